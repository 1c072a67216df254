"""Lesson 06's prediction: a GPT-2 block's forward on an H100, kernel by kernel, from a roofline.

Each kernel a level launches takes the longer of two times: its FLOPs at the matrix units' rate, its
bytes at the copy bandwidth. Summed per part (ln_1, the attention's projections and heads, ln_2, the
feed-forward, the residual adds), that predicts where each level's time goes before anything is
measured; the lesson then sets the measured block beside it.

The rates are ones measured on an H100 in this project (bfloat16), not datasheet peaks:

* the copy bandwidth, from ``profiling/results/h100/environment.json``;
* cuBLAS on the GPT-2 feed-forward's two matmuls, 38.7 GFLOP each at 8192 tokens: 63 µs with the shared
  dimension K = 768, 56 µs with K = 3072; our Triton matmul on the same two: 443 and 515 TFLOP/s (the
  header of ``triton_kernels/matmul.py``). The q·k·v and output projections (K = 768, narrower outputs)
  get the K = 768 rates, a little optimistic;
* our Triton flash attention, causal, (4, 16, 4096, 64): 0.39 ms (``triton_kernels/attention_forward.py``).
  Level 5's CUDA flash attention was measured at head_dim 128 only, at 0.6× the Triton kernel's speed;
  both fused levels get the Triton kernel's rate here, which flatters level 5.

The passes between the matmuls are the earlier lessons' counts (forward, no gradient): LayerNorm 12 at
level 1 and 2 fused (lesson 02); the score matrix 6 trips between its two matmuls at level 1 (scale,
mask, softmax each read and write it) and 2 at level 3 (one fused softmax), none at levels 4 and 5
(flash attention, lesson 04); the hidden matrix 24 trips for level 1's bias + GELU, 2 for one fused
pass, 0 in level 4's matmul epilogue (lesson 05); the residual adds 3 passes each at every level.
"""

from __future__ import annotations

import json

import torch

import levels

from .lessons import RESULTS

COPY_BYTES_PER_S = json.loads((RESULTS / "environment.json").read_text())["copy_bandwidth_gb_per_s"] * 1e9
FEED_FORWARD_MATMUL_FLOPS = 2 * 8192 * 768 * 3072
CUBLAS_FLOPS_PER_S = {768: FEED_FORWARD_MATMUL_FLOPS / 63e-6, 3072: FEED_FORWARD_MATMUL_FLOPS / 56e-6}  # by K
TRITON_FLOPS_PER_S = {768: 443e12, 3072: 515e12}
PARTS = ("ln_1", "attn projections", "attention heads", "ln_2", "mlp", "residual adds")
LAYER_NORM_PASSES = {1: 12, 3: 2, 4: 2, 5: 2}
SCORE_TRIPS_BETWEEN_MATMULS = {1: 6, 3: 2}  # levels 4 and 5 keep the scores on chip
HIDDEN_TRIPS_BETWEEN_MATMULS = {1: 24, 3: 2, 4: 0, 5: 2}

_CAUSAL = levels.build("attention", "native", causal=True)
_FULL = levels.build("attention", "native", causal=False)
FLASH_FLOPS_PER_S = _CAUSAL.flops((4, 16, 4096, 64)) / 0.39e-3


def block_kernels(level: int, batch: int = 8, seq: int = 1024, n_embd: int = 768, n_head: int = 12):
    """(part, FLOPs, bytes, FLOP/s of the unit doing them) for each kernel of one forward, bfloat16."""
    tokens, itemsize = batch * seq, 2
    activation = tokens * n_embd * itemsize  # bytes of one (tokens, n_embd) tensor
    hidden, scores = 4 * activation, batch * n_head * seq * seq * itemsize
    heads = (batch, n_head, seq, n_embd // n_head)
    rate = TRITON_FLOPS_PER_S if level == 4 else CUBLAS_FLOPS_PER_S

    def matmul(part, k, n):  # (tokens, k)·(k, n): read the input and the weight, write the output
        return (part, 2 * tokens * k * n, (tokens * (k + n) + k * n) * itemsize, rate[k])

    def passes(part, count, size):  # elementwise or row-reduction work: bytes only
        return (part, 0, count * size, float("inf"))

    kernels = [passes("ln_1", LAYER_NORM_PASSES[level], activation), passes("ln_2", LAYER_NORM_PASSES[level], activation),
               matmul("attn projections", n_embd, 3 * n_embd), matmul("attn projections", n_embd, n_embd),
               matmul("mlp", n_embd, 4 * n_embd), passes("mlp", HIDDEN_TRIPS_BETWEEN_MATMULS[level], hidden),
               matmul("mlp", 4 * n_embd, n_embd), passes("residual adds", 2 * 3, activation)]
    if level == 1:
        kernels.append(passes("mlp", 2, activation))  # the proj bias, added on its own
    if level in SCORE_TRIPS_BETWEEN_MATMULS:
        # Every (query, key) pair is multiplied, then masked; q·kᵀ (K = 64) is bound by writing the scores.
        pairs_flops = _FULL.flops(heads) // 2
        kernels += [("attention heads", pairs_flops, 2 * activation + scores, rate[768]),  # q·kᵀ
                    passes("attention heads", SCORE_TRIPS_BETWEEN_MATMULS[level], scores),
                    ("attention heads", pairs_flops, scores + 2 * activation, rate[768])]  # p·v
    else:
        kernels.append(("attention heads", _CAUSAL.flops(heads), _CAUSAL.bytes_moved(heads, torch.bfloat16),
                        FLASH_FLOPS_PER_S))
    return kernels


def kernel_microseconds(flops: float, moved: float, flops_per_s: float) -> float:
    """The roofline: the slower of the FLOPs at the unit's rate and the bytes at the copy bandwidth."""
    return max(flops / flops_per_s, moved / COPY_BYTES_PER_S) * 1e6


def predicted_microseconds(level: int, batch: int = 8, seq: int = 1024) -> dict[str, float]:
    """{part: µs} on an H100: each kernel at the slower of its FLOPs and its bytes, summed per part."""
    microseconds = dict.fromkeys(PARTS, 0.0)
    for part, flops, moved, flops_per_s in block_kernels(level, batch, seq):
        microseconds[part] += kernel_microseconds(flops, moved, flops_per_s)
    return microseconds
