"""The eager door of every level-4 op: the ``torch.autograd.Function`` its package function calls when a
gradient is wanted and torch.compile is not tracing (``triton_kernels/__init__.py`` says why there are two
doors). Autograd's C++ engine runs the graph either way; what this module trims is the Python each call
pays around it, which at decode sizes is most of a call (profiling/results/host_path.md)."""

import itertools

import torch
from torch.autograd import forward_ad

from . import replay
from .launch import SignatureTable

_FUNCTION_APPLY_IN_CPP = torch._C._FunctionBase.__dict__["apply"]  # where Function.apply ends up
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_grad_enabled = torch.is_grad_enabled
_FUNCTION_NUMBERS = itertools.count()


def refuse_tangents(op: str, *tensors) -> None:
    """Raise for inputs that carry a forward-mode tangent (torch.func.jvp, torch.autograd.forward_ad): our
    kernels have no forward-mode formula, and an output without its tangent would be a silently wrong
    answer. Only inside a dual level can a tensor have one, so every ordinary call reads one module global
    and goes on."""
    if forward_ad._current_level < 0:
        return
    if any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(f"triton_kernels.{op}: forward-mode AD is not implemented (an input has a tangent); "
                                  "use reverse mode")


def first_order_only(backward, plans: SignatureTable):
    """``torch.autograd.function.once_differentiable`` for an ``EagerFunction``'s backward, minus its cost
    on the usual path; ``EagerFunction`` (below) makes it the ``apply`` of its graph nodes. A plain
    ``.backward()`` runs the backward with grad mode off: nothing records a graph, so the backward runs
    as it is. Grad mode is on only under ``create_graph=True``; then ``once_differentiable`` itself runs
    it, and a second derivative raises instead of coming out silently as zero. (It would wrap every call
    in ``torch.no_grad()``: a Python context manager, entered and left per backward.)

    The first backward of a recorded forward is recorded too, for ``plans`` (``replay``: the signature's
    later calls are then C++)."""
    guarded = torch.autograd.function.once_differentiable(backward)

    def first_order(ctx, *grads):
        if _grad_enabled():
            return guarded(ctx, *grads)
        pending = getattr(ctx, "pending", None)
        if pending is not None and plans.get(pending.signature) is pending:
            return replay.record_backward(backward, ctx, grads, plans)
        return backward(ctx, *grads)

    return first_order


class _EagerFunctionMeta(torch.autograd.function.FunctionMeta):
    # FunctionMeta makes each Function's class of graph nodes (``_backward_cls``) once the class body has
    # run, so a metaclass of our own is where each Function's nodes get their ``apply`` as it is defined.
    def __init__(cls, name, bases, attrs):
        super().__init__(name, bases, attrs)
        cls._apply_in_cpp = _FUNCTION_APPLY_IN_CPP.__get__(None, cls)
        cls._replay_plans = SignatureTable()  # signature -> replay.Plan, Pending or Refused
        cls._replay_number = next(_FUNCTION_NUMBERS)  # the C++ op's name for this Function's calls
        cls._backward_cls.apply = first_order_only(cls.backward, cls._replay_plans)


class EagerFunction(torch.autograd.Function, metaclass=_EagerFunctionMeta):
    """The ``torch.autograd.Function`` behind each level-4 op's eager call (see ``__init__.py``), with the
    same meaning and less Python per call, forward and backward. Package functions call
    ``call(tensors, numbers)``: the op's tensor arguments (None for an absent one), then its numbers, which
    its ``forward`` takes in that order.

    Forward: ``Function.apply`` asks whether ``setup_context`` is defined (it is not, here), and maps a
    pytree over the arguments to unwrap dead functorch wrappers, before it calls autograd's C++ ``apply``.
    ``call`` unwraps the tensors in one comprehension and calls the C++ ``apply`` itself. Under a
    functorch transform (vmap, grad, ...) it takes ``Function.apply``'s path.

    Backward: the engine calls the graph node's ``apply``, which in PyTorch is Python that looks up
    ``backward`` and ``vjp`` on the Function (to refuse a class that defines both) and whether it wants
    its gradients boxed, on every call, before it calls ``backward``. Here each node's ``apply`` is
    ``first_order_only(backward)``, made once when the Function is defined: subclasses define
    ``backward`` (never ``vjp``), and it is first-order only.

    On a GPU, a signature whose first forward and backward were recorded replayable (``replay``) skips
    all of this: its later calls are one C++ op, which finds the call's plan itself, and their backward a
    C++ node."""

    @classmethod
    def call(cls, tensors: tuple, numbers: tuple = ()):
        if _functorch_transforms_active():
            return cls.apply(*tensors, *numbers)
        if replay.REPLAY:
            known = replay.run_known(cls._replay_number, tensors, numbers)
            if known is not None:
                return known
        tensors = [_unwrap_if_dead(tensor) if tensor is not None else None for tensor in tensors]
        if not replay.REPLAY:
            return cls._apply_in_cpp(*tensors, *numbers)
        args = (*tensors, *numbers)
        signature = replay.signature(args)
        plan = cls._replay_plans.get(signature)
        if plan.__class__ is replay.Plan:
            return replay.run(cls._replay_number, tensors, numbers, plan)
        if plan is None:
            return replay.record_forward(cls, args, signature, cls._replay_plans)
        if plan.__class__ is replay.Pending:
            return replay.await_backward(cls, args, plan)
        return cls._apply_in_cpp(*args)  # replay.Refused
