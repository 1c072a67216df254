"""LayerNorm's and RMSNorm's backward in Triton: dx along each row, dw (and db) across rows.

What it computes (``layer_norm.py`` has the forward and the ops)
    x̂ = (x − mean)·rstd,  g = dy·w
    dx = rstd·(g − x̂·mean(x̂·g) − mean(g))      a reduction along each row (RMSNorm: mean 0, no mean(g))
    dw = Σ_rows dy·x̂,  db = Σ_rows dy          reductions *across* rows (RMSNorm: no db)

The one idea
    The cross-row sums are the hard part. A persistent backward launches about one program per SM;
    each walks a strided set of rows, keeps its running dw, db in registers, and leaves one row of a
    small (programs, N) float32 buffer that stays in L2. A second, tiny kernel sums that buffer's
    columns in a fixed order: deterministic, no atomics.
    A row too long for registers (past 8192 values: four arrays a column, ``ROW_ARRAYS``) cannot keep its
    dw, db there. Added row by row into a program's row of the partial buffer in memory, they would cost
    16 bytes of float32 read-modify-write an element (dw and db), against the 6 that bfloat16 x, dy and
    dx need: at 131,072 elements a row that capped the H100 near 23 % of copy bandwidth, and it measured
    22 %. So every such row is split across programs instead (``layer_norm_split.py``): programs own a column slice and a group of rows, keep that
    slice's dw, db in registers, and leave partial rows that the same column reduction sums.

Check
    python -m pytest tests -k "(layer_norm or rms_norm) and triton"
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import (
    SignatureTable,
    cdiv,
    column_reduction_launch,
    compute_dtype,
    interpreter_is_on,
    launch,
    on_device,
    persistent_program_count,
    row_matrix,
    row_strategy,
    row_tile,
)
from .layer_norm_split import SplitNormBackwardLaunch, allocate_partial_gradients

ROW_ARRAYS = 4
"""Values a column the row kernel keeps in registers: x, dy and the running dw, db (``launch.row_tile``'s
``arrays``): twice the forward's, so it holds rows half as long, 8192 values. At 16,384 it spilled
registers to local memory; there the rows are split as longer ones are."""
BACKWARD_WARPS_PER_SM = 8
"""How many warps of persistent backward programs to launch per SM. A program keeps x, dy, w and its
running dw, db in registers: ~220 a thread at N = 8192 with 8 warps, so one program fills most of an
SM's 64K-register file. More programs would only queue, and each adds a row to the partial buffers.
(On an H100 at 8192 × 8192, one program per SM beat two and four.)"""
ONE_PROGRAM_TILES = 4
"""A backward of at most this many tiles (decode sizes: a few rows) runs as one program, which writes
dw and db itself: the column reduction's launch and the two partial buffers would cost the host more
time than one program's walk over four tiles costs the GPU."""


def loads_next_tile_early(dtype: torch.dtype) -> bool:
    """Whether the backward's programs load the x and dy of the tile they take next while they reduce this
    one (``LOADS_NEXT_TILE_EARLY``): in 16-bit dtypes. A program of the persistent grid loads its tile, waits
    for it, then spends its two row reductions and its store loading nothing; with one or two programs an SM,
    so does the SM. Loading the next tile first keeps bytes in flight through that time, at the cost of the
    registers that hold it: in 16 bits two values a register, which the 8 warps an SM have to spare. On an
    H200 (profiling/results/h200/norm-backward-next-tile.md; the backward alone, % of copy bandwidth) it took
    bfloat16 LayerNorm at rows of 2048 / 4096 / 8192 from 73.8 / 74.4 / 65.3 to 78.2 / 91.3 / 86.7, RMSNorm at
    512-8192 from 72.0-81.2 to 85.4-89.3 (LayerNorm at 512: 73.4 against 71.7); float16 moved as bfloat16 did
    (LayerNorm at 8192 65.4 → 87.5). In float32 the held tile costs a register a value and LayerNorm lost 1-12
    points at every length, so float32 keeps the plain loop. The interpreter takes it at any dtype, so that the
    CPU tests check its indexing too."""
    return dtype.itemsize == 2 or interpreter_is_on()


@triton.jit
def _tile_of_rows(tile, n_rows, N, cols, col_mask, ROWS_PER_TILE: tl.constexpr):
    """Tile ``tile``'s rows, which of them are inside the matrix, the (rows, cols) mask and the offsets: a tile
    past the last row is all masked, so a program may load it without a branch."""
    rows = tile * ROWS_PER_TILE + tl.arange(0, ROWS_PER_TILE)
    row_mask = rows < n_rows
    return rows, row_mask, row_mask[:, None] & col_mask[None, :], rows.to(tl.int64)[:, None] * N + cols[None, :]


@triton.jit
def _load_tile(X, DY, tile, n_rows, N, cols, col_mask, ROWS_PER_TILE: tl.constexpr):
    """Tile ``tile``'s x and dy in their own dtype (zeros where masked): the early loads' first and next tiles."""
    _, _, mask, offsets = _tile_of_rows(tile, n_rows, N, cols, col_mask, ROWS_PER_TILE)
    return tl.load(X + offsets, mask=mask, other=0.0), tl.load(DY + offsets, mask=mask, other=0.0)


@triton.jit
def _layer_norm_bwd_kernel(DY, X, W, Mean, Rstd, DX, PartialDW, PartialDB, n_rows, N,
                           BLOCK_N: tl.constexpr, ROWS_PER_TILE: tl.constexpr, COMPUTE: tl.constexpr,
                           SUBTRACT_MEAN: tl.constexpr, HAS_BIAS: tl.constexpr, LOADS_NEXT_TILE_EARLY: tl.constexpr):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(COMPUTE)
    # This program's running dw and db live in registers across all of its rows.
    dw = tl.zeros((ROWS_PER_TILE, BLOCK_N), COMPUTE)
    db = tl.zeros((ROWS_PER_TILE, BLOCK_N), COMPUTE)
    if LOADS_NEXT_TILE_EARLY:
        next_x, next_dy = _load_tile(X, DY, program, n_rows, N, cols, col_mask, ROWS_PER_TILE)
    for tile in range(program, tl.cdiv(n_rows, ROWS_PER_TILE), programs):
        rows, row_mask, mask, offsets = _tile_of_rows(tile, n_rows, N, cols, col_mask, ROWS_PER_TILE)
        if LOADS_NEXT_TILE_EARLY:
            # The tile this program takes next is loaded now (past the last tile: all masked, nothing read)
            # and flies while this one reduces and stores (loads_next_tile_early). This tile is converted
            # first, before those loads are issued: converted after them, the same kernel ran LayerNorm's
            # 16-bit rows of 8192 at 67 % of copy bandwidth instead of 86 % on an H200 (Triton 3.6;
            # profiling/results/h200/norm-backward-split.md, probe 21).
            x, dy = next_x.to(COMPUTE), next_dy.to(COMPUTE)
            next_x, next_dy = _load_tile(X, DY, tile + programs, n_rows, N, cols, col_mask, ROWS_PER_TILE)
        else:
            x = tl.load(X + offsets, mask=mask, other=0.0).to(COMPUTE)
            dy = tl.load(DY + offsets, mask=mask, other=0.0).to(COMPUTE)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        if SUBTRACT_MEAN:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
            x_hat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        else:
            x_hat = x * rstd[:, None]  # padding read as 0 stays 0
        g = dy * w[None, :]
        mean_x_hat_g = tl.sum(x_hat * g, axis=1) / N
        if SUBTRACT_MEAN:
            mean_g = tl.sum(g, axis=1) / N
            dx = (g - (x_hat * mean_x_hat_g[:, None] + mean_g[:, None])) * rstd[:, None]
        else:
            dx = (g - x_hat * mean_x_hat_g[:, None]) * rstd[:, None]
        tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        if HAS_BIAS:
            db += dy
    # One row of the partial buffers per program: small enough to stay in L2 for the column reduction.
    # (A lone program's row is the gradient itself: then PartialDW and PartialDB are dw and db.)
    partial = program.to(tl.int64) * N + cols
    tl.store(PartialDW + partial, tl.sum(dw, axis=0).to(PartialDW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(PartialDB + partial, tl.sum(db, axis=0).to(PartialDB.dtype.element_ty), mask=col_mask)


@triton.jit
def _layer_norm_bwd_dwdb_kernel(PartialDW, PartialDB, DW, DB, n_partials, N,
                                BLOCK_PARTIALS: tl.constexpr, BLOCK_COLS: tl.constexpr, HAS_BIAS: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < N
    dw = tl.zeros((BLOCK_PARTIALS, BLOCK_COLS), PartialDW.dtype.element_ty)
    db = tl.zeros((BLOCK_PARTIALS, BLOCK_COLS), PartialDB.dtype.element_ty)
    for start in range(0, n_partials, BLOCK_PARTIALS):
        partials = start + tl.arange(0, BLOCK_PARTIALS)
        mask = (partials < n_partials)[:, None] & col_mask[None, :]
        offsets = partials.to(tl.int64)[:, None] * N + cols[None, :]
        dw += tl.load(PartialDW + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(PartialDB + offsets, mask=mask, other=0.0)
    tl.store(DW + cols, tl.sum(dw, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(db, axis=0).to(DB.dtype.element_ty), mask=col_mask)


class NormBackwardLaunch(NamedTuple):
    """One backward of a norm by the row kernel, but its tensors, for one signature of its inputs: what
    ``launch_norm_bwd_unchecked`` works out once (tile, programs, kernel arguments) and keeps, as the
    forward keeps its (layer_norm.NormForwardLaunch), since a model calls each norm's backward with the
    same signature every step. Planned under launch.py's row-strategy settings of the time: code that
    changes them empties the table too."""

    grid: tuple[int]
    rows: int
    n: int
    constants: dict
    reduction: tuple | None  # (grid, constants) of the column reduction; None: one program writes dw, db

    def __call__(self, grad_out, x, weight, mean, rstd):
        """(grad_x, grad_weight, grad_bias) of inputs of this launch's signature, as
        ``launch_norm_bwd_unchecked`` returns them."""
        subtract_mean = mean is not None
        grad_x, grad_weight, grad_bias = _allocate_gradients(x, weight, subtract_mean)
        if self.reduction is None:
            partial_dw, partial_db = grad_weight, grad_bias
        else:
            partial_dw, partial_db = allocate_partial_gradients(self.grid[0], self.n, x, subtract_mean)
        # RMSNorm has no mean and no bias: rstd and dw's buffer stand in for the pointers its kernel never reads.
        mean_in, partial_db_in = (mean, partial_db) if subtract_mean else (rstd, partial_dw)
        with on_device(x):
            launch(_layer_norm_bwd_kernel, self.grid, grad_out, x, weight, mean_in, rstd, grad_x, partial_dw,
                   partial_db_in, self.rows, self.n, **self.constants)
            if self.reduction is not None:
                _launch_column_reduction(partial_dw, partial_db, grad_weight, grad_bias, self.n, *self.reduction)
        return grad_x, grad_weight, grad_bias


class SplitNormBackwardRows(NamedTuple):
    """One backward of a norm over rows split across programs, for one signature of its inputs:
    ``layer_norm_split.SplitNormBackwardLaunch`` fills grad_x and the partial dw, db rows, and the column
    reduction sums them, planned once for each number of partial rows it meets (the two phases' groups,
    or the rows a cooperative grid holds at once)."""

    split: SplitNormBackwardLaunch
    reductions: dict  # partial rows -> (grid, constants) of the column reduction

    def __call__(self, grad_out, x, weight, mean, rstd):
        subtract_mean = mean is not None
        grad_x, grad_weight, grad_bias = _allocate_gradients(x, weight, subtract_mean)
        partial_dw, partial_db = self.split(grad_out, x, weight, mean, rstd, grad_x)
        partial_rows = partial_dw.shape[0]
        reduction = self.reductions.get(partial_rows)
        if reduction is None:
            reduction = self.reductions[partial_rows] = _column_reduction_plan(x, self.split.n, partial_rows,
                                                                               subtract_mean)
        with on_device(x):
            _launch_column_reduction(partial_dw, partial_db, grad_weight, grad_bias, self.split.n, *reduction)
        return grad_x, grad_weight, grad_bias


def _allocate_gradients(x: torch.Tensor, weight: torch.Tensor, subtract_mean: bool):
    """(grad_x, grad_weight, grad_bias) for a norm's backward: grad_bias None for RMSNorm."""
    return torch.empty_like(x), torch.empty_like(weight), (torch.empty_like(weight) if subtract_mean else None)


_NORM_BACKWARD_LAUNCHES = SignatureTable()


def launch_norm_bwd_unchecked(grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                              mean: torch.Tensor | None, rstd: torch.Tensor):
    """The backward of both norms, without checks (see ``triton_kernels/__init__.py``): LayerNorm's
    (grad_x, grad_weight, grad_bias), or RMSNorm's (grad_x, grad_weight, None) when ``mean`` is None.
    x, weight and the statistics as the forward saved them, grad_out contiguous. A signature seen
    before skips its planning, by the row kernel or over split rows: it reads nothing else."""
    subtract_mean = mean is not None
    signature = (x.shape, x.dtype, x.device, subtract_mean)
    planned = _NORM_BACKWARD_LAUNCHES.get(signature)
    if planned is not None:
        return planned(grad_out, x, weight, mean, rstd)
    rows, n = row_matrix("layer_norm_backward" if subtract_mean else "rms_norm_backward", x)
    if rows == 0:
        grad_bias = torch.zeros_like(weight) if subtract_mean else None
        return torch.empty_like(x), torch.zeros_like(weight), grad_bias
    # Rows too long for registers: each split across programs, on a cooperative grid in float32 on a GPU
    # (16-bit measured slower there: layer_norm_split.SplitNormBackwardLaunch says why).
    strategy = row_strategy(rows, n, x, ROW_ARRAYS, cooperative=x.dtype == torch.float32)
    if strategy in ("looped", "split", "cooperative"):
        plan = SplitNormBackwardRows(
            SplitNormBackwardLaunch.plan(x, rows, n, subtract_mean, cooperative=strategy == "cooperative"), {})
    else:
        plan = _plan_norm_bwd_rows(x, rows, n, subtract_mean)
    return _NORM_BACKWARD_LAUNCHES.keep(signature, plan)(grad_out, x, weight, mean, rstd)


def _plan_norm_bwd_rows(x: torch.Tensor, rows: int, n: int, subtract_mean: bool) -> NormBackwardLaunch:
    """dx by the persistent kernel, rows (or tiles of rows) held in registers, leaving (programs, n)
    partial dw, db buffers for the column reduction; or one program that takes every tile
    (``ONE_PROGRAM_TILES``) and writes grad_weight and grad_bias itself."""
    tile = row_tile(n, ROW_ARRAYS)
    tiles = cdiv(rows, tile.rows_per_tile)
    one_program = tiles <= ONE_PROGRAM_TILES
    programs = 1 if one_program else persistent_program_count(
        x, tiles, max(1, BACKWARD_WARPS_PER_SM // tile.num_warps))
    # enable_fp_fusion=False: dx = dy·w − (x̂·c₁ + c₂) is a cancellation. Contracted into a fused
    # multiply-add, dy·w stays unrounded while c₂ (built from the rounded dy·w) does not, which leaves
    # rounding noise where the exact answer is 0 (rows of one element). The kernel is memory-bound:
    # the separate multiply costs nothing.
    constants = dict(BLOCK_N=tile.block_n, ROWS_PER_TILE=tile.rows_per_tile, COMPUTE=compute_dtype(x.dtype),
                     SUBTRACT_MEAN=subtract_mean, HAS_BIAS=subtract_mean,
                     LOADS_NEXT_TILE_EARLY=loads_next_tile_early(x.dtype), num_warps=tile.num_warps,
                     enable_fp_fusion=False)
    return NormBackwardLaunch((programs,), rows, n, constants,
                              None if one_program else _column_reduction_plan(x, n, programs, subtract_mean))


def _column_reduction_plan(x: torch.Tensor, n: int, partial_rows: int, has_bias: bool) -> tuple:
    """(grid, constants) of the column reduction over (partial_rows, n) buffers: ~2 programs per SM."""
    programs, block_cols, block_partials = column_reduction_launch(n, partial_rows, persistent_program_count(x, n, 2))
    return (programs,), dict(BLOCK_PARTIALS=block_partials, BLOCK_COLS=block_cols, HAS_BIAS=has_bias, num_warps=4)


def _launch_column_reduction(partial_dw, partial_db, grad_weight, grad_bias, n: int, grid, constants) -> None:
    """grad_weight (and grad_bias) as the column sums of the partial buffers (RMSNorm: partial_db and
    grad_bias None; dw's buffer and gradient stand in for the pointers its kernel never reads)."""
    launch(_layer_norm_bwd_dwdb_kernel, grid, partial_dw, partial_dw if partial_db is None else partial_db,
           grad_weight, grad_weight if grad_bias is None else grad_bias, partial_dw.shape[0], n, **constants)
