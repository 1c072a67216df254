"""Reference solutions of the lessons' PyTorch-level exercises (levels 1-3 territory).

The notebooks give the learner a skeleton and a check (``profiling.lessons.check_exercise``); these
are our answers, kept out of the notebooks and run through the same checks by
``tests/test_exercises.py``. The Triton exercises' answers are in ``triton_kernels/exercises.py``.

    windowed_attention(q, k, v, window)           lesson 04   a sliding-window mask, end-aligned queries
    post_norm_block(block, x)                     lesson 06   the original transformer's block order
    greedy_decode_with_graph(model, prompt, n)    lesson 07   a CUDA graph around the decode step
    adamw_by_hand(param, grad, m, v, step, ...)   lesson 08   AdamW from the textbook formula
    swap_layer_norms(model, level)                lesson 10   a transformers GPT-2's LayerNorms at a level
    average_gradients(replicas)                   lesson 11   DDP's all-reduce, on replicas in one process
"""

from __future__ import annotations

import torch
from torch import nn

from .gpt import GPTSpec, StaticCacheDecoder
from .huggingface import level_layer_norm


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
    decoder = StaticCacheDecoder(model, prompt, capture=False)
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


def swap_layer_norms(model: nn.Module, level: str) -> None:
    """Every ``nn.LayerNorm`` of ``model`` (a ``transformers`` GPT-2: each block's ``ln_1`` and ``ln_2``,
    and ``ln_f``) replaced, in place, by ``level``'s LayerNorm holding the same weight and bias.

    Notice two things. The module is replaced in its *parent* (``setattr`` on the block), since a
    module does not know where it hangs. And the new module is given the old one's Parameters
    themselves, not copies (``load_state_dict`` would copy): an optimizer made earlier keeps training
    the tensors the model computes with, and no memory is spent twice. ``levels.huggingface.apply``
    swaps the LayerNorms with the same helper, and the MLP, attention and LM head besides."""
    layer_norms = [name for name, module in model.named_modules() if isinstance(module, nn.LayerNorm)]
    for name in layer_norms:  # listed first: the loop changes the modules it would walk
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, level_layer_norm(model.get_submodule(name), level))


@torch.no_grad()
def average_gradients(replicas: list[nn.Module]) -> None:
    """Every parameter's gradient, in every replica, replaced by its mean over the replicas: what DDP's
    all-reduce leaves on each process after the backward.

    Notice that each replica gets the mean, not only the first: the replicas stay one model only if
    every one of them takes the same optimizer step. On real processes each holds one replica and this
    loop is ``dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)`` per gradient (DDP does it per bucket of
    gradients, while the backward still runs)."""
    for parameters in zip(*(replica.parameters() for replica in replicas)):
        mean = torch.stack([parameter.grad for parameter in parameters]).mean(dim=0)
        for parameter in parameters:
            parameter.grad.copy_(mean)
