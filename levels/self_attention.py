"""Causal self-attention as GPT-2 has it: one fused q·k·v projection, multi-head attention, an output
projection, at five levels.

The level's own parts do the work: its ``linear`` for the two projections (``levels.backends.linear``)
and its attention component (``levels.attention``) for the heads. At levels 1-3 the score matrix is
materialised; at levels 4 and 5 it never leaves the chip. With a ``KVCache`` the same module decodes:
the keys and values of earlier tokens are kept, and only the new tokens' queries attend to them (a
query shorter than the keys, aligned to their end).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

from . import attention as attention_component
from .backends import linear
from .spec import ComponentSpec, default_device_and_dtype, element_count


class KVCache:
    """The keys and values one attention layer has seen, (batch, heads, tokens, head_dim) each; they grow
    by the new tokens' keys and values at every call. Empty until the first call (the prompt)."""

    def __init__(self):
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention) -> torch.Tensor:
        """Append the new tokens' keys and values, and attend their queries over every key so far."""
        if self.keys is not None:
            k = torch.cat((self.keys, k), dim=-2)
            v = torch.cat((self.values, v), dim=-2)
        self.keys, self.values = k, v
        return attention(q, k, v)


class DecodePosition:
    """Where a static-cache decode stands, on the device, shared by every layer's ``StaticKVCache``:
    ``position`` (1,) int64, the count of tokens cached before the current step, and ``key_lengths``
    (batch,) int32, the keys each sequence's new query sees (that count plus one). Kept on the device
    and advanced by device ops (``begin_step``, ``end_step``), so a captured step replays correctly:
    a Python int would be frozen into the graph at capture."""

    def __init__(self, batch: int, device: torch.device):
        self.position = torch.zeros(1, dtype=torch.int64, device=device)
        self.key_lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        if self.position.is_cuda:  # updated in place inside level 3's CUDA graphs too (see StaticKVCache)
            torch._dynamo.mark_static_address(self.position)
            torch._dynamo.mark_static_address(self.key_lengths)

    def begin_step(self) -> None:
        self.key_lengths.copy_(self.position + 1)  # the new token's key is cached before attention reads it

    def end_step(self) -> None:
        self.position.add_(1)


class StaticKVCache:
    """Keys and values preallocated to ``capacity`` positions, (batch, heads, capacity, head_dim) each,
    written in place: every decode step then has the same shapes and the same addresses, which CUDA
    graph capture needs (``KVCache`` grows by concatenation: new tensors at every step). The first call
    (the prompt) fills positions 0..tokens-1 and attends as usual; every later call is one token,
    which the attention's ``decode`` writes at ``position.position`` and attends (one kernel at levels
    4 and 5: the new key and value go to the cache from registers, where the query uses them)."""

    def __init__(self, batch: int, heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 position: DecodePosition):
        device = position.position.device
        self.keys = torch.zeros(batch, heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.position = position
        self.awaits_prompt = True
        if device.type == "cuda":
            # torch.compile's CUDA graphs (level 3, mode="reduce-overhead") may update these buffers in
            # place only if it knows their addresses never change.
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)

    def __len__(self) -> int:
        """Tokens cached so far (reads the device: for tests and checks, not the decode loop)."""
        return 0 if self.awaits_prompt else int(self.position.position)

    def restart(self) -> None:
        """Take a new prompt at the next call: same buffers (a captured step keeps its addresses)."""
        self.awaits_prompt = True

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention) -> torch.Tensor:
        """The prompt: cache its keys and values and attend as usual. Then one token per call, appended
        and attended by ``attention.decode``."""
        if self.awaits_prompt:
            tokens = k.shape[-2]
            self.keys[:, :, :tokens] = k
            self.values[:, :, :tokens] = v
            self.awaits_prompt = False
            return attention(q, k, v)
        if q.shape[-2] != 1:
            raise ValueError(f"a static KV cache decodes one token per call after the prompt, got {q.shape[-2]}")
        return attention.decode(q, k, v, self.keys, self.values, self.position.key_lengths)


def check_heads(n_embd: int, n_head: int) -> int:
    """The head dim, or a clear error when ``n_embd`` does not split into ``n_head`` heads."""
    if n_head <= 0 or n_embd <= 0 or n_embd % n_head != 0:
        raise ValueError(f"n_embd={n_embd} must be a positive multiple of n_head={n_head} (each head gets "
                         f"n_embd / n_head features)")
    return n_embd // n_head


class SelfAttentionSpec(ComponentSpec):
    """Multi-head causal self-attention with input and output projections (GPT-2's ``attn``).

    q, k, v = split(x·W_attnᵀ + b_attn);  y = concat_heads(attention(q, k, v))·W_projᵀ + b_proj

    Args:
        n_embd: model width; n_head: number of heads (n_embd / n_head is the head dim, which levels 4
            and 5 support for multiples of 8 up to 256).
        window: sliding-window attention over the last ``window`` tokens (None: full causal).

    Parameters: ``c_attn`` (3·n_embd × n_embd) and ``c_proj`` (n_embd × n_embd), ``nn.Linear``s named as in
    GPT-2. Call: ``attn(x)`` or ``attn(x, cache)`` with x of shape (batch, tokens, n_embd).
    """

    component = "self_attention"
    default_shapes = {"cuda": (8, 1024, 768), "cpu": (2, 64, 128)}

    def __init__(self, n_embd: int, n_head: int, window: Optional[int] = None):
        self.head_dim = check_heads(int(n_embd), int(n_head))
        super().__init__(n_embd=int(n_embd), n_head=int(n_head), window=window)
        self.n_embd, self.n_head = int(n_embd), int(n_head)
        self.c_attn = nn.Linear(self.n_embd, 3 * self.n_embd)
        self.c_proj = nn.Linear(self.n_embd, self.n_embd)
        # This level's attention: no parameters, so the state_dict is the same at every level.
        self.attention = attention_component.IMPLEMENTATIONS[self.level or "native"](causal=True, window=window)

    def forward(self, x: torch.Tensor, cache: Optional[KVCache | StaticKVCache] = None) -> torch.Tensor:
        self.check_inputs(x)
        return self.compute(x, cache)

    def check_inputs(self, x: torch.Tensor) -> None:
        super().check_inputs(x)
        if x.dim() != 3 or x.shape[-1] != self.n_embd:
            raise ValueError(f"{self.component} expects x of shape (batch, tokens, n_embd={self.n_embd}), "
                             f"got {tuple(x.shape)}")

    def compute(self, x: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
        return self.attend(x, functools.partial(linear, self.level), self.attention, cache)

    def attend(self, x: torch.Tensor, project, attention, cache: Optional[KVCache] = None) -> torch.Tensor:
        """The layer with ``project(x, weight, bias)`` for the two projections and ``attention(q, k, v)``
        for the heads: each level passes its own, PyTorch's reference row F.linear and SDPA."""
        batch, tokens, width = x.shape
        qkv = project(x, self.c_attn.weight, self.c_attn.bias)
        # (batch, tokens, 3, heads, head_dim) -> three (batch, heads, tokens, head_dim) views. Unbound before
        # the heads are transposed, so that autograd's way back is one pass: unbind's backward stacks the
        # three gradients straight into qkv's (batch, tokens, 3, heads, head_dim) layout, and the view's is
        # free. Transposed first (one permute, then unbind), the stack would come out heads-first and the
        # view's backward would copy all of it once more (at GPT-2 size, 38 MB a layer). How fast the stack
        # runs depends on how the three gradients lie: levels 4 and 5 write them tokens first, as the
        # projection holds them, so the stack copies whole rows (attention_tiles.empty_gradient; lesson 06).
        q, k, v = (part.transpose(1, 2) for part in qkv.view(batch, tokens, 3, self.n_head, self.head_dim).unbind(2))
        heads = attention(q, k, v) if cache is None else cache.attend(q, k, v, attention)
        merged = heads.transpose(1, 2).reshape(batch, tokens, width)
        return project(merged, self.c_proj.weight, self.c_proj.bias)

    def reference_modules(self, device=None) -> dict[str, nn.Module]:
        return {"F.linear + SDPA flash (PyTorch)": _PyTorchSelfAttention(self)}

    @classmethod
    def config_for_shape(cls, input_shape):
        width = int(input_shape[-1])
        return {"n_embd": width, "n_head": max(1, width // 64)}  # GPT-2's head dim of 64

    def example_inputs(self, shape, dtype=None, device=None) -> tuple[torch.Tensor]:
        dtype, device = default_device_and_dtype(dtype, device)
        return (torch.randn(tuple(shape), dtype=dtype, device=device),)

    def flops(self, shape, backward=False) -> int:
        batch, tokens, width = shape
        projections = 2 * batch * tokens * width * 4 * width  # q·k·v (3 widths) and output (1 width)
        heads = self.attention.flops((batch, self.n_head, tokens, self.head_dim), backward)
        return projections * (3 if backward else 1) + heads  # a matmul's backward is two matmuls

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        activations = element_count(shape) * dtype.itemsize
        weights = sum(p.numel() for p in self.parameters()) * dtype.itemsize
        return (2 * activations + weights) * (3 if backward else 1)


# Flash where it runs, else the backends every device has: the math fallback keeps float64 and the CPU working.
_FLASH_FIRST = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class _PyTorchSelfAttention(nn.Module):
    """The vendor way, on the spec's own parameters: ``F.linear`` projections (cuBLAS, bias in its
    epilogue) around ``F.scaled_dot_product_attention`` on its FlashAttention-2 backend, which takes the
    heads as strided views of the projection, as ours do. (PyTorch 2.11's own choice on an H100, cuDNN,
    failed on them in forward+backward: "mha_graph.execute(...).is_good()"; the attention component
    compares every SDPA backend, cuDNN included, on contiguous inputs.) Where flash cannot run (the CPU
    build, float64), PyTorch's choice."""

    def __init__(self, spec: SelfAttentionSpec):
        super().__init__()
        self.spec = spec
        self.sdpa = attention_component.PyTorchSDPA(spec.attention, backend=_FLASH_FIRST)

    def forward(self, x):
        return self.spec.attend(x, F.linear, self.sdpa)


class SelfAttentionNative(SelfAttentionSpec):
    """Level 1: ``F.linear`` projections around level 1's materialised attention."""

    level = "native"


class SelfAttentionTorchScript(SelfAttentionSpec):
    """Level 2: ``F.linear`` projections around level 2's scripted attention."""

    level = "torchscript"


class SelfAttentionCompiled(SelfAttentionSpec):
    """Level 3: ``F.linear`` projections (the cuBLAS call Inductor would make) around level 3's compiled attention."""

    level = "compile"


class SelfAttentionTriton(SelfAttentionSpec):
    """Level 4: our Triton matmul for the projections, our Triton flash attention for the heads."""

    level = "triton"


class SelfAttentionCUDA(SelfAttentionSpec):
    """Level 5: the extension's linear op (cuBLAS, our bias-gradient kernel) and our CUDA flash attention."""

    level = "cuda"


IMPLEMENTATIONS = {
    "native": SelfAttentionNative,
    "torchscript": SelfAttentionTorchScript,
    "compile": SelfAttentionCompiled,
    "triton": SelfAttentionTriton,
    "cuda": SelfAttentionCUDA,
}
