"""Flash attention in Triton, the backward pass: dq, dk, dv from the saved log-sum-exp, scores recomputed.

What it computes
    With s = q·kᵀ·scale and p = exp(s − lse) (the forward's probabilities, rebuilt from the saved lse):
        dv = pᵀ·do,   dp = do·vᵀ,   ds = p ∘ (dp − δ),   dq = scale·ds·k,   dk = scale·dsᵀ·q
    where δ_i = Σ_j p_ij·dp_ij = Σ_d do_id·o_id: one number per query, cheaper from o than from p.

Kernels, in the order they run
    ``_attention_bwd_delta_kernel``   δ = rowsum(do ∘ o), one read of do and o
    ``_attention_bwd_dkdv_kernel``    one program per (key block, batch·kv head): its k, v and the dk, dv
                                      accumulators stay in registers while it walks the query blocks
                                      that see those keys, recomputing p and ds tile by tile (with
                                      grouped-query attention, those of every query head of the group)
    ``_attention_bwd_dq_kernel``      one program per (query block, batch·head): its q, do and the dq
                                      accumulator stay in registers while it walks the key blocks

The one idea that makes it fast
    Recompute instead of store. Keeping p for the backward would write seq² numbers per head in the
    forward and read them back here: exactly the memory traffic flash attention exists to remove.
    One log-sum-exp per query rebuilds any tile of p from q and k for the price of one more q·kᵀ
    matmul; on a GPU that does ~300 FLOPs in the time it moves one byte, FLOPs are the cheap side.

    Two kernels instead of atomics. dk and dv are sums over queries, dq a sum over keys: no single
    tiling owns both. The program owning a key block sums dk and dv in registers and writes them
    once; dq would then need atomic float adds from every key block, whose order (and so whose
    rounding) changes from run to run. A second kernel owning query blocks recomputes p and ds to
    sum dq instead: two more matmuls per tile (seven against five), and bit-identical results on
    every run. It is faster too, in Triton 3.6 on an H200: the dk, dv program adding dq with atomics (or
    with TMA's bulk reduce) took 1.23 ms against 1.18 at (2, 16, 4096, 128) and 0.221 against 0.184 at
    GPT-2's (8, 12, 1024, 64), a third register tile costing more than two matmuls
    (profiling/results/h200/attention-probes-a50d9ec.md). Both kernels skip masked-out blocks and mask
    only the straddling ones, as the forward does.

Launch
    ``backward_tiles``: per tile width (the head dim rounded up to a power of two), measured on an H100
    (see BACKWARD_TILES). float32 and float64 take the forward's ``wide_float_tile`` for both kernels.

Measured (H100 80GB HBM3, Triton 3.6, bfloat16, causal, batch 4, 16 heads, seq 4096, head_dim 128)
    with the 4-warp dk, dv tile of 64 keys (before the H200's measurement in BACKWARD_TILES):
    dk, dv 1.55 ms (356 TFLOP/s of its four matmuls), dq 0.79 ms (525 TFLOP/s of its three); forward
    and backward through autograd 2.99 ms against 3.61 ms for PyTorch SDPA on its flash backend
    (×1.21). Two runs of the backward give identical bits.
    head_dim 64, 32, 16: forward + backward 1.62, 1.13, 0.89 ms; SDPA flash 2.07, 1.41, 1.49 ms.

Limits
    As the forward: head_dim a multiple of 8 up to 256; grouped-query attention; any lengths; float16,
    bfloat16, float32, float64 on the GPU (accumulating in float32, float64 for float64); float32 and float64
    under the interpreter.

Check
    python -m pytest tests -k "attention and triton"
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention_tiles import (
    AttentionTile,
    check_attention_shapes,
    empty_gradient,
    head_rows,
    head_strides,
    key_block_range,
    keys_visible,
    load_per_query,
    load_rows,
    padded_head_dim,
    query_block_of_program,
    readable,
    store_rows,
    wide_float_tile,
)
from .launch import (
    LOG2E,
    SignatureTable,
    cdiv,
    check_inputs,
    compute_dtype,
    dot_input_precision,
    launch,
    on_device,
    split_float,
)


class BackwardTiles(NamedTuple):
    key_blocks: AttentionTile  # dk, dv kernel: block_n keys owned per program, block_m queries a step
    query_blocks: AttentionTile  # dq kernel: block_m queries owned per program, block_n keys a step


BACKWARD_TILES = {
    16: BackwardTiles(AttentionTile(32, 128, 4, 3), AttentionTile(64, 64, 4, 3)),
    32: BackwardTiles(AttentionTile(32, 64, 4, 3), AttentionTile(64, 64, 4, 3)),
    64: BackwardTiles(AttentionTile(32, 64, 4, 3), AttentionTile(64, 64, 4, 3)),
    128: BackwardTiles(AttentionTile(64, 128, 8, 3), AttentionTile(128, 64, 8, 3)),
    256: BackwardTiles(AttentionTile(32, 32, 8, 2), AttentionTile(64, 32, 8, 2)),
}
"""Backward tiles for float16 and bfloat16, per head dim, measured on an H100 (batch 4, 16 heads,
seq 4096, causal, bfloat16) and at head_dim 128 on an H200. A dk, dv program holds two float32
(block_n, head_dim) accumulators besides k and v, so at 4 warps its key block stays at 64 (128 at
head_dim 16) and its query steps are small. At head_dim 128, 8 warps hold 128 keys: (64 queries a step,
128 keys, 8 warps, 3 stages), about 160 KB of shared memory for k, v and three stages of q, do, ran the
backward in 1.15 ms at (2, 16, 4096, 128) on an H200, against 1.28 ms for (32, 64, 4, 3), the H100's
choice, 1.21 ms in 2 stages, 1.31 ms with 128-query steps and 1.64 ms with 64 keys at 8 warps
(profiling/results/h200/attention-backward-tiles-128.md). At head_dim 64 the 4-warp tile stays: eight
others took 1.39-2.18 ms against its 1.32-1.36 at (16, 16, 2048, 64).
The dq program holds one float32 (block_m, head_dim) accumulator: 128 queries at head_dim 128 against
64-key blocks, 64 queries of 4 warps up to head_dim 64, where twice the programs beat 128-query ones of 8
warps (profiling/results/h100/attention-backward-tiles.md).
Tile width 256 (head dims 136 … 256), by arithmetic and not yet measured: a dk, dv program of 32 keys
holds 2 × 32 × 256 float32 accumulators, 64 registers a thread over 8 warps, and k, v plus 2 stages of
32-query q, do blocks take 32 + 64 = 96 KB of shared memory; the dq program is the forward's 64 × 32."""

DELTA_ROWS = 64
"""Queries per program of the δ kernel: 64 rows of do and o, 16 KB at head_dim 128 in 16 bits."""


def backward_tiles(block_d: int, dtype: torch.dtype) -> BackwardTiles:
    if dtype.itemsize == 2:
        return BACKWARD_TILES[block_d]
    return BackwardTiles(wide_float_tile(block_d), wide_float_tile(block_d))


@triton.jit(do_not_specialize=["query_length"])
def _attention_bwd_delta_kernel(Out, DOut, Delta, query_length, heads, stride_ob, stride_oh, stride_om, stride_dob,
                                stride_doh, stride_dom, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_ROWS: tl.constexpr, COMPUTE: tl.constexpr):
    # Program (batch·head, i): queries i·BLOCK_ROWS … of one head. (batch·head on the grid's first axis,
    # which takes 2^31 − 1 programs; the second takes 65,535.)
    batch_head = tl.program_id(0).to(tl.int64)
    Out, stride_om = head_rows(Out, batch_head, heads, stride_ob, stride_oh, stride_om)
    DOut, stride_dom = head_rows(DOut, batch_head, heads, stride_dob, stride_doh, stride_dom)
    queries = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    o = load_rows(Out, queries, query_length, stride_om, HEAD_DIM, BLOCK_D, True).to(COMPUTE)
    do = load_rows(DOut, queries, query_length, stride_dom, HEAD_DIM, BLOCK_D, True).to(COMPUTE)
    tl.store(Delta + batch_head * query_length + queries, tl.sum(o * do, axis=1), mask=queries < query_length)


# --- dk, dv: a program per key block ------------------------------------------------------------------


@triton.jit
def _query_block_range(first_key, query_length, key_length, window, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """The queries that see the keys first_key … first_key + BLOCK_N − 1, as three runs of query
    blocks: [lo, full_lo) straddles the diagonal (masked), [full_lo, full_hi) sees every key of the
    block (no mask), [full_hi, hi) straddles the window's trailing edge or the end of the queries
    (masked). The mirror image of ``key_block_range``."""
    lo = tl.zeros((), tl.int32)
    full_lo = lo
    full_hi = query_length // BLOCK_M * BLOCK_M
    hi = query_length
    if CAUSAL:
        offset = key_length - query_length  # query i sits at position i + offset
        last_key = tl.minimum(first_key + BLOCK_N, key_length) - 1
        lo = tl.maximum(first_key - offset, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(last_key - offset, 0), BLOCK_M) * BLOCK_M
        if WINDOWED:  # query i sees key j while j > i + offset − window, that is i < j − offset + window
            hi = tl.minimum(tl.maximum(last_key - offset + window, 0), query_length)
            full_hi = tl.minimum(tl.maximum(first_key - offset + window, 0), query_length) // BLOCK_M * BLOCK_M
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _attention_bwd_dkdv_inner(dk, dv, k, v, Q, DOut, LSE, Delta, q_row_stride, do_row_stride, keys, start, end,
                              query_length, key_length, window, qk_scale, HEAD_DIM: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                              MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    """Add the query blocks start … end into a key block's dk and dv. Tiles are (keys, queries):
    transposed, so that the sums over queries are matmuls that land in dk and dv directly."""
    for block_start in range(start, end, BLOCK_M):
        queries = block_start + tl.arange(0, BLOCK_M)
        # rows past query_length read as q = do = 0, so they add nothing to dk and dv
        q = load_rows(Q, queries, query_length, q_row_stride, HEAD_DIM, BLOCK_D, MASKED)
        do = load_rows(DOut, queries, query_length, do_row_stride, HEAD_DIM, BLOCK_D, MASKED)
        lse = load_per_query(LSE, queries, query_length, MASKED)
        delta = load_per_query(Delta, queries, query_length, MASKED)
        # pᵀ rebuilt from the saved log-sum-exp, in base 2 as the forward computed it
        p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - (lse * LOG2E)[None, :])
        if MASKED:
            p_t = tl.where(keys_visible(queries[None, :], keys[:, None], query_length, key_length, window,
                                    CAUSAL, WINDOWED), p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION, out_dtype=dv.dtype)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION, out_dtype=dk.dtype)
    return dk, dv


@triton.jit(do_not_specialize=["query_length", "key_length", "window"])
def _attention_bwd_dkdv_kernel(Q, K, V, DOut, LSE, Delta, DK, DV, query_length, key_length, heads, group, window,
                               scale_high, scale_low, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                               stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom, stride_dkb,
                               stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr,
                               CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, COMPUTE: tl.constexpr,
                               DOT_PRECISION: tl.constexpr):
    # Key blocks fastest, in order: with a causal mask the first key blocks are seen by the most
    # queries, so the longest programs start first. A program owns a block of one kv head. k and v are
    # strided as they came, dk and dv as the launcher laid them out (attention_tiles.empty_gradient).
    key_blocks = tl.cdiv(key_length, BLOCK_N)
    first_key = tl.program_id(0) % key_blocks * BLOCK_N
    kv_head = (tl.program_id(0) // key_blocks).to(tl.int64)
    K, stride_kn = head_rows(K, kv_head, heads // group, stride_kb, stride_kh, stride_kn)
    V, stride_vn = head_rows(V, kv_head, heads // group, stride_vb, stride_vh, stride_vn)
    DK, stride_dkn = head_rows(DK, kv_head, heads // group, stride_dkb, stride_dkh, stride_dkn)
    DV, stride_dvn = head_rows(DV, kv_head, heads // group, stride_dvb, stride_dvh, stride_dvn)

    keys = first_key + tl.arange(0, BLOCK_N)
    k = load_rows(K, keys, key_length, stride_kn, HEAD_DIM, BLOCK_D, True)
    v = load_rows(V, keys, key_length, stride_vn, HEAD_DIM, BLOCK_D, True)
    scale = tl.cast(scale_high, COMPUTE) + tl.cast(scale_low, COMPUTE)
    dk = tl.zeros((BLOCK_N, BLOCK_D), COMPUTE)
    dv = tl.zeros((BLOCK_N, BLOCK_D), COMPUTE)

    lo, full_lo, full_hi, hi = _query_block_range(first_key, query_length, key_length, window, BLOCK_M, BLOCK_N,
                                                  CAUSAL, WINDOWED)
    # Grouped-query attention: every query head of the group reads these keys, so this program walks
    # them one after another into the same registers. dk and dv are summed over the group in one fixed
    # order, with no atomics: bit-identical on every run.
    for head in range(group):
        batch_head = kv_head * group + head
        Qh, q_row = head_rows(Q, batch_head, heads, stride_qb, stride_qh, stride_qm)
        DOuth, do_row = head_rows(DOut, batch_head, heads, stride_dob, stride_doh, stride_dom)
        LSEh = LSE + batch_head * query_length
        Deltah = Delta + batch_head * query_length
        dk, dv = _attention_bwd_dkdv_inner(dk, dv, k, v, Qh, DOuth, LSEh, Deltah, q_row, do_row, keys, lo,
                                           full_lo, query_length, key_length, window, scale * LOG2E, HEAD_DIM,
                                           BLOCK_D, BLOCK_M, True, CAUSAL, WINDOWED, DOT_PRECISION)
        dk, dv = _attention_bwd_dkdv_inner(dk, dv, k, v, Qh, DOuth, LSEh, Deltah, q_row, do_row, keys,
                                           full_lo, full_hi, query_length, key_length, window, scale * LOG2E,
                                           HEAD_DIM, BLOCK_D, BLOCK_M, False, CAUSAL, WINDOWED, DOT_PRECISION)
        dk, dv = _attention_bwd_dkdv_inner(dk, dv, k, v, Qh, DOuth, LSEh, Deltah, q_row, do_row, keys,
                                           full_hi, hi, query_length, key_length, window, scale * LOG2E, HEAD_DIM,
                                           BLOCK_D, BLOCK_M, True, CAUSAL, WINDOWED, DOT_PRECISION)
    store_rows(DK, keys, key_length, stride_dkn, dk * scale, HEAD_DIM, BLOCK_D)
    store_rows(DV, keys, key_length, stride_dvn, dv, HEAD_DIM, BLOCK_D)


# --- dq: a program per query block --------------------------------------------------------------------


@triton.jit
def _attention_bwd_dq_inner(dq, q, do, lse2, delta, K, V, k_row_stride, v_row_stride, queries, start, end,
                            query_length, key_length, window, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_N: tl.constexpr,
                            MASKED: tl.constexpr,
                            CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Add the key blocks start … end into a query block's dq."""
    for block_start in range(start, end, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        k = load_rows(K, keys, key_length, k_row_stride, HEAD_DIM, BLOCK_D, MASKED)
        v = load_rows(V, keys, key_length, v_row_stride, HEAD_DIM, BLOCK_D, MASKED)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(keys_visible(queries[:, None], keys[None, :], query_length, key_length, window, CAUSAL,
                                  WINDOWED), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION, out_dtype=dq.dtype)
    return dq


@triton.jit(do_not_specialize=["query_length", "key_length", "window"])
def _attention_bwd_dq_kernel(Q, K, V, DOut, LSE, Delta, DQ, query_length, key_length, heads, group, window,
                             scale_high, scale_low, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                             stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom, stride_dqb,
                             stride_dqh, stride_dqm,
                             HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr,
                             CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, COMPUTE: tl.constexpr,
                             DOT_PRECISION: tl.constexpr):
    first_query, batch_head = query_block_of_program(query_length, BLOCK_M)  # the forward's grid and order
    Q, stride_qm = head_rows(Q, batch_head, heads, stride_qb, stride_qh, stride_qm)
    DOut, stride_dom = head_rows(DOut, batch_head, heads, stride_dob, stride_doh, stride_dom)
    DQ, stride_dqm = head_rows(DQ, batch_head, heads, stride_dqb, stride_dqh, stride_dqm)
    LSE += batch_head * query_length
    Delta += batch_head * query_length
    kv_head = batch_head // group  # the kv head of this query head's group
    K, stride_kn = head_rows(K, kv_head, heads // group, stride_kb, stride_kh, stride_kn)
    V, stride_vn = head_rows(V, kv_head, heads // group, stride_vb, stride_vh, stride_vn)

    queries = first_query + tl.arange(0, BLOCK_M)
    q = load_rows(Q, queries, query_length, stride_qm, HEAD_DIM, BLOCK_D, True)
    do = load_rows(DOut, queries, query_length, stride_dom, HEAD_DIM, BLOCK_D, True)
    lse2 = load_per_query(LSE, queries, query_length, True) * LOG2E
    delta = load_per_query(Delta, queries, query_length, True)
    scale = tl.cast(scale_high, COMPUTE) + tl.cast(scale_low, COMPUTE)
    dq = tl.zeros((BLOCK_M, BLOCK_D), COMPUTE)

    lo, full_lo, full_hi, hi = key_block_range(first_query, query_length, key_length, window, BLOCK_M, BLOCK_N,
                                                CAUSAL, WINDOWED)
    dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, stride_vn, queries, lo, full_lo, query_length,
                                 key_length, window, scale * LOG2E, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL,
                                 WINDOWED, DOT_PRECISION)
    dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, stride_vn, queries, full_lo, full_hi,
                                 query_length, key_length, window, scale * LOG2E, HEAD_DIM, BLOCK_D, BLOCK_N, False,
                                 CAUSAL, WINDOWED, DOT_PRECISION)
    dq = _attention_bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, stride_vn, queries, full_hi, hi, query_length,
                                 key_length, window, scale * LOG2E, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL,
                                 WINDOWED, DOT_PRECISION)
    store_rows(DQ, queries, query_length, stride_dqm, dq * scale, HEAD_DIM, BLOCK_D)


# --- launcher ------------------------------------------------------------------------------------------


def launch_attention_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, causal: bool, window: int, scale: float):
    check_attention_shapes("attention_backward", q, k, v, causal, window, like_q={"grad_out": grad_out, "out": out},
                           per_query={"lse": lse})
    check_inputs("attention_backward", grad_out, q, k, v, out, lse)
    return launch_attention_bwd_unchecked(grad_out, readable(q), readable(k), readable(v), readable(out), lse, causal,
                                          window, scale)


class BackwardLaunch(NamedTuple):
    """The backward's three launches but their tensors, for one signature of its inputs (shapes, strides,
    dtype, mask, scale): worked out once by ``launch_attention_bwd_unchecked`` and kept, as the forward's
    (attention_forward.ForwardLaunch)."""

    delta_grid: tuple[int, int]
    delta_scalars: tuple  # the δ kernel's arguments after out, grad_out and delta
    delta_constants: dict
    key_grid: tuple[int]
    key_constants: dict
    query_grid: tuple[int] | None  # None: every query sees exactly one key, and no gradient reaches q or k
    query_constants: dict
    scalars: tuple  # the dk, dv and dq kernels' arguments after their tensors
    key_gradient_strides: tuple  # then the dk, dv kernel's: the (batch, head, row) strides of dk and dv
    query_gradient_strides: tuple  # and the dq kernel's: those of dq


_BACKWARD_LAUNCHES = SignatureTable()


def _plan_backward(grad_out, q, k, v, out, grad_q, grad_k, grad_v, causal, window, scale) -> BackwardLaunch:
    batch, heads, query_length, head_dim = q.shape
    kv_heads, key_length = k.shape[1], k.shape[2]
    block_d = padded_head_dim(head_dim)
    tiles = backward_tiles(block_d, q.dtype)
    shared = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=causal, WINDOWED=causal and window > 0,
                  COMPUTE=compute_dtype(q.dtype), DOT_PRECISION=dot_input_precision(q.dtype))
    grad_out_strides = head_strides(grad_out)
    key_tile, query_tile = tiles.key_blocks, tiles.query_blocks
    # Every query sees exactly one key: each softmax is the constant 1, so no gradient reaches q or k.
    # Say so exactly, rather than as the rounding noise of dp − δ (level 1 gives zeros).
    one_key_each = key_length == 1 or (causal and window == 1)
    return BackwardLaunch(
        delta_grid=(batch * heads, cdiv(query_length, DELTA_ROWS)),
        delta_scalars=(query_length, heads, *head_strides(out), *grad_out_strides),
        delta_constants=dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_ROWS=DELTA_ROWS,
                             COMPUTE=compute_dtype(q.dtype), num_warps=4),
        key_grid=(cdiv(key_length, key_tile.block_n) * batch * kv_heads,),
        key_constants=dict(BLOCK_M=key_tile.block_m, BLOCK_N=key_tile.block_n, num_warps=key_tile.num_warps,
                           num_stages=key_tile.num_stages, **shared),
        query_grid=None if one_key_each else (cdiv(query_length, query_tile.block_m) * batch * heads,),
        query_constants=dict(BLOCK_M=query_tile.block_m, BLOCK_N=query_tile.block_n,
                             num_warps=query_tile.num_warps, num_stages=query_tile.num_stages, **shared),
        scalars=(query_length, key_length, heads, heads // kv_heads, window, *split_float(scale),
                 *head_strides(q), *head_strides(k), *head_strides(v), *grad_out_strides),
        key_gradient_strides=(*head_strides(grad_k), *head_strides(grad_v)),
        query_gradient_strides=head_strides(grad_q))


def launch_attention_bwd_unchecked(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   out: torch.Tensor, lse: torch.Tensor, causal: bool, window: int, scale: float):
    """``launch_attention_bwd`` without its checks, for the eager backward (see ``triton_kernels/__init__.py``):
    q, k, v and out readable, as the forward saved them; grad_out, autograd's, may be any view. Its
    launches are planned once per signature (``BackwardLaunch``)."""
    if q.numel() == 0 or k.numel() == 0:  # no queries, or no keys: nothing flows back
        return empty_gradient(q).zero_(), empty_gradient(k).zero_(), empty_gradient(v).zero_()
    grad_out = readable(grad_out)
    signature = (q.shape, k.shape, q.stride(), k.stride(), v.stride(), out.stride(), grad_out.stride(), q.dtype,
                 causal, window, scale)
    # Laid out by q's, k's and v's strides, which the signature holds: its plan holds the gradients' strides.
    grad_q, grad_k, grad_v = empty_gradient(q), empty_gradient(k), empty_gradient(v)
    planned = _BACKWARD_LAUNCHES.get(signature) or _BACKWARD_LAUNCHES.keep(
        signature, _plan_backward(grad_out, q, k, v, out, grad_q, grad_k, grad_v, causal, window, scale))
    delta = torch.empty_like(lse)
    with on_device(q):
        launch(_attention_bwd_delta_kernel, planned.delta_grid, out, grad_out, delta, *planned.delta_scalars,
               **planned.delta_constants)
        launch(_attention_bwd_dkdv_kernel, planned.key_grid, q, k, v, grad_out, lse, delta, grad_k, grad_v,
               *planned.scalars, *planned.key_gradient_strides, **planned.key_constants)
        if planned.query_grid is None:
            return grad_q.zero_(), grad_k.zero_(), grad_v
        launch(_attention_bwd_dq_kernel, planned.query_grid, q, k, v, grad_out, lse, delta, grad_q, *planned.scalars,
               *planned.query_gradient_strides, **planned.query_constants)
    return grad_q, grad_k, grad_v
