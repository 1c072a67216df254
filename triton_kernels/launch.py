"""What every level-4 launcher shares: where kernels may run, input checks, dtype tables, launch-size
heuristics, the scalar-argument trick, and ``launch``, the one way a launcher starts a kernel.

Every call of a level-4 op runs through here, so everything is cheap on the happy path: answers that
depend only on a shape, a dtype or a constant are cached; checks cost a few attribute reads when the
inputs are fine and build their message only when they are not. (Measured host times per call:
profiling/results/host_path.md.)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import operator
import os
import threading
from typing import NamedTuple, Sequence

import numpy
import torch
import triton
import triton.language as tl

from cuda_kernels.limits import LevelUnavailableError  # the one error type both kernel packages raise

# --- where the kernels run -----------------------------------------------------------------------

INTERPRETING = bool(triton.knobs.runtime.interpret)
"""True when Triton's CPU interpreter runs our kernels. ``triton_kernels/__init__.py`` throws the switch
before any kernel module (and so this one) is imported, and every @triton.jit decorator has read it by
then: it cannot change afterwards, so it is read once."""


def interpreter_is_on() -> bool:
    """True when Triton's CPU interpreter runs our kernels (``triton_kernels/__init__.py`` decides)."""
    return INTERPRETING


_DEVICE_TYPE = "cpu" if INTERPRETING else "cuda"
_SUPPORTED_DTYPES = (torch.float32, torch.float64) if INTERPRETING else (
    torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SUPPORTED_DTYPE_SET = frozenset(_SUPPORTED_DTYPES)


def check_inputs(op: str, *tensors: torch.Tensor) -> None:
    """Every tensor on the one device this mode runs on, and of a dtype the kernels compute.

    The test is a few attribute reads per tensor (is_cpu, is_cuda and get_device() read fields, where
    ``tensor.device`` builds a new object); the messages are built only when it fails."""
    device_index = tensors[0].get_device()
    for tensor in tensors:
        if ((tensor.is_cpu if INTERPRETING else tensor.is_cuda) is not True or tensor.get_device() != device_index
                or tensor.dtype not in _SUPPORTED_DTYPES):
            _raise_input_error(op, tensors)


_ON_THIS_DEVICE = operator.attrgetter("is_cpu" if INTERPRETING else "is_cuda")


def check_many_inputs(op: str, tensors: Sequence[torch.Tensor], dtypes: set) -> None:
    """``check_inputs`` for a long list (an optimizer's ~600 tensors), whose caller has already gathered
    the set of their ``dtypes`` (an optimizer checks that each gradient and moment has its parameter's):
    the same test with its loops in C (``map`` into ``all`` and ``set``), several times faster per tensor
    than a Python loop, so that checking a step's tensors costs less than the GPU's step. The message is
    built only on failure."""
    if tensors and not (dtypes <= _SUPPORTED_DTYPE_SET and all(map(_ON_THIS_DEVICE, tensors))
                        and len(set(map(torch.Tensor.get_device, tensors))) == 1):
        _raise_input_error(op, tensors)


def _raise_input_error(op: str, tensors) -> None:
    for tensor in tensors:
        if tensor.device.type != _DEVICE_TYPE:
            if _DEVICE_TYPE == "cuda":
                raise LevelUnavailableError(
                    f"triton_kernels::{op} got a tensor on {tensor.device}: with a GPU present, Triton compiles "
                    f"for it, so inputs must be CUDA tensors")
            raise LevelUnavailableError(
                f"triton_kernels::{op} got a tensor on {tensor.device}: no GPU was found, so Triton's interpreter "
                f"runs the kernels, and it takes CPU tensors (it is switched on by TRITON_INTERPRET=1 when "
                f"triton_kernels is imported without a GPU)")
        if tensor.device != tensors[0].device:
            raise ValueError(f"triton_kernels::{op} got tensors on {tensors[0].device} and {tensor.device}")
        if tensor.dtype not in _SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in _SUPPORTED_DTYPES)
            raise TypeError(f"triton_kernels::{op} got dtype {str(tensor.dtype).removeprefix('torch.')}; "
                            f"on {_DEVICE_TYPE} it supports: {names}")


def require(condition, message) -> None:
    """``torch._check(condition, message)``, which the fake (shape-only) implementations need for
    symbolic shapes, minus its cost when the answer is a plain True: torch._check takes ~15 µs a call
    on the host, and a dozen checks per call would cost more than a small kernel runs."""
    if condition is not True:
        torch._check(condition, message)


def require_value(condition, message) -> None:
    """``require`` raising ValueError (torch._check_value): for sizes that do not fit together."""
    if condition is not True:
        torch._check_value(condition, message)


def check_contiguous(op: str, *tensors: torch.Tensor) -> None:
    """The kernels index memory linearly. Also called by the fake implementations, where
    ``is_contiguous()`` may be a symbolic answer that ``require`` hands to torch._check. A plain True
    calls nothing and builds no message closure: every launcher runs this."""
    for tensor in tensors:
        contiguous = tensor.is_contiguous()
        if contiguous is not True:
            require(contiguous, lambda: f"triton_kernels::{op} needs contiguous tensors (call .contiguous() first)")


_SAME_DEVICE = contextlib.nullcontext()


# The current CUDA device's index and its current stream's handle, straight from PyTorch's C++:
# ``torch.cuda.current_device()`` (which Triton's driver calls) first asks, in Python, whether CUDA is
# initialised, four calls deep. Both are called only with a CUDA tensor in hand, so CUDA is initialised
# by then. (A CPU build of PyTorch has neither; there the interpreter runs every kernel.)
_current_cuda_device = getattr(torch._C, "_cuda_getDevice", None)
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def on_device(tensor: torch.Tensor):
    """Triton launches on the *current* CUDA device: make it the tensor's. Entering
    ``torch.cuda.device`` costs microseconds (it switches the device and back), so it is used only
    when the tensor lives elsewhere; the interpreter and the usual one-GPU case get a shared no-op."""
    if tensor.is_cuda and tensor.get_device() != _current_cuda_device():
        return torch.cuda.device(tensor.device)
    return _SAME_DEVICE


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _l2_cache_bytes(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).L2_cache_size


def persistent_program_count(tensor: torch.Tensor, work_items: int, programs_per_multiprocessor: int) -> int:
    """How many programs a persistent kernel (one that loops over its share of the work) launches:
    enough to fill every streaming multiprocessor (SM) ``programs_per_multiprocessor`` times, never more
    than there is work. The interpreter runs programs one after another, so there 4 suffice to
    exercise the same cross-program code."""
    slots = programs_per_multiprocessor * _multiprocessor_count(tensor.get_device()) if tensor.is_cuda else 4
    return max(1, min(work_items, slots))


def row_matrix(op: str, x: torch.Tensor) -> tuple[int, int]:
    """(rows, N) of a contiguous x of shape (..., N), which a row-wise kernel (LayerNorm, softmax) walks
    as a (rows, N) matrix: its leading dims are the rows. Taking x as it comes spares every caller a
    view (a tensor object and an autograd node each, which at decode sizes cost about as much as the
    kernel). A tensor's number of dims is a plain int even under torch.compile, so the check is an ``if``
    that builds the message closure only for a scalar."""
    if x.dim() == 0:
        require(False, lambda: f"{op}: x must have at least one dim (rows of N), got a scalar")
    n = x.shape[-1]
    return (x.numel() // n if n else 0), n


def check_version(op: str, version: int, versions: dict[int, str]) -> None:
    """The earlier versions of a kernel (``layer_norm_versions.py``, ``softmax_versions.py``) go by number."""
    if version not in versions:
        raise ValueError(f"triton_kernels::{op}: version {version} does not exist "
                         f"(versions: {', '.join(map(str, versions))})")


def refuse_backward(op: str, instead: str):
    """The autograd formula of a forward-only op: a clear error instead of a gradient. The earlier
    versions of a kernel exist to time the forward's climb; ``instead`` names what differentiates."""
    def backward(ctx, *grads):
        raise NotImplementedError(f"triton_kernels::{op} is forward only (it times an earlier version of the "
                                  f"forward kernel); for gradients use {instead}")
    return backward


# --- dtypes ----------------------------------------------------------------------------------------


def compute_dtype(dtype: torch.dtype):
    """Arithmetic precision inside a kernel: float32 for every input type, float64 for float64 inputs."""
    return tl.float64 if dtype == torch.float64 else tl.float32


ELEMENT_TYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                torch.float64: tl.float64}
"""The Triton type of a tensor's elements, for a kernel that builds pointers from addresses (a pointer
table) instead of receiving tensors, whose type Triton reads itself."""


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of saved statistics and partial sums: the kernels' compute precision."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def dot_input_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input_precision for inputs of ``dtype``. Triton's default for float32 operands is
    TF32 (10 mantissa bits, errors near 3e-4) which would fail float32's 2e-5 tolerance, so float32
    (and float64) ask for "ieee": exact products, on the CUDA cores instead of the tensor cores.
    16-bit operands go to the tensor cores whatever this says."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


@functools.cache
def split_float(value: float) -> tuple[float, float]:
    """Triton passes a Python float to a kernel as a float32 scalar, which would cost float64 inputs
    29 bits of a constant like beta or eps. So we pass two float32 halves, ``value ≈ high + low``;
    the kernel adds them in its compute precision and gets back 48 of the 53 bits. Cached: a module's
    beta, eps or scale is one constant, split once instead of through NumPy on every call."""
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


@functools.cache
def elementwise_launch(numel: int) -> tuple[int, int, int]:
    """(programs, block, num_warps) for an elementwise kernel over ``numel`` elements."""
    block = min(ELEMENTWISE_BLOCK, max(128, next_power_of_2(numel)))
    return cdiv(numel, block), block, max(1, block // 256)


MAX_ROW_BLOCK = 16384
"""The longest row a program holds in registers (64 KB in float32: 32 values a thread at 16 warps,
about the most that leaves registers for the arithmetic without spilling). Longer rows are looped
over in blocks of ``LOOPED_ROW_BLOCK``."""
MAX_ONE_ARRAY_ROW_BLOCK = 32768
"""The longest row held in registers by a kernel that keeps one value an element there (softmax's
forward: x becomes exp(x − max) in place) rather than two (the norms keep x and x − mean): 32 values a
thread at 32 warps. The row is then read once instead of twice, and for float32 rows of 32,768 the H100
measured the difference (profiling/results/h100/sweep.csv); the norms at this length spilled registers
and ran slower than their looped kernel."""
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
def row_tile(n: int, arrays: int = 2) -> RowTile:
    """The launch shape for rows of ``n`` elements, for a kernel that keeps ``arrays`` values a column in
    registers (1: softmax's forward; 2: the norms' forward and softmax's backward; 4: the norms' backward).

    Heuristic: the row rounded up to a power of two is one block if it fits in ``MAX_ROW_BLOCK`` at two
    arrays (``MAX_ONE_ARRAY_ROW_BLOCK`` at one, half of ``MAX_ROW_BLOCK`` at four);
    short rows are stacked until the tile reaches ``MIN_TILE`` elements; warps grow with the tile at
    one warp per 1024 elements (32 values a thread), between 4 and 32. Fewer, fuller threads won on
    an H100: at N = 8192 the forward moved 2.84 TB/s with 8 warps and 2.43 TB/s with 16.

    Why four arrays hold half the row: 32 values a thread of each of four arrays are 128 registers before
    any arithmetic, and 16 warps leave a thread 128 (an SM has 64K). The norms' backward at 16,384 on 16
    warps spilled 528 bytes a thread to local memory in bfloat16 and 1368 in float32, and on 32 or 8 warps
    too, where at 8192 on 8 warps it fits in 254 registers (Triton 3.6 for sm_90:
    profiling/results/kernel-registers.md)."""
    block_n = next_power_of_2(n)
    if block_n > (MAX_ONE_ARRAY_ROW_BLOCK if arrays == 1 else MAX_ROW_BLOCK * 2 // arrays):
        # 8 warps, 16 values a thread: with 4 warps a looped backward spilled registers.
        return RowTile(LOOPED_ROW_BLOCK, 1, 8, True)
    rows_per_tile = max(1, MIN_TILE // block_n)
    tile = block_n * rows_per_tile
    return RowTile(block_n, rows_per_tile, max(4, min(32, tile // 1024)), False)


SHORT_ROW_TILE = 1024
"""Short rows go into programs of this many values (rows padded to a power of two) on 2 warps, or of
twice as many where 16-bit rows leave padding and a program would hold less than SHORT_ROW_TILE_BYTES
of them (``short_row_tile``)."""
SHORT_ROW_TILE_BYTES = 2048


def short_row_tile(n: int, dtype: torch.dtype, longest: int = SHORT_ROW_TILE) -> RowTile | None:
    """The tile of the row kernels' forwards (both norms', softmax's) for rows of ``n`` values when their
    block (``n`` padded to a power of two) is at most ``longest``: programs of 2 warps holding
    SHORT_ROW_TILE values (16 a thread) or one row of ``longest``, instead of ``row_tile``'s MIN_TILE on
    4 warps (32 a thread); as many more rows as it takes to hold SHORT_ROW_TILE_BYTES of them (16-bit rows
    that leave padding in their block, such as GPT-2's 768). None for longer rows.

    Why smaller programs: every program waits in its reductions with nothing to load. More, smaller
    programs an SM each wait at a different time, so the SM always has loads to issue; but a program must
    still move enough bytes to pay for its reductions. Read offline (Triton 3.6, sm_90), the norms'
    programs an SM went from 7-9 to 16-32 while the bytes of x they hold fell (128 → 100 KB of float32
    rows of 512): more programs, not more bytes, made the gain. Measured on an H200 at 2^26 elements,
    % of copy bandwidth, ``row_tile`` → this (profiling/results/h200/norm-forward-candidates.md, probes
    10 and 11):
    - the norms, rows of 128-1024: float32 96.0-97.6 → 98.9-99.2 (torch.compile 98.5-99.0), bfloat16
      92.3-93.8 → 94.9-95.1. Programs of less than 2 KB lost: bfloat16 rows of 512 one a program read
      76 %, rows of 768 one a program 88.0 against 92.0 for LayerNorm, two a program 93.8 (94.6). Rows of
      2048 keep ``row_tile``'s: within half a point of every smaller program there (``longest`` 1024).
    - softmax, rows of 128-2048 (``longest`` 2048): float32 512 96.9 → 100.2, 768 88.8 → 100.3, 1024
      97.3 → 100.4, 2048 97.9 → 98.4, 128 96.2 → 97.9-98.4 (torch.compile 98.4); bfloat16 128 95.8 →
      97.8-98.1, 512 94.8 → 98.0, 768 94.0 → 98.3, 1024 94.9 → 98.1, 2048 95.1 → 98.1."""
    block_n = next_power_of_2(n)
    if block_n > longest:
        return None
    rows_per_tile = max(1, SHORT_ROW_TILE // block_n)
    while rows_per_tile * n * dtype.itemsize < SHORT_ROW_TILE_BYTES:
        rows_per_tile *= 2
    return RowTile(block_n, rows_per_tile, 2, False)


def loads_next_row_early(tile: RowTile, dtype: torch.dtype) -> bool:
    """Whether a one-array forward (softmax's) on ``tile`` walks its rows persistently, each program loading
    its next row while it reduces this one (``softmax._softmax_fwd_next_row_kernel``, which says why): for
    bfloat16 rows as long as registers hold, where the row kernel fills an SM with one program. On an H200 at
    (2048, 32768) bfloat16 it read 82.8 % of copy bandwidth against the row kernel's 74.7 %. It lost
    everywhere else it was timed there: at 16,384 (16 warps, two programs an SM, which already overlap each
    other's waits), 72.7 against 90.4 %; in float32 at 32,768, 64.9 against 94.7 (the waiting row takes
    registers the program does not have); and in float16 at 32,768, 65.6 against 74.9, a loss whose cause
    this probe did not find (profiling/results/h200/softmax-next-row.md). The interpreter takes it at any
    dtype, so that the CPU tests check its indexing too."""
    return (not tile.looped and tile.block_n == MAX_ONE_ARRAY_ROW_BLOCK
            and (dtype == torch.bfloat16 or interpreter_is_on()))


def l2_looped_tile(element_size: int, subtract_mean: bool) -> RowTile:
    """The norms' looped forward's tile on a GPU (``row_strategy``'s "looped_in_l2"), by the bytes of an
    element and the norm (LayerNorm subtracts the mean, RMSNorm does not).

    A looped row crosses DRAM once only if its second pass finds it still in L2, so the tile is chosen for
    how many rows are in flight, not for one program's speed: every tile here fills an SM's register file
    (32 warps of 64 registers, or 16 of 128), so each SM runs one program, one row, at a time: 132 rows on
    an H100, 17 MB at 32,768 float32 values a row, which its 50 MB L2 holds. The 8-warp ``row_tile`` runs
    several programs an SM, their rows overflow L2, and the second pass reads DRAM again: two reads, about
    2/3 of copy bandwidth (profiling/results/h100/looped-rows-in-l2.md).

    Within that, the tile that measured fastest on an H200 (profiling/results/h200/norm-looped-tiles.md):
    - float32: blocks of 32,768 (32 values a thread, 32 warps). A program waits out a block-wide reduction
      after each block of its first pass and loads nothing meanwhile; the wider block halves those waits.
      At rows of 32,768 LayerNorm went from 76.7 to 85.3 % of copy bandwidth, RMSNorm from 89.7 to 97.0,
      though Triton 3.6 spills 112-144 bytes a thread there.
    - bfloat16 LayerNorm: blocks of 16,384 on 16 warps (32 values a thread, 128 registers): 79.0 against
      73.1 % at 32,768, 76.1 against 73.2 at 65,536. RMSNorm lost on 16 warps at 65,536 (71 against 82 %)
      and keeps 32; why the two norms part there, these runs do not say.
    - float64: blocks of 16,384 on 32 warps, as first measured."""
    if element_size == 4:
        return RowTile(32768, 1, 32, True)
    return RowTile(16384, 1, 16 if element_size == 2 and subtract_mean else 32, True)


SPLIT_MIN_ROW = 32768
"""Rows at least this long may be split across programs (``row_strategy``): below it a row is cheap
enough for one program, and its split would be slices too small to pay for the second phase."""
SPLIT_MAX_ROWS_PER_SM = 2
"""... and are split when there are fewer rows than this many per SM: one program per row would then
leave SMs idle (an H100 has 132), or keep one long row's loop on one SM while the others wait."""
SPLIT_BLOCK = 4096
"""Elements of a split row that one program owns: a slice held in registers, 16 KB in float32."""
COOPERATIVE_ROWS = True
"""Whether ``row_strategy`` may answer ``"cooperative"`` (on a GPU): tests switch it off to run the
looped and split forwards there too."""
COOPERATIVE_MIN_ROWS_AT_ONCE = 8
"""A cooperative grid must hold this many rows at once (or all of them), else the split's two phases
run instead. With fewer, every program waits on the same row or two, so the whole GPU stops loading
while they wait: on an H100, LayerNorm over float32 rows of 524,288 (5 rows at once) moved 53 % of copy
bandwidth cooperatively against 63 % in two phases, softmax at the same length (8 at once) 76 against
63 %, and rows of 2,097,152 (one at a time) lost everywhere (49-58 % against 63-65 %)."""


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): e^x = 2^(x·log2 e)


@triton.jit
def exp_on_sfu(x):
    """e^x as 2^(x·log2 e), on the special-function unit in one instruction (MUFU.EX2). ``tl.exp`` computes
    the same 2^(x·log2 e), but lowers to PTX's ``ex2.approx.f32``, whose subnormal-safe form ptxas turns
    into four instructions (a compare and two predicated multiplies around the MUFU), where ``tl.exp2``
    lowers to ``ex2.approx.ftz.f32``, one: results under 2^-126 become 0, which no softmax or gradient
    here can tell apart. A memory-bound kernel counts instructions too: at copy speed an SM receives 12
    (H100) to 16 (H200) bytes a clock and issues 128 lane-instructions, so a bfloat16 softmax, which reads
    and writes 4 bytes a value, has 32 to 43 instructions a value, and takes two exps of each. Float64 keeps
    ``tl.exp``: its exp2 is no cheaper, and log2 e as a float32 constant would cost it precision."""
    if x.dtype == tl.float64:
        return tl.exp(x)
    else:
        return tl.exp2(x * LOG2E)


@triton.jit
def split_row_slice(row, piece, N, BLOCK_N: tl.constexpr):
    """The device side of ``"split"``: the columns of slice ``piece`` of ``row`` in an (rows, N) matrix,
    which of them are inside the row, and their offsets from the matrix's start. Offsets are 64-bit:
    a few long rows still make a matrix of more than 2^31 elements."""
    cols = piece * BLOCK_N + tl.arange(0, BLOCK_N)
    return cols, cols < N, row.to(tl.int64) * N + cols


@triton.jit
def split_row_partials(row, n_slices, BLOCK_SLICES: tl.constexpr):
    """Where phase 1 left ``row``'s partial statistics in a (rows, n_slices) buffer, padded to
    BLOCK_SLICES, and which of those slots are real: phase 2 reads them all at once and reduces."""
    slices = tl.arange(0, BLOCK_SLICES)
    return tl.cast(row, tl.int64) * n_slices + slices, slices < n_slices


@triton.jit
def arrive_and_wait(Arrivals, expected):
    """A barrier for the ``expected`` programs that share one row in a cooperative kernel: count this
    program in at the int32 ``Arrivals`` (zeroed before the launch), then spin until all have arrived.

    Why it is safe: the partial statistics a program stored before it arrives are visible to every
    program that leaves the wait. All threads' stores are done at the CTA barrier; the arrival is an
    acquire-release atomic at GPU scope (PTX's release is cumulative over what the CTA barrier ordered
    before it); the spin's loads are acquires. Readers then load the partials with ``.cg`` (L2, never a
    stale L1 line: a neighbouring row's partials share the 128-byte line). It cannot hang only because
    a cooperative launch guarantees that every program of the grid is resident at once
    (``launch_cooperative``); under the interpreter, which runs programs one after another, it would."""
    tl.debug_barrier()
    arrived = tl.atomic_add(Arrivals, 1, sem="acq_rel", scope="gpu") + 1
    while arrived < expected:
        arrived = tl.atomic_add(Arrivals, 0, sem="acquire", scope="gpu")


def _a_row_an_sm_stays_in_l2(rows: int, n: int, tensor: torch.Tensor) -> bool:
    """Whether ``l2_looped_tile``'s programs, one row an SM, find their rows in L2 on the second pass: every SM
    gets a row, and the rows in flight fit in L2. On an H200 (60 MB of L2) the loop beat the cooperative grid
    with 35 MB in flight (rows of 65,536 float32: LayerNorm 75.1 against 70.6 % of copy bandwidth, RMSNorm
    86.2 against 76.7; 131,072 bfloat16: 63-64 against 58-64) and lost with 69 MB (131,072 float32: 66-70
    against 67-73) (profiling/results/h200/norm-looped-tiles.md)."""
    device = tensor.get_device()
    multiprocessors = _multiprocessor_count(device)
    return rows >= multiprocessors and multiprocessors * n * tensor.element_size() <= _l2_cache_bytes(device)


def row_strategy(rows: int, n: int, tensor: torch.Tensor, arrays: int = 2, cooperative: bool = False,
                 loop_in_l2: bool = False) -> str:
    """How a row-wise kernel (LayerNorm, RMSNorm, softmax) covers a (rows, n) matrix on ``tensor``'s device:

    ``"tiled"``     short rows (``row_tile``'s block below ``MIN_TILE``): several rows a program, so each
                    program moves enough bytes to pay for its reductions;
    ``"row"``       one row a program, in registers (rows up to ``row_tile``'s limit for ``arrays``);
    ``"looped"``    one row a program, looped over in blocks (longer rows; the norms' backward splits
                    these rows too, layer_norm_backward.py says why);
    ``"split"``     rows of at least ``SPLIT_MIN_ROW`` elements, fewer than ``SPLIT_MAX_ROWS_PER_SM`` per SM:
                    each row is cut into slices of ``SPLIT_BLOCK``, one program each; phase 1 reduces the
                    slices to partial statistics, phase 2 combines them and normalises
                    (layer_norm_split.py, softmax_split.py);
    ``"cooperative"`` on a GPU, for a kernel that has a ``cooperative`` version (the forwards, the norms'
                    float32 backward), every row too long for one program's registers (``arrays``: as
                    ``row_tile`` counts them): slices of ``SPLIT_BLOCK`` in registers across a grid whose
                    programs are all resident, which wait for their row's partial statistics instead of
                    re-reading the row. The row crosses DRAM once, where "looped" and "split" read it
                    twice (at most 2/3 of copy bandwidth). The interpreter never gets it: it runs programs
                    one at a time, so one that waits for another would wait forever.
    ``"looped_in_l2"`` on a GPU, instead of "cooperative", for a forward that asks ``loop_in_l2`` (the
                    norms'): rows short enough that one an SM fits in L2, enough of them to fill
                    every SM. One row a program, looped over with ``l2_looped_tile``, whose second read
                    comes from L2. (Softmax's online loop, exps in both passes, did not win there.)

    The thresholds are module constants read at each call, so a test can lower them (and clear
    ``row_tile``'s cache) to run every strategy at sizes the interpreter takes in seconds. The
    interpreter counts as one SM."""
    # The row length first: the usual short row never asks for the SM count.
    if cooperative and COOPERATIVE_ROWS and tensor.is_cuda and row_tile(n, arrays).looped:
        return "looped_in_l2" if loop_in_l2 and _a_row_an_sm_stays_in_l2(rows, n, tensor) else "cooperative"
    if n >= SPLIT_MIN_ROW and rows < SPLIT_MAX_ROWS_PER_SM * (
            _multiprocessor_count(tensor.get_device()) if tensor.is_cuda else 1):
        return "split"
    tile = row_tile(n, arrays)
    return "looped" if tile.looped else ("tiled" if tile.rows_per_tile > 1 else "row")


@functools.cache
def column_reduction_launch(n: int, partial_rows: int, programs_target: int) -> tuple[int, int, int]:
    """(programs, block_cols, block_partials) for summing a (partial_rows, n) buffer over its rows.

    Each program owns ``block_cols`` adjacent columns (at least 32: one 128-byte line of float32 per
    row read) and walks down the rows ``block_partials`` at a time; columns are split so that about
    ``programs_target`` programs share the work."""
    block_cols = min(1024, max(32, next_power_of_2(cdiv(n, programs_target))))
    block_partials = min(next_power_of_2(partial_rows), max(1, 4096 // block_cols))
    return cdiv(n, block_cols), block_cols, block_partials


# --- launching -----------------------------------------------------------------------------------
# ``kernel[grid](*args, **constants)`` runs Triton's JITFunction.run, which on every call reads its
# knobs, asks the driver for the current device and stream, binds the arguments to the kernel's
# signature and *specializes* each one (a tensor's dtype and whether its address is a multiple of
# 16; an int's width, whether it is 1, whether it is a multiple of 16), turns that and the options
# into a cache key (a string built per call), looks the compiled kernel up, checks that the globals
# the kernel read have not changed, builds launch metadata for profiler hooks, and only then calls
# the compiled kernel's C launcher. For a decode-size kernel that runs in a few microseconds, this
# bookkeeping is a good part of the call. ``launch`` keeps the first call per key on that path (it
# compiles, or finds the kernel in Triton's caches) and remembers the CompiledKernel it returns;
# later calls with the same key go straight to the C launcher, with the arguments in the order
# JITFunction.run passes them (every parameter, constexprs included, as its generated launcher
# expects). Triton 3.6 and 3.9 share all of this: JITFunction.run, CompiledKernel.run / function /
# packed_metadata and the launcher's arguments.
#
# The key holds everything Triton's does, or more (a finer key only costs an extra trip through the
# JIT, never a wrong kernel): the kernel, the device, the knobs that JITFunction.run folds into the
# options, per argument its type and, for a tensor, its dtype and its address modulo 16, for an int
# whether it is 1, whether a multiple of 16, and its width (int32, int64 or uint64), and every
# constexpr and launch option by value. What it skips: JITFunction.run's
# check that the globals a kernel read are unchanged (ours read module constants only) and its
# pre-run hooks (none are registered). A profiler's launch hooks send calls back through the JIT.

DIRECT_LAUNCH = os.environ.get("TRITON_KERNELS_DIRECT_LAUNCH", "1") != "0"
"""Launch cached kernels straight through their C launcher (see above). Set it to False (or the
environment variable TRITON_KERNELS_DIRECT_LAUNCH=0) to send every call through JITFunction.run, to
time one against the other. The interpreter always takes Triton's own path."""

_compiled_kernels: dict[tuple, tuple] = {}  # key -> (kernel, CompiledKernel, values of the parameters after args)
# (The entry holds the kernel itself so that the id(kernel) in its key can never be reused.)

RECORDERS: dict[int, object] = {}
"""The ``replay.Recorder`` watching a forward or a backward, by thread, while one does: ``launch`` and
``launch_cooperative`` tell it each kernel they start (straight to its launcher, or through Triton's JIT)."""


def _tell_recorder(event: str, *details) -> None:
    """Call ``event`` (``launched``, ``launched_through_jit``) on this thread's recorder, if one
    is watching."""
    recorder = RECORDERS.get(threading.get_ident())
    if recorder is not None:
        getattr(recorder, event)(*details)


def launch(kernel, grid, *args, **constants) -> None:
    """``kernel[grid](*args, **constants)``: tensors and scalars positionally, constexprs and launch
    options (num_warps, num_stages, ...) by keyword, as every launcher here calls its kernels. An
    autotuned kernel (its grid a function of the chosen tile) takes Triton's path."""
    if INTERPRETING or not DIRECT_LAUNCH or type(kernel) is not _JITFunction or _hooked(kernel):
        if RECORDERS:
            _tell_recorder("launched_through_jit", kernel)
        kernel[grid](*args, **constants)
        return
    device = _current_cuda_device()
    key = _launch_key(kernel, device, args, constants)
    entry = _compiled_kernels.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **constants)  # Triton binds, specializes, compiles or finds, launches
        if isinstance(compiled, triton.compiler.CompiledKernel):
            entry = _compiled_kernels[key] = (kernel, compiled, _constant_tail(kernel, args, constants))
        if RECORDERS:
            _tell_recorder("launched", entry, grid, args)
        return
    if RECORDERS:
        _tell_recorder("launched", entry, grid, args)
    _, compiled, tail = entry
    # As JITFunction.run does: the launcher, the loaded function and the packed metadata are read off
    # the CompiledKernel at each launch; no launch metadata and no hooks, since _hooked found none.
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 _current_raw_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)


def _launch_key(kernel, device: int, args, constants: dict) -> tuple:
    # The tensors' part of the key is written inline: most arguments are tensors, and a function call
    # per argument was a quarter of launch's time.
    return (id(kernel), device, *_option_knob_values(triton.knobs),
            *[(arg.dtype, arg.data_ptr() & 15) if isinstance(arg, torch.Tensor)
              else (_INT_KEYS.get(arg) or _int_key(arg)) if type(arg) is int else type(arg) for arg in args],
            *constants.items())


def _constant_tail(kernel, args, constants: dict) -> tuple:
    """The parameters after the positional ``args``, in order, as the generated launcher takes them."""
    return tuple(constants[p.name] if p.name in constants else p.default for p in kernel.params[len(args):])


_cooperative_kernels: dict[tuple, tuple] = {}


class _RowArrivals:
    """``ROW_ARRIVALS``'s type."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ROW_ARRIVALS"


ROW_ARRIVALS = _RowArrivals()
"""Stands, among ``launch_cooperative``'s arguments, for the counters ``arrive_and_wait`` counts on: a
zeroed int32 per row. ``launch_cooperative`` allocates them only once it knows the grid will launch,
so a caller that falls back to its two phases pays no allocation and no zeroing kernel for them."""


def _with_row_arrivals(args: tuple, rows: int, device: int) -> tuple:
    arrivals = torch.zeros(rows, dtype=torch.int32, device=torch.device("cuda", device))
    return tuple(arrivals if arg is ROW_ARRIVALS else arg for arg in args)


@functools.cache
def _cuda_driver() -> ctypes.CDLL:
    """The CUDA driver library, for the one call Triton does not wrap: the occupancy query."""
    return ctypes.CDLL("libcuda.so.1")


def _cooperative_entry(kernel, args: tuple, constants: dict) -> tuple:
    """(kernel, its CompiledKernel, programs the GPU holds at once, the launcher's constant tail) for a
    cooperative launch of ``kernel`` with these arguments, compiled and asked once per key.

    The CUDA driver says how many programs an SM holds, from the compiled kernel's registers, shared
    memory and warps (``cuOccupancyMaxActiveBlocksPerMultiprocessor``, the arithmetic by which it would
    refuse a cooperative grid too large)."""
    constants["launch_cooperative_grid"] = True
    device = _current_cuda_device()
    # The key sees ROW_ARRIVALS, not a tensor; the kernel is compiled for a fresh allocation's counters,
    # int32 and 16-byte aligned like every buffer of PyTorch's caching allocator.
    key = _launch_key(kernel, device, args, constants)
    entry = _cooperative_kernels.get(key)
    if entry is None:
        # Compiles, launches nothing. The counters' stand-in is their dtype (Triton's MockTensor: aligned), not a
        # zeroed tensor: a pass being recorded for replay would see an allocation that no launch reads.
        compiled = kernel.warmup(*(torch.int32 if arg is ROW_ARRIVALS else arg for arg in args), grid=(1,),
                                 **constants)
        compiled._init_handles()  # loads the binary: its CUfunction handle is what the driver is asked about
        per_multiprocessor = ctypes.c_int()
        result = _cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(per_multiprocessor), ctypes.c_void_p(compiled.function),
            ctypes.c_int(32 * compiled.metadata.num_warps), ctypes.c_size_t(compiled.metadata.shared))
        if result != 0:
            raise RuntimeError(f"cuOccupancyMaxActiveBlocksPerMultiprocessor failed with CUDA error {result}")
        entry = _cooperative_kernels[key] = (kernel, compiled, per_multiprocessor.value * _multiprocessor_count(device),
                                             _constant_tail(kernel, args, constants))
    return entry


def cooperative_rows_at_once(kernel, rows: int, slices: int, *args, **constants) -> int:
    """How many of ``rows`` rows of ``slices`` slices ``launch_cooperative`` would run at once with these
    arguments: as many whole rows as the GPU holds programs for, or 0 when that is fewer than
    ``COOPERATIVE_MIN_ROWS_AT_ONCE`` (or than all the rows), where it launches nothing. For a caller that
    sizes a buffer by it (a row of partial sums per row at once); only the arguments' types and
    alignments enter, so a stand-in of the same dtype may take the place of a buffer not yet allocated."""
    return _rows_at_once(_cooperative_entry(kernel, args, constants)[2], rows, slices)


def _rows_at_once(resident: int, rows: int, slices: int) -> int:
    rows_at_once = min(rows, resident // slices)
    return rows_at_once if rows_at_once >= min(rows, COOPERATIVE_MIN_ROWS_AT_ONCE) else 0


def launch_cooperative(kernel, rows: int, slices: int, *args, **constants) -> bool:
    """Launch ``kernel`` over ``rows`` rows of ``slices`` slices as one cooperative grid, whose programs
    may wait on each other (``arrive_and_wait``): program p owns slice p % slices of rows p // slices,
    then that plus the rows at once, and so on. A cooperative launch starts every program at once or
    not at all: the driver refuses a grid larger than the GPU holds with an error, never a hang.

    The grid holds as many whole rows at once as fit (``cooperative_rows_at_once``). Returns False,
    launching nothing, when fewer than ``COOPERATIVE_MIN_ROWS_AT_ONCE`` rows (or than all of them) fit:
    the caller runs its two phases. The row counters go among ``args`` as ``ROW_ARRIVALS``."""
    _, compiled, resident, tail = _cooperative_entry(kernel, args, constants)
    rows_at_once = _rows_at_once(resident, rows, slices)
    if not rows_at_once:
        # The same answer at every call of the signature: a recorder may replay the caller's two phases.
        return False
    device = _current_cuda_device()
    # The counters, zeroed: to a recorder, a zero-filled allocation, which the C++ op fills again per call.
    args = _with_row_arrivals(args, rows, device)
    grid = (rows_at_once * slices,)
    if not DIRECT_LAUNCH or _hooked(kernel):
        if RECORDERS:
            _tell_recorder("launched_through_jit", kernel)
        kernel[grid](*args, **constants)
    else:
        if RECORDERS:
            _tell_recorder("launched", (kernel, compiled, tail), grid, args)
        compiled.run(grid[0], 1, 1, _current_raw_stream(device), compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *tail)
    return True


class SignatureTable(dict):
    """Launch plans kept per input signature (shapes, strides, dtypes, devices and the op's scalars): a
    model calls each op with the same few signatures step after step, so a launcher that works out its
    checks, tiles and kernel arguments once per signature only allocates and launches after that. At
    most ``most`` at once: past that (a loop over ever-new shapes) the table starts again. A dict, so
    that the lookup on every call is dict's own ``get``."""

    def __init__(self, most: int = 256):
        super().__init__()
        self.most = most

    def keep(self, signature: tuple, plan):
        if len(self) >= self.most:
            self.clear()
        self[signature] = plan
        return plan


_JITFunction = triton.runtime.JITFunction  # exactly: a subclass could launch differently


def _hooked(kernel) -> bool:
    """Whether anything asks to see this launch: launch hooks (a profiler's), pre-run hooks, a pipeline
    inspection hook. Those calls take Triton's own path, which serves them. One expression, no helper
    per hook: every direct launch asks."""
    runtime = triton.knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    # Triton's default hook is an empty HookChain, which the C launcher would call and which does nothing.
    return not ((enter is None or type(enter) is _HookChain and not enter.calls)
                and (leave is None or type(leave) is _HookChain and not leave.calls)
                and not kernel.pre_run_hooks and getattr(runtime, "add_stages_inspection_hook", None) is None)


_HookChain = triton.knobs.HookChain

_OPTION_KNOBS = [("runtime", "debug"), ("compilation", "instrumentation_mode")] + [
    ("compilation", name) for name in ("fpsan_homomorphic_casts",)
    if hasattr(triton.knobs.compilation, name)]  # Triton 3.9 reads this one as well
"""The knobs JITFunction.run reads into the options, and so into its key, on every call: (group, name)
in ``triton.knobs``."""
_option_knob_values = operator.attrgetter(*[f"{group}.{name}" for group, name in _OPTION_KNOBS])
"""Their values, read in one call (an attrgetter loops in C)."""


_INT32 = range(-2**31, 2**31)
_INT_KEYS: dict[int, tuple] = {}
"""An int argument's part of the key, per value: a launcher passes the same few sizes (rows, N, strides)
call after call, and one dict lookup costs less than recomputing the four tests. (Only ints enter:
1.0 and True equal 1 as dict keys, so other types never look here.)"""


def _int_key(value: int) -> tuple:
    key = _INT_KEYS[value] = (int, value == 1, value % 16 == 0, value in _INT32, value >= 2**63)
    return key
