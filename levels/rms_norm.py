"""RMSNorm over the trailing ``normalized_shape`` dims, with an affine weight and no bias, at five levels.

LayerNorm without the mean (Zhang & Sennrich, 2019): each row is divided by its root mean square, so
a row needs one reduction instead of two, and the output no bias. Llama, Mistral and most models since
use it. The levels mirror LayerNorm's (``layer_norm.py``), and so do the kernels: levels 4 and 5 run
LayerNorm's kernels with the mean and the bias switched off at compile time (a constexpr flag in
Triton, a template parameter in CUDA and C++), so the lesson is what disappears, not a second copy.
"""

from __future__ import annotations

import functools
from typing import List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .backends import cuda_backend, inductor, torchscript, triton_backend
from .layer_norm import NormalizationSpec, normalize_rows
from .spec import element_count


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, normalized_ndim: int, eps: float) -> torch.Tensor:
    """The formula as a PyTorch user writes it: mean square, reciprocal square root, scale."""
    dims: List[int] = [-(i + 1) for i in range(normalized_ndim)]
    mean_square = (x * x).mean(dim=dims, keepdim=True)
    return x * torch.rsqrt(mean_square + eps) * weight


class RMSNormSpec(NormalizationSpec):
    """Root-mean-square normalisation, as ``nn.RMSNorm(normalized_shape, eps, elementwise_affine=True)``.

    y = x / sqrt(mean(x²) + eps) · weight, with the mean of squares taken over the trailing
    ``normalized_shape`` dims of x. No mean is subtracted and there is no bias.

    Args:
        normalized_shape: an int or a tuple: the trailing dims to normalise over. Their product (the
            row length N) may be anything from 1 to millions of elements.
        eps: added to the mean square before the square root, so a row of zeros does not divide by 0.
            (nn.RMSNorm's default, None, means the dtype's machine epsilon; ours is a fixed 1e-6.)

    Parameters: ``weight`` (ones), of shape ``normalized_shape``.
    """

    component = "rms_norm"
    title = "RMSNorm"

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-6):
        super().__init__(normalized_shape, eps)

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        elements = element_count(shape)
        rows, row_length = self.rows_and_row_length(shape)
        item = dtype.itemsize
        statistics = rows * 4  # the reciprocal RMS, float32, written forward, read backward
        forward_bytes = 2 * elements * item + row_length * item + statistics  # x, y, weight, rstd
        backward_bytes = 3 * elements * item + 2 * row_length * item + statistics  # x, dy, dx, weight, dweight
        return forward_bytes + (backward_bytes if backward else 0)

    def flops(self, shape, backward=False) -> int:
        # forward per element: square, sum, multiply by 1/rms, scale (4)
        # backward per element: x̂ (1), dy·w (1), one row sum of x̂·g (2), dx (3), the dweight sum (2)
        per_element = 4 + (9 if backward else 0)
        return per_element * element_count(shape)

    def pytorch_reference(self) -> tuple[str, nn.Module]:
        return "F.rms_norm (PyTorch)", _PyTorchRMSNorm(self)

    def liger_reference(self, liger) -> tuple[str, nn.Module]:
        return "Liger RMSNorm", _LigerRMSNorm(self, liger)


class _LigerRMSNorm(nn.Module):
    """Liger-Kernel's Triton RMSNorm on the spec's own parameters, as a reference row: its "gemma"
    casting (every step in float32, as our kernels compute), and not in place (its default overwrites
    the incoming gradient, which a timed loop reuses)."""

    def __init__(self, spec: RMSNormSpec, liger):
        super().__init__()
        self.spec, self.function = spec, liger.LigerRMSNormFunction

    def forward(self, x):
        return self.function.apply(x, self.spec.weight, self.spec.eps, 0.0, "gemma", False)


class _PyTorchRMSNorm(nn.Module):
    """``F.rms_norm`` on the spec's own parameters: PyTorch's own RMSNorm, as a reference row."""

    def __init__(self, spec: RMSNormSpec):
        super().__init__()
        self.spec = spec

    def forward(self, x):
        return F.rms_norm(x, self.spec.normalized_shape, self.spec.weight, self.spec.eps)


class RMSNormNative(RMSNormSpec):
    """Level 1: six tensor ops (square, mean, add eps, rsqrt, two multiplies), each a pass over memory."""

    level = "native"

    def compute(self, x):
        return rms_norm_math(x, self.weight, len(self.normalized_shape), self.eps)


@functools.cache
def _scripted_rms_norm():
    return torchscript(rms_norm_math)


class RMSNormTorchScript(RMSNormSpec):
    """Level 2: ``torch.jit.script`` of the same math (the legacy fuser, deprecated upstream): it fuses
    the elementwise tail but leaves the reduction as a kernel of its own."""

    level = "torchscript"

    def compute(self, x):
        return _scripted_rms_norm()(x, self.weight, len(self.normalized_shape), self.eps)


@functools.cache
def _compiled_rms_norm():
    return inductor(rms_norm_math)


class RMSNormCompiled(RMSNormSpec):
    """Level 3: ``torch.compile`` of the level-1 math; Inductor fuses the reduction and the pointwise
    work into one kernel per row block, forward and backward."""

    level = "compile"

    def compute(self, x):
        return _compiled_rms_norm()(x, self.weight, len(self.normalized_shape), self.eps)


class _RMSNormKernel(RMSNormSpec):
    """Levels 4 and 5 (see ``layer_norm.normalize_rows``); ``backend`` is set by each level."""

    def compute(self, x):
        return normalize_rows(self.backend().rms_norm, x, self.normalized_shape, (self.weight,), self.eps)


class RMSNormTriton(_RMSNormKernel):
    """Level 4: LayerNorm's ``@triton.jit`` kernels compiled without the mean and the bias: a fused
    forward, a fused input-gradient pass writing per-program partial weight gradients, and the column
    reduction that finishes them."""

    level = "triton"
    backend = staticmethod(triton_backend)


class RMSNormCUDA(_RMSNormKernel):
    """Level 5: LayerNorm's CUDA kernels and OpenMP C++ CPU kernels, instantiated without the mean and the bias."""

    level = "cuda"
    backend = staticmethod(cuda_backend)


IMPLEMENTATIONS = {
    "native": RMSNormNative,
    "torchscript": RMSNormTorchScript,
    "compile": RMSNormCompiled,
    "triton": RMSNormTriton,
    "cuda": RMSNormCUDA,
}
