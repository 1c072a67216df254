"""Level 5: hand-written CUDA kernels and their C++ CPU twins, registered as ``torch.ops.cuda_kernels``.

    swish(x, beta)                            -> y  (swish.cu,      swish_cpu.cpp,      swish_ops.cpp)
    layer_norm(x, weight, bias, eps)          -> y  (layer_norm.cu, layer_norm_cpu.cpp, layer_norm_ops.cpp)
    rms_norm(x, weight, eps)                  -> y  (the same three files: LayerNorm's kernels and
                                                     wrappers without the mean and the bias)
    softmax(x)                                -> y  (softmax.cu,    softmax_cpu.cpp,    softmax_ops.cpp)
    attention(q, k, v, causal, window, scale) -> o  (attention_forward.cu, attention_backward.cu,
                                                     attention_cpu.cpp, attention_ops.cpp; on a Hopper
                                                     GPU attention_forward_hopper.cu and
                                                     attention_backward_hopper.cu, unless inside
                                                     ``portable_attention()``)
    decode_attention(q, k_new, v_new,         -> o  (attention_decode.cu, attention_cpu.cpp, attention_ops.cpp:
                     k_cache, v_cache,               one new token per sequence appended to a static KV
                     key_lengths, window, scale)     cache and attended)
    linear(x2d, weight, bias)                 -> y  (cuBLAS through ATen; the bias gradient in
                                                     feed_forward.cu, feed_forward_cpu.cpp, feed_forward_ops.cpp)
    feed_forward(x2d, fc_weight, fc_bias,
                 proj_weight, proj_bias)      -> y  (cuBLAS through ATen around feed_forward.cu,
                                                     feed_forward_cpu.cpp, feed_forward_ops.cpp)
    linear_cross_entropy(hidden, weight,
                         targets, ignore_index) -> loss  (cuBLAS through ATen around linear_cross_entropy.cu,
                                                     linear_cross_entropy_cpu.cpp, linear_cross_entropy_ops.cpp)
    adamw_step(params, grads, exp_avgs,
               exp_avg_sqs, lr, beta1, beta2,
               eps, weight_decay, step)       -> None, in place  (adamw.cu, adamw_cpu.cpp, adamw_ops.cpp)

Importing this module compiles the extension the first time (``torch.utils.cpp_extension.load``:
ninja, then cached in PyTorch's extensions folder, so later imports only load it; a build is announced
on stderr). Everything an op needs is registered in C++, by each component's ``*_ops.cpp``: its
schemas, its CPU, CUDA and Meta (shape-only, for torch.compile) kernels, and its autograd formula, so
a forward and backward never come back to Python. The functions below only call the ops and return
the output the user sees (the forward ops also return what their backward saves).

The CUDA sources are compiled only when this PyTorch was built with CUDA, a GPU is visible and nvcc
is found; otherwise the extension holds the CPU kernels alone, and CUDA tensors get a
``LevelUnavailableError`` that says why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from .limits import LevelUnavailableError

_HERE = Path(__file__).resolve().parent
# Every component's sources, found by suffix: *.cpp (CPU twins and *_ops.cpp bindings), *.cu (CUDA).
_CPU_SOURCES = tuple(sorted(_HERE.glob("*.cpp")))
_CUDA_SOURCES = tuple(sorted(_HERE.glob("*.cu")))

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
# The target architectures come from PyTorch (TORCH_CUDA_ARCH_LIST, else the visible GPUs), except on a
# Hopper GPU: see _cuda_arch_flags.
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


def _cuda_arch_flags() -> list[str]:
    """nvcc's target flags: ``-gencode=arch=compute_90a,code=sm_90a -DKERNEL_LADDER_SM90A`` for a visible
    Hopper GPU (compute capability 9.0), so that attention_forward_hopper.cu gets its wgmma/TMA kernel,
    and one ``-gencode`` for each other visible GPU.

    wgmma, setmaxnreg and the TMA instructions exist only in the "arch-specific" sm_90a target, which
    PyTorch chooses only when TORCH_CUDA_ARCH_LIST says "9.0a". Once any flag of ours names an arch,
    cpp_extension adds none of its own, so every visible GPU's arch is listed here. (The ``-gencode``
    form, not ``-arch=sm_90a``: with nvcc 13.0 the shorthand also ran a plain sm_90 pass that rejects
    wgmma.) A TORCH_CUDA_ARCH_LIST set by the user is left in charge; the define follows its "9.0a".
    Empty when no visible GPU is a Hopper: PyTorch's own choice stands."""
    requested = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if requested:
        return ["-DKERNEL_LADDER_SM90A"] if "9.0a" in requested else []
    capabilities = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    if (9, 0) not in capabilities:
        return []
    flags = ["-DKERNEL_LADDER_SM90A"]
    for major, minor in capabilities:
        arch = f"{major}{minor}a" if (major, minor) == (9, 0) else f"{major}{minor}"
        flags.append(f"-gencode=arch=compute_{arch},code=sm_{arch}")
    return flags


def _cxx_compiler_for_the_extension() -> tuple[str, str | None]:
    """The C++ compiler to build the extension with, and why it is not $CXX (None if it is).

    PyTorch links the extension with $CXX (default ``c++``), and the extension must use the shared C++
    runtime (libstdc++.so or libc++), the one PyTorch itself loaded. A toolchain that links libstdc++
    statically (say, a wrapper whose library folders hold libstdc++.a but no libstdc++.so, so the
    linker takes the archive) leaves the extension with runtime code of its own whose iostreams were
    never initialised: the first error message that formats a number (every TORCH_CHECK with a shape
    in it) then crashes the process instead of raising. Seen on this project's H100 machine, whose
    CXX is such a wrapper. So a $CXX other than the default is tried on a two-line library first, and
    ``c++`` from PATH is used when it fails."""
    requested = os.environ.get("CXX")
    if requested is None or _links_the_shared_cxx_runtime(requested):
        return requested or "c++", None
    fallback = shutil.which("c++") or shutil.which("g++")
    if fallback is None or not _links_the_shared_cxx_runtime(fallback):
        raise LevelUnavailableError(
            f"CXX={requested} links no shared C++ runtime into a shared library, and no c++ on PATH does: the "
            "extension would crash on its first error message. Set CXX to a compiler that links libstdc++.so")
    return fallback, (f"CXX={requested} links no shared C++ runtime into a shared library (the extension would "
                      f"crash on its first error message); building with {fallback}")


def _links_the_shared_cxx_runtime(compiler: str) -> bool:
    """Build a library that formats a number, as TORCH_CHECK does, and look for the shared runtime among
    what it needs (the dynamic section names it; a static copy leaves no such name)."""
    with tempfile.TemporaryDirectory() as folder:
        source, library = Path(folder) / "probe.cpp", Path(folder) / "probe.so"
        source.write_text("#include <sstream>\n#include <string>\n"
                          "std::string format(long n) { std::ostringstream s; s << n; return s.str(); }\n")
        try:
            built = subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(library)],
                                   capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            built = False
        if not built:
            return True  # not a compiler that builds this: PyTorch's build will say what is wrong with it
        contents = library.read_bytes()
        return b"libstdc++.so" in contents or b"libc++.so" in contents or b"libc++.1.dylib" in contents


def _say(message: str) -> None:
    print(f"cuda_kernels: {message}", file=sys.stderr, flush=True)


def _build() -> str | None:
    """Compile (if needed) and load the extension; return why CUDA was left out, or None.

    Whether ``load`` compiles is its own decision (sources, flags, PyTorch version, the checkout's path
    all count), so rather than guess it beforehand we watch the call: a load from the cache takes a
    fraction of a second, so one still running after a second is compiling, and says so then."""
    from torch.utils import cpp_extension

    why_no_cuda = _why_no_cuda()
    name = "kernel_ladder_ext_cpu" if why_no_cuda else "kernel_ladder_ext_cuda"
    what = "C++ CPU kernels only: " + why_no_cuda if why_no_cuda else "C++ CPU and CUDA kernels"
    announcement = threading.Timer(1.0, _say, [f"compiling the level-5 extension {name} ({what}); about a minute..."])
    announcement.daemon = True
    started = time.perf_counter()
    announcement.start()
    compiler, why_not_cxx = _cxx_compiler_for_the_extension()
    if why_not_cxx:
        _say(why_not_cxx)
    requested_cxx = os.environ.get("CXX")
    os.environ["CXX"] = compiler  # what cpp_extension compiles and links with; restored below
    try:
        cpp_extension.verify_ninja_availability()
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in _CPU_SOURCES + (() if why_no_cuda else _CUDA_SOURCES)],
            extra_cflags=_CXX_FLAGS + ([] if why_no_cuda else ["-DKERNEL_LADDER_WITH_CUDA"]),
            extra_cuda_cflags=_NVCC_FLAGS + ([] if why_no_cuda else _cuda_arch_flags()),
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
    finally:
        announcement.cancel()
        if requested_cxx is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = requested_cxx
    seconds = time.perf_counter() - started
    if seconds > 1.0:
        _say(f"{name} built and loaded in {seconds:.0f} s")
    return why_no_cuda


def _refuse_cuda_tensors(why_no_cuda: str) -> torch.library.Library:
    """A GPU is visible but the extension has no CUDA kernels (no nvcc): give every op a CUDA kernel that
    raises ``LevelUnavailableError`` saying why, instead of the dispatcher's "could not run ... with
    arguments from the 'CUDA' backend". It costs the CPU path nothing."""
    def refuse(*args, **kwargs):
        raise LevelUnavailableError(
            f"cuda_kernels got a CUDA tensor, but the extension was built without its CUDA kernels: "
            f"{why_no_cuda}. Install a CUDA build of PyTorch and the matching CUDA toolkit (nvcc)")

    library = torch.library.Library("cuda_kernels", "IMPL")
    for qualified_name in torch._C._dispatch_get_registrations_for_dispatch_key("CPU"):
        if qualified_name.startswith("cuda_kernels::"):
            library.impl(qualified_name.removeprefix("cuda_kernels::"), refuse, "CUDA")
    return library


_WHY_NO_CUDA = _build()
if _WHY_NO_CUDA is not None and torch.cuda.is_available():
    _CUDA_REFUSAL = _refuse_cuda_tensors(_WHY_NO_CUDA)  # kept: the registrations live as long as the library


# --- what the levels call ------------------------------------------------------------------------------
# The op handles are looked up once, here; each call goes straight to the dispatcher, whose C++ does the
# checks (ValueError for shapes, TypeError for dtypes), the autograd and the launch.

_ops = torch.ops.cuda_kernels
_swish_forward = _ops.swish_forward.default
_layer_norm_forward = _ops.layer_norm_forward.default
_rms_norm_forward = _ops.rms_norm_forward.default
_softmax_forward = _ops.softmax_forward.default
_attention_forward = _ops.attention_forward.default
_decode_attention = _ops.decode_attention.default
_use_hopper_attention = _ops.use_hopper_attention.default
_linear_forward = _ops.linear_forward.default
_feed_forward_forward = _ops.feed_forward_forward.default
_linear_cross_entropy_forward = _ops.linear_cross_entropy_forward.default
_adamw_step = _ops.adamw_step.default


def swish(x: torch.Tensor, beta: float) -> torch.Tensor:
    """y = x * sigmoid(beta * x) by our kernels, differentiable (the backward is ``swish_backward``)."""
    return _swish_forward(x, beta)


def swish_version(x: torch.Tensor, beta: float, version: int) -> torch.Tensor:
    """y = x * sigmoid(beta * x) by ``version`` of ``limits.SWISH_VERSIONS``: forward only, CUDA tensors only."""
    return _ops.swish_forward_version.default(x, beta, version)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` (..., N) by our kernels, differentiable; returns only
    the output (the saved mean and rstd stay inside the autograd graph)."""
    return _layer_norm_forward(x, weight, bias, eps)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (..., N) by our kernels, differentiable; returns only the
    output (the saved rstd stays inside the autograd graph)."""
    return _rms_norm_forward(x, weight, eps)[0]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim of ``x`` (..., N) by our kernels, differentiable."""
    return _softmax_forward(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
              scale: float) -> torch.Tensor:
    """Flash attention of q (B, H, Lq, D) over k, v (B, Hkv, Lk, D), H a multiple of Hkv (grouped-query
    attention), D a multiple of 8 up to 256, by our kernels, differentiable (``window`` 0: none); returns
    only the output (the saved lse stays inside the autograd graph)."""
    return _attention_forward(q, k, v, causal, window, scale)[0]


@contextlib.contextmanager
def portable_attention():
    """Inside this block, level 5's attention forward and backward run their portable mma.sync kernels also
    on a Hopper GPU, whose defaults are the wgmma/TMA kernels (attention_forward_hopper.cu,
    attention_backward_hopper.cu), so that one process can time or check both. The switch is process-wide
    (every thread, every stream); the previous setting comes back on exit. Elsewhere there is only one kernel, and this changes nothing."""
    previous = _use_hopper_attention(False)
    try:
        yield
    finally:
        _use_hopper_attention(previous)


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, key_lengths: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """One new token per sequence, q (B, H, 1, D), k_new, v_new (B, Hkv, 1, D): its key and value written at
    position ``key_lengths[b] - 1`` (an int32 device tensor) of static caches (B, Hkv, capacity, D), its query
    attended over the first ``key_lengths[b]`` positions: the decode step a CUDA graph replays.
    Inference only."""
    return _decode_attention(q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T (+ bias) of x (..., K) and an nn.Linear weight (N, K), differentiable: the matmuls are
    cuBLAS's through ATen (bias in its epilogue), the bias gradient our column-sum kernel."""
    return _linear_forward(x, weight, bias)


def feed_forward(x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: torch.Tensor | None, proj_weight: torch.Tensor,
                 proj_bias: torch.Tensor | None) -> torch.Tensor:
    """GPT-2's MLP, gelu_tanh(x fc_weight^T + fc_bias) proj_weight^T + proj_bias, of x (..., C), differentiable:
    cuBLAS matmuls around our GELU kernel and our fused GELU-backward + bias-gradient kernel. Both biases
    or neither. Returns only the output (the saved pre-activation and activation stay inside the
    autograd graph)."""
    return _feed_forward_forward(x, fc_weight, fc_bias, proj_weight, proj_bias)[0]


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                         chunk_rows: int = 0) -> torch.Tensor:
    """The mean cross-entropy of the logits hidden @ weight^T, hidden (T, C) and weight (V, C), against
    int64 targets (T,), over the tokens whose target is not ``ignore_index``; differentiable in hidden and
    weight. The (T, V) logits are never whole in memory: ``chunk_rows`` tokens at a time (0 chooses equal
    chunks of at most 2^28 logits). The gradients are made in the forward and kept in the autograd graph. The loss
    is a 0-dim float32 tensor (float64 for float64 inputs); with no valid token it is 0, and the
    gradients are zeros."""
    return _linear_cross_entropy_forward(hidden, weight, targets, ignore_index, False, chunk_rows)[0]


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step: int) -> None:
    """One torch.optim.AdamW step (amsgrad and maximize off) over every tensor, in place: params,
    exp_avgs and exp_avg_sqs are updated; ``step`` is the 1-based count, this step included. Call it
    under ``torch.no_grad()``, as torch.optim does. All tensors contiguous and on one device, each
    state tensor shaped and typed as its parameter."""
    if not (params or grads or exp_avgs or exp_avg_sqs):
        return  # no tensor for the dispatcher to choose a kernel by, and nothing to update
    _adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step)


__all__ = ["adamw_step", "attention", "decode_attention", "feed_forward", "layer_norm", "linear",
           "linear_cross_entropy", "portable_attention", "rms_norm", "softmax", "swish", "swish_version"]
