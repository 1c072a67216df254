"""What every level-4 launcher shares: where kernels may run, input checks, dtype tables, launch-size
heuristics and the scalar-argument trick. Kernel files import from here; nothing here launches.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import numpy
import torch
import triton
import triton.language as tl

from cuda_kernels.limits import LevelUnavailableError  # the one error type both kernel packages raise

# --- where the kernels run -----------------------------------------------------------------------


def interpreter_is_on() -> bool:
    """True when Triton's CPU interpreter runs our kernels (``triton_kernels/__init__.py`` decides)."""
    return bool(triton.knobs.runtime.interpret)


def check_inputs(op: str, *tensors: torch.Tensor) -> None:
    """Every tensor on the one device this mode runs on, and of a dtype the kernels compute."""
    device_type = "cpu" if interpreter_is_on() else "cuda"
    supported = (torch.float32, torch.float64) if device_type == "cpu" else (
        torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for tensor in tensors:
        if tensor.device.type != device_type:
            if device_type == "cuda":
                raise LevelUnavailableError(
                    f"triton_kernels::{op} got a tensor on {tensor.device}: with a GPU present, Triton compiles "
                    f"for it, so inputs must be CUDA tensors")
            raise LevelUnavailableError(
                f"triton_kernels::{op} got a tensor on {tensor.device}: no GPU was found, so Triton's interpreter "
                f"runs the kernels, and it takes CPU tensors (it is switched on by TRITON_INTERPRET=1 when "
                f"triton_kernels is imported without a GPU)")
        if tensor.device != tensors[0].device:
            raise ValueError(f"triton_kernels::{op} got tensors on {tensors[0].device} and {tensor.device}")
        if tensor.dtype not in supported:
            names = ", ".join(str(d).removeprefix("torch.") for d in supported)
            raise TypeError(f"triton_kernels::{op} got dtype {str(tensor.dtype).removeprefix('torch.')}; "
                            f"on {device_type} it supports: {names}")


def require(condition, message) -> None:
    """``torch._check(condition, message)``, which the fake (shape-only) implementations need for
    symbolic shapes, minus its cost when the answer is a plain True: torch._check takes ~15 µs a call
    on the host, and a dozen checks per call would cost more than a small kernel runs."""
    if condition is not True:
        torch._check(condition, message)


def check_contiguous(op: str, *tensors: torch.Tensor) -> None:
    """The kernels index memory linearly. Also called by the fake implementations."""
    require(all(tensor.is_contiguous() for tensor in tensors),
            lambda: f"triton_kernels::{op} needs contiguous tensors (call .contiguous() first)")


def on_device(tensor: torch.Tensor):
    """Triton launches on the *current* CUDA device: make it the tensor's (a no-op for the interpreter)."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def persistent_program_count(tensor: torch.Tensor, work_items: int, programs_per_multiprocessor: int) -> int:
    """How many programs a persistent kernel (one that loops over its share of the work) launches:
    enough to fill every streaming multiprocessor (SM) ``programs_per_multiprocessor`` times, never more
    than there is work. The interpreter runs programs one after another, so there 4 suffice to
    exercise the same cross-program code."""
    slots = programs_per_multiprocessor * _multiprocessor_count(tensor.device.index or 0) if tensor.is_cuda else 4
    return max(1, min(work_items, slots))


# --- dtypes ----------------------------------------------------------------------------------------


def compute_dtype(dtype: torch.dtype):
    """Arithmetic precision inside a kernel: float32 for every input type, float64 for float64 inputs."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of saved statistics and partial sums: the kernels' compute precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dot_input_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision for inputs of ``dtype``. Triton's default for float32 operands is
    TF32 (10 mantissa bits, errors near 3e-4) which would fail float32's 2e-5 tolerance, so float32
    (and float64) ask for "ieee": exact products, on the CUDA cores instead of the tensor cores.
    16-bit operands go to the tensor cores whatever this says."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def split_float(value: float) -> tuple[float, float]:
    """Triton passes a Python float to a kernel as a float32 scalar, which would cost float64 inputs
    29 bits of a constant like beta or eps. So we pass two float32 halves, ``value ≈ high + low``;
    the kernel adds them in its compute precision and gets back 48 of the 53 bits."""
    high = float(numpy.float32(value))
    return high, float(numpy.float32(value - high))


# --- launch sizes ----------------------------------------------------------------------------------
# Plain-Python twins of triton.cdiv and triton.next_power_of_2: recent Triton versions wrap those as
# constexpr functions that cost microseconds per host-side call, and launchers run on every step.


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


ELEMENTWISE_BLOCK = 1024
"""Elements per program of an elementwise kernel. With 4 warps (128 threads) each thread handles 8
elements, two 16-byte loads in float32; many small programs let every SM keep several in flight.
(Measured on an H100 at 8192 × 8192: 1024 / 4 warps, 2048 / 8 and 4096 / 8 all within 2 % of
each other, at 97-99 % of copy bandwidth.)"""


def elementwise_launch(numel: int) -> tuple[int, int, int]:
    """(programs, block, num_warps) for an elementwise kernel over ``numel`` elements."""
    block = min(ELEMENTWISE_BLOCK, max(128, next_power_of_2(numel)))
    return cdiv(numel, block), block, max(1, block // 256)


MAX_ROW_BLOCK = 16384
"""The longest row a program holds in registers (64 KB in float32: 32 values a thread at 16 warps,
about the most that leaves registers for the arithmetic without spilling). Longer rows are looped
over in blocks of ``LOOPED_ROW_BLOCK``."""
LOOPED_ROW_BLOCK = 4096
MIN_TILE = 4096
"""Short rows are packed several to a program until a tile holds this many elements, so that every
program moves enough bytes to pay for its reductions. (On an H100 at N = 1024, four rows a tile
lifted the backward from 2.62 to 2.80 TB/s; the forward did not care.)"""


class RowTile(NamedTuple):
    """How a row-wise kernel covers a (rows, N) matrix."""

    block_n: int  # columns per block: the whole row (padded to a power of two), or one looped block
    rows_per_tile: int  # rows one program handles at once
    num_warps: int
    looped: bool  # True when the row is longer than MAX_ROW_BLOCK and is processed block by block


@functools.cache
def row_tile(n: int) -> RowTile:
    """The launch shape for rows of ``n`` elements.

    Heuristic: the row rounded up to a power of two is one block if it fits in ``MAX_ROW_BLOCK``;
    short rows are stacked until the tile reaches ``MIN_TILE`` elements; warps grow with the tile at
    one warp per 1024 elements (32 values a thread), between 4 and 16. Fewer, fuller threads won on
    an H100: at N = 8192 the forward moved 2.84 TB/s with 8 warps and 2.43 TB/s with 16."""
    block_n = next_power_of_2(n)
    if block_n > MAX_ROW_BLOCK:
        # 8 warps, 16 values a thread: with 4 warps the looped backward spills registers.
        return RowTile(LOOPED_ROW_BLOCK, 1, 8, True)
    rows_per_tile = max(1, MIN_TILE // block_n)
    tile = block_n * rows_per_tile
    return RowTile(block_n, rows_per_tile, max(4, min(16, tile // 1024)), False)


@functools.cache
def column_reduction_launch(n: int, partial_rows: int, programs_target: int) -> tuple[int, int, int]:
    """(programs, block_cols, block_partials) for summing a (partial_rows, n) buffer over its rows.

    Each program owns ``block_cols`` adjacent columns (at least 32: one 128-byte line of float32 per
    row read) and walks down the rows ``block_partials`` at a time; columns are split so that about
    ``programs_target`` programs share the work."""
    block_cols = min(1024, max(32, next_power_of_2(cdiv(n, programs_target))))
    block_partials = min(next_power_of_2(partial_rows), max(1, 4096 // block_cols))
    return cdiv(n, block_cols), block_cols, block_partials
