"""GPT-2's transformer block, pre-LayerNorm with residuals, at five levels, each made of that level's
own LayerNorm, self-attention and feed-forward:

    x = x + attn(ln_1(x));   x = x + mlp(ln_2(x))

Nothing new is computed here: the lesson is that the speedups of the parts add up (or do not) once
they run together, and where the time goes in a real block (the matmuls, mostly).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .feed_forward import IMPLEMENTATIONS as FEED_FORWARD
from .layer_norm import IMPLEMENTATIONS as LAYER_NORM
from .self_attention import IMPLEMENTATIONS as SELF_ATTENTION
from .self_attention import KVCache, SelfAttentionSpec
from .spec import ComponentSpec, default_device_and_dtype, element_count


def residual_block(x: torch.Tensor, ln_1, attn, ln_2, mlp, *attention_arguments) -> torch.Tensor:
    """GPT-2's pre-LayerNorm residual stream around any four parts (``attention_arguments``: the KV cache)."""
    x = x + attn(ln_1(x), *attention_arguments)
    return x + mlp(ln_2(x))


class TransformerBlockSpec(ComponentSpec):
    """One pre-LayerNorm GPT-2 block.

    y = h + mlp(ln_2(h)),  h = x + attn(ln_1(x))

    Args:
        n_embd: model width; n_head: number of attention heads; window: sliding-window attention
            (None: full causal). The feed-forward is 4 · n_embd wide, with biases.

    Submodules (the same names, and so the same ``state_dict``, at every level): ``ln_1``, ``attn``,
    ``ln_2``, ``mlp``. Call: ``block(x)`` or ``block(x, cache)`` with x of shape (batch, tokens, n_embd).
    """

    component = "transformer_block"
    default_shapes = SelfAttentionSpec.default_shapes

    def __init__(self, n_embd: int, n_head: int, window: Optional[int] = None):
        super().__init__(n_embd=int(n_embd), n_head=int(n_head), window=window)
        level = self.level or "native"
        self.n_embd = int(n_embd)
        self.ln_1 = LAYER_NORM[level](normalized_shape=self.n_embd)
        self.attn = SELF_ATTENTION[level](n_embd, n_head, window=window)
        self.ln_2 = LAYER_NORM[level](normalized_shape=self.n_embd)
        self.mlp = FEED_FORWARD[level](n_embd)

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        self.check_inputs(x)
        return self.compute(x, cache)

    def check_inputs(self, x: torch.Tensor) -> None:
        self.attn.check_inputs(x)

    def compute(self, x: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        return residual_block(x, self.ln_1, self.attn, self.ln_2, self.mlp, cache)

    def reference_modules(self, device=None) -> dict[str, nn.Module]:
        return {"F.layer_norm, F.linear + SDPA flash, F.gelu (PyTorch)": _PyTorchTransformerBlock(self, device)}

    @classmethod
    def config_for_shape(cls, input_shape):
        return SelfAttentionSpec.config_for_shape(input_shape)

    def example_inputs(self, shape, dtype=None, device=None) -> tuple[torch.Tensor]:
        dtype, device = default_device_and_dtype(dtype, device)
        return (torch.randn(tuple(shape), dtype=dtype, device=device),)

    def flops(self, shape, backward=False) -> int:
        parts = sum(part.flops(shape, backward) for part in (self.ln_1, self.attn, self.ln_2, self.mlp))
        return parts + self.residual_adds_flops(shape, backward)

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        parts = sum(part.bytes_moved(shape, dtype, backward) for part in (self.ln_1, self.attn, self.ln_2, self.mlp))
        return parts + self.residual_adds_bytes(shape, dtype, backward)

    @staticmethod
    def residual_adds_flops(shape, backward=False) -> int:
        """The two residual adds: one FLOP an element each; the backward adds the branch's gradient to
        the stream's at both."""
        return 2 * element_count(shape) * (2 if backward else 1)

    @staticmethod
    def residual_adds_bytes(shape, dtype, backward=False) -> int:
        """The two residual adds, each reading two (..., n_embd) tensors and writing one, as no level fuses
        them into a neighbour; the backward's two gradient sums move as much again."""
        return 2 * 3 * element_count(shape) * dtype.itemsize * (2 if backward else 1)


class TransformerBlockNative(TransformerBlockSpec):
    """Level 1: level 1's LayerNorm, self-attention and feed-forward."""

    level = "native"


class TransformerBlockTorchScript(TransformerBlockSpec):
    """Level 2: level 2's scripted parts."""

    level = "torchscript"


class TransformerBlockCompiled(TransformerBlockSpec):
    """Level 3: level 3's parts, each compiled by Inductor."""

    level = "compile"


class TransformerBlockTriton(TransformerBlockSpec):
    """Level 4: our Triton LayerNorm, matmuls and flash attention."""

    level = "triton"


class TransformerBlockCUDA(TransformerBlockSpec):
    """Level 5: our CUDA LayerNorm, bias + GELU and flash-attention kernels around cuBLAS matmuls."""

    level = "cuda"


class _PyTorchTransformerBlock(nn.Module):
    """The vendor way, on the spec's own parameters: the parts' PyTorch reference rows in the same
    residual stream (``F.layer_norm``; ``F.linear`` around SDPA; ``F.linear`` and the fused GELU)."""

    def __init__(self, spec: TransformerBlockSpec, device=None):
        super().__init__()
        self.spec = spec
        # PyTorch's own norm by name: where Liger-Kernel is installed, the norm has a second reference row.
        _, self.ln_1 = spec.ln_1.pytorch_reference()
        (self.attn,) = spec.attn.reference_modules(device).values()
        _, self.ln_2 = spec.ln_2.pytorch_reference()
        (self.mlp,) = spec.mlp.reference_modules(device).values()

    def forward(self, x):
        return residual_block(x, self.ln_1, self.attn, self.ln_2, self.mlp)


IMPLEMENTATIONS = {
    "native": TransformerBlockNative,
    "torchscript": TransformerBlockTorchScript,
    "compile": TransformerBlockCompiled,
    "triton": TransformerBlockTriton,
    "cuda": TransformerBlockCUDA,
}
