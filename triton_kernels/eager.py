"""The eager door of every level-4 op: the ``torch.autograd.Function`` its package function calls when a
gradient is wanted and torch.compile is not tracing (``triton_kernels/__init__.py`` says why there are two
doors). Autograd's C++ engine runs the graph either way; what this module trims is the Python each call
pays around it, which at decode sizes is most of a call (profiling/results/host_path.md)."""

import torch

_FUNCTION_APPLY_IN_CPP = torch._C._FunctionBase.__dict__["apply"]  # where Function.apply ends up
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_grad_enabled = torch.is_grad_enabled


def first_order_only(backward):
    """``torch.autograd.function.once_differentiable`` for an ``EagerFunction``'s backward, minus its cost
    on the usual path; ``EagerFunction`` (below) makes it the ``apply`` of its graph nodes. A plain
    ``.backward()`` runs the backward with grad mode off: nothing records a graph, so the backward runs
    as it is. Grad mode is on only under ``create_graph=True``; then ``once_differentiable`` itself runs
    it, and a second derivative raises instead of coming out silently as zero. (It would wrap every call
    in ``torch.no_grad()``: a Python context manager, entered and left per backward.)"""
    guarded = torch.autograd.function.once_differentiable(backward)

    def first_order(ctx, *grads):
        if _grad_enabled():
            return guarded(ctx, *grads)
        return backward(ctx, *grads)

    return first_order


class _EagerFunctionMeta(torch.autograd.function.FunctionMeta):
    # FunctionMeta makes each Function's class of graph nodes (``_backward_cls``) once the class body has
    # run, so a metaclass of our own is where each Function's nodes get their ``apply`` as it is defined.
    def __init__(cls, name, bases, attrs):
        super().__init__(name, bases, attrs)
        cls._apply_in_cpp = _FUNCTION_APPLY_IN_CPP.__get__(None, cls)
        cls._backward_cls.apply = first_order_only(cls.backward)


class EagerFunction(torch.autograd.Function, metaclass=_EagerFunctionMeta):
    """The ``torch.autograd.Function`` behind each level-4 op's eager call (see ``__init__.py``), with the
    same meaning and less Python per call, forward and backward.

    Forward: ``Function.apply`` asks whether ``setup_context`` is defined (it is not, here), and maps a
    pytree over the arguments to unwrap dead functorch wrappers, before it calls autograd's C++ ``apply``.
    This ``apply`` unwraps the tensors in one comprehension and calls the C++ ``apply`` itself. Under a
    functorch transform (vmap, grad, ...) it takes ``Function.apply``'s path.

    Backward: the engine calls the graph node's ``apply``, which in PyTorch is Python that looks up
    ``backward`` and ``vjp`` on the Function (to refuse a class that defines both) and whether it wants
    its gradients boxed, on every call, before it calls ``backward``. Here each node's ``apply`` is
    ``first_order_only(backward)``, made once when the Function is defined: subclasses define
    ``backward`` (never ``vjp``), and it is first-order only."""

    @classmethod
    def apply(cls, *args):
        if _functorch_transforms_active():
            return super().apply(*args)
        return cls._apply_in_cpp(*[_unwrap_if_dead(arg) if isinstance(arg, torch.Tensor) else arg for arg in args])
