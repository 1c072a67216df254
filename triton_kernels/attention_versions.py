"""Causal attention's forward in Triton, as it grew: four versions, each the one before plus one change.

The versions (``ATTENTION_VERSIONS``; ``attention_forward_version(q, k, v, version)`` runs one)
    version 1  the scores materialised, three launches: ``_attention_scores_kernel`` writes
               S = q·kᵀ·scale (the hidden half −inf) to memory, level 4's softmax launcher turns S into
               P, ``_probabilities_times_values_kernel`` reads P back for o = P·v. S and P are (seq, seq)
               per head in float32, so HBM moves 4 bytes × seq² four times (S written, S read, P written,
               P read) for q, k, v, o that are seq × head_dim each: memory-bound on an intermediate.
    version 2  fused (FlashAttention-1): ``_attention_fwd_fused_kernel``, one program per (query block,
               batch·head), streams key/value blocks past its query block and merges them with the
               online softmax (running max, running sum, output accumulator, all in registers). S never
               touches memory: the bytes are q, k, v and o. But every key block is visited and masked,
               including those wholly past the diagonal, so it does the FLOPs of full attention.
    version 3  version 2 + causal block skipping and exp2: the key loop stops at the diagonal (half the
               FLOPs), only the blocks that straddle it are masked (no compares elsewhere), and the
               exponentials are 2^x, one special-function-unit instruction, with log2(e) folded into
               the score scale once (e^x would be a multiply and the same instruction, per score).
    version 4  level 4's own kernel (attention_forward.py, called, not copied): version 3 + software
               pipelining (three key/value loads in flight while the tensor cores work, num_stages=3),
               tiles tuned per head dim on an H100 (128 queries, 8 warps), the longest query blocks
               launched first, and grouped-query attention and sliding windows besides.

Versions 1-3 share one untuned tile and one pipeline stage (``version_tile``), so that they differ
only in what their story says. They exist to be timed side by side (``levels.attention.
attention_triton_versions``, the GPU suite's versions part); the measured numbers live in
profiling/results/, not here. Forward only, causal only, no torch.library op: the ladder's level-4 op
is version 4's.

Limits
    Causal, queries aligned to the end of the keys (Lq ≤ Lk); as many k, v heads as q heads for
    versions 1-3; head_dim a multiple of 8 up to 256 (the level-4 kernels' set, checked by the same
    helper); float16, bfloat16, float32, float64 on the GPU, float32 and float64 under the interpreter.

Check
    python -m pytest -q tests/test_attention_versions.py
"""

import torch
import triton
import triton.language as tl

from .attention_forward import launch_attention_fwd, merge_key_blocks
from .attention_tiles import (
    AttentionTile,
    check_attention_shapes,
    key_block_range,
    keys_visible,
    load_rows,
    padded_head_dim,
    store_rows,
    wide_float_tile,
)
from .launch import (
    LOG2E,
    accumulator_dtype,
    cdiv,
    check_contiguous,
    check_inputs,
    compute_dtype,
    dot_input_precision,
    launch,
    on_device,
    require,
    require_value,
    split_float,
)
from .softmax import launch_softmax_fwd

ATTENTION_VERSIONS = {
    1: "scores materialised: S = q·kᵀ, softmax, P·v in three launches",
    2: "version 1 fused into one kernel (FlashAttention-1): online softmax, S never in memory",
    3: "version 2 + causal block skipping and exp2 with log2(e) in the scale",
    4: "version 3 + software pipelining and tuned tiles (the level-4 kernel)",
}
"""The climb to level 4's attention forward, kept runnable: each version is the one before plus one change."""


def version_tile(block_d: int, dtype: torch.dtype) -> AttentionTile:
    """The tile of versions 1-3: 64 × 64 for 16-bit inputs (8 warps from tile width 128 on, where the
    accumulator doubles), level 4's float32/float64 tile otherwise, and always one pipeline stage: each
    key block is loaded when the loop reaches it (version 4 loads ahead)."""
    if dtype.itemsize != 2:
        return wide_float_tile(block_d)._replace(num_stages=1)
    return AttentionTile(64, 64, 4 if block_d <= 64 else 8, 1)


# --- version 1: scores through memory ------------------------------------------------------------------


@triton.jit
def _attention_scores_kernel(Q, K, S, query_length, key_length, scale_high, scale_low, HEAD_DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of S = q·kᵀ·scale per program, the hidden pairs −inf."""
    queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    keys = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    batch_head = tl.program_id(2).to(tl.int64)
    q = load_rows(Q + batch_head * query_length * HEAD_DIM, queries, query_length, HEAD_DIM, HEAD_DIM, BLOCK_D, True)
    k = load_rows(K + batch_head * key_length * HEAD_DIM, keys, key_length, HEAD_DIM, HEAD_DIM, BLOCK_D, True)
    scale = tl.cast(scale_high, COMPUTE) + tl.cast(scale_low, COMPUTE)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    visible = keys_visible(queries[:, None], keys[None, :], query_length, key_length, 0, True, False)
    scores = tl.where(visible, scores, float("-inf"))
    # Every tile is written, the wholly hidden ones too (as −inf): S is seq × seq whatever the mask.
    S += batch_head * query_length * key_length
    tl.store(S + queries[:, None] * key_length + keys[None, :], scores.to(S.dtype.element_ty),
             mask=(queries < query_length)[:, None] & (keys < key_length)[None, :])


@triton.jit
def _probabilities_times_values_kernel(P, V, Out, query_length, key_length, HEAD_DIM: tl.constexpr,
                                       BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                       COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """o = P·v for one query block, P read back from memory one (BLOCK_M, BLOCK_N) tile at a time."""
    queries = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch_head = tl.program_id(1).to(tl.int64)
    P += batch_head * query_length * key_length
    V += batch_head * key_length * HEAD_DIM
    acc = tl.zeros((BLOCK_M, BLOCK_D), COMPUTE)
    for block_start in range(0, key_length, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        p = tl.load(P + queries[:, None] * key_length + keys[None, :],
                    mask=(queries < query_length)[:, None] & (keys < key_length)[None, :], other=0.0)
        v = load_rows(V, keys, key_length, HEAD_DIM, HEAD_DIM, BLOCK_D, True)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION, out_dtype=acc.dtype)
    store_rows(Out + batch_head * query_length * HEAD_DIM, queries, query_length, HEAD_DIM, acc, HEAD_DIM, BLOCK_D)


def _launch_version_1(q, k, v, out, scale, tile, block_d):
    batch, heads, query_length, head_dim = q.shape
    key_length = k.shape[2]
    constants = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                     COMPUTE=compute_dtype(q.dtype), DOT_PRECISION=dot_input_precision(q.dtype),
                     num_warps=tile.num_warps, num_stages=tile.num_stages)
    scores = torch.empty((batch, heads, query_length, key_length), dtype=accumulator_dtype(q.dtype), device=q.device)
    query_blocks = cdiv(query_length, tile.block_m)
    launch(_attention_scores_kernel, (query_blocks, cdiv(key_length, tile.block_n), batch * heads), q, k, scores,
           query_length, key_length, *split_float(scale), **constants)
    probabilities = launch_softmax_fwd(scores)
    launch(_probabilities_times_values_kernel, (query_blocks, batch * heads), probabilities, v, out, query_length,
           key_length, **constants)


# --- versions 2 and 3: fused ---------------------------------------------------------------------------


@triton.jit
def _attention_fwd_fused_kernel(Q, K, V, Out, query_length, key_length, scale_high, scale_low,
                                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, VERSION: tl.constexpr, COMPUTE: tl.constexpr,
                                DOT_PRECISION: tl.constexpr):
    """o for one (BLOCK_M query block, batch·head) per program: version 2, or with VERSION 3 version 3."""
    first_query = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1).to(tl.int64)
    K += batch_head * key_length * HEAD_DIM
    V += batch_head * key_length * HEAD_DIM
    queries = first_query + tl.arange(0, BLOCK_M)
    q = load_rows(Q + batch_head * query_length * HEAD_DIM, queries, query_length, HEAD_DIM, HEAD_DIM, BLOCK_D, True)
    scale = tl.cast(scale_high, COMPUTE) + tl.cast(scale_low, COMPUTE)
    acc = tl.zeros((BLOCK_M, BLOCK_D), COMPUTE)
    row_sum = tl.zeros((BLOCK_M,), COMPUTE)
    row_max = tl.full((BLOCK_M,), float("-inf"), COMPUTE)
    # One column slice (REST_D = 0): acc and q also fill merge_key_blocks' unused second-slice arguments.
    if VERSION == 2:  # every key block, each one masked, plain exp
        acc, _, row_sum, row_max = merge_key_blocks(acc, acc, row_sum, row_max, q, q, K, V, HEAD_DIM, HEAD_DIM, queries,
                                                    0, key_length, query_length, key_length, 0, scale, HEAD_DIM,
                                                    BLOCK_D, 0, BLOCK_N, True, True, False, DOT_PRECISION, False)
    else:  # version 3: the blocks below the diagonal unmasked, then those straddling it; none past it
        _, _, diagonal, end = key_block_range(first_query, query_length, key_length, 0, BLOCK_M, BLOCK_N, True, False)
        scale = scale * LOG2E  # e^x = 2^(x·log2 e)
        acc, _, row_sum, row_max = merge_key_blocks(acc, acc, row_sum, row_max, q, q, K, V, HEAD_DIM, HEAD_DIM, queries,
                                                    0, diagonal, query_length, key_length, 0, scale, HEAD_DIM,
                                                    BLOCK_D, 0, BLOCK_N, False, True, False, DOT_PRECISION, True)
        acc, _, row_sum, row_max = merge_key_blocks(acc, acc, row_sum, row_max, q, q, K, V, HEAD_DIM, HEAD_DIM, queries,
                                                    diagonal, end, query_length, key_length, 0, scale, HEAD_DIM,
                                                    BLOCK_D, 0, BLOCK_N, True, True, False, DOT_PRECISION, True)
    store_rows(Out + batch_head * query_length * HEAD_DIM, queries, query_length, HEAD_DIM, acc / row_sum[:, None],
               HEAD_DIM, BLOCK_D)


def _launch_fused(q, k, v, out, scale, tile, block_d, version):
    batch, heads, query_length, head_dim = q.shape
    launch(_attention_fwd_fused_kernel, (cdiv(query_length, tile.block_m), batch * heads), q, k, v, out, query_length,
           k.shape[2], *split_float(scale), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=tile.block_m,
           BLOCK_N=tile.block_n, VERSION=version, COMPUTE=compute_dtype(q.dtype),
           DOT_PRECISION=dot_input_precision(q.dtype), num_warps=tile.num_warps, num_stages=tile.num_stages)


# --- one door for every version -------------------------------------------------------------------------


def attention_forward_version(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, version: int,
                              scale: float | None = None) -> torch.Tensor:
    """Causal o = softmax(q·kᵀ·scale + mask)·v by ``version`` of ``ATTENTION_VERSIONS`` (scale: default
    1/√head_dim, as SDPA's); q (B, H, Lq, D), k and v (B, H, Lk, D), Lq ≤ Lk. Forward only."""
    op = "attention_forward_version"
    require_value(version in ATTENTION_VERSIONS, lambda: f"{op}: version {version} does not exist "
                                                         f"(versions: {', '.join(map(str, ATTENTION_VERSIONS))})")
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    if version == 4:
        return launch_attention_fwd(q, k, v, True, 0, scale)[0]
    check_attention_shapes(op, q, k, v, True, 0)
    check_contiguous(op, q, k, v)  # versions 1-3 index rows HEAD_DIM apart (level 4's kernels take strides)
    check_inputs(op, q, k, v)
    require(k.shape[1] == q.shape[1], lambda: f"{op}: versions 1-3 take as many k, v heads as q heads, got "
                                              f"{q.shape[1]} and {k.shape[1]} (grouped-query attention: version 4)")
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    block_d = padded_head_dim(q.shape[-1])
    tile = version_tile(block_d, q.dtype)
    with on_device(q):
        if version == 1:
            _launch_version_1(q, k, v, out, scale, tile, block_d)
        else:
            _launch_fused(q, k, v, out, scale, tile, block_d, version)
    return out
