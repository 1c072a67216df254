"""A language model's last step in Triton: the LM head and the cross-entropy loss fused, as ``triton_kernels`` ops.

What it computes
    hidden (T, C), weight (V, C), targets (T,):   logits = hidden·weightᵀ,
    loss = mean over the n tokens whose target is not ignore_index of  logsumexp_j logits_ij − logits_i,target_i
    grad_logits = (softmax(logits_i) − onehot(target_i)) / n   (0 on ignored rows)
    grad_hidden = grad_logits·weight,   grad_weight = grad_logitsᵀ·hidden
    The loss is a scalar, so its gradients are fixed by the forward's inputs: the forward computes
    them, and the backward only multiplies them by the upstream gradient.

The one idea: the logits are never in memory whole
    At GPT-2 size (16384 tokens, V = 50304, C = 768, bfloat16) the logits are 16384 × 50304 × 2 B =
    1.65 GB, and unfused autograd holds three tensors of that size at its backward's peak (the saved
    log-softmax, its gradient and the logits' gradient): ~5 GB, more than the model, for a scalar.
    Here the tokens are walked in chunks of ``choose_chunk_rows`` (4096 at that size: 4 chunks). Each chunk's
    logits, 412 MB, are written by our matmul, read by a row kernel that turns them into the loss
    terms and writes the logits' gradient over them in place, and fed straight into the two gradient
    matmuls; the next chunk reuses the buffer. What lives at once: that buffer, the float32 weight
    gradient it is summed into (50304 × 768 × 4 B = 155 MB), grad_hidden (25 MB) and, at the end, the
    weight gradient cast to bfloat16 (77 MB): ~0.67 GB at the peak. After the forward only the two
    bfloat16 gradients (77 + 25 MB) stay for the backward.

Kernels, in the order they run (per chunk, then once)
    ``launch_matmul`` (matmul.py)     logits = hidden_chunk·weightᵀ, weight read transposed in place
    ``_cross_entropy_rows_kernel``    one program per row: pass 1 an online max and sum of exp over V
                                      (softmax.py's trick) and the row's loss term; pass 2 writes
                                      the gradient over the logits
    ``launch_matmul``                 grad_hidden_chunk = grad_logits·weight, into grad_hidden's rows
    ``launch_matmul``, ACCUMULATE     grad_weight += grad_logitsᵀ·hidden_chunk, in float32
    ``launch_column_sum``             loss = Σ of the rows' terms (each already divided by n)
    backward: ``_scale_kernel``       grad × upstream gradient, read from device memory (no host sync)

Launch
    The matmuls choose their own tiles (matmul.py). The row kernel walks V in blocks of
    LOOPED_ROW_BLOCK at 8 warps, 16 values a thread, as softmax.py's long rows do. n, the count of valid
    targets, stays on the device (the row kernel reads 1/n there); the targets' range reaches the host by
    a non-blocking copy (``OnTheWayToHost``) that the launcher reads only after queuing all its kernels.
    That read still waits for the GPU to reach the copy, which the stream runs after everything queued
    before the call (in a training step, the forward), but the GPU then has the call's matmuls to run
    while the host goes on, where reading the range first left it idle until the host's next launch.
    Without a gradient wanted, pass 2 and the two gradient matmuls (2/3 of the FLOPs) are skipped.

Limits
    hidden (T, C) and weight (V, C) of one dtype, read through their strides (any layout); targets
    int64 (T,). float16, bfloat16, float32 and float64 on the GPU, math in float32 (float64 for
    float64); float32 and float64 under the CPU interpreter. The logits and their gradient are stored
    in the input dtype, as PyTorch's would be; the loss is float32 (float64 for float64). With no
    valid target the loss and the gradients are 0 (F.cross_entropy's mean would be 0/0 = NaN).
    The gradients take memory in the forward even if the backward never runs. The gradient is
    stored already divided by n: in float16, entries below 6e-8 flush to zero, as in PyTorch's.

Check
    python -m pytest tests -k "linear_cross_entropy and triton"
"""

import torch
import triton
import triton.language as tl

from cuda_kernels.host_copy import OnTheWayToHost

from .eager import EagerFunction, refuse_tangents
from .launch import (
    LOOPED_ROW_BLOCK,
    accumulator_dtype,
    cdiv,
    check_contiguous,
    check_inputs,
    compute_dtype,
    elementwise_launch,
    exp_on_sfu,
    launch,
    next_power_of_2,
    on_device,
    require_value,
)
from .matmul import Epilogue, launch_column_sum, launch_matmul
from .softmax import row_max_and_sum_of_exp

LOGITS_PER_CHUNK = 2**28
"""The most logits one chunk holds: 512 MB in bfloat16. The tokens are cut into equal chunks under it:
GPT-2's 16384 tokens at V = 50304 into 4 chunks of 4096 rows, its 8192 into 2, so even the 8192-token
step never holds its logits whole. Bigger chunks are faster, because a chunk's grad_hidden matmul has
only (rows / 128) × 6 output tiles for 132 SMs: measured on an H200 (profiling/results/h200/README.md,
the LM head's chunk sizes), level 4 took 8.07 ms a call at 4096 rows against 8.50 at 2560 and 7.87 at
8192 (0.98×, 0.93× and 1.00× torch.compile). Level 5's binding chooses the same chunks in C++
(cuda_kernels/linear_cross_entropy_ops.cpp, choose_chunk_rows), so the two levels compare like for like."""

CHUNK_ROW_MULTIPLE = 128
"""Chunks start on a multiple of 128 rows, the height of the large matmul tiles: only the last
chunk's matmuls have a partial tile-row."""

LOGITS_ROW_ALIGNMENT = 64
"""The logits buffer's rows are padded to a multiple of this many values (128 bytes in bfloat16). With
GPT-2's own vocabulary, 50257 (odd), unpadded rows would start every other row off a 16-byte boundary:
the matmuls that read the logits back (grad_hidden, grad_weight) could then not prove their tiles'
rows aligned, and Triton loads them without 16-byte vectors (or Hopper's TMA, which needs 16-byte
aligned strides). Only the scratch buffer is wider, by at most 63 columns; the model keeps its 50257."""

# --- input checks (launchers and fake implementations) ----------------------------------------------


def _check_linear_cross_entropy_shapes(op: str, hidden: torch.Tensor, weight: torch.Tensor,
                                       targets: torch.Tensor) -> None:
    """hidden (T, C), weight (V, C) of hidden's dtype, targets int64 (T,) and contiguous."""
    if hidden.dim() != 2:
        raise ValueError(f"{op}: hidden must be a (tokens, C) matrix, got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"{op}: weight must be (V, C), one row per class, got shape {tuple(weight.shape)}")
    require_value(hidden.shape[1] == weight.shape[1],
                   lambda: f"{op}: hidden has C = {hidden.shape[1]} features but weight (V, C) has "
                           f"C = {weight.shape[1]}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"{op}: hidden is {hidden.dtype} but weight is {weight.dtype}: they must match")
    if targets.dtype != torch.int64:
        raise TypeError(f"{op}: targets must be int64 class indices, got {targets.dtype}")
    require_value(targets.dim() == 1 and targets.shape[0] == hidden.shape[0],
                   lambda: f"{op}: targets must be ({hidden.shape[0]},), one class per row of hidden, "
                           f"got shape {tuple(targets.shape)}")
    check_contiguous(op, targets)


def _check_backward_shapes(grad_loss: torch.Tensor, grad_hidden: torch.Tensor, grad_weight: torch.Tensor) -> None:
    op = "linear_cross_entropy_backward"
    require_value(grad_loss.dim() == 0, lambda: f"{op}: grad_loss must be a scalar, got {tuple(grad_loss.shape)}")
    if grad_weight.dtype != grad_hidden.dtype:
        raise TypeError(f"{op}: grad_hidden is {grad_hidden.dtype} but grad_weight is {grad_weight.dtype}")
    check_contiguous(op, grad_hidden, grad_weight)


def _count_valid_targets(targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, OnTheWayToHost]:
    """(n, summary): n, the number of targets that are not ``ignore_index``, an int64 on the targets'
    device (the row kernel reads it there), and n with the smallest and largest valid target on their
    way to the host, for ``_check_target_range`` once the kernels are queued."""
    valid = targets != ignore_index
    n_valid = valid.sum()
    smallest_and_largest = torch.aminmax(torch.where(valid, targets, 0))  # ignored rows stand in as class 0
    return n_valid, OnTheWayToHost(torch.stack((n_valid, *smallest_and_largest)))


def _check_target_range(op: str, summary: OnTheWayToHost, ignore_index: int, vocabulary: int) -> None:
    """Every target that is not ``ignore_index`` is a class in [0, V). The row kernel reads a target outside
    its row as no class, so a bad one fails the call here, never the GPU."""
    n_valid, smallest, largest = summary.arrived()
    if n_valid and not (smallest >= 0 and largest < vocabulary):
        raise ValueError(f"{op}: target {smallest if smallest < 0 else largest} is outside the classes "
                         f"[0, {vocabulary}) of weight (and is not ignore_index = {ignore_index})")


def choose_chunk_rows(tokens: int, vocabulary: int, requested: int = 0) -> int:
    """Rows per chunk: ``requested`` if > 0 (tests walk small inputs in several chunks with it), else the
    fewest equal chunks of at most LOGITS_PER_CHUNK logits, rounded up to CHUNK_ROW_MULTIPLE rows; from 1
    to ``tokens``."""
    if not requested:
        chunks = max(1, cdiv(tokens * vocabulary, LOGITS_PER_CHUNK))
        requested = cdiv(cdiv(tokens, chunks), CHUNK_ROW_MULTIPLE) * CHUNK_ROW_MULTIPLE
    return max(1, min(tokens, requested))


# --- kernels --------------------------------------------------------------------------------------------


@triton.jit
def _cross_entropy_rows_kernel(Logits, Targets, RowLosses, NValid, V, row_stride, ignore_index,
                               BLOCK_V: tl.constexpr, COMPUTE: tl.constexpr, WRITE_GRADIENT: tl.constexpr):
    row = tl.program_id(0)
    Logits += row.to(tl.int64) * row_stride
    target = tl.load(Targets + row)
    valid = target != ignore_index
    cols = tl.arange(0, BLOCK_V)
    # pass 1: the row's log-sum-exp, with softmax.py's online softmax
    row_max, row_sum = row_max_and_sum_of_exp(Logits, V, BLOCK_V, COMPUTE)
    log_sum_exp = row_max + tl.log(row_sum)
    # Read before pass 2 overwrites it. An ignored row reads class 0 and discards it; so does a target
    # outside the row, which fails the call once it is queued (_check_target_range).
    target_logit = tl.load(Logits + tl.where(valid & (target >= 0) & (target < V), target, 0)).to(COMPUTE)
    # The mean's 1/n, folded into every term: n counted on the device, so the host never waited for it.
    # With no valid target every row takes the 0 branch, and max(n, 1) keeps a 1/0 from being computed.
    scale = tl.where(valid, 1.0 / tl.maximum(tl.load(NValid).to(COMPUTE), 1.0), 0.0)
    tl.store(RowLosses + row, tl.where(valid, (log_sum_exp - target_logit) * scale, 0.0))
    if WRITE_GRADIENT:
        # pass 2: (softmax − onehot(target)) / n over the logits, in place: the gradient matmuls read it there.
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            x = tl.load(Logits + start + cols, mask=mask, other=0.0).to(COMPUTE)
            gradient = (exp_on_sfu(x - log_sum_exp) - tl.where(start + cols == target, 1.0, 0.0)) * scale
            tl.store(Logits + start + cols, gradient.to(Logits.dtype.element_ty), mask=mask)


@triton.jit
def _scale_kernel(X, Scale, Y, numel, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    # The factor is read from device memory: reading it on the host would wait for the GPU to catch up.
    scale = tl.load(Scale).to(COMPUTE)
    x = tl.load(X + offsets, mask=mask).to(COMPUTE)
    tl.store(Y + offsets, (x * scale).to(Y.dtype.element_ty), mask=mask)


# --- launchers ----------------------------------------------------------------------------------------


def launch_linear_cross_entropy_fwd(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                    ignore_index: int, compute_gradients: bool, chunk_rows: int = 0):
    """(loss, grad_hidden, grad_weight), the gradients those of the loss itself (upstream gradient 1).
    Without ``compute_gradients`` they are empty tensors of shape (0,). ``chunk_rows`` > 0 sets the
    tokens per chunk (0 chooses, ``choose_chunk_rows``)."""
    op = "linear_cross_entropy_forward"
    _check_linear_cross_entropy_shapes(op, hidden, weight, targets)
    check_inputs(op, hidden, weight)
    if targets.device != hidden.device:
        raise ValueError(f"{op}: targets are on {targets.device} but hidden is on {hidden.device}")
    (tokens, _), vocabulary = hidden.shape, weight.shape[0]
    loss_dtype = accumulator_dtype(hidden.dtype)
    if tokens == 0:
        # Nothing to average over: a loss of 0 and zero gradients, as for tokens that are all ignored.
        loss = hidden.new_zeros((), dtype=loss_dtype)
        if not compute_gradients:
            return loss, hidden.new_empty(0), weight.new_empty(0)
        return loss, hidden.new_zeros(hidden.shape), weight.new_zeros(weight.shape)

    rows_per_chunk = choose_chunk_rows(tokens, vocabulary, chunk_rows)
    starts = range(0, tokens, rows_per_chunk)
    # One chunk's logits, reused by every chunk: (rows, vocabulary), rows padded apart (LOGITS_ROW_ALIGNMENT).
    row_stride = cdiv(vocabulary, LOGITS_ROW_ALIGNMENT) * LOGITS_ROW_ALIGNMENT
    logits = hidden.new_empty((min(rows_per_chunk, tokens), row_stride))[:, :vocabulary]
    row_losses = hidden.new_empty(tokens, dtype=loss_dtype)
    grad_hidden, grad_weight = hidden.new_empty(0), weight.new_empty(0)
    if compute_gradients:
        grad_hidden = hidden.new_empty(hidden.shape)
        # Summed over chunks in float32 (float64), so that 16-bit rounding is paid once, not per chunk;
        # a single chunk's product goes straight to the input dtype.
        grad_weight = weight.new_empty(weight.shape, dtype=weight.dtype if len(starts) == 1 else loss_dtype)
    block_v = min(LOOPED_ROW_BLOCK, next_power_of_2(vocabulary))
    with on_device(hidden):
        for start in starts:
            hidden_chunk = hidden[start:start + rows_per_chunk]
            chunk_logits = logits[:hidden_chunk.shape[0]]
            launch_matmul(hidden_chunk, weight.t(), out=chunk_logits)
            if start == 0:
                # The targets' count and range are queued behind the first chunk's logits matmul: the GPU
                # runs it while the host queues their half-dozen small ops. Queued ahead of it, they would
                # leave the GPU idle until the host reached the matmul.
                n_valid, target_summary = _count_valid_targets(targets, ignore_index)
            launch(_cross_entropy_rows_kernel, (hidden_chunk.shape[0],), chunk_logits, targets[start:],
                   row_losses[start:], n_valid, vocabulary, row_stride, ignore_index, BLOCK_V=block_v,
                   COMPUTE=compute_dtype(hidden.dtype), WRITE_GRADIENT=compute_gradients,
                   num_warps=max(1, block_v // 512))  # 16 values a thread
            if compute_gradients:  # chunk_logits now holds the logits' gradient
                launch_matmul(chunk_logits, weight, out=grad_hidden[start:start + rows_per_chunk])
                launch_matmul(chunk_logits.t(), hidden_chunk, Epilogue.ACCUMULATE if start else Epilogue.NONE,
                              out=grad_weight)
    loss = launch_column_sum(row_losses.view(tokens, 1)).view(())
    _check_target_range(op, target_summary, ignore_index, vocabulary)
    return loss, grad_hidden, grad_weight.to(weight.dtype)


def launch_linear_cross_entropy_bwd(grad_loss: torch.Tensor, grad_hidden: torch.Tensor, grad_weight: torch.Tensor):
    _check_backward_shapes(grad_loss, grad_hidden, grad_weight)
    check_inputs("linear_cross_entropy_backward", grad_loss, grad_hidden, grad_weight)
    return launch_linear_cross_entropy_bwd_unchecked(grad_loss, grad_hidden, grad_weight)


def launch_linear_cross_entropy_bwd_unchecked(grad_loss: torch.Tensor, grad_hidden: torch.Tensor,
                                              grad_weight: torch.Tensor):
    """``launch_linear_cross_entropy_bwd`` without its checks, for the eager backward (see
    ``triton_kernels/__init__.py``). New tensors, so that a retained graph can run its backward again."""
    return _scaled(grad_hidden, grad_loss), _scaled(grad_weight, grad_loss)


def _scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    programs, block, num_warps = elementwise_launch(x.numel())
    with on_device(x):
        launch(_scale_kernel, (programs,), x, scale, out, x.numel(), BLOCK=block, COMPUTE=compute_dtype(x.dtype),
               num_warps=num_warps)
    return out


# --- registration: op, fake (shape-only), autograd ------------------------------------------------------


@torch.library.custom_op("triton_kernels::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                                 compute_gradients: bool,
                                 chunk_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_linear_cross_entropy_fwd(hidden, weight, targets, ignore_index, compute_gradients, chunk_rows)


@linear_cross_entropy_forward.register_fake
def _linear_cross_entropy_forward_fake(hidden, weight, targets, ignore_index, compute_gradients, chunk_rows=0):
    _check_linear_cross_entropy_shapes("linear_cross_entropy_forward", hidden, weight, targets)
    loss = hidden.new_empty((), dtype=accumulator_dtype(hidden.dtype))
    if not compute_gradients:
        return loss, hidden.new_empty(0), weight.new_empty(0)
    return loss, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


def _linear_cross_entropy_forward_setup_context(ctx, inputs, output):
    ctx.computed_gradients = inputs[4]
    ctx.save_for_backward(*output[1:])  # the gradients themselves: the backward only scales them


def _linear_cross_entropy_forward_backward(ctx, grad_loss, grad_of_grad_hidden, grad_of_grad_weight):
    # grad_hidden and grad_weight are returned only to be saved for this backward: gradients flowing
    # into them are ignored.
    needs_hidden, needs_weight = ctx.needs_input_grad[:2]
    if not (needs_hidden or needs_weight):
        return None, None, None, None, None, None
    if not ctx.computed_gradients:
        raise RuntimeError("linear_cross_entropy_forward ran with compute_gradients=False: it has no gradients "
                           "to give (call it with compute_gradients=True)")
    grad_hidden, grad_weight = linear_cross_entropy_backward(grad_loss, *ctx.saved_tensors)
    return grad_hidden if needs_hidden else None, grad_weight if needs_weight else None, None, None, None, None


linear_cross_entropy_forward.register_autograd(_linear_cross_entropy_forward_backward,
                                               setup_context=_linear_cross_entropy_forward_setup_context)


@torch.library.custom_op("triton_kernels::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(grad_loss: torch.Tensor, grad_hidden: torch.Tensor,
                                  grad_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return launch_linear_cross_entropy_bwd(grad_loss, grad_hidden, grad_weight)


@linear_cross_entropy_backward.register_fake
def _linear_cross_entropy_backward_fake(grad_loss, grad_hidden, grad_weight):
    _check_backward_shapes(grad_loss, grad_hidden, grad_weight)
    return torch.empty_like(grad_hidden), torch.empty_like(grad_weight)


# --- what the levels call ------------------------------------------------------------------------------


class _LinearCrossEntropyEager(EagerFunction):
    """The ops' forward and backward without the dispatcher, for eager calls (see __init__.py)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk_rows):
        loss, grad_hidden, grad_weight = launch_linear_cross_entropy_fwd(hidden, weight, targets, ignore_index,
                                                                         True, chunk_rows)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return *launch_linear_cross_entropy_bwd_unchecked(grad_loss, *ctx.saved_tensors), None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100, chunk_rows: int = 0) -> torch.Tensor:
    """The mean cross-entropy of logits hidden·weightᵀ against ``targets`` over the rows whose target is
    not ``ignore_index``, by our kernels, differentiable in hidden and weight, the logits never whole
    in memory (``chunk_rows`` tokens' worth at a time; 0 chooses). torch.compile sees the registered op."""
    targets = targets.contiguous()  # T indices, copied only if strided: the row kernel reads them by row
    wants_gradient = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if torch.compiler.is_compiling():
        return linear_cross_entropy_forward(hidden, weight, targets, ignore_index, wants_gradient, chunk_rows)[0]
    refuse_tangents("linear_cross_entropy", hidden, weight)
    if not wants_gradient:
        # no gradient wanted: skip autograd's bookkeeping, the gradient pass and 2/3 of the FLOPs
        return launch_linear_cross_entropy_fwd(hidden, weight, targets, ignore_index, False, chunk_rows)[0]
    return _LinearCrossEntropyEager.call((hidden, weight, targets), (ignore_index, chunk_rows))
