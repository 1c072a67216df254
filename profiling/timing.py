"""Timing that a GPU cannot fool: warm up, synchronise, time many runs, report the median and spread.

GPU work is asynchronous: a Python clock around a kernel launch measures the launch, not the kernel.
On CUDA we record events on the stream around each run; on the CPU a monotonic clock is enough.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from tqdm import tqdm


@dataclass(frozen=True)
class Timing:
    """Seconds per run: the median, and the 10th and 90th percentiles as the spread, of ``samples``
    (seconds per call, one per timed run or batch); ``runs`` counts the calls timed."""

    median_s: float
    p10_s: float
    p90_s: float
    runs: int
    samples: tuple[float, ...] = ()

    @classmethod
    def from_samples(cls, samples, runs: int) -> "Timing":
        samples = tuple(samples)
        # "inclusive": the deciles stay within the samples. The default ("exclusive") extrapolates past
        # the fastest and slowest of a few widely spread samples, down to a negative p10 on a busy machine.
        deciles = statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
        return cls(statistics.median(samples), deciles[0], deciles[-1], runs, samples)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(function: Callable[[], object], device: torch.device) -> float:
    """Memory one call allocates beyond what already lives (the CUDA caching allocator's high-water
    mark): a step's activations, logits and gradients, not the model. NaN on the CPU."""
    if device.type != "cuda":
        return math.nan
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    function()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def kernels_launched(function: Callable[[], object], device: torch.device) -> float:
    """GPU kernels one call launches, counted by the profiler (fusion's first visible effect). NaN on
    the CPU."""
    if device.type != "cuda":
        return math.nan
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        function()
        synchronize(device)
    return sum(1 for event in profiler.events() if event.device_type == DeviceType.CUDA
               and not event.name.startswith(("Memcpy", "Memset")))


def quiet_compile_workers() -> None:
    """Shut down torch.compile's pool of compile workers, if one is running, before anything is timed,
    and compile in this process from then on.

    Inductor compiles its kernels in a pool of worker processes (one per host core) that its first
    compile starts and then leaves waiting for the next, served by a thread in this process. While the
    pool lives, every Python call here runs slower: on an H200 machine with 16 host cores, level 4's
    LayerNorm spent 35-41 µs of host time a call for at least 12 s after one ``torch.compile`` call,
    against 26-28 µs before it, or after it with ``TORCHINDUCTOR_COMPILE_THREADS=1`` (no pool). A row
    timed then, eagerly, reads the slower host as a slower kernel; a comparison timed in turns reads
    it on every row whose calls the host bounds. Why no new pool afterwards: a sweep compiles anew for
    every shape, and with a pool started and shut down for each one the LayerNorm sweep (about 70 s
    for both dtypes in an earlier call) had finished only its float32 half after 155 s."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    # The pool set and its shutdown are Inductor internals (torch 2.11, on the H200, and 2.13 have both);
    # where they are missing, nothing is shut down and timing goes on.
    if async_compile is not None and getattr(async_compile, "_pool_set", None):
        from torch._inductor import config as inductor_config

        async_compile.shutdown_compile_workers()
        inductor_config.compile_threads = 1


def time_once(function: Callable[[], object], device: torch.device) -> float:
    """Wall time of one call, synchronised: what a first call (with its compile or build) costs."""
    synchronize(device)
    start = time.perf_counter()
    function()
    synchronize(device)
    return time.perf_counter() - start


def time_runs(function: Callable[[], object], device: torch.device, *, budget_s: float = 1.0,
              min_runs: int = 5, max_runs: int = 200, warmup_runs: int = 3) -> Timing:
    """Time ``function`` repeatedly within about ``budget_s`` seconds and summarise.

    The number of runs adapts to the cost of one run, so a microsecond kernel gets hundreds of
    samples and a slow interpreted one gets ``min_runs``.
    """
    for _ in range(warmup_runs):
        function()
    quiet_compile_workers()  # after the warm-up runs, which may have compiled
    estimate = max(time_once(function, device), 1e-7)
    runs = int(min(max_runs, max(min_runs, budget_s / estimate)))
    samples = seconds_per_run(function, device, runs)
    return Timing.from_samples(samples, len(samples))


def seconds_per_run(function: Callable[[], object], device: torch.device, runs: int) -> list[float]:
    """Seconds of each of ``runs`` calls of ``function``, made back to back with no synchronisation
    between them: on CUDA each call's time on the stream (events recorded around it, so the host may
    queue the next call while the GPU runs this one), on the CPU its wall time."""
    return _cuda_event_samples(function, device, runs) if device.type == "cuda" else _clock_samples(function, runs)


def time_back_to_back(function: Callable[[], object], device: torch.device, *, budget_s: float = 1.0,
                      max_samples: int = 21, min_samples: int = 5, min_batch_s: float = 1e-3,
                      warmup_runs: int = 3) -> Timing:
    """Seconds per call of ``function`` launched back to back from Python, as a decode loop launches it.

    Each sample is the wall time of a batch of N calls between two synchronisations, divided by N;
    the median is over ``max_samples`` batches (down to ``min_samples`` for a call so slow, such as an
    interpreted one, that the budget holds fewer). N is chosen so a batch lasts at least ``min_batch_s``
    (and the batches together about ``budget_s``): one call of a few microseconds is too short for one
    clock reading, and on CUDA an event pair around a single call would measure the GPU's stream time,
    not the host's launch cost that bounds a loop of small calls. A call whose GPU work outlasts its
    launch shows up as GPU time, a call whose launch outlasts its GPU work as launch time: either
    way, what one more call costs.
    """
    for _ in range(warmup_runs):
        function()
    quiet_compile_workers()  # after the warm-up runs, which may have compiled
    one_call = max(time_once(function, device), 1e-7)
    samples = int(min(max_samples, max(min_samples, budget_s / one_call)))
    calls = max(1, int(max(min_batch_s, budget_s / samples) / one_call))
    per_call = []
    for _ in range(samples):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            function()
        synchronize(device)
        per_call.append((time.perf_counter() - start) / calls)
    return Timing.from_samples(per_call, samples * calls)


def time_side_by_side(functions: Mapping[str, Callable[[], object]], device: torch.device, timer=time_runs, *,
                      budget_s: float = 1.0, rounds: int = 3, min_runs: int = 5,
                      progress: bool = False) -> dict[str, Timing]:
    """``timer`` (``time_runs`` or ``time_back_to_back``) for every function, in turns: ``rounds``
    rounds, each giving every function ``budget_s / rounds`` of timing, one after the other; each
    function's samples of all rounds make its Timing.

    A ratio between two rows is only as good as the conditions they were timed under. Timed one
    after the other, a row timed while the host was busy (another process, a clock that stepped down)
    loses to one timed a second later. In turns, such a spell falls on every row alike. Warm-up
    runs happen in the first round only, and each round asks for a share of ``min_runs``, so a slow
    (interpreted) call runs only one more time per round (the timer's estimate) than timed in one go."""
    per_round = max(1, math.ceil(min_runs / rounds))
    minimum = {"min_samples": per_round} if timer is time_back_to_back else {"min_runs": per_round}
    samples = {key: [] for key in functions}
    runs = dict.fromkeys(functions, 0)
    bar = tqdm(total=rounds * len(functions), desc="timing side by side", unit="row", disable=not progress,
               leave=False)
    for round_index in range(rounds):
        for key, function in functions.items():
            bar.update()
            timing = timer(function, device, budget_s=budget_s / rounds, warmup_runs=3 if round_index == 0 else 0,
                           **minimum)
            samples[key] += timing.samples
            runs[key] += timing.runs
    bar.close()
    return {key: Timing.from_samples(samples[key], runs[key]) for key in functions}


def _clock_samples(function, runs):
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        samples.append(time.perf_counter() - start)
    return samples


def _cuda_event_samples(function, device, runs):
    stream = torch.cuda.current_stream(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for start, end in zip(starts, ends):
        start.record(stream)
        function()
        end.record(stream)
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]
