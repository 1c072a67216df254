"""The device's own ceilings, measured once per process: what "percent of peak" is a percent of.

Datasheet numbers are leads, not ceilings: a real device-to-device copy falls short of the memory's
datasheet bandwidth (an H100's measured copy is in profiling/results/h100/environment.json). A
memory-bound kernel is judged against what a copy achieves on the same device in the same run, a
compute-bound one against a large matmul measured the same way.
"""

from __future__ import annotations

import functools

import torch

from .timing import time_runs


def copy_bytes(device_type: str) -> int:
    """Bytes one measuring copy reads and writes: large enough to spill every cache level (H100 L2
    is 50 MB, a server CPU's last-level cache tens of MB), small enough for a laptop."""
    return 2 * ((256 << 20) if device_type == "cuda" else (64 << 20))


@functools.lru_cache(maxsize=None)
def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large tensor copy (bytes read + bytes written) on ``device``."""
    device = torch.device(device)
    source = torch.rand(copy_bytes(device.type) // 2 // 4, device=device)
    destination = torch.empty_like(source)
    timing = time_runs(lambda: destination.copy_(source), device, budget_s=0.5)
    return 2 * source.numel() * source.element_size() / timing.median_s


def matmul_size(device_type: str) -> int:
    """The side of the square matrices whose product defines 100 % of matmul peak."""
    return 8192 if device_type == "cuda" else 1024


@functools.lru_cache(maxsize=None)
def matmul_throughput(device: str, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matrix product in ``dtype`` on ``device`` (the vendor library's best):
    the ceiling of compute-bound work such as attention."""
    device = torch.device(device)
    size = matmul_size(device.type)
    # Random data, not zeros: tensor cores draw less power on zeros and run measurably faster.
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    timing = time_runs(lambda: a @ b, device, budget_s=0.5)
    return 2 * size**3 / timing.median_s


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({torch.get_num_threads()} threads)"
