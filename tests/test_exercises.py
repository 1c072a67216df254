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
    "swap_layer_norms": levels.exercises.swap_layer_norms,
    "average_gradients": levels.exercises.average_gradients,
}


def _adamw_without_bias_correction(param, grad, exp_avg, exp_avg_sq, step, lr, betas, eps, weight_decay):
    exp_avg.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
    exp_avg_sq.mul_(betas[1]).add_(grad * grad, alpha=1 - betas[1])
    param.sub_(lr * (exp_avg / (exp_avg_sq.sqrt() + eps) + weight_decay * param))


def _swap_layer_norms_with_copies(model, level):
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.LayerNorm):
            swapped = levels.build("layer_norm", level, normalized_shape=module.normalized_shape, eps=module.eps)
            swapped.load_state_dict(module.state_dict())  # copies: the model's Parameters are orphaned
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, swapped)


@torch.no_grad()
def _sum_gradients(replicas):
    for parameters in zip(*(replica.parameters() for replica in replicas)):
        total = sum(parameter.grad for parameter in parameters)
        for parameter in parameters:
            parameter.grad.copy_(total)


@torch.no_grad()
def _average_into_first_replica_only(replicas):
    for first, *others in zip(*(replica.parameters() for replica in replicas)):
        first.grad.copy_(torch.stack([first.grad, *(parameter.grad for parameter in others)]).mean(dim=0))


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
    "swap_layer_norms": _swap_layer_norms_with_copies,
    "average_gradients": _sum_gradients,
}

FURTHER_MISTAKES = [
    ("swap_layer_norms", lambda model, level: None, "transformer.h.0.ln_1 is a LayerNorm, not level native's"),
    ("swap_layer_norms", _swap_layer_norms_with_copies, "holds copies of the LayerNorm's weight and bias"),
    ("average_gradients", _average_into_first_replica_only, "replica 1's gradient of"),
]
"""More wrong answers, each with what its verdict must say: the checks that are not an error size."""

REQUIREMENTS = {"swap_layer_norms": "transformers"}
"""Exercises on an optional dependency: skipped where it is missing, as tests/test_huggingface.py is."""


def _exercise(name):
    if name in REQUIREMENTS:
        pytest.importorskip(REQUIREMENTS[name], reason=f"exercise {name} needs {REQUIREMENTS[name]}")
    return name


def _skeleton(*args, **kwargs):
    raise NotImplementedError("fill in the skeleton")


def test_every_exercise_has_a_solution_and_a_mistake():
    assert set(SOLUTIONS) == set(EXERCISES) == set(MISTAKES)


@pytest.mark.parametrize("name", list(EXERCISES))
def test_reference_solution_passes_its_check(name):
    assert exercise_verdict(_exercise(name), SOLUTIONS[name]).startswith(f"exercise {name}: pass")


@pytest.mark.parametrize("name", list(EXERCISES))
def test_typical_mistake_fails_its_check(name):
    assert exercise_verdict(_exercise(name), MISTAKES[name]).startswith(f"exercise {name}: fail: ")


@pytest.mark.parametrize(("name", "mistake", "reason"), FURTHER_MISTAKES)
def test_further_mistakes_fail_saying_what_is_wrong(name, mistake, reason):
    verdict = exercise_verdict(_exercise(name), mistake)
    assert verdict.startswith(f"exercise {name}: fail: ") and reason in verdict, verdict


@pytest.mark.parametrize("name", list(EXERCISES))
def test_untouched_skeleton_is_not_implemented_yet(name):
    assert exercise_verdict(_exercise(name), _skeleton) == f"exercise {name}: not implemented yet"


def test_unknown_exercise_names_the_exercises():
    with pytest.raises(KeyError, match="relu_squared"):
        exercise_verdict("relu_cubed", _skeleton)
