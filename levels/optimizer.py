"""AdamW (Loshchilov & Hutter, 2019) at five levels, each a ``torch.optim.Optimizer``.

An optimizer step does almost no arithmetic per parameter (a dozen operations) and moves a lot of
bytes: every parameter, its gradient and its two moments are read, and the parameter and the moments
written: 7 tensors' worth of traffic for GPT-2 small's 124M parameters, about 1.7 GB in bfloat16 per
step. So it is memory-bound, and how fast it runs is decided by how many times those bytes cross
memory and how many kernels it takes. Level 1 is the textbook loop, ten tensor ops per parameter
(each a pass over memory) for each of GPT-2's 148 parameter tensors: 1480 kernel launches a step.
Level 4 is one Triton launch over every parameter (a table of pointers and sizes tells each program
which slice of which tensor is its own); level 5 is CUDA's multi-tensor apply, the pattern PyTorch's
fused optimizers and Apex use: each launch carries the addresses of up to 512 tensors in its
arguments. Both read and write each byte once.

    optimizer = levels.build_optimizer("cuda", model.parameters(), lr=3e-4, weight_decay=0.1)
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from typing import ClassVar, Iterable, List, NamedTuple

import torch

from .backends import cuda_backend, inductor, torchscript, triton_backend
from .spec import resolve_level


def adamw_math(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
               exp_avg_sqs: List[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
               weight_decay: float, step_size: float, bias_correction2_sqrt: float) -> None:
    """One AdamW step as a PyTorch user writes it (torch.optim.AdamW's single-tensor path), in place:

        p  ← p · (1 − lr·weight_decay)                       decoupled weight decay
        m  ← m + (1 − β1)·(g − m)                             first moment (a running mean of g)
        v  ← β2·v + (1 − β2)·g²                               second moment (of g²)
        p  ← p − step_size · m / (√v / bias_correction2_sqrt + eps)

    with step_size = lr / (1 − β1ᵗ) and bias_correction2_sqrt = √(1 − β2ᵗ) for step t."""
    for i in range(len(params)):
        param, grad, exp_avg, exp_avg_sq = params[i], grads[i], exp_avgs[i], exp_avg_sqs[i]
        param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denominator = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
        # Not addcdiv_(..., value=-step_size): a Scalar argument that changes every step would make
        # torch.compile (level 3) specialise on it and compile again each step; a float in arithmetic
        # with a tensor stays symbolic.
        param.sub_(exp_avg / denominator * step_size)


class AdamWSpec(torch.optim.Optimizer):
    """AdamW with decoupled weight decay, as ``torch.optim.AdamW`` (amsgrad and maximize off).

    Args:
        params: parameters (or parameter groups) to optimise; lr: learning rate; betas: (β1, β2), the
            decay rates of the two moments; eps: added to the denominator; weight_decay: decoupled
            decay per unit of learning rate.

    State per parameter: ``step`` (an int), ``exp_avg`` and ``exp_avg_sq`` (the moments, in the
    parameter's dtype, as torch.optim.AdamW keeps them). Each level subclasses this and implements
    only ``update``, which applies one step to lists of tensors that share a step count.
    """

    level: ClassVar[str] = ""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must each lie in [0, 1), got {betas}")
        if not eps >= 0.0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(eps),
                                      weight_decay=float(weight_decay)))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # Parameters that share a step count share the bias corrections: one update call each (in
            # practice one call per group, since every parameter gets a gradient every step).
            # The loop runs per parameter tensor (148 for GPT-2) on every step, so it is written for the
            # host: each value read once into a local, no tuples or zips built per parameter.
            by_step: dict[int, tuple[list, list, list, list]] = {}
            state_of = self.state
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise TypeError("AdamW does not support sparse gradients")
                state = state_of[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                step = state["step"] = state["step"] + 1
                lists = by_step.get(step)
                if lists is None:
                    lists = by_step[step] = ([], [], [], [])
                lists[0].append(param)
                lists[1].append(grad)
                lists[2].append(state["exp_avg"])
                lists[3].append(state["exp_avg_sq"])
            for step, (params, grads, exp_avgs, exp_avg_sqs) in by_step.items():
                self.update(params, grads, exp_avgs, exp_avg_sqs, group["lr"], beta1, beta2, group["eps"],
                            group["weight_decay"], step)
        return loss

    def update(self, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step) -> None:
        raise NotImplementedError(f"{type(self).__name__} is a spec; build a level with levels.build_optimizer()")


def bias_corrections(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(step_size, bias_correction2_sqrt) of ``adamw_math`` at step ``step``, computed once on the host."""
    return lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step)


class AdamWNative(AdamWSpec):
    """Level 1: the loop above, ten tensor ops (ten passes over memory, ten launches) per parameter."""

    level = "native"

    def update(self, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
        adamw_math(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay,
                   *bias_corrections(lr, beta1, beta2, step))


@functools.cache
def _scripted_adamw():
    return torchscript(adamw_math)


class AdamWTorchScript(AdamWSpec):
    """Level 2: ``torch.jit.script`` of the same loop (deprecated upstream; the legacy fuser): the loop
    runs in TorchScript's interpreter instead of Python; its fuser fuses only the out-of-place chain
    (the denominator and the step), not the in-place updates."""

    level = "torchscript"

    def update(self, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
        _scripted_adamw()(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay,
                          *bias_corrections(lr, beta1, beta2, step))


@functools.cache
def _compiled_adamw():
    return inductor(adamw_math)


class AdamWCompiled(AdamWSpec):
    """Level 3: ``torch.compile`` of the same loop: Inductor fuses each parameter's ten ops into one
    kernel, one launch per parameter tensor (148 for GPT-2). The first step compiles (a
    graph over all ~150 tensors: tens of seconds for GPT-2), and once more at the second step, where
    Dynamo finds the step size changed and makes the floats symbolic; from then on it runs what it has."""

    level = "compile"

    def update(self, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
        _compiled_adamw()(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay,
                          *bias_corrections(lr, beta1, beta2, step))


class _GroupPlan(NamedTuple):
    """What one parameter group's step reads that stays put from step to step."""

    params: list          # the group's parameters, as planned
    has_grad: tuple       # per parameter, whether it had a gradient (those without are skipped)
    trained: list         # the parameters with one
    states: list          # their state dicts, and in them:
    exp_avgs: list
    exp_avg_sqs: list
    steps: list           # their step counts, all equal
    launch: object        # its triton_kernels.AdamWStepPlan


_GRAD, _IS_SPARSE = operator.attrgetter("grad"), operator.attrgetter("is_sparse")
_STEP, _EXP_AVG, _EXP_AVG_SQ = (operator.itemgetter(key) for key in ("step", "exp_avg", "exp_avg_sq"))


def _same_objects(these: list, those: list) -> bool:
    """Whether two lists hold the same objects (``==`` on lists of tensors would compare their values)."""
    return len(these) == len(those) and all(map(operator.is_, these, those))


class _AdamWKernel(AdamWSpec):
    """Levels 4 and 5 hand the four lists to one op that updates them all in place. ``backend`` is set
    by each level."""

    def update(self, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step) -> None:
        self.backend().adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step)


class AdamWTriton(_AdamWKernel):
    """Level 4: one ``@triton.jit`` launch over every parameter, reading a table of their addresses.

    A planned step. ``AdamWSpec.step`` walks the parameters in Python, about a microsecond each, and the
    launcher then checks every tensor in Python too: for GPT-2's 148 parameters (592 tensors) that was
    0.6-0.75 ms of host time on a 2-core CPU, more than the GPU's whole step (0.42 ms on an H200), so the
    step ran at the host's pace. Yet from one step to the next only the gradients change. So after a
    step this optimizer keeps, per group, a plan: its parameters, their state and moments, and a
    ``triton_kernels.AdamWStepPlan``, which checks and tables the tensors once. A later step re-reads
    what the user could have changed, each read one pass in C (``map``) rather than a Python loop: the
    group's parameters, which have gradients, their state dicts, moments and step counts, and (the
    ``AdamWStepPlan``'s ``matches``) where the tensors are. If all is as planned it counts the step and
    launches; anything else (a closure, a gradient gained or lost, a sparse gradient, a replaced moment or
    state, ``load_state_dict``, a parameter moved) takes the general step, which checks everything, says
    what is wrong, and plans again."""

    level = "triton"
    backend = staticmethod(triton_backend)
    _plans: list | None = None
    _planned_state: dict | None = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None and self._step_as_planned():
            return None
        loss = super().step(closure)
        self._plans, self._planned_state = self._plan_groups(), self.state
        return loss

    def _plan_groups(self) -> list[_GroupPlan] | None:
        plans = []
        for group in self.param_groups:
            params = list(group["params"])
            has_grad = tuple(param.grad is not None for param in params)
            trained = [param for param, graded in zip(params, has_grad) if graded]
            states = [self.state[param] for param in trained]
            steps = list(map(_STEP, states))
            if len(set(steps)) > 1:
                return None  # parameters at different step counts: the general step groups them
            exp_avgs, exp_avg_sqs = list(map(_EXP_AVG, states)), list(map(_EXP_AVG_SQ, states))
            launch = self.backend().AdamWStepPlan(trained, list(map(_GRAD, trained)), exp_avgs, exp_avg_sqs)
            plans.append(_GroupPlan(params, has_grad, trained, states, exp_avgs, exp_avg_sqs, steps, launch))
        return plans

    def _step_as_planned(self) -> bool:
        """One step from the plans, if every group is as planned (checked for all groups before any
        launch, so that a group that is not leaves no other half-stepped); else False, having done nothing."""
        plans = self._plans
        if plans is None or self.state is not self._planned_state or len(plans) != len(self.param_groups):
            return False
        state_of = self.state
        ready = []
        for group, plan in zip(self.param_groups, plans):
            if not _same_objects(group["params"], plan.params):
                return False
            grads = list(map(_GRAD, plan.params))
            if tuple(map(operator.is_not, grads, itertools.repeat(None))) != plan.has_grad:
                return False
            if len(grads) != len(plan.trained):
                grads = list(itertools.compress(grads, plan.has_grad))
            states = list(map(state_of.__getitem__, plan.trained))
            if (any(map(_IS_SPARSE, grads)) or not _same_objects(states, plan.states)
                    or not _same_objects(list(map(_EXP_AVG, states)), plan.exp_avgs)
                    or not _same_objects(list(map(_EXP_AVG_SQ, states)), plan.exp_avg_sqs)
                    or list(map(_STEP, states)) != plan.steps or not plan.launch.matches(grads)):
                return False
            ready.append((group, plan, grads))
        for group, plan, grads in ready:
            if not plan.trained:
                continue
            step = plan.steps[0] + 1
            beta1, beta2 = group["betas"]
            plan.launch.launch(grads, group["lr"], beta1, beta2, group["eps"], group["weight_decay"], step)
            for state in plan.states:
                state["step"] = step
            plan.steps[:] = itertools.repeat(step, len(plan.steps))
        return True


class AdamWCUDA(_AdamWKernel):
    """Level 5: CUDA multi-tensor apply (tensor addresses in the kernel's arguments), and a C++ CPU twin.
    It steps without a plan: its op checks the tensors in C++, at little cost, and a planned step's
    checks in Python took as long as ``AdamWSpec.step``'s loop (about 0.12 ms for GPT-2 on a 2-core CPU)."""

    level = "cuda"
    backend = staticmethod(cuda_backend)


IMPLEMENTATIONS = {
    "native": AdamWNative,
    "torchscript": AdamWTorchScript,
    "compile": AdamWCompiled,
    "triton": AdamWTriton,
    "cuda": AdamWCUDA,
}


def build_optimizer(level: str | int, params: Iterable, **hyperparameters) -> AdamWSpec:
    """AdamW at ``level`` ("native" … "cuda" or 1-5) over ``params``; ``hyperparameters`` are
    AdamWSpec's (lr, betas, eps, weight_decay)."""
    return IMPLEMENTATIONS[resolve_level(level)](params, **hyperparameters)
