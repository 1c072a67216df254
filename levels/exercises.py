"""Reference solutions of the lessons' PyTorch-level exercises (levels 1-3 territory).

The notebooks give the learner a skeleton and a check (``profiling.lessons.check_exercise``); these
are our answers, kept out of the notebooks and run through the same checks by
``tests/test_exercises.py``. The Triton exercises' answers are in ``triton_kernels/exercises.py``.

    windowed_attention(q, k, v, window)           lesson 04   a sliding-window mask, end-aligned queries
    post_norm_block(block, x)                     lesson 06   the original transformer's block order
    greedy_decode_with_graph(model, prompt, n)    lesson 07   a CUDA graph around the decode step
    adamw_by_hand(param, grad, m, v, step, ...)   lesson 08   AdamW from the textbook formula
"""

from __future__ import annotations

import torch

from .gpt import GPTSpec, _StaticCacheDecoder


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Causal attention in which each query sees only the ``window`` most recent keys (itself included).

    Notice two things. Queries are the *last* positions when there are fewer queries than keys (a
    decode step with a cache), so query i sits at i + (keys − queries), not at i. And the mask is
    applied to the scores before the softmax, as −inf, so masked keys get probability exactly 0."""
    queries, keys = q.shape[-2], k.shape[-2]
    query_positions = torch.arange(queries, device=q.device)[:, None] + (keys - queries)
    key_positions = torch.arange(keys, device=q.device)[None, :]
    visible = (key_positions <= query_positions) & (key_positions > query_positions - window)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def post_norm_block(block, x: torch.Tensor) -> torch.Tensor:
    """The 2017 transformer's order, LayerNorm *after* each residual add, from a GPT-2 block's parts:

        h = ln_1(x + attn(x)),   y = ln_2(h + mlp(h))

    Notice: the same parts and the same FLOPs as GPT-2's pre-norm block (``residual_block``); only
    where the normalisation sits differs. Pre-norm leaves the residual stream itself un-normalised,
    which is what lets deep stacks train without warm-up tricks; post-norm's outputs are always
    normalised, so the two blocks compute different functions of the same weights."""
    h = block.ln_1(x + block.attn(x))
    return block.ln_2(h + block.mlp(h))


@torch.no_grad()
def greedy_decode_with_graph(model: GPTSpec, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding in which one decode step is captured as a CUDA graph and replayed per token.

    Notice the rules a graph imposes, all visible here. The step must read and write fixed buffers
    (``decoder.token`` in, the returned logits out, a static KV cache); it must not allocate, copy to
    the host or compile during capture, so it is run once first on a side stream (a warm-up) whose
    side effect, advancing the position, is undone. On the CPU there is no graph: the same static step
    runs eagerly, so the tokens, which are the check, are the same."""
    decoder = _StaticCacheDecoder(model, prompt, capture=False)
    logits = decoder.prefill(prompt)
    tokens = [prompt, logits[:, -1].argmax(dim=-1, keepdim=True)]
    step = decoder._step
    if prompt.is_cuda:
        side_stream = torch.cuda.Stream(prompt.device)
        side_stream.wait_stream(torch.cuda.current_stream(prompt.device))
        with torch.cuda.stream(side_stream):
            decoder._step()  # warm-up: cuBLAS handles, Triton compiles, none allowed during capture
            decoder.position.position.sub_(1)  # the warm-up advanced the position; undo it
        torch.cuda.current_stream(prompt.device).wait_stream(side_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_logits = decoder._step()

        def step():
            graph.replay()
            return graph_logits
    for _ in range(new_tokens - 1):
        decoder.token.copy_(tokens[-1])
        tokens.append(step()[:, -1].argmax(dim=-1, keepdim=True))
    return torch.cat(tokens, dim=1)


def adamw_by_hand(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """One AdamW step of one tensor, in place, from the textbook form; ``step`` counts from 1.

    Notice the temporaries: m̂, v̂ and λ·p are each a full tensor, so this dispatches 14 ops (lesson
    08 counts them) where ``adamw_math`` folds the bias corrections into two host scalars and needs
    10, and the fused kernels of levels 4 and 5 one."""
    beta1, beta2 = betas
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).add_(grad * grad, alpha=1 - beta2)
    exp_avg_hat = exp_avg / (1 - beta1**step)
    exp_avg_sq_hat = exp_avg_sq / (1 - beta2**step)
    param.sub_(lr * (exp_avg_hat / (exp_avg_sq_hat.sqrt() + eps) + weight_decay * param))
