"""The eager door of every level-4 op: the ``torch.autograd.Function`` its package function calls when a
gradient is wanted and torch.compile is not tracing (``triton_kernels/__init__.py`` says why there are two
doors). Autograd's C++ engine runs the graph either way; what this module trims is the Python each call
pays around it, which at decode sizes is most of a call (profiling/results/host_path.md)."""

import functools

import torch

_FUNCTION_APPLY_IN_CPP = torch._C._FunctionBase.__dict__["apply"]  # where Function.apply ends up
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


class EagerFunction(torch.autograd.Function):
    """The ``torch.autograd.Function`` behind each level-4 op's eager call (see ``__init__.py``), with the
    same meaning and less Python per call. ``Function.apply`` asks whether ``setup_context`` is defined (it
    is not, here), and maps a pytree over the arguments to unwrap dead functorch wrappers, before it calls
    autograd's C++ ``apply``. This ``apply`` unwraps the tensors in one comprehension and calls the C++
    ``apply`` itself. Under a functorch transform (vmap, grad, ...) it takes ``Function.apply``'s path."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._apply_in_cpp = _FUNCTION_APPLY_IN_CPP.__get__(None, cls)

    @classmethod
    def apply(cls, *args):
        if _functorch_transforms_active():
            return super().apply(*args)
        return cls._apply_in_cpp(*[_unwrap_if_dead(arg) if isinstance(arg, torch.Tensor) else arg for arg in args])


def first_order_only(backward):
    """``torch.autograd.function.once_differentiable`` for an ``EagerFunction``'s backward, minus its cost
    on the usual path. A plain ``.backward()`` runs the backward with grad mode off: nothing records a
    graph, so the backward runs as it is. Grad mode is on only under ``create_graph=True``; then
    ``once_differentiable`` itself runs it, and a second derivative raises instead of coming out silently
    as zero. (It would wrap every call in ``torch.no_grad()``: a Python context manager, entered and
    left per backward.)"""
    guarded = torch.autograd.function.once_differentiable(backward)

    @functools.wraps(backward)
    def first_order(ctx, *grads):
        if torch.is_grad_enabled():
            return guarded(ctx, *grads)
        return backward(ctx, *grads)

    return first_order
