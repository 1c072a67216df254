"""Scaled dot-product attention, causal, sliding-window or full, at five levels.

o = softmax(q·kᵀ·scale + mask)·v on (batch, heads, seq, head_dim) tensors. Level 1 materialises the
seq × seq score matrix: written, masked, softmaxed and read back, so time and memory grow with seq²
while the useful output grows with seq. Flash attention (levels 4 and 5) tiles q and k/v, keeps a
tile of scores in registers or shared memory, merges tiles with the online softmax, and saves only
one log-sum-exp per query for the backward pass, which recomputes the scores instead of storing
them. With a sliding window, tiles wholly outside the window are never visited, so the work grows
with seq × window.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from cuda_kernels.limits import attention_head_dim_supported, unsupported_head_dim_message  # a leaf: builds nothing

from .backends import cuda_backend, inductor, torchscript, triton_backend
from .spec import ComponentSpec, check_floating_input, default_device_and_dtype


def visible_keys_mask(query_length: int, key_length: int, window: int, device: torch.device) -> torch.Tensor:
    """(query_length, key_length) booleans: True where a query may attend to a key.

    Queries are aligned to the *end* of the keys (decoding with a cache: the last query is the newest
    token), so query i sits at position i + key_length − query_length. It sees every key at or before
    its position, and with ``window`` > 0 only the ``window`` most recent of them.
    """
    query_positions = torch.arange(query_length, device=device).unsqueeze(-1) + (key_length - query_length)
    key_positions = torch.arange(key_length, device=device).unsqueeze(0)
    visible = key_positions <= query_positions
    if window > 0:
        visible = visible & (key_positions > query_positions - window)
    return visible


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int,
                   scale: float) -> torch.Tensor:
    """The formula as a PyTorch user writes it: scores, mask, softmax, weighted sum (``window`` 0: none).

    Grouped-query attention (k, v with fewer heads than q): the query heads are viewed as (kv heads,
    group) and k, v get a group axis of size 1, so matmul broadcasts each kv head over its group's
    query heads without copying k or v, and autograd sums their gradients over the group."""
    batch, query_heads, query_length, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped_q = q.reshape(batch, kv_heads, query_heads // kv_heads, query_length, head_dim)
    scores = torch.matmul(grouped_q, k.unsqueeze(2).transpose(-2, -1)) * scale
    if causal:
        visible = visible_keys_mask(query_length, k.shape[-2], window, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
    probabilities = torch.softmax(scores, dim=-1)
    return torch.matmul(probabilities, v.unsqueeze(2)).reshape(q.shape)


def decode_attention_math(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, key_lengths: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """One new token per sequence over a preallocated cache, the step a CUDA graph replays.

    q is the new token's (batch, heads, 1, head_dim), k_new and v_new its (batch, kv_heads, 1, head_dim)
    (kv_heads divides heads: grouped-query attention as in ``attention_math``); the caches are (batch,
    kv_heads, capacity, head_dim), of which sequence b fills its first ``key_lengths[b]`` positions with this
    step: the new key and value are written at position key_lengths[b] − 1, in place. The count lives
    on the device, so the same call, with the same shapes and addresses, serves every step. The query
    sits at that last position: it sees every filled key, or with ``window`` > 0 the ``window`` most
    recent. Positions past the count are masked out, so whatever they hold is ignored."""
    lengths = key_lengths.to(torch.int64).view(-1, 1, 1, 1)
    slot = (lengths - 1).expand(k_new.shape)
    k_cache.scatter_(2, slot, k_new)
    v_cache.scatter_(2, slot, v_new)
    positions = torch.arange(k_cache.shape[-2], device=q.device)
    visible = positions < lengths
    if window > 0:
        visible = visible & (positions >= lengths - window)
    batch, heads, _, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    grouped_q = q.reshape(batch, kv_heads, heads // kv_heads, 1, head_dim)
    scores = torch.matmul(grouped_q, k_cache.unsqueeze(2).transpose(-2, -1)) * scale
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v_cache.unsqueeze(2)).reshape(q.shape)


def heads_fit(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Each kv head serves a whole group of query heads: Hq is a multiple of Hkv (or both are 0)."""
    query_heads, kv_heads = q.shape[1], k.shape[1]
    return query_heads == kv_heads or (kv_heads > 0 and query_heads % kv_heads == 0)


class AttentionSpec(ComponentSpec):
    """Multi-head scaled dot-product attention (no projections: q, k, v come in ready).

    o = softmax(q·kᵀ·scale + mask)·v

    Args:
        causal: query i sees keys at or before its position; when q is shorter than k (decoding with
            a KV cache), queries are aligned to the end of the keys.
        window: sliding-window (local) attention as in Longformer and Mistral: query i sees keys
            i − window + 1 … i. Needs ``causal=True``; work scales with seq × window.
        scale: multiplies the scores; default 1/√head_dim.

    Call: ``attention(q, k, v)`` with q of shape (batch, heads, query_len, head_dim) and k, v of shape
    (batch, kv_heads, key_len, head_dim); returns (batch, heads, query_len, head_dim). kv_heads may be a
    divisor of heads (grouped-query attention, as in Llama 2 70B and Mistral): query head h then uses
    kv head h // (heads / kv_heads). Levels 4 and 5 take head dims that are multiples of 8 up to 256.
    """

    component = "attention"
    default_shapes = {"cuda": (4, 16, 4096, 128), "cpu": (1, 2, 128, 64)}

    def __init__(self, causal: bool = True, window: Optional[int] = None, scale: Optional[float] = None):
        if window is not None and (int(window) != window or window <= 0):
            raise ValueError(f"window must be a positive number of keys, got {window!r}")
        if window is not None and not causal:
            raise ValueError("a sliding window looks back from each query, so it needs causal=True")
        super().__init__(causal=bool(causal), window=window, scale=scale)
        self.causal = bool(causal)
        self.window = None if window is None else int(window)
        self.scale = scale

    def scale_for(self, head_dim: int) -> float:
        return float(self.scale) if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def check_inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, tensor in (("q", q), ("k", k), ("v", v)):
            check_floating_input(name, tensor, self.level or "native")
            if tensor.dim() != 4:
                raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(tensor.shape)}")
        for name, tensor in (("k", k), ("v", v)):
            if tensor.dtype != q.dtype or tensor.device != q.device:
                raise TypeError(f"q, k and v must share dtype and device: q is {q.dtype} on {q.device}, "
                                f"{name} is {tensor.dtype} on {tensor.device}")
        if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or not heads_fit(q, k):
            raise ValueError(f"shapes do not fit together: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                             "(expected q (B, H, Lq, D) and k, v both (B, Hkv, Lk, D), H a multiple of Hkv)")
        if self.causal and q.shape[-2] > k.shape[-2]:
            raise ValueError(f"causal attention with {q.shape[-2]} queries but only {k.shape[-2]} keys: the first "
                             "queries would see no key (queries are aligned to the end of the keys)")

    @classmethod
    def config_for_shape(cls, input_shape):
        return {"causal": True}

    @staticmethod
    def query_and_key_shapes(shape) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(q's shape, k's and v's shape) of one ``shape`` (batch, heads, seq, head_dim) for all three,
        or of a tuple of three shapes (q, k, v): queries shorter than keys, as in decoding, or k and v
        with fewer heads than q (grouped-query attention)."""
        if isinstance(shape[0], (tuple, list)):
            return tuple(shape[0]), tuple(shape[1])
        return tuple(shape), tuple(shape)

    def example_inputs(self, shape, dtype=None, device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of one ``shape`` (batch, heads, seq, head_dim), or of three shapes (q, k, v)."""
        dtype, device = default_device_and_dtype(dtype, device)
        query_shape, key_shape = self.query_and_key_shapes(shape)
        return tuple(torch.randn(s, dtype=dtype, device=device) for s in (query_shape, key_shape, key_shape))

    def visible_pairs(self, query_length: int, key_length: int) -> int:
        """How many (query, key) pairs the mask leaves: the work a kernel that skips masked tiles does."""
        if not self.causal:
            return query_length * key_length
        per_query = torch.arange(query_length, dtype=torch.int64) + (key_length - query_length) + 1
        if self.window is not None:
            per_query = per_query.clamp(max=self.window)
        return int(per_query.clamp(min=0).sum())

    def flops(self, shape, backward=False) -> int:
        (batch, heads, queries, head_dim), key_shape = self.query_and_key_shapes(shape)
        # Two matmuls forward (q·kᵀ and p·v), 2 FLOPs per multiply-add, over the visible pairs only.
        # The backward has five (recomputed q·kᵀ, dv, dp, dq, dk): 2.5× the forward.
        forward = 4 * batch * heads * head_dim * self.visible_pairs(queries, key_shape[2])
        return forward + (int(2.5 * forward) if backward else 0)

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        (batch, heads, queries, head_dim), key_shape = self.query_and_key_shapes(shape)
        query_tensor = batch * heads * queries * head_dim * dtype.itemsize
        key_tensor = batch * key_shape[1] * key_shape[2] * head_dim * dtype.itemsize  # at the kv heads (GQA)
        log_sum_exp = batch * heads * queries * 4
        forward = 2 * query_tensor + 2 * key_tensor + log_sum_exp  # read q, k, v; write o and the log-sum-exp
        # read q, k, v, o, do, lse; write dq, dk, dv
        backward_bytes = 4 * query_tensor + 4 * key_tensor + log_sum_exp
        return forward + (backward_bytes if backward else 0)

    def reference_modules(self, device: torch.device | None = None) -> dict[str, nn.Module]:
        """``F.scaled_dot_product_attention`` pinned to each backend this device offers."""
        from torch.nn.attention import SDPBackend

        backends = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"]
        if device is not None and torch.device(device).type == "cpu":
            backends = ["FLASH_ATTENTION", "MATH"]
        return {f"SDPA {name.split('_')[0].lower()}": PyTorchSDPA(self, getattr(SDPBackend, name))
                for name in backends if hasattr(SDPBackend, name)}


    def decode(self, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, key_lengths: torch.Tensor) -> torch.Tensor:
        """Append one new token per sequence to static caches and attend its query over them
        (``decode_attention_math`` says what it computes): the generation step that ``levels.gpt``
        captures as a CUDA graph. Causal by nature; inference only."""
        if (q.dim() != 4 or q.shape[-2] != 1 or k_new.shape != v_new.shape or k_cache.shape != v_cache.shape
                or k_new.shape != (*k_cache.shape[:2], 1, q.shape[-1]) or q.shape[0] != k_cache.shape[0]
                or q.shape[-1] != k_cache.shape[-1] or not heads_fit(q, k_cache)):
            raise ValueError(f"decode takes q of shape (batch, heads, 1, head_dim), k_new, v_new of shape (batch, "
                             f"kv_heads, 1, head_dim) and two caches of shape (batch, kv_heads, capacity, head_dim), "
                             f"heads a multiple of kv_heads, got q {tuple(q.shape)}, k_new "
                             f"{tuple(k_new.shape)}, v_new {tuple(v_new.shape)}, k_cache {tuple(k_cache.shape)}, "
                             f"v_cache {tuple(v_cache.shape)}")
        return self.compute_decode(q, k_new, v_new, k_cache, v_cache, key_lengths, self.window or 0,
                                   self.scale_for(q.shape[-1]))

    def compute_decode(self, q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale):
        return decode_attention_math(q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale)


class PyTorchSDPA(nn.Module):
    """``F.scaled_dot_product_attention`` on one backend (or a few to choose from). SDPA's ``is_causal`` aligns queries to the
    *start* of the keys, so other masks (end-aligned, windowed) go in as a boolean mask, which some
    backends (flash) refuse: that row then says so."""

    def __init__(self, spec: AttentionSpec, backend):
        super().__init__()
        self.spec = spec
        self.backend = backend  # one SDPBackend, or a list of those it may choose from

    def forward(self, q, k, v):
        from torch.nn.attention import sdpa_kernel

        spec = self.spec
        same_length_causal = spec.causal and spec.window is None and q.shape[-2] == k.shape[-2]
        mask = None
        if spec.causal and not same_length_causal:
            mask = visible_keys_mask(q.shape[-2], k.shape[-2], spec.window or 0, q.device)
        with sdpa_kernel(self.backend):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=same_length_causal,
                                                  scale=spec.scale_for(q.shape[-1]), enable_gqa=q.shape[1] != k.shape[1])


class AttentionNative(AttentionSpec):
    """Level 1: the full seq × seq score matrix, materialised, masked, softmaxed and read back."""

    level = "native"

    def compute(self, q, k, v):
        return attention_math(q, k, v, self.causal, self.window or 0, self.scale_for(q.shape[-1]))


@functools.cache
def _scripted_attention():
    return torchscript(attention_math)


class AttentionTorchScript(AttentionSpec):
    """Level 2: ``torch.jit.script`` of the same math (deprecated upstream; the legacy fuser). It can
    fuse the scale-and-mask into one kernel but still materialises the scores."""

    level = "torchscript"

    def compute(self, q, k, v):
        return _scripted_attention()(q, k, v, self.causal, self.window or 0, self.scale_for(q.shape[-1]))

    def compute_decode(self, q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale):
        return _scripted_decode_attention()(q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale)


@functools.cache
def _scripted_decode_attention():
    return torchscript(decode_attention_math)


@functools.cache
def _compiled_attention():
    return inductor(attention_math)


class AttentionCompiled(AttentionSpec):
    """Level 3: ``torch.compile`` of the level-1 math. Inductor fuses the mask and softmax and calls
    the vendor matmuls, but it does not invent flash attention: the scores still go through memory."""

    level = "compile"

    def compute(self, q, k, v):
        return _compiled_attention()(q, k, v, self.causal, self.window or 0, self.scale_for(q.shape[-1]))

    def compute_decode(self, q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale):
        return _compiled_decode_attention()(q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale)


@functools.cache
def _compiled_decode_attention():
    return inductor(decode_attention_math)


class _AttentionKernel(AttentionSpec):
    """Levels 4 and 5: flash-attention ops; ``backend`` and ``kernel_name`` are set by each level. The
    ops take q, k and v as they come, so heads split off a fused projection cost no autograd node (and
    no Python call) here: level 5's kernels read them where they lie, and write the output in the
    (batch, tokens, heads, head_dim) order that merging the heads back reads; level 4 copies them below
    autograd."""

    def check_inputs(self, q, k, v):
        # A training loop calls with one signature every time, a decode loop over a growing KV cache with
        # one whose key length grows by a token a step. The checks read nothing else, so a signature that
        # passed once passes again if its key lengths still agree (and, causal, still cover the queries):
        # the next call compares it and goes on (profiling/results/h100/attention-host-path.md). k.shape[:2]
        # and [3:] are all of the shape but the key length, and a k of another rank never matches.
        signature = ((q.shape, k.shape[:2], k.shape[3:], v.shape[:2], v.shape[3:], q.dtype, k.dtype, v.dtype,
                      q.device, k.device, v.device)
                     if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
                     else None)
        if (signature is not None and signature == self.__dict__.get("_signature_passed")
                and k.shape[2] == v.shape[2] and (not self.causal or q.shape[2] <= k.shape[2])):
            return
        super().check_inputs(q, k, v)
        if not attention_head_dim_supported(q.shape[-1]):
            raise ValueError(unsupported_head_dim_message(q.shape[-1], self.kernel_name))
        self.__dict__["_signature_passed"] = signature

    def compute(self, q, k, v):
        return self.backend().attention(q, k, v, self.causal, self.window or 0, self.scale_for(q.shape[-1]))

    def compute_decode(self, q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale):
        return self.backend().decode_attention(q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale)


class AttentionTriton(_AttentionKernel):
    """Level 4: Triton flash attention: tiled, online softmax, scores never written to memory,
    log-sum-exp saved; backward kernels recompute the scores tile by tile."""

    level = "triton"
    kernel_name = "Triton"
    backend = staticmethod(triton_backend)


class AttentionTritonVersion(AttentionTriton):
    """An earlier rung of level 4's causal attention forward, kept runnable so a lesson can time the
    climb (``triton_kernels.ATTENTION_VERSIONS`` says what each version adds): forward only, causal,
    as many k, v heads as q heads below version 4, which is level 4's own kernel."""

    def __init__(self, version: int = 4, scale: Optional[float] = None):
        super().__init__(causal=True, scale=scale)
        self.version = int(version)

    def compute(self, q, k, v):
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            raise NotImplementedError(f"attention version {self.version} is forward only (level 4's backward: "
                                      "levels.build('attention', 'triton'))")
        return self.backend().attention_forward_version(q.contiguous(), k.contiguous(), v.contiguous(), self.version,
                                                        self.scale_for(q.shape[-1]))


def attention_triton_versions(scale: Optional[float] = None) -> dict[str, AttentionTritonVersion]:
    """``{"version 1: ...": module, ...}``: every rung of level 4's causal attention forward, for
    ``compare_optimization_levels``."""
    versions = triton_backend().ATTENTION_VERSIONS
    return {f"version {version}: {what}": AttentionTritonVersion(version, scale) for version, what in versions.items()}


class AttentionCUDA(_AttentionKernel):
    """Level 5: CUDA flash attention on tensor cores (mma.sync), and a tiled C++ CPU version with
    the same online-softmax algorithm."""

    level = "cuda"
    kernel_name = "CUDA"
    backend = staticmethod(cuda_backend)


IMPLEMENTATIONS = {
    "native": AttentionNative,
    "torchscript": AttentionTorchScript,
    "compile": AttentionCompiled,
    "triton": AttentionTriton,
    "cuda": AttentionCUDA,
}
