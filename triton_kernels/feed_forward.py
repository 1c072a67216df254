"""Linear layers and GPT-2's feed-forward block in Triton, as ``triton_kernels`` ops: matmuls whose
epilogues do the elementwise work.

What it computes
    linear         y = x·Wᵀ + b                           one matmul, the bias added in its epilogue
                   grad_x = grad_y·W,   grad_W = grad_yᵀ·x,   grad_b = Σ_rows grad_y
    feed_forward   h = x·W_fcᵀ + b_fc,  a = gelu_tanh(h)   one matmul, bias and GELU in its epilogue
                   y = a·W_projᵀ + b_proj                  one matmul, bias in its epilogue
                   grad_h = (grad_y·W_proj) ∘ gelu_tanh'(h)  one matmul, gelu' in its epilogue
                   grad_W_proj = grad_yᵀ·a,   grad_b_proj = Σ_rows grad_y
                   grad_W_fc = grad_hᵀ·x,     grad_b_fc = Σ_rows grad_h,   grad_x = grad_h·W_fc
    Every transpose (Wᵀ, grad_yᵀ, grad_hᵀ) is a strided view that the matmul kernel reads in place
    (matmul.py). The bias gradients are summed by the weight gradients' matmuls, which read grad_y and
    grad_h along their K anyway (matmul.py's ``row_sums``). h and a are saved for the backward.
    The feed-forward's weights may also come as the transpose of a contiguous matrix: GPT-2's Conv1D in
    Hugging Face stores (in, out), and levels.huggingface passes it as a view. Their gradients are then
    made in that layout, grad_Wᵀ = xᵀ·grad_h, so autograd accumulates them into the (in, out) parameter
    without a copy.

The one idea: epilogue fusion
    The hidden activation is the biggest tensor of the block: (tokens, 4·C), 8192 × 3072 in bfloat16
    at GPT-2-small size, 50 MB. Unfused, every elementwise step sends it through DRAM once more:
        forward    matmul writes h; GELU reads h, writes a                        150 MB
        backward   matmul writes grad_a; gelu' reads grad_a and h, writes grad_h  200 MB
    Fused, each elementwise step runs on the matmul's output tile while it is still in registers:
        forward    the epilogue writes h and a (h only because the backward needs it)   100 MB
                   (no gradient wanted: a alone, 50 MB)
        backward   the epilogue reads h and writes grad_h                               100 MB
    Prediction: 150 MB saved per training step and layer, ~50 µs at the H100's 3 TB/s, next to
    ~300 µs for the block's six matmuls (232 GFLOP). The bias costs nothing either way: one vector
    per tile.

Measured (H100 80GB HBM3, Triton 3.6, bfloat16, 8192 tokens, C = 768, H = 3072; medians)
    The prediction holds only where the epilogue adds no reads. GELU alone (no gradient) adds 16 µs
    to the matmul (87 → 103 µs) where PyTorch's separate GELU kernel takes 36 µs. Saving h as well
    adds 38 µs, as much as the unfused GELU; gelu' adds 66 µs (74 → 140 µs) where ATen's separate
    gelu_backward kernel takes 52. A program runs its epilogue after its K loop, and with one 8-warp
    program per SM nothing else keeps the tensor cores busy meanwhile: the epilogue's loads and
    stores wait in the open instead of overlapping another tile's loop. The matmuls themselves run
    at a fraction of cuBLAS's rate (matmul.py has the figures).
        forward, no gradient             177 µs   torch.compile 156, eager PyTorch 156    0.88 ×
        forward + backward, replayed as a CUDA graph
                                         613 µs   torch.compile 491, eager PyTorch 504    0.80 ×
        forward + backward through autograd, launched from Python
                                        1614 µs   torch.compile 881, eager PyTorch 496    0.55 ×
    The last line was host time: ten launches (six matmuls, two two-pass column sums) with their
    checks, issued from Python, for 0.6 ms of GPU work. launch.py has since cut the Python around
    each launch (profiling/results/host_path.md), and the bias gradients now come out of the weight
    gradients' matmuls, which leaves six launches (what that did on an H100, kernel by kernel and for a
    training step: profiling/results/h100/bias-gradients.md).

    Since then the matmuls with a bias and no GELU, and then the GELU epilogues too, run on matmul.py's
    persistent TMA kernel, and the GELU's tanh is one instruction of the special function unit
    (``tanh.approx``) in 16-bit: the GELU matmuls now beat cuBLAS followed by ATen's GELU kernels
    (profiling/results/h200/gelu-epilogues.md).

What it does not do (yet)
    Overlap a tile's epilogue with the next tile's K loop by warp specialization, as cuBLAS does. Split
    K: the weight gradients (K = tokens, output 768 × 3072) have few tiles, so part of the GPU idles in
    their last wave.

Limits
    x (tokens, C) with any number of rows and features; weights in nn.Linear's (out, in) layout (the
    feed-forward's may be transposed views, see above); biases both given or both None. Contiguous
    tensors of one dtype: float16, bfloat16, float32, float64 on the GPU, float32 and float64 under the
    CPU interpreter. h, a and grad_h are stored in the input dtype, as PyTorch's autograd would.

Check
    python -m pytest tests -k "feed_forward and triton"
    python -m profiling --component feed_forward --shape 8192 768 --dtype bfloat16 --backward
"""

from typing import NamedTuple

import torch

from .eager import EagerFunction, refuse_tangents
from .launch import SignatureTable, check_contiguous, check_inputs, require
from .matmul import Epilogue, MatmulLaunch, launch_column_sum, launch_matmul, plan_matmul

# --- input checks (launchers and fake implementations) ----------------------------------------------


def _check_linear_shapes(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         weight_name: str = "weight", transposable: bool = False) -> None:
    """x is (rows, in), weight (out, in) of x's dtype, bias (out,) or None. All contiguous, except that a
    ``transposable`` weight may be the transpose of a contiguous matrix."""
    require(x.dim() == 2, lambda: f"{op}: x must be a (rows, features) matrix, got shape {tuple(x.shape)}")
    require(weight.dim() == 2,
            lambda: f"{op}: {weight_name} must be (out_features, in_features), got shape {tuple(weight.shape)}")
    require(x.shape[1] == weight.shape[1],
            lambda: f"{op}: x has {x.shape[1]} features but {weight_name} expects {weight.shape[1]}")
    require(weight.dtype == x.dtype, lambda: f"{op}: x is {x.dtype} but {weight_name} is {weight.dtype}")
    if bias is not None:
        _check_like(op, "bias", bias, weight.shape[:1], x.dtype)
    check_contiguous(op, x)
    _check_weight_layout(op, weight_name, weight, transposable)


def _is_transposed(weight: torch.Tensor) -> bool:
    """A weight stored (in, out) and seen as (out, in): a Conv1D's, through levels.huggingface."""
    return not weight.is_contiguous() and weight.t().is_contiguous()


def _check_weight_layout(op: str, name: str, weight: torch.Tensor, transposable: bool) -> None:
    if transposable:
        require(weight.is_contiguous() or weight.t().is_contiguous(),
                lambda: f"triton_kernels::{op} needs {name} contiguous or the transpose of a contiguous matrix")
    else:
        check_contiguous(op, weight)


def _check_feed_forward_shapes(op: str, x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: torch.Tensor | None,
                               proj_weight: torch.Tensor, proj_bias: torch.Tensor | None) -> None:
    """x (rows, C), fc_weight (H, C), proj_weight (C, H), biases (H,) and (C,) or both None."""
    _check_linear_shapes(op, x, fc_weight, fc_bias, "fc_weight", transposable=True)
    hidden, channels = fc_weight.shape
    require(proj_weight.shape == (channels, hidden),
            lambda: f"{op}: proj_weight is {tuple(proj_weight.shape)} but must be (C, H) = ({channels}, {hidden}) "
                    f"to follow fc_weight {tuple(fc_weight.shape)}")
    require(proj_weight.dtype == x.dtype, lambda: f"{op}: x is {x.dtype} but proj_weight is {proj_weight.dtype}")
    require((fc_bias is None) == (proj_bias is None),
            lambda: f"{op}: give both fc_bias and proj_bias or neither (got only "
                    f"{'fc_bias' if proj_bias is None else 'proj_bias'})")
    if proj_bias is not None:
        _check_like(op, "proj_bias", proj_bias, (channels,), x.dtype)
    _check_weight_layout(op, "proj_weight", proj_weight, transposable=True)


def _check_like(op: str, name: str, tensor: torch.Tensor, shape, dtype: torch.dtype) -> None:
    require(tensor.shape == tuple(shape) and tensor.dtype == dtype,
            lambda: f"{op}: {name} is {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(shape)} {dtype}")
    check_contiguous(op, tensor)


def _check_linear_backward_shapes(grad_out, x, weight) -> None:
    _check_linear_shapes("linear_backward", x, weight, None)
    _check_like("linear_backward", "grad_out", grad_out, (x.shape[0], weight.shape[0]), x.dtype)


def _check_feed_forward_backward_shapes(grad_out, x, fc_weight, proj_weight, pre_activation, activation) -> None:
    op = "feed_forward_backward"
    _check_feed_forward_shapes(op, x, fc_weight, None, proj_weight, None)
    _check_like(op, "grad_out", grad_out, x.shape, x.dtype)
    for name, tensor in (("pre_activation", pre_activation), ("activation", activation)):
        _check_like(op, name, tensor, (x.shape[0], fc_weight.shape[0]), x.dtype)


# --- launchers ----------------------------------------------------------------------------------------


def _signature(*tensors) -> tuple:
    """What a launcher's checks and its matmuls' plans read of its tensors: shape, strides, dtype, device,
    and where the data starts within 16 bytes (the TMA kernel reads only operands that start on 16 bytes)."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15) for t in tensors)


# A model calls each projection and feed-forward with the same signature step after step, and at a decode
# step's sizes the checks and the matmuls' planning cost the host more than the launches themselves. So each
# launcher below keeps its matmuls' launches (matmul.MatmulLaunch) per signature, once the autotuner has
# chosen their tiles, and a signature seen before skips the checks and the planning: they read nothing else.
# The weights go to a kept launch as they are, for their transposes: it holds the strides, and the
# pointer is the same. Empty products stay unplanned, and so do the backwards of transposed weights (a
# Conv1D's), whose weight gradients take another path (``_weight_gradients``).
_LINEAR_FORWARD_LAUNCHES = SignatureTable()


def launch_linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    signature = _signature(x, weight, bias)
    planned = _LINEAR_FORWARD_LAUNCHES.get(signature)
    if planned is not None:
        return planned(x, weight, x.new_empty((x.shape[0], weight.shape[0])), bias)
    _check_linear_shapes("linear_forward", x, weight, bias)
    check_inputs("linear_forward", *(t for t in (x, weight, bias) if t is not None))
    out = x.new_empty((x.shape[0], weight.shape[0]))
    if out.numel():
        planned = plan_matmul(x, weight.t(), out, Epilogue.NONE, bias)
        if planned is not None:  # else the autotuner has yet to choose this matmul's tile
            return _LINEAR_FORWARD_LAUNCHES.keep(signature, planned)(x, weight, out, bias)
    return launch_matmul(x, weight.t(), Epilogue.NONE, bias=bias, out=out)


def launch_linear_bwd(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    _check_linear_backward_shapes(grad_out, x, weight)
    check_inputs("linear_backward", grad_out, x, weight)
    return launch_linear_bwd_unchecked(grad_out, x, weight)


class LinearBackwardLaunch(NamedTuple):
    """The linear backward's two matmul launches for one signature (see _LINEAR_FORWARD_LAUNCHES)."""

    grad_x: MatmulLaunch  # grad_out·W
    grad_weight: MatmulLaunch  # grad_outᵀ·x, and Σ_tokens grad_out as its row sums
    has_bias: bool

    def __call__(self, grad_out, x, weight):
        grad_bias = grad_out.new_empty(grad_out.shape[1]) if self.has_bias else None
        return (self.grad_x(grad_out, weight, x.new_empty(x.shape)),
                self.grad_weight(grad_out, x, weight.new_empty(weight.shape), row_sums=grad_bias), grad_bias)


_LINEAR_BACKWARD_LAUNCHES = SignatureTable()


def launch_linear_bwd_unchecked(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                has_bias: bool = True):
    """``launch_linear_bwd`` without its checks, for the eager backward (see ``triton_kernels/__init__.py``),
    which passes ``has_bias`` (without a bias, the gradient comes back None and is never summed)."""
    signature = (has_bias, *_signature(grad_out, x, weight))
    planned = _LINEAR_BACKWARD_LAUNCHES.get(signature)
    if planned is None and x.numel() and grad_out.numel() and not _is_transposed(weight):
        grad_x = plan_matmul(grad_out, weight, x.new_empty(x.shape))
        grad_weight = plan_matmul(grad_out.t(), x, weight.new_empty(weight.shape),
                                  row_sums=grad_out.new_empty(grad_out.shape[1]) if has_bias else None)
        if grad_x is not None and grad_weight is not None:  # else the autotuner has yet to choose a tile
            planned = _LINEAR_BACKWARD_LAUNCHES.keep(signature, LinearBackwardLaunch(grad_x, grad_weight, has_bias))
    if planned is not None:
        return planned(grad_out, x, weight)
    return launch_matmul(grad_out, weight), *_weight_gradients(grad_out, x, weight, has_bias)


class FeedForwardForwardLaunch(NamedTuple):
    """The feed-forward forward's two matmul launches for one signature (see _LINEAR_FORWARD_LAUNCHES)."""

    fc: MatmulLaunch
    proj: MatmulLaunch
    hidden_shape: tuple[int, int]
    out_shape: tuple[int, int]
    save_for_backward: bool

    def __call__(self, x, fc_weight, fc_bias, proj_weight, proj_bias):
        activation = x.new_empty(self.hidden_shape)
        pre_activation = x.new_empty(self.hidden_shape) if self.save_for_backward else None
        self.fc(x, fc_weight, activation, fc_bias, pre_activation)
        return self.proj(activation, proj_weight, x.new_empty(self.out_shape), proj_bias), pre_activation, activation


_FEED_FORWARD_FORWARD_LAUNCHES = SignatureTable()


def launch_feed_forward_fwd(x, fc_weight, fc_bias, proj_weight, proj_bias, save_for_backward: bool = True):
    """(out, pre_activation, activation); without ``save_for_backward`` only the activation is written
    and (out, None, activation) comes back: the GELU epilogue then skips h's 50 MB at GPT-2 size."""
    signature = (save_for_backward, *_signature(x, fc_weight, fc_bias, proj_weight, proj_bias))
    planned = _FEED_FORWARD_FORWARD_LAUNCHES.get(signature)
    if planned is not None:
        return planned(x, fc_weight, fc_bias, proj_weight, proj_bias)
    _check_feed_forward_shapes("feed_forward_forward", x, fc_weight, fc_bias, proj_weight, proj_bias)
    check_inputs("feed_forward_forward", *(t for t in (x, fc_weight, fc_bias, proj_weight, proj_bias) if t is not None))
    hidden_shape = (x.shape[0], fc_weight.shape[0])
    activation = x.new_empty(hidden_shape)
    pre_activation = x.new_empty(hidden_shape) if save_for_backward else None
    out = x.new_empty((x.shape[0], proj_weight.shape[0]))
    fc_epilogue = Epilogue.GELU_SAVING_PRE_ACTIVATION if save_for_backward else Epilogue.GELU
    if activation.numel() and out.numel():
        fc = plan_matmul(x, fc_weight.t(), activation, fc_epilogue, fc_bias, pre_activation)
        proj = plan_matmul(activation, proj_weight.t(), out, Epilogue.NONE, proj_bias)
        if fc is not None and proj is not None:  # else the autotuner has yet to choose a tile
            _FEED_FORWARD_FORWARD_LAUNCHES.keep(
                signature, FeedForwardForwardLaunch(fc, proj, hidden_shape, tuple(out.shape), save_for_backward))
            fc(x, fc_weight, activation, fc_bias, pre_activation)
            return proj(activation, proj_weight, out, proj_bias), pre_activation, activation
    launch_matmul(x, fc_weight.t(), fc_epilogue, bias=fc_bias, pre_activation=pre_activation, out=activation)
    return launch_matmul(activation, proj_weight.t(), Epilogue.NONE, bias=proj_bias, out=out), pre_activation, activation


def launch_feed_forward_bwd(grad_out, x, fc_weight, proj_weight, pre_activation, activation):
    """(grad_x, grad_fc_weight, grad_fc_bias, grad_proj_weight, grad_proj_bias)."""
    _check_feed_forward_backward_shapes(grad_out, x, fc_weight, proj_weight, pre_activation, activation)
    check_inputs("feed_forward_backward", grad_out, x, fc_weight, proj_weight, pre_activation, activation)
    return launch_feed_forward_bwd_unchecked(grad_out, x, fc_weight, proj_weight, pre_activation, activation)


class FeedForwardBackwardLaunch(NamedTuple):
    """The feed-forward backward's four matmul launches for one signature (see _LINEAR_FORWARD_LAUNCHES)."""

    grad_pre_activation: MatmulLaunch  # grad_out·W_proj · gelu'(h)
    grad_x: MatmulLaunch  # grad_h·W_fc
    grad_fc_weight: MatmulLaunch  # grad_hᵀ·x, and the fc bias's gradient as its row sums
    grad_proj_weight: MatmulLaunch  # grad_outᵀ·a, and the proj bias's gradient as its row sums
    has_bias: bool

    def __call__(self, grad_out, x, fc_weight, proj_weight, pre_activation, activation):
        grad_h = self.grad_pre_activation(grad_out, proj_weight, pre_activation.new_empty(pre_activation.shape),
                                          pre_activation=pre_activation)
        grad_fc_bias = grad_h.new_empty(grad_h.shape[1]) if self.has_bias else None
        grad_proj_bias = grad_out.new_empty(grad_out.shape[1]) if self.has_bias else None
        return (self.grad_x(grad_h, fc_weight, x.new_empty(x.shape)),
                self.grad_fc_weight(grad_h, x, fc_weight.new_empty(fc_weight.shape), row_sums=grad_fc_bias),
                grad_fc_bias,
                self.grad_proj_weight(grad_out, activation, proj_weight.new_empty(proj_weight.shape),
                                      row_sums=grad_proj_bias),
                grad_proj_bias)


_FEED_FORWARD_BACKWARD_LAUNCHES = SignatureTable()


def launch_feed_forward_bwd_unchecked(grad_out, x, fc_weight, proj_weight, pre_activation, activation,
                                      has_bias: bool = True):
    """``launch_feed_forward_bwd`` without its checks, for the eager backward (see ``triton_kernels/__init__.py``),
    which passes ``has_bias`` (without biases, their gradients come back None and are never summed)."""
    signature = (has_bias, *_signature(grad_out, x, fc_weight, proj_weight, pre_activation, activation))
    planned = _FEED_FORWARD_BACKWARD_LAUNCHES.get(signature)
    if (planned is None and x.numel() and grad_out.numel() and activation.numel()
            and not (_is_transposed(fc_weight) or _is_transposed(proj_weight))):
        grad_h = pre_activation.new_empty(pre_activation.shape)
        matmuls = (
            plan_matmul(grad_out, proj_weight, grad_h, Epilogue.GELU_BACKWARD, pre_activation=pre_activation),
            plan_matmul(grad_h, fc_weight, x.new_empty(x.shape)),
            plan_matmul(grad_h.t(), x, fc_weight.new_empty(fc_weight.shape),
                        row_sums=grad_h.new_empty(grad_h.shape[1]) if has_bias else None),
            plan_matmul(grad_out.t(), activation, proj_weight.new_empty(proj_weight.shape),
                        row_sums=grad_out.new_empty(grad_out.shape[1]) if has_bias else None))
        if None not in matmuls:  # else the autotuner has yet to choose a tile
            planned = _FEED_FORWARD_BACKWARD_LAUNCHES.keep(signature, FeedForwardBackwardLaunch(*matmuls, has_bias))
    if planned is not None:
        return planned(grad_out, x, fc_weight, proj_weight, pre_activation, activation)
    grad_pre_activation = launch_matmul(grad_out, proj_weight, Epilogue.GELU_BACKWARD, pre_activation=pre_activation)
    return (launch_matmul(grad_pre_activation, fc_weight),
            *_weight_gradients(grad_pre_activation, x, fc_weight, has_bias),
            *_weight_gradients(grad_out, activation, proj_weight, has_bias))


def _weight_gradients(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool):
    """(grad_weight, grad_bias): grad_outᵀ·x in ``weight``'s own layout and, with a bias, Σ_tokens grad_out
    (else None). The matmul's K is the tokens, so it reads all of grad_out (as its A, transposed in place)
    and sums A's rows as it goes: the bias gradient costs no launch of its own (matmul.py's ``row_sums``).

    A transposed weight gets (xᵀ·grad_out)ᵀ, the same matmul with grad_out as B, and a column-sum kernel
    for the bias: summing B's columns inside the matmul (a ones·B product) ran slower than that kernel on
    an H100, and Triton 3.6 compiled it wrong there at two GPT-2 shapes, the product itself included
    (profiling/results/h100/bias-gradients.md). So does an x without features, whose empty product has
    no programs to sum anything."""
    if _is_transposed(weight) or x.shape[1] == 0:
        return launch_matmul(x.t(), grad_out).t(), launch_column_sum(grad_out) if has_bias else None
    grad_bias = grad_out.new_empty(grad_out.shape[1]) if has_bias else None
    return launch_matmul(grad_out.t(), x, row_sums=grad_bias), grad_bias


# --- registration: op, fake (shape-only), autograd ------------------------------------------------------


@torch.library.custom_op("triton_kernels::linear_forward", mutates_args=())
def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return launch_linear_fwd(x, weight, bias)


@linear_forward.register_fake
def _linear_forward_fake(x, weight, bias):
    _check_linear_shapes("linear_forward", x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


def _linear_forward_setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_forward_backward(ctx, grad_out):
    needs_x, needs_weight, needs_bias = ctx.needs_input_grad
    if not (needs_x or needs_weight or needs_bias):
        return None, None, None
    x, weight = ctx.saved_tensors
    # Autograd may hand us a broadcast (stride-0) gradient, e.g. from y.sum().backward().
    grad_x, grad_weight, grad_bias = linear_backward(grad_out.contiguous(), x, weight)
    return (grad_x if needs_x else None, grad_weight if needs_weight else None,
            grad_bias if needs_bias and ctx.has_bias else None)


linear_forward.register_autograd(_linear_forward_backward, setup_context=_linear_forward_setup_context)


@torch.library.custom_op("triton_kernels::linear_backward", mutates_args=())
def linear_backward(grad_out: torch.Tensor, x: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_linear_bwd(grad_out, x, weight)


@linear_backward.register_fake
def _linear_backward_fake(grad_out, x, weight):
    _check_linear_backward_shapes(grad_out, x, weight)
    return torch.empty_like(x), torch.empty_like(weight), weight.new_empty(weight.shape[:1])


@torch.library.custom_op("triton_kernels::feed_forward_forward", mutates_args=())
def feed_forward_forward(x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: torch.Tensor | None,
                         proj_weight: torch.Tensor,
                         proj_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_feed_forward_fwd(x, fc_weight, fc_bias, proj_weight, proj_bias)


@feed_forward_forward.register_fake
def _feed_forward_forward_fake(x, fc_weight, fc_bias, proj_weight, proj_bias):
    _check_feed_forward_shapes("feed_forward_forward", x, fc_weight, fc_bias, proj_weight, proj_bias)
    hidden = x.new_empty((x.shape[0], fc_weight.shape[0]))
    return torch.empty_like(x), hidden, torch.empty_like(hidden)


def _feed_forward_forward_setup_context(ctx, inputs, output):
    x, fc_weight, fc_bias, proj_weight, _ = inputs
    _, pre_activation, activation = output
    ctx.save_for_backward(x, fc_weight, proj_weight, pre_activation, activation)
    ctx.has_bias = fc_bias is not None


def _feed_forward_forward_backward(ctx, grad_out, grad_pre_activation, grad_activation):
    # pre_activation and activation are returned only to be saved for this backward: gradients
    # flowing into them are ignored.
    needs = ctx.needs_input_grad
    if not any(needs):
        return None, None, None, None, None
    grads = feed_forward_backward(grad_out.contiguous(), *ctx.saved_tensors)
    has_bias = (True, True, ctx.has_bias, True, ctx.has_bias)
    return tuple(grad if need and present else None for grad, need, present in zip(grads, needs, has_bias))


feed_forward_forward.register_autograd(_feed_forward_forward_backward,
                                       setup_context=_feed_forward_forward_setup_context)


@torch.library.custom_op("triton_kernels::feed_forward_backward", mutates_args=())
def feed_forward_backward(grad_out: torch.Tensor, x: torch.Tensor, fc_weight: torch.Tensor,
                          proj_weight: torch.Tensor, pre_activation: torch.Tensor, activation: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_feed_forward_bwd(grad_out, x, fc_weight, proj_weight, pre_activation, activation)


@feed_forward_backward.register_fake
def _feed_forward_backward_fake(grad_out, x, fc_weight, proj_weight, pre_activation, activation):
    _check_feed_forward_backward_shapes(grad_out, x, fc_weight, proj_weight, pre_activation, activation)
    return (torch.empty_like(x), torch.empty_like(fc_weight), fc_weight.new_empty(fc_weight.shape[:1]),
            torch.empty_like(proj_weight), proj_weight.new_empty(proj_weight.shape[:1]))


# --- what the levels call ------------------------------------------------------------------------------


class _LinearEager(EagerFunction):
    """The ops' forward and backward without the dispatcher, for eager calls (see __init__.py)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return launch_linear_fwd(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        return launch_linear_bwd_unchecked(grad_out.contiguous(), *ctx.saved_tensors, has_bias=ctx.has_bias)


class _FeedForwardEager(EagerFunction):
    """The ops' forward and backward without the dispatcher, for eager calls (see __init__.py)."""

    @staticmethod
    def forward(ctx, x, fc_weight, fc_bias, proj_weight, proj_bias):
        out, pre_activation, activation = launch_feed_forward_fwd(x, fc_weight, fc_bias, proj_weight, proj_bias)
        ctx.save_for_backward(x, fc_weight, proj_weight, pre_activation, activation)
        ctx.has_bias = fc_bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        return launch_feed_forward_bwd_unchecked(grad_out.contiguous(), *ctx.saved_tensors, has_bias=ctx.has_bias)


def _wants_gradient(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _contiguous(*tensors):
    """The ops take contiguous tensors; the package-level functions accept any layout."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _weight_as_is_or_contiguous(weight: torch.Tensor) -> torch.Tensor:
    """The feed-forward's weights may stay transposed views (a Conv1D's): copying one would cost a
    pass over the weight at every call."""
    return weight if _is_transposed(weight) else weight.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x·weightᵀ + bias for x (rows, in) and weight (out, in) by our kernels, differentiable.
    torch.compile sees the registered op."""
    x, weight, bias = _contiguous(x, weight, bias)
    if torch.compiler.is_compiling():
        return linear_forward(x, weight, bias)
    refuse_tangents("linear", x, weight, bias)
    if not _wants_gradient(x, weight, bias):
        return launch_linear_fwd(x, weight, bias)  # no gradient wanted: skip autograd's bookkeeping
    return _LinearEager.call((x, weight, bias))


def feed_forward(x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: torch.Tensor | None, proj_weight: torch.Tensor,
                 proj_bias: torch.Tensor | None) -> torch.Tensor:
    """GPT-2's MLP, gelu_tanh(x·fc_weightᵀ + fc_bias)·proj_weightᵀ + proj_bias, by our kernels,
    differentiable; returns only the output (h and a stay saved for the backward). torch.compile
    sees the registered op."""
    x, fc_bias, proj_bias = _contiguous(x, fc_bias, proj_bias)
    tensors = (x, _weight_as_is_or_contiguous(fc_weight), fc_bias, _weight_as_is_or_contiguous(proj_weight), proj_bias)
    if torch.compiler.is_compiling():
        return feed_forward_forward(*tensors)[0]
    refuse_tangents("feed_forward", *tensors)
    if not _wants_gradient(*tensors):
        return launch_feed_forward_fwd(*tensors, save_for_backward=False)[0]  # no gradient: h is never written
    return _FeedForwardEager.call(tensors)
