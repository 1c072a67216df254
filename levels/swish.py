"""Swish: y = x · sigmoid(β·x), elementwise, at five levels.

With β = 1 this is SiLU, the activation of LLaMA's feed-forward. It is the simplest memory-bound
function there is: a handful of FLOPs per element against 2 × element size bytes moved, so every
level is judged by how close it gets to the device's copy bandwidth. Level 1 launches three kernels
(β·x, sigmoid, multiply) and moves the tensor through memory three times; every level above fuses
them into one pass.

On a CPU, at lesson 01's 1 MiB, the byte count loses its grip; lesson 01 keeps the conclusion, the
reasoning is here. Three things set a small CPU call's time besides bytes:

* The arithmetic is not free. Timing level 1's three ops one at a time shows the sigmoid taking
  most of the time: an ``exp`` over 262 144 floats costs a CPU core real arithmetic, each multiply,
  on data that sits in cache, much less. A fused kernel still computes every ``exp``, so fusion can
  save only the two multiplies; the sum of the three ops' times over the sigmoid's bounds its gain
  (under 2×, against the GPU's 3.5×), and ``F.silu`` and level 5 land near that bound.
* Every call has a fixed cost before it touches an element: Python, the module's argument checks,
  dispatch, at level 3 the compiled function's guards and wrapper, with autograd the backward's
  bookkeeping. Timed on a 4-element tensor it is tens of microseconds (level 3's the largest), a
  large share of a call on 1 MiB, so level 3 gains little or nothing over level 1 there.
* Recompute-or-store flips. The fused backwards recompute σ(β·x) from ``x``, which on a GPU saves
  writing ``s`` to HBM and reading it back; on a CPU the second ``exp`` costs about as much as the
  forward's sigmoid, while level 1 reads its saved ``s`` from cache. Against that, level 1's backward
  is five ops, each with its own autograd node, dispatch and fresh output; which of the two weighs
  more, and so whether the fused rows gain more or less with the backward, depends on the CPU.

Past the last-level cache (4096 × 4096, 64 MiB a tensor) a CPU comes closer to the byte count, for
a second reason as well: each level-1 op writes a fresh tensor whose pages the operating system
zeroes on first touch, three times per forward against a fused kernel's once. ``python -m profiling
--component swish --shape 4096 4096 --levels native compile cuda`` measures it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn

from .backends import cuda_backend, inductor, torchscript, triton_backend
from .spec import ComponentSpec, default_device_and_dtype, element_count


def swish_math(x: torch.Tensor, beta: float) -> torch.Tensor:
    """The formula as a PyTorch user writes it: three tensor ops, three kernels."""
    return x * torch.sigmoid(beta * x)


class SwishSpec(ComponentSpec):
    """Swish / SiLU activation.

    y = x · σ(β·x),  dy/dx = σ(β·x) · (1 + β·x · (1 − σ(β·x)))

    Args:
        beta: the slope inside the sigmoid (a fixed constant, not a learned parameter). β = 1 is SiLU.

    Shape: any; the output has the input's shape and dtype.
    """

    component = "swish"

    def __init__(self, beta: float = 1.0):
        super().__init__(beta=float(beta))
        self.beta = float(beta)

    def example_inputs(self, shape: Sequence[int], dtype=None, device=None) -> tuple[torch.Tensor]:
        dtype, device = default_device_and_dtype(dtype, device)
        # Spread over [-6, 6] or so, where the sigmoid actually bends.
        return (torch.randn(tuple(shape), dtype=dtype, device=device) * 3,)

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        tensor_bytes = element_count(shape) * dtype.itemsize
        forward = 2 * tensor_bytes  # read x, write y
        # The backward recomputes σ(β·x) from x rather than storing it: read x and dy, write dx.
        return forward + (3 * tensor_bytes if backward else 0)

    def flops(self, shape, backward=False) -> int:
        # forward: β·x, exp, 1 + e, reciprocal, multiply (counting exp as one operation)
        # backward: the same sigmoid again plus 6 more for the derivative and the chain rule
        per_element = 5 + (11 if backward else 0)
        return per_element * element_count(shape)

    def reference_modules(self, device=None) -> dict[str, nn.Module]:
        # F.silu is PyTorch's fused kernel for β = 1; there is no built-in for other β.
        return {"F.silu (PyTorch fused)": nn.SiLU()} if self.beta == 1.0 else {}


class SwishNative(SwishSpec):
    """Level 1: three tensor ops, each its own kernel and its own trip through memory."""

    level = "native"

    def compute(self, x):
        return swish_math(x, self.beta)


@functools.cache
def _scripted_swish():
    return torchscript(swish_math)


class SwishTorchScript(SwishSpec):
    """Level 2: ``torch.jit.script`` of the same math, fused by TorchScript's legacy fuser.

    TorchScript is deprecated upstream in favour of ``torch.compile``; it is here because its
    profiling executor was PyTorch's first automatic fuser, and seeing what it could (elementwise
    chains on the GPU) and could not do explains why level 3 exists.
    """

    level = "torchscript"

    def compute(self, x):
        return _scripted_swish()(x, self.beta)


@functools.cache
def _compiled_swish():
    return inductor(swish_math)


class SwishCompiled(SwishSpec):
    """Level 3: ``torch.compile`` of the level-1 math; Inductor writes one fused Triton (GPU) or C++ (CPU) kernel."""

    level = "compile"

    def compute(self, x):
        return _compiled_swish()(x, self.beta)


class _SwishKernel(SwishSpec):
    """Levels 4 and 5 call their backend's ``swish`` op (``backend`` is set by each level) on a
    contiguous copy of the input: our kernels index memory linearly."""

    def compute(self, x):
        return self.backend().swish(x.contiguous(), self.beta)


class SwishTriton(_SwishKernel):
    """Level 4: one hand-written ``@triton.jit`` kernel for the forward and one for the backward."""

    level = "triton"
    backend = staticmethod(triton_backend)


class SwishCUDA(_SwishKernel):
    """Level 5: hand-written CUDA kernels with 16-byte loads, plus an OpenMP C++ twin for the CPU."""

    level = "cuda"
    backend = staticmethod(cuda_backend)


class SwishCUDAVersion(SwishCUDA):
    """An earlier rung of level 5's Swish forward kernel, kept runnable so a lesson can time the climb
    (``cuda_kernels.ops.SWISH_VERSIONS`` says what each version adds): forward only, CUDA tensors only.
    Version 3 is level 5's own kernel."""

    def __init__(self, beta: float = 1.0, version: int = 3):
        super().__init__(beta)
        self.version = int(version)

    def compute(self, x):
        return self.backend().swish_version(x.contiguous(), self.beta, self.version)


def swish_cuda_versions(beta: float = 1.0) -> dict[str, SwishCUDAVersion]:
    """``{"version 1: ...": module, ...}``: every rung of level 5's Swish, for ``compare_optimization_levels``."""
    from cuda_kernels.limits import SWISH_VERSIONS

    return {f"version {version}: {what}": SwishCUDAVersion(beta, version) for version, what in SWISH_VERSIONS.items()}


IMPLEMENTATIONS = {
    "native": SwishNative,
    "torchscript": SwishTorchScript,
    "compile": SwishCompiled,
    "triton": SwishTriton,
    "cuda": SwishCUDA,
}
