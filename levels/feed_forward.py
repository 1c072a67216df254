"""GPT-2's feed-forward block: Linear → GELU (tanh approximation) → Linear, at five levels.

Two matmuls carry almost all of the FLOPs; what separates the levels is the elementwise work between
them. Written as a PyTorch user writes it, the bias add and the GELU are eight more kernels, each
reading and writing the (tokens, 4·n_embd) hidden activation: at GPT-2-small size (8192 tokens × 3072,
bfloat16, 50 MB a pass) that is more memory traffic than the matmuls' own operands. TorchScript and
Inductor fuse the eight into one pass; levels 4 and 5 go further and do the bias and the GELU while the
matmul's output tile is still in registers (the *epilogue*), so the hidden activation is written once,
and the backward multiplies by GELU's derivative in the epilogue of the matmul that makes its gradient.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .backends import cuda_backend, inductor, torchscript, triton_backend
from .spec import ComponentSpec, default_device_and_dtype, element_count


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation, spelled out as GPT-2's own code did: six elementwise kernels in eager mode."""
    return 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h * h * h)))


def feed_forward_math(x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: Optional[torch.Tensor],
                      proj_weight: torch.Tensor, proj_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The formula as a PyTorch user writes it: matmul, bias, GELU, matmul, bias."""
    hidden = torch.matmul(x, fc_weight.t())
    if fc_bias is not None:
        hidden = hidden + fc_bias
    out = torch.matmul(gelu_tanh(hidden), proj_weight.t())
    if proj_bias is not None:
        out = out + proj_bias
    return out


class FeedForwardSpec(ComponentSpec):
    """The multilayer perceptron of a GPT-2 block.

    y = GELU_tanh(x·W_fcᵀ + b_fc)·W_projᵀ + b_proj,  GELU_tanh(h) = ½·h·(1 + tanh(√(2/π)·(h + 0.044715·h³)))

    Args:
        n_embd: width of the input and output (the model's embedding size).
        hidden: width of the hidden layer; default 4 · n_embd, as in GPT-2.
        bias: whether both linear layers have a bias.

    Parameters: ``c_fc`` (hidden × n_embd) and ``c_proj`` (n_embd × hidden), ``nn.Linear``s named as in
    GPT-2 and nanoGPT. Call: ``mlp(x)`` with x of shape (..., n_embd).
    """

    component = "feed_forward"
    # (batch, tokens, n_embd): a GPT-2 small training batch of 8 × 1024 tokens; a small one on the CPU.
    default_shapes = {"cuda": (8, 1024, 768), "cpu": (2, 64, 128)}

    def __init__(self, n_embd: int, hidden: Optional[int] = None, bias: bool = True):
        hidden = 4 * int(n_embd) if hidden is None else int(hidden)
        if int(n_embd) <= 0 or hidden <= 0:
            raise ValueError(f"n_embd and hidden must be positive, got n_embd={n_embd!r}, hidden={hidden!r}")
        super().__init__(n_embd=int(n_embd), hidden=hidden, bias=bool(bias))
        self.n_embd, self.hidden = int(n_embd), hidden
        self.c_fc = nn.Linear(self.n_embd, hidden, bias=bias)
        self.c_proj = nn.Linear(hidden, self.n_embd, bias=bias)

    def check_inputs(self, x: torch.Tensor) -> None:
        super().check_inputs(x)
        if x.dim() == 0 or x.shape[-1] != self.n_embd:
            raise ValueError(f"feed_forward expects inputs of shape (..., n_embd={self.n_embd}), got {tuple(x.shape)}")

    @classmethod
    def config_for_shape(cls, input_shape):
        return {"n_embd": int(input_shape[-1])}

    def example_inputs(self, shape, dtype=None, device=None) -> tuple[torch.Tensor]:
        dtype, device = default_device_and_dtype(dtype, device)
        return (torch.randn(tuple(shape), dtype=dtype, device=device),)

    def parameter_tensors(self):
        """(fc_weight, fc_bias, proj_weight, proj_bias) in the order every level's math takes them."""
        return self.c_fc.weight, self.c_fc.bias, self.c_proj.weight, self.c_proj.bias

    def flops(self, shape, backward=False) -> int:
        tokens = element_count(shape) // self.n_embd
        forward = 2 * 2 * tokens * self.n_embd * self.hidden  # two matmuls, 2 FLOPs per multiply-add
        return forward * (3 if backward else 1)  # backward: two matmuls per forward matmul

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        activations = element_count(shape) * dtype.itemsize
        weights = sum(p.numel() for p in self.parameters()) * dtype.itemsize
        forward = 2 * activations + weights  # read x and the weights, write y
        # backward: read dy, x and the weights again, write dx and the weight gradients
        return forward + ((3 * activations + 2 * weights) if backward else 0)

    def reference_modules(self, device=None) -> dict[str, nn.Module]:
        return {"F.linear + F.gelu(tanh) (PyTorch)": _PyTorchFeedForward(self)}


class _PyTorchFeedForward(nn.Module):
    """The vendor way: ``F.linear`` (cuBLAS, bias in its epilogue) and PyTorch's fused GELU kernel."""

    def __init__(self, spec: FeedForwardSpec):
        super().__init__()
        self.spec = spec

    def forward(self, x):
        hidden = F.gelu(F.linear(x, self.spec.c_fc.weight, self.spec.c_fc.bias), approximate="tanh")
        return F.linear(hidden, self.spec.c_proj.weight, self.spec.c_proj.bias)


class FeedForwardNative(FeedForwardSpec):
    """Level 1: two matmuls, two bias adds and the six elementwise ops of the GELU: ten kernels forward."""

    level = "native"

    def compute(self, x):
        return feed_forward_math(x, *self.parameter_tensors())


@functools.cache
def _scripted_feed_forward():
    return torchscript(feed_forward_math)


class FeedForwardTorchScript(FeedForwardSpec):
    """Level 2: ``torch.jit.script`` of the same math (deprecated upstream; the legacy fuser). On the GPU
    the fuser merges the bias add and the GELU's elementwise ops into one kernel between the matmuls."""

    level = "torchscript"

    def compute(self, x):
        return _scripted_feed_forward()(x, *self.parameter_tensors())


@functools.cache
def _compiled_feed_forward():
    return inductor(feed_forward_math)


class FeedForwardCompiled(FeedForwardSpec):
    """Level 3: ``torch.compile`` of the level-1 math: cuBLAS matmuls with the bias and GELU fused into
    one generated Triton kernel (a separate pass over the hidden activation), and the same backward."""

    level = "compile"

    def compute(self, x):
        return _compiled_feed_forward()(x, *self.parameter_tensors())


class FeedForwardTriton(FeedForwardSpec):
    """Level 4: our Triton matmul with the bias + GELU epilogue (pre-activation and activation written
    once), and a backward whose gradient matmul multiplies by GELU's derivative in its epilogue."""

    level = "triton"

    def compute(self, x):
        rows = x.reshape(-1, self.n_embd).contiguous()  # the launchers take a contiguous (tokens, n_embd) matrix
        return triton_backend().feed_forward(rows, *self.parameter_tensors()).view(x.shape)


class FeedForwardCUDA(FeedForwardSpec):
    """Level 5: cuBLAS matmuls (through ATen; the fc bias rides in cuBLAS's epilogue, so the hidden
    matrix is written once by the matmul and once as the activation) around our CUDA GELU kernel and
    our fused GELU-backward + bias-gradient kernel; C++ CPU twins of both on the CPU. The op takes x as
    it comes, (..., n_embd), and views it as a matrix itself, below autograd."""

    level = "cuda"

    def compute(self, x):
        return cuda_backend().feed_forward(x, *self.parameter_tensors())


IMPLEMENTATIONS = {
    "native": FeedForwardNative,
    "torchscript": FeedForwardTorchScript,
    "compile": FeedForwardCompiled,
    "triton": FeedForwardTriton,
    "cuda": FeedForwardCUDA,
}
