"""Softmax's forward as it grew: level 4's kernel and the two versions before it, kept runnable so
that lesson 03 can time the climb (forward only; ``triton_kernels::softmax_forward_version``).

The versions, each the one before plus one change (one program per row in versions 1 and 2, which
walk the row in blocks of ``LOOPED_ROW_BLOCK``)
    version 1  three passes over the row in global memory: the row's maximum; then Σ exp(x − max);
               then write exp(x − max) / Σ. x is read 3 times, y written once.
    version 2  version 1 + the maximum and the sum in one pass, the *online* softmax (Milakov and
               Gimelshein, 2018): a running maximum, and a running sum multiplied by exp(old − new)
               whenever the maximum grows. x read twice. (This is softmax.py's
               ``softmax_fwd_online_kernel``, launched for any N.)
    version 3  version 2 + the whole row held in registers: one load, max, exp, sum, one store;
               short rows are stacked several to a program. x read once. This is level 4's own
               forward (``launch_softmax_fwd``), for rows up to MAX_ONE_ARRAY_ROW_BLOCK; it loops like version 2
               over longer ones.

Why each is faster
    Per element, softmax does ~5 flops (one an exp) on 8 bytes (float32 x in, y out), where an H100
    can do ~20 flops per byte of DRAM bandwidth. So time is bytes: counting x's reads and y's write,
    the versions move 4, 3 and 2 element-sizes per element, a predicted 4 : 3 : 2 in time. That holds
    when every pass goes to DRAM. A re-read may instead hit L2 (50 MB on an H100) if the row is still
    there, which makes versions 1 and 2 faster than predicted; the lesson's measurement says how much.
    Version 2 pays for its saved read with an extra exp per element (the rescaling): cheap, since
    the kernel waits on memory, not on arithmetic.

Check
    python -m pytest tests/test_kernel_versions.py -k softmax
"""

import torch
import triton
import triton.language as tl

from .launch import (LOOPED_ROW_BLOCK, check_inputs, check_version, compute_dtype, launch, next_power_of_2,
                     on_device, refuse_backward, row_matrix)
from .softmax import check_softmax_shapes, softmax_fwd_online_kernel, launch_softmax_fwd, write_softmax_blocks

SOFTMAX_VERSIONS = {
    1: "three passes over the row: max, sum of exponentials, write (x read 3 times)",
    2: "version 1 + max and sum in one online pass (x read twice)",
    3: "version 2 + the whole row held in registers (x read once: the level-4 kernel)",
}
"""What each version of softmax's forward adds to the one before it (the module docstring says why)."""

_OP = "softmax_forward_version"


@triton.jit
def _softmax_fwd_three_pass_kernel(X, Y, N, BLOCK_N: tl.constexpr, COMPUTE: tl.constexpr):
    row = tl.program_id(0)
    X += row.to(tl.int64) * N
    Y += row.to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    # pass 1: the maximum, lane by lane, merged after the loop. Padding reads −inf: it never wins.
    # (evict_last, as in version 2: the next pass reads the row again, so ask L2 to keep it.)
    maxima = tl.full((BLOCK_N,), float("-inf"), COMPUTE)
    for start in range(0, N, BLOCK_N):
        x = tl.load(X + start + cols, mask=start + cols < N, other=float("-inf"), eviction_policy="evict_last")
        maxima = tl.maximum(maxima, x.to(COMPUTE))
    row_max = tl.max(maxima, axis=0)
    # pass 2: Σ exp(x − max), x read a second time; padding adds exp(−inf) = 0
    sums = tl.zeros((BLOCK_N,), COMPUTE)
    for start in range(0, N, BLOCK_N):
        x = tl.load(X + start + cols, mask=start + cols < N, other=float("-inf"), eviction_policy="evict_last")
        sums += tl.exp(x.to(COMPUTE) - row_max)
    # pass 3: normalise and write, x read a third time
    write_softmax_blocks(X, Y, N, row_max, tl.sum(sums, axis=0), BLOCK_N, COMPUTE)


def launch_softmax_fwd_version(x: torch.Tensor, version: int) -> torch.Tensor:
    """y = softmax(x) over its last dim by ``version`` of ``SOFTMAX_VERSIONS``."""
    check_version(_OP, version, SOFTMAX_VERSIONS)
    if version == 3:
        return launch_softmax_fwd(x)
    check_softmax_shapes(_OP, x)
    check_inputs(_OP, x)
    rows, n = row_matrix(_OP, x)
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    # 4096 elements a block, 8 warps (16 values a thread), as level 4 walks rows too long for registers.
    kernel = _softmax_fwd_three_pass_kernel if version == 1 else softmax_fwd_online_kernel
    with on_device(x):
        launch(kernel, (rows,), x, out, n, BLOCK_N=min(LOOPED_ROW_BLOCK, next_power_of_2(n)),
               COMPUTE=compute_dtype(x.dtype), num_warps=8)
    return out


# --- registration: op, fake (shape-only), autograd (none: forward only) ---------------------------------


@torch.library.custom_op(f"triton_kernels::{_OP}", mutates_args=())
def softmax_forward_version(x: torch.Tensor, version: int) -> torch.Tensor:
    return launch_softmax_fwd_version(x, version)


@softmax_forward_version.register_fake
def _softmax_forward_version_fake(x, version):
    check_version(_OP, version, SOFTMAX_VERSIONS)
    check_softmax_shapes(_OP, x)
    return torch.empty_like(x)


softmax_forward_version.register_autograd(refuse_backward(_OP, "levels.SoftmaxTriton (level 4)"))
