"""What the kernels can and cannot do, written once on the kernel side and read by ``levels`` and by
both kernel packages. A leaf: it imports nothing from the project and builds nothing."""

from __future__ import annotations


class LevelUnavailableError(RuntimeError):
    """A level cannot run here (missing package, no compiler, wrong device). The message says why."""


ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
"""Head dims the level-4 and level-5 attention kernels compile tiles for (one tile width each)."""

SWISH_VERSIONS = {
    1: "one element per thread, IEEE expf and division",
    2: "version 1 + the hardware's exp and reciprocal (__expf, __fdividef)",
    3: "version 2 + 16-byte packs with streaming cache hints (the level-5 kernel)",
}
"""The climb to level 5's Swish forward kernel, kept runnable (swish.cu): each version is the one
before it plus one change."""
