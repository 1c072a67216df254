"""Reference solutions of the lessons' Triton exercises: small kernels a learner writes first.

Each notebook from 01 on ends with an exercise: a skeleton to fill in, and a check
(``profiling.lessons.check_exercise``) that runs the learner's function against a float64 run of
the formula on fresh random inputs. These are our answers, kept out of the notebooks so that the
exercise stays an exercise, and run through the same checks by ``tests/test_exercises.py``, which
proves each exercise solvable. They are written to be read: each is the shortest kernel that is
right, with one comment where the hardware decides.

    relu_squared(x)                           lesson 01   one pass over memory, like Swish
    rms_norm(x, weight, eps)                  lesson 02   a reduction along a row held in registers
    log_softmax(x)                            lesson 03   the stable shift, and a log instead of a division
    linear_bias_residual(x, weight, bias, r)  lesson 05   a matmul whose epilogue adds bias and residual

Limits
    Contiguous float32 or float64 tensors on the device Triton runs on (the CPU under the
    interpreter); the row kernels hold a row in one block, so rows up to 65 536 elements. No
    backward: the exercises are forward passes.

Check
    python -m pytest tests/test_exercises.py
"""

import torch
import triton
import triton.language as tl

from .launch import (
    check_contiguous,
    cdiv,
    check_inputs,
    compute_dtype,
    dot_input_precision,
    elementwise_launch,
    launch,
    next_power_of_2,
    on_device,
    require,
    row_matrix,
)

MAX_ROW = 65536
"""The longest row the row kernels hold in one block (registers, then local memory, run out beyond)."""


# --- lesson 01: ReLU², elementwise ---------------------------------------------------------------------


@triton.jit
def _relu_squared_kernel(X, Y, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel  # the last block runs past the end: masked lanes neither load nor store
    x = tl.load(X + offsets, mask=mask)
    relu = tl.maximum(x, 0.0)
    tl.store(Y + offsets, relu * relu, mask=mask)


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """max(x, 0)², one read and one write of x. Notice: the same launch as Swish (a flat array cut into
    blocks), so the kernel runs at copy bandwidth whatever the formula, as long as it is elementwise."""
    check_contiguous("relu_squared", x)
    check_inputs("relu_squared", x)
    y = torch.empty_like(x)
    if x.numel():
        programs, block, num_warps = elementwise_launch(x.numel())
        with on_device(x):
            launch(_relu_squared_kernel, (programs,), x, y, x.numel(), BLOCK=block, num_warps=num_warps)
    return y


# --- lesson 02: RMSNorm forward, one row per program ------------------------------------------------------


@triton.jit
def _rms_norm_kernel(X, W, Y, N, eps, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(COMPUTE)
    # The row stays in registers: the mean of squares and the scaling read it once from memory.
    reciprocal_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=mask).to(COMPUTE)
    tl.store(Y + row * N + cols, (x * reciprocal_rms * w).to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight over the last dim. Notice: LayerNorm without the mean, so one
    reduction instead of two; padding lanes load 0, which adds nothing to the sum of squares."""
    rows, n = row_matrix("rms_norm", x)
    require(weight.shape == (n,), lambda: f"rms_norm: weight is {tuple(weight.shape)}, expected ({n},)")
    require(0 < n <= MAX_ROW, lambda: f"rms_norm: rows of {n} elements; this kernel holds 1 to {MAX_ROW}")
    check_contiguous("rms_norm", x, weight)
    check_inputs("rms_norm", x, weight)
    y = torch.empty_like(x)
    with on_device(x):
        launch(_rms_norm_kernel, (rows,), x, weight, y, n, eps, BLOCK_N=next_power_of_2(n),
               COMPUTE=compute_dtype(x.dtype))
    return y


# --- lesson 03: log-softmax, one row per program ----------------------------------------------------------


@triton.jit
def _log_softmax_kernel(X, Y, N, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    # Padding reads as −inf: it never wins the maximum and adds exp(−inf) = 0 to the sum.
    x = tl.load(X + row * N + cols, mask=mask, other=float("-inf")).to(COMPUTE)
    shifted = x - tl.max(x, axis=0)
    log_sum = tl.log(tl.sum(tl.exp(shifted), axis=0))
    tl.store(Y + row * N + cols, (shifted - log_sum).to(Y.dtype.element_ty), mask=mask)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x − max − log Σ exp(x − max) over the last dim. Notice: no division and no log of a tiny
    probability: log(softmax(x)) underflows to −inf where this stays finite, which is why losses are
    computed from log-softmax (lesson 08's cross-entropy)."""
    rows, n = row_matrix("log_softmax", x)
    require(0 < n <= MAX_ROW, lambda: f"log_softmax: rows of {n} elements; this kernel holds 1 to {MAX_ROW}")
    check_contiguous("log_softmax", x)
    check_inputs("log_softmax", x)
    y = torch.empty_like(x)
    with on_device(x):
        launch(_log_softmax_kernel, (rows,), x, y, n, BLOCK_N=next_power_of_2(n), COMPUTE=compute_dtype(x.dtype))
    return y


# --- lesson 05: a matmul with a bias + residual epilogue ---------------------------------------------------


@triton.jit
def _linear_bias_residual_kernel(X, W, B, R, Y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, COMPUTE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), COMPUTE)
    for k in range(0, K, BLOCK_K):
        x = tl.load(X + rows[:, None] * K + (k + ks)[None, :],
                    mask=(rows[:, None] < M) & ((k + ks)[None, :] < K), other=0.0)
        w = tl.load(W + cols[None, :] * K + (k + ks)[:, None],  # weight is (N, K): read it as its transpose
                    mask=(cols[None, :] < N) & ((k + ks)[:, None] < K), other=0.0)
        accumulator += tl.dot(x, w, input_precision=PRECISION)
    # The epilogue: the tile is still in registers, so the bias and the residual cost one read each
    # and the output one write, where separate kernels would write and re-read the product twice.
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    bias = tl.load(B + cols, mask=cols < N, other=0.0).to(COMPUTE)
    residual = tl.load(R + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(COMPUTE)
    y = accumulator + bias[None, :] + residual
    tl.store(Y + rows[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def linear_bias_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         residual: torch.Tensor) -> torch.Tensor:
    """x · weightᵀ + bias + residual for x (M, K), weight (N, K), bias (N,), residual (M, N): a
    transformer block's output projection and its residual add, in one kernel. Notice: the epilogue
    is three lines after the k loop; the whole gain is the (M, N) tensor never written before it."""
    m, k = x.shape
    n = weight.shape[0]
    require(weight.shape == (n, k) and bias.shape == (n,) and residual.shape == (m, n),
            lambda: f"linear_bias_residual: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                    f"{tuple(bias.shape)}, residual {tuple(residual.shape)}: expected (M, K), (N, K), (N,), (M, N)")
    check_contiguous("linear_bias_residual", x, weight, bias, residual)
    check_inputs("linear_bias_residual", x, weight, bias, residual)
    y = torch.empty_like(residual)
    block = 16  # tl.dot's smallest tile; a real kernel picks 64-128 (lesson 05)
    with on_device(x):
        launch(_linear_bias_residual_kernel, (cdiv(m, block), cdiv(n, block)), x, weight, bias,
               residual, y, m, n, k, BLOCK_M=block, BLOCK_N=block, BLOCK_K=block,
               PRECISION=dot_input_precision(x.dtype), COMPUTE=compute_dtype(x.dtype))
    return y
