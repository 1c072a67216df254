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
import math
from typing import ClassVar, Iterable, List

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


class _AdamWKernel(AdamWSpec):
    """Levels 4 and 5 hand the four lists to one op that updates them all in place. ``backend`` is set
    by each level."""

    def update(self, params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step):
        self.backend().adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step)


class AdamWTriton(_AdamWKernel):
    """Level 4: one ``@triton.jit`` launch over every parameter, reading a table of their addresses."""

    level = "triton"
    backend = staticmethod(triton_backend)


class AdamWCUDA(_AdamWKernel):
    """Level 5: CUDA multi-tensor apply (tensor addresses in the kernel's arguments), and a C++ CPU twin."""

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
