"""The lessons' exercises: every reference solution passes its check, and every check can fail.

A check that no answer passes would leave the learner stuck; one that a wrong answer passes would
teach nothing. So each exercise is run three ways through ``profiling.lessons.exercise_verdict``,
the function behind the notebooks' check cells: our solution (pass), a typical mistake (fail), and
the untouched skeleton, which raises NotImplementedError (not implemented yet).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import levels.exercises
from levels.attention import attention_math
from profiling.lessons import EXERCISES, exercise_verdict


def _triton(name):
    def solution(*args, **kwargs):
        import triton_kernels.exercises  # imported on first use: it sets up Triton (its interpreter on a CPU)

        return getattr(triton_kernels.exercises, name)(*args, **kwargs)
    return solution


SOLUTIONS = {
    "relu_squared": _triton("relu_squared"),
    "rms_norm": _triton("rms_norm"),
    "log_softmax": _triton("log_softmax"),
    "windowed_attention": levels.exercises.windowed_attention,
    "linear_bias_residual": _triton("linear_bias_residual"),
    "post_norm_block": levels.exercises.post_norm_block,
    "cuda_graph_decode": levels.exercises.greedy_decode_with_graph,
    "adamw_step": levels.exercises.adamw_by_hand,
}


def _adamw_without_bias_correction(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    exp_avg.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    exp_avg_sq.mul_(betas[1]).add_(grad * grad, alpha=1 - betas[1])
    param.sub_(lr * (exp_avg / (exp_avg_sq.sqrt() + eps) + weight_decay * param))


MISTAKES = {
    "relu_squared": lambda x: torch.relu(x),  # forgot the square
    "rms_norm": lambda x, weight, eps: F.layer_norm(x, x.shape[-1:], weight, None, eps),  # centred: LayerNorm
    "log_softmax": lambda x: torch.log(torch.softmax(x, dim=-1)),  # log of an underflowed 0 is −inf
    "windowed_attention": lambda q, k, v, window: attention_math(q, k, v, True, 0, q.shape[-1] ** -0.5),  # no window
    "linear_bias_residual": lambda x, weight, bias, residual: F.linear(x, weight, bias),  # forgot the residual
    "post_norm_block": lambda block, x: block(x),  # GPT-2's pre-norm block
    "cuda_graph_decode": lambda model, prompt, new_tokens: model.generate(  # sampled, not greedy
        prompt, new_tokens, temperature=1.0, generator=torch.Generator(prompt.device).manual_seed(0)),
    "adamw_step": _adamw_without_bias_correction,
}


def _skeleton(*args, **kwargs):
    raise NotImplementedError("fill in the skeleton")


def test_every_exercise_has_a_solution_and_a_mistake():
    assert set(SOLUTIONS) == set(EXERCISES) == set(MISTAKES)


@pytest.mark.parametrize("name", list(EXERCISES))
def test_reference_solution_passes_its_check(name):
    assert exercise_verdict(name, SOLUTIONS[name]).startswith(f"exercise {name}: pass")


@pytest.mark.parametrize("name", list(EXERCISES))
def test_typical_mistake_fails_its_check(name):
    assert exercise_verdict(name, MISTAKES[name]).startswith(f"exercise {name}: fail: ")


@pytest.mark.parametrize("name", list(EXERCISES))
def test_untouched_skeleton_is_not_implemented_yet(name):
    assert exercise_verdict(name, _skeleton) == f"exercise {name}: not implemented yet"


def test_unknown_exercise_names_the_exercises():
    with pytest.raises(KeyError, match="relu_squared"):
        exercise_verdict("relu_cubed", _skeleton)
