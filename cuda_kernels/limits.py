"""What the kernels can and cannot do, written once on the kernel side and read by ``levels`` and by
both kernel packages. A leaf: it imports nothing from the project and builds nothing."""

from __future__ import annotations


class LevelUnavailableError(RuntimeError):
    """A level cannot run here (missing package, no compiler, wrong device). The message says why."""


ATTENTION_HEAD_DIM_STEP = 8
ATTENTION_MAX_HEAD_DIM = 256
ATTENTION_HEAD_DIMS = "multiples of 8 from 8 to 256"
"""Head dims the level-4 and level-5 attention kernels run. A row of 8 16-bit values is one 16-byte
copy, so every row starts aligned and a tile's padding columns (the kernels round the head dim up to
a tile width: a power of two in Triton, a multiple of 16 for mma.sync in CUDA) are whole copies that
read as zero and are never stored. 256 is the widest tile whose accumulators still fit an SM."""


def attention_head_dim_supported(head_dim: int) -> bool:
    return head_dim % ATTENTION_HEAD_DIM_STEP == 0 and ATTENTION_HEAD_DIM_STEP <= head_dim <= ATTENTION_MAX_HEAD_DIM


def unsupported_head_dim_message(head_dim: int, kernel: str) -> str:
    return f"head_dim {head_dim} is not supported by the {kernel} attention kernel (supported: {ATTENTION_HEAD_DIMS})"


SWISH_VERSIONS = {
    1: "one element per thread, IEEE expf and division",
    2: "version 1 + the hardware's exp and reciprocal (__expf, __fdividef)",
    3: "version 2 + 16-byte packs with streaming cache hints (the level-5 kernel)",
}
"""The climb to level 5's Swish forward kernel, kept runnable (swish.cu): each version is the one
before it plus one change."""
