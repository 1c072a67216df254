"""Flash attention in Triton, the forward pass: o = softmax(q·kᵀ·scale + mask)·v without the score matrix.

What it computes
    ``_attention_fwd_kernel``, one program per (block of BLOCK_M queries, batch·head):
        for each block of BLOCK_N keys the queries can see:
            s = q·kᵀ·scale·log2(e)                     a (BLOCK_M, BLOCK_N) tile, in registers only
            m_new = max(m, rowmax s)                    running maximum per query
            p = 2^(s − m_new),  α = 2^(m − m_new)       α rescales what was summed under the old maximum
            ℓ = α·ℓ + rowsum p,  acc = α·acc + p·v
        o = acc / ℓ,   lse = (m + log2 ℓ)·ln 2          lse: the log-sum-exp of the scaled scores, saved
                                                        so that the backward can rebuild p tile by tile

The one idea that makes it fast
    Level 1 writes the (seq, seq) score matrix to memory, reads it back to softmax it, writes the
    probabilities and reads them again for p·v: time and memory grow with seq². Here a tile of
    scores lives and dies in registers. Each program loads its q block once and streams k and v
    blocks through shared memory (``num_stages`` loads in flight while the tensor cores work on the
    current one); the online softmax merges one key block at a time, so nothing of size seq² exists.
    Per program the bytes moved are q, o and the k, v it visits; the FLOPs are the two tile matmuls.

    The mask costs nothing where it is not needed. ``key_block_range`` splits the keys a query
    block can see into blocks fully visible to all its queries (no mask at all: the loop runs with
    unmasked loads and no compares) and the few blocks that straddle the causal diagonal, the
    window's trailing edge or the end of the keys (masked). Blocks no query of the block can see
    (past the diagonal, before the window) are not visited, so causal attention does half the
    work of full attention, and a sliding window makes the work grow with seq × window.

    exp2 instead of exp: the GPU's special-function unit computes 2^x in one instruction; e^x is
    2^(x·log2 e), and the factor log2 e is folded into the score scale once.

Launch
    ``forward_tile``: a fixed table per tile width for 16-bit inputs, measured on an H100 (see
    FORWARD_TILES), 4-warp tiles for head dims of two slices (SPLIT_TILES) and a smaller tile under
    a sliding window (WINDOW_TILE); float32 and float64 take
    smaller tiles (``attention_tiles.wide_float_tile``), as their products run on the CUDA cores or the
    float64 tensor cores with operands held in registers.

Measured (H100 80GB HBM3, Triton 3.6, causal, batch 4, 16 heads, CUDA-event medians)
    bfloat16, seq 4096, head_dim 128: 0.65 ms, 420 TFLOP/s. PyTorch SDPA on its flash backend takes
    0.89 ms (ours ×1.37), level 1, which materialises the scores, 11.7 ms (×18). head_dim 64, 32,
    16: 0.39, 0.32, 0.27 ms against SDPA flash's 0.52, 0.37, 0.42 ms.
    bfloat16, seq 16384, head_dim 128: causal 9.1 ms (482 TFLOP/s), window 1024 1.6 ms (×5.5).
    The window runs at ~330 TFLOP/s: each program visits only ~19 key blocks, so filling and
    draining its load pipeline weighs more than over the 128 blocks of an average causal row.
    A single key loop with the mask on a run-time branch, instead of the three runs of key blocks,
    measured 2-5 % slower for causal attention and within noise for the window.
    Tried on a stripped copy of this kernel with Triton 3.6 (bfloat16, (4, 16, 4096, 128), causal): k and v
    through device-side tensor descriptors (TMA) 0.700 ms against 0.645 with pointer loads;
    ``tl.range(..., warp_specialize=True)`` on the key loop 0.646 ms, and it failed to compile at 4 warps.
    On an H200, the next key block's q·kᵀ issued before this block's softmax (FlashAttention-3's overlap,
    by hand) ran 0.363 ms against 0.360 at (2, 16, 4096, 128), and slower at head_dim 64
    (profiling/results/h200/attention-probes-a50d9ec.md).
    None is used: on Hopper this Triton gets nothing from them for this loop, and the ~0.8× of cuDNN's
    forward that remains is what level 5's hand-written warp specialisation (attention_forward_hopper.cu) buys.
    float32 and float64 (seq 1024): 3.1 and 2.0 ms, 5.5 and 8.8 TFLOP/s (CUDA cores, float64
    tensor cores).

Limits
    head_dim a multiple of 8 up to 256 (80, 96 and 136 … 192 as two power-of-two column slices, the others,
    72 and 88 among them, on a tile padded to a power of two: attention_tiles.head_dim_slices); k and v may have
    fewer heads than q (grouped-query attention); any sequence lengths (the last blocks are masked); float16,
    bfloat16, float32 (exact "ieee" products, no TF32) and float64 on the GPU, accumulating in float32
    (float64 for float64); float32 and float64 under the CPU interpreter. (B, H, L, D) inputs, read where
    they lie when their rows are (``attention_tiles.readable``); the output is laid out (B, L, H, D).

Check
    python -m pytest tests -k "attention and triton"
    python -m profiling --component attention --shape 4 16 4096 128 --dtype bfloat16 --backward
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention_tiles import (
    AttentionTile,
    check_attention_shapes,
    attention_output_stride,
    head_dim_slices,
    head_rows,
    head_strides,
    key_block_range,
    keys_visible,
    load_columns,
    padded_head_dim,
    query_block_of_program,
    readable,
    row_strides,
    store_columns,
    wide_float_tile,
)
from .launch import (
    LOG2E,
    SignatureTable,
    accumulator_dtype,
    cdiv,
    check_inputs,
    compute_dtype,
    dot_input_precision,
    launch,
    on_device,
    split_float,
)

LN2 = tl.constexpr(0.6931471805599453)  # ln(2): back from base 2 to the natural log-sum-exp


FORWARD_TILES = {
    16: AttentionTile(128, 64, 4, 3),
    32: AttentionTile(128, 64, 4, 3),
    64: AttentionTile(128, 64, 8, 3),
    128: AttentionTile(128, 64, 8, 3),
    256: AttentionTile(128, 64, 8, 2),
}
"""Forward tiles for float16 and bfloat16, per tile width (the head dim rounded up to a power of two,
``padded_head_dim``), measured on an H100 (batch 4, 16 heads,
seq 4096, causal, bfloat16). 128 queries a program: two warpgroups of the tensor cores' 64-row
instructions, and each k, v block loaded is reused by 128 queries. Key blocks of 64 keep the score
tile, the accumulator and three loads in flight within the registers and shared memory of one SM.
At head_dim 128: (128, 64, 8 warps, 3 stages) 0.650 ms; 4 stages 0.668; 2 stages 0.810 (the loads
no longer hide behind the matmuls); 128-key blocks 0.688-0.738; 64 queries and 4 warps 0.725.
At head_dim 256 the same 128 × 64 tile in 2 stages (q 64 KB and 2 × (k + v) 128 KB of shared memory,
one program an SM) takes 1.29 ms, 425 TFLOP/s, as fast as head_dim 128; 64 queries a program (64 × 32
or 64 × 64 blocks, 4 or 8 warps) 1.71-3.46 ms: a k, v block reused by half as many queries doubles the
shared-memory traffic per product, which at 256 columns is what limits; 1 stage 1.64 ms."""

SPLIT_TILES = {
    16: AttentionTile(64, 64, 4, 3),
    32: AttentionTile(128, 64, 4, 3),
}
"""The forward tiles for head dims that run as a 64-column slice and a second one (80 and 96,
``head_dim_slices``), 16-bit inputs, by the second slice's width. 4 warps: with the accumulator 80-96
columns wide, 4 warps hold it in registers (80 a thread at 128 queries) and the two products of a block
issue from one warpgroup each, where 8 warps split each product in halves too small to keep the tensor
cores fed. Measured on an H100 (4, 16, 4096, causal, bfloat16) with 128 queries a program: head_dim 80
0.501 ms, 343 TFLOP/s (0.81× head_dim 128's 423) against 0.616 ms with 8 warps and 0.672 ms on the
padded 128-wide tile; head_dim 96 0.557 ms, 370 TFLOP/s (0.88×) against 0.624 and 0.673.
A 16-column second slice (head dim 80) then takes 64 queries a program: on an H200 ((2, 16, 4096),
causal, bfloat16, timed in turns beside head_dim 128's own tile, two rounds; ``profiling/results/h200``,
session of 2026-11-29, seventh) head_dim 80 ran at 0.816× head_dim 128's TFLOP/s with (64, 64, 4 warps, 3
stages) against 0.790× with (128, 64, 4, 3), 0.788× in 4 stages, 0.70× with 32-key blocks, 128-key
blocks or 8 warps. The 32-column slice of 96 keeps 128 queries (0.885×; 64 queries there not measured)."""


WINDOW_TILE = AttentionTile(64, 64, 4, 3)
"""The forward tile for 16-bit inputs under a sliding window. A program then visits only about
(window + BLOCK_M) / BLOCK_N key blocks, so there is little loop to pipeline and the grid, not the
loop, decides the time: 64 queries a program doubles the programs and halves the last wave's idle
SMs. Measured on an H100 (bfloat16, (1, 4, 16384, 128), window 1024, do_bench): 0.110 ms against
0.121 ms with the causal tile (128, 64, 8, 3), whose full causal run takes 0.561 ms (64-query tiles
there: 0.635 ms). The window keeps the causal tile at width 256 (chosen by arithmetic, not measured)."""


@functools.cache  # a launch asks for its tile on every call
def forward_tile(head_dim: int, dtype: torch.dtype, windowed: bool = False) -> AttentionTile:
    block_d = padded_head_dim(head_dim)
    if dtype.itemsize != 2:
        return wide_float_tile(block_d)
    if windowed and block_d <= 128:
        return WINDOW_TILE
    main, rest = head_dim_slices(head_dim)
    return SPLIT_TILES[rest] if rest and main <= 64 else FORWARD_TILES[block_d]


# --- forward -----------------------------------------------------------------------------------------


@triton.jit
def merge_key_blocks(acc, acc_rest, row_sum, row_max, q, q_rest, K, V, k_row_stride, v_row_stride, queries, start, end,
                     query_length, key_length, window, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     REST_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                     WINDOWED: tl.constexpr, DOT_PRECISION: tl.constexpr, EXP2: tl.constexpr):
    """Merge the key blocks start … end into the running (acc, row_sum, row_max) of a query block: the
    online softmax, a tile of scores living and dying in registers. With EXP2 (level 4's way) the
    scores come in base-2 units, qk_scale holding log2(e); without it they are natural, for plain exp
    (attention_versions.py's version 2). REST_D > 0: the head dim's columns BLOCK_D … BLOCK_D + REST_D − 1
    are a second slice (``head_dim_slices``), q_rest and acc_rest its query tile and accumulator; with
    REST_D = 0 those two are passed through untouched."""
    for block_start in range(start, end, BLOCK_N):
        keys = block_start + tl.arange(0, BLOCK_N)
        k = load_columns(K, keys, key_length, k_row_stride, HEAD_DIM, 0, BLOCK_D, MASKED)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if REST_D > 0:
            k_rest = load_columns(K, keys, key_length, k_row_stride, HEAD_DIM, BLOCK_D, REST_D, MASKED)
            scores = tl.dot(q_rest, tl.trans(k_rest), scores, input_precision=DOT_PRECISION, out_dtype=scores.dtype)
        if MASKED:
            scores = tl.where(keys_visible(queries[:, None], keys[None, :], query_length, key_length, window,
                                       CAUSAL, WINDOWED), scores, float("-inf"))
        # The scale goes into the exponent's argument, not onto the scores first: the max of the raw scores,
        # scaled once, is the max of the scaled ones (qk_scale > 0 keeps their order), and each score then
        # costs one fused multiply-add, scores·scale − shift, where scaling them first cost a multiply and a
        # subtraction. (H200, bfloat16, causal, (4, 16, 4096, 128): 386 → 410 TFLOP/s.)
        new_max = tl.maximum(row_max, tl.max(scores, axis=1) * qk_scale)
        # A query whose keys so far were all masked still has maximum −inf: shift by 0 there, so that
        # 2^(−inf − shift) is 0 instead of NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        if EXP2:
            p = tl.exp2(scores * qk_scale - shift[:, None])
            rescale = tl.exp2(row_max - shift)
        else:
            p = tl.exp(scores * qk_scale - shift[:, None])
            rescale = tl.exp(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, axis=1)
        v = load_columns(V, keys, key_length, v_row_stride, HEAD_DIM, 0, BLOCK_D, MASKED)
        # p goes into the second matmul in the inputs' precision, as tensor cores take it; acc stays in
        # the compute precision (out_dtype: a float64 accumulator must say so, tl.dot's default is float32).
        p = p.to(v.dtype)
        acc = tl.dot(p, v, acc * rescale[:, None], input_precision=DOT_PRECISION, out_dtype=acc.dtype)
        if REST_D > 0:
            v_rest = load_columns(V, keys, key_length, v_row_stride, HEAD_DIM, BLOCK_D, REST_D, MASKED)
            acc_rest = tl.dot(p, v_rest, acc_rest * rescale[:, None], input_precision=DOT_PRECISION,
                              out_dtype=acc_rest.dtype)
        row_max = new_max
    return acc, acc_rest, row_sum, row_max


@triton.jit(do_not_specialize=["query_length", "key_length", "window"])
def _attention_fwd_kernel(Q, K, V, Out, LSE, query_length, key_length, heads, group, window, scale_high, scale_low,
                          stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                          stride_vn, stride_ob, stride_oh, stride_om,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, REST_D: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, COMPUTE: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    first_query, batch_head = query_block_of_program(query_length, BLOCK_M)
    Q, stride_qm = head_rows(Q, batch_head, heads, stride_qb, stride_qh, stride_qm)
    Out, stride_om = head_rows(Out, batch_head, heads, stride_ob, stride_oh, stride_om)
    LSE += batch_head * query_length
    kv_head = batch_head // group  # the kv head of this query head's group
    K, stride_kn = head_rows(K, kv_head, heads // group, stride_kb, stride_kh, stride_kn)
    V, stride_vn = head_rows(V, kv_head, heads // group, stride_vb, stride_vh, stride_vn)

    queries = first_query + tl.arange(0, BLOCK_M)
    q = load_columns(Q, queries, query_length, stride_qm, HEAD_DIM, 0, BLOCK_D, True)  # on chip for the whole loop
    qk_scale = (tl.cast(scale_high, COMPUTE) + tl.cast(scale_low, COMPUTE)) * LOG2E
    acc = tl.zeros((BLOCK_M, BLOCK_D), COMPUTE)
    q_rest, acc_rest = q, acc  # one slice: placeholders merge_key_blocks passes through
    if REST_D > 0:
        q_rest = load_columns(Q, queries, query_length, stride_qm, HEAD_DIM, BLOCK_D, REST_D, True)
        acc_rest = tl.zeros((BLOCK_M, REST_D), COMPUTE)
    row_sum = tl.zeros((BLOCK_M,), COMPUTE)
    row_max = tl.full((BLOCK_M,), float("-inf"), COMPUTE)

    lo, full_lo, full_hi, hi = key_block_range(first_query, query_length, key_length, window, BLOCK_M,
                                                BLOCK_N, CAUSAL, WINDOWED)
    acc, acc_rest, row_sum, row_max = merge_key_blocks(
        acc, acc_rest, row_sum, row_max, q, q_rest, K, V, stride_kn, stride_vn, queries, lo, full_lo, query_length,
        key_length, window, qk_scale, HEAD_DIM, BLOCK_D, REST_D, BLOCK_N, True, CAUSAL, WINDOWED, DOT_PRECISION, True)
    acc, acc_rest, row_sum, row_max = merge_key_blocks(
        acc, acc_rest, row_sum, row_max, q, q_rest, K, V, stride_kn, stride_vn, queries, full_lo, full_hi, query_length,
        key_length, window, qk_scale, HEAD_DIM, BLOCK_D, REST_D, BLOCK_N, False, CAUSAL, WINDOWED, DOT_PRECISION, True)
    acc, acc_rest, row_sum, row_max = merge_key_blocks(
        acc, acc_rest, row_sum, row_max, q, q_rest, K, V, stride_kn, stride_vn, queries, full_hi, hi, query_length,
        key_length, window, qk_scale, HEAD_DIM, BLOCK_D, REST_D, BLOCK_N, True, CAUSAL, WINDOWED, DOT_PRECISION, True)
    # Rows past query_length saw only padding: their ℓ may be 0, and their stores are masked.
    query_mask = queries < query_length
    row_sum = tl.where(query_mask, row_sum, 1.0)
    inverse_sum = (1.0 / row_sum)[:, None]
    store_columns(Out, queries, query_length, stride_om, acc * inverse_sum, HEAD_DIM, 0, BLOCK_D)
    if REST_D > 0:
        store_columns(Out, queries, query_length, stride_om, acc_rest * inverse_sum, HEAD_DIM, BLOCK_D, REST_D)
    tl.store(LSE + queries, (row_max + tl.log2(row_sum)) * LN2, mask=query_mask)


def checked_readable_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v checked (shapes, dtypes, device) and made readable (``attention_tiles.readable``)."""
    check_attention_shapes("attention_forward", q, k, v, causal, window)
    check_inputs("attention_forward", q, k, v)
    return readable(q), readable(k), readable(v)


class ForwardLaunch(NamedTuple):
    """Everything one forward call launches but its tensors, for one signature of the inputs (shapes,
    strides, dtypes, devices, mask, scale). ``forward_launch`` works it out once, checks included, and
    keeps it: a decode step or a training step calls with the same signature every time, and per call
    the checks, the tile table and the stride arithmetic cost more host time than a short kernel takes
    on the GPU (profiling/results/h100/attention-host-path.md)."""

    programs: int  # 0: nothing to launch (no queries, or no keys to attend)
    out_stride: tuple[int, ...]  # attention_tiles.attention_output_stride
    lse_dtype: torch.dtype
    scalars: tuple  # the kernel's arguments after its five tensors
    constants: dict

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) of q, k, v of this launch's signature, as ``forward_launch`` returned them."""
        out = q.new_empty_strided(q.shape, self.out_stride)
        lse = q.new_empty(q.shape[:3], dtype=self.lse_dtype)
        if not self.programs:
            # No queries, or (full attention only) no keys: a softmax over none is an empty sum, as level 1 gives.
            return out.zero_(), lse.fill_(float("-inf"))
        with on_device(q):
            launch(_attention_fwd_kernel, (self.programs,), q, k, v, out, lse, *self.scalars, **self.constants)
        return out, lse


_FORWARD_LAUNCHES = SignatureTable()
_GROWING_KEYS_LAUNCHES = SignatureTable()
"""Plans for a decode loop over a growing KV cache, keyed on all of the signature but the key length and the
k and v strides: those change at every step, as the cache grows by a token, and only they do. A kept plan
serves the next step with them filled in (``_forward_scalars``), after the checks that read them."""


def forward_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, ForwardLaunch]:
    """(q, k, v, launch): the operands as the kernel reads them, checked and made readable
    (``checked_readable_inputs``), and the ``ForwardLaunch`` of their signature. A signature seen before
    whose operands were read where they lie skips the checks: they read nothing but the signature. So does
    one that differs from such a signature only in its key length and the k and v strides (a growing KV
    cache), but for the checks that read those."""
    signature = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                 q.device, k.device, v.device, causal, window, scale)
    known = _FORWARD_LAUNCHES.get(signature)
    if known is not None:
        return q, k, v, known
    # k.shape[:2] and [3:]: all but the key length, and a k of another rank never matches.
    growing_keys = (q.shape, q.stride(), k.shape[:2], k.shape[3:], v.shape[:2], v.shape[3:], q.dtype, k.dtype,
                    v.dtype, q.device, k.device, v.device, causal, window, scale)
    grown = _GROWING_KEYS_LAUNCHES.get(growing_keys)
    if (grown is not None and v.shape[2] == k.shape[2] >= (q.shape[2] if causal else 1)
            and readable(k) is k and readable(v) is v):
        # Kept under this step's own signature too: every layer of a model attends with the same one.
        return q, k, v, _FORWARD_LAUNCHES.keep(
            signature, grown._replace(scalars=_forward_scalars(q, k, v, window, scale, grown.out_stride)))
    read_q, read_k, read_v = checked_readable_inputs(q, k, v, causal, window)
    known = _plan_forward(read_q, read_k, read_v, causal, window, scale)
    if read_q is q and read_k is k and read_v is v:
        _FORWARD_LAUNCHES.keep(signature, known)
        if known.programs:
            _GROWING_KEYS_LAUNCHES.keep(growing_keys, known)
    return read_q, read_k, read_v, known


def _plan_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
                  scale: float) -> ForwardLaunch:
    batch, heads, query_length, head_dim = q.shape
    key_length = k.shape[2]
    out_stride, lse_dtype = attention_output_stride(q.shape), accumulator_dtype(q.dtype)
    if not (q.numel() and key_length):  # an empty output, or (full attention only) no keys to attend
        return ForwardLaunch(0, out_stride, lse_dtype, (), {})
    block_d, rest_d = head_dim_slices(head_dim)
    tile = forward_tile(head_dim, q.dtype, windowed=causal and window > 0)
    return ForwardLaunch(
        programs=cdiv(query_length, tile.block_m) * batch * heads,
        out_stride=out_stride,
        lse_dtype=lse_dtype,
        scalars=_forward_scalars(q, k, v, window, scale, out_stride),
        constants=dict(HEAD_DIM=head_dim, BLOCK_D=block_d, REST_D=rest_d, BLOCK_M=tile.block_m,
                       BLOCK_N=tile.block_n, CAUSAL=causal, WINDOWED=causal and window > 0,
                       COMPUTE=compute_dtype(q.dtype), DOT_PRECISION=dot_input_precision(q.dtype),
                       num_warps=tile.num_warps, num_stages=tile.num_stages))


def _forward_scalars(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float,
                     out_stride: tuple[int, ...]) -> tuple:
    """The kernel's arguments after its five tensors, for readable q, k, v."""
    heads = q.shape[1]
    return (q.shape[2], k.shape[2], heads, heads // k.shape[1], window, *split_float(scale), *head_strides(q),
            *head_strides(k), *head_strides(v), *row_strides(q.shape, out_stride))


def launch_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q, k, v: checked, read where they lie or copied once, launched."""
    q, k, v, forward = forward_launch(q, k, v, causal, window, scale)
    return forward(q, k, v)
