"""LayerNorm's forward as it grew: level 4's kernel and the two versions before it, kept runnable so
that lesson 02 can time the climb (forward only; ``triton_kernels::layer_norm_forward_version``).

The versions, each the one before plus one change (one program per row in versions 1 and 2, which
walk the row in blocks of ``LOOPED_ROW_BLOCK``)
    version 1  three passes over the row in global memory: the mean; then the variance of x − mean;
               then normalise, scale, shift and write. x is read 3 times, y written once.
    version 2  version 1 + the mean and the variance in one pass: each block's count, mean and sum of
               squared deviations, merged into the running ones by Chan's formula. x read twice.
               (This is layer_norm.py's ``layer_norm_fwd_looped_kernel``, launched for any N.)
    version 3  version 2 + the whole row held in registers: one load, two reductions over registers,
               one store; short rows are stacked several to a program. x read once. This is level 4's
               own forward (``launch_layer_norm_fwd``), for rows up to MAX_ROW_BLOCK; it loops like
               version 2 over longer ones.

Why each is faster
    Per element, LayerNorm does ~7 flops on 8 bytes (float32 x in, y out): ~1 flop per byte, where an
    H100 can do ~20 per byte of DRAM bandwidth. So time is bytes: counting x's reads and y's write,
    the versions move 4, 3 and 2 element-sizes per element, a predicted 4 : 3 : 2 in time. That holds
    when every pass goes to DRAM. A re-read may instead hit L2 (50 MB on an H100) if the row is still
    there, which makes versions 1 and 2 faster than predicted; the lesson's measurement says how much.

Why not Σx and Σx² in version 2 (one pass, simpler)
    var = Σx²/N − mean² subtracts two large, nearly equal numbers when |mean| ≫ std: float32 keeps
    7 digits, so a row with mean 1000 and std 0.01 loses all of them. Chan's merge only ever adds
    squared deviations from a mean, which cannot cancel.

Check
    python -m pytest tests/test_kernel_versions.py -k layer_norm
"""

import torch
import triton
import triton.language as tl

from .launch import (LOOPED_ROW_BLOCK, check_inputs, check_version, compute_dtype, launch, next_power_of_2,
                     on_device, refuse_backward, split_float)
from .layer_norm import layer_norm_fwd_looped_kernel, check_norm_shapes, launch_layer_norm_fwd, normalize_row_blocks

LAYER_NORM_VERSIONS = {
    1: "three passes over the row: mean, variance, normalise (x read 3 times)",
    2: "version 1 + mean and variance in one pass, merged by Chan's formula (x read twice)",
    3: "version 2 + the whole row held in registers (x read once: the level-4 kernel)",
}
"""What each version of LayerNorm's forward adds to the one before it (the module docstring says why)."""

_OP = "layer_norm_forward_version"


@triton.jit
def _layer_norm_fwd_three_pass_kernel(X, Y, W, B, N, eps_high, eps_low, BLOCK_N: tl.constexpr,
                                      COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    X += row.to(tl.int64) * N
    Y += row.to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    # pass 1: the mean. Each lane sums its own elements; lanes are merged once, after the loop.
    # (evict_last, as in version 2: the next pass reads the row again, so ask L2 to keep it.)
    sums = tl.zeros((BLOCK_N,), COMPUTE)
    for start in range(0, N, BLOCK_N):
        sums += tl.load(X + start + cols, mask=start + cols < N, other=0.0, eviction_policy="evict_last").to(COMPUTE)
    mean = tl.sum(sums, axis=0) / N
    # pass 2: the variance, from deviations about the now-known mean: x read a second time
    squares = tl.zeros((BLOCK_N,), COMPUTE)
    for start in range(0, N, BLOCK_N):
        mask = start + cols < N
        x = tl.load(X + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(COMPUTE)
        deviation = tl.where(mask, x - mean, 0.0)
        squares += deviation * deviation
    rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / N + tl.cast(eps_high, COMPUTE) + tl.cast(eps_low, COMPUTE))
    # pass 3: normalise, scale, shift and write: x read a third time
    normalize_row_blocks(X, Y, W, B, N, mean, rstd, BLOCK_N, COMPUTE, True)


def launch_layer_norm_fwd_version(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                                  version: int) -> torch.Tensor:
    """y = LayerNorm(x) over its last dim by ``version`` of ``LAYER_NORM_VERSIONS``."""
    check_version(_OP, version, LAYER_NORM_VERSIONS)
    if version == 3:
        return launch_layer_norm_fwd(x, weight, bias, eps, keep_statistics=False)[0]
    rows, n = check_norm_shapes(_OP, x, per_column={"weight": weight, "bias": bias})
    check_inputs(_OP, x, weight, bias)
    out = torch.empty_like(x)
    if rows == 0:
        return out
    # 4096 elements a block, 8 warps (16 values a thread), as level 4 walks rows too long for registers.
    block_n = min(LOOPED_ROW_BLOCK, next_power_of_2(n))
    compute = compute_dtype(x.dtype)
    with on_device(x):
        if version == 1:
            launch(_layer_norm_fwd_three_pass_kernel, (rows,), x, out, weight, bias, n, *split_float(eps),
                   BLOCK_N=block_n, COMPUTE=compute, num_warps=8)
        else:  # no statistics stored, so out stands in for their pointers
            launch(layer_norm_fwd_looped_kernel, (rows,), x, out, weight, bias, out, out, n, *split_float(eps),
                   BLOCK_N=block_n, COMPUTE=compute, STORE_STATISTICS=False, SUBTRACT_MEAN=True, HAS_BIAS=True,
                   num_warps=8)
    return out


# --- registration: op, fake (shape-only), autograd (none: forward only) ---------------------------------


@torch.library.custom_op(f"triton_kernels::{_OP}", mutates_args=())
def layer_norm_forward_version(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                               version: int) -> torch.Tensor:
    return launch_layer_norm_fwd_version(x, weight, bias, eps, version)


@layer_norm_forward_version.register_fake
def _layer_norm_forward_version_fake(x, weight, bias, eps, version):
    check_version(_OP, version, LAYER_NORM_VERSIONS)
    check_norm_shapes(_OP, x, per_column={"weight": weight, "bias": bias})
    return torch.empty_like(x)


layer_norm_forward_version.register_autograd(refuse_backward(_OP, "levels.LayerNormTriton (level 4)"))
