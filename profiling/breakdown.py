"""Where a training step's time goes, kernel by kernel: ``torch.profiler`` around a few steps, the device
time summed per kernel and per kind of work (matmul, attention, norm, loss, optimizer, copy, ...).

A tokens/s figure says that a step is slow, not where. Two steps built from the same kernels, our GPT at
level 5 and ``transformers``' GPT-2 patched at level 5, run far apart (profiling/results/h100:
``language_model.csv``, ``huggingface.csv``), and only a table of what each one's GPU spent its time on
says which kernels make the difference: a matmul on an unaligned vocabulary, copies that make strided
heads contiguous, an optimizer, or the gaps between kernels where the GPU waits for the host.

    python -m profiling.breakdown                                  # GPT-2 small, 8 x 1024 tokens, bf16, GPU
    python -m profiling.breakdown --rows gpt:cuda hf:cuda hf:sdpa+compile --shape 8 1024 --out DIR
    python -m profiling.breakdown --device cpu --config tiny      # a dry run: the ops' CPU time

A row is ``gpt:<level>`` (our GPT, ``profiling.language_model.training_work``) or ``hf:<row>``
(``transformers``' GPT-2 small, ``profiling.huggingface.training_work``: ``sdpa``, ``sdpa+compile`` or a
level). On a GPU every CUDA kernel, copy and memset counts, by its device time; ``idle`` is the rest of
the step's wall time, when the GPU had nothing to run (the profiler's own host work adds to it, so read it
as an upper bound). On the CPU every op counts (ATen's, ours, autograd's nodes), by its own CPU time.
With ``--out`` the per-kernel table goes to ``breakdown.csv``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from .timing import synchronize

KERNEL_KINDS = [
    ("communication", r"nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|broadcast"),
    ("loss", r"cross_?entropy|nll_?loss|log_?softmax"),
    ("attention", r"attention|flash|fmha|sdpa|softmax"),
    ("norm", r"layer_?norm|rms_?norm"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("matmul", r"gemm|xmma|nvjet|cutlass|matmul|addmm|aten::mm|aten::bmm|cublas|linear"),
    ("copy", r"copy|Memcpy|CatArray|cat_|aten::cat|aten::stack|contiguous|clone|transpose"),
    ("memset", r"Memset|fill|zero"),
    ("embedding", r"embedding|index"),
    ("elementwise", r"elementwise|vectorized|triton_poi|feed_?forward|gelu|swish|silu|aten::add|aten::mul|aten::div"),
    ("reduction", r"reduce|triton_red|triton_per|aten::sum"),
]
"""What a kernel does, read from its name: the first pattern that matches wins, so a loss's log-softmax
is loss and attention's softmax is attention. The names are those of our kernels (levels 4 and 5), of
Inductor's (``triton_poi_fused_...``, whose fused op names decide), of cuBLAS and of ATen, and on the CPU
those of ops and autograd nodes (``_FeedForwardEagerBackward``); anything else is ``other``. A heuristic
for reading a profile, not a measurement: ``breakdown.csv`` keeps the names."""

_KIND_PATTERNS = [(kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KERNEL_KINDS]


def kernel_kind(name: str) -> str:
    """The kind of work a kernel (or an ATen op) named ``name`` does (``KERNEL_KINDS``)."""
    return next((kind for kind, pattern in _KIND_PATTERNS if pattern.search(name)), "other")


def kernel_times(step: Callable[[], object], device: torch.device, steps: int = 3, warmup: int = 2) -> pd.DataFrame:
    """One row per kernel that ``step()`` runs: ``kernel`` (its name), ``kind``, ``calls_per_step``,
    ``ms_per_step`` and ``share`` of the step. On a GPU the time is device time and a last row, ``idle``,
    holds what is left of the step's wall time; on the CPU it is each op's own CPU time (ATen's, ours,
    autograd's nodes), its callees' excluded. Averaged over ``steps`` profiled steps after ``warmup``
    unprofiled ones (compilation, autotuning, the allocator's first sizes)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    totals: dict[str, list[float]] = {}
    for event in profiler.events():
        if on_gpu and event.device_type == DeviceType.CUDA:
            milliseconds = event.time_range.elapsed_us() / 1e3
        elif not on_gpu and event.device_type == DeviceType.CPU:
            milliseconds = event.self_cpu_time_total / 1e3  # own time only: a caller's excludes its callees
        else:
            continue
        calls_and_time = totals.setdefault(event.name, [0, 0.0])
        calls_and_time[0] += 1
        calls_and_time[1] += milliseconds
    rows = [(name, kernel_kind(name), calls / steps, total / steps) for name, (calls, total) in totals.items()]
    if on_gpu:
        rows.append(("idle", "idle", 0.0, max(0.0, wall_ms - sum(row[3] for row in rows))))
    table = pd.DataFrame(rows, columns=["kernel", "kind", "calls_per_step", "ms_per_step"])
    table = table.sort_values("ms_per_step", ascending=False, ignore_index=True)
    table["share"] = table["ms_per_step"] / table["ms_per_step"].sum()
    table.attrs["wall_ms"] = wall_ms
    return table


def kinds_side_by_side(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """ms per step by kind of work (rows) for each profiled step (columns), with the total last."""
    columns = {name: table.groupby("kind")["ms_per_step"].sum() for name, table in tables.items()}
    summary = pd.DataFrame(columns).fillna(0.0)
    summary = summary.loc[summary.max(axis=1).sort_values(ascending=False).index]
    summary.loc["total"] = summary.sum()
    return summary


def training_steps(rows: Iterable[str], config: str, shape, dtype: torch.dtype,
                   device: torch.device) -> dict[str, Callable[[], object]]:
    """``{row: step}`` for each ``gpt:<level>`` or ``hf:<row>`` (see the module docstring)."""
    from levels.gpt import GPT2_SMALL, TINY

    from . import huggingface, language_model

    steps = {}
    for row in rows:
        family, _, name = row.partition(":")
        if family == "gpt":
            gpt_config = dict(GPT2_SMALL) if config == "gpt2-small" else dict(TINY, block_size=shape[1])
            models, step = language_model.training_work(gpt_config, shape, dtype, device, [name])
        elif family == "hf":
            hf_config = None if config == "gpt2-small" else dict(
                huggingface.NO_DROPOUT, n_layer=TINY["n_layer"], n_head=TINY["n_head"], n_embd=TINY["n_embd"],
                vocab_size=TINY["vocab_size"], n_positions=shape[1])
            models, step = huggingface.training_work(shape, dtype, device, [name], hf_config)
        else:
            raise ValueError(f"a row is gpt:<level> or hf:<row>, got {row!r}")
        (model,) = models.values()
        steps[row] = lambda step=step, model=model: step(model)
    return steps


def breakdown(rows: Iterable[str], config: str = "gpt2-small", shape=(8, 1024), dtype: torch.dtype = torch.bfloat16,
              device: torch.device | str = "cuda", steps: int = 3, top: int = 8, out: Path | str | None = None) -> pd.DataFrame:
    """Profile each row's training step (``training_steps``), print its longest kernels and then the kinds
    side by side, and return (and with ``out``, write to ``breakdown.csv``) the per-kernel table."""
    device = torch.device(device)
    tables = {}
    for row, step in training_steps(rows, config, shape, dtype, device).items():
        tables[row] = table = kernel_times(step, device, steps)
        print(f"{row}: {table.attrs['wall_ms']:.2f} ms a step; its {top} longest kernels:")
        print(table.head(top).to_string(index=False, formatters={"kernel": lambda name: name[:90]},
                                        float_format="{:.3f}".format), end="\n\n", flush=True)
    what = "device" if device.type == "cuda" else "CPU (each op's own)"
    dtype_name = str(dtype).removeprefix("torch.")
    print(f"ms per training step by kind, {what} time, {config} {tuple(shape)} {dtype_name} on {device}:")
    print(kinds_side_by_side(tables).to_string(float_format="{:.2f}".format), flush=True)
    table = pd.concat([table.assign(row=row, wall_ms=table.attrs["wall_ms"]) for row, table in tables.items()],
                      ignore_index=True).assign(config=config, shape=str(tuple(shape)), dtype=dtype_name,
                                                device=str(device))
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        table.to_csv(Path(out) / "breakdown.csv", index=False)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.breakdown", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=["gpt:cuda", "hf:cuda", "hf:sdpa+compile"],
                        help="steps to profile: gpt:<level> or hf:<sdpa|sdpa+compile|level> (default: %(default)s)")
    parser.add_argument("--config", choices=("gpt2-small", "tiny"), default="gpt2-small",
                        help="GPT-2 small (our GPT's vocabulary padded to 50304, transformers' its own 50257) or a "
                             "two-layer model for the CPU (default: %(default)s)")
    parser.add_argument("--shape", nargs=2, type=int, default=(8, 1024), metavar=("BATCH", "TOKENS"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps per row (default: %(default)s)")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per row (default: %(default)s)")
    parser.add_argument("--out", default=None, help="folder for breakdown.csv")
    arguments = parser.parse_args(argv)
    breakdown(arguments.rows, arguments.config, tuple(arguments.shape), getattr(torch, arguments.dtype),
              arguments.device, arguments.steps, arguments.top, arguments.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
