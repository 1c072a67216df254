"""A tiled matmul in Triton with fused epilogues, and a column sum: the kernels of ``linear``, ``feed_forward``
and ``linear_cross_entropy``.

What it computes
    ``_matmul_kernel``        C = A·B for A (M, K) and B (K, N) of any strides, so that transposed
                              operands (weightᵀ, grad_outᵀ) are read in place, never copied; then,
                              in registers, before the one store of each output tile, an epilogue:
            none                              C = A·B (+ bias)
            gelu                              C = gelu_tanh(A·B (+ bias))
            gelu_saving_pre_activation        H = A·B (+ bias) and C = gelu_tanh(H), both stored
            gelu_backward                     C = A·B · gelu_tanh'(H), H read from the saved tensor
            accumulate                        C += A·B, C read before the store: a sum over several
                                              launches (linear_cross_entropy's weight gradient,
                                              chunk by chunk), in float32 while A and B are 16-bit
                              and, from the A tiles the K loop loads anyway, optionally Σ_k A[m, k]:
                              a weight gradient grad_outᵀ·x reads all of grad_out along K (the
                              tokens), and grad_out's sums over the tokens are the bias gradient
    ``_column_sum_kernel``    the sums down the columns of a (rows, N) matrix (a transposed weight's bias
                              gradient, the loss's row terms)

The one idea that makes it fast
    Each program owns one (BLOCK_M, BLOCK_N) tile of C and walks K in steps of BLOCK_K, so every
    element of A is loaded N / BLOCK_N times and every element of B M / BLOCK_M times, not once per
    product. Still, a 128 × 256 tile of bfloat16 does 85 FLOPs per byte it loads, and an H100 does
    ~270 (800 TFLOP/s) in the time its DRAM delivers one byte (3 TB/s): the loads must mostly hit
    L2. Hence the grouped order (``_grouped_tile``): programs that run together cover GROUP_M
    tile-rows of C, so the A rows and B columns they share come from L2, not DRAM. ``num_stages``
    loads are in flight while the tensor cores (wgmma on Hopper) work on the current step.

    The epilogue is where the feed-forward's elementwise work goes. The output tile is still in
    registers, so the bias and the GELU cost no memory traffic, and gelu' one read of H: an unfused
    GELU reads h back and writes a again, an unfused backward writes grad_a, reads it back with h
    and writes grad_h. feed_forward.py counts the bytes, and what they came to on an H100.

Launch
    16-bit inputs: ``triton.autotune`` over TENSOR_CORE_TILES (TMA_TILES for the TMA kernel, which
    ``_tma_operands`` chooses), once per shape, layout, epilogue and dtype, timing only the tiles
    ``_tiles_worth_timing`` keeps; a small matmul takes ``small_matmul_tile``'s tile untimed (a decode
    tile for a decode step's few rows).
    The autotuner is asked once per key (``_tuned_tiles``); later calls launch its choice directly, as
    every other level-4 kernel is launched (what that saves: profiling/results/host_path.md). Each call's
    decisions make one ``MatmulLaunch`` (``plan_matmul``), which the launchers of feed_forward.py keep per
    signature of their inputs, so that a model's repeat calls only allocate and launch. float32
    (exact "ieee" products on the CUDA cores: TF32's 10-bit mantissa would miss float32's tolerance) and
    float64 (double-precision tensor cores) use WIDE_FLOAT_TILE, and Triton's CPU interpreter
    INTERPRETER_TILE: tuning there would time every candidate in a slow simulation. ``_tile_choice`` is
    the one place that decides. The column sum: two passes when there are many rows (partial sums of row
    chunks, then a sum of the partials), one otherwise.
    The row sums (a bias gradient) cost a weight gradient's matmul less than a column-sum kernel after it
    would, and two launches fewer, except where the matmul is one wave of programs and those of
    tile-column 0 set its time (profiling/results/h100/bias-gradients.md).

Measured (H100 80GB HBM3, Triton 3.6, bfloat16, GPT-2 small at 8192 tokens; the tables are in
profiling/results/h100/tma-matmul.md)
    The pointer kernel runs 0.70-0.84 × cuBLAS. cuBLAS's Hopper kernels are persistent, load through
    the tensor-memory accelerator, and overlap a tile's epilogue with the next tile's loads. Each of the
    pointer kernel's programs loads through cp.async, then stores its tile and ends.
    The TMA kernel closes most of that gap where A is read by rows. The loss's logits matmul, the
    largest in the model, runs at cuBLAS's speed. The weight gradients (A read transposed, few tiles)
    stay with the pointer kernel, which was faster there (``_tma_operands``). The GELU epilogues take the
    TMA kernel since their tanh is one instruction (``_tanh_approx``): on an H200 they then beat cuBLAS
    followed by ATen's GELU kernels (profiling/results/h200/gelu-epilogues.md). The epilogues:
    feed_forward.py.

Limits
    Any M, N, K (the edge tiles wrap their loads and mask their stores, or the TMA boxes read zeros past
    the edges); the output, the bias and H are contiguous. float16, bfloat16, float32, float64 on the
    GPU, accumulating in float32 (float64 for float64); float32 and float64 under the CPU interpreter.
    The TMA kernel needs each operand to start on 16 bytes, with its outer stride a multiple of 16 bytes;
    other operands take the pointer kernel. Autotuning compiles and times the
    candidates at each new (M, N, K) of a large matmul: the first call at a shape costs seconds, and
    must not happen inside a CUDA-graph capture.

Check
    python -m pytest tests -k "feed_forward and triton"
"""

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import (
    accumulator_dtype,
    cdiv,
    column_reduction_launch,
    compute_dtype,
    dot_input_precision,
    interpreter_is_on,
    launch,
    next_power_of_2,
    on_device,
    persistent_program_count,
)


class Epilogue:
    """What ``_matmul_kernel`` does to a tile of A·B before storing it (a constexpr: one compiled kernel each)."""

    NONE = "none"
    GELU = "gelu"
    GELU_SAVING_PRE_ACTIVATION = "gelu_saving_pre_activation"
    GELU_BACKWARD = "gelu_backward"
    ACCUMULATE = "accumulate"


# --- tiles: the one place that chooses them ---------------------------------------------------------------


class MatmulTile(NamedTuple):
    block_m: int  # rows of C per program
    block_n: int  # columns of C per program
    block_k: int  # depth of one step along K
    num_warps: int
    num_stages: int  # loads in flight in the software pipeline of the K loop


SMALL_MATMUL_TILE = MatmulTile(64, 64, 64, 4, 4)
"""The one tile of a small 16-bit matmul (see SMALL_MATMUL), and the smallest candidate."""

DECODE_MATMUL_TILE = MatmulTile(16, 64, 128, 4, 3)
"""The tile of a small 16-bit matmul of at most DECODE_ROWS rows: a decode step's tokens. Such a matmul
is a read of the weight by a few dozen programs (some hundreds for the LM head) on a GPU of 132 SMs.
SMALL_MATMUL_TILE's four stages of 64 × 64 hold 32 KB of the weight and 32 KB of A in shared memory,
64 rows of A where a decode step has 1 to 32; with 16 rows (the smallest mma.sync fragment) and
128-deep steps, three stages hold 48 KB of the weight and 12 KB of A, and a program takes half as many
steps along K. Which of these the gain comes from was not taken apart. Measured on an H200
(Triton 3.6, bfloat16, CUDA-graph replay, GPT-2 small's projections, one token): 768 → 2304 4.3 µs
(64 × 64 × 64: 8.1), 768 → 3072 4.8 (9.9), 3072 → 768 9.6 (14.6), the LM head 768 → 50304 26 (72;
cuBLAS 22); at 32 tokens it was as fast as 64 × 64 × 64 or faster at every one of them. Where the
weight has few columns, NARROW_DECODE_MATMUL_TILE beats it."""

NARROW_DECODE_MATMUL_TILE = MatmulTile(16, 32, 128, 4, 4)
"""The decode tile of a weight of at most NARROW_DECODE_COLUMNS columns: 64-column tiles of GPT-2's
768 make 12 programs for 132 SMs, and 32-column ones twice as many, each with four stages of 8 KB of the
weight in flight. Same H200 run, µs at one token and at 32: 768 → 768 3.6 and 3.5 (16 × 64 × 128: 3.9
and 3.8), 3072 → 768 7.9 and 8.3 (9.6 and 9.6); at 2304 columns and more it lost to DECODE_MATMUL_TILE
(768 → 2304 4.4 against 4.3, 768 → 3072 5.2 against 4.8, the LM head 35 against 26). 16 × 16 × 256
won two of the narrow cases (3.5 at 768 → 768, 6.9 at 3072 → 768 with 32 tokens) and lost the others."""

DECODE_ROWS = 32
"""Up to this many rows a small 16-bit matmul takes DECODE_MATMUL_TILE or NARROW_DECODE_MATMUL_TILE."""

NARROW_DECODE_COLUMNS = 1024
"""Up to this many columns a decode-size matmul takes NARROW_DECODE_MATMUL_TILE."""

TENSOR_CORE_TILES = [
    MatmulTile(128, 256, 64, 8, 3),
    MatmulTile(256, 128, 64, 8, 3),
    MatmulTile(128, 128, 64, 8, 4),
    MatmulTile(128, 128, 64, 4, 4),
    MatmulTile(64, 256, 64, 4, 4),
    MatmulTile(64, 128, 64, 4, 4),
    SMALL_MATMUL_TILE,
]
"""Candidates for float16 and bfloat16 on a Hopper GPU. Warpgroups of 4 warps issue wgmma on 64-row
slices, so tiles are multiples of 64; a 128 × 256 tile of float32 accumulators takes most of the
register file of 8 warps (217-255 registers a thread compiled for sm_90: one program per SM). A stage
is 48 KB of shared memory at 128 × 256 × 64, so three fit in the H100's 227 KB.

Measured on an H100 (Triton 3.6, bfloat16, the GPT-2-small feed-forward at 8192 tokens; every
candidate timed at every matmul of the block, forward and backward): 256 × 128 won x·W_fcᵀ with the
bias (85 µs) and with GELU (103 µs); 128 × 256 the gelu' backward (139 µs), the weight gradients
(84-85 µs; A read transposed in place) and grad_y·W_proj without epilogue (73 µs); 128 × 128 with 4
warps the projection (75 µs); 64 × 256 grad_x (71 µs); 64 × 128 the GELU saving h (126 µs: with 96 KB
of shared memory two programs fit on an SM, so one's epilogue can overlap the other's K loop).
128 × 128 with 8 warps came within 1-5 % of the best at three of the nine. Dropped after that run:
128 × 64 and 128-deep K steps (128 × 128 × 128, 64 × 128 × 128), never within 8 % of the best, and
4-stage twins of the 8-warp 128 × 256 and 256 × 128 tiles, which beat the 3-stage ones by 2 µs at
most."""

TMA_TILES = [
    MatmulTile(128, 256, 64, 8, 4),
    MatmulTile(128, 256, 64, 8, 3),
    MatmulTile(128, 128, 64, 8, 4),
    MatmulTile(128, 128, 128, 8, 3),
]
"""Candidates for ``_matmul_tma_kernel`` (16-bit, Hopper). Measured on an H100 (Triton 3.6, bfloat16, the
GPT-2-small feed-forward's six matmuls at 8192 tokens, bias but no other epilogue, L2 flushed): 128 × 256
in 4 stages won three of them; 128 × 128 won the two with K = 3072 and N = 768, where 128 × 256 makes
only 192 tiles for 132 SMs. 256 × 128 never won, nor two programs an SM of 128 × 128 (4 or 8 warps)."""

SMALL_MATMUL = 2**30
"""Below this many multiply-adds (M·N·K; ~3 µs of tensor-core work on an H100) a 16-bit matmul takes a
tile chosen by its shape alone, untimed (``small_matmul_tile``): its time is the launch and one short
wave of tiles reading the weight, while timing the candidates would compile each of them for every new
shape."""

WIDE_FLOAT_TILE = MatmulTile(64, 64, 32, 4, 3)
"""float32 and float64. Their products run on the CUDA cores ("ieee" float32) or the float64 tensor
cores, with slices of both operands held in registers, so tiles stay small: compiled for sm_90, 110
registers a thread in float32 and 166-240 in float64, where only the gelu' epilogue spills (440
bytes; 8 warps would not, at 234 registers: untimed)."""

INTERPRETER_TILE = MatmulTile(32, 32, 32, 1, 1)
"""Triton's CPU interpreter runs programs one after another on NumPy: small tiles keep the padding it
computes at odd sizes small."""

GROUP_M = 8
"""Tile-rows of C per group in the launch order (see ``_grouped_tile``)."""


def _fits(block_m: int, block_n: int, M: int, N: int) -> bool:
    """Whether a tile is no taller or wider than an (M, N) product, rounded up to a power of two and to
    at least 64 (the height of one wgmma): a bigger tile only multiplies padding."""
    return block_m <= max(64, next_power_of_2(M)) and block_n <= max(64, next_power_of_2(N))


def _tiles_worth_timing(configs, named_args, **kwargs):
    """Which candidates autotuning times for a large matmul (small ones never reach the autotuner:
    see ``_tile_choice``): those that ``_fits`` the product."""
    M, N = named_args["M"], named_args["N"]
    return [config for config in configs if _fits(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], M, N)]


# --- GELU (tanh approximation) ------------------------------------------------------------------------------
# Exact form (float32, float64, the interpreter): 1 + tanh(u) = 2·sigmoid(2u) and 1 − tanh(u)² = 4·s·(1 − s)
# with s = sigmoid(2u): one exponential and one division, and no cancellation where tanh(u) is near −1 (large
# negative h), where 1 + tanh(u) would lose digits.
# Fast form (16-bit outputs on the GPU, FAST_TANH): tanh.approx.f32, one instruction of the SM's special
# function unit, where the exact form's exponential and division take a dozen. Its error (about 2^-11 relative,
# as the PTX ISA gives it) sits below float16's and bfloat16's rounding of the stored result, and the tile's
# epilogue is where a matmul's tensor cores wait (both measured: profiling/results/h200/gelu-epilogues.md).

SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_CUBIC = tl.constexpr(0.044715)


# (Tensors go left of the constants: the interpreter's constexpr × tensor makes a constexpr.)


@triton.jit
def _gelu_inner(h):
    """u = sqrt(2/π)·(h + 0.044715·h³)."""
    return (h + h * h * h * GELU_CUBIC) * SQRT_2_OVER_PI


@triton.jit
def _tanh_approx(u):
    """tanh on the special function unit (``tanh.approx.f32``): GPU only, never the interpreter."""
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [u], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _sigmoid_of_2u(h):
    """s = sigmoid(2u)."""
    two_u = _gelu_inner(h) * 2
    # exp(−|2u|) ≤ 1: tl.sigmoid's exp(−2u) overflows to inf for 2u < −88 in float32 (h < −10);
    # a GPU shrugs (1/inf = 0), but Triton's CPU interpreter (numpy) warns on every such lane.
    e = tl.exp(-tl.abs(two_u))
    return tl.where(two_u >= 0, 1.0, e) / (1.0 + e)


@triton.jit
def _gelu_tanh(h, FAST_TANH: tl.constexpr):
    """0.5·h·(1 + tanh u) = h·s."""
    if FAST_TANH:
        return h * (_tanh_approx(_gelu_inner(h)) * 0.5 + 0.5)
    return h * _sigmoid_of_2u(h)


@triton.jit
def _gelu_tanh_derivative(h, FAST_TANH: tl.constexpr):
    """0.5·(1 + tanh u) + 0.5·h·(1 − tanh² u)·du/dh = s + 2·h·s·(1 − s)·du/dh."""
    du_dh = (h * h * (3 * GELU_CUBIC) + 1.0) * SQRT_2_OVER_PI
    if FAST_TANH:
        t = _tanh_approx(_gelu_inner(h))
        return (t + 1.0) * 0.5 + h * (1.0 - t * t) * du_dh * 0.5
    s = _sigmoid_of_2u(h)
    return s + h * s * (1.0 - s) * du_dh * 2.0


# --- matmul ----------------------------------------------------------------------------------------------


@triton.jit
def _grouped_tile(index, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile-row, tile-column) of C for tile number ``index``, in grouped order: consecutive tiles go
    down a group of GROUP_M tile-rows before moving one tile-column right. The tiles computed at once
    then cover a near-square patch of C, which reads fewer distinct rows of A and columns of B than a
    strip of one tile-row would: those stay in L2 for the whole patch."""
    tile_rows = tl.cdiv(M, BLOCK_M)
    tiles_per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_tile_row = index // tiles_per_group * GROUP_M
    group_height = tl.minimum(tile_rows - first_tile_row, GROUP_M)  # the last group may be shorter
    tile_row = first_tile_row + (index % tiles_per_group) % group_height
    tile_col = (index % tiles_per_group) // group_height
    return tile_row, tile_col


@triton.jit
def _finish_tile(acc, row_sums, tile_row, tile_col, C, Bias, PreActivation, RowSums, M, N, stride_cm,
                 EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_SUMS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, FAST_TANH: tl.constexpr):
    """What both matmul kernels do with a finished tile of A·B in registers: the row sums (tile-column 0
    stores them) and the epilogue, then the one store of the tile."""
    rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
    if ROW_SUMS:
        if tile_col == 0:
            # Each of the 16 columns holds the same sums: tl.max picks one, with no division.
            tl.store(RowSums + rows, tl.max(row_sums, axis=1).to(RowSums.dtype.element_ty), mask=rows < M)
    col_mask = cols < N
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_mask, other=0.0).to(COMPUTE)[None, :]
    mask = (rows < M)[:, None] & col_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]  # of the (M, N) pre-activation
    c_offsets = rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]  # C's rows may be padded apart
    if EPILOGUE == "gelu_backward":
        pre_activation = tl.load(PreActivation + offsets, mask=mask, other=0.0).to(COMPUTE)
        acc *= _gelu_tanh_derivative(pre_activation, FAST_TANH)
    if EPILOGUE == "gelu_saving_pre_activation":
        tl.store(PreActivation + offsets, acc.to(PreActivation.dtype.element_ty), mask=mask)
    if EPILOGUE == "gelu" or EPILOGUE == "gelu_saving_pre_activation":
        acc = _gelu_tanh(acc, FAST_TANH)
    if EPILOGUE == "accumulate":
        acc += tl.load(C + c_offsets, mask=mask, other=0.0).to(COMPUTE)
    tl.store(C + c_offsets, acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _matmul_kernel(A, B, C, Bias, PreActivation, RowSums, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                   stride_cm, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_SUMS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_TANH: tl.constexpr):
    tile_row, tile_col = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_col * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    # Edge tiles read rows and columns modulo M and N: every load stays inside A and B with no mask
    # (the wrapped rows compute values nobody stores), so only the K loop's tail needs one.
    A += (rows % M).to(tl.int64)[:, None] * stride_am + depth[None, :] * stride_ak
    B += depth[:, None] * stride_bk + (cols % N).to(tl.int64)[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), COMPUTE)
    if ROW_SUMS:
        # Σ_k A[m, k] as a product too: A·ones(BLOCK_K, 16) is one more small MMA on the A tile already
        # in shared memory, 16 columns beside the tile's BLOCK_N (a sixteenth more tensor-core work at 256
        # columns, a quarter at 64), where a tl.sum would first copy the tile into registers. Every program
        # runs it, and the programs of tile-column 0 store it: a branch on that inside the loop kept the
        # loop from being pipelined (the measured cost: profiling/results/h100/bias-gradients.md).
        row_sums = tl.zeros((BLOCK_M, 16), COMPUTE)
        ones = tl.full((BLOCK_K, 16), 1.0, A.dtype.element_ty)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        depth_left = K - step * BLOCK_K
        a = tl.load(A, mask=depth[None, :] < depth_left, other=0.0)
        b = tl.load(B, mask=depth[:, None] < depth_left, other=0.0)
        # out_dtype: a float64 accumulator must say so (tl.dot's default is float32).
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=COMPUTE)
        if ROW_SUMS:
            row_sums = tl.dot(a, ones, row_sums, input_precision=DOT_PRECISION, out_dtype=COMPUTE)
        A += BLOCK_K * stride_ak  # pointer steps, not k·stride offsets: no 32-bit overflow at any K
        B += BLOCK_K * stride_bk
    _finish_tile(acc, row_sums if ROW_SUMS else acc, tile_row, tile_col, C, Bias, PreActivation, RowSums, M, N,
                 stride_cm, EPILOGUE, HAS_BIAS, ROW_SUMS, BLOCK_M, BLOCK_N, COMPUTE, FAST_TANH)


@triton.jit
def _matmul_tma_kernel(A, B, C, Bias, PreActivation, M, N, K, stride_a, stride_b, stride_cm,
                       B_TRANSPOSED: tl.constexpr, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, FAST_TANH: tl.constexpr):
    """``_matmul_kernel``'s product, persistent and fed by the tensor-memory accelerator (Hopper's TMA),
    for the layouts and epilogues where it measured faster (``_tma_operands``).

    A tensor descriptor names a 2-D box of a matrix in memory; one thread asks the TMA unit for the
    box, and it lands in shared memory laid out for the tensor cores, edges zero-filled, while the
    warps go on computing: no address arithmetic or masks per element, and no registers spent on
    addresses. A transposed B (a weightᵀ) is a descriptor over the weight as it lies, whose box is read
    transposed from shared memory (``.T``, free: wgmma takes either order).

    Persistent: a grid of about one program per SM walks the tiles in grouped order, and the tile loop
    and its K loop are flattened into one software pipeline (``flatten=True``), so a program's next
    tile starts loading while it finishes this one, where one program per tile would drain the
    pipeline, store and exit at every tile."""
    a_boxes = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_a, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_TRANSPOSED:  # B[k, n] at B + n·stride_b + k: an (N, K) matrix read by (BLOCK_N, BLOCK_K) boxes
        b_boxes = tl.make_tensor_descriptor(B, shape=[N, K], strides=[stride_b, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_boxes = tl.make_tensor_descriptor(B, shape=[K, N], strides=[stride_b, 1], block_shape=[BLOCK_K, BLOCK_N])
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        tile_row, tile_col = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        first_row, first_col = tile_row * BLOCK_M, tile_col * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), COMPUTE)
        for step in range(0, tl.cdiv(K, BLOCK_K)):
            depth = step * BLOCK_K  # the last box reads past K as zeros: no mask
            a = a_boxes.load([first_row, depth])
            if B_TRANSPOSED:
                b = b_boxes.load([first_col, depth]).T
            else:
                b = b_boxes.load([depth, first_col])
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, out_dtype=COMPUTE)
        # No row sums here (_tma_operands): C stands in for their pointer, never read.
        _finish_tile(acc, acc, tile_row, tile_col, C, Bias, PreActivation, C, M, N, stride_cm, EPILOGUE, HAS_BIAS,
                     False, BLOCK_M, BLOCK_N, COMPUTE, FAST_TANH)


def _autotuned(kernel, tiles: list[MatmulTile], key: list[str]):
    """``kernel`` autotuned over ``tiles`` (each a triton.Config of its BLOCK_* sizes, warps and stages),
    timing only those ``_tiles_worth_timing`` keeps, per value of the arguments named in ``key``.
    ACCUMULATE reads C: every timing run would add A·B into it once more, so C is put back after timing."""
    configs = [triton.Config(dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k),
                             num_warps=tile.num_warps, num_stages=tile.num_stages) for tile in tiles]
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": _tiles_worth_timing},
                           restore_value=["C"])(kernel)


# Tensor arguments' dtypes join the keys by themselves; the strides tell transposed layouts apart.
_matmul_autotuned = _autotuned(_matmul_kernel, TENSOR_CORE_TILES, ["M", "N", "K", "stride_am", "stride_ak", "stride_bk",
                                                                 "stride_bn", "EPILOGUE", "HAS_BIAS", "ROW_SUMS"])
_matmul_tma_autotuned = _autotuned(_matmul_tma_kernel, TMA_TILES,
                                   ["M", "N", "K", "stride_a", "stride_b", "B_TRANSPOSED", "EPILOGUE", "HAS_BIAS"])


def _tile_choice(dtype: torch.dtype, rows: int, columns: int, depth: int) -> MatmulTile | None:
    """The fixed tile for ``dtype`` in this mode, or None where autotuning picks among TENSOR_CORE_TILES
    (or TMA_TILES). A small 16-bit matmul gets a decode tile or SMALL_MATMUL_TILE here rather than from
    the autotuner, which would prune its candidates to the small tile anyway, after keying and looking
    up its cache on every call."""
    if interpreter_is_on():
        return INTERPRETER_TILE
    if dtype.itemsize != 2:
        return WIDE_FLOAT_TILE
    return small_matmul_tile(rows, columns) if rows * columns * depth < SMALL_MATMUL else None


def small_matmul_tile(rows: int, columns: int) -> MatmulTile:
    """The tile of a small 16-bit matmul of ``rows`` × ``columns`` on a GPU: a decode tile for a decode
    step's few rows, narrow for a narrow weight, else SMALL_MATMUL_TILE."""
    if rows > DECODE_ROWS:
        return SMALL_MATMUL_TILE
    return NARROW_DECODE_MATMUL_TILE if columns <= NARROW_DECODE_COLUMNS else DECODE_MATMUL_TILE


class _TmaOperands(NamedTuple):
    """How ``_matmul_tma_kernel`` reads its operands: B stored transposed or not, and each one's outer
    stride (A is always read by rows)."""

    b_transposed: bool
    stride_a: int
    stride_b: int


def _tma_operands(a: torch.Tensor, b: torch.Tensor, tile: MatmulTile | None,
                  row_sums: torch.Tensor | None) -> _TmaOperands | None:
    """How ``_matmul_tma_kernel`` reads A and B where it runs, else None (``_matmul_kernel`` does). It
    runs a large (autotuned, ``tile`` None) 16-bit matmul on a Hopper GPU, and under the interpreter any
    matmul, so that the CPU tests check its indexing too; and only where it measured faster (on an
    H100, ``TMA_TILES``; the GELU epilogues on an H200): A read by rows, any epilogue, no row sums. TMA
    must also be able to read A and B in place: one stride of each is 1, the other a multiple of 16 bytes,
    and each starts on 16 bytes; and K is not empty (a descriptor has no zero-sized dim). On the GPU, one of its tiles
    must fit the product (``_fits``): they are all 128 rows tall, so a product of 64 rows or fewer (a
    decode step's batch of tokens through the LM head) takes the pointer kernel's 64-row tiles, where the
    autotuner would otherwise prune every candidate away.

    What stays with the pointer kernel, and why: a weight gradient grad_outᵀ·x (A transposed, with the
    bias gradient's row sums), where the TMA kernel ran 3-27 % slower on an H100, and 25-107 % slower on an
    H200 with the row sums in the TMA kernel too (profiling/results/h200/gelu-epilogues.md). Without row sums
    (the loss's weight gradient, accumulated in float32) it tied or lost too, by 9 % on an H200
    (profiling/results/h200/lce-grad-weight-tma-f1cc652.md). The GELU
    epilogues used to stay as well: with the exact tanh, the TMA kernel's one program an SM waited out each
    tile's long epilogue, where the pointer kernel's two programs an SM overlapped it with a K loop. With
    ``tanh.approx`` the epilogue is short enough that the TMA kernel wins (same file)."""
    if row_sums is not None or a.shape[1] == 0:
        return None
    if not (interpreter_is_on() or (tile is None and a.is_cuda and _has_tma(a.get_device())
                                    and _a_tma_tile_fits(a.shape[0], b.shape[1]))):
        return None
    a_layout, b_layout = _box_layout(a), _box_layout(b)
    if a_layout is None or a_layout[0] or b_layout is None:
        return None
    return _TmaOperands(b_layout[0], a_layout[1], b_layout[1])


@functools.cache
def _a_tma_tile_fits(M: int, N: int) -> bool:
    """Whether any of TMA_TILES ``_fits`` an (M, N) product: asked on every large matmul's call, so
    answered once per shape."""
    return any(_fits(tile.block_m, tile.block_n, M, N) for tile in TMA_TILES)


def _box_layout(operand: torch.Tensor) -> tuple[bool, int] | None:
    """(transposed, outer stride) of a 2-D operand a TMA descriptor can read in place, or None."""
    outer, inner = operand.stride()
    if inner == 1:
        transposed, stride = False, outer
    elif outer == 1:
        transposed, stride = True, inner
    else:
        return None
    if stride * operand.element_size() % 16 or operand.data_ptr() % 16:
        return None
    return transposed, stride


@functools.cache
def _has_tma(device_index: int) -> bool:
    """Hopper (compute capability 9.x), where TMA_TILES were measured."""
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global memory for the descriptors ``_matmul_tma_kernel`` builds (128 bytes a program), from
    PyTorch's caching allocator on the current device. Out of sight of dispatch modes: it is the launcher's
    memory, not the caller's, and a recorder (replay.py) counts it in the launch it belongs to."""
    with _OUT_OF_DISPATCH_MODES():
        return torch.empty(size, dtype=torch.int8, device="cuda")


_OUT_OF_DISPATCH_MODES = torch._C._DisableTorchDispatch


_tuned_tiles: dict[tuple, MatmulTile] = {}
"""The tile the autotuner chose, per key: asked of it once, at a key's first call, which it times the
candidates for. Every later call launches that tile through ``launch.launch``'s direct path. Sent through
the autotuner instead, each call would pay its Python (the key rebuilt from a dict of every argument, the
cache lookup) and then Triton's whole JITFunction.run, which ``launch`` skips for every other kernel.
(Concurrent first calls from two threads could read each other's choice: still a correct tile.)"""


def _tile_of(config: triton.Config) -> MatmulTile:
    return MatmulTile(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.num_warps,
                      config.num_stages)


class MatmulLaunch(NamedTuple):
    """One matmul's launch but its tensors: what ``plan_matmul`` decides from the operands' shapes,
    strides, dtypes and alignment (kernel, tile, grid, scalars), so that a caller that sees the same
    signature again (a model's projections, step after step) can keep it and only launch."""

    kernel: object
    grid: tuple[int]  # or, for an autotuned kernel, a function of the chosen tile's meta-parameters
    scalars: tuple  # the kernel's arguments after its tensors
    constants: dict
    tma: bool  # the TMA kernel, which takes no row sums

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None,
                 pre_activation: torch.Tensor | None = None, row_sums: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` ← A·B through the planned epilogue. ``b`` may be any tensor with B's data pointer and
        dtype (a weight, for its transpose): the plan holds B's strides."""
        if self.tma:
            # The descriptors' memory comes from this allocator, which Triton keeps per thread (a context
            # variable): autograd runs backward matmuls on a thread of its own, so each launch sets it.
            triton.set_allocator(_descriptor_scratch)
            tensors = (a, b, out, bias, pre_activation)
        else:
            tensors = (a, b, out, bias, pre_activation, row_sums)
        with on_device(a):
            launch(self.kernel, self.grid, *tensors, *self.scalars, **self.constants)
        return out


def plan_matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, epilogue: str = Epilogue.NONE,
                bias: torch.Tensor | None = None, pre_activation: torch.Tensor | None = None,
                row_sums: torch.Tensor | None = None) -> MatmulLaunch | None:
    """The launch of ``launch_matmul`` for these operands (M, N > 0), or None while the autotuner has
    yet to choose a tile for them (``launch_matmul``'s first call with their key asks it)."""
    (M, K), N = a.shape, b.shape[1]
    tile = _tile_choice(a.dtype, M, N, K)
    tma = _tma_operands(a, b, tile, row_sums)
    b_transposed = None if tma is None else tma.b_transposed
    flags = (bias is not None, pre_activation is not None, row_sums is not None)
    if tile is None:
        tile = _tuned_tiles.get(_autotune_key(a, b, out, epilogue, b_transposed, *flags))
        if tile is None:
            return None
    return MatmulLaunch(_matmul_kernel if tma is None else _matmul_tma_kernel,
                        _grid(a, M, N, tile.block_m, tile.block_n, tma is not None), _matmul_scalars(a, b, out, tma),
                        _matmul_constants(epilogue, flags[0], flags[2], a.dtype, tile, b_transposed),
                        tma is not None)


def _matmul_scalars(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, tma: _TmaOperands | None) -> tuple:
    """The arguments after the tensors: of ``_matmul_kernel`` (and its autotuned twin), or with ``tma`` of
    ``_matmul_tma_kernel``."""
    (M, K), N = a.shape, b.shape[1]
    if tma is None:
        return M, N, K, *a.stride(), *b.stride(), out.stride(0)
    return M, N, K, tma.stride_a, tma.stride_b, out.stride(0)


def _autotune_key(a, b, out, epilogue, b_transposed, has_bias, has_pre_activation, has_row_sums) -> tuple:
    """The autotuner's own key: what it times candidates for, and what makes its choice differ."""
    return (*a.shape, b.shape[1], *a.stride(), *b.stride(), b_transposed, epilogue, a.dtype, out.dtype, has_bias,
            has_pre_activation, has_row_sums)


def launch_matmul(a: torch.Tensor, b: torch.Tensor, epilogue: str = Epilogue.NONE, bias: torch.Tensor | None = None,
                  pre_activation: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  row_sums: torch.Tensor | None = None) -> torch.Tensor:
    """A·B (+ bias) through ``epilogue``, as a new contiguous (M, N) tensor of A's dtype, or into ``out``,
    an (M, N) tensor of any float dtype whose rows are contiguous and may stand apart (a narrowed view of
    a wider buffer: ``linear_cross_entropy`` pads its logits' rows); ACCUMULATE adds to it. ``a`` and ``b``
    may be any strided views. ``pre_activation`` is the (M, N) tensor H: written by GELU_SAVING_PRE_ACTIVATION,
    read by GELU_BACKWARD. ``row_sums``, a contiguous M-vector, gets Σ_k A[m, k] (added in the
    accumulator's dtype) from the same launch.

    Unchecked: the callers (the launchers of feed_forward.py and linear_cross_entropy.py) check their
    inputs once for all of their matmuls. Host time bounds a small feed-forward step, and six matmuls'
    checks would be part of it."""
    (M, K), N = a.shape, b.shape[1]
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        if row_sums is not None and M > 0 and K > 0:
            raise ValueError("launch_matmul: row_sums are summed by the programs of C's first tile-column, and an "
                             f"(M, N) = ({M}, 0) product has none: sum A's rows apart")
        if row_sums is not None:
            row_sums.zero_()  # an empty sum
        return out
    planned = plan_matmul(a, b, out, epilogue, bias, pre_activation, row_sums)
    if planned is not None:
        return planned(a, b, out, bias, pre_activation, row_sums)
    # The key's first call: the autotuner times the candidates, launches the best and is asked no more.
    flags = (bias is not None, pre_activation is not None, row_sums is not None)
    tma = _tma_operands(a, b, None, row_sums)
    b_transposed = None if tma is None else tma.b_transposed
    autotuned = _matmul_autotuned if tma is None else _matmul_tma_autotuned
    MatmulLaunch(autotuned, lambda meta: _grid(a, M, N, meta["BLOCK_M"], meta["BLOCK_N"], tma is not None),
                 _matmul_scalars(a, b, out, tma), _matmul_constants(epilogue, flags[0], flags[2], a.dtype, None,
                                                                    b_transposed),
                 tma is not None)(a, b, out, bias, pre_activation, row_sums)
    _tuned_tiles[_autotune_key(a, b, out, epilogue, b_transposed, *flags)] = _tile_of(autotuned.best_config)
    return out


def _grid(a: torch.Tensor, M: int, N: int, block_m: int, block_n: int, persistent: bool) -> tuple[int]:
    """A program per tile of C, or (the persistent TMA kernel) one per SM, never more than the tiles."""
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    return (persistent_program_count(a, tiles, 1) if persistent else tiles,)


@functools.cache
def _matmul_constants(epilogue: str, has_bias: bool, row_sums: bool, dtype: torch.dtype,
                      tile: MatmulTile | None, b_transposed: bool | None) -> dict:
    """The constexprs and launch options of one matmul configuration, built once (``launch`` does not
    modify them). Without a tile the autotuner adds the tile's own. ``b_transposed`` is the TMA kernel's,
    None for the pointer kernel (which has ROW_SUMS instead)."""
    constants = dict(EPILOGUE=epilogue, HAS_BIAS=has_bias, GROUP_M=GROUP_M, COMPUTE=compute_dtype(dtype),
                     DOT_PRECISION=dot_input_precision(dtype),
                     FAST_TANH=dtype.itemsize == 2 and not interpreter_is_on())
    if b_transposed is None:
        constants.update(ROW_SUMS=row_sums)
    else:
        constants.update(B_TRANSPOSED=b_transposed)
    if tile is not None:
        constants.update(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                         num_warps=tile.num_warps, num_stages=tile.num_stages)
    return constants


# --- column sum (a transposed weight's bias gradient, the loss's sum of row terms) ------------------------

COLUMN_SUM_TILE = 4096
"""Elements a column-sum program adds per step: 32 a thread at 4 warps, several loads in flight."""


@triton.jit
def _column_sum_kernel(X, Sums, n_rows, N, rows_per_program, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                       COMPUTE: tl.constexpr):
    """Program (i, j) sums rows j·rows_per_program … (j+1)·rows_per_program − 1 of columns block i
    of the (n_rows, N) matrix X into row j of Sums. Pass 1 of a long sum writes partial rows; pass 2
    (the same kernel, one row chunk) sums them."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < N
    chunk = tl.program_id(1)
    end = tl.minimum((chunk + 1) * rows_per_program, n_rows)
    sums = tl.zeros((BLOCK_ROWS, BLOCK_COLS), COMPUTE)  # a column of partial sums per thread: one add a load
    for start in range(chunk * rows_per_program, end, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        mask = (rows < end)[:, None] & col_mask[None, :]
        sums += tl.load(X + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    tl.store(Sums + chunk.to(tl.int64) * N + cols, tl.sum(sums, axis=0).to(Sums.dtype.element_ty), mask=col_mask)


def launch_column_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ_rows x for a contiguous (rows, N) matrix, as an N-vector of x's dtype (summed in float32,
    float64 for float64). Unchecked, as ``launch_matmul``.

    Few columns cannot fill the GPU (N = 768 makes 3 column blocks), so rows are split into chunks
    as well: about 4 programs per SM, each summing its chunk into a row of a float32 buffer that stays
    in L2; a second launch of the same kernel sums that buffer's columns."""
    rows, n = x.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out.zero_()
    block_cols = min(256, max(32, next_power_of_2(n)))  # 256 columns: a 512-byte line of a 16-bit row
    block_rows = min(COLUMN_SUM_TILE // block_cols, next_power_of_2(rows))
    col_blocks, row_blocks = cdiv(n, block_cols), cdiv(rows, block_rows)
    chunks = min(row_blocks, cdiv(persistent_program_count(x, col_blocks * row_blocks, 4), col_blocks))
    rows_per_chunk = cdiv(row_blocks, chunks) * block_rows
    chunks = cdiv(rows, rows_per_chunk)
    compute = compute_dtype(x.dtype)
    with on_device(x):
        if chunks == 1:
            launch(_column_sum_kernel, (col_blocks, 1), x, out, rows, n, rows, BLOCK_ROWS=block_rows,
                   BLOCK_COLS=block_cols, COMPUTE=compute, num_warps=4)
            return out
        partial = torch.empty((chunks, n), dtype=accumulator_dtype(x.dtype), device=x.device)
        launch(_column_sum_kernel, (col_blocks, chunks), x, partial, rows, n, rows_per_chunk, BLOCK_ROWS=block_rows,
               BLOCK_COLS=block_cols, COMPUTE=compute, num_warps=4)
        programs, partial_cols, partial_rows = column_reduction_launch(n, chunks, persistent_program_count(x, n, 2))
        launch(_column_sum_kernel, (programs, 1), partial, out, chunks, n, chunks, BLOCK_ROWS=partial_rows,
               BLOCK_COLS=partial_cols, COMPUTE=compute, num_warps=4)
    return out
