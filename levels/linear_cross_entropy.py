"""The LM head and its loss in one component: logits = hidden·Wᵀ, then the mean next-token
cross-entropy, at five levels.

Where a GPT-2 training step's memory goes. At 16 × 1024 tokens and a vocabulary of 50304, the logits
are a (16384, 50304) matrix: 1.6 GB in bfloat16, 3.3 GB again when cast to float32 for the loss, and
3.3 GB more for their gradient, for a result that is one number. Level 1 pays all of it, and reads the
logits back four times (cast, log-softmax, gather, and the gradient). Levels 4 and 5 never hold the
logits whole: they take the tokens a chunk at a time, compute that chunk's logits, its log-sum-exp
(an online softmax over the vocabulary, as in lesson 03), its loss and its gradient, written over the
logits in place, and feed that gradient straight into the two gradient matmuls (hidden's and W's).
Because the loss is a scalar, the backward pass only scales those gradients by the upstream one, so
they are computed in the forward pass (Liger-Kernel's fused linear cross-entropy and llm.c's fused
classifier work this way).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .backends import cuda_backend, inductor, liger_ops, torchscript, triton_backend
from .spec import ComponentSpec, default_device_and_dtype, element_count

GPT2_VOCABULARY = 50304
"""GPT-2's 50257 tokens padded to a multiple of 64, as nanoGPT does (levels.gpt.GPT2_SMALL)."""


def linear_cross_entropy_math(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                              ignore_index: int) -> torch.Tensor:
    """The formula as a PyTorch user writes it: the logits, cast to float32, ``F.cross_entropy``.

    The mean is over the tokens whose target is not ``ignore_index``, and a batch with none of them
    has loss 0 (``F.cross_entropy``'s own mean would divide 0 by 0)."""
    logits = F.linear(hidden, weight)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, weight.shape[0])
    flat_targets = targets.reshape(-1)
    total = F.cross_entropy(logits, flat_targets, ignore_index=ignore_index, reduction="sum")
    return total / (flat_targets != ignore_index).sum().clamp_min(1)


class LinearCrossEntropySpec(ComponentSpec):
    """The LM head (a linear map to the vocabulary, no bias) and the mean cross-entropy of its logits.

    loss = mean over tokens t with targets[t] ≠ ignore_index of  logsumexp(hidden[t]·Wᵀ) − hidden[t]·W[targets[t]]

    Args:
        n_embd: the width of ``hidden``; vocab_size: the number of classes (rows of W);
        ignore_index: a target value whose token is left out of the loss (padding), as in
            ``F.cross_entropy``. A batch whose every target is ignored has loss 0 and zero gradients.

    Parameters: ``weight`` (vocab_size × n_embd), N(0, 0.02) like GPT-2's; in the GPT it is the token
    embedding itself (tied). Call: ``loss = head(hidden, targets)`` with hidden (..., n_embd) and
    targets (...) of int64 class ids; the loss is a float32 scalar (float64 for float64 inputs).
    """

    component = "linear_cross_entropy"
    # A GPT-2 training step's 16 × 1024 tokens on the GPU; on the CPU, small enough for the interpreter.
    default_shapes = {"cuda": (16384, 768), "cpu": (64, 64)}

    def __init__(self, n_embd: int, vocab_size: int, ignore_index: int = -100):
        if n_embd <= 0 or vocab_size <= 0:
            raise ValueError(f"n_embd and vocab_size must be positive, got {n_embd} and {vocab_size}")
        if 0 <= ignore_index < vocab_size:
            raise ValueError(f"ignore_index={ignore_index} is a class id of this vocabulary (0 to {vocab_size - 1}): "
                             f"those tokens would be both scored and ignored; use a negative value such as -100")
        super().__init__(n_embd=int(n_embd), vocab_size=int(vocab_size), ignore_index=int(ignore_index))
        self.n_embd, self.vocab_size, self.ignore_index = int(n_embd), int(vocab_size), int(ignore_index)
        self.weight = nn.Parameter(torch.randn(self.vocab_size, self.n_embd) * 0.02)

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.check_inputs(hidden, targets)
        return self.compute(hidden, targets)

    def check_inputs(self, hidden: torch.Tensor, targets: torch.Tensor) -> None:
        super().check_inputs(hidden)
        if hidden.dim() < 1 or hidden.shape[-1] != self.n_embd:
            raise ValueError(f"linear_cross_entropy expects hidden of shape (..., n_embd={self.n_embd}), "
                             f"got {tuple(hidden.shape)}")
        if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
            raise TypeError(f"targets must be an int64 tensor of class ids, got "
                            f"{getattr(targets, 'dtype', type(targets).__name__)}")
        if targets.shape != hidden.shape[:-1]:
            raise ValueError(f"targets of shape {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}: "
                             f"one target per row of hidden, shape {tuple(hidden.shape[:-1])}")
        if targets.device != hidden.device:
            raise ValueError(f"targets are on {targets.device} but hidden is on {hidden.device}")
        if self.level in ("native", "torchscript", "compile"):
            # PyTorch's cross-entropy stops with a device-side assert on a CUDA target out of range (the
            # process cannot go on), so levels 1-3 check first. Levels 4 and 5 check inside their ops.
            check_targets_in_range(targets, self.vocab_size, self.ignore_index)

    @classmethod
    def config_for_shape(cls, input_shape):
        n_embd = int(input_shape[-1])
        return {"n_embd": n_embd, "vocab_size": GPT2_VOCABULARY if n_embd >= 512 else 1000}

    def example_inputs(self, shape, dtype=None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden of ``shape`` (..., n_embd), and random targets with about one in sixteen ignored."""
        dtype, device = default_device_and_dtype(dtype, device)
        hidden = torch.randn(tuple(shape), dtype=dtype, device=device)
        targets = torch.randint(0, self.vocab_size, tuple(shape[:-1]), device=device)
        ignored = torch.rand(tuple(shape[:-1]), device=device) < 1 / 16
        return hidden, targets.masked_fill(ignored, self.ignore_index)

    def output_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The loss is float32 whatever the inputs' dtype (float64 for float64 inputs)."""
        return torch.promote_types(dtype, torch.float32)

    def bytes_moved(self, shape, dtype, backward=False) -> int:
        # The fewest: hidden and W read, the targets read; backward writes hidden's and W's gradients.
        # (The logits are not counted: a fused kernel never writes them to memory.)
        hidden = element_count(shape) * dtype.itemsize
        weight = self.vocab_size * self.n_embd * dtype.itemsize
        targets = element_count(shape[:-1]) * 8
        return hidden + weight + targets + ((hidden + weight) if backward else 0)

    def flops(self, shape, backward=False) -> int:
        # One matmul forward (2·T·C·V), two backward (hidden's gradient and W's), plus ~10 per logit for
        # the softmax, the loss and the logits' gradient.
        tokens = element_count(shape[:-1])
        matmul = 2 * tokens * self.n_embd * self.vocab_size
        return matmul * (3 if backward else 1) + 10 * tokens * self.vocab_size

    def reference_modules(self, device=None) -> dict[str, nn.Module]:
        """Liger-Kernel's fused linear cross-entropy, the design levels 4 and 5 follow, where it is installed and
        ``device`` is a GPU. (PyTorch's own way, ``F.linear`` then ``F.cross_entropy``, is level 1 already.)"""
        liger = liger_ops(device)
        return {} if liger is None else {"Liger fused linear cross-entropy": _LigerLinearCrossEntropy(self, liger)}


class _LigerLinearCrossEntropy(nn.Module):
    """Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction`` on the spec's own weight, as a reference row: the
    tokens flattened to (tokens, n_embd) rows, no bias, no class weights, the mean over the targets that are
    not ``ignore_index``. Its first output is that loss, in float32; the others (a z-loss, an accuracy, the
    predicted tokens) are None unless asked for."""

    def __init__(self, spec: LinearCrossEntropySpec, liger):
        super().__init__()
        self.spec, self.function = spec, liger.LigerFusedLinearCrossEntropyFunction

    def forward(self, hidden, targets):
        rows = hidden.reshape(-1, self.spec.n_embd)
        return self.function.apply(rows, self.spec.weight, targets.reshape(-1), None, None, self.spec.ignore_index)[0]


def check_targets_in_range(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """ValueError naming a target outside [0, vocab_size) that is not ``ignore_index``. Reads the
    answer back from the device: one synchronisation, both extremes in one copy (ignored targets stand
    in as class 0, inside the range, rather than being picked out by a boolean mask, whose size the host
    would have to wait for)."""
    if targets.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(torch.where(targets != ignore_index, targets, 0))).tolist()
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"target {bad} is out of range: targets must lie in [0, vocab_size={vocab_size}) "
                         f"or equal ignore_index={ignore_index}")


class LinearCrossEntropyNative(LinearCrossEntropySpec):
    """Level 1: ``F.linear``, a float32 copy of the logits, ``F.cross_entropy``: the whole (tokens ×
    vocabulary) matrix in memory three times over (logits, their float32 copy, their gradient)."""

    level = "native"

    def compute(self, hidden, targets):
        return linear_cross_entropy_math(hidden, self.weight, targets, self.ignore_index)


@functools.cache
def _scripted_linear_cross_entropy():
    return torchscript(linear_cross_entropy_math)


class LinearCrossEntropyTorchScript(LinearCrossEntropySpec):
    """Level 2: ``torch.jit.script`` of the same math (deprecated upstream; the legacy fuser). A matmul
    and a log-softmax are beyond its elementwise fuser: it runs the level-1 kernels."""

    level = "torchscript"

    def compute(self, hidden, targets):
        return _scripted_linear_cross_entropy()(hidden, self.weight, targets, self.ignore_index)


@functools.cache
def _compiled_linear_cross_entropy():
    return inductor(linear_cross_entropy_math)


class LinearCrossEntropyCompiled(LinearCrossEntropySpec):
    """Level 3: ``torch.compile`` of the level-1 math. Inductor fuses the cast into the log-softmax
    and the loss, but keeps the logits (and their gradient) whole: it does not chunk a matmul."""

    level = "compile"

    def compute(self, hidden, targets):
        return _compiled_linear_cross_entropy()(hidden, self.weight, targets, self.ignore_index)


class _LinearCrossEntropyKernel(LinearCrossEntropySpec):
    """Levels 4 and 5 take hidden as a (tokens, n_embd) matrix and the targets as a vector (views of
    what the caller passed when it is contiguous; a non-contiguous hidden is copied, once).
    ``backend`` is set by each level."""

    def compute(self, hidden, targets):
        rows = hidden.reshape(-1, self.n_embd)
        return self.backend().linear_cross_entropy(rows, self.weight, targets.reshape(-1), self.ignore_index)


class LinearCrossEntropyTriton(_LinearCrossEntropyKernel):
    """Level 4: chunks of tokens, each chunk's logits by our Triton matmul, a Triton kernel for the
    online log-sum-exp, the loss and the logits' gradient in place, and our matmuls for the two
    gradients (W's accumulated across chunks in the matmul's epilogue)."""

    level = "triton"
    backend = staticmethod(triton_backend)


class LinearCrossEntropyCUDA(_LinearCrossEntropyKernel):
    """Level 5: the same chunked scheme with cuBLAS matmuls (through ATen) around our CUDA kernel for
    the log-sum-exp, the loss and the logits' gradient, and a C++ CPU twin."""

    level = "cuda"
    backend = staticmethod(cuda_backend)


IMPLEMENTATIONS = {
    "native": LinearCrossEntropyNative,
    "torchscript": LinearCrossEntropyTorchScript,
    "compile": LinearCrossEntropyCompiled,
    "triton": LinearCrossEntropyTriton,
    "cuda": LinearCrossEntropyCUDA,
}
