"""LayerNorm over the trailing ``normalized_shape`` dims, with affine weight and bias, at five levels.

A row reduction: each row of N elements needs its mean and variance before any output can be
written. Level 1 spells that as five tensor ops (mean, centre, variance, normalise, scale-and-shift),
each a pass over memory. A fused kernel reads a row once into registers (or loops over it in blocks
when it is too long), reduces, and writes the output once. The backward pass is the harder lesson:
the input gradient is again a per-row reduction, but the weight and bias gradients are reductions
*across* rows, which a kernel must split between programs and finish in a second, small pass.

RMSNorm (``rms_norm.py``) is LayerNorm without the mean and the bias: it shares this file's
``NormalizationSpec`` and ``normalize_rows``, and LayerNorm's kernels at levels 4 and 5.
"""

from __future__ import annotations

import functools
from typing import ClassVar, List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .backends import cuda_backend, inductor, liger_ops, torchscript, triton_backend
from .spec import ComponentSpec, default_device_and_dtype, element_count


def layer_norm_math(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, normalized_ndim: int,
                    eps: float) -> torch.Tensor:
    """The formula as a PyTorch user writes it: mean, centre, variance, normalise, scale and shift."""
    dims: List[int] = [-(i + 1) for i in range(normalized_ndim)]
    mean = x.mean(dim=dims, keepdim=True)
    centered = x - mean
    variance = (centered * centered).mean(dim=dims, keepdim=True)
    return centered / torch.sqrt(variance + eps) * weight + bias


class NormalizationSpec(ComponentSpec):
    """What LayerNorm and RMSNorm share: a ``normalized_shape`` of trailing dims, a ``weight`` of that
    shape (ones), ``eps``, the input checks and the example inputs. Each subclass adds its formula,
    its other parameters and its cost model."""

    title: ClassVar[str] = ""  # the name errors use

    def __init__(self, normalized_shape: int | Sequence[int], eps: float):
        shape = (int(normalized_shape),) if isinstance(normalized_shape, int) else tuple(int(s) for s in normalized_shape)
        if not shape or any(s <= 0 for s in shape):
            raise ValueError(f"normalized_shape must be a positive int or a tuple of positive ints, got {normalized_shape!r}")
        super().__init__(normalized_shape=shape, eps=float(eps))
        self.normalized_shape = shape
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(shape))

    def check_inputs(self, x: torch.Tensor) -> None:
        super().check_inputs(x)
        trailing = tuple(x.shape[x.dim() - len(self.normalized_shape):]) if x.dim() >= len(self.normalized_shape) else tuple(x.shape)
        if trailing != self.normalized_shape:
            raise ValueError(
                f"{self.title} expects an input whose trailing dims are normalized_shape={self.normalized_shape}, "
                f"got input of shape {tuple(x.shape)}"
            )

    @classmethod
    def config_for_shape(cls, input_shape):
        return {"normalized_shape": int(input_shape[-1])}

    def example_inputs(self, shape, dtype=None, device=None) -> tuple[torch.Tensor]:
        dtype, device = default_device_and_dtype(dtype, device)
        # An offset and a scale that are not (0, 1), so a kernel that forgets to centre or scale fails.
        return (torch.randn(tuple(shape), dtype=dtype, device=device) * 2 + 0.5,)

    def reference_modules(self, device=None) -> dict[str, nn.Module]:
        """PyTorch's own kernel (``pytorch_reference``), and Liger-Kernel's (``liger_reference``) where it
        is installed and ``device`` is a GPU; Liger normalises the last dim only."""
        references = dict([self.pytorch_reference()])
        liger = liger_ops(device)
        if liger is not None and len(self.normalized_shape) == 1:
            references.update([self.liger_reference(liger)])
        return references

    def rows_and_row_length(self, shape) -> tuple[int, int]:
        row_length = element_count(self.normalized_shape)
        return element_count(shape) // row_length, row_length


class LayerNormSpec(NormalizationSpec):
    """Layer normalisation (Ba et al., 2016), as ``nn.LayerNorm`` with ``elementwise_affine=True``.

    y = (x − mean) / sqrt(var + eps) · weight + bias, with mean and the biased variance taken over the
    trailing ``normalized_shape`` dims of x.

    Args:
        normalized_shape: an int or a tuple: the trailing dims to normalise over. Their product (the
            row length N) may be anything from 1 to millions of elements.
        eps: added to the variance before the square root, so a constant row does not divide by 0.

    Parameters: ``weight`` (ones) and ``bias`` (zeros), both of shape ``normalized_shape``.
    """

    component = "layer_norm"
    title = "LayerNorm"

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5):
        super().__init__(normalized_shape, eps)
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape))

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        elements = element_count(shape)
        rows, row_length = self.rows_and_row_length(shape)
        item = dtype.itemsize
        statistics = 2 * rows * 4  # mean and reciprocal std, float32, written forward, read backward
        forward_bytes = 2 * elements * item + 2 * row_length * item + statistics  # x, y, weight, bias, stats
        backward_bytes = 3 * elements * item + 3 * row_length * item + statistics  # x, dy, dx, weight, dweight, dbias
        return forward_bytes + (backward_bytes if backward else 0)

    def flops(self, shape, backward=False) -> int:
        # forward per element: sum, subtract, square, sum, multiply by 1/std, scale, shift (~7)
        # backward per element: recompute x̂ (2), dy·w (1), two row sums (2), dx (4), dweight and dbias sums (3)
        per_element = 7 + (12 if backward else 0)
        return per_element * element_count(shape)

    def pytorch_reference(self) -> tuple[str, nn.Module]:
        return "F.layer_norm (PyTorch fused)", _PyTorchFusedLayerNorm(self)

    def liger_reference(self, liger) -> tuple[str, nn.Module]:
        return "Liger LayerNorm", _LigerLayerNorm(self, liger)


class _LigerLayerNorm(nn.Module):
    """Liger-Kernel's Triton LayerNorm on the spec's own parameters, as a reference row."""

    def __init__(self, spec: LayerNormSpec, liger):
        super().__init__()
        self.spec, self.function = spec, liger.LigerLayerNormFunction

    def forward(self, x):
        return self.function.apply(x, self.spec.weight, self.spec.bias, self.spec.eps)


class _PyTorchFusedLayerNorm(nn.Module):
    """``F.layer_norm`` on the spec's own parameters: the vendor kernel, as a reference row."""

    def __init__(self, spec: LayerNormSpec):
        super().__init__()
        self.spec = spec

    def forward(self, x):
        return F.layer_norm(x, self.spec.normalized_shape, self.spec.weight, self.spec.bias, self.spec.eps)


class LayerNormNative(LayerNormSpec):
    """Level 1: five tensor ops; each reads and writes a full tensor, and the reductions run twice."""

    level = "native"

    def compute(self, x):
        return layer_norm_math(x, self.weight, self.bias, len(self.normalized_shape), self.eps)


@functools.cache
def _scripted_layer_norm():
    return torchscript(layer_norm_math)


class LayerNormTorchScript(LayerNormSpec):
    """Level 2: ``torch.jit.script`` of the same math (TorchScript is deprecated upstream; this is the
    legacy fuser). It fuses the elementwise tail (normalise, scale, shift) on the GPU but leaves the
    reductions as separate kernels: fusing across a reduction was beyond it."""

    level = "torchscript"

    def compute(self, x):
        return _scripted_layer_norm()(x, self.weight, self.bias, len(self.normalized_shape), self.eps)


@functools.cache
def _compiled_layer_norm():
    return inductor(layer_norm_math)


class LayerNormCompiled(LayerNormSpec):
    """Level 3: ``torch.compile`` of the level-1 math; Inductor fuses reductions and pointwise work
    into one persistent-reduction kernel per row block, forward and backward."""

    level = "compile"

    def compute(self, x):
        return _compiled_layer_norm()(x, self.weight, self.bias, len(self.normalized_shape), self.eps)


def normalize_rows(function, x: torch.Tensor, normalized_shape: tuple[int, ...], parameters, eps: float):
    """Levels 4 and 5 of LayerNorm and RMSNorm: ``function(x, *parameters, eps)`` is a kernel op that
    normalises over the last dim of x as it comes, (..., N), treating its leading dims as rows, so
    the usual one-dim ``normalized_shape`` costs no view of x, the parameters or the output (each a
    tensor object and an autograd node: at decode sizes, microseconds as long as the kernel). A
    ``normalized_shape`` of several dims is flattened into one row of N."""
    x = x.contiguous()  # the kernels index rows linearly: a non-contiguous x is copied, once
    if len(normalized_shape) == 1:
        return function(x, *parameters, eps)
    row_length = parameters[0].numel()
    out = function(x.view(-1, row_length), *(p.view(row_length) for p in parameters), eps)
    return out.view(x.shape)


class _LayerNormKernel(LayerNormSpec):
    """Levels 4 and 5 (see ``normalize_rows``); ``backend`` is set by each level."""

    def compute(self, x):
        return normalize_rows(self.backend().layer_norm, x, self.normalized_shape, (self.weight, self.bias), self.eps)


class LayerNormTriton(_LayerNormKernel):
    """Level 4: ``@triton.jit`` kernels: a fused forward, a fused input-gradient pass that also writes
    per-program partial weight/bias gradients, and a column reduction that finishes them."""

    level = "triton"
    backend = staticmethod(triton_backend)


class LayerNormTritonVersion(LayerNormTriton):
    """An earlier rung of level 4's LayerNorm forward kernel, kept runnable so a lesson can time the climb
    (``triton_kernels.layer_norm_versions`` says what each version adds): forward only. Version 3 is
    level 4's own kernel."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, version: int = 3):
        super().__init__(normalized_shape, eps)
        self.version = int(version)

    def compute(self, x):
        return normalize_rows(self._forward_version, x, self.normalized_shape, (self.weight, self.bias), self.eps)

    def _forward_version(self, x, weight, bias, eps):
        return self.backend().layer_norm_forward_version(x, weight, bias, eps, self.version)


def layer_norm_triton_versions(normalized_shape: int | Sequence[int], eps: float = 1e-5) -> dict[str, LayerNormTritonVersion]:
    """``{"version 1: ...": module, ...}``: every rung of level 4's LayerNorm forward, for
    ``compare_optimization_levels``."""
    from triton_kernels.layer_norm_versions import LAYER_NORM_VERSIONS

    return {f"version {version}: {what}": LayerNormTritonVersion(normalized_shape, eps, version)
            for version, what in LAYER_NORM_VERSIONS.items()}


class LayerNormCUDA(_LayerNormKernel):
    """Level 5: CUDA kernels with 16-byte loads and warp-shuffle reductions, plus OpenMP C++ CPU kernels."""

    level = "cuda"
    backend = staticmethod(cuda_backend)


IMPLEMENTATIONS = {
    "native": LayerNormNative,
    "torchscript": LayerNormTorchScript,
    "compile": LayerNormCompiled,
    "triton": LayerNormTriton,
    "cuda": LayerNormCUDA,
}
