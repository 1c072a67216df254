"""A tiny GPT (GPT-2's architecture, nanoGPT's layout) at five levels, each made of that level's blocks.

Token and position embeddings, ``n_layer`` pre-LayerNorm transformer blocks, a final LayerNorm and an
LM head tied to the token embedding. ``generate`` decodes with a KV cache: the prompt goes through once,
then every new token is one query attending to the cached keys and values, which is the case the
attention kernels of levels 4 and 5 handle with queries shorter than keys.

Given targets, ``gpt(idx, targets)`` returns the mean next-token loss instead of the logits, through the
level's ``linear_cross_entropy`` (the LM head and the loss in one component, holding the tied weight):
at levels 4 and 5 the (tokens × vocabulary) logits are never in memory whole.

What is not a ladder component stays PyTorch at every level, on purpose and said here: the embedding
lookups (a gather, not a lesson) and the residual adds.
"""

from __future__ import annotations

import math
import sys
from typing import Optional

import torch
from torch import nn

from cuda_kernels.host_copy import OnTheWayToHost

from .backends import linear
from .layer_norm import IMPLEMENTATIONS as LAYER_NORM
from .linear_cross_entropy import IMPLEMENTATIONS as LINEAR_CROSS_ENTROPY
from .self_attention import DecodePosition, KVCache, StaticKVCache, check_heads
from .spec import ComponentSpec
from .transformer_block import IMPLEMENTATIONS as TRANSFORMER_BLOCK

GPT2_SMALL = {"vocab_size": 50304, "n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024}
"""GPT-2 small (124M parameters), with the vocabulary padded from 50257 to a multiple of 64 as nanoGPT does."""

TINY = {"vocab_size": 96, "n_layer": 2, "n_head": 2, "n_embd": 64}
"""A model small enough for the CPU and Triton's interpreter to run in seconds (head dim 32)."""


def check_id_range(smallest: int, largest: int, vocab_size: int) -> None:
    """ValueError unless every token id, from ``smallest`` to ``largest``, lies in the vocabulary."""
    if smallest < 0 or largest >= vocab_size:
        raise ValueError(f"token ids must lie in [0, vocab_size={vocab_size}), got ids from {smallest} to {largest}")


class IdRangeOnTheWay:
    """The token ids' smallest and largest values on their way to the host (``OnTheWayToHost``: no wait
    for the GPU to get here), and the ids clamped into the vocabulary for the lookup, so that a bad id
    cannot read outside the embedding table. ``arrived`` is called once the forward is queued: the host
    runs ahead as it does without any check, and a bad id still raises before the forward returns
    anything."""

    def __init__(self, idx: torch.Tensor, vocab_size: int):
        self.extremes = OnTheWayToHost(torch.stack(torch.aminmax(idx)))
        self.clamped_ids = idx.clamp(0, vocab_size - 1)

    def arrived(self) -> tuple[int, int]:
        """(smallest, largest), once the copy has landed."""
        return tuple(self.extremes.arrived())


class GPTSpec(ComponentSpec):
    """A GPT-2-style language model.

    logits = ln_f(blocks(wte[idx] + wpe[positions]))·wteᵀ

    Args:
        vocab_size: number of token ids; n_layer: blocks; n_head: attention heads per block;
        n_embd: model width (a multiple of n_head); block_size: the longest sequence (positions);
        window: sliding-window attention in every block (None: full causal).

    Parameters: ``wte`` (vocab_size × n_embd, also the LM head: ``lm_head.weight`` is the same tensor),
    ``wpe`` (block_size × n_embd), ``h`` (the blocks), ``ln_f``: the same ``state_dict`` at every level.
    Call: ``gpt(idx)`` with idx a (batch, tokens) tensor of token ids returns (batch, tokens,
    vocab_size) logits; ``gpt(idx, targets)`` with targets of idx's shape (the next tokens; -100 for
    none) returns the mean loss, a float32 scalar.
    """

    component = "gpt"
    default_shapes = {"cuda": (8, 1024), "cpu": (2, 32)}

    def __init__(self, vocab_size: int, n_layer: int, n_head: int, n_embd: int, block_size: int,
                 window: Optional[int] = None):
        check_heads(int(n_embd), int(n_head))
        if vocab_size <= 0 or n_layer <= 0 or block_size <= 0:
            raise ValueError(f"vocab_size, n_layer and block_size must be positive, got {vocab_size}, {n_layer}, "
                             f"{block_size}")
        super().__init__(vocab_size=int(vocab_size), n_layer=int(n_layer), n_head=int(n_head), n_embd=int(n_embd),
                         block_size=int(block_size), window=window)
        level = self.level or "native"
        self.vocab_size, self.n_embd, self.block_size = int(vocab_size), int(n_embd), int(block_size)
        self.wte = nn.Embedding(self.vocab_size, self.n_embd)
        self.wpe = nn.Embedding(self.block_size, self.n_embd)
        self.h = nn.ModuleList(TRANSFORMER_BLOCK[level](n_embd, n_head, window=window) for _ in range(n_layer))
        self.ln_f = LAYER_NORM[level](normalized_shape=self.n_embd)
        self.lm_head = LINEAR_CROSS_ENTROPY[level](n_embd=self.n_embd, vocab_size=self.vocab_size)
        self.lm_head.weight = self.wte.weight  # tied: the LM head is the token embedding (GPT-2's choice)
        self._initialise(int(n_layer))

    def _initialise(self, n_layer: int) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, and the projections that write into
        the residual stream scaled by 1/√(2·n_layer), so the stream's variance does not grow with depth."""
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif name.startswith(("wte", "wpe")) or name.endswith(("c_attn.weight", "c_fc.weight")):
                nn.init.normal_(parameter, std=0.02)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * n_layer))

    # --- the computation ---------------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        self.check_inputs(idx)
        on_the_way = IdRangeOnTheWay(idx, self.vocab_size) if idx.is_cuda and idx.numel() else None
        if on_the_way is None:
            self.check_ids(idx)
        else:
            idx = on_the_way.clamped_ids
        output = self.compute(idx) if targets is None else self.lm_head(self.hidden_states(idx), targets)
        if on_the_way is not None:
            check_id_range(*on_the_way.arrived(), self.vocab_size)
        return output

    def check_inputs(self, idx: torch.Tensor, past: int = 0) -> None:
        """Type, shape, device and length: what the host knows without asking the GPU."""
        if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"gpt takes token ids as an int64 or int32 tensor, got "
                            f"{getattr(idx, 'dtype', type(idx).__name__)}")
        if idx.dim() != 2:
            raise ValueError(f"gpt takes token ids of shape (batch, tokens), got {tuple(idx.shape)}")
        if idx.device != self.wte.weight.device:
            raise ValueError(f"token ids are on {idx.device} but the model is on {self.wte.weight.device}")
        if past + idx.shape[1] > self.block_size:
            raise ValueError(f"{past + idx.shape[1]} tokens do not fit the model's block_size={self.block_size} "
                             f"(it has that many positions)")

    def check_ids(self, idx: torch.Tensor) -> None:
        """Every id in the vocabulary, checked now (on a CUDA tensor the host waits for the GPU to get here)."""
        if idx.numel():
            check_id_range(*torch.stack(torch.aminmax(idx)).tolist(), self.vocab_size)  # one copy, one wait

    def hidden_states(self, idx: torch.Tensor, caches: Optional[list] = None,
                      positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What the LM head reads: the final LayerNorm of the last block's output, (batch, tokens, n_embd).
        ``positions`` default to the tokens after those already cached."""
        if positions is None:
            past = len(caches[0]) if caches else 0
            positions = torch.arange(past, past + idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for index, block in enumerate(self.h):
            x = block(x, caches[index] if caches else None)
        return self.ln_f(x)

    def compute(self, idx: torch.Tensor, caches: Optional[list] = None,
                last_token_only: bool = False) -> torch.Tensor:
        x = self.hidden_states(idx, caches)
        if last_token_only:
            x = x[:, -1:]
        return linear(self.level or "native", x, self.wte.weight)  # the LM head, tied to the token embedding

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 generator: Optional[torch.Generator] = None, cuda_graph: Optional[bool] = None) -> torch.Tensor:
        """Continue each row of ``idx`` (batch, tokens) by ``max_new_tokens`` tokens; returns the prompt
        and the new tokens. ``temperature`` 0 picks the most likely token (greedy, deterministic);
        above 0 it samples from softmax(logits / temperature). The prompt and the new tokens must fit
        in ``block_size`` (no cropping: a KV cache cannot forget its first tokens' positions).

        ``cuda_graph`` (default: on for CUDA tensors) decodes with a static KV cache and replays one
        captured CUDA graph per token: a decode step of GPT-2 small is ~150 small kernels whose GPU
        time is far below what Python takes to launch them, so replaying them from the GPU's own queue
        is most of the speed-up (level 3 gets the same from ``torch.compile(mode="reduce-overhead")``).
        On the CPU there is no graph to capture: the static-cache step then runs eagerly, and says so.
        ``cuda_graph=False`` decodes with a growing cache, every kernel launched from Python.

        The static decoder (its caches and its graph) is kept for the next call with the same batch
        size, which then only fills the cache with its prompt: capturing costs about two decode steps.
        Moving or converting the model (``.to()``) drops it, since a graph holds the addresses it read."""
        self.check_inputs(idx, past=max_new_tokens)
        self.check_ids(idx)
        if cuda_graph is None:
            cuda_graph = idx.is_cuda
        if cuda_graph and not idx.is_cuda:
            print("gpt.generate: no CUDA graphs on the CPU; the static-cache decode step runs eagerly", file=sys.stderr)
        decoder = self._static_decoder(idx) if cuda_graph else GrowingCacheDecoder(self)
        tokens = [idx]
        logits = decoder.prefill(idx)
        for step in range(max_new_tokens):
            next_token = self._choose(logits[:, -1].float(), temperature, generator)
            tokens.append(next_token)
            if step + 1 < max_new_tokens:
                logits = decoder.step(next_token)
        return torch.cat(tokens, dim=1)

    def _static_decoder(self, idx: torch.Tensor) -> "StaticCacheDecoder":
        decoder = self.__dict__.get("_decoder")
        if decoder is None or decoder.token.shape != (idx.shape[0], 1) or decoder.token.device != idx.device:
            decoder = StaticCacheDecoder(self, idx, capture=idx.is_cuda)
            self.__dict__["_decoder"] = decoder  # not a submodule: no state_dict entry, no .to()
        return decoder

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_decoder", None)  # its graph and caches hold the old parameters' addresses
        return super()._apply(fn, *args, **kwargs)

    @staticmethod
    def _choose(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
        if temperature <= 0:
            return logits.argmax(dim=-1, keepdim=True)
        probabilities = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probabilities, 1, generator=generator)

    # --- what the lessons and the profiler ask of a component ---------------------------------------------
    @classmethod
    def config_for_shape(cls, input_shape):
        """GPT-2 small for sequences of 512 tokens or more (a GPU shape), else the tiny model."""
        tokens = int(input_shape[-1])
        return dict(GPT2_SMALL) if tokens >= 512 else dict(TINY, block_size=tokens)

    def example_inputs(self, shape, dtype=None, device=None) -> tuple[torch.Tensor]:
        """Random token ids of ``shape`` (batch, tokens); ``dtype`` is the model's and does not apply to ids."""
        device = torch.device(device) if device is not None else self.wte.weight.device
        return (torch.randint(0, self.vocab_size, tuple(shape), device=device),)

    def flops(self, shape, backward=False) -> int:
        batch, tokens = shape
        hidden_shape = (batch, tokens, self.n_embd)
        blocks = sum(block.flops(hidden_shape, backward) for block in self.h)
        lm_head = 2 * batch * tokens * self.n_embd * self.vocab_size * (3 if backward else 1)
        return blocks + lm_head

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        batch, tokens = shape
        hidden_shape = (batch, tokens, self.n_embd)
        blocks = sum(block.bytes_moved(hidden_shape, dtype, backward) for block in self.h)
        logits = batch * tokens * self.vocab_size * dtype.itemsize
        return blocks + (self.wte.weight.numel() * dtype.itemsize + logits) * (3 if backward else 1)


class GrowingCacheDecoder:
    """Decoding as written: every step launched from Python, the cache grown by concatenation."""

    def __init__(self, model: GPTSpec):
        self.model = model
        self.caches = [KVCache() for _ in model.h]

    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model.compute(idx, self.caches, last_token_only=True)

    def step(self, token: torch.Tensor) -> torch.Tensor:
        return self.model.compute(token, self.caches)


class StaticCacheDecoder:
    """Decoding with a cache preallocated to ``block_size`` and one decode step captured as a CUDA graph.

    The step reads its token from a fixed buffer, its position from the device (``DecodePosition``),
    writes its keys and values in place and its logits to a fixed output: the same kernels on the same
    addresses every time, so it is captured once and replayed per token. Capture records without
    running, after one warm-up step on a side stream (which builds cuBLAS handles and compiles or
    autotunes Triton kernels, none of which may happen during capture) whose advance of the position
    is undone. Level 3 hands the same step to ``torch.compile(mode="reduce-overhead")``, whose CUDA
    graphs warm up, record and replay by themselves."""

    def __init__(self, model: GPTSpec, idx: torch.Tensor, capture: bool):
        batch = idx.shape[0]
        attention = model.h[0].attn
        self.model = model
        self.position = DecodePosition(batch, idx.device)
        self.caches = [StaticKVCache(batch, attention.n_head, model.block_size, attention.head_dim,
                                     model.wte.weight.dtype, self.position) for _ in model.h]
        self.token = torch.zeros(batch, 1, dtype=idx.dtype, device=idx.device)
        self.capture = capture
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.compiled_step = None
        if capture and model.level == "compile":
            self.compiled_step = torch.compile(self._step, mode="reduce-overhead")

    def prefill(self, idx: torch.Tensor) -> torch.Tensor:
        for cache in self.caches:
            cache.restart()  # positions past the new prompt hold an earlier call's keys: masked until rewritten
        logits = self.model.compute(idx, self.caches, last_token_only=True)
        self.position.position.fill_(idx.shape[1])
        return logits

    def _step(self) -> torch.Tensor:
        self.position.begin_step()
        x = self.model.hidden_states(self.token, self.caches, positions=self.position.position)
        logits = linear(self.model.level or "native", x, self.model.wte.weight)
        self.position.end_step()
        return logits

    def step(self, token: torch.Tensor) -> torch.Tensor:
        self.token.copy_(token)
        if self.compiled_step is not None:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are read: reuse their memory
            return self.compiled_step()
        if not self.capture:
            return self._step()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        side_stream = torch.cuda.Stream(self.token.device)
        side_stream.wait_stream(torch.cuda.current_stream(self.token.device))
        with torch.cuda.stream(side_stream):
            self._step()
            self.position.position.sub_(1)  # the warm-up ran this step; the first replay runs it again
        torch.cuda.current_stream(self.token.device).wait_stream(side_stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step()


class GPTNative(GPTSpec):
    """Level 1: level 1's blocks: every part as separate tensor ops."""

    level = "native"


class GPTTorchScript(GPTSpec):
    """Level 2: level 2's blocks: scripted parts (the legacy fuser)."""

    level = "torchscript"


class GPTCompiled(GPTSpec):
    """Level 3: level 3's blocks: every part compiled by Inductor."""

    level = "compile"


class GPTTriton(GPTSpec):
    """Level 4: level 4's blocks and LM head: our Triton kernels."""

    level = "triton"


class GPTCUDA(GPTSpec):
    """Level 5: level 5's blocks and LM head: our CUDA kernels around cuBLAS matmuls."""

    level = "cuda"


IMPLEMENTATIONS = {
    "native": GPTNative,
    "torchscript": GPTTorchScript,
    "compile": GPTCompiled,
    "triton": GPTTriton,
    "cuda": GPTCUDA,
}
