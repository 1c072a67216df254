"""Level 4's eager calls replayed from C++: the Python forward and backward run once per input signature,
and every later call of that signature is one C++ op that allocates and launches the same compiled Triton
kernels, with a C++ autograd node that does the same for the backward.

Why. Two costs of a level-4 call are Python's, not the GPU's. Each launch goes through Triton's Python
launcher, which on a GPU machine's host takes longer than the kernel runs at GPT-2's sizes. And on a GPU,
PyTorch runs every backward node on its autograd *device thread*, where a node written in Python runs far
slower than on the calling thread (CPython writes a reference count into every object it touches, and two
threads on two cores touch the same objects in turn; profiling/results/h200/README.md, "Autograd's device
thread"). Level 5 pays neither, because its launches and its autograd are C++. This module gives level 4's
kernels the same path, as AOTInductor does for torch.compile's Triton kernels: the kernels stay Triton's;
only the Python around their launches goes. What it gained, and the backward alone would not have:
profiling/results/h200/replay-from-cpp.md.

How (``eager.EagerFunction`` calls it):
1. The first call of a signature (each tensor's shape, strides, dtype, device, requires_grad and
   address modulo 16, since Triton compiles for aligned pointers when they are; any other argument's
   value) runs the ``torch.autograd.Function`` as before, under a ``Recorder``: it notes every kernel
   ``launch.launch`` starts (the compiled kernel, grid and arguments) and every ATen op.
2. The first backward of that signature runs under a second ``Recorder`` (calls until then take the
   Python path, unrecorded). Then the call is *replayable* when each
   pass's ATen ops were only allocations (``torch.empty*``), its work only launches through
   ``launch.launch``, each tensor argument of a launch is a whole tensor of the call (an argument, the
   gradient, a saved tensor or an allocation; never a view into one), and the output and each gradient
   are one whole allocation. Anything else (a cooperative grid, an autotuned kernel, a zero-filled
   buffer, a matmul by PyTorch, ...) and the signature keeps its Python: correct, only slower.
3. Every later call of a replayable signature is ``cuda_kernels::run_triton_plan`` (level 5's
   extension, ``cuda_kernels/triton_replay.cpp``): the forward, and an output whose ``grad_fn`` is a C++
   node that replays the backward.

Each launch's parameters are checked against the kernel's PTX (what Triton's launcher passes: the
non-constexpr arguments, then its scratch pointers), so a Triton whose calling convention differs is
refused, not mislaunched. Set ``TRITON_KERNELS_REPLAY=0`` (or ``replay.REPLAY = False``) to keep every
call in Python, to time one against the other; the interpreter never replays (its kernels are Python).
A plan keeps the kernels it recorded: a Triton knob changed later (``triton.knobs``, e.g. debug) reaches
new signatures only.
"""

from __future__ import annotations

import functools
import os
import re
import struct
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import launch as launch_module

REPLAY = not launch_module.INTERPRETING and os.environ.get("TRITON_KERNELS_REPLAY", "1") != "0"
"""Replay recorded calls from C++ (see above); read at each call, so a test or a benchmark can switch it."""

# The ATen ops a replayable pass may run: allocations, whose contents its kernels write in full; and the
# detach PyTorch itself applies to a tensor a dispatch mode returns (no work).
_ALLOCATIONS = frozenset({torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                          torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default})
_DETACH = torch.ops.aten.detach.default

# c10::ScalarType's numbers (stable: they are serialised in TorchScript files).
_SCALAR_TYPE = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
                torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15}

# triton_replay.cpp's ParameterKind.
_TENSOR, _ALIGNED_TENSOR, _BITS32, _BITS64 = 0, 1, 2, 3


def signature(args) -> tuple:
    """What a recorded call depends on, per argument (see the module's docstring). The strides, not only
    whether a tensor is contiguous: a launcher that reads a strided view in place passes its strides to
    the kernel as integers, which the plan keeps."""
    return tuple((arg.shape, arg.stride(), arg.dtype, arg.get_device(), arg.requires_grad, arg.data_ptr() & 15)
                 if isinstance(arg, torch.Tensor) else (type(arg), arg) for arg in args)


class Refused(str):
    """What a signature whose call is not replayable keeps instead of a plan (it is not recorded again): why."""


class Pending:
    """What a signature keeps from its first call's forward until a backward of it runs: the forward's record
    (or ``Refused``) and the compiled kernels it launched. Calls meanwhile take the Python path,
    unrecorded, and carry it to their backward."""

    __slots__ = ("signature", "forward", "kernels")

    def __init__(self, signature: tuple, forward, kernels: tuple):
        self.signature, self.forward, self.kernels = signature, forward, kernels


class Plan:
    """A plan kept by level 5's extension, by number; forgotten there when this is. It holds the compiled
    kernels the plan launches: a CompiledKernel unloads its module when it is freed, and the plan keeps
    only the address of the function in it."""

    __slots__ = ("number", "kernels")

    def __init__(self, number: int, kernels: tuple):
        self.number, self.kernels = number, kernels

    def __del__(self):
        try:
            _extension()[2](self.number)
        except Exception:  # at interpreter exit the ops may be gone before the plans
            pass


@functools.cache
def _extension():
    """(make_triton_plan, run_triton_plan, release_triton_plan) from level 5's extension, built on first use;
    None (and a note, once) where it has no CUDA kernels: then every level-4 call stays in Python."""
    try:
        import cuda_kernels.ops as extension
    except (ImportError, RuntimeError) as error:  # LevelUnavailableError is a RuntimeError
        why = str(error)
    else:
        why = extension._WHY_NO_CUDA
    if why is not None:
        print(f"triton_kernels: level 4's calls stay in Python (no C++ op to replay them): {why}", file=sys.stderr)
        return None
    ops = torch.ops.cuda_kernels
    return ops.make_triton_plan.default, ops.run_triton_plan.default, ops.release_triton_plan.default


def plans() -> dict[str, dict]:
    """What each level-4 op's signatures have come to so far: ``{op: {"replayed": n, "pending": n,
    "refused": [why, ...]}}``, for anyone who wants to know which calls run from C++ (and why the others
    do not)."""
    from .eager import EagerFunction  # (eager imports this module)

    report = {}
    for function in EagerFunction.__subclasses__():
        kept = list(function._replay_plans.values())
        report[function.__name__] = {"replayed": sum(isinstance(plan, Plan) for plan in kept),
                                     "pending": sum(isinstance(plan, Pending) for plan in kept),
                                     "refused": [str(plan) for plan in kept if isinstance(plan, Refused)]}
    return report


def run(args, plan: Plan) -> torch.Tensor:
    """The output of a call of a recorded signature, by the C++ op."""
    return _extension()[1]([arg if isinstance(arg, torch.Tensor) else None for arg in args], plan.number)


def record_forward(function, args, call_signature: tuple, plans) -> torch.Tensor:
    """``function``'s first call of a signature, recorded: the signature keeps a ``Pending`` until a
    backward of it runs (``record_backward``)."""
    if _extension() is None:
        plans.keep(call_signature, Refused("no C++ op to replay it"))
        return function._apply_in_cpp(*args)
    recorder = Recorder(args)
    with recorder:
        output = function._apply_in_cpp(*args)
    node = output.grad_fn if isinstance(output, torch.Tensor) else None
    if node is None:
        plans.keep(call_signature, Refused("its output is not one tensor with a backward"))
    else:
        record = recorder.forward_record(output, node.saved_tensors)
        node.pending = plans.keep(call_signature, Pending(call_signature, record, recorder.kernels()))
    return output


def await_backward(function, args, pending: Pending) -> torch.Tensor:
    """A call of a signature whose forward is recorded and whose backward is not yet: the Python path, its
    node carrying the record to whichever backward runs first."""
    output = function._apply_in_cpp(*args)
    output.grad_fn.pending = pending
    return output


def record_backward(backward, ctx, grads, plans) -> tuple:
    """Run ``backward(ctx, *grads)`` under a ``Recorder`` and keep the signature's ``Plan`` (or ``Refused``)
    in ``plans``; return the backward's gradients."""
    pending = ctx.pending
    if isinstance(pending.forward, Refused):
        plans.keep(pending.signature, pending.forward)
        return backward(ctx, *grads)
    grad = grads[0].contiguous()
    recorder = Recorder([grad, *ctx.saved_tensors])
    with recorder:
        gradients = backward(ctx, grad)
    gradients = gradients if isinstance(gradients, tuple) else (gradients,)
    record = recorder.backward_record(gradients)
    plans.keep(pending.signature, record if isinstance(record, Refused) else
               Plan(_extension()[0](*pending.forward, *record), pending.kernels + recorder.kernels()))
    return gradients


class Recorder(TorchDispatchMode):
    """Watches one pass (a forward or a backward) on this thread: the kernels ``launch.launch`` starts, the
    buffers it allocates, and any other ATen op (which makes it not replayable). ``forward_record`` and
    ``backward_record`` turn what it saw into ``make_triton_plan``'s arguments, or ``Refused``."""

    def __init__(self, slots):
        super().__init__()
        # The pass's tensors by slot: its arguments (None for a non-tensor), then each allocation.
        self.slots = [slot if isinstance(slot, torch.Tensor) else None for slot in slots]
        self.first_allocation = len(self.slots)
        self.launches = []  # (kernel, CompiledKernel, grid, every parameter's value)
        self.refusal = None

    def __enter__(self):
        launch_module.RECORDERS[threading.get_ident()] = self
        return super().__enter__()

    def __exit__(self, *exc):
        del launch_module.RECORDERS[threading.get_ident()]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.slots.append(out)  # also keeps it alive, so no later buffer reuses its address
        elif func is not _DETACH:
            self.refuse(f"it runs {func}")
        return out

    def refuse(self, why: str) -> None:
        if self.refusal is None:
            self.refusal = why

    def launched(self, entry, grid, args) -> None:
        """Called by ``launch.launch`` for each kernel it starts; ``entry`` is its cache entry (kernel,
        CompiledKernel, values of the parameters after ``args``), None if it kept none."""
        if entry is None:
            self.refuse("a kernel launched without a CompiledKernel to replay")
        else:
            kernel, compiled, tail = entry
            self.launches.append((kernel, compiled, tuple(grid) + (1,) * (3 - len(grid)), (*args, *tail)))

    def kernels(self) -> tuple:
        """The CompiledKernels this pass launched."""
        return tuple(compiled for _, compiled, _, _ in self.launches)

    def forward_record(self, output, saved):
        """(allocations, launches, output slot, saved slots), or ``Refused``."""
        try:
            allocations, launches, slot_of = self._pass()
            return allocations, launches, self._whole_allocation(output, slot_of), [self._whole(t, slot_of) for t in saved]
        except _NotReplayable as why:
            return Refused(why)

    def backward_record(self, gradients):
        """(allocations, launches, the gradients' slots), or ``Refused``."""
        try:
            allocations, launches, slot_of = self._pass()
            slots = [-1 if gradient is None else self._whole_allocation(gradient, slot_of) for gradient in gradients]
            return allocations, launches, slots
        except _NotReplayable as why:
            return Refused(why)

    def _pass(self):
        if self.refusal is not None:
            raise _NotReplayable(self.refusal)
        if not self.launches:
            raise _NotReplayable("it launched no kernel")
        slot_of = {}
        for slot, tensor in enumerate(self.slots):
            if tensor is None:
                continue
            address = tensor.data_ptr()
            if address == 0 or address in slot_of:
                raise _NotReplayable("two of its tensors share an address, or one is empty")
            slot_of[address] = slot
        allocations = []
        device = next(tensor for tensor in self.slots if tensor is not None).device  # where the C++ op allocates
        for tensor in self.slots[self.first_allocation:]:
            if not tensor.is_contiguous() or tensor.device != device or tensor.dtype not in _SCALAR_TYPE:
                raise _NotReplayable("it allocates a buffer the C++ op would not allocate alike")
            allocations.append([_SCALAR_TYPE[tensor.dtype], *tensor.shape])
        try:
            launches = [_launch_row(kernel, compiled, grid, values, slot_of)
                        for kernel, compiled, grid, values in self.launches]
        except (AttributeError, KeyError) as error:  # a Triton whose CompiledKernel reads otherwise
            raise _NotReplayable(f"its compiled kernels do not read as expected ({error!r})") from error
        return allocations, launches, slot_of

    def _whole(self, tensor, slot_of) -> int:
        """The slot that is exactly ``tensor`` (same address, shape, strides and dtype)."""
        slot = slot_of.get(tensor.data_ptr()) if isinstance(tensor, torch.Tensor) else None
        if (slot is None or tensor.shape != self.slots[slot].shape or tensor.stride() != self.slots[slot].stride()
                or tensor.dtype != self.slots[slot].dtype):
            raise _NotReplayable("a tensor it hands on is not a whole tensor of the pass")
        return slot

    def _whole_allocation(self, tensor, slot_of) -> int:
        slot = self._whole(tensor, slot_of)
        if slot < self.first_allocation:
            raise _NotReplayable("a tensor it returns is not a buffer it allocated")
        return slot


class _NotReplayable(Exception):
    pass


def _launch_row(kernel, compiled, grid, values, slot_of) -> list[int]:
    """[CUfunction, grid x, y, z, threads, shared bytes, (kind, value) per parameter] of one recorded
    launch, as triton_replay.cpp takes it."""
    metadata = compiled.metadata
    if (getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "launch_pdl", False) or getattr(metadata, "tensordesc_meta", None)
            or getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0)):
        raise _NotReplayable(f"{kernel.fn.__name__} needs a launch the C++ op does not make")
    row = [compiled.function, *grid, 32 * metadata.num_warps, metadata.shared]
    sizes = []
    types = compiled.src.signature
    for parameter, value in zip(kernel.params, values):
        kind = types[parameter.name]
        if kind == "constexpr":
            continue
        if kind.startswith("*"):
            slot = slot_of.get(value.data_ptr()) if isinstance(value, torch.Tensor) else None
            if slot is None:
                raise _NotReplayable(f"{kernel.fn.__name__}'s {parameter.name} is not a whole tensor of the pass")
            row += [_ALIGNED_TENSOR if value.data_ptr() % 16 == 0 else _TENSOR, slot]
            sizes.append(8)
        elif kind in ("i32", "u32"):
            row += [_BITS32, value & 0xFFFFFFFF]
            sizes.append(4)
        elif kind == "i64":
            row += [_BITS64, value]
            sizes.append(8)
        elif kind == "fp32":
            row += [_BITS32, struct.unpack("<I", struct.pack("<f", value))[0]]
            sizes.append(4)
        elif kind == "fp64":
            row += [_BITS64, struct.unpack("<q", struct.pack("<d", value))[0]]
            sizes.append(8)
        else:
            raise _NotReplayable(f"{kernel.fn.__name__}'s {parameter.name} is a {kind}")
    declared = _ptx_parameter_sizes(compiled)
    scratch = declared[len(sizes):]
    if declared[:len(sizes)] != sizes or any(size != 8 for size in scratch):
        raise _NotReplayable(f"{kernel.fn.__name__}'s PTX parameters {declared} do not match its arguments {sizes}")
    for _ in scratch:  # Triton's scratch pointers, null: the kernel asked for no scratch memory
        row += [_BITS64, 0]
    return row


_PTX_ENTRY = re.compile(r"\.entry\s+[\w$]+\s*\((.*?)\)", re.S)
_PTX_PARAMETER = re.compile(r"\.param\s+\.[a-z]+(\d+)")


def _ptx_parameter_sizes(compiled) -> list[int]:
    """Bytes of each parameter of the kernel's entry, as its PTX declares them (``.param .u64 ...``)."""
    entry = _PTX_ENTRY.search(compiled.asm["ptx"])
    return [int(bits) // 8 for bits in _PTX_PARAMETER.findall(entry.group(1))] if entry else []
