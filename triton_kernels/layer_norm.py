"""LayerNorm (and RMSNorm) in Triton: forward and backward over the last dim of x (..., N), as
``triton_kernels`` ops.

What it computes
    forward    mean = Σx/N,  rstd = 1/sqrt(Σ(x−mean)²/N + eps)   ("rstd": reciprocal standard deviation)
               y = (x − mean)·rstd·w + b;  mean and rstd are saved for the backward
    backward   x̂ = (x − mean)·rstd,  g = dy·w
               dx = rstd·(g − x̂·mean(x̂·g) − mean(g))              a reduction along each row
               dw = Σ_rows dy·x̂,  db = Σ_rows dy                 reductions *across* rows
    RMSNorm    the same without the mean and without the bias (``SUBTRACT_MEAN=False``, ``HAS_BIAS=False``):
               rstd = 1/sqrt(Σx²/N + eps), x̂ = x·rstd, y = x̂·w;  dx = rstd·(g − x̂·mean(x̂·g)), dw as above.
               Every kernel below serves both; ``rms_norm.py`` registers RMSNorm's ops on them.

Kernels, in the order they run (this file: the forward and the ops; the backward's kernels in
``layer_norm_backward.py``; rows split across programs in ``layer_norm_split.py``)
    ``_layer_norm_fwd_kernel``          a row (or a tile of short rows) held in registers: read once,
                                        two reductions, write once; compiled for its row length N
    ``_norm_fwd_pipelined_rows_kernel`` LayerNorm's 16-bit rows of the widest block (MAX_ROW_BLOCK) on a
                                        GPU: the same row, on a persistent grid whose loop Triton
                                        pipelines, copying the next rows into shared memory during this
                                        one's reductions (``pipelines_rows``)
    ``layer_norm_fwd_looped_kernel``   rows longer than MAX_ROW_BLOCK: pass 1 merges per-block statistics
                                        (Chan's formula; RMSNorm sums x² lane by lane), pass 2
                                        normalises (``..._constant_n_kernel``: the same, compiled for
                                        one row length, for RMSNorm and float32, and for rows of
                                        4097-24,576 that a program holds less well: ``row_loop_tile``);
                                        the row is read twice, the
                                        second time from L2 on a GPU (one row an SM in flight:
                                        ``launch.l2_looped_tile``), which runs it only for rows that fit
                                        there; longer ones cross DRAM once on the split file's cooperative grid
    ``_layer_norm_bwd_kernel``          dx per row, plus per-program partial sums of dw and db; in 16-bit
                                        dtypes each program loads its next tile while it reduces this one
                                        (``layer_norm_backward.loads_next_tile_early``); rows
                                        longer than half of MAX_ROW_BLOCK (it keeps four arrays a column:
                                        ``layer_norm_backward.ROW_ARRAYS``) take the split backward instead
    ``_layer_norm_bwd_dwdb_kernel``     sums the partial rows into dw and db

The one idea that makes it fast
    Every element crosses DRAM the fewest times the math allows: the forward reads x and writes y
    once; the backward reads x and dy once and writes dx once. The cross-row sums dw and db are the
    hard part: a persistent backward launches about one program per SM; each walks a strided set of
    rows, keeps its running dw, db in registers, then writes them as one row of a small
    (programs, N) float32 buffer that stays in L2. A second, tiny kernel sums that buffer's columns.

Launch
    ``launch.row_strategy`` picks by row length N and row count: short rows stacked into tiles of
    1024 elements (at least 2 KB of rows) on 2 warps, several rows a program (``norm_row_tile``); a row
    a program, in registers, except rows of the lengths in ``ROW_LOOPS`` (4097-24,576, by norm and
    dtype), looped over in blocks of 2048-8192 (``row_loop_tile``); on a GPU, longer rows
    looped over one an SM while that many fit in L2 (``launch.l2_looped_tile``), longer still
    split across a cooperative grid that reads them once (``layer_norm_split.py``); else a row a
    program, looped over; or, for a few long rows, each row split across programs in two phases.
    ``launch.row_tile``: the row rounded up to a power of two is one block; one warp per 1024
    elements; 2 warps for rows of up to 1024, two 16-bit rows a program from 8192 elements up
    (``norm_row_tile``). The backward
    launches BACKWARD_WARPS_PER_SM warps' worth of programs per SM (one 8-warp program at N = 8192).

Measured (H100, 8192 × 8192, kernels alone)
    forward 2.92 TB/s in float32, 2.83 in bfloat16: copy bandwidth (2.94 / 2.86), torch.compile
    (2.95 / 2.83), 1.6 × PyTorch's F.layer_norm (1.85 / 1.80). Backward dx kernel 2.82 / 2.37 TB/s
    over its three tensors, plus 10 µs for the dw, db column reduction.

Limits
    Any N ≥ 1: rows longer than MAX_ROW_BLOCK (16384) are looped over, or split across a cooperative
    grid forward on a GPU, or split in two phases when they are too few to fill the SMs; never rejected.
    Backward they are always split, and so are rows past 8192: across a cooperative grid in float32 on a
    GPU, else in two phases.
    The backward's partial buffers have at most min(rows, a few × SMs) rows of N float32 values.
    float16, bfloat16, float32, float64 on the GPU (statistics and sums in float32, float64 for float64);
    float32 and float64 under the interpreter.

Check
    python -m pytest tests -k "layer_norm and triton"
    python -m profiling --component layer_norm --shape 8192 8192 --backward
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import launch as launch_settings  # MAX_ROW_BLOCK is read at each call: tests lower it
from .eager import EagerFunction, refuse_tangents
from .launch import (
    RowTile,
    SignatureTable,
    accumulator_dtype,
    cdiv,
    check_contiguous,
    check_inputs,
    compute_dtype,
    interpreter_is_on,
    l2_looped_tile,
    launch,
    on_device,
    persistent_program_count,
    require,
    row_matrix,
    row_strategy,
    row_tile,
    short_row_tile,
    split_float,
)
from .layer_norm_backward import launch_norm_bwd_unchecked
from .layer_norm_split import SplitNormForwardLaunch, allocate_norm_outputs

# --- input checks (launchers and fake implementations) ----------------------------------------------


def check_norm_shapes(op: str, x: torch.Tensor, per_column: dict, per_row: dict | None = None,
                      like_x: dict | None = None):
    """x is (..., N), its leading dims the rows; ``per_column`` tensors are N-vectors of x's dtype,
    ``per_row`` ones are rows-vectors of the statistics dtype, ``like_x`` ones match x. All contiguous.
    Returns (rows, N)."""
    rows, n = row_matrix(op, x)
    require(n >= 1, lambda: f"{op}: rows of 0 elements have no mean (x has shape {tuple(x.shape)})")
    per_row, like_x = per_row or {}, like_x or {}
    expected = [(per_column, (n,), x.dtype), (per_row, (rows,), accumulator_dtype(x.dtype)), (like_x, x.shape, x.dtype)]
    for tensors, shape, dtype in expected:
        for name, tensor in tensors.items():
            require(tensor.shape == shape and tensor.dtype == dtype,
                    lambda: f"{op}: {name} is {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(shape)} {dtype}")
    check_contiguous(op, x, *per_column.values(), *per_row.values(), *like_x.values())
    return rows, n


# --- forward -----------------------------------------------------------------------------------------


@triton.jit
def normalize_rows_in_registers(X, Y, W, B, Mean, Rstd, tile, n_rows, N, eps, BLOCK_N: tl.constexpr,
                                ROWS_PER_TILE: tl.constexpr, COMPUTE: tl.constexpr, STORE_STATISTICS: tl.constexpr,
                                SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Tile ``tile`` of ROWS_PER_TILE rows, each held whole in registers: read once, two reductions, write
    once. The body of both in-register forwards below."""
    rows = tile * ROWS_PER_TILE + tl.arange(0, ROWS_PER_TILE)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    # x is read once. (An evict_first hint here, meant to keep w and b in L2, cost 3 % on an H100:
    # 2.84 against 2.92 TB/s. w and b stay cached anyway.)
    x = tl.load(X + offsets, mask=mask, other=0.0).to(COMPUTE)
    w = tl.load(W + cols, mask=col_mask).to(COMPUTE)
    # mean, then the variance of the centred values: two reductions over registers, no second read.
    # (RMSNorm skips the mean: its "variance" is the mean square of x, whose padding already reads 0.)
    if SUBTRACT_MEAN:
        mean = tl.sum(x, axis=1) / N
        centered = tl.where(mask, x - mean[:, None], 0.0)
    else:
        centered = x
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
    y = centered * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_mask).to(COMPUTE)[None, :]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)
    if STORE_STATISTICS:
        if SUBTRACT_MEAN:
            tl.store(Mean + rows, mean, mask=row_mask)
        tl.store(Rstd + rows, rstd, mask=row_mask)


@triton.jit
def _layer_norm_fwd_kernel(X, Y, W, B, Mean, Rstd, n_rows, eps_high, eps_low, N: tl.constexpr,
                           BLOCK_N: tl.constexpr, ROWS_PER_TILE: tl.constexpr, COMPUTE: tl.constexpr,
                           STORE_STATISTICS: tl.constexpr, SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A tile a program. N is compiled in, as Inductor compiles its kernels: every mask of a row whose
    length is a power of two folds away, and at other lengths (GPT-2's 768 in a 1024 block) the compiler
    knows which lanes are padding. Each new N is a new compilation. Measured on an H200 in bfloat16
    (profiling/results/h200/norm-forward-candidates.md, probe 5): 88.7 → 91.9 % of copy bandwidth for
    LayerNorm at (87381, 768), 91.2 → 94.5 for RMSNorm; 88.2 → 90.1 and 91.9 → 94.0 at (8192, 8192);
    float32 and the other lengths within half a point."""
    eps = tl.cast(eps_high, COMPUTE) + tl.cast(eps_low, COMPUTE)
    normalize_rows_in_registers(X, Y, W, B, Mean, Rstd, tl.program_id(0), n_rows, N, eps, BLOCK_N, ROWS_PER_TILE,
                                COMPUTE, STORE_STATISTICS, SUBTRACT_MEAN, HAS_BIAS)


@triton.jit
def _norm_fwd_pipelined_rows_kernel(X, Y, W, B, Mean, Rstd, n_rows, eps_high, eps_low, N: tl.constexpr,
                                    BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, STORE_STATISTICS: tl.constexpr,
                                    SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, STAGES: tl.constexpr):
    """A row a step, each program walking a strided share of the rows (a persistent grid), its loop
    software-pipelined STAGES deep: Triton issues the next row's loads as asynchronous copies into shared
    memory (cp.async, LDGSTS in the SASS) before this row's reductions, so a program keeps bytes in flight
    while it waits in them. ``pipelines_rows`` says where it runs, and what it measured."""
    eps = tl.cast(eps_high, COMPUTE) + tl.cast(eps_low, COMPUTE)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0), num_stages=STAGES):
        normalize_rows_in_registers(X, Y, W, B, Mean, Rstd, row, n_rows, N, eps, BLOCK_N, 1, COMPUTE,
                                    STORE_STATISTICS, SUBTRACT_MEAN, HAS_BIAS)


@triton.jit
def layer_norm_fwd_looped_kernel(X, Y, W, B, Mean, Rstd, N, eps_high, eps_low,
                                  BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr, STORE_STATISTICS: tl.constexpr,
                                  SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr):
    row = tl.program_id(0)
    X += row.to(tl.int64) * N
    Y += row.to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    # pass 1: statistics. Each block's count, mean and sum of squared deviations (m2) are exact in
    # registers; Chan's formula merges them into the running ones without the cancellation of Σx².
    # (RMSNorm wants Σx² itself: no mean, nothing cancels, so each lane keeps its own running sum and
    # the lanes are added once, after the loop: no block-wide reduction, no barrier, inside it. That pays
    # only with N a constant, which RMSNorm always gets: loops_a_constant_row_length.)
    count = tl.zeros((), COMPUTE)
    mean = tl.zeros((), COMPUTE)
    m2 = tl.zeros((), COMPUTE)
    lane_squares = tl.zeros((BLOCK_N,), COMPUTE)
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        # evict_last: pass 2 reads this block again, so ask L2 to keep it if it can.
        x = tl.load(X + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(COMPUTE)
        if SUBTRACT_MEAN:
            block_count = tl.cast(tl.minimum(N - start, BLOCK_N), COMPUTE)
            block_mean = tl.sum(x, axis=0) / block_count
            deviation = tl.where(mask, x - block_mean, 0.0)
            block_m2 = tl.sum(deviation * deviation, axis=0)
            total = count + block_count
            delta = block_mean - mean
            mean += delta * (block_count / total)
            m2 += block_m2 + delta * delta * (count * block_count / total)
            count = total
        else:
            lane_squares += x * x
    if not SUBTRACT_MEAN:
        m2 = tl.sum(lane_squares, axis=0)
    rstd = 1.0 / tl.sqrt(m2 / N + tl.cast(eps_high, COMPUTE) + tl.cast(eps_low, COMPUTE))
    if STORE_STATISTICS:
        if SUBTRACT_MEAN:
            tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)
    # pass 2: normalise, scale and shift (RMSNorm: mean stays 0)
    normalize_row_blocks(X, Y, W, B, N, mean, rstd, BLOCK_N, COMPUTE, HAS_BIAS)


@triton.jit
def layer_norm_fwd_looped_constant_n_kernel(X, Y, W, B, Mean, Rstd, eps_high, eps_low, N: tl.constexpr,
                                            BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
                                            STORE_STATISTICS: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
                                            HAS_BIAS: tl.constexpr):
    """``layer_norm_fwd_looped_kernel`` compiled for one row length, as Inductor compiles its own: N is a
    constant, so the loops' trip counts are known, the compiler unrolls them and issues a row's blocks'
    loads together, and every mask of a row that is a whole number of blocks folds away. Each new N is a
    new compilation; ``loops_a_constant_row_length`` says which norms and dtypes gain."""
    layer_norm_fwd_looped_kernel(X, Y, W, B, Mean, Rstd, N, eps_high, eps_low, BLOCK_N, COMPUTE, STORE_STATISTICS,
                                 SUBTRACT_MEAN, HAS_BIAS)


def loops_a_constant_row_length(subtract_mean: bool, dtype: torch.dtype) -> bool:
    """Whether a looped forward runs ``layer_norm_fwd_looped_constant_n_kernel`` (else the kernel that takes
    N at run time). Measured on an H200 at rows of 32,768-131,072, in % of copy bandwidth
    (profiling/results/h200/norm-forward-candidates.md):
    - RMSNorm gains in every dtype, and most in bfloat16: its lanes' running sums pay only with the row
      length constant (at run time they lost 26 points, since the compiler then issued a block's second
      load after using the first); with it, 87.5 → 93.1 at 32,768 (Inductor's kernel 92.3), 66.8 → 76.5 at
      131,072;
    - LayerNorm in float32 gains 2.5-6 points (85.2 → 87.7 at 32,768, 74.6 → 80.5 at 65,536);
    - LayerNorm in 16 bits, on 16 warps, loses 12-17 points from 65,536 up (76.3 → 58.8), where the
      unrolled loop's blocks take 99 registers a thread instead of 63, and keeps the run-time N, as does
      LayerNorm in float64, not measured."""
    return not subtract_mean or dtype.itemsize == 4


@triton.jit
def normalize_row_blocks(X, Y, W, B, N, mean, rstd, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
    """y = (x − mean)·rstd·w (+ b) over the row of N values at X, block by block: the last pass of the
    looped kernel, and of the earlier versions in ``layer_norm_versions.py``."""
    cols = tl.arange(0, BLOCK_N)
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        # The row's last read, and y is not read back here: evict_first and streaming stores (.cs) ask L2
        # to give their lines up before those of rows other programs have yet to read a second time.
        x = tl.load(X + start + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(COMPUTE)
        w = tl.load(W + start + cols, mask=mask).to(COMPUTE)
        y = (x - mean) * rstd * w
        if HAS_BIAS:
            y += tl.load(B + start + cols, mask=mask).to(COMPUTE)
        tl.store(Y + start + cols, y.to(Y.dtype.element_ty), mask=mask, cache_modifier=".cs")


def launch_layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                          keep_statistics: bool = True):
    """(y, mean, rstd); with ``keep_statistics=False`` (inference: no backward will read them) the
    kernel skips their stores and the statistics come back as None: at decode sizes their two
    allocations cost more host time than the kernel's whole run."""
    return launch_norm_fwd("layer_norm_forward", x, weight, bias, eps, keep_statistics)


class NormForwardLaunch(NamedTuple):
    """One forward of a norm by a row kernel, but its tensors, for one signature of its inputs: what
    ``launch_norm_fwd`` works out once (checks, strategy, tile, kernel arguments) and keeps, since a model
    calls each norm with the same signature every step, and at GPT-2's sizes that work costs more host
    time than the kernel takes on the GPU (measured beside attention's plans in
    profiling/results/h100/attention-host-path.md). A launch is planned under launch.py's row-strategy settings of the
    time, as ``row_tile``'s cached answers are: code that changes them empties the table too."""

    kernel: object
    grid: tuple[int]
    rows: int
    scalars: tuple  # the kernel's arguments after its six tensors
    constants: dict

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """(y, mean, rstd) of inputs of this launch's signature, as ``launch_norm_fwd`` returns them."""
        subtract_mean = self.constants["SUBTRACT_MEAN"]
        out, mean, rstd = allocate_norm_outputs(x, self.rows, self.constants["STORE_STATISTICS"], subtract_mean)
        # Pointers a kernel never reads (statistics it does not store, RMSNorm's mean and bias): out stands in.
        with on_device(x):
            launch(self.kernel, self.grid, x, out, weight, bias if subtract_mean else weight,
                   mean if mean is not None else out, rstd if rstd is not None else out, *self.scalars,
                   **self.constants)
        return out, mean, rstd


_NORM_FORWARD_LAUNCHES = SignatureTable()


PIPELINED_WARPS = 8
PIPELINED_STAGES = 3
PIPELINED_PROGRAMS_PER_SM = 2


def pipelines_rows(tile: RowTile, dtype: torch.dtype) -> bool:
    """Whether the forward on ``tile`` runs ``_norm_fwd_pipelined_rows_kernel`` (a grid of
    PIPELINED_PROGRAMS_PER_SM programs an SM of PIPELINED_WARPS warps, PIPELINED_STAGES rows in flight each:
    96 KB of x, and Triton stages w and b beside it, 197 KB in all for LayerNorm compiled offline for sm_90,
    so one program an SM runs at a time) instead of a tile a program: for 16-bit rows at the widest block
    registers hold (MAX_ROW_BLOCK, rows of 8193-16,384) that ``row_loop_tile`` does not loop over, so
    LayerNorm's of 12,289-16,384. There a tile a program holds two rows on 16 warps and loads nothing while
    it waits in their reductions; the pipelined loop is loading its next rows meanwhile. Measured on an H200,
    % of copy bandwidth, tile a program → pipelined (torch.compile), at 2^26 elements
    (profiling/results/h200/norm-forward-candidates.md, probe 6):
    - rows of 12,288: LayerNorm bfloat16 69.6 → 75.5 (73.0), float16 70.9 → 76.9 (80.0); RMSNorm bfloat16
      85.0 → 86.9 (82.5), float16 70.9 → 87.3 (94.1);
    - rows of 16,384: LayerNorm bfloat16 75.7 → 85.9 (89.8), float16 78.0 → 86.0 (90.2); RMSNorm a point
      lower, bfloat16 89.2 → 88.2 (92.1), float16 89.4 → 88.1 (91.9).
    Two stages lost 27 points at 16,384 (59.1) and 16 warps, one program an SM, came second. In float32 it
    lost everywhere (96.4 → 89.1 for RMSNorm at 16,384: a float32 row leaves no room in registers for the
    next), and so did 16-bit rows of 8192 (94.2 → 83.3). The interpreter takes it in any dtype, so that the
    CPU tests check its indexing too."""
    return (not tile.looped and tile.block_n == launch_settings.MAX_ROW_BLOCK
            and (dtype.itemsize == 2 or interpreter_is_on()))


ROW_LOOPS = {
    # (subtract_mean, bytes an element): the row lengths (shortest, longest) looped over, and the tile
    (True, 2): ((4097, 7168, RowTile(2048, 1, 4, True)), (8193, 12288, RowTile(4096, 1, 8, True)),
                (16385, 24576, RowTile(4096, 1, 8, True))),
    (True, 4): ((8193, 12288, RowTile(4096, 1, 8, True)), (12289, 16384, RowTile(8192, 1, 16, True))),
    (False, 2): ((6145, 16384, RowTile(4096, 1, 16, True)),),
    (False, 4): ((4097, 12288, RowTile(4096, 1, 16, True)),),
}


def row_loop_tile(n: int, dtype: torch.dtype, subtract_mean: bool) -> RowTile | None:
    """The tile on which the forward loops over a row in blocks, compiled for its length
    (``layer_norm_fwd_looped_constant_n_kernel``), at the lengths in ``ROW_LOOPS``, where it measured faster
    than the kernel the row would run otherwise (a tile a program, pipelined rows, or, past MAX_ROW_BLOCK,
    ``launch.l2_looped_tile``'s loop of one program an SM); None at other lengths:
    - LayerNorm in 16 bits: rows of 4097-7168 in blocks of 2048 on 4 warps; 8193-12,288 and 16,385-24,576
      (which "looped_in_l2" reaches) in blocks of 4096 on 8 warps;
    - LayerNorm in float32: 8193-12,288 in blocks of 4096 on 8 warps (16 lost 10-20 points), 12,289-16,384
      in blocks of 8192 on 16;
    - RMSNorm: 6145-16,384 in 16 bits and 4097-12,288 in float32, in blocks of 4096 on 16 warps.

    Why reading a row twice (the second time from L2) beats reading it once here: rows in flight. Compiled
    offline (Triton 3.6, sm_90; probe 8's notes), the kernels these rows ran on fit one program, one row, an
    SM, which loads nothing while it waits in its reductions. float32 LayerNorm's tile kernel, compiled for
    its N on 16 warps, needs 72-108 registers a thread at 9000 and 11,000-16,384 (one program an SM: 70-89 %
    of copy bandwidth) but 64 at 10,240 (two: 98 %); the 16-bit rows' pipelined kernel takes 131-197 KB of
    shared memory, so one of its programs runs an SM at a time; from 5120 up the 16-bit tiles fit 2-3 programs
    an SM. The loop's programs take 29-62 registers and little shared memory: 2-8 share an SM, a row each.
    Its second pass finds the row in L2 as long as the rows in flight fit there: at 24,576 16-bit values,
    48 KB a row, 8 programs an SM on 132 SMs hold about 50 MB, and at 32,768 the loop lost (68 against the
    one-program-an-SM loop's 79 %).

    Measured on an H200 at 2^26 elements, % of copy bandwidth, the path before → this loop (torch.compile in
    the same run) (profiling/results/h200/norm-forward-candidates.md, probes 8 and 10):
    - RMSNorm bfloat16: 7168 83.9 → 95.1 (95.1), 7680 82.9 → 95.4, 8192 93.9 → 95.1, 9000 72.1 → 94.3
      (92.5), 10,240 83.0 → 95.0 (94.3), 12,288 86.7 → 95.0 (94.0), 16,384 89.4 → 94.5; but 6144 94.0 → 91.9,
      which keeps its tile; float16 at 9000 and 12,288 like bfloat16.
    - RMSNorm float32: 4608 98.5 → 99.9 (100.0), 5120-7680 97.6-98.2 → 99.8-99.9 (99.3-99.7), 8192
      97.7 → 99.9 (99.7), 10,240 98.3 → 99.7, 12,288 96.6 → 98.6, but 16,384 96.8 → 92.1, which keeps its tile.
    - LayerNorm bfloat16, blocks of 2048: 4608 70.4 → 75.3 (46.5), 5120 72.8 → 87.4 (51.0), 6144 81.8 → 90.2
      (58.1), 7168 84.9 → 86.4 (58.3), but 7680 87.3 → 82.4; blocks of 4096: 9000 59.4 → 71.7 (53.5), 10,240
      72.6 → 83.4, 12,288 77.1 → 87.5 (73.4), 20,000 59.6 → 73.7 (49.3), 24,576 69.0 → 72.8 (62.3); float16
      at 9000 and 12,288 60.4 → 78.6 and 78.6 → 88.3; at 8192 it tied (90.1 → 90.3) and at 16,384 lost
      (86.1 → 84.7).
    - LayerNorm float32: 9000 70.2 → 87.3 (91.2), 11,000 74.7 → 90.0 (87.0), 12,288 79.9 → 91.7 (90.6), but
      10,240 97.9 → 93.3 and 8192 99.4 → 96.2 (8192 keeps its tile; 10,240 is the one length of the range
      measured to lose); in blocks of 8192, 14,000 83.6 → 88.3 (78.2) and 16,384 88.8 → 94.3 (88.0). Below
      8192 its tile kept up with every loop (97-98.5 %).
    The rule is the same on the interpreter, so that the CPU tests check it."""
    for shortest, longest, tile in ROW_LOOPS.get((subtract_mean, dtype.itemsize), ()):
        if shortest <= n <= longest:
            return tile
    return None


def norm_row_tile(n: int, dtype: torch.dtype) -> RowTile:
    """``row_tile(n)`` for the norms' forward, except at both ends of the rows registers hold:
    - rows of at most ``launch.SHORT_ROW_TILE`` values: ``launch.short_row_tile``'s programs of 2 warps
      (which says why, and what they measured);
    - 16-bit rows of 8192 values or more take two rows a program. Why: a program loads its row, then waits
      in two block-wide reductions (mean, variance) before it writes, and loads nothing while it waits; 32
      values a thread are 128 bytes of float32 but only 64 of bfloat16, so a 16-bit program waits as long for
      half the bytes. Two rows a program keep twice the bytes in flight for the same two waits. In float32
      two rows a program lost. Measured on an H200: ``profiling/results/h200/norm-forward-probes.md``."""
    short = short_row_tile(n, dtype)
    if short is not None:
        return short
    tile = row_tile(n)
    if tile.looped:
        return tile
    if dtype.itemsize == 2 and tile.block_n >= 8192:  # a block that wide is one row
        return tile._replace(rows_per_tile=2)
    return tile


def launch_norm_fwd(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                    keep_statistics: bool):
    """The forward of both norms: LayerNorm, or RMSNorm when ``bias`` is None (no mean, no bias).
    Returns (y, mean, rstd); mean is None for RMSNorm, both statistics without ``keep_statistics``.
    A signature (shapes, strides, dtypes, devices, eps) seen before skips its checks and planning, which
    read nothing else: a row kernel's launch (``NormForwardLaunch``) or a split row's
    (``layer_norm_split.SplitNormForwardLaunch``) is kept for it."""
    signature = (op, x.shape, x.stride(), x.dtype, x.device, weight.shape, weight.stride(), weight.dtype,
                 weight.device, None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
                 eps, keep_statistics)
    planned = _NORM_FORWARD_LAUNCHES.get(signature)
    if planned is not None:
        return planned(x, weight, bias)
    subtract_mean = bias is not None
    per_column = {"weight": weight, "bias": bias} if subtract_mean else {"weight": weight}
    rows, n = check_norm_shapes(op, x, per_column=per_column)
    check_inputs(op, x, *per_column.values())
    if rows == 0:  # nothing to launch, nothing to keep
        return allocate_norm_outputs(x, rows, keep_statistics, subtract_mean)
    strategy = row_strategy(rows, n, x, cooperative=True, loop_in_l2=True)
    if strategy in ("split", "cooperative"):
        # Long rows on a GPU (or a few long ones) each split across programs (layer_norm_split.py).
        planned = SplitNormForwardLaunch.plan(x, rows, n, eps, subtract_mean, keep_statistics,
                                              cooperative=strategy == "cooperative")
        return _NORM_FORWARD_LAUNCHES.keep(signature, planned)(x, weight, bias)
    loop_tile = row_loop_tile(n, x.dtype, subtract_mean) if strategy in ("row", "looped_in_l2") else None
    if loop_tile is not None:
        tile = loop_tile
    elif strategy == "looped_in_l2":
        tile = l2_looped_tile(x.element_size(), subtract_mean)
    else:
        tile = norm_row_tile(n, x.dtype)
    constants = dict(BLOCK_N=tile.block_n, COMPUTE=compute_dtype(x.dtype), STORE_STATISTICS=keep_statistics,
                     SUBTRACT_MEAN=subtract_mean, HAS_BIAS=subtract_mean, num_warps=tile.num_warps)
    if pipelines_rows(tile, x.dtype):
        grid = (persistent_program_count(x, rows, PIPELINED_PROGRAMS_PER_SM),)
        planned = NormForwardLaunch(_norm_fwd_pipelined_rows_kernel, grid, rows, (rows, *split_float(eps)),
                                    constants | {"N": n, "STAGES": PIPELINED_STAGES, "num_warps": PIPELINED_WARPS,
                                                 "num_stages": PIPELINED_STAGES})
    elif loop_tile is not None or (tile.looped and loops_a_constant_row_length(subtract_mean, x.dtype)):
        planned = NormForwardLaunch(layer_norm_fwd_looped_constant_n_kernel, (rows,), rows, split_float(eps),
                                    constants | {"N": n})
    elif tile.looped:
        planned = NormForwardLaunch(layer_norm_fwd_looped_kernel, (rows,), rows, (n, *split_float(eps)), constants)
    else:
        planned = NormForwardLaunch(_layer_norm_fwd_kernel, (cdiv(rows, tile.rows_per_tile),), rows,
                                    (rows, *split_float(eps)), constants | {"N": n, "ROWS_PER_TILE": tile.rows_per_tile})
    return _NORM_FORWARD_LAUNCHES.keep(signature, planned)(x, weight, bias)


# --- backward (kernels in layer_norm_backward.py) -------------------------------------------------


def launch_layer_norm_bwd(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                          rstd: torch.Tensor):
    check_norm_shapes("layer_norm_backward", x, per_column={"weight": weight},
                      per_row={"mean": mean, "rstd": rstd}, like_x={"grad_out": grad_out})
    check_inputs("layer_norm_backward", grad_out, x, weight, mean, rstd)
    return launch_norm_bwd_unchecked(grad_out, x, weight, mean, rstd)


# --- registration: op, fake (shape-only), autograd ------------------------------------------------------


@torch.library.custom_op("triton_kernels::layer_norm_forward", mutates_args=())
def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_layer_norm_fwd(x, weight, bias, eps)


@layer_norm_forward.register_fake
def _layer_norm_forward_fake(x, weight, bias, eps):
    rows, _ = check_norm_shapes("layer_norm_forward", x, per_column={"weight": weight, "bias": bias})
    mean = x.new_empty(rows, dtype=accumulator_dtype(x.dtype))
    return torch.empty_like(x), mean, torch.empty_like(mean)


def _layer_norm_forward_setup_context(ctx, inputs, output):
    x, weight, _, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)  # the bias does not enter any gradient


def _layer_norm_forward_backward(ctx, grad_out, grad_mean, grad_rstd):
    # mean and rstd are returned only to be saved for this backward: gradients flowing into them are ignored.
    needs_x, needs_weight, needs_bias, _ = ctx.needs_input_grad
    if not (needs_x or needs_weight or needs_bias):
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    # Autograd may hand us a broadcast (stride-0) gradient, e.g. from y.sum().backward().
    grad_x, grad_weight, grad_bias = layer_norm_backward(grad_out.contiguous(), x, weight, mean, rstd)
    return (grad_x if needs_x else None, grad_weight if needs_weight else None,
            grad_bias if needs_bias else None, None)


layer_norm_forward.register_autograd(_layer_norm_forward_backward, setup_context=_layer_norm_forward_setup_context)


@torch.library.custom_op("triton_kernels::layer_norm_backward", mutates_args=())
def layer_norm_backward(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                        rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_layer_norm_bwd(grad_out, x, weight, mean, rstd)


@layer_norm_backward.register_fake
def _layer_norm_backward_fake(grad_out, x, weight, mean, rstd):
    check_norm_shapes("layer_norm_backward", x, per_column={"weight": weight},
                      per_row={"mean": mean, "rstd": rstd}, like_x={"grad_out": grad_out})
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(weight)


# --- what the levels call ------------------------------------------------------------------------------


class _LayerNormEager(EagerFunction):
    """The ops' forward and backward without the dispatcher, for eager calls (see __init__.py)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        out, mean, rstd = launch_layer_norm_fwd(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_weight, grad_bias = launch_norm_bwd_unchecked(grad_out.contiguous(), *ctx.saved_tensors)
        return grad_x, grad_weight, grad_bias, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim of ``x`` (..., N) by our kernels, differentiable; returns only
    the output (mean and rstd stay saved for the backward). torch.compile sees the registered op."""
    if torch.compiler.is_compiling():
        return layer_norm_forward(x, weight, bias, float(eps))[0]
    refuse_tangents("layer_norm", x, weight, bias)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad)):
        # No gradient wanted: no autograd bookkeeping, and no statistics for a backward.
        return launch_layer_norm_fwd(x, weight, bias, float(eps), keep_statistics=False)[0]
    return _LayerNormEager.call((x, weight, bias), (float(eps),))
