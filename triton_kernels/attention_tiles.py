"""What the flash-attention kernels of both directions share (attention_forward.py, attention_backward.py):
the tile shape, the input checks, and the @triton.jit helpers every kernel calls: which query block a
program owns, masked and unmasked row loads, the visibility mask, and the runs of key blocks a query
block sees. Each is written once, so the forward and the two backward kernels mask alike.

Head dims that are not a power of two. ``tl.arange`` (and so every tile) needs a power-of-two length,
so a head dim D runs on a tile BLOCK_D = ``padded_head_dim(D)`` wide: the tensors stay (…, D) in memory,
loads fill columns D … BLOCK_D − 1 with 0 (a zero column adds nothing to q·kᵀ, and p·v then gives zero
there) and stores skip them. At a power of two BLOCK_D == D and the column mask compiles away.

The forward goes one step further (``head_dim_slices``): 80 = 64 + 16 and 96 = 64 + 32 run as two
column slices, each a power of two, so q·kᵀ is the sum of two products and p·v fills two accumulators.
Padding 80 to 128 would spend 37.5 % of every matmul on zeros; two slices spend none.

Grouped-query attention. k and v may have fewer heads than q (H a multiple of Hkv): a program of query
head batch·H + h reads kv head batch·Hkv + h // group, which is simply (batch·H + h) // group.

Operands where they lie. Self-attention splits q, k and v off one fused projection (batch, tokens, 3, H, D)
as strided (batch, heads, tokens, head_dim) views, and merges the heads back as one row of H·D per token.
The kernels take every operand's (batch, head, row) strides (``readable``, ``head_strides``, ``head_rows``)
instead of asking for contiguous copies, and the forward writes its output token-major
(``empty_attention_output``), where copies had cost self-attention five tensors a layer, forward and
backward: q, k, v and the merged heads forward, the gradient of the output backward.
"""

import functools
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from cuda_kernels.limits import attention_head_dim_supported, unsupported_head_dim_message

from .launch import accumulator_dtype, check_contiguous, next_power_of_2, require

ROW_ALIGNMENT = tl.constexpr(8)
"""Elements that every stride of an operand the kernels read in place is a multiple of (``readable``):
16 bytes in 16-bit dtypes and more in wider ones, so rows load as 16-byte vectors (``head_rows``)."""


class AttentionTile(NamedTuple):
    """How one program of a flash-attention kernel tiles its work."""

    block_m: int  # queries per tile
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int  # loads in flight in the software pipeline of the key (or query) loop


@functools.cache  # asked on every launch; a few head dims in a program's life
def padded_head_dim(head_dim: int) -> int:
    """The tile width of a head dim: the next power of two, at least 16 (tl.dot's smallest k)."""
    return max(16, next_power_of_2(head_dim))


MIN_MAIN_SLICE = 64
"""The narrowest first slice of a two-slice head dim (``head_dim_slices``). Head dims 40 and 48 as 32 + 16
columns read past the shared memory Triton 3.6 gave the kernel (compute-sanitizer on an H100: an invalid
__shared__ read in the second slice's p·v, at 4 warps in float16), so below 64 a head dim stays on its
padded tile."""


@functools.cache
def head_dim_slices(head_dim: int) -> tuple[int, int]:
    """The forward's column slices of a head dim: (main, rest), both powers of two (rest 0: one slice),
    main + rest ≥ head_dim. Two slices where they are narrower than the padded tile and the first is at
    least MIN_MAIN_SLICE wide: 80 → (64, 16), 96 → (64, 32), 136 → (128, 16), 160 → (128, 32); 112 → (128, 0),
    since 64 + 64 would be no narrower than 128; 40 → (64, 0).

    Behind a 64-column first slice the second must be full: 72 and 88 (a 16- and a 32-column slice with
    their last 8 columns masked) read past the kernel's shared memory in causal attention (compute-sanitizer
    on an H200, Triton 3.6, float16 and bfloat16: invalid __shared__ reads of 512 and 2,048 bytes; 80 and 96,
    and 136-160 behind a 128-column slice, were clean, as were 72 and 88 on the padded tile). So 72 and 88
    take the padded 128-wide tile."""
    padded = padded_head_dim(head_dim)
    main = max(16, next_power_of_2(head_dim + 1) // 2)
    rest = 0 if head_dim <= main else max(16, next_power_of_2(head_dim - main))
    full_or_behind_wide_main = main > MIN_MAIN_SLICE or main + rest == head_dim
    usable = 0 < rest and main >= MIN_MAIN_SLICE and main + rest < padded and full_or_behind_wide_main
    return (main, rest) if usable else (padded, 0)


def wide_float_tile(block_d: int) -> AttentionTile:
    """The tile of every attention kernel for float32 and float64 inputs, by tile width. float32
    ("ieee") products run on the CUDA cores and float64 ones on the double-precision tensor cores,
    each thread holding its share of both operands in registers along the whole head dim: 32 × 32
    tiles over 8 warps fit up to head_dim 64, at 128 the key side halves to 16 (32 × 32 spilled
    registers to local memory, read off the compiler's resource report for sm_90). At 256 the query
    side halves too, over 4 warps: a 16 × 256 float32 operand is 32 registers a thread, as 32 × 128
    is over 8 (chosen by that arithmetic, not yet measured)."""
    if block_d <= 128:
        return AttentionTile(32, 32 if block_d <= 64 else 16, 8, 2)
    return AttentionTile(16, 16, 4, 2)

# --- input checks (launchers and fake implementations) ----------------------------------------------


def check_attention_shapes(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                           window: int, like_q: dict | None = None, per_query: dict | None = None) -> None:
    """q is (B, H, Lq, D), k and v are (B, Hkv, Lk, D) of q's dtype with H a multiple of Hkv, D a
    supported head dim, and causal attention has Lq ≤ Lk; ``like_q`` tensors match q, ``per_query``
    ones are (B, H, Lq) statistics in the accumulator dtype, contiguous. q, k, v and the ``like_q`` tensors
    may be strided: the launchers read them where they lie or copy them once (``readable``)."""
    require(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
            lambda: f"{op}: q, k, v must be (batch, heads, seq, head_dim), got shapes {tuple(q.shape)}, "
                    f"{tuple(k.shape)}, {tuple(v.shape)}")
    require(k.shape == v.shape and q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3]
            and (q.shape[1] == k.shape[1] or (k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0)),
            lambda: f"{op}: shapes do not fit together: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                    f"(q's heads must be a multiple of k's and v's)")
    require(k.dtype == q.dtype and v.dtype == q.dtype,
            lambda: f"{op}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    require(attention_head_dim_supported(q.shape[3]), lambda: f"{op}: {unsupported_head_dim_message(q.shape[3], 'Triton')}")
    require(window >= 0, lambda: f"{op}: window must be ≥ 0 (0: no window), got {window}")
    require(causal or window == 0, lambda: f"{op}: a sliding window (here {window}) looks back from each query, "
                                           f"so it needs causal=True")
    require(not causal or q.shape[2] <= k.shape[2],
            lambda: f"{op}: causal attention with {q.shape[2]} queries but only {k.shape[2]} keys: the first "
                    f"queries would see no key (queries are aligned to the end of the keys)")
    for name, tensor in (like_q or {}).items():
        require(tensor.shape == q.shape and tensor.dtype == q.dtype,
                lambda: f"{op}: {name} is {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(q.shape)} {q.dtype}")
    for name, tensor in (per_query or {}).items():
        require(tensor.shape == q.shape[:3] and tensor.dtype == accumulator_dtype(q.dtype),
                lambda: f"{op}: {name} is {tuple(tensor.shape)} {tensor.dtype}, expected "
                        f"{tuple(q.shape[:3])} {accumulator_dtype(q.dtype)}")
    check_contiguous(op, *(per_query or {}).values())


# --- operands where they lie ----------------------------------------------------------------------


def readable(t: torch.Tensor) -> torch.Tensor:
    """``t``, a (batch, heads, rows, head_dim) operand, if the kernels can read it where it lies, else its
    contiguous copy, made once, on purpose. Readable: the head_dim values of a row are contiguous, the
    other strides are multiples of ROW_ALIGNMENT, and a head's rows span less than 2^31 elements (row
    offsets are 32-bit in the kernels' loops). A dim of size 1 is never stepped along: its stride does
    not count."""
    size, stride = t.shape, t.stride()
    if ((size[3] > 1 and stride[3] != 1) or size[2] * stride[2] >= 2**31
            or any(size[dim] > 1 and stride[dim] % ROW_ALIGNMENT.value for dim in range(3))):
        return t.contiguous()
    return t


def head_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """The (batch, head, row) strides of a readable operand, 0 for a dim of size 1 (never stepped along,
    and so a multiple of ROW_ALIGNMENT whatever its stride was)."""
    return row_strides(t.shape, t.stride())


def row_strides(size: Sequence[int], stride: Sequence[int]) -> tuple[int, int, int]:
    """``head_strides`` of a tensor of this size and stride."""
    return tuple(step if extent > 1 else 0 for extent, step in zip(size[:3], stride[:3]))


def attention_output_stride(size: Sequence[int]) -> tuple[int, int, int, int]:
    """The strides of the forward's output (batch, heads, query_length, head_dim) laid out as (batch,
    query_length, heads, head_dim): the order in which self-attention's output projection reads the heads
    back, one row of heads·head_dim per token, so that ``out.transpose(1, 2).reshape(batch, tokens,
    width)`` is a view, not a copy (as level 5's output). (An empty dim counts as 1, as in PyTorch's
    own contiguous strides.)"""
    _, heads, query_length, head_dim = (max(extent, 1) for extent in size)
    return (query_length * heads * head_dim, head_dim, heads * head_dim, 1)


def empty_attention_output(q: torch.Tensor) -> torch.Tensor:
    """The forward's output for q, laid out as ``attention_output_stride`` says."""
    return q.new_empty_strided(q.shape, attention_output_stride(q.shape))


def empty_gradient(t: torch.Tensor) -> torch.Tensor:
    """The gradient of ``t`` before its kernel writes it, laid out as ``t`` lies: tokens first (as
    ``empty_attention_output``) where t's rows lie farther apart than its heads, as the heads of a fused
    q·k·v projection do, else contiguous.

    Why it matters: self-attention takes q, k and v apart from its (batch, tokens, 3, heads, head_dim)
    projection with ``unbind``, whose backward stacks the three gradients back into that layout. From
    gradients laid out heads first, that stack gathers every row of a head from its own place; from
    gradients laid out tokens first, each token's heads·head_dim values are one contiguous run, and the stack
    runs at copy speed (measured: profiling/results/h200/README.md, session of 2026-11-30, thirteenth). A
    contiguous t gets a contiguous gradient, so that autograd keeps it as a leaf's ``.grad`` without a copy."""
    size, stride = t.shape, t.stride()
    if size[1] > 1 and size[2] > 1 and stride[1] < stride[2]:
        return empty_attention_output(t)
    return t.new_empty(size)


# --- what every attention kernel shares: programs, loads, the mask and the blocks it leaves ------------


@triton.jit
def query_block_of_program(query_length, BLOCK_M: tl.constexpr):
    """(first query, batch·head) of this program in a flat grid over (query block, batch·head), query
    blocks fastest: programs running together share a head, so its k and v are read from DRAM once and
    then from L2. Causal blocks late in the sequence visit the most keys, so they go first and the
    short ones fill the launch's tail."""
    query_blocks = tl.cdiv(query_length, BLOCK_M)
    first_query = (query_blocks - 1 - tl.program_id(0) % query_blocks) * BLOCK_M
    return first_query, (tl.program_id(0) // query_blocks).to(tl.int64)


@triton.jit
def head_rows(Base, batch_head, heads, batch_stride, head_stride, row_stride):
    """(where head ``batch_head`` starts, how far apart its rows lie) in an operand at ``Base`` with these
    strides (``head_strides``), ``batch_head`` flat over batch·heads with ``heads`` to a batch. The strides
    come as the compiler may take them: multiples of ROW_ALIGNMENT, as ``readable`` made sure. Without that,
    a row stride not divisible by 16 (a head dim of 72, say) would hide that rows start 16 bytes apart, and
    every load would go element by element."""
    head_start = (batch_head // heads * tl.multiple_of(batch_stride, ROW_ALIGNMENT)
                  + batch_head % heads * tl.multiple_of(head_stride, ROW_ALIGNMENT))
    return Base + head_start, tl.multiple_of(row_stride, ROW_ALIGNMENT)


@triton.jit
def load_rows(Base, rows, row_count, row_stride, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """Rows ``rows`` of a (row_count, HEAD_DIM) matrix whose rows start ``row_stride`` elements apart, as
    one (rows, BLOCK_D) tile; columns past HEAD_DIM read as 0. MASKED: rows past row_count read as 0;
    blocks known to lie inside skip the compare and, at a power-of-two head dim, load as plain 16-byte
    copies."""
    return load_columns(Base, rows, row_count, row_stride, HEAD_DIM, 0, BLOCK_D, MASKED)


@triton.jit
def load_columns(Base, rows, row_count, row_stride, HEAD_DIM: tl.constexpr, FIRST: tl.constexpr, WIDTH: tl.constexpr,
                 MASKED: tl.constexpr):
    """Columns FIRST … FIRST + WIDTH − 1 of rows ``rows`` of a (row_count, HEAD_DIM) matrix, as
    ``load_rows`` (which is the slice from column 0)."""
    columns = FIRST + tl.arange(0, WIDTH)
    offsets = rows[:, None] * row_stride + columns[None, :]
    if MASKED:
        mask = (rows < row_count)[:, None]
        if FIRST + WIDTH > HEAD_DIM:
            mask = mask & (columns < HEAD_DIM)[None, :]
        tile = tl.load(Base + offsets, mask=mask, other=0.0)
    elif FIRST + WIDTH > HEAD_DIM:
        tile = tl.load(Base + offsets, mask=(columns < HEAD_DIM)[None, :], other=0.0)
    else:
        tile = tl.load(Base + offsets)
    return tile


@triton.jit
def store_rows(Base, rows, row_count, row_stride, tile, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write a (rows, BLOCK_D) ``tile`` to rows ``rows`` of a (row_count, HEAD_DIM) matrix whose rows start
    ``row_stride`` elements apart, in its dtype; rows past row_count and columns past HEAD_DIM are skipped."""
    store_columns(Base, rows, row_count, row_stride, tile, HEAD_DIM, 0, BLOCK_D)


@triton.jit
def store_columns(Base, rows, row_count, row_stride, tile, HEAD_DIM: tl.constexpr, FIRST: tl.constexpr,
                  WIDTH: tl.constexpr):
    """Write a (rows, WIDTH) ``tile`` to columns FIRST … FIRST + WIDTH − 1, as ``store_rows``."""
    columns = FIRST + tl.arange(0, WIDTH)
    offsets = rows[:, None] * row_stride + columns[None, :]
    tl.store(Base + offsets, tile.to(Base.dtype.element_ty),
             mask=(rows < row_count)[:, None] & (columns < HEAD_DIM)[None, :])


@triton.jit
def load_per_query(Base, queries, query_length, MASKED: tl.constexpr):
    """A per-query statistic (lse, δ) at ``queries``; past query_length it reads 0 when MASKED."""
    if MASKED:
        values = tl.load(Base + queries, mask=queries < query_length, other=0.0)
    else:
        values = tl.load(Base + queries)
    return values


@triton.jit
def keys_visible(queries, keys, query_length, key_length, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """Which keys each query sees, as ``levels.attention.visible_keys_mask``: ``queries`` and ``keys``
    are index blocks shaped to broadcast against each other ((M, 1) and (1, N), or transposed)."""
    visible = keys < key_length
    if CAUSAL:
        positions = queries + (key_length - query_length)  # queries are aligned to the end of the keys
        visible = visible & (keys <= positions)
        if WINDOWED:
            visible = visible & (keys > positions - window)
    return visible


@triton.jit
def key_block_range(first_query, query_length, key_length, window, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr):
    """The keys that the queries first_query … first_query + BLOCK_M − 1 see, as three runs of key
    blocks: [lo, full_lo) straddles the window's trailing edge (masked), [full_lo, full_hi) is seen
    whole by every query (no mask), [full_hi, hi) straddles the diagonal or the end of the keys
    (masked). Blocks outside [lo, hi) are seen by none and skipped."""
    lo = tl.zeros((), tl.int32)
    full_lo = lo
    full_hi = key_length // BLOCK_N * BLOCK_N
    hi = key_length
    if CAUSAL:
        first = first_query + (key_length - query_length)  # positions of the block's first and last query
        last = tl.minimum(first_query + BLOCK_M, query_length) - 1 + (key_length - query_length)
        full_hi = (first + 1) // BLOCK_N * BLOCK_N
        hi = last + 1
        if WINDOWED:
            lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
            full_lo = tl.cdiv(tl.maximum(last - window + 1, 0), BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi
