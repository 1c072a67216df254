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
   Python path, unrecorded). Then the call is *replayable* when each pass's ATen ops were only
   allocations (``torch.empty*``, strided or not, and ``torch.zeros*``, which the C++ op fills with zeros
   again at each call) and views (``.t()``, ``.view``, ``.permute``, ...: a tensor's sizes, strides and
   offset, no work), its work only launches through ``launch.launch`` and ``launch.launch_cooperative``
   (a cooperative grid: its row counters are such a zero-filled allocation), each tensor argument of a
   launch is a tensor of the call (an argument, the gradient, a saved tensor, an allocation, or a view of
   one of these), and the output and each gradient are memory the pass allocated (or a view of it).
   Anything else (a matmul by PyTorch, a buffer filled with anything but zeros, a loss's count of
   targets, ...) and the signature keeps its Python: correct, only slower. A pass that first tuned a
   kernel (the matmul's autotuner, timing its candidates at a new shape) is not kept: the next call of
   the signature is recorded instead.
3. Every later call of a replayable signature is ``cuda_kernels::run_triton_plan`` (level 5's
   extension, ``cuda_kernels/triton_replay.cpp``): the forward, and an output whose ``grad_fn`` is a C++
   node that replays the backward. The op remembers the call's key (the signature, worked out in C++), and
   from then on a call alike is found by ``cuda_kernels::run_known_triton_call`` before any of this
   module's Python runs: working out the signature in Python, the lookup and the op's argument list cost
   a GPU host 7 µs a call (profiling/results/h200/replay-known-calls.md).

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
from typing import NamedTuple

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from . import launch as launch_module

REPLAY = not launch_module.INTERPRETING and os.environ.get("TRITON_KERNELS_REPLAY", "1") != "0"
"""Replay recorded calls from C++ (see above); read at each call, so a test or a benchmark can switch it."""

# The ATen ops a replayable pass may run, besides views: allocations, whose contents its kernels write in
# full; zero-filled allocations (a cooperative grid's row counters), which the C++ op fills again at each
# call; and the detach PyTorch itself applies to a tensor a dispatch mode returns (no work).
_ALLOCATIONS = frozenset({torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                          torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                          torch.ops.aten.new_empty_strided.default})
_ZERO_FILLED = frozenset({torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default,
                          torch.ops.aten.new_zeros.default})
_DETACH = torch.ops.aten.detach.default

# c10::ScalarType's numbers (stable: they are serialised in TorchScript files).
_SCALAR_TYPE = {torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
                torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15}

# triton_replay.cpp's ParameterKind.
_TENSOR, _ALIGNED_TENSOR, _BITS32, _BITS64, _SCRATCH = 0, 1, 2, 3, 4


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
    (or ``Refused``), the compiled kernels it launched and its output's strides. Calls meanwhile take the
    Python path, unrecorded, and carry it to their backward."""

    __slots__ = ("signature", "forward", "kernels", "output_stride")

    def __init__(self, signature: tuple, forward, kernels: tuple, output_stride: tuple):
        self.signature, self.forward, self.kernels, self.output_stride = signature, forward, kernels, output_stride


class Plan:
    """A plan kept by level 5's extension, by number; forgotten there when this is. It holds the compiled
    kernels the plan launches: a CompiledKernel unloads its module when it is freed, and the plan keeps
    only the address of the function in it."""

    __slots__ = ("number", "kernels")

    def __init__(self, number: int, kernels: tuple):
        self.number, self.kernels = number, kernels

    def __del__(self):
        try:
            _extension().release_plan(self.number)
        except Exception:  # at interpreter exit the ops may be gone before the plans
            pass


class CppOps(NamedTuple):
    """Level 5's ops that keep and run plans (``cuda_kernels/triton_replay.cpp``)."""

    make_plan: object
    run_plan: object
    release_plan: object
    run_known_call: object


def cpp_ops() -> CppOps:
    """The ops from ``torch.ops.cuda_kernels``, the extension loaded."""
    ops = torch.ops.cuda_kernels
    return CppOps(ops.make_triton_plan.default, ops.run_triton_plan.default, ops.release_triton_plan.default,
                  ops.run_known_triton_call.default)


@functools.cache
def _extension() -> CppOps | None:
    """``cpp_ops()`` from level 5's extension, built on first use; None (and a note, once) where it has no
    CUDA kernels: then every level-4 call stays in Python."""
    try:
        import cuda_kernels.ops as extension
    except (ImportError, RuntimeError) as error:  # LevelUnavailableError is a RuntimeError
        why = str(error)
    else:
        why = extension._WHY_NO_CUDA
    if why is not None:
        print(f"triton_kernels: level 4's calls stay in Python (no C++ op to replay them): {why}", file=sys.stderr)
        return None
    return cpp_ops()


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


def run(function: int, tensors, numbers, plan: Plan) -> torch.Tensor:
    """The output of a call of a recorded signature, by the C++ op, which remembers the call's key for
    ``function`` (an ``EagerFunction``'s number): its next call alike is ``run_known``'s."""
    return _extension().run_plan(function, tensors, numbers, plan.number)


def run_known(function: int, tensors, numbers) -> torch.Tensor | None:
    """The output of a call whose key the C++ op remembers (``run``), by the C++ op; None for any other
    call, or where there is no C++ op."""
    extension = _extension()
    return None if extension is None else extension.run_known_call(function, tensors, numbers)


def record_forward(function, args, call_signature: tuple, plans) -> torch.Tensor:
    """``function``'s first call of a signature, recorded: the signature keeps a ``Pending`` until a
    backward of it runs (``record_backward``); a call that tuned a kernel first keeps nothing, and the next
    call records again."""
    if _extension() is None:
        plans.keep(call_signature, Refused("no C++ op to replay it"))
        return function._apply_in_cpp(*args)
    recorder = Recorder(args)
    with recorder:
        output = function._apply_in_cpp(*args)
    if recorder.postponed:
        return output
    node = output.grad_fn if isinstance(output, torch.Tensor) else None
    if node is None:
        plans.keep(call_signature, Refused("its output is not one tensor with a backward"))
    else:
        record = recorder.forward_record(output, node.saved_tensors)
        node.pending = plans.keep(call_signature, Pending(call_signature, record, recorder.kernels(), output.stride()))
    return output


def await_backward(function, args, pending: Pending) -> torch.Tensor:
    """A call of a signature whose forward is recorded and whose backward is not yet: the Python path, its
    node carrying the record to whichever backward runs first."""
    output = function._apply_in_cpp(*args)
    output.grad_fn.pending = pending
    return output


def record_backward(backward, ctx, grads, plans) -> tuple:
    """Run ``backward(ctx, *grads)`` under a ``Recorder`` and keep the signature's ``Plan`` (or ``Refused``)
    in ``plans``; return the backward's gradients. The gradient is taken as it comes when it is laid out as
    the output was (attention's output is a (B, H, L, D) view of a (B, L, H, D) buffer, and its gradient
    comes back so), else made contiguous; the C++ node lays later gradients out the same way."""
    pending = ctx.pending
    if isinstance(pending.forward, Refused):
        plans.keep(pending.signature, pending.forward)
        return backward(ctx, *grads)
    grad = grads[0] if grads[0].stride() == pending.output_stride else grads[0].contiguous()
    recorder = Recorder([grad, *ctx.saved_tensors])
    with recorder:
        gradients = backward(ctx, grad)
    gradients = gradients if isinstance(gradients, tuple) else (gradients,)
    if not recorder.postponed:
        record = recorder.backward_record(gradients)
        plans.keep(pending.signature, record if isinstance(record, Refused) else
                   Plan(_extension().make_plan(*pending.forward, grad.stride(), *record), pending.kernels + recorder.kernels()))
    return gradients


class Recorder(TorchDispatchMode):
    """Watches one pass (a forward or a backward) on this thread: the kernels ``launch.launch`` starts, the
    buffers it allocates, the views it takes, and any other ATen op (which makes it not replayable).
    ``forward_record`` and ``backward_record`` turn what it saw into ``make_triton_plan``'s arguments, or
    ``Refused``.

    Slots are numbered as triton_replay.cpp numbers them: the tensors the pass is handed (None for a
    non-tensor argument), then its allocations, then its views."""

    def __init__(self, handed):
        super().__init__()
        # Each list keeps its tensors alive, so no later buffer reuses an address and no id is reused.
        self.handed = [tensor if isinstance(tensor, torch.Tensor) else None for tensor in handed]
        self.allocations = []
        self.zero_filled = set()  # ids of the allocations that came zero-filled
        self.views = []  # (view, the tensor it was taken of)
        self.launches = []  # (kernel, CompiledKernel, grid, every parameter's value)
        self.refusal = None
        self.postponed = False

    def __enter__(self):
        launch_module.RECORDERS[threading.get_ident()] = self
        return super().__enter__()

    def __exit__(self, *exc):
        del launch_module.RECORDERS[threading.get_ident()]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocations.append(out)
        elif func in _ZERO_FILLED:
            self.allocations.append(out)
            self.zero_filled.add(id(out))
        elif func is _DETACH:  # the same tensor again (found by its address, like any alias of a slot)
            pass
        elif func.is_view and isinstance(args[0], torch.Tensor):  # a view's metadata only: no work
            self.views += [(view, args[0]) for view in (out if isinstance(out, (tuple, list)) else (out,))]
        else:
            self.refuse(f"it runs {func}")
        return out

    def refuse(self, why: str) -> None:
        if self.refusal is None:
            self.refusal = why

    def launched_through_jit(self, kernel) -> None:
        """Called by ``launch.launch`` for a kernel it hands to Triton's JIT, which the C++ op cannot repeat.
        An autotuner's launch, though (a key's first call, timing the candidates; later calls launch its
        choice directly), only makes this pass unlike the next call's: the pass is not kept, and the next
        call of the signature is recorded instead."""
        if type(kernel) is triton.runtime.Autotuner:
            self.postponed = True
        else:
            self.refuse(f"{kernel} launched through Triton's JIT")

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
        """(allocations, views, launches, output slot, saved slots), or ``Refused``."""
        try:
            slots = _Slots(self)
            saved_slots = [slots.whole(tensor) for tensor in saved]
            if any(slot >= slots.handed and not slots.owned(slot) for slot in saved_slots):
                raise _NotReplayable("it saves a view of an argument")
            return (*slots.rows(), slots.allocated(output), saved_slots)
        except _NotReplayable as why:
            return Refused(why)

    def backward_record(self, gradients):
        """(allocations, views, launches, the gradients' slots), or ``Refused``."""
        try:
            slots = _Slots(self)
            return (*slots.rows(), [-1 if gradient is None else slots.allocated(gradient) for gradient in gradients])
        except _NotReplayable as why:
            return Refused(why)


class _NotReplayable(Exception):
    pass


class _Slots:
    """A recorded pass's tensors numbered as slots, and its rows for ``make_triton_plan``."""

    def __init__(self, recorder: Recorder):
        if recorder.refusal is not None:
            raise _NotReplayable(recorder.refusal)
        if not recorder.launches:
            raise _NotReplayable("it launched no kernel")
        self.handed = len(recorder.handed)
        self.first_view = self.handed + len(recorder.allocations)
        self.tensors = [*recorder.handed, *recorder.allocations, *(view for view, _ in recorder.views)]
        self.by_id = {id(tensor): slot for slot, tensor in enumerate(self.tensors) if tensor is not None}
        # The tensors that own memory (handed or allocated) must not share an address: a kernel's pointer is
        # found by it, and two arguments that alias now may not alias at the next call.
        self.by_address = {}
        for slot, tensor in enumerate(self.tensors[:self.first_view]):
            if tensor is None:
                continue
            if tensor.data_ptr() == 0 or tensor.data_ptr() in self.by_address:
                raise _NotReplayable("two of its tensors share an address, or one is empty")
            self.by_address[tensor.data_ptr()] = slot
        device = next(tensor for tensor in self.tensors if tensor is not None).device  # where the C++ op allocates
        self.allocations = []
        for tensor in recorder.allocations:
            if tensor.device != device or tensor.dtype not in _SCALAR_TYPE:
                raise _NotReplayable("it allocates a buffer the C++ op would not allocate alike")
            self.allocations.append([_SCALAR_TYPE[tensor.dtype], int(id(tensor) in recorder.zero_filled), tensor.dim(),
                                     *tensor.shape, *tensor.stride()])
        self.bases = {}  # view slot -> the slot it is a view of
        self.views = []
        for slot, (view, base) in enumerate(recorder.views, self.first_view):
            base_slot = self.whole(base, before=slot)
            base = self.tensors[base_slot]
            if view.dtype != base.dtype or view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
                raise _NotReplayable("it views a tensor as another dtype")
            self.bases[slot] = base_slot
            self.views.append([base_slot, view.storage_offset() - base.storage_offset(), view.dim(), *view.shape,
                               *view.stride()])
            if view.data_ptr() != 0:
                self.by_address.setdefault(view.data_ptr(), slot)
        try:
            self.launches = [_launch_row(kernel, compiled, grid, values, self)
                             for kernel, compiled, grid, values in recorder.launches]
        except (AttributeError, KeyError) as error:  # a Triton whose CompiledKernel reads otherwise
            raise _NotReplayable(f"its compiled kernels do not read as expected ({error!r})") from error

    def rows(self) -> tuple:
        return self.allocations, self.views, self.launches

    def pointer(self, tensor):
        """The slot whose address a kernel parameter ``tensor`` has, or None."""
        slot = self.by_id.get(id(tensor))
        return slot if slot is not None else self.by_address.get(tensor.data_ptr())

    def whole(self, tensor, before=None) -> int:
        """The slot that is exactly ``tensor``: the same object, or the same address, sizes, strides and dtype
        (a saved output unpacked again is a new tensor object), among the slots before ``before``."""
        slot = self.by_id.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if slot is not None and (before is None or slot < before):
            return slot
        if isinstance(tensor, torch.Tensor):
            for slot, candidate in enumerate(self.tensors[:before]):
                if (candidate is not None and candidate.data_ptr() == tensor.data_ptr() and candidate.dtype == tensor.dtype
                        and candidate.shape == tensor.shape and candidate.stride() == tensor.stride()):
                    return slot
        raise _NotReplayable("a tensor it hands on is not a tensor of the pass")

    def owned(self, slot: int) -> bool:
        """Whether ``slot`` is memory the pass allocated, or a view of it (through views of views)."""
        while slot in self.bases:
            slot = self.bases[slot]
        return slot >= self.handed

    def allocated(self, tensor) -> int:
        """The slot of ``tensor``, which must be memory the pass allocated (or a view of it)."""
        slot = self.whole(tensor)
        if not self.owned(slot):
            raise _NotReplayable("a tensor it returns is not a buffer it allocated")
        return slot


def _launch_row(kernel, compiled, grid, values, slots: _Slots) -> list[int]:
    """[CUfunction, grid x, y, z, threads, shared bytes, cooperative, (kind, value) per parameter] of one
    recorded launch, as triton_replay.cpp takes it. cooperative: 1 for a kernel compiled for a cooperative
    grid (``launch.launch_cooperative``), whose programs must all be resident at once."""
    metadata = compiled.metadata
    if (getattr(metadata, "num_ctas", 1) != 1 or getattr(metadata, "launch_pdl", False)
            or getattr(metadata, "tensordesc_meta", None) or getattr(metadata, "profile_scratch_size", 0)):
        raise _NotReplayable(f"{kernel.fn.__name__} needs a launch the C++ op does not make")
    row = [compiled.function, *grid, 32 * metadata.num_warps, metadata.shared,
           int(bool(getattr(metadata, "launch_cooperative_grid", False)))]
    sizes = []
    types = compiled.src.signature
    for parameter, value in zip(kernel.params, values):
        kind = types[parameter.name]
        if kind == "constexpr":
            continue
        if kind.startswith("*"):
            slot = slots.pointer(value) if isinstance(value, torch.Tensor) else None
            if slot is None:
                raise _NotReplayable(f"{kernel.fn.__name__}'s {parameter.name} is not a tensor of the pass")
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
    # Triton's scratch pointers: global scratch (so many bytes a program, for a TMA descriptor built on the
    # device), allocated per launch as Triton's launcher does; null where the kernel asks for none.
    global_scratch = getattr(metadata, "global_scratch_size", 0) * grid[0] * grid[1] * grid[2]
    for index in range(len(scratch)):
        row += [_SCRATCH, global_scratch] if index == 0 and global_scratch else [_BITS64, 0]
    return row


_PTX_ENTRY = re.compile(r"\.entry\s+[\w$]+\s*\((.*?)\)", re.S)
_PTX_PARAMETER = re.compile(r"\.param\s+\.[a-z]+(\d+)")


def _ptx_parameter_sizes(compiled) -> list[int]:
    """Bytes of each parameter of the kernel's entry, as its PTX declares them (``.param .u64 ...``)."""
    entry = _PTX_ENTRY.search(compiled.asm["ptx"])
    return [int(bits) // 8 for bits in _PTX_PARAMETER.findall(entry.group(1))] if entry else []
