"""AdamW in Triton: one optimizer step over every parameter in one launch, as a ``triton_kernels`` op.

What it computes (torch.optim.AdamW's math, amsgrad and maximize off; step t counted from 1)
    p  ← p · (1 − lr·weight_decay)                          decoupled weight decay
    m  ← m + (1 − β1)·(g − m)                                first moment
    v  ← β2·v + (1 − β2)·g²                                  second moment
    p  ← p − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + eps)
    in place on every (p, g, m, v) of the lists, in float32 (float64 for float64 tensors). The bias
    corrections are computed on the host in Python's float64, once per step, as PyTorch does.

The one idea: one launch, each byte once
    A step is memory-bound: a dozen FLOPs per parameter against 4 reads (p, g, m, v) and 3 writes
    (p, m, v): 7 × 4 B × 124M = 3.5 GB per step for GPT-2 small in float32, 1.7 GB in bfloat16, about
    1.2 ms (0.6 ms) at an H100's 3 TB/s. torch.optim.AdamW's single-tensor path makes a pass over
    memory per operation, eight per tensor, each a launch: ~1200 launches for GPT-2's 148 tensors, most
    of them on small tensors (LayerNorm weights of 768 values) whose time is the launch itself; its
    foreach path groups tensors into fewer launches but keeps a pass per operation; its fused path
    does what this file does (CUDA multi-tensor apply, as level 5). Here one program
    updates one chunk of ELEMENTWISE_BLOCK elements of one tensor, and one launch covers all tensors
    of a dtype: each program finds its tensor and chunk in a table built on the host, and the
    tensor's addresses in tables of pointers (int64 addresses the kernel casts to pointers).

Kernel
    ``_adamw_kernel``   per program: (tensor, chunk) from the program table, the four addresses and
                        the size from the address tables; read p, g, m, v once, write p, m, v once

Launch
    The program table and the addresses of p, m and v depend only on those tensors, which keep their
    storage from step to step: they are built once and cached, keyed on the addresses and sizes
    themselves. Gradients may move every step (zero_grad(set_to_none=True) frees them): their address
    table is cached on their addresses too (the allocator often gives the same ones back), and on a
    miss it is one small host-to-device copy, queued without waiting. An optimizer keeps its step as an
    ``AdamWStepPlan``, which checks the four lists once and, at each later step, only what can change.
    The hyperparameters travel as float32 pairs (``launch.split_float``'s halves): float64 tensors
    keep 48 bits of each, where a single float32 would cost the update 29. Every other dtype computes
    in float32 and gets each value's float32 rounding, as PyTorch's does.

Limits
    Contiguous tensors; each gradient and moment matches its parameter in shape, dtype and device.
    float16, bfloat16, float32 and float64 on the GPU, float32 and float64 under the CPU interpreter;
    one launch per dtype present. Zero-element tensors and empty lists are no-ops. A new table's copy
    to the GPU cannot be captured in a CUDA graph. Moments are kept in the parameter's dtype, as
    PyTorch keeps them: in float16, v = (1 − β2)·g² falls below the normal range (6e-5) for gradients
    under ~0.25 and loses digits, and rounds to 0 under ~0.005, where that element's step
    m / (√v + eps) is no longer AdamW's (the math runs in float32, so eps = 1e-8 does not vanish as
    in PyTorch's own float16 step, which divides by zero there). Train float16 models with float32
    parameters and moments.

Check
    python -m pytest tests -k "adamw and triton"
"""

import functools
import math
import operator

import torch
import triton
import triton.language as tl

from .launch import (
    ELEMENT_TYPE,
    ELEMENTWISE_BLOCK,
    cdiv,
    check_contiguous,
    check_many_inputs,
    compute_dtype,
    launch,
    on_device,
    split_float,
)

# --- input checks ---------------------------------------------------------------------------------------

_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")


def _check_adamw_lists(params, grads, exp_avgs, exp_avg_sqs) -> tuple[tuple, set]:
    """Four lists of equal length; each gradient and moment shaped and typed as its parameter. Returns
    every tensor of the four in one tuple, and the set of their dtypes, for the launcher's device check."""
    op = "adamw_step"
    lengths = (len(params), len(grads), len(exp_avgs), len(exp_avg_sqs))
    if len(set(lengths)) != 1:
        raise ValueError(f"{op}: params, grads, exp_avgs and exp_avg_sqs must be lists of equal length, "
                         f"got {', '.join(map(str, lengths))}")
    # Whole lists compared at once, loops in C (map): a step checks ~600 tensors (GPT-2), and a Python
    # loop per tensor costs the host more than the GPU takes for the step.
    dtypes, shapes = list(map(_DTYPE, params)), list(map(_SHAPE, params))
    for name, tensors in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        if list(map(_DTYPE, tensors)) != dtypes or list(map(_SHAPE, tensors)) != shapes:
            _raise_mismatch(op, name, tensors, params)
    every_tensor = (*params, *grads, *exp_avgs, *exp_avg_sqs)
    if not all(map(torch.Tensor.is_contiguous, every_tensor)):
        check_contiguous(op, *every_tensor)  # says which
    return every_tensor, set(dtypes)


def _raise_mismatch(op: str, name: str, tensors, params) -> None:
    for index, (tensor, param) in enumerate(zip(tensors, params)):
        if tensor.dtype != param.dtype:
            raise TypeError(f"{op}: {name}[{index}] is {tensor.dtype} but params[{index}] is {param.dtype}")
        if tensor.shape != param.shape:
            raise ValueError(f"{op}: {name}[{index}] has shape {tuple(tensor.shape)} but params[{index}] "
                             f"has {tuple(param.shape)}")


# --- kernel -----------------------------------------------------------------------------------------------


@triton.jit
def _address(Table, index, ELEMENT: tl.constexpr, ALIGNED: tl.constexpr):
    """Entry ``index`` of an address table as a pointer to ELEMENTs. With ALIGNED, the compiler is told
    the address is a multiple of 16 bytes, which it cannot see in a number read from memory: the hint
    that lets it load and store 16 bytes a thread at once (``_adamw_kernel`` says why that matters).
    The hint goes on the pointer, after the cast: Triton's alignment analysis does not carry a hint on
    the integer through its cast to a pointer (the PTX shows it: with the hint on the integer, every
    bfloat16 was still its own ``ld.global.b16``; on the pointer, eight travel in one ``ld.global.v4``)."""
    pointer = tl.load(Table + index).to(tl.pointer_type(ELEMENT))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _adamw_kernel(Programs, Addresses, GradAddresses, Numels, n_tensors, decay_high, decay_low, one_minus_beta1_high,
                  one_minus_beta1_low, beta2_high, beta2_low, one_minus_beta2_high, one_minus_beta2_low,
                  step_size_high, step_size_low, bias_correction2_sqrt_high, bias_correction2_sqrt_low, eps_high,
                  eps_low, BLOCK: tl.constexpr, ELEMENT: tl.constexpr, COMPUTE: tl.constexpr,
                  ALIGNED: tl.constexpr, VECTOR: tl.constexpr):
    # Which chunk of which tensor: two int32 per program, written on the host.
    tensor = tl.load(Programs + 2 * tl.program_id(0))
    offsets = tl.load(Programs + 2 * tl.program_id(0) + 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # Addresses and sizes come from tables, so the compiler knows nothing of their alignment and would
    # move one element per instruction (2 bytes in bfloat16): 82 % of copy bandwidth on an H100, 72 % on
    # an H200, where the hinted kernel reaches 100 % (profiling/results/h200/README.md). When
    # the launcher has checked that every address is a multiple of 16 bytes and every size a multiple
    # of VECTOR elements (16 bytes' worth), it says so (ALIGNED): each thread's accesses then become
    # 16-byte vectors, and the mask, constant over each VECTOR elements, does not split them.
    numel = tl.load(Numels + tensor)
    if ALIGNED:
        numel = tl.multiple_of(numel, VECTOR)
    mask = offsets < numel
    param_pointer = _address(Addresses, tensor, ELEMENT, ALIGNED) + offsets
    grad_pointer = _address(GradAddresses, tensor, ELEMENT, ALIGNED) + offsets
    exp_avg_pointer = _address(Addresses, n_tensors + tensor, ELEMENT, ALIGNED) + offsets
    exp_avg_sq_pointer = _address(Addresses, 2 * n_tensors + tensor, ELEMENT, ALIGNED) + offsets

    decay = tl.cast(decay_high, COMPUTE) + tl.cast(decay_low, COMPUTE)
    one_minus_beta1 = tl.cast(one_minus_beta1_high, COMPUTE) + tl.cast(one_minus_beta1_low, COMPUTE)
    beta2 = tl.cast(beta2_high, COMPUTE) + tl.cast(beta2_low, COMPUTE)
    one_minus_beta2 = tl.cast(one_minus_beta2_high, COMPUTE) + tl.cast(one_minus_beta2_low, COMPUTE)
    step_size = tl.cast(step_size_high, COMPUTE) + tl.cast(step_size_low, COMPUTE)
    bias_correction2_sqrt = tl.cast(bias_correction2_sqrt_high, COMPUTE) + tl.cast(bias_correction2_sqrt_low, COMPUTE)
    eps = tl.cast(eps_high, COMPUTE) + tl.cast(eps_low, COMPUTE)

    param = tl.load(param_pointer, mask=mask).to(COMPUTE)
    grad = tl.load(grad_pointer, mask=mask).to(COMPUTE)
    exp_avg = tl.load(exp_avg_pointer, mask=mask).to(COMPUTE)
    exp_avg_sq = tl.load(exp_avg_sq_pointer, mask=mask).to(COMPUTE)
    param *= decay
    exp_avg += one_minus_beta1 * (grad - exp_avg)
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad
    param -= step_size * exp_avg / (tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps)
    tl.store(param_pointer, param.to(ELEMENT), mask=mask)
    tl.store(exp_avg_pointer, exp_avg.to(ELEMENT), mask=mask)
    tl.store(exp_avg_sq_pointer, exp_avg_sq.to(ELEMENT), mask=mask)


# --- launcher -----------------------------------------------------------------------------------------------


def launch_adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
                      weight_decay: float, step: int) -> None:
    """The op's step: every list checked, the step planned and launched (tables are cached on addresses)."""
    AdamWStepPlan(params, grads, exp_avgs, exp_avg_sqs, keep=False).launch(
        grads, lr, beta1, beta2, eps, weight_decay, step)


_DATA_PTR, _NUMEL, _IS_CONTIGUOUS = torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.is_contiguous
_GET_DEVICE = torch.Tensor.get_device


class AdamWStepPlan:
    """One optimizer's step over the same tensors, step after step, checked and tabled once.

    ``levels.optimizer`` keeps one per parameter group. Checking a step's ~600 tensors in full costs the
    host more than the GPU takes for the step (0.3 ms of Python on a 2-core CPU, for a 0.42 ms step on an
    H200), and the parameters and moments do not change from step to step. So the plan checks all four
    lists once, and each step ``matches`` checks only what can move: every parameter and moment still at
    its address (the plan holds their storages, so an address seen again is the same allocation, not a
    new tensor the caching allocator put where a freed one was), and the gradients, allocated anew by each
    backward, each contiguous and of its parameter's size, dtype and device. ``launch`` then only reads
    the gradients' addresses. ``keep=False`` (the op's one-off plan) holds nothing."""

    def __init__(self, params, grads, exp_avgs, exp_avg_sqs, keep: bool = True):
        every_tensor, dtypes = _check_adamw_lists(params, grads, exp_avgs, exp_avg_sqs)
        check_many_inputs("adamw_step", every_tensor, dtypes)
        self._held = (*params, *exp_avgs, *exp_avg_sqs)
        self._addresses = tuple(map(_DATA_PTR, self._held))
        self._storages = tuple(map(torch.Tensor.untyped_storage, self._held)) if keep else ()
        self._numels = tuple(map(_NUMEL, params))
        self._dtypes = list(map(_DTYPE, params))
        self._device_index = params[0].get_device() if params else None
        # One launch per dtype: (which tensors, or None for all of them, and their tables).
        n = len(params)
        groups = [(None, dtype) for dtype in dtypes] if len(dtypes) == 1 else [
            ([i for i in range(n) if self._dtypes[i] == dtype], dtype) for dtype in dtypes]
        self._launches = []
        for indices, dtype in groups:
            chosen = range(n) if indices is None else indices
            addresses = tuple(self._addresses[j * n + i] for j in range(3) for i in chosen)
            vector = VECTOR_BYTES // params[chosen[0]].element_size()
            tables = _cached_tables(params[0].device, addresses, tuple(self._numels[i] for i in chosen), vector)
            if tables[0].shape[0]:  # not zero-element tensors only
                self._launches.append((indices, dtype, vector, tables))

    def matches(self, grads: list[torch.Tensor]) -> bool:
        """Whether this step's tensors are the planned ones: the parameters and moments where they were,
        ``grads`` (the parameters' ``.grad``) contiguous, each of its parameter's size, dtype and device."""
        return (tuple(map(_DATA_PTR, self._held)) == self._addresses and tuple(map(_NUMEL, grads)) == self._numels
                and list(map(_DTYPE, grads)) == self._dtypes and all(map(_IS_CONTIGUOUS, grads))
                and (not grads or set(map(_GET_DEVICE, grads)) == {self._device_index}))

    def launch(self, grads, lr, beta1, beta2, eps, weight_decay, step) -> None:
        """The step's launches, one per dtype, for gradients that ``matches`` (or the op's checks) passed."""
        # The order of _adamw_kernel's scalars; the bias corrections in Python's float64.
        hyperparameters = (1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** step),
                           math.sqrt(1 - beta2 ** step), eps)
        for indices, dtype, vector, (programs, addresses, numels, tables_aligned) in self._launches:
            chosen = grads if indices is None else [grads[i] for i in indices]
            grad_addresses, grads_aligned = _cached_grad_addresses(programs.device, tuple(map(_DATA_PTR, chosen)))
            with on_device(chosen[0]):
                launch(_adamw_kernel, (programs.shape[0],), programs, addresses, grad_addresses, numels,
                       len(chosen), *_halves(hyperparameters, dtype), BLOCK=ELEMENTWISE_BLOCK,
                       ELEMENT=ELEMENT_TYPE[dtype], COMPUTE=compute_dtype(dtype),
                       ALIGNED=tables_aligned and grads_aligned, VECTOR=vector, num_warps=4)


VECTOR_BYTES = 16
"""The widest load or store one thread issues (128 bits). Separately allocated tensors start at
multiples of 512 bytes (the caching allocator's rounding); views into one buffer (an FSDP shard, a
slice) may not, and those take the kernel's unhinted path."""


@functools.lru_cache(maxsize=16)
def _cached_tables(device: torch.device, addresses: tuple[int, ...], numels: tuple[int, ...], vector: int):
    """(programs, addresses, numels, aligned) on ``device``: per program its (tensor, chunk) as two int32;
    the addresses of the params, exp_avgs and exp_avg_sqs as a (3, tensors) int64 table; the sizes; and
    whether every address is a multiple of VECTOR_BYTES and every size of ``vector`` elements. Keyed on
    the addresses and sizes, which are all the tables hold: a hit is the same table, whoever owns the
    memory now. A training run uses one entry per parameter group and dtype, built at its first step."""
    chunks = torch.tensor([cdiv(numel, ELEMENTWISE_BLOCK) for numel in numels], dtype=torch.int64)
    tensor_of_program = torch.repeat_interleave(torch.arange(len(numels)), chunks)
    first_program_of_tensor = torch.cumsum(chunks, 0) - chunks
    chunk_of_program = torch.arange(tensor_of_program.numel()) - first_program_of_tensor[tensor_of_program]
    programs = torch.stack((tensor_of_program, chunk_of_program), dim=1).to(torch.int32)
    aligned = _vector_aligned(addresses) and all(n % vector == 0 for n in numels)
    return (programs.to(device, non_blocking=True),
            torch.tensor(addresses, dtype=torch.int64).to(device, non_blocking=True),
            torch.tensor(numels, dtype=torch.int64).to(device, non_blocking=True), aligned)


@functools.lru_cache(maxsize=4)
def _cached_grad_addresses(device: torch.device, addresses: tuple[int, ...]) -> tuple[torch.Tensor, bool]:
    """The gradients' addresses on ``device``, and whether all are multiples of VECTOR_BYTES. Gradients
    freed by zero_grad(set_to_none=True) are allocated anew by every backward, in the same order and
    sizes, so PyTorch's caching allocator often hands out the same addresses again: then this is a
    cache hit, and no copy. On a miss, non_blocking: CUDA stages the small pageable table at once, and
    the host does not wait for the GPU's queue to reach the copy."""
    return torch.tensor(addresses, dtype=torch.int64).to(device, non_blocking=True), _vector_aligned(addresses)


def _vector_aligned(addresses: tuple[int, ...]) -> bool:
    """Whether every address is a multiple of VECTOR_BYTES: where a thread's 16-byte access may start."""
    return all(address % VECTOR_BYTES == 0 for address in addresses)


def _halves(values, dtype: torch.dtype) -> list[float]:
    """Each value as a (high, low) pair of float32s (see the docstring's Launch). Only float64 computes
    with the low halves; the others get 0.0 there and skip the split. split_float's cache is for
    constants: the step size and the bias correction change every step (the learning rate too, under a
    schedule), so they are split by its uncached function."""
    if dtype != torch.float64:
        return [half for value in values for half in (value, 0.0)]
    return [half for value in values for half in split_float.__wrapped__(value)]


# --- registration: op, fake (shape-only) ---------------------------------------------------------------------


@torch.library.custom_op("triton_kernels::adamw_step", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def adamw_step_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float, step: int) -> None:
    launch_adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step)


@adamw_step_op.register_fake
def _adamw_step_fake(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
    _check_adamw_lists(params, grads, exp_avgs, exp_avg_sqs)


# --- what the levels call ------------------------------------------------------------------------------------


def adamw_step(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
               exp_avg_sqs: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step: int) -> None:
    """One AdamW step over all of ``params`` in place (and their moments), ``step`` counted from 1 and
    already incremented, by one launch per dtype. torch.compile sees the registered op."""
    hyperparameters = float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step)
    if torch.compiler.is_compiling():
        adamw_step_op(params, grads, exp_avgs, exp_avg_sqs, *hyperparameters)
        return
    # Eagerly, straight to the launcher: the op's call crosses the dispatcher and its Python wrappers
    # (see __init__.py), and as a mutating op bumps the version counter of each mutated tensor (~450 for
    # GPT-2): host time a step does not need. There is no autograd to skip: a step runs under no_grad.
    launch_adamw_step(params, grads, exp_avgs, exp_avg_sqs, *hyperparameters)
