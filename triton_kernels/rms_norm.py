"""RMSNorm in Triton: LayerNorm's kernels without the mean and without the bias, as ``triton_kernels`` ops.

What it computes
    forward    rstd = 1/sqrt(Σx²/N + eps)   (the reciprocal root mean square; saved, float32, for the backward)
               y = x·rstd·w
    backward   x̂ = x·rstd,  g = dy·w
               dx = rstd·(g − x̂·mean(x̂·g))                       a reduction along each row
               dw = Σ_rows dy·x̂                                  a reduction *across* rows

Kernels
    None of its own. RMSNorm is LayerNorm with the mean taken as 0 and no bias, so the kernels of
    ``layer_norm.py`` take two constexpr flags, ``SUBTRACT_MEAN`` and ``HAS_BIAS``, and Triton compiles
    a separate variant for each setting: the RMSNorm variant carries no mean reduction, no bias load
    and no db buffer, so it moves the same bytes a dedicated kernel would. Launch shapes, the looped
    path for long rows and the persistent backward with its deterministic dw column reduction are
    LayerNorm's (read its docstring for the reasons).

Limits
    LayerNorm's: any N ≥ 1; float16, bfloat16, float32, float64 on the GPU, float32 and float64 under
    the interpreter; statistics and sums in float32 (float64 for float64 inputs).

Check
    python -m pytest tests -k "rms_norm and triton"
    python -m profiling --component rms_norm --shape 8192 8192 --backward
"""

import torch

from .eager import EagerFunction, refuse_tangents
from .launch import accumulator_dtype, check_inputs
from .layer_norm import check_norm_shapes, launch_norm_fwd
from .layer_norm_backward import launch_norm_bwd_unchecked


def launch_rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, keep_statistics: bool = True):
    """(y, rstd); rstd is None with ``keep_statistics=False`` (inference: no backward will read it)."""
    out, _, rstd = launch_norm_fwd("rms_norm_forward", x, weight, None, eps, keep_statistics)
    return out, rstd


def launch_rms_norm_bwd(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor):
    """(grad_x, grad_weight)."""
    check_norm_shapes("rms_norm_backward", x, per_column={"weight": weight}, per_row={"rstd": rstd},
                      like_x={"grad_out": grad_out})
    check_inputs("rms_norm_backward", grad_out, x, weight, rstd)
    return launch_norm_bwd_unchecked(grad_out, x, weight, None, rstd)[:2]


# --- registration: op, fake (shape-only), autograd ------------------------------------------------------


@torch.library.custom_op("triton_kernels::rms_norm_forward", mutates_args=())
def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_rms_norm_fwd(x, weight, eps)


@rms_norm_forward.register_fake
def _rms_norm_forward_fake(x, weight, eps):
    rows, _ = check_norm_shapes("rms_norm_forward", x, per_column={"weight": weight})
    return torch.empty_like(x), x.new_empty(rows, dtype=accumulator_dtype(x.dtype))


def _rms_norm_forward_setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_forward_backward(ctx, grad_out, grad_rstd):
    # rstd is returned only to be saved for this backward: a gradient flowing into it is ignored.
    needs_x, needs_weight, _ = ctx.needs_input_grad
    if not (needs_x or needs_weight):
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    # Autograd may hand us a broadcast (stride-0) gradient, e.g. from y.sum().backward().
    grad_x, grad_weight = rms_norm_backward(grad_out.contiguous(), x, weight, rstd)
    return grad_x if needs_x else None, grad_weight if needs_weight else None, None


rms_norm_forward.register_autograd(_rms_norm_forward_backward, setup_context=_rms_norm_forward_setup_context)


@torch.library.custom_op("triton_kernels::rms_norm_backward", mutates_args=())
def rms_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_rms_norm_bwd(grad_out, x, weight, rstd)


@rms_norm_backward.register_fake
def _rms_norm_backward_fake(grad_out, x, weight, rstd):
    check_norm_shapes("rms_norm_backward", x, per_column={"weight": weight}, per_row={"rstd": rstd},
                      like_x={"grad_out": grad_out})
    return torch.empty_like(x), torch.empty_like(weight)


# --- what the levels call ------------------------------------------------------------------------------


class _RMSNormEager(EagerFunction):
    """The ops' forward and backward without the dispatcher, for eager calls (see __init__.py)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        out, rstd = launch_rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight, _ = launch_norm_bwd_unchecked(grad_out.contiguous(), x, weight, None, rstd)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (..., N) by our kernels, differentiable; returns only the
    output (rstd stays saved for the backward). torch.compile sees the registered op."""
    if torch.compiler.is_compiling():
        return rms_norm_forward(x, weight, float(eps))[0]
    refuse_tangents("rms_norm", x, weight)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        # No gradient wanted: no autograd bookkeeping, and no statistics for a backward.
        return launch_rms_norm_fwd(x, weight, float(eps), keep_statistics=False)[0]
    return _RMSNormEager.call((x, weight), (float(eps),))
