"""Decode attention in Triton: one new token per sequence appended to a static KV cache and attended,
the step generation replays as a CUDA graph.

What it computes
    K[b, h, n − 1] = k_new[b, h],  V[b, h, n − 1] = v_new[b, h]            (in place)
    out[b, h] = softmax(q[b, h]·K[b, h, :n]ᵀ·scale)·V[b, h, :n],   n = key_lengths[b]
    over the first n positions of caches preallocated to ``capacity`` (or, with a window W > 0, over
    the last min(W, n) of them). The query is the newest token: it sits at position n − 1.

Kernel
    ``_attention_decode_kernel``   one program per (sequence, head): the query and the new key and value
                                   in registers; the new key and value stored to the cache; the n − 1
                                   keys before them streamed in blocks of BLOCK_N with an online softmax
                                   (running maximum, rescaled sum and output), as the flash forward does;
                                   the new key folded in last, from registers

The one idea
    n is read from device memory, not passed from Python: a CUDA graph freezes its launches'
    arguments at capture, so a count passed by value would stay the count of the step that was
    captured. With the count on the device, one captured launch serves every step, and each step reads
    only the keys it needs (a mask over the whole cache would read all ``capacity`` of them). Writing
    the new key and value here, instead of in a copy kernel before, saves two launches a layer: a
    captured decode step of GPT-2 small is ~150 small kernels, so each one is a share of its time.
    One query is a matrix-vector product: a dot product of the query with each key of a block and a
    weighted sum of the value rows, in registers; tensor cores need at least 16 query rows to help.

Grouped-query attention
    q is (B, H, 1, D), k_new, v_new and the caches have Hkv heads (H a multiple of Hkv). A program owns
    a query head and reads kv head h // (H / Hkv); only the group's first program writes the new key
    and value to the cache (the others read them from k_new, v_new, as it does).

Limits
    head_dim a multiple of 8 up to 256 (the row padded to a power of two, the extra columns masked);
    q, k_new, v_new may be strided (heads split off the fused projection; their last dim contiguous;
    k_new and v_new alike), the caches contiguous (B, Hkv, capacity, D),
    key_lengths (B,) int32 on q's device, 1 ≤ n ≤ capacity (read on the device, so not checked: an n
    outside is clamped to that range).
    float16, bfloat16, float32, float64 on the GPU, float32 and float64 under the interpreter. No
    backward: generation runs under torch.no_grad.

Check
    python -m pytest tests -k "static_cache and triton"
"""

import torch
import triton
import triton.language as tl

from cuda_kernels.limits import attention_head_dim_supported, unsupported_head_dim_message

from .attention_tiles import padded_head_dim
from .launch import check_inputs, compute_dtype, exp_on_sfu, launch, on_device, require, split_float

DECODE_VALUES_PER_STEP = 64 * 128
"""Values of k per step of the loop: 64 keys × 128 dims is 8K values of k and as many of v in flight per
program, 64 registers a thread at 4 warps. Wider rows take fewer keys a step (32 at a 256-wide tile),
so that the registers stay the same."""


def _check_decode_shapes(op: str, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, key_lengths: torch.Tensor, window: int) -> None:
    require(q.dim() == 4 and q.shape[2] == 1 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
            and k_new.shape == v_new.shape and k_new.shape == (*k_cache.shape[:2], 1, q.shape[3])
            and k_cache.shape[0] == q.shape[0] and k_cache.shape[3] == q.shape[3]
            and (q.shape[1] == k_cache.shape[1] or (k_cache.shape[1] > 0 and q.shape[1] % k_cache.shape[1] == 0)),
            lambda: f"{op}: q must be (batch, heads, 1, head_dim), k_new and v_new (batch, kv_heads, 1, head_dim) and "
                    f"the caches (batch, kv_heads, capacity, head_dim), heads a multiple of kv_heads, got q "
                    f"{tuple(q.shape)}, k_new {tuple(k_new.shape)}, v_new {tuple(v_new.shape)}, "
                    f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}")
    require(all(t.dtype == q.dtype for t in (k_new, v_new, k_cache, v_cache)),
            lambda: f"{op}: q, k_new, v_new and the caches must share a dtype, got {q.dtype}, {k_new.dtype}, "
                    f"{v_new.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    require(attention_head_dim_supported(q.shape[3]), lambda: f"{op}: {unsupported_head_dim_message(q.shape[3], 'Triton')}")
    require(key_lengths.dtype == torch.int32 and key_lengths.shape == q.shape[:1],
            lambda: f"{op}: key_lengths must be an int32 tensor of shape ({q.shape[0]},), got "
                    f"{key_lengths.dtype} {tuple(key_lengths.shape)}")
    require(window >= 0, lambda: f"{op}: window must be ≥ 0 (0: no window), got {window}")
    require(q.stride(3) == 1 and k_new.stride(3) == 1 and v_new.stride() == k_new.stride()
            and k_cache.is_contiguous() and v_cache.is_contiguous(),
            lambda: f"{op}: q, k_new and v_new must have a contiguous last dim, k_new and v_new share strides, and the "
                    f"caches be contiguous")


@triton.jit
def _attention_decode_kernel(Q, KNew, VNew, K, V, Out, KeyLengths, heads, group, capacity, stride_qb, stride_qh,
                             stride_kvb, stride_kvh, window, scale_high, scale_low, HEAD_DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
                             COMPUTE: tl.constexpr):
    sequence_head = tl.program_id(0).to(tl.int64)
    sequence, head = sequence_head // heads, sequence_head % heads
    kv_sequence_head = sequence_head // group  # = sequence · kv_heads + head // group
    dims = tl.arange(0, BLOCK_D)
    in_row = dims < HEAD_DIM  # the padding columns past HEAD_DIM read 0 and are never written
    scale = tl.cast(scale_high, COMPUTE) + tl.cast(scale_low, COMPUTE)
    q = tl.load(Q + sequence * stride_qb + head * stride_qh + dims, mask=in_row, other=0.0).to(COMPUTE) * scale
    kv_token = sequence * stride_kvb + head // group * stride_kvh + dims
    k_new = tl.load(KNew + kv_token, mask=in_row, other=0.0)
    v_new = tl.load(VNew + kv_token, mask=in_row, other=0.0)
    filled = tl.minimum(tl.maximum(tl.load(KeyLengths + sequence), 1), capacity)  # the new token is one
    first = 0
    if WINDOWED:
        first = tl.maximum(filled - window, 0)
    K += kv_sequence_head * capacity * HEAD_DIM
    V += kv_sequence_head * capacity * HEAD_DIM
    if head % group == 0:  # one program of the group stores, for the steps after this one
        tl.store(K + (filled - 1) * HEAD_DIM + dims, k_new, mask=in_row)
        tl.store(V + (filled - 1) * HEAD_DIM + dims, v_new, mask=in_row)
    running_max = tl.full((), float("-inf"), COMPUTE)
    running_sum = tl.zeros((), COMPUTE)
    acc = tl.zeros((BLOCK_D,), COMPUTE)
    for start in range(first, filled - 1, BLOCK_N):  # the keys cached before this step
        keys = start + tl.arange(0, BLOCK_N)
        visible = keys < filled - 1
        offsets = keys.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :]
        k = tl.load(K + offsets, mask=visible[:, None] & in_row[None, :], other=0.0).to(COMPUTE)
        scores = tl.where(visible, tl.sum(k * q[None, :], axis=1), float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        rescale = exp_on_sfu(running_max - new_max)
        p = exp_on_sfu(scores - new_max)
        v = tl.load(V + offsets, mask=visible[:, None] & in_row[None, :], other=0.0).to(COMPUTE)
        acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
        running_sum = running_sum * rescale + tl.sum(p, axis=0)
        running_max = new_max
    # the new key, from registers: it is always visible (the query is its own token)
    score = tl.sum(k_new.to(COMPUTE) * q, axis=0)
    new_max = tl.maximum(running_max, score)
    rescale = exp_on_sfu(running_max - new_max)
    p = exp_on_sfu(score - new_max)
    out = (acc * rescale + p * v_new.to(COMPUTE)) / (running_sum * rescale + p)
    tl.store(Out + sequence_head * HEAD_DIM + dims, out.to(Out.dtype.element_ty), mask=in_row)


def launch_attention_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, key_lengths: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    _check_decode_shapes("decode_attention", q, k_new, v_new, k_cache, v_cache, key_lengths, window)
    check_inputs("decode_attention", q, k_new, v_new, k_cache, v_cache)
    batch, heads, _, head_dim = q.shape
    out = torch.empty((batch, heads, 1, head_dim), dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    with on_device(q):
        launch(_attention_decode_kernel, (batch * heads,), q, k_new, v_new, k_cache, v_cache, out, key_lengths, heads,
               heads // k_cache.shape[1], k_cache.shape[2], q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
               window, *split_float(scale), HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
               BLOCK_N=DECODE_VALUES_PER_STEP // max(128, padded_head_dim(head_dim)), WINDOWED=window > 0,
               COMPUTE=compute_dtype(q.dtype), num_warps=4)
    return out


# --- registration: op and fake (no autograd: inference only) -----------------------------------------


@torch.library.custom_op("triton_kernels::decode_attention", mutates_args=("k_cache", "v_cache"))
def decode_attention_op(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, key_lengths: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    return launch_attention_decode(q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale)


@decode_attention_op.register_fake
def _decode_attention_fake(q, k_new, v_new, k_cache, v_cache, key_lengths, window, scale):
    _check_decode_shapes("decode_attention", q, k_new, v_new, k_cache, v_cache, key_lengths, window)
    return q.new_empty((q.shape[0], q.shape[1], 1, q.shape[3]))


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, key_lengths: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Write each sequence's new key and value at position ``key_lengths[b] − 1`` of the static caches
    and attend its query over the first ``key_lengths[b]`` positions (see the module docstring);
    inference only. torch.compile sees the registered op."""
    if torch.is_grad_enabled() and (q.requires_grad or k_new.requires_grad or v_new.requires_grad):
        # The output would carry no graph: the gradients of everything before it would be silently missing.
        raise RuntimeError("triton_kernels::decode_attention is inference only (it has no backward): call it under "
                           "torch.no_grad(), or use attention() where gradients are wanted")
    if torch.compiler.is_compiling():
        return decode_attention_op(q, k_new, v_new, k_cache, v_cache, key_lengths, int(window), float(scale))
    return launch_attention_decode(q, k_new, v_new, k_cache, v_cache, key_lengths, int(window), float(scale))
