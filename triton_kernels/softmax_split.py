"""Softmax in Triton for long rows: each row split across programs, in one cooperative launch that reads
the row once (the forward, on a GPU), or in two phases.

Why
    ``softmax.py`` gives each row one program. 64 rows of 300000 were 64 programs on 132 SMs, each
    walking its row alone (0.90 TB/s forward on an H100). Here a row is cut into slices of
    ``launch.SPLIT_BLOCK`` elements, one program each, so rows × slices programs share the work;
    ``launch.row_strategy`` decides when, as for LayerNorm. On a GPU the forward's
    ``_softmax_fwd_cooperative_kernel`` keeps each slice in registers while the row's programs exchange
    their (max, sum) pairs, as ``layer_norm_split.py`` explains: softmax over 4096 × 262,144 float32
    went from 66 to 84 % of copy bandwidth on an H100.

What it computes
    forward  phase 1  each slice's maximum m and Σ exp(x − m), into (rows, slices) float32 buffers
             phase 2  each program merges its row's partials, M = max m, S = Σ sum·exp(m − M) (the online
                      softmax's merge, once per slice instead of once per block), and writes
                      y = exp(x − M)/S for its slice
    backward phase 1  each slice's Σ dy·y
             phase 2  each program sums its row's partials and writes dx = y·(dy − Σ dy·y) for its slice

Cost
    x (y, dy) read twice, as by the looped kernels; phase 2 re-reads each slice, from L2 when the rows in
    flight fit there. The partial buffers are rows × slices values.

Check
    python -m pytest tests -k "strateg"
"""

import torch
import triton
import triton.language as tl

from . import launch as launch_settings  # SPLIT_BLOCK is read at each call: tests lower it
from .launch import (ROW_ARRIVALS, arrive_and_wait, cdiv, compute_dtype, exp_on_sfu, launch, launch_cooperative,
                     next_power_of_2, on_device, split_row_partials, split_row_slice)

SPLIT_WARPS = 4  # as layer_norm_split.py: 32 values a thread for a 4096-element slice


@triton.jit
def _store_slice_max_and_sum(x, PartialMax, PartialSum, row, piece, n_slices):
    """Phase 1 for one slice x (padding −inf) of ``row``: its maximum m and Σ exp(x − m)."""
    slice_max = tl.max(x, axis=0)
    # A slice of only −inf has maximum −inf: shift by 0 there, so that its sum is 0 instead of
    # exp(−inf − (−inf)) = NaN (the looped kernel's guard, softmax.py).
    shift = tl.where(slice_max == float("-inf"), 0.0, slice_max)
    slot = row.to(tl.int64) * n_slices + piece
    tl.store(PartialMax + slot, slice_max)
    tl.store(PartialSum + slot, tl.sum(exp_on_sfu(x - shift), axis=0))


@triton.jit
def _combine_row_max_and_sum(PartialMax, PartialSum, row, n_slices, BLOCK_SLICES: tl.constexpr):
    """Phase 2's start: ``row``'s maximum and 1/Σ exp(x − maximum) from its slices' partials (``.cg``:
    from L2, as ``layer_norm_split._combine_row_statistics`` says)."""
    slots, slice_mask = split_row_partials(row, n_slices, BLOCK_SLICES)
    # Padding slots (and slices of only −inf) have maximum −inf and sum 0: they add nothing.
    maxima = tl.load(PartialMax + slots, mask=slice_mask, other=float("-inf"), cache_modifier=".cg")
    row_max = tl.max(maxima, axis=0)
    sums = tl.load(PartialSum + slots, mask=slice_mask, other=0.0, cache_modifier=".cg")
    return row_max, 1.0 / tl.sum(tl.where(slice_mask, sums * exp_on_sfu(maxima - row_max), 0.0), axis=0)


@triton.jit
def _softmax_fwd_split_statistics_kernel(X, PartialMax, PartialSum, N, n_slices, BLOCK_N: tl.constexpr,
                                         COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    _, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
    # evict_last: phase 2 reads this slice again. Padding reads as −inf: exp(−inf − m) = 0.
    x = tl.load(X + offsets, mask=mask, other=float("-inf"), eviction_policy="evict_last").to(COMPUTE)
    _store_slice_max_and_sum(x, PartialMax, PartialSum, row, piece, n_slices)


@triton.jit
def _softmax_fwd_split_normalize_kernel(X, Y, PartialMax, PartialSum, N, n_slices, BLOCK_N: tl.constexpr,
                                        BLOCK_SLICES: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    row_max, reciprocal_sum = _combine_row_max_and_sum(PartialMax, PartialSum, row, n_slices, BLOCK_SLICES)
    _, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
    x = tl.load(X + offsets, mask=mask, other=0.0).to(COMPUTE)
    tl.store(Y + offsets, (exp_on_sfu(x - row_max) * reciprocal_sum).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_fwd_cooperative_kernel(X, Y, PartialMax, PartialSum, Arrivals, n_rows, N, n_slices, BLOCK_N: tl.constexpr,
                                    BLOCK_SLICES: tl.constexpr, COMPUTE: tl.constexpr):
    # The grid and the wait of layer_norm_split._norm_fwd_cooperative_kernel: x read once, kept in registers.
    program = tl.program_id(0)
    piece = program % n_slices
    for row in range(program // n_slices, n_rows, tl.num_programs(0) // n_slices):
        _, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
        x = tl.load(X + offsets, mask=mask, other=float("-inf"), eviction_policy="evict_first").to(COMPUTE)
        _store_slice_max_and_sum(x, PartialMax, PartialSum, row, piece, n_slices)
        arrive_and_wait(Arrivals + row, n_slices)
        row_max, reciprocal_sum = _combine_row_max_and_sum(PartialMax, PartialSum, row, n_slices, BLOCK_SLICES)
        # Streaming (.cs): y is not read here again, so its lines may leave L2 before the partials and
        # counters that the rows in flight still read (1-3 points of copy bandwidth on an H100:
        # profiling/results/h100/cooperative-grids.md).
        tl.store(Y + offsets, (exp_on_sfu(x - row_max) * reciprocal_sum).to(Y.dtype.element_ty), mask=mask,
                 cache_modifier=".cs")


def launch_softmax_fwd_split(x: torch.Tensor, out: torch.Tensor, rows: int, n: int, cooperative: bool = False) -> None:
    """Fill ``out`` with softmax(x) over rows of ``n``; ``softmax.py`` has checked and allocated.
    ``cooperative``: one launch reading x once, as ``layer_norm_split.SplitNormForwardLaunch`` decides."""
    block = launch_settings.SPLIT_BLOCK
    slices = cdiv(n, block)
    statistics_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    partial_max = torch.empty(rows, slices, dtype=statistics_dtype, device=x.device)
    partial_sum = torch.empty_like(partial_max)
    flags = dict(BLOCK_N=block, COMPUTE=compute_dtype(x.dtype), num_warps=SPLIT_WARPS)
    with on_device(x):
        if cooperative:
            args = (x, out, partial_max, partial_sum, ROW_ARRIVALS, rows, n, slices)
            if launch_cooperative(_softmax_fwd_cooperative_kernel, rows, slices, *args,
                                  BLOCK_SLICES=next_power_of_2(slices), **flags):
                return
        launch(_softmax_fwd_split_statistics_kernel, (rows, slices), x, partial_max, partial_sum, n, slices, **flags)
        launch(_softmax_fwd_split_normalize_kernel, (rows, slices), x, out, partial_max, partial_sum, n, slices,
               BLOCK_SLICES=next_power_of_2(slices), **flags)


@triton.jit
def _softmax_bwd_split_dot_kernel(DY, Y, PartialDot, N, n_slices, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    _, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
    y = tl.load(Y + offsets, mask=mask, other=0.0, eviction_policy="evict_last").to(COMPUTE)
    dy = tl.load(DY + offsets, mask=mask, other=0.0, eviction_policy="evict_last").to(COMPUTE)
    tl.store(PartialDot + row.to(tl.int64) * n_slices + piece, tl.sum(dy * y, axis=0))


@triton.jit
def _softmax_bwd_split_dx_kernel(DY, Y, PartialDot, DX, N, n_slices, BLOCK_N: tl.constexpr,
                                 BLOCK_SLICES: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    piece = tl.program_id(1)
    slots, slice_mask = split_row_partials(row, n_slices, BLOCK_SLICES)
    row_dot = tl.sum(tl.load(PartialDot + slots, mask=slice_mask, other=0.0), axis=0)
    _, mask, offsets = split_row_slice(row, piece, N, BLOCK_N)
    y = tl.load(Y + offsets, mask=mask, other=0.0).to(COMPUTE)
    dy = tl.load(DY + offsets, mask=mask, other=0.0).to(COMPUTE)
    tl.store(DX + offsets, (y * (dy - row_dot)).to(DX.dtype.element_ty), mask=mask)


def launch_softmax_bwd_split(grad_out: torch.Tensor, y: torch.Tensor, grad_x: torch.Tensor, rows: int,
                             n: int) -> None:
    """Fill ``grad_x`` with y·(dy − Σ dy·y) over rows of ``n``."""
    block = launch_settings.SPLIT_BLOCK
    slices = cdiv(n, block)
    partial_dot = torch.empty(rows, slices, dtype=torch.float64 if y.dtype == torch.float64 else torch.float32,
                              device=y.device)
    compute = compute_dtype(y.dtype)
    with on_device(y):
        launch(_softmax_bwd_split_dot_kernel, (rows, slices), grad_out, y, partial_dot, n, slices, BLOCK_N=block,
               COMPUTE=compute, num_warps=SPLIT_WARPS)
        launch(_softmax_bwd_split_dx_kernel, (rows, slices), grad_out, y, partial_dot, grad_x, n, slices,
               BLOCK_N=block, BLOCK_SLICES=next_power_of_2(slices), COMPUTE=compute, num_warps=SPLIT_WARPS)
