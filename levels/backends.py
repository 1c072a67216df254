"""Lazy loading of levels 4 and 5, so that ``import levels`` stays light and the error says what to do."""

from __future__ import annotations

import functools
import importlib
import importlib.util

from .spec import LevelUnavailableError


# Cached: levels call these on every forward, and at GPU speeds even an import lookup shows up.
@functools.cache
def triton_backend():
    """``triton_kernels``: importing it registers the ``torch.ops.triton_kernels`` ops."""
    try:
        return importlib.import_module("triton_kernels")
    except ImportError as error:
        raise LevelUnavailableError(
            "level 4 needs Triton (Linux: `pip install triton`; it ships with CUDA builds of PyTorch). "
            f"Import failed: {error}"
        ) from error


@functools.cache
def cuda_backend():
    """``cuda_kernels.ops``: importing it builds (first time only) and loads the extension's ops."""
    return importlib.import_module("cuda_kernels.ops")


def liger_ops(device=None):
    """Liger-Kernel's Triton ops (``liger_kernel.ops``), the peer whose LayerNorm, RMSNorm and softmax
    stand as extra reference rows on a GPU; None where it is not installed (it is optional, never
    required) or ``device`` is not a GPU (its kernels are not meant for Triton's CPU interpreter)."""
    import torch

    if device is None or torch.device(device).type != "cuda" or importlib.util.find_spec("liger_kernel") is None:
        return None
    return importlib.import_module("liger_kernel.ops")


# The legacy fuser's deprecation notice, exactly as PyTorch words it. Level 2 exists to teach that
# fuser, so we silence this one warning (and nothing else) where we script.
TORCHSCRIPT_DEPRECATION = r"`torch\.jit\.script` is deprecated\. Please switch to `torch\.compile` or `torch\.export`\."


def torchscript(function):
    """``torch.jit.script(function)`` with exactly the deprecation warning filtered (see above)."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHSCRIPT_DEPRECATION, category=DeprecationWarning)
        return torch.jit.script(function)


def inductor(function):
    """``torch.compile(function)`` with the default (Inductor) backend; compiled lazily on first call."""
    import torch

    return torch.compile(function)


def linear(level: str, x, weight, bias=None):
    """``x @ weightᵀ + bias`` over the last dim of ``x``, computed the way ``level`` computes matmuls.

    Levels 1-3 call ``F.linear`` (cuBLAS on the GPU; Inductor lowers a lone linear to the same call,
    so compiling it alone would only add guards). Levels 4 and 5 call their own ``linear`` op: the
    Triton matmul at level 4, on the (tokens, features) matrix; cuBLAS through ATen with our
    bias-gradient kernel at level 5, whose op takes x as it comes and makes that matrix itself, below
    autograd (the two views around the call were two autograd nodes a projection).
    """
    import torch.nn.functional as F

    if level in ("native", "torchscript", "compile"):
        return F.linear(x, weight, bias)
    if level == "cuda":
        return cuda_backend().linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return triton_backend().linear(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
