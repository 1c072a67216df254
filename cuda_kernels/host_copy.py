"""A few numbers computed on the GPU, on their way to the host without stopping it: the Python twin of
binding.h's ``OnTheWayToHost``, for level 4's ops and the GPT. A leaf: it imports nothing from the
project and builds nothing."""

from __future__ import annotations

import torch


class OnTheWayToHost:
    """``values`` (a small tensor) copied to the host.

    Why not ``values.tolist()``: on a CUDA tensor it waits until the GPU has run everything queued before
    it (in a training step, the whole forward so far), and while the host waits it queues nothing, so the
    GPU then idles until the host's next launches reach it. Instead the values travel by a non-blocking
    copy into pinned host memory with an event behind it, and ``arrived`` (called once the caller has
    queued its kernels) waits for that copy: for the work the stream ran before it, not for the kernels
    queued after it, which the GPU then runs while the host goes on. On the CPU the copy is done at once."""

    def __init__(self, values: torch.Tensor):
        self.host = values.to("cpu", non_blocking=True)
        self.copied = None
        if values.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record(torch.cuda.current_stream(values.device))

    def arrived(self) -> list:
        """The values, once the copy has landed."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()
