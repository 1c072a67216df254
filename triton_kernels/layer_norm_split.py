"""LayerNorm and RMSNorm in Triton with each row split across programs: in one cooperative launch that
reads the row once, or in two phases.

Why
    ``layer_norm.py`` gives each row one program. With a few long rows (a (4, 262144) activation, a
    batch of one sequence of long features) that is a few programs on a GPU of 132 SMs: most SMs sit
    idle, and each busy one loops over its row alone. Here a row is cut into slices of
    ``launch.SPLIT_BLOCK`` elements, one program each, so rows × slices programs share the work.
    ``launch.row_strategy`` decides when, and whether on a cooperative grid. The backward splits every
    row too long for registers, however many rows there are: its column-slice programs are what keep dw
    and db in registers (``layer_norm_backward.py`` says why that matters).

Read once: the cooperative forward (a GPU only)
    ``_norm_fwd_cooperative_kernel`` keeps each slice in its program's registers while the row's
    programs exchange their partial statistics: every program stores its slice's partials, counts
    itself in at the row's counter and waits there (``launch.arrive_and_wait``) until the row's other
    slices have arrived, then combines them and writes y from registers. A program may only wait for
    another that is running too, so the grid is launched cooperatively (``launch.launch_cooperative``:
    every program resident at once, the rows at once as many as fit) and walks the rows in turns. It
    needs at least ``launch.COOPERATIVE_MIN_ROWS_AT_ONCE`` rows at once, else the two phases below run.
    On an H100 it took LayerNorm over float32 rows of 32,768 and 131,072 from 65 and 64 % of copy
    bandwidth to 81 and 76 % (profiling/results/h100/sweep.csv): short of a row held in one program
    (99 %), because a program that waits loads nothing. Two ways to load during the wait lost on an H100
    and again on an H200: the next row's slice loaded before it (two slices in registers: half the
    programs an SM; profiling/results/h100/cooperative-grids.md), and the matrix streamed through L2,
    which reads x once only while few enough slices are in flight, and then too few programs run
    (profiling/results/h100/long-rows-streamed.md, h200/long-row-probes.md). Rows as short as 32,768
    now loop instead, one an SM, and find their second read in L2 (``launch.l2_looped_tile``;
    profiling/results/h100/looped-rows-in-l2.md). The float32 backward has a cooperative grid too
    (``_norm_bwd_cooperative_kernel``): x and dy stay in registers while the row's Σx̂·g and Σg gather,
    and each program keeps one column slice for good, so its dw, db stay in registers across its rows.

What it computes (the formulas of ``layer_norm.py``; RMSNorm with ``SUBTRACT_MEAN=HAS_BIAS=False``)
    forward  phase 1  each slice's mean and sum of squared deviations (m2) (RMSNorm: its Σx²), into
                      (rows, slices) float32 buffers
             phase 2  each program combines its row's partials (Chan's formula: the mean is the
                      count-weighted mean of the slices' means, m2 the slices' m2 plus each slice's
                      count·(slice mean − mean)²; no Σx² cancellation) and normalises its slice
    backward phase 1  each slice's Σx̂·g and Σg, into (rows, slices) buffers
             phase 2  programs own (slice, group of rows): for each of their rows they combine the
                      row's partial sums, write dx for their slice and add dy·x̂ (and dy) into dw (db)
                      kept in registers; then one partial row per group, which the column reduction
                      of ``layer_norm_backward.py`` sums in a fixed order: deterministic, no atomics

Cost
    In two phases x is read twice forward (phase 2 re-reads each slice, from L2 when the rows in flight
    fit there), and x, dy twice backward, as in the looped kernels; the cooperative grids read them once.
    The partial buffers are rows × slices values.
    Every phase-2 program reads all its row's partials from L2: at 2^24 elements a row, 4096 of them,
    as many bytes as its own float32 slice (larger slices for such rows would cut that).

Limits
    As ``layer_norm.py``; a row has at most 2^31 elements.

Check
    python -m pytest tests -k "strateg"
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import launch as launch_settings  # SPLIT_BLOCK is read at each call: tests lower it
from .launch import (
    ROW_ARRIVALS,
    accumulator_dtype,
    arrive_and_wait,
    cdiv,
    compute_dtype,
    cooperative_rows_at_once,
    launch,
    launch_cooperative,
    next_power_of_2,
    on_device,
    persistent_program_count,
    split_float,
    split_row_partials,
    split_row_slice,
)

SPLIT_WARPS = 4
"""Warps of a split program: 32 values a thread for a 4096-element slice, as ``row_tile`` gives a row
of 4096."""

# --- forward -----------------------------------------------------------------------------------------


@triton.jit
def _store_slice_statistics(x, mask, PartialMean, PartialM2, row, piece, N, n_slices, BLOCK_N: tl.constexpr,
                            COMPUTE: tl.constexpr, SUBTRACT_MEAN: tl.constexpr):
    """Phase 1 for one slice x (padding 0) of ``row``: its mean and m2 (RMSNorm: its Σx²) into the
    (rows, slices) buffers."""
    slot = row.to(tl.int64) * n_slices + piece
    if SUBTRACT_MEAN:
        mean = tl.sum(x, axis=0) / tl.cast(tl.minimum(N - piece * BLOCK_N, BLOCK_N), COMPUTE)
        deviation = tl.where(mask, x - mean, 0.0)
        tl.store(PartialMean + slot, mean)
        tl.store(PartialM2 + slot, tl.sum(deviation * deviation, axis=0))
    else:
        tl.store(PartialM2 + slot, tl.sum(x * x, axis=0))


@triton.jit
def _combine_row_statistics(PartialMean, PartialM2, row, N, n_slices, eps_high, eps_low, BLOCK_N: tl.constexpr,
                            BLOCK_SLICES: tl.constexpr, COMPUTE: tl.constexpr, SUBTRACT_MEAN: tl.constexpr):
    """Phase 2's start: ``row``'s (mean, rstd) from its slices' partials, which every program of the row
    combines itself (cheaper than a launch of its own). ``.cg`` reads them from L2: in the cooperative
    kernel another SM wrote them a moment ago (``launch.arrive_and_wait``)."""
    slots, slice_mask = split_row_partials(row, n_slices, BLOCK_SLICES)
    m2 = tl.sum(tl.load(PartialM2 + slots, mask=slice_mask, other=0.0, cache_modifier=".cg"), axis=0)
    mean = tl.zeros((), COMPUTE)  # RMSNorm's
    if SUBTRACT_MEAN:
        counts = tl.where(slice_mask, tl.minimum(N - tl.arange(0, BLOCK_SLICES) * BLOCK_N, BLOCK_N), 0).to(COMPUTE)
        means = tl.load(PartialMean + slots, mask=slice_mask, other=0.0, cache_modifier=".cg")
        mean = tl.sum(counts * means, axis=0) / N
        deviation = means - mean
        m2 += tl.sum(counts * deviation * deviation, axis=0)
    return mean, 1.0 / tl.sqrt(m2 / N + tl.cast(eps_high, COMPUTE) + tl.cast(eps_low, COMPUTE))


@triton.jit
def _write_normalized_slice(x, Y, W, B, Mean, Rstd, row, piece, cols, mask, offsets, mean, rstd, COMPUTE: tl.constexpr,
                            STORE_STATISTICS: tl.constexpr, SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Phase 2's end: y = (x − mean)·rstd·w (+ b) for one slice; the row's first slice stores the statistics."""
    if STORE_STATISTICS:
        if piece == 0:
            if SUBTRACT_MEAN:
                tl.store(Mean + row, mean)
            tl.store(Rstd + row, rstd)
    y = (x - mean) * rstd * tl.load(W + cols, mask=mask).to(COMPUTE)
    if HAS_BIAS:
        y += tl.load(B + cols, mask=mask).to(COMPUTE)
    # Streaming (.cs): y is not read again here, and its lines would otherwise push out of L2 the weight
    # (and bias), which every row's slice at these columns reads again
    # (profiling/results/h100/evict-first-staging.md).
    tl.store(Y + offsets, y.to(Y.dtype.element_ty), mask=mask, cache_modifier=".cs")


@triton.jit
def _norm_fwd_split_statistics_kernel(X, PartialMean, PartialM2, N, n_slices, BLOCK_N: tl.constexpr,
                                      COMPUTE: tl.constexpr, SUBTRACT_MEAN: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    _, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
    # evict_last: phase 2 reads this slice again
    x = tl.load(X + offsets, mask=mask, other=0.0, eviction_policy="evict_last").to(COMPUTE)
    _store_slice_statistics(x, mask, PartialMean, PartialM2, row, piece, N, n_slices, BLOCK_N, COMPUTE, SUBTRACT_MEAN)


@triton.jit
def _norm_fwd_split_normalize_kernel(X, Y, W, B, PartialMean, PartialM2, Mean, Rstd, N, n_slices, eps_high, eps_low,
                                     BLOCK_N: tl.constexpr, BLOCK_SLICES: tl.constexpr, COMPUTE: tl.constexpr,
                                     STORE_STATISTICS: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
                                     HAS_BIAS: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    mean, rstd = _combine_row_statistics(PartialMean, PartialM2, row, N, n_slices, eps_high, eps_low, BLOCK_N,
                                         BLOCK_SLICES, COMPUTE, SUBTRACT_MEAN)
    cols, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
    x = tl.load(X + offsets, mask=mask, other=0.0).to(COMPUTE)
    _write_normalized_slice(x, Y, W, B, Mean, Rstd, row, piece, cols, mask, offsets, mean, rstd, COMPUTE,
                            STORE_STATISTICS, SUBTRACT_MEAN, HAS_BIAS)


@triton.jit
def _norm_fwd_cooperative_kernel(X, Y, W, B, PartialMean, PartialM2, Arrivals, Mean, Rstd, n_rows, N, n_slices,
                                 eps_high, eps_low, BLOCK_N: tl.constexpr, BLOCK_SLICES: tl.constexpr,
                                 COMPUTE: tl.constexpr, STORE_STATISTICS: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
                                 HAS_BIAS: tl.constexpr):
    # The grid is (rows at once) × n_slices programs, all resident: program p always owns slice
    # p % n_slices, of rows p // n_slices, then that plus the rows at once, and so on.
    program = tl.program_id(0)
    piece = program % n_slices
    for row in range(program // n_slices, n_rows, tl.num_programs(0) // n_slices):
        cols, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
        # x crosses DRAM once: it stays in this program's registers while the row's partials gather.
        x = tl.load(X + offsets, mask=mask, other=0.0, eviction_policy="evict_first").to(COMPUTE)
        _store_slice_statistics(x, mask, PartialMean, PartialM2, row, piece, N, n_slices, BLOCK_N, COMPUTE,
                                SUBTRACT_MEAN)
        arrive_and_wait(Arrivals + row, n_slices)
        mean, rstd = _combine_row_statistics(PartialMean, PartialM2, row, N, n_slices, eps_high, eps_low, BLOCK_N,
                                             BLOCK_SLICES, COMPUTE, SUBTRACT_MEAN)
        _write_normalized_slice(x, Y, W, B, Mean, Rstd, row, piece, cols, mask, offsets, mean, rstd, COMPUTE,
                                STORE_STATISTICS, SUBTRACT_MEAN, HAS_BIAS)


def allocate_norm_outputs(x: torch.Tensor, rows: int, keep_statistics: bool, subtract_mean: bool):
    """(y, mean, rstd) for a norm's forward on x: y like x; rstd (and LayerNorm's mean) a float32 (float64)
    value a row, or None where no backward will read them (inference; RMSNorm has no mean)."""
    rstd = x.new_empty(rows, dtype=accumulator_dtype(x.dtype)) if keep_statistics else None
    mean = torch.empty_like(rstd) if keep_statistics and subtract_mean else None
    return torch.empty_like(x), mean, rstd


class SplitNormForwardLaunch(NamedTuple):
    """One forward of LayerNorm, or RMSNorm, over rows split across programs, for one signature of its
    inputs: ``layer_norm.NormForwardLaunch``'s twin for the ``"split"`` and ``"cooperative"`` strategies,
    which ``layer_norm.launch_norm_fwd`` keeps per signature as it keeps that one. A call allocates y, the
    statistics and the (rows, slices) partial buffers, and launches. ``cooperative`` (a GPU only): one launch
    that reads x once, when the GPU holds enough rows' slices at once, which ``launch.launch_cooperative``
    asks at each call (it depends on the buffers' alignment too); otherwise, and under the interpreter, the
    two phases."""

    grid: tuple[int, int]  # (rows, n_slices): one program a slice, in two phases
    scalars: tuple  # (N, n_slices): the kernels' sizes
    eps: tuple  # split_float(eps)
    cooperative: bool
    flags: dict  # the statistics kernel's constants
    normalize_flags: dict  # the normalising (and cooperative) kernels' constants

    @classmethod
    def plan(cls, x: torch.Tensor, rows: int, n: int, eps: float, subtract_mean: bool, keep_statistics: bool,
             cooperative: bool) -> "SplitNormForwardLaunch":
        block = launch_settings.SPLIT_BLOCK
        slices = cdiv(n, block)
        flags = dict(BLOCK_N=block, COMPUTE=compute_dtype(x.dtype), SUBTRACT_MEAN=subtract_mean, num_warps=SPLIT_WARPS)
        normalize_flags = dict(BLOCK_SLICES=next_power_of_2(slices), STORE_STATISTICS=keep_statistics,
                               HAS_BIAS=subtract_mean, **flags)
        return cls((rows, slices), (n, slices), split_float(eps), cooperative, flags, normalize_flags)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        """(y, mean, rstd) of inputs of this launch's signature, as ``layer_norm.launch_norm_fwd`` returns them."""
        rows, slices = self.grid
        subtract_mean = self.flags["SUBTRACT_MEAN"]
        out, mean, rstd = allocate_norm_outputs(x, rows, self.normalize_flags["STORE_STATISTICS"], subtract_mean)
        partial_m2 = x.new_empty(self.grid, dtype=accumulator_dtype(x.dtype))
        partial_mean = torch.empty_like(partial_m2) if subtract_mean else partial_m2  # RMSNorm never reads it
        # Pointers a kernel never reads (statistics it does not store, RMSNorm's mean and bias): out stands in.
        mean_out, rstd_out = (mean if mean is not None else out), (rstd if rstd is not None else out)
        bias_in = bias if subtract_mean else weight
        with on_device(x):
            if self.cooperative and launch_cooperative(
                    _norm_fwd_cooperative_kernel, rows, slices, x, out, weight, bias_in, partial_mean, partial_m2,
                    ROW_ARRIVALS, mean_out, rstd_out, rows, *self.scalars, *self.eps, **self.normalize_flags):
                return out, mean, rstd
            launch(_norm_fwd_split_statistics_kernel, self.grid, x, partial_mean, partial_m2, *self.scalars,
                   **self.flags)
            launch(_norm_fwd_split_normalize_kernel, self.grid, x, out, weight, bias_in, partial_mean, partial_m2,
                   mean_out, rstd_out, *self.scalars, *self.eps, **self.normalize_flags)
        return out, mean, rstd


# --- backward ----------------------------------------------------------------------------------------


@triton.jit
def _slice_x_hat(X, Mean, Rstd, row, offsets, mask, COMPUTE: tl.constexpr, SUBTRACT_MEAN: tl.constexpr,
                 EVICTION: tl.constexpr):
    """x̂ = (x − mean)·rstd of one slice of a row (0 in the padding), and the row's rstd."""
    x = tl.load(X + offsets, mask=mask, other=0.0, eviction_policy=EVICTION).to(COMPUTE)
    rstd = tl.load(Rstd + row)
    if SUBTRACT_MEAN:
        x = tl.where(mask, x - tl.load(Mean + row), 0.0)
    return x * rstd, rstd


@triton.jit
def _store_slice_sums(x_hat, g, PartialXHatG, PartialG, row, piece, n_slices, SUBTRACT_MEAN: tl.constexpr):
    """Phase 1 for one slice of ``row``: its Σx̂·g (and Σg) into the (rows, slices) buffers."""
    slot = row.to(tl.int64) * n_slices + piece
    tl.store(PartialXHatG + slot, tl.sum(x_hat * g, axis=0))
    if SUBTRACT_MEAN:
        tl.store(PartialG + slot, tl.sum(g, axis=0))


@triton.jit
def _combine_row_sums(PartialXHatG, PartialG, row, N, n_slices, BLOCK_SLICES: tl.constexpr, COMPUTE: tl.constexpr,
                      SUBTRACT_MEAN: tl.constexpr):
    """Phase 2's start: ``row``'s mean(x̂·g) and mean(g) (RMSNorm: 0) from its slices' partial sums, read
    from L2 (``.cg``: in the cooperative kernel another SM wrote them a moment ago)."""
    slots, slice_mask = split_row_partials(row, n_slices, BLOCK_SLICES)
    mean_x_hat_g = tl.sum(tl.load(PartialXHatG + slots, mask=slice_mask, other=0.0, cache_modifier=".cg"), axis=0) / N
    mean_g = tl.zeros((), COMPUTE)  # RMSNorm's dx has no mean(g) term
    if SUBTRACT_MEAN:
        mean_g = tl.sum(tl.load(PartialG + slots, mask=slice_mask, other=0.0, cache_modifier=".cg"), axis=0) / N
    return mean_x_hat_g, mean_g


@triton.jit
def _norm_bwd_split_sums_kernel(DY, X, W, Mean, Rstd, PartialXHatG, PartialG, N, n_slices, BLOCK_N: tl.constexpr,
                                COMPUTE: tl.constexpr, SUBTRACT_MEAN: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    cols, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
    x_hat, _ = _slice_x_hat(X, Mean, Rstd, row, offsets, mask, COMPUTE, SUBTRACT_MEAN, "")
    dy = tl.load(DY + offsets, mask=mask, other=0.0, eviction_policy="evict_last").to(COMPUTE)
    g = dy * tl.load(W + cols, mask=mask, other=0.0).to(COMPUTE)
    _store_slice_sums(x_hat, g, PartialXHatG, PartialG, row, piece, n_slices, SUBTRACT_MEAN)


@triton.jit
def _norm_bwd_split_dx_kernel(DY, X, W, Mean, Rstd, PartialXHatG, PartialG, DX, PartialDW, PartialDB, n_rows, N,
                              n_slices, BLOCK_N: tl.constexpr, BLOCK_SLICES: tl.constexpr, COMPUTE: tl.constexpr,
                              SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr):
    piece = tl.program_id(0)
    group = tl.program_id(1)
    cols = piece * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(COMPUTE)
    # This program's share of dw and db (its slice's columns, summed over its rows) stays in registers.
    dw = tl.zeros((BLOCK_N,), COMPUTE)
    db = tl.zeros((BLOCK_N,), COMPUTE)
    for row in range(group, n_rows, tl.num_programs(1)):
        mean_x_hat_g, mean_g = _combine_row_sums(PartialXHatG, PartialG, row, N, n_slices, BLOCK_SLICES, COMPUTE,
                                                 SUBTRACT_MEAN)
        offsets = tl.cast(row, tl.int64) * N + cols
        x_hat, rstd = _slice_x_hat(X, Mean, Rstd, row, offsets, mask, COMPUTE, SUBTRACT_MEAN, "")
        dy = tl.load(DY + offsets, mask=mask, other=0.0).to(COMPUTE)
        dx = (dy * w - (x_hat * mean_x_hat_g + mean_g)) * rstd
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        if HAS_BIAS:
            db += dy
    _store_partial_gradients(dw, db, PartialDW, PartialDB, group, N, cols, mask, HAS_BIAS)


@triton.jit
def _norm_bwd_cooperative_kernel(DY, X, W, Mean, Rstd, PartialXHatG, PartialG, Arrivals, DX, PartialDW, PartialDB,
                                 n_rows, N, n_slices, BLOCK_N: tl.constexpr, BLOCK_SLICES: tl.constexpr,
                                 COMPUTE: tl.constexpr, SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr):
    # Both phases in one grid, as the cooperative forward: program p owns slice p % n_slices of rows
    # p // n_slices, then that plus the rows at once, and so on. So each program keeps one column slice
    # for good, and its dw, db stay in registers across its rows, as in the split's phase 2.
    program = tl.program_id(0)
    piece = program % n_slices
    group = program // n_slices
    cols = piece * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(COMPUTE)
    dw = tl.zeros((BLOCK_N,), COMPUTE)
    db = tl.zeros((BLOCK_N,), COMPUTE)
    for row in range(group, n_rows, tl.num_programs(0) // n_slices):
        _, _, offsets = split_row_slice(row, piece, N, BLOCK_N)
        # x and dy cross DRAM once: they stay in this program's registers while the row's sums gather.
        x_hat, rstd = _slice_x_hat(X, Mean, Rstd, row, offsets, mask, COMPUTE, SUBTRACT_MEAN, "evict_first")
        dy = tl.load(DY + offsets, mask=mask, other=0.0, eviction_policy="evict_first").to(COMPUTE)
        g = dy * w
        _store_slice_sums(x_hat, g, PartialXHatG, PartialG, row, piece, n_slices, SUBTRACT_MEAN)
        arrive_and_wait(Arrivals + row, n_slices)
        mean_x_hat_g, mean_g = _combine_row_sums(PartialXHatG, PartialG, row, N, n_slices, BLOCK_SLICES, COMPUTE,
                                                 SUBTRACT_MEAN)
        dx = (g - (x_hat * mean_x_hat_g + mean_g)) * rstd
        # Streaming (.cs): dx is not read here again, so its lines may leave L2 before the partial sums and
        # counters that the rows in flight still read.
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask, cache_modifier=".cs")
        dw += dy * x_hat
        if HAS_BIAS:
            db += dy
    _store_partial_gradients(dw, db, PartialDW, PartialDB, group, N, cols, mask, HAS_BIAS)


@triton.jit
def _store_partial_gradients(dw, db, PartialDW, PartialDB, group, N, cols, mask, HAS_BIAS: tl.constexpr):
    """A program's dw (and db) over its group of rows, for its slice's columns: row ``group`` of the
    (groups, N) buffers that the column reduction of ``layer_norm_backward.py`` sums."""
    partial = group.to(tl.int64) * N + cols
    tl.store(PartialDW + partial, dw, mask=mask)
    if HAS_BIAS:
        tl.store(PartialDB + partial, db, mask=mask)


class SplitNormBackwardLaunch(NamedTuple):
    """One backward of LayerNorm, or RMSNorm, over rows split across programs, for one signature of its
    inputs: ``SplitNormForwardLaunch``'s twin, which ``layer_norm_backward.launch_norm_bwd_unchecked`` keeps
    per signature beside its row kernel's plans. A call fills ``grad_x`` and returns the (groups, n)
    partial dw and db buffers (db: None for RMSNorm) that the backward's column reduction sums.

    ``cooperative`` (a GPU only; the backward's launcher asks it in float32): one launch that reads x and
    dy once, when the GPU holds enough rows' slices at once (``launch.cooperative_rows_at_once``, asked at
    each call as the forward asks it; its groups are the rows at once); otherwise the two phases.
    (16-bit dtypes stay in two phases: a slice in registers is half the bytes, too few in flight per SM while
    the programs wait. On an H100 the grid ran rows of 131,072 slower than the two phases did
    (profiling/results/h100/cooperative-grids.md); on an H200 at rows of 32,768 and 131,072 it read 40-50 % of
    copy bandwidth against the two phases' 50-57 %, and neither loading the next row before the wait nor
    holding the slice in 16 bits across it caught up: LayerNorm's kernel sits at 255 registers a thread, two
    programs an SM, whatever the source holds (profiling/results/h200/norm-backward-split.md).)"""

    rows: int
    slices: int
    n: int
    groups: int  # the two phases' groups of rows a slice: about two programs an SM, never more than rows
    cooperative: bool
    flags: dict  # the sums kernel's constants
    dx_flags: dict  # the dx (and cooperative) kernels' constants

    @classmethod
    def plan(cls, x: torch.Tensor, rows: int, n: int, subtract_mean: bool, cooperative: bool) -> "SplitNormBackwardLaunch":
        block = launch_settings.SPLIT_BLOCK
        slices = cdiv(n, block)
        groups = max(1, persistent_program_count(x, rows * slices, 2) // slices)
        # enable_fp_fusion=False in both phases: dx's cancellation needs the g = dy·w that phase 1 sums to be
        # the rounded g that phase 2 subtracts from (layer_norm.py's backward says why).
        flags = dict(BLOCK_N=block, COMPUTE=compute_dtype(x.dtype), SUBTRACT_MEAN=subtract_mean,
                     num_warps=SPLIT_WARPS, enable_fp_fusion=False)
        dx_flags = dict(BLOCK_SLICES=next_power_of_2(slices), HAS_BIAS=subtract_mean, **flags)
        return cls(rows, slices, n, groups, cooperative, flags, dx_flags)

    def __call__(self, grad_out, x, weight, mean, rstd, grad_x):
        rows, slices, n = self.rows, self.slices, self.n
        subtract_mean = mean is not None
        partial_x_hat_g = x.new_empty((rows, slices), dtype=accumulator_dtype(x.dtype))
        partial_g = torch.empty_like(partial_x_hat_g) if subtract_mean else partial_x_hat_g  # RMSNorm never reads it
        mean_in = mean if subtract_mean else rstd  # a pointer RMSNorm's kernels never read
        with on_device(x):
            if self.cooperative:
                # partial_x_hat_g stands in for the partial dw, db buffers, which are sized by the answer.
                args = [grad_out, x, weight, mean_in, rstd, partial_x_hat_g, partial_g, ROW_ARRIVALS, grad_x,
                        partial_x_hat_g, partial_x_hat_g, rows, n, slices]
                groups = cooperative_rows_at_once(_norm_bwd_cooperative_kernel, rows, slices, *args, **self.dx_flags)
                if groups:
                    partial_dw, partial_db = allocate_partial_gradients(groups, n, x, subtract_mean)
                    args[9:11] = partial_dw, (partial_dw if partial_db is None else partial_db)
                    launch_cooperative(_norm_bwd_cooperative_kernel, rows, slices, *args, **self.dx_flags)
                    return partial_dw, partial_db
            partial_dw, partial_db = allocate_partial_gradients(self.groups, n, x, subtract_mean)
            launch(_norm_bwd_split_sums_kernel, (rows, slices), grad_out, x, weight, mean_in, rstd, partial_x_hat_g,
                   partial_g, n, slices, **self.flags)
            launch(_norm_bwd_split_dx_kernel, (slices, self.groups), grad_out, x, weight, mean_in, rstd,
                   partial_x_hat_g, partial_g, grad_x, partial_dw, partial_dw if partial_db is None else partial_db,
                   rows, n, slices, **self.dx_flags)
        return partial_dw, partial_db


def allocate_partial_gradients(groups: int, n: int, x: torch.Tensor, subtract_mean: bool):
    """The (groups, n) partial dw buffer in x's accumulator dtype, and db's (None for RMSNorm): a row each
    for the column reduction of ``layer_norm_backward.py`` to sum."""
    partial_dw = x.new_empty((groups, n), dtype=accumulator_dtype(x.dtype))
    return partial_dw, (torch.empty_like(partial_dw) if subtract_mean else None)
