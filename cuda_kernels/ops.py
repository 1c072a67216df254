"""Level 5: hand-written CUDA kernels and their C++ CPU twins, registered as ``torch.ops.cuda_kernels``.

    swish(x, beta)                            -> y  (cuda_kernels/swish.cu,      swish_cpu.cpp)
    layer_norm(x2d, weight, bias, eps)        -> y  (cuda_kernels/layer_norm.cu, layer_norm_cpu.cpp)
    softmax(x2d)                              -> y  (cuda_kernels/softmax.cu,    softmax_cpu.cpp)
    attention(q, k, v, causal, window, scale) -> o  (cuda_kernels/attention_forward.cu and
                                                     attention_backward.cu,   attention_cpu.cpp)
    linear(x2d, weight, bias)                 -> y  (cuBLAS through ATen; the bias gradient in
                                                     cuda_kernels/feed_forward.cu, feed_forward_cpu.cpp)
    feed_forward(x2d, fc_weight, fc_bias,
                 proj_weight, proj_bias)      -> y  (cuBLAS through ATen around cuda_kernels/feed_forward.cu,
                                                     feed_forward_cpu.cpp)

Importing this module compiles the extension the first time (``torch.utils.cpp_extension.load``:
ninja, then cached in PyTorch's extensions folder, so later imports only load it) and registers, for
each op (``swish_forward``, ``swish_backward``, ``layer_norm_forward``, ``layer_norm_backward``,
``softmax_forward``, ``softmax_backward``, ``attention_forward``, ``attention_backward``,
``linear_forward``, ``linear_backward``, ``feed_forward_forward``, ``feed_forward_backward``) a fake
(shape-only) implementation for torch.compile and, for the forward ops, an autograd formula that
calls the backward op. The schemas and the CPU/CUDA kernels themselves
are registered in C++ (``ops.cpp``).

The CUDA sources are compiled only when this PyTorch was built with CUDA, a GPU is visible and nvcc
is found; otherwise the extension holds the CPU kernels alone, and CUDA tensors get a
``LevelUnavailableError`` that says why.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .limits import LevelUnavailableError

_HERE = Path(__file__).resolve().parent
_CPU_SOURCES = ("ops.cpp", "swish_cpu.cpp", "layer_norm_cpu.cpp", "softmax_cpu.cpp", "attention_cpu.cpp",
                "feed_forward_cpu.cpp")
_CUDA_SOURCES = ("swish.cu", "layer_norm.cu", "softmax.cu", "attention_forward.cu", "attention_backward.cu",
                 "feed_forward.cu")
_HEADERS = ("kernels.h", "common.cuh", "cpu_common.h", "attention_mask.h", "tensor_core.cuh", "attention_simt.cuh")

# -O3 for vectorisation; -march=native because the extension is always built on the machine that runs
# it (PyTorch's cache lives in the user's home); -fno-math-errno and -fno-trapping-math tell gcc that
# math functions need not set errno and FP operations never trap, which it needs before it turns
# branches like a clamp into vector min/max (see swish_cpu.cpp). -ffp-contract=off: gcc would otherwise
# fuse a*b - c into one FMA wherever it likes, so a product summed in one loop and subtracted in the
# next would differ by a rounding (LayerNorm's dx with N = 1 must be exactly 0, and would not be).
# No -ffast-math: the exp in swish_cpu.cpp relies on IEEE rounding.
_CXX_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
# No --use_fast_math: it would also flush float32 denormals to zero and make every float32 division and
# sqrt approximate. The kernels call the fast intrinsics (__expf, __fdividef) by name, where they are
# accurate enough (swish.cu says why).
# The target architecture comes from PyTorch (TORCH_CUDA_ARCH_LIST, else the visible GPUs).
_NVCC_FLAGS = ["-O3", "-std=c++17"]
_LINK_FLAGS = ["-fopenmp"]


def _why_no_cuda() -> str | None:
    """None if the CUDA sources can be built and run here, else the reason they are left out."""
    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return (f"nvcc was not found: install the CUDA toolkit {torch.version.cuda} (the version this PyTorch "
                f"was built with) and set CUDA_HOME")
    return None


def _build() -> str | None:
    """Compile (if needed) and load the extension; return why CUDA was left out, or None."""
    from torch.utils import cpp_extension

    why_no_cuda = _why_no_cuda()
    name = "kernel_ladder_ext_cpu" if why_no_cuda else "kernel_ladder_ext_cuda"
    sources = [_HERE / s for s in _CPU_SOURCES + (() if why_no_cuda else _CUDA_SOURCES)]
    try:
        cpp_extension.verify_ninja_availability()
        # PyTorch's own cache folder for `name` (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/...).
        library = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
        newest_source = max(f.stat().st_mtime for f in sources + [_HERE / h for h in _HEADERS])
        if not library.exists() or library.stat().st_mtime < newest_source:
            what = "C++ CPU kernels only: " + why_no_cuda if why_no_cuda else "C++ CPU and CUDA kernels"
            print(f"cuda_kernels: compiling the level-5 extension {name} ({what}); once, about a minute...",
                  file=sys.stderr, flush=True)
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=_CXX_FLAGS + ([] if why_no_cuda else ["-DKERNEL_LADDER_WITH_CUDA"]),
            extra_cuda_cflags=_NVCC_FLAGS,
            extra_ldflags=_LINK_FLAGS,
            with_cuda=why_no_cuda is None,
            is_python_module=False,  # the library registers torch.ops.cuda_kernels; no Python module inside
            verbose=False,
        )
    except (RuntimeError, OSError) as error:
        raise LevelUnavailableError(
            "level 5 could not build its C++/CUDA extension. It needs ninja (`pip install ninja`), a C++17 "
            "compiler with OpenMP (g++ >= 9)" + ("" if why_no_cuda else " and nvcc") + f". Build error: {error}"
        ) from error
    return why_no_cuda


_WHY_NO_CUDA = _build()


def _require_kernels_for(x: torch.Tensor) -> None:
    if x.is_cuda and _WHY_NO_CUDA is not None:
        raise LevelUnavailableError(
            f"cuda_kernels got a CUDA tensor, but the extension was built without its CUDA kernels: "
            f"{_WHY_NO_CUDA}. Install a CUDA build of PyTorch and the matching CUDA toolkit (nvcc)")


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """mean and rstd are kept in the kernels' accumulator type: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _register(op_name: str, fake, backward=None, setup_context=None) -> None:
    """Register the fake (shape-only) implementation and, for a differentiable op, its autograd formula."""
    qualified_name = f"cuda_kernels::{op_name}"
    torch.library.register_fake(qualified_name, fake)
    if backward is not None:
        torch.library.register_autograd(qualified_name, backward, setup_context=setup_context)


def _check_contiguous(op: str, *tensors: torch.Tensor) -> None:
    for tensor in tensors:
        torch._check(tensor.is_contiguous(), lambda: f"cuda_kernels::{op} needs contiguous tensors (call .contiguous() first)")


def _check_rows(op: str, x: torch.Tensor, **columns: torch.Tensor) -> None:
    """x is a (rows, N) matrix with N >= 1; each of ``columns`` is an N-vector."""
    torch._check(x.dim() == 2, lambda: f"cuda_kernels::{op}: x must be a (rows, N) matrix, got shape {tuple(x.shape)}")
    torch._check(x.shape[1] >= 1, lambda: f"cuda_kernels::{op}: rows of 0 elements have no mean")
    for name, tensor in columns.items():
        torch._check(tensor.shape == x.shape[1:],
                     lambda: f"cuda_kernels::{op}: {name} has shape {tuple(tensor.shape)}, expected ({x.shape[1]},)")
    _check_contiguous(op, x, *columns.values())


# --- swish: y = x * sigmoid(beta * x) --------------------------------------------------------------


def _swish_forward_fake(x, beta):
    _check_contiguous("swish_forward", x)
    return torch.empty_like(x)


def _swish_forward_setup_context(ctx, inputs, output):
    x, beta = inputs
    ctx.save_for_backward(x)  # x only: the backward recomputes sigmoid(beta * x)
    ctx.beta = beta


def _swish_forward_backward(ctx, grad_out):
    (x,) = ctx.saved_tensors
    # Autograd may hand us a broadcast (stride-0) gradient, e.g. from y.sum().backward().
    return torch.ops.cuda_kernels.swish_backward(grad_out.contiguous(), x, ctx.beta), None


def _swish_backward_fake(grad_out, x, beta):
    torch._check(grad_out.shape == x.shape, lambda: "cuda_kernels::swish_backward: grad_out and x differ in shape")
    _check_contiguous("swish_backward", grad_out, x)
    return torch.empty_like(x)


# --- layer_norm over the rows of a (rows, N) matrix --------------------------------------------------


def _layer_norm_forward_fake(x, weight, bias, eps):
    _check_rows("layer_norm_forward", x, weight=weight, bias=bias)
    mean = x.new_empty(x.shape[0], dtype=_statistics_dtype(x.dtype))
    return torch.empty_like(x), mean, torch.empty_like(mean)


def _layer_norm_forward_setup_context(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)  # the bias enters no gradient


def _layer_norm_forward_backward(ctx, grad_out, grad_mean, grad_rstd):
    # mean and rstd are outputs only so that they can be saved for this backward: their gradients are ignored.
    needs_x, needs_weight, needs_bias, _ = ctx.needs_input_grad
    x, weight, mean, rstd = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = torch.ops.cuda_kernels.layer_norm_backward(grad_out.contiguous(), x, weight, mean, rstd)
    return (grad_x if needs_x else None, grad_weight if needs_weight else None,
            grad_bias if needs_bias else None, None)


def _layer_norm_backward_fake(grad_out, x, weight, mean, rstd):
    _check_rows("layer_norm_backward", x, weight=weight)
    torch._check(grad_out.shape == x.shape, lambda: "cuda_kernels::layer_norm_backward: grad_out and x differ in shape")
    _check_contiguous("layer_norm_backward", grad_out, mean, rstd)
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


# --- softmax over the rows of a (rows, N) matrix -----------------------------------------------------


def _softmax_forward_fake(x):
    torch._check(x.dim() == 2, lambda: f"cuda_kernels::softmax_forward: x must be a (rows, N) matrix, got shape {tuple(x.shape)}")
    _check_contiguous("softmax_forward", x)
    return torch.empty_like(x)


def _softmax_forward_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)  # y, not x: dx = y * (dy - sum(dy * y)) needs nothing else


def _softmax_forward_backward(ctx, grad_out):
    (y,) = ctx.saved_tensors
    return torch.ops.cuda_kernels.softmax_backward(grad_out.contiguous(), y)


def _softmax_backward_fake(grad_out, y):
    torch._check(y.dim() == 2, lambda: f"cuda_kernels::softmax_backward: y must be a (rows, N) matrix, got shape {tuple(y.shape)}")
    torch._check(grad_out.shape == y.shape, lambda: "cuda_kernels::softmax_backward: grad_out and y differ in shape")
    _check_contiguous("softmax_backward", grad_out, y)
    return torch.empty_like(y)


# --- attention: o = softmax(q k^T * scale + mask) v over (B, H, L, D) tensors ---------------------------


def _check_attention(op: str, q, k, v, causal, **like_q: torch.Tensor) -> None:
    torch._check(q.dim() == 4 and k.dim() == 4 and k.shape == v.shape and q.shape[:2] == k.shape[:2]
                 and q.shape[3] == k.shape[3],
                 lambda: f"cuda_kernels::{op}: expected q (B, H, Lq, D) and k, v (B, H, Lk, D), got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    torch._check(not causal or q.shape[2] <= k.shape[2],
                 lambda: f"cuda_kernels::{op}: causal attention with {q.shape[2]} queries but only {k.shape[2]} keys")
    for name, tensor in like_q.items():
        torch._check(tensor.shape == q.shape, lambda: f"cuda_kernels::{op}: {name} and q differ in shape")
    _check_contiguous(op, q, k, v, *like_q.values())


def _attention_forward_fake(q, k, v, causal, window, scale):
    _check_attention("attention_forward", q, k, v, causal)
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_statistics_dtype(q.dtype))


def _attention_forward_setup_context(ctx, inputs, output):
    q, k, v, causal, window, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # lse, not the probabilities: the backward recomputes them
    ctx.mask_and_scale = (causal, window, scale)


def _attention_forward_backward(ctx, grad_out, grad_lse):
    # lse is an output only so that it can be saved for this backward: its gradient is ignored.
    needs_q, needs_k, needs_v = ctx.needs_input_grad[:3]
    q, k, v, out, lse = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.cuda_kernels.attention_backward(grad_out.contiguous(), q, k, v, out, lse,
                                                                       *ctx.mask_and_scale)
    return (grad_q if needs_q else None, grad_k if needs_k else None, grad_v if needs_v else None, None, None, None)


def _attention_backward_fake(grad_out, q, k, v, out, lse, causal, window, scale):
    _check_attention("attention_backward", q, k, v, causal, grad_out=grad_out, out=out)
    torch._check(lse.shape == q.shape[:3], lambda: "cuda_kernels::attention_backward: lse must be (B, H, Lq)")
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# --- linear: y = x weight^T + bias, and GPT-2's feed-forward block, around cuBLAS matmuls --------------


def _check_linear(op: str, x: torch.Tensor, weight: torch.Tensor, weight_name: str = "weight") -> None:
    """x is a (rows, K) matrix and ``weight`` an (N, K) nn.Linear weight."""
    torch._check(x.dim() == 2, lambda: f"cuda_kernels::{op}: x must be a (rows, features) matrix, got shape {tuple(x.shape)}")
    torch._check(weight.dim() == 2, lambda: f"cuda_kernels::{op}: {weight_name} must be an (out_features, in_features) "
                                            f"matrix, got shape {tuple(weight.shape)}")
    torch._check(weight.shape[1] == x.shape[1],
                 lambda: f"cuda_kernels::{op}: x has {x.shape[1]} features but {weight_name} expects {weight.shape[1]}")


def _check_bias(op: str, name: str, bias: torch.Tensor | None, features: int) -> None:
    torch._check(bias is None or bias.shape == (features,),
                 lambda: f"cuda_kernels::{op}: {name} has shape {tuple(bias.shape)}, expected ({features},)")


def _linear_forward_fake(x, weight, bias):
    _check_linear("linear_forward", x, weight)
    _check_bias("linear_forward", "bias", bias, weight.shape[0])
    _check_contiguous("linear_forward", x, weight, *([] if bias is None else [bias]))
    return x.new_empty(x.shape[0], weight.shape[0])


def _linear_forward_setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight)  # the bias enters no gradient


def _linear_forward_backward(ctx, grad_out):
    grads = torch.ops.cuda_kernels.linear_backward(grad_out.contiguous(), *ctx.saved_tensors)
    return tuple(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad))


def _linear_backward_fake(grad_out, x, weight):
    _check_linear("linear_backward", x, weight)
    torch._check(grad_out.shape == (x.shape[0], weight.shape[0]),
                 lambda: f"cuda_kernels::linear_backward: grad_out has shape {tuple(grad_out.shape)}, expected "
                         f"({x.shape[0]}, {weight.shape[0]})")
    _check_contiguous("linear_backward", grad_out, x, weight)
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(weight.shape[0])


def _check_feed_forward(op: str, x, fc_weight, proj_weight) -> None:
    """x (rows, C), fc_weight (H, C), proj_weight (C, H): the H hidden features come back to C."""
    _check_linear(op, x, fc_weight, "fc_weight")
    torch._check(proj_weight.shape == (x.shape[1], fc_weight.shape[0]),
                 lambda: f"cuda_kernels::{op}: proj_weight has shape {tuple(proj_weight.shape)}, expected "
                         f"({x.shape[1]}, {fc_weight.shape[0]})")


def _check_feed_forward_arguments(op: str, x, fc_weight, fc_bias, proj_weight, proj_bias) -> None:
    _check_feed_forward(op, x, fc_weight, proj_weight)
    torch._check((fc_bias is None) == (proj_bias is None),
                 lambda: f"cuda_kernels::{op}: give both biases or neither (fc_bias is "
                         f"{'None' if fc_bias is None else 'given'}, proj_bias is {'None' if proj_bias is None else 'given'})")
    _check_bias(op, "fc_bias", fc_bias, fc_weight.shape[0])
    _check_bias(op, "proj_bias", proj_bias, x.shape[1])


def _feed_forward_forward_fake(x, fc_weight, fc_bias, proj_weight, proj_bias):
    op = "feed_forward_forward"
    _check_feed_forward_arguments(op, x, fc_weight, fc_bias, proj_weight, proj_bias)
    _check_contiguous(op, x, fc_weight, proj_weight, *(b for b in (fc_bias, proj_bias) if b is not None))
    pre_activation = x.new_empty(x.shape[0], fc_weight.shape[0])
    return torch.empty_like(x), pre_activation, torch.empty_like(pre_activation)


def _feed_forward_forward_setup_context(ctx, inputs, output):
    x, fc_weight, _, proj_weight, _ = inputs
    _, pre_activation, activation = output
    # h for GELU's derivative, a for the gradient of W_proj; the biases enter no gradient.
    ctx.save_for_backward(x, fc_weight, proj_weight, pre_activation, activation)


def _feed_forward_forward_backward(ctx, grad_out, grad_pre_activation, grad_activation):
    # pre_activation and activation are outputs only so that they can be saved for this backward: their
    # gradients are ignored.
    grads = torch.ops.cuda_kernels.feed_forward_backward(grad_out.contiguous(), *ctx.saved_tensors)
    return tuple(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad))


def _feed_forward_backward_fake(grad_out, x, fc_weight, proj_weight, pre_activation, activation):
    op = "feed_forward_backward"
    _check_feed_forward(op, x, fc_weight, proj_weight)
    hidden_shape = (x.shape[0], fc_weight.shape[0])
    torch._check(grad_out.shape == x.shape, lambda: f"cuda_kernels::{op}: grad_out and x differ in shape")
    torch._check(pre_activation.shape == hidden_shape and activation.shape == hidden_shape,
                 lambda: f"cuda_kernels::{op}: pre_activation and activation must be {hidden_shape}")
    _check_contiguous(op, grad_out, x, fc_weight, proj_weight, pre_activation, activation)
    return (torch.empty_like(x), torch.empty_like(fc_weight), fc_weight.new_empty(fc_weight.shape[0]),
            torch.empty_like(proj_weight), proj_weight.new_empty(proj_weight.shape[0]))


_register("swish_forward", _swish_forward_fake, _swish_forward_backward, _swish_forward_setup_context)
_register("swish_backward", _swish_backward_fake)
_register("layer_norm_forward", _layer_norm_forward_fake, _layer_norm_forward_backward, _layer_norm_forward_setup_context)
_register("layer_norm_backward", _layer_norm_backward_fake)
_register("softmax_forward", _softmax_forward_fake, _softmax_forward_backward, _softmax_forward_setup_context)
_register("softmax_backward", _softmax_backward_fake)
_register("attention_forward", _attention_forward_fake, _attention_forward_backward, _attention_forward_setup_context)
_register("attention_backward", _attention_backward_fake)
_register("linear_forward", _linear_forward_fake, _linear_forward_backward, _linear_forward_setup_context)
_register("linear_backward", _linear_backward_fake)
_register("feed_forward_forward", _feed_forward_forward_fake, _feed_forward_forward_backward,
          _feed_forward_forward_setup_context)
_register("feed_forward_backward", _feed_forward_backward_fake)


# --- what the levels call ------------------------------------------------------------------------------


def swish(x: torch.Tensor, beta: float) -> torch.Tensor:
    """y = x * sigmoid(beta * x) by our kernels, differentiable (the backward is ``swish_backward``)."""
    _require_kernels_for(x)
    return torch.ops.cuda_kernels.swish_forward(x, float(beta))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm of each row of the (rows, N) matrix ``x`` by our kernels, differentiable; returns only
    the output (the saved mean and rstd stay inside the autograd graph)."""
    _require_kernels_for(x)
    return torch.ops.cuda_kernels.layer_norm_forward(x, weight, bias, float(eps))[0]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax of each row of the (rows, N) matrix ``x`` by our kernels, differentiable."""
    _require_kernels_for(x)
    return torch.ops.cuda_kernels.softmax_forward(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
              scale: float) -> torch.Tensor:
    """Flash attention of q (B, H, Lq, D) over k, v (B, H, Lk, D) by our kernels, differentiable
    (``window`` 0: none); returns only the output (the saved lse stays inside the autograd graph)."""
    _require_kernels_for(q)
    return torch.ops.cuda_kernels.attention_forward(q, k, v, bool(causal), int(window), float(scale))[0]


def _contiguous_or_none(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) of x (rows, K) and an nn.Linear weight (N, K), differentiable: the matmuls are
    cuBLAS's through ATen (bias in its epilogue), the bias gradient our column-sum kernel."""
    _require_kernels_for(x)
    # The shape checks run here too, before the op is dispatched: on an H100 machine (torch 2.11, CUDA 13)
    # a width mismatch rejected by the C++ op's TORCH_CHECK for CUDA tensors ended the process with a
    # segmentation fault instead of raising, while the same check on CPU tensors raised (not yet understood).
    _check_linear("linear_forward", x, weight)
    _check_bias("linear_forward", "bias", bias, weight.shape[0])
    return torch.ops.cuda_kernels.linear_forward(x.contiguous(), weight.contiguous(), _contiguous_or_none(bias))


def feed_forward(x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: torch.Tensor | None, proj_weight: torch.Tensor,
                 proj_bias: torch.Tensor | None) -> torch.Tensor:
    """GPT-2's MLP, gelu_tanh(x fc_weight^T + fc_bias) proj_weight^T + proj_bias, of x (rows, C), differentiable:
    cuBLAS matmuls around our GELU kernel and our fused GELU-backward + bias-gradient kernel. Both biases
    or neither. Returns only the output (the saved pre-activation and activation stay inside the
    autograd graph)."""
    _require_kernels_for(x)
    _check_feed_forward_arguments("feed_forward_forward", x, fc_weight, fc_bias, proj_weight, proj_bias)  # see linear
    return torch.ops.cuda_kernels.feed_forward_forward(x.contiguous(), fc_weight.contiguous(), _contiguous_or_none(fc_bias),
                                                       proj_weight.contiguous(), _contiguous_or_none(proj_bias))[0]


__all__ = ["attention", "feed_forward", "layer_norm", "linear", "softmax", "swish"]
