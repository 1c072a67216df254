"""Softmax in Triton: forward and backward over the last dim of x (..., N), as ``triton_kernels`` ops.

What it computes
    forward    y = exp(x − max x) / Σ exp(x − max x)           per row; subtracting the maximum keeps exp
                                                               from overflowing and changes nothing else
    backward   dx = y · (dy − Σ dy·y)                          y saved by the forward, nothing recomputed

Kernels, in the order they run
    ``_softmax_fwd_kernel``          a row (or a tile of short rows) held in registers: read once, max,
                                     exp, sum, write once
    ``_softmax_fwd_next_row_kernel`` the same for bfloat16 rows of 16,385-32,768, persistent: a program
                                     loads its next row while it reduces this one
    ``softmax_fwd_online_kernel``   rows longer than MAX_ONE_ARRAY_ROW_BLOCK: pass 1 keeps a running
                                     maximum and a running sum, rescaled whenever the maximum grows
                                     (the *online* softmax); pass 2 normalises. The row is read twice
    ``_softmax_bwd_kernel``          dx per row from y and dy in registers
    ``_softmax_bwd_looped_kernel``   the same for long rows: pass 1 sums dy·y, pass 2 writes dx
    (long rows split across programs, read once by a cooperative grid on a GPU: softmax_split.py)

The one idea that makes it fast
    Level 1 makes four passes over memory (max, subtract-and-exp, sum, divide) and allocates the
    intermediates. Here a program holds its row in registers, so the two reductions and the exps cost
    no memory traffic: the forward reads x and writes y once, at copy bandwidth. A row too long for
    registers cannot be normalised before its maximum is known, which is what the online pass solves:
    the statistics take one read instead of two, the same trick flash attention plays on score tiles.

Launch
    ``launch.row_tile``, shared with LayerNorm: a row rounded up to a power of two is one block if it
    fits in 16384 elements (the forward, which keeps one value an element in registers, 32768 at 32
    warps); short rows are stacked into tiles of at least 4096 elements; one warp per 1024 elements.
    The forward's rows of at most 2048 run on smaller programs instead (``launch.short_row_tile``: 1024
    values, or one row of 2048, on 2 warps), which keep more programs an SM, each waiting in its
    reductions at a different time.
    Longer rows are split across a cooperative grid on a GPU (softmax_split.py), read once; under the
    interpreter, and where that grid would hold too few rows at once, they get one program each, walked
    in blocks of 4096, unless they are too few to fill the SMs: then ``launch.row_strategy`` splits each
    across programs in two phases. A row kernel's launch is worked out once per signature of its inputs
    and kept (``SoftmaxLaunch``); the split ones are planned at each call, where the GPU's time dwarfs it.

Measured (H100 80GB HBM3, Triton 3.6, CUDA-event medians; copy bandwidth measured alongside: 2.96 TB/s)
    8192 × 8192 float32: forward 183 µs, 2.94 TB/s (99 % of copy; torch.softmax 1.84 TB/s), backward
    2.99 TB/s. bfloat16: forward 2.85 TB/s (96 %), backward 2.91 TB/s.
    64 rows of 300000 (online kernels): forward 0.90 TB/s, backward 0.97 TB/s: 64 programs on 132
    SMs, each walking its row alone. Such rows (few, at least launch.SPLIT_MIN_ROW long) are now split
    across programs instead (softmax_split.py: partial maxima and sums in a first launch, merged in a
    second), or across a cooperative grid; the row-length sweep times them
    (profiling/results/h200/sweep-*.csv).

Limits
    Any N (rows of any length are looped over, or split across programs, never rejected), contiguous
    input. float16, bfloat16, float32 and float64 on
    the GPU, computed in float32 (float64 for float64); float32 and float64 under the CPU interpreter.

Check
    python -m pytest tests -k "softmax and triton"
    python -m profiling --component softmax --shape 8192 8192 --backward
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .eager import EagerFunction, refuse_tangents
from .launch import (SignatureTable, cdiv, check_contiguous, check_inputs, compute_dtype, exp_on_sfu, launch,
                     loads_next_row_early, on_device, persistent_program_count, require, row_matrix, row_strategy,
                     row_tile, short_row_tile)
from .softmax_split import launch_softmax_bwd_split, launch_softmax_fwd_split

# --- input checks (launchers and fake implementations) ----------------------------------------------


def check_softmax_shapes(op: str, x: torch.Tensor, like_x: dict | None = None) -> tuple[int, int]:
    """x is (..., N), softmax taken over its last dim; ``like_x`` tensors match it in shape and dtype.
    All contiguous. Returns x's (rows, N) (``launch.row_matrix``), for the launcher to walk."""
    rows_and_n = row_matrix(op, x)
    if not like_x:  # the forward: no dict or tuple built per call (at decode sizes, a share of the call)
        check_contiguous(op, x)
        return rows_and_n
    for name, tensor in like_x.items():
        require(tensor.shape == x.shape and tensor.dtype == x.dtype,
                lambda: f"{op}: {name} is {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(x.shape)} {x.dtype}")
    check_contiguous(op, x, *like_x.values())
    return rows_and_n


# --- forward -----------------------------------------------------------------------------------------


@triton.jit
def _softmax_fwd_kernel(X, Y, n_rows, N, BLOCK_N: tl.constexpr, ROWS_PER_TILE: tl.constexpr,
                        COMPUTE: tl.constexpr):
    rows = tl.program_id(0) * ROWS_PER_TILE + tl.arange(0, ROWS_PER_TILE)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < N)[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    # Padding reads as −inf: it never wins the maximum and adds exp(−inf) = 0 to the sum. Rows past
    # n_rows (the last tile's tail) would be all −inf, and −inf − (−inf) is NaN: zeros there instead.
    x = tl.load(X + offsets, mask=mask, other=float("-inf")).to(COMPUTE)
    x = tl.where(row_mask[:, None], x, 0.0)
    numerators = exp_on_sfu(x - tl.max(x, axis=1)[:, None])
    y = numerators * (1.0 / tl.sum(numerators, axis=1))[:, None]
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_next_row_kernel(X, Y, n_rows, N, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr,
                                 WIDE_OFFSETS: tl.constexpr):
    """``_softmax_fwd_kernel`` for the longest rows held in registers, bfloat16, persistent: one program an SM
    walks every (number of programs)-th row and loads its next row before it reduces this one.

    Why: a row of 32,768 values takes a program of 32 warps, the whole register file, so an SM holds one
    program, and one row's load is all it has in flight. While the program waits out its two reductions
    (a max and a sum across 1024 threads) and writes y, that SM reads nothing, and the row kernel reached
    75 % of copy bandwidth in bfloat16 on an H200. Issued first, the next row's load is in flight through
    all of it. It waits as 16-bit values, 16 registers a thread; in float32 it would take 32 more, past the
    64 a thread has at 32 warps, and spill (profiling/results/h200/softmax-next-row.md).

    ``WIDE_OFFSETS``: row offsets in int64, for a matrix of 2^31 elements or more. Below that they stay
    int32, which read 82.8 % of copy bandwidth on an H200 where int64 read 77.8. Not for registers (both
    take 64 and spill 104 bytes in Triton 3.6's code for sm_90) but instructions: at copy speed an SM issues
    about 8 lane-instructions a byte it receives (``exp_on_sfu`` counts them), and a 64-bit offset is a
    pair of 32-bit ones."""
    cols = tl.arange(0, BLOCK_N)
    step = tl.num_programs(0)
    next_x = _row_if_any(X, tl.program_id(0), n_rows, N, cols, WIDE_OFFSETS)
    for row in range(tl.program_id(0), n_rows, step):
        x = next_x.to(COMPUTE)
        next_x = _row_if_any(X, row + step, n_rows, N, cols, WIDE_OFFSETS)
        numerators = exp_on_sfu(x - tl.max(x, axis=0))
        y = numerators * (1.0 / tl.sum(numerators, axis=0))
        tl.store(Y + _row_start(row, N, WIDE_OFFSETS) + cols, y.to(Y.dtype.element_ty), mask=cols < N)


@triton.jit
def _row_start(row, N, WIDE_OFFSETS: tl.constexpr):
    """Where row ``row`` of a matrix of rows of N values starts, in int64 only where int32 would overflow."""
    if WIDE_OFFSETS:
        row = tl.cast(row, tl.int64)
    return row * N


@triton.jit
def _row_if_any(X, row, n_rows, N, cols, WIDE_OFFSETS: tl.constexpr):
    """Row ``row`` of the (n_rows, N) matrix at X, padded with −inf; all −inf past the last row (cols < 0 is
    false everywhere), so a program's load of the row after its last one reads nothing."""
    return tl.load(X + _row_start(row, N, WIDE_OFFSETS) + cols, mask=cols < tl.where(row < n_rows, N, 0),
                   other=float("-inf"))


@triton.jit
def row_max_and_sum_of_exp(X, N, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    """(max x, Σ exp(x − max x)) of the row of N values at X, in one pass over it: the online softmax.
    Also the first pass of the LM head's loss (linear_cross_entropy.py), whose rows are a vocabulary long."""
    cols = tl.arange(0, BLOCK_N)
    # Every lane of the block is its own online softmax over the elements it visits: a running maximum,
    # and a running sum of exp(x − maximum) multiplied by exp(old − new) when the maximum grows. Lanes
    # need no reduction inside the loop; they are merged once at the end.
    running_max = tl.full((BLOCK_N,), float("-inf"), COMPUTE)
    running_sum = tl.zeros((BLOCK_N,), COMPUTE)
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        # evict_last: the caller's second pass reads this block again, so ask L2 to keep it if it can.
        x = tl.load(X + start + cols, mask=mask, other=float("-inf"), eviction_policy="evict_last").to(COMPUTE)
        new_max = tl.maximum(running_max, x)
        # A lane that has seen only −inf still has maximum −inf: shift by 0 there, so that exp gives 0
        # instead of exp(−inf − (−inf)) = NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * exp_on_sfu(running_max - shift) + exp_on_sfu(x - shift)
        running_max = new_max
    row_max = tl.max(running_max, axis=0)
    return row_max, tl.sum(running_sum * exp_on_sfu(running_max - row_max), axis=0)


@triton.jit
def softmax_fwd_online_kernel(X, Y, N, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    X += row.to(tl.int64) * N
    Y += row.to(tl.int64) * N
    # pass 1: the row's maximum and sum of exponentials, online
    row_max, row_sum = row_max_and_sum_of_exp(X, N, BLOCK_N, COMPUTE)
    # pass 2: normalise
    write_softmax_blocks(X, Y, N, row_max, row_sum, BLOCK_N, COMPUTE)


@triton.jit
def write_softmax_blocks(X, Y, N, row_max, row_sum, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    """y = exp(x − row_max) / row_sum over the row of N values at X, block by block: the last pass of
    the online kernel, and of the earlier versions in ``softmax_versions.py``."""
    cols = tl.arange(0, BLOCK_N)
    reciprocal_sum = 1.0 / row_sum  # one division a row, then a multiply per element
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        x = tl.load(X + start + cols, mask=mask, other=0.0).to(COMPUTE)
        y = exp_on_sfu(x - row_max) * reciprocal_sum
        tl.store(Y + start + cols, y.to(Y.dtype.element_ty), mask=mask)


def launch_softmax_fwd(x: torch.Tensor) -> torch.Tensor:
    """y = softmax(x) over x's last dim. A signature (shape, strides, dtype, device) seen before skips the
    checks and the planning, which read nothing else: its row kernel's launch is kept (``SoftmaxLaunch``)."""
    signature = ("softmax_forward", x.shape, x.stride(), x.dtype, x.device)
    planned = _SOFTMAX_LAUNCHES.get(signature)
    if planned is not None:
        return planned(x)
    rows, n = check_softmax_shapes("softmax_forward", x)
    check_inputs("softmax_forward", x)
    return _run_row_kernels(signature, softmax_fwd_online_kernel, _softmax_fwd_kernel, launch_softmax_fwd_split,
                            rows, n, x, arrays=1, cooperative=True, next_row_kernel=_softmax_fwd_next_row_kernel,
                            short_rows_up_to=SHORT_ROWS_UP_TO)


SHORT_ROWS_UP_TO = 2048
"""The forward runs rows of at most this many values (padded to a power of two) on ``launch.short_row_tile``'s
programs of 2 warps: one row of 2048 a program, 32 values a thread, gained 3 points in bfloat16 on an H200
(95.1 → 98.1 % of copy bandwidth), where no smaller program gained the norms, which hold two values a column,
more than half a point."""


class SoftmaxLaunch(NamedTuple):
    """One launch of a softmax row kernel (forward or backward), but its tensors, for one signature of its
    inputs: at decode sizes the checks, the strategy and the tile cost a third of the launcher's host
    time, and a model calls softmax with the same few signatures step after step. Planned under
    launch.py's row-strategy settings of the time, as ``row_tile``'s cached answers are: code that changes
    them empties ``_SOFTMAX_LAUNCHES`` too."""

    kernel: object
    grid: tuple[int]
    scalars: tuple  # the kernel's arguments after its tensors
    constants: dict

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The output, shaped like the last of ``inputs`` (x forward; dy, y backward)."""
        out = torch.empty_like(inputs[-1])
        with on_device(out):
            launch(self.kernel, self.grid, *inputs, out, *self.scalars, **self.constants)
        return out


_SOFTMAX_LAUNCHES = SignatureTable()


def _run_row_kernels(signature: tuple, looped_kernel, tiled_kernel, split_launcher, rows: int, n: int,
                     *inputs: torch.Tensor, arrays: int = 2, cooperative: bool = False,
                     next_row_kernel=None, short_rows_up_to: int = 0) -> torch.Tensor:
    """One output shaped like the (..., N) ``inputs``, walked as (``rows``, ``n``) matrices
    (``launch.row_matrix``, which the caller has already asked) by the strategy
    ``launch.row_strategy`` picks: rows that fit a block go several (or one) to a program
    (``tiled_kernel``), longer rows one to a program looping over their blocks (``looped_kernel``), a
    few long rows split across programs (``split_launcher``, softmax_split.py). ``arrays``: the values a
    column the tiled kernel holds in registers (``launch.row_tile``): 1 in the forward, so longer rows fit.
    ``cooperative``: ``split_launcher`` has a cooperative version, which a GPU runs for every longer row.
    ``next_row_kernel``: a persistent ``tiled_kernel`` that loads a program's next row early, for the rows
    ``launch.loads_next_row_early`` names. ``short_rows_up_to``: rows whose block is at most this long run
    on ``launch.short_row_tile``'s smaller programs (0: none). A row kernel's launch is kept under
    ``signature``."""
    if rows == 0:  # no elements: row_matrix counts no rows when N is 0
        return torch.empty_like(inputs[-1])
    strategy = row_strategy(rows, n, inputs[-1], arrays, cooperative)
    if strategy == "cooperative":
        out = torch.empty_like(inputs[-1])
        split_launcher(*inputs, out, rows, n, cooperative=True)
        return out
    if strategy == "split":
        out = torch.empty_like(inputs[-1])
        split_launcher(*inputs, out, rows, n)
        return out
    tile = short_row_tile(n, inputs[-1].dtype, short_rows_up_to) if short_rows_up_to else None
    if tile is None:
        tile = row_tile(n, arrays)
    constants = dict(BLOCK_N=tile.block_n, COMPUTE=compute_dtype(inputs[-1].dtype), num_warps=tile.num_warps)
    if tile.looped:
        planned = SoftmaxLaunch(looped_kernel, (rows,), (n,), constants)
    elif next_row_kernel is not None and loads_next_row_early(tile, inputs[-1].dtype):
        programs = persistent_program_count(inputs[-1], rows, 1)
        # A program's last load is of the row after its last, past the matrix: that offset must fit too.
        planned = SoftmaxLaunch(next_row_kernel, (programs,), (rows, n),
                                constants | {"WIDE_OFFSETS": (rows + programs) * n >= 2**31})
    else:
        planned = SoftmaxLaunch(tiled_kernel, (cdiv(rows, tile.rows_per_tile),), (rows, n),
                                constants | {"ROWS_PER_TILE": tile.rows_per_tile})
    return _SOFTMAX_LAUNCHES.keep(signature, planned)(*inputs)


# --- backward ----------------------------------------------------------------------------------------


@triton.jit
def _softmax_bwd_kernel(DY, Y, DX, n_rows, N, BLOCK_N: tl.constexpr, ROWS_PER_TILE: tl.constexpr,
                        COMPUTE: tl.constexpr):
    rows = tl.program_id(0) * ROWS_PER_TILE + tl.arange(0, ROWS_PER_TILE)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    y = tl.load(Y + offsets, mask=mask, other=0.0).to(COMPUTE)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(COMPUTE)
    dx = y * (dy - tl.sum(dy * y, axis=1)[:, None])
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_looped_kernel(DY, Y, DX, N, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    offset = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    # pass 1: Σ dy·y, lane by lane (evict_last: pass 2 reads y and dy again)
    dot = tl.zeros((BLOCK_N,), COMPUTE)
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        y = tl.load(Y + offset + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(COMPUTE)
        dy = tl.load(DY + offset + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(COMPUTE)
        dot += dy * y
    row_dot = tl.sum(dot, axis=0)
    # pass 2: dx
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        y = tl.load(Y + offset + start + cols, mask=mask, other=0.0).to(COMPUTE)
        dy = tl.load(DY + offset + start + cols, mask=mask, other=0.0).to(COMPUTE)
        tl.store(DX + offset + start + cols, (y * (dy - row_dot)).to(DX.dtype.element_ty), mask=mask)


def launch_softmax_bwd(grad_out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    check_softmax_shapes("softmax_backward", y, like_x={"grad_out": grad_out})
    check_inputs("softmax_backward", grad_out, y)
    return launch_softmax_bwd_unchecked(grad_out, y)


def launch_softmax_bwd_unchecked(grad_out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``launch_softmax_bwd`` without its checks, for the eager backward (see ``triton_kernels/__init__.py``);
    its launch kept per signature of y (grad_out matches it, as the checks or autograd made sure)."""
    signature = ("softmax_backward", y.shape, y.stride(), y.dtype, y.device)
    planned = _SOFTMAX_LAUNCHES.get(signature)
    if planned is not None:
        return planned(grad_out, y)
    rows, n = row_matrix("softmax_backward", y)
    return _run_row_kernels(signature, _softmax_bwd_looped_kernel, _softmax_bwd_kernel, launch_softmax_bwd_split,
                            rows, n, grad_out, y)


# --- registration: op, fake (shape-only), autograd ------------------------------------------------------


@torch.library.custom_op("triton_kernels::softmax_forward", mutates_args=())
def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    return launch_softmax_fwd(x)


@softmax_forward.register_fake
def _softmax_forward_fake(x):
    check_softmax_shapes("softmax_forward", x)
    return torch.empty_like(x)


def _softmax_forward_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)  # the backward needs y only, not x


def _softmax_forward_backward(ctx, grad_out):
    if not ctx.needs_input_grad[0]:
        return None
    (y,) = ctx.saved_tensors
    # Autograd may hand us a broadcast (stride-0) gradient, e.g. from y.sum().backward().
    return softmax_backward(grad_out.contiguous(), y)


softmax_forward.register_autograd(_softmax_forward_backward, setup_context=_softmax_forward_setup_context)


@torch.library.custom_op("triton_kernels::softmax_backward", mutates_args=())
def softmax_backward(grad_out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return launch_softmax_bwd(grad_out, y)


@softmax_backward.register_fake
def _softmax_backward_fake(grad_out, y):
    check_softmax_shapes("softmax_backward", y, like_x={"grad_out": grad_out})
    return torch.empty_like(y)


# --- what the levels call ------------------------------------------------------------------------------


class _SoftmaxEager(EagerFunction):
    """The ops' forward and backward without the dispatcher, for eager calls (see __init__.py)."""

    @staticmethod
    def forward(ctx, x):
        y = launch_softmax_fwd(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        (y,) = ctx.saved_tensors
        return launch_softmax_bwd_unchecked(grad_out.contiguous(), y)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of ``x`` (..., N) by our kernels, differentiable.
    torch.compile sees the registered op."""
    if torch.compiler.is_compiling():
        return softmax_forward(x)
    refuse_tangents("softmax", x)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return launch_softmax_fwd(x)  # no gradient wanted: skip autograd's bookkeeping
    return _SoftmaxEager.call((x,))
