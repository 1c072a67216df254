"""Flash attention in Triton, as ``triton_kernels`` ops: o = softmax(q·kᵀ·scale + mask)·v.

The kernels are two lessons, one file each:
    attention_forward.py    tiles of q stay put while k, v blocks stream past; an online softmax
                            merges them; the (seq, seq) scores never reach memory; lse is saved
    attention_backward.py   δ = rowsum(do·o), then dk, dv per key block and dq per query block, each
                            rebuilding p = exp(s − lse) tile by tile instead of reading it back

This file registers them: ``attention_forward(q, k, v, causal, window, scale) -> (out, lse)`` and
``attention_backward(grad_out, q, k, v, out, lse, causal, window, scale) -> (dq, dk, dv)``, each with
a fake (shape-only) implementation and the forward's autograd formula, and offers ``attention``, what
level 4 calls (the two doors of ``triton_kernels/__init__.py``).

Mask
    As ``levels.attention.visible_keys_mask``: query i sits at position p = i + Lk − Lq (queries are
    aligned to the end of the keys); causal: it sees keys j ≤ p; a window W > 0 (causal only, as in
    ``attention_math``) keeps j > p − W as well; not causal: every key. ``window=0`` means none.

Limits
    head_dim a multiple of 8 from 8 to 256; k and v with H or a divisor of H heads (grouped-query
    attention); any lengths (Lq ≤ Lk when causal); (B, H, L, D) tensors of any strides, read where they lie
    when their rows allow it (attention_tiles.readable), of one dtype: float16, bfloat16, float32, float64
    on the GPU, float32 and float64 under the interpreter. lse is float32 (float64 for float64 inputs).

Check
    python -m pytest tests -k "attention and triton"
    python -m profiling --component attention --shape 4 16 4096 128 --dtype bfloat16 --backward
"""

import torch

from .attention_backward import launch_attention_bwd, launch_attention_bwd_unchecked
from .attention_forward import forward_launch, launch_attention_fwd
from .attention_tiles import check_attention_shapes, empty_attention_output, empty_gradient
from .eager import EagerFunction, refuse_tangents
from .launch import accumulator_dtype

# --- registration: op, fake (shape-only), autograd ------------------------------------------------------


@torch.library.custom_op("triton_kernels::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_attention_fwd(q, k, v, causal, window, scale)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, window, scale):
    check_attention_shapes("attention_forward", q, k, v, causal, window)
    return empty_attention_output(q), q.new_empty(q.shape[:3], dtype=accumulator_dtype(q.dtype))


def _attention_forward_setup_context(ctx, inputs, output):
    q, k, v, causal, window, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)  # lse, not p: the backward rebuilds p tile by tile
    ctx.mask_and_scale = (causal, window, scale)


def _attention_forward_backward(ctx, grad_out, grad_lse):
    # lse is returned only to be saved for this backward: a gradient flowing into it is ignored.
    needs_q, needs_k, needs_v = ctx.needs_input_grad[:3]
    if not (needs_q or needs_k or needs_v):
        return None, None, None, None, None, None
    q, k, v, out, lse = ctx.saved_tensors
    # A gradient autograd hands over strided (the merged heads' view) or broadcast (stride 0, from
    # out.sum().backward()) is read where it lies or copied once by the launcher (attention_tiles.readable).
    grad_q, grad_k, grad_v = attention_backward(grad_out, q, k, v, out, lse, *ctx.mask_and_scale)
    return (grad_q if needs_q else None, grad_k if needs_k else None, grad_v if needs_v else None,
            None, None, None)


attention_forward.register_autograd(_attention_forward_backward, setup_context=_attention_forward_setup_context)


@torch.library.custom_op("triton_kernels::attention_backward", mutates_args=())
def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool, window: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_attention_bwd(grad_out, q, k, v, out, lse, causal, window, scale)


@attention_backward.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, causal, window, scale):
    check_attention_shapes("attention_backward", q, k, v, causal, window, like_q={"grad_out": grad_out, "out": out},
                           per_query={"lse": lse})
    return empty_gradient(q), empty_gradient(k), empty_gradient(v)


# --- what the levels call ------------------------------------------------------------------------------


class _AttentionEager(EagerFunction):
    """The ops' forward and backward without the dispatcher, for eager calls (see __init__.py)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window, scale):
        # The heads of a fused projection are read where they lie; an odd view is copied once, here,
        # and the copy saved, so the backward does not copy it again. The gradients come back laid out as
        # attention_tiles.empty_gradient says: the heads of a fused projection's, tokens first.
        q, k, v, forward = forward_launch(q, k, v, causal, window, scale)
        out, lse = forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask_and_scale = (causal, window, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_q, grad_k, grad_v = launch_attention_bwd_unchecked(grad_out, *ctx.saved_tensors,
                                                                *ctx.mask_and_scale)
        return grad_q, grad_k, grad_v, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
              scale: float) -> torch.Tensor:
    """Flash attention of q (B, H, Lq, D) over k, v (B, Hkv, Lk, D), H a multiple of Hkv, by our kernels,
    differentiable; returns only the output (lse stays saved for the backward). q, k and v may be strided
    (read where they lie, as the heads of a fused projection are, or copied once: attention_tiles.readable);
    the output is laid out (B, Lq, H, D), so merging its heads is a view. torch.compile sees the registered op."""
    causal, window, scale = bool(causal), int(window), float(scale)
    if torch.compiler.is_compiling():
        return attention_forward(q, k, v, causal, window, scale)[0]
    refuse_tangents("attention", q, k, v)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # No gradient wanted: skip autograd
        return launch_attention_fwd(q, k, v, causal, window, scale)[0]
    return _AttentionEager.call((q, k, v), (causal, window, scale))
