"""Softmax over one dim, numerically stable, at five levels.

softmax(x)_i = exp(x_i − max x) / Σ_j exp(x_j − max x). Subtracting the row maximum changes nothing
mathematically and keeps exp from overflowing. Level 1 spells it as four passes over memory (max,
subtract-and-exp, sum, divide). A fused kernel reads a row once when it fits in registers; for rows
too long for that, the *online* softmax keeps a running maximum and a running sum rescaled whenever
the maximum grows, so statistics take one pass and the output a second: the idea flash attention
is built on.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .backends import cuda_backend, inductor, liger_ops, torchscript, triton_backend
from .spec import ComponentSpec, default_device_and_dtype, element_count


def softmax_math(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The formula as a PyTorch user writes it: max, subtract and exponentiate, sum, divide."""
    if x.shape[dim] == 0:  # rows of no elements: nothing to normalise (and amax of nothing is undefined)
        return x.clone()
    shifted = x - x.amax(dim=dim, keepdim=True)
    exponentials = torch.exp(shifted)
    return exponentials / exponentials.sum(dim=dim, keepdim=True)


class SoftmaxSpec(ComponentSpec):
    """Softmax along ``dim``.

    y = exp(x − max x) / Σ exp(x − max x),  dx = y · (dy − Σ dy·y)

    Args:
        dim: the dim to normalise over (default the last). Levels 4 and 5 compute over contiguous rows
            and move ``dim`` last first when it is not.

    Shape: any with at least one dim; the output has the input's shape and dtype.
    """

    component = "softmax"

    def __init__(self, dim: int = -1):
        super().__init__(dim=int(dim))
        self.dim = int(dim)

    def check_inputs(self, x: torch.Tensor) -> None:
        super().check_inputs(x)
        dims = x.dim()
        if not -dims <= self.dim < (dims or 1):  # a 0-d tensor has one dim to normalise over, dim 0
            raise ValueError(f"softmax over dim {self.dim} needs an input with more dims, got shape {tuple(x.shape)}")

    def example_inputs(self, shape, dtype=None, device=None) -> tuple[torch.Tensor]:
        dtype, device = default_device_and_dtype(dtype, device)
        # Logits of the size attention produces: wide enough that skipping the max would overflow fp16.
        return (torch.randn(tuple(shape), dtype=dtype, device=device) * 4,)

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        tensor_bytes = element_count(shape) * dtype.itemsize
        # forward: read x, write y. backward: read y and dy, write dx.
        return 2 * tensor_bytes + (3 * tensor_bytes if backward else 0)

    def flops(self, shape, backward=False) -> int:
        # forward: max, subtract, exp, sum, divide; backward: multiply, sum, subtract, multiply
        return (5 + (4 if backward else 0)) * element_count(shape)

    def reference_modules(self, device=None) -> dict[str, nn.Module]:
        references = {"torch.softmax (PyTorch fused)": _PyTorchSoftmax(self.dim)}
        liger = liger_ops(device)
        if liger is not None and self.dim == -1:  # Liger's softmax takes the last dim only
            references["Liger softmax"] = _LigerSoftmax(liger)
        return references


class _PyTorchSoftmax(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.softmax(x, self.dim)


class _LigerSoftmax(nn.Module):
    """Liger-Kernel's Triton softmax over the last dim, as a reference row."""

    def __init__(self, liger):
        super().__init__()
        self.function = liger.LigerSoftmaxFunction

    def forward(self, x):
        return self.function.apply(x)


class SoftmaxNative(SoftmaxSpec):
    """Level 1: four tensor ops, four passes over memory, plus the intermediates they allocate."""

    level = "native"

    def compute(self, x):
        return softmax_math(x, self.dim)


@functools.cache
def _scripted_softmax():
    return torchscript(softmax_math)


class SoftmaxTorchScript(SoftmaxSpec):
    """Level 2: ``torch.jit.script`` of the same math (deprecated upstream; the legacy fuser). Its
    fuser fuses elementwise chains only, so the two reductions stay separate kernels."""

    level = "torchscript"

    def compute(self, x):
        return _scripted_softmax()(x, self.dim)


@functools.cache
def _compiled_softmax():
    return inductor(softmax_math)


class SoftmaxCompiled(SoftmaxSpec):
    """Level 3: ``torch.compile`` of the level-1 math: Inductor emits one kernel per row block, with
    an online-softmax split for rows too long to keep in registers."""

    level = "compile"

    def compute(self, x):
        return _compiled_softmax()(x, self.dim)


class _SoftmaxKernel(SoftmaxSpec):
    """Levels 4 and 5 normalise over the last dim of x as it comes, (..., N): the kernels treat its
    leading dims as rows, so softmax over the last dim costs no view (each a tensor object and an
    autograd node: at decode sizes, microseconds as long as the kernel). Another ``dim`` is moved last
    and copied once, on purpose. ``backend`` is set by each level."""

    def compute(self, x):
        dim = self.dim
        if dim == -1 or dim == x.dim() - 1:
            return self.softmax_last_dim(x.contiguous())  # a non-contiguous x is copied, once
        return self.softmax_last_dim(x.movedim(self.dim, -1).contiguous()).movedim(-1, self.dim)

    def softmax_last_dim(self, x):
        return self.backend().softmax(x)


class SoftmaxTriton(_SoftmaxKernel):
    """Level 4: a one-pass ``@triton.jit`` kernel for rows that fit a block, an online (running max
    and sum) two-pass kernel for longer rows, and a fused backward."""

    level = "triton"
    backend = staticmethod(triton_backend)


class SoftmaxTritonVersion(SoftmaxTriton):
    """An earlier rung of level 4's softmax forward kernel, kept runnable so a lesson can time the climb
    (``triton_kernels.softmax_versions`` says what each version adds): forward only. Version 3 is
    level 4's own kernel."""

    def __init__(self, dim: int = -1, version: int = 3):
        super().__init__(dim)
        self.version = int(version)

    def softmax_last_dim(self, x):
        return self.backend().softmax_forward_version(x, self.version)


def softmax_triton_versions(dim: int = -1) -> dict[str, SoftmaxTritonVersion]:
    """``{"version 1: ...": module, ...}``: every rung of level 4's softmax forward, for
    ``compare_optimization_levels``."""
    from triton_kernels.softmax_versions import SOFTMAX_VERSIONS

    return {f"version {version}: {what}": SoftmaxTritonVersion(dim, version) for version, what in SOFTMAX_VERSIONS.items()}


class SoftmaxCUDA(_SoftmaxKernel):
    """Level 5: CUDA kernels with warp-shuffle reductions and an online pass for long rows, plus
    OpenMP C++ CPU kernels."""

    level = "cuda"
    backend = staticmethod(cuda_backend)


IMPLEMENTATIONS = {
    "native": SoftmaxNative,
    "torchscript": SoftmaxTorchScript,
    "compile": SoftmaxCompiled,
    "triton": SoftmaxTriton,
    "cuda": SoftmaxCUDA,
}
