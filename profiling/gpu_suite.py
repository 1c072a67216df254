"""The GPU suite: every test (GPU ones included) and every benchmark, offline, in parts.

Each part fits well inside ten minutes on an H100, the extension's first build (about a minute)
included, so each can run as one call on a lent machine; run them one after another into one folder:

    python -m profiling.gpu_suite --part tests     --out profiling/results/h100   # GPU-marked tests, levels 1, 2, 4, 5
    python -m profiling.gpu_suite --part tests-compile --out profiling/results/h100  # GPU-marked tests, level 3
    python -m profiling.gpu_suite --part tests-cpu --out profiling/results/h100   # the other tests, but the grid's
    python -m profiling.gpu_suite --part tests-cpu-grid --out profiling/results/h100  # the equivalence grid's CPU cases
    python -m profiling.gpu_suite --part kernels   --out profiling/results/h100   # component benchmarks
    python -m profiling.gpu_suite --part attention --out profiling/results/h100   # attention against cuDNN
    python -m profiling.gpu_suite --part huggingface --out profiling/results/h100 # transformers GPT-2, patched
    python -m profiling.gpu_suite --part breakdown --out profiling/results/h100   # a training step, kernel by kernel
    python -m profiling.gpu_suite --part models    --out profiling/results/h100   # GPT-2 small training
    python -m profiling.gpu_suite --part generation --out profiling/results/h100  # GPT-2 small generation
    python -m profiling.gpu_suite --part overhead  --out profiling/results/h100   # one call at decode size
    python -m profiling.gpu_suite --part sweep     --out profiling/results/h100   # row lengths, forward
    python -m profiling.gpu_suite --part sweep-backward --out profiling/results/h100  # row lengths, fwd+bwd
    python -m profiling.gpu_suite --part versions  --out profiling/results/h100   # the climb to a kernel
    python -m profiling.gpu_suite --part hopper    --out profiling/results/h100   # attention vs sequence length
    python -m profiling.gpu_suite --part sanitize  --out profiling/results/h100   # compute-sanitizer's memcheck
    python -m profiling.gpu_suite --part distributed --out profiling/results/h100x4  # DDP and FSDP, every GPU

Without --part every part runs in turn. Each part writes, under --out:
    environment.json         device, torch / Triton / CUDA versions, date, copy bandwidth
    pytest-<part>.log        tests, tests-compile, tests-cpu, tests-cpu-grid: the test run
    benchmarks.csv/.png      kernels: one row per component × dtype × pass × level, as compare_optimization_levels
    attention.csv/.png       attention: causal attention at long sequences, GPT-2's shape and five head dims
    huggingface.csv          huggingface: transformers' GPT-2 small, unpatched and patched at each level
    breakdown.csv            breakdown: the device time of one training step, kernel by kernel (profiling.breakdown),
                             for our GPT and transformers' GPT-2 small patched at levels 4 and 5, beside sdpa+compile
    training.csv/.png        models: the LM head + loss and the AdamW step, per level, as compare_optimization_levels
    language_model.csv       models: GPT-2 small per level, training-step tokens/s and peak memory
    generation.csv           generation: GPT-2 small per level, generation tokens/s, eager and CUDA graph
    overhead.csv             overhead: one call per case × pass × level at decode size, as call_overhead
    sweep[-backward].csv/.png  sweep, sweep-backward: LayerNorm, RMSNorm and softmax over rows of 128 …
                             4,194,304 elements at 2^26 elements each point (profiling.sweep);
    softmax-long-rows.csv    sweep: softmax on 4096 × 262,144 float32
    versions.csv             versions: each version of a kernel the lessons show growing, side by side
    hopper-attention.csv/.png  hopper: causal attention TFLOP/s over sequence lengths 512 … 16384 at head
                             dims 64 and 128, level 5's mma.sync and sm_90a kernels beside level 4 and
                             SDPA's cuDNN and flash (profiling.hopper; its --ncu adds hopper-ncu.csv)
    sanitize.md              sanitize: each case of profiling.sanitize (levels 4 and 5 at the head dims and row
                             lengths their kernels treat specially) under compute-sanitizer's memcheck, forward
                             and backward in a process of its own (several at once): errors found, the first
                             one named
    distributed.csv          distributed: every step of DDP and FSDP2 on one GPU alone, then on 2, 4, ...
                             and all of them (profiling.distributed under torchrun; the machine needs 2
                             or more GPUs); distributed-each-alone.csv: every GPU's rate training alone,
                             all at once; breakdown-<strategy>-<processes>.csv: each run's kernels, NCCL's
                             included
    targets-<part>.md        kernels, models, overhead: each target, its ratio in this run, met or missed

Liger-Kernel's rows (its LayerNorm, RMSNorm, softmax and fused linear cross-entropy beside PyTorch's in the
kernels, sweep and models parts) appear where ``liger_kernel`` imports. It is pure Python: on a machine without
a network, bring its wheel (``pip download liger-kernel --no-deps``) and install it into the interpreter that runs the
suite, ``python -m pip install --no-deps <wheel>``, first (a bare ``pip`` may belong to another Python: on an H200 on
2026-11-29 its rows did not appear after one).

Targets are ratios of rows measured side by side in one run (never absolute times), so they mean the
same on any GPU; they live here, never in timed unit tests. Every ratio is of eager times (what a
user gets); the CUDA-graph replay ratio stands beside it to show how much of a gap is launch overhead.
Dry runs of the distributed part (two gloo processes, the tiny GPT) and of the overhead part work on
the CPU too; for the overhead part, in float32; there Triton's interpreter spends
many minutes on the feed-forward's level-4 row alone, so leave that case out:

    python -m profiling.gpu_suite --part overhead --device cpu --budget 0.05 --out /tmp/suite \
        --only swish,layer_norm,softmax,attention
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from levels.spec import LEVEL_TITLES

from . import breakdown, hopper, sanitize
from .cli import save_plots
from .compare import compare_optimization_levels
from .language_model import format_throughput, generation_throughput, training_throughput
from .overhead import DECODE_CASES, call_overhead, format_overhead
from .peaks import copy_bandwidth, describe_device
from .report import format_table, with_setup_columns
from .sweep import ROW_COMPONENTS, format_sweep, plot_sweeps, row_length_sweep


@dataclass(frozen=True)
class Benchmark:
    """One comparison table: a component's levels and reference rows on one shape, dtype and pass."""

    name: str
    component: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    backward: bool = False
    config: dict | None = None  # constructor arguments; None: the component's default for the shape
    levels: tuple[str, ...] | None = None  # None: all five


def _pass_name(backward: bool) -> str:
    return "fwd+bwd" if backward else "forward"


def _elementwise_benchmarks() -> list[Benchmark]:
    """Swish, LayerNorm and softmax on a 256 MB float32 tensor (far beyond the L2), both dtypes and passes."""
    benchmarks = []
    for component in ("swish", "layer_norm", "softmax"):
        for dtype in (torch.float32, torch.bfloat16):
            for backward in (False, True):
                benchmarks.append(Benchmark(f"{component} {_pass_name(backward)} {str(dtype).removeprefix('torch.')}",
                                            component, (8192, 8192), dtype, backward))
    return benchmarks


GPT2_ROWS = (8192, 768)  # 8 sequences of 1024 tokens at GPT-2 small's width: its LayerNorms' input
GPT2_TOKENS = (8, 1024, 768)  # the same tokens as (batch, tokens, width): the block and its parts
ATTENTION_SHAPE = (4, 16, 4096, 128)  # batch, heads, seq, head_dim: long enough to be compute-bound
# Sliding window against full causal at a long sequence. Four heads keep the float64 level-1
# reference (five 16384² score matrices of 8 bytes) inside an 80 GB GPU.
LONG_ATTENTION_SHAPE = (1, 4, 16384, 128)
# Forward+backward at batch 2: the float64 level-1 reference keeps six 4096² score-sized tensors per
# head for its backward, which at batch 4 (8.6 GB each) does not fit an 80 GB GPU.
ATTENTION_BACKWARD_SHAPE = (2, 16, 4096, 128)

# GPT-2 small's attention (head dim 64) and a larger model's at 2048 tokens; batch 8, not 16, in the
# second so the float64 level-1 reference's backward (six score-sized tensors) fits 80 GB.
GPT2_ATTENTION_SHAPE = (8, 12, 1024, 64)
WIDE_ATTENTION_SHAPE = (8, 16, 2048, 64)
HEAD_DIMS = (64, 80, 96, 128, 256)
"""Head dims the attention part compares at one sequence: the tuned 64 and 128, and sizes real models
use that are no power of two (80, 96) or larger (256)."""

ATTENTION_BENCHMARKS = [
    Benchmark("attention forward causal", "attention", ATTENTION_SHAPE, torch.bfloat16, False, {"causal": True}),
    Benchmark("attention fwd+bwd causal", "attention", ATTENTION_BACKWARD_SHAPE, torch.bfloat16, True, {"causal": True}),
    Benchmark("attention forward causal seq 16384", "attention", LONG_ATTENTION_SHAPE, torch.bfloat16, False,
              {"causal": True}),
    Benchmark("attention forward window 1024 seq 16384", "attention", LONG_ATTENTION_SHAPE, torch.bfloat16, False,
              {"causal": True, "window": 1024}),
    Benchmark("attention fwd+bwd causal GPT-2", "attention", GPT2_ATTENTION_SHAPE, torch.bfloat16, True,
              {"causal": True}, ("triton", "cuda")),
    Benchmark("attention fwd+bwd causal seq 2048 head dim 64", "attention", WIDE_ATTENTION_SHAPE, torch.bfloat16, True,
              {"causal": True}, ("triton", "cuda")),
] + [Benchmark(f"attention forward causal head dim {head_dim}", "attention", (2, 16, 4096, head_dim), torch.bfloat16,
               False, {"causal": True}, ("triton", "cuda")) for head_dim in HEAD_DIMS]

BENCHMARKS = _elementwise_benchmarks() + [
    Benchmark("layer_norm fwd+bwd bfloat16 GPT-2 rows", "layer_norm", GPT2_ROWS, torch.bfloat16, True),
    Benchmark("softmax fwd+bwd bfloat16 GPT-2 rows", "softmax", GPT2_ROWS, torch.bfloat16, True),
    Benchmark("feed_forward forward bfloat16", "feed_forward", GPT2_TOKENS, torch.bfloat16, False),
    Benchmark("feed_forward fwd+bwd bfloat16", "feed_forward", GPT2_TOKENS, torch.bfloat16, True),
    Benchmark("self_attention fwd+bwd bfloat16", "self_attention", GPT2_TOKENS, torch.bfloat16, True),
    Benchmark("transformer_block fwd+bwd bfloat16", "transformer_block", GPT2_TOKENS, torch.bfloat16, True),
]


def _training_benchmarks() -> list[Benchmark]:
    """What a GPT-2 small training step adds to the blocks: the LM head + loss on a 16 × 1024-token step
    (vocabulary 50304), and one AdamW step over its 124M parameters."""
    from .optimizer_step import gpt2_small_parameter_shapes

    return [
        Benchmark("linear_cross_entropy fwd+bwd bfloat16", "linear_cross_entropy", (16384, 768), torch.bfloat16, True),
        Benchmark("adamw gpt2-small bfloat16", "adamw", gpt2_small_parameter_shapes(), torch.bfloat16),
    ]


def _language_model_benchmarks(part: str):
    """GPT-2 small in bfloat16. ``models``: a training step on 8 × 1024 and 16 × 1024 tokens.
    ``generation``: greedy generation of 112 tokens after a 16-token prompt at batch 1 (decoding one
    token at a time) and batch 32, every kernel launched from Python and each step a CUDA graph."""
    from levels.gpt import GPT2_SMALL

    if part == "models":
        return {f"gpt training step {batch}x1024": lambda device, batch=batch: training_throughput(
                    GPT2_SMALL, (batch, 1024), torch.bfloat16, device) for batch in (8, 16)}
    return {f"gpt generation batch {batch}{' cuda graph' if graph else ''}":
            lambda device, batch=batch, graph=graph: generation_throughput(GPT2_SMALL, batch, 16, 112, torch.bfloat16,
                                                                           device, cuda_graph=graph)
            for batch in (1, 32) for graph in (False, True)}


THROUGHPUT_COLUMNS = ("tflop_per_s", "gb_per_s")
"""Columns a ``Target`` may compare where higher is better (across shapes whose work differs)."""

FASTEST_REFERENCE = "fastest PyTorch reference"
"""A ``Target.versus`` that means: whichever of the table's PyTorch reference rows ran fastest."""

OWN_VALUE = "its own value"
"""A ``Target.versus`` that means: no ratio, the row's own ``column`` (tokens/s) must reach the threshold."""


@dataclass(frozen=True)
class Target:
    """In benchmark ``benchmark``, row ``level`` must reach ``threshold`` against row ``versus`` (a row
    key or ``FASTEST_REFERENCE``), found in ``versus_benchmark`` (default: the same benchmark):

    * a speedup: ``versus``'s time / ``level``'s time ≥ threshold;
    * with ``at_most``, a time ratio: ``level``'s time / ``versus``'s time ≤ threshold;
    * with ``versus`` None, a percent of copy bandwidth ≥ threshold;
    * with ``versus`` OWN_VALUE, the row's ``column`` itself ≥ threshold (tokens/s).
    """

    benchmark: str
    level: str
    threshold: float
    versus: str | None = None
    versus_benchmark: str | None = None
    at_most: bool = False
    column: str = "median_ms"  # what is compared: time, peak_memory_mb or tflop_per_s (no graph-replay twin)

    def describe(self) -> str:
        level = LEVEL_TITLES.get(self.level, self.level)
        if self.versus is None:
            return f"{self.benchmark}: {level} ≥ {self.threshold:g} % of copy bandwidth"
        if self.versus == OWN_VALUE:
            return f"{self.benchmark}: {level} ≥ {self.threshold:,.0f} {self.column.replace('_per_s', '/s')}"
        versus = LEVEL_TITLES.get(self.versus, self.versus)
        where = f" in {self.versus_benchmark}" if self.versus_benchmark else ""
        if self.column in THROUGHPUT_COLUMNS:
            return f"{self.benchmark}: {level} {self.column.replace('_per_s', '/s')} ≥ {self.threshold:g}× {versus}'s{where}"
        if self.at_most:
            what = "time" if self.column == "median_ms" else self.column.replace("_", " ")
            return f"{self.benchmark}: {level} {what} ≤ {self.threshold:g}× {versus}{where}"
        return f"{self.benchmark}: {level} ≥ {self.threshold:g}× {versus}{where}"

    def measure(self, tables: dict[str, pd.DataFrame], time_column: str = "median_ms") -> float:
        """The target's value from ``time_column``: eager ``median_ms`` (what is judged) or ``graph_ms``
        (beside it). NaN where a row is missing or did not run, or the table has no such column."""
        if self.column != "median_ms":
            if time_column != "median_ms":
                return math.nan  # graph replay has no memory column
            time_column = self.column
        rows = _ok_rows(tables[self.benchmark])
        if self.level not in rows.index or time_column not in rows:
            return math.nan
        level_time = rows.loc[self.level, time_column]
        if self.versus == OWN_VALUE:
            return float(level_time)
        if self.versus is None:
            return float(rows.loc[self.level, "pct_copy_bandwidth"] * rows.loc[self.level, "median_ms"] / level_time)
        versus_rows = _ok_rows(tables[self.versus_benchmark or self.benchmark])
        if self.versus == FASTEST_REFERENCE:
            references = versus_rows.loc[versus_rows["kind"] == "reference", time_column]
            versus_time = references.min() if len(references) else math.nan
        else:
            versus_time = versus_rows[time_column].get(self.versus, math.nan)
        # A throughput is better higher: its ratio is level over versus, as a time's is versus over level.
        higher_is_better = self.column in THROUGHPUT_COLUMNS
        ratio = level_time / versus_time if self.at_most or higher_is_better else versus_time / level_time
        return float(ratio)

    def shown(self, value: float) -> str:
        """``value`` (``measure``'s) as the target reads it: a percent, a ratio or the row's own number."""
        if math.isnan(value):
            return "-"
        if self.versus is None:
            return f"{value:.2f} %"
        return f"{value:,.0f}" if self.versus == OWN_VALUE else f"{value:.2f}×"

    def met(self, value: float) -> str:
        if math.isnan(value):
            return "not measured"
        return "yes" if (value <= self.threshold if self.at_most else value >= self.threshold) else "**no**"


def _ok_rows(table: pd.DataFrame) -> pd.DataFrame:
    return table[table["status"] == "ok"].set_index("level")


KERNEL_LEVELS = ("triton", "cuda")


def memory_bound_targets() -> list[Target]:
    """Swish, LayerNorm, softmax on 8192 × 8192: near copy bandwidth, and no slower than Inductor's fusion."""
    targets = []
    for level in KERNEL_LEVELS:
        for dtype in ("float32", "bfloat16"):
            targets += [
                Target(f"swish forward {dtype}", level, 90.0),
                Target(f"swish forward {dtype}", level, 1.0, "compile"),
                Target(f"layer_norm forward {dtype}", level, 90.0 if dtype == "float32" else 85.0),
                Target(f"layer_norm forward {dtype}", level, 1.0, "compile"),
                Target(f"layer_norm forward {dtype}", level, 1.5, "F.layer_norm (PyTorch fused)"),
                Target(f"layer_norm fwd+bwd {dtype}", level, 1.0, "compile"),
            ]
        targets.append(Target("softmax forward float32", level, 90.0))
    return targets


def attention_targets() -> list[Target]:
    """Flash attention against the fastest vendor kernel on Hopper, SDPA's cuDNN backend (flash beside
    it), at long sequences and at GPT-2's head dim 64; no cliff for head dims 80, 96 and 256 (throughput
    within 0.8× of the same level's at 128); the window's saving at seq 16384."""
    forward, backward, small_heads = {"triton": 0.95, "cuda": 0.85}, {"triton": 0.85, "cuda": 0.7}, {"triton": 0.8, "cuda": 0.7}
    targets = []
    for level in KERNEL_LEVELS:
        targets += [
            Target("attention forward causal", level, forward[level], "SDPA cudnn"),
            Target("attention forward causal seq 16384", level, forward[level], "SDPA cudnn"),
            Target("attention fwd+bwd causal", level, backward[level], "SDPA cudnn"),
            Target("attention fwd+bwd causal GPT-2", level, small_heads[level], "SDPA cudnn"),
            Target("attention fwd+bwd causal seq 2048 head dim 64", level, small_heads[level], "SDPA cudnn"),
            Target("attention forward causal", level, 1.0, "SDPA flash"),
            Target("attention forward window 1024 seq 16384", level, 5.0, level, "attention forward causal seq 16384"),
        ]
        targets += [Target(f"attention forward causal head dim {head_dim}", level, 0.8, level,
                           "attention forward causal head dim 128", column="tflop_per_s") for head_dim in (80, 96, 256)]
    return targets


def gpt2_size_targets() -> list[Target]:
    """Forward+backward at GPT-2 small's sizes, eager: levels 4 and 5 no slower than PyTorch's own
    kernels and than torch.compile."""
    benchmarks = ("layer_norm fwd+bwd bfloat16 GPT-2 rows", "layer_norm fwd+bwd bfloat16",
                  "softmax fwd+bwd bfloat16 GPT-2 rows", "softmax fwd+bwd bfloat16",
                  "feed_forward fwd+bwd bfloat16", "self_attention fwd+bwd bfloat16", "transformer_block fwd+bwd bfloat16")
    return [Target(benchmark, level, 1.0, versus)
            for benchmark in benchmarks for level in KERNEL_LEVELS for versus in (FASTEST_REFERENCE, "compile")]


def training_targets() -> list[Target]:
    """GPT-2 small training: the step well past torch.compile in time and memory (16 × 1024 tokens),
    at least level 3 on 8 × 1024; the LM head + loss past torch.compile in time and far under level 1's
    memory; AdamW at PyTorch's fused kernel's speed and near copy bandwidth; level 5's 16 × 1024 step at
    350k tokens/s (23 ms a step of 8 × 1024)."""
    step, small_step = "gpt training step 16x1024", "gpt training step 8x1024"
    head, adamw = "linear_cross_entropy fwd+bwd bfloat16", "adamw gpt2-small bfloat16"
    targets = []
    for level, versus_compile in (("triton", 1.15), ("cuda", 1.3)):
        targets += [
            Target(step, level, versus_compile, "compile"),
            Target(step, level, 0.7, "compile", at_most=True, column="peak_memory_mb"),
            Target(small_step, level, 1.0, "compile"),
            Target(small_step, level, 1.5, "native"),
            Target(head, level, 1.2, "compile"),
            Target(head, level, 0.25, "native", at_most=True, column="peak_memory_mb"),
            Target(adamw, level, 1.0, "torch.optim.AdamW(fused=True)"),
            Target(adamw, level, 85.0),
        ]
    return targets + [Target(step, "cuda", 350_000, OWN_VALUE, column="tokens_per_s")]


def generation_targets() -> list[Target]:
    """GPT-2 small generation: launched from Python, batch 1 past torch.compile and 1.5× level 1; with
    CUDA graphs, batch 1 at 10× level 1 launched from Python, and level 5 at 1,500 new tokens/s (batch 1)
    and 25,000 (batch 32)."""
    targets = []
    for level in KERNEL_LEVELS:
        targets += [
            Target("gpt generation batch 1", level, 1.0, "compile"),
            Target("gpt generation batch 1", level, 1.5, "native"),
            Target("gpt generation batch 1 cuda graph", level, 10.0, "native", "gpt generation batch 1"),
        ]
    return targets + [Target("gpt generation batch 1 cuda graph", "cuda", 1_500, OWN_VALUE, column="tokens_per_s"),
                      Target("gpt generation batch 32 cuda graph", "cuda", 25_000, OWN_VALUE, column="tokens_per_s")]


def decode_targets() -> list[Target]:
    """One call at decode size: level 5 within 1.3× and level 4 within 2× of PyTorch's fastest kernel
    for the same work, forward and forward+backward (the cost of our own dispatch path)."""
    allowed = {"cuda": 1.3, "triton": 2.0}
    return [Target(f"decode {case} {_pass_name(backward)}", level, allowed[level], FASTEST_REFERENCE, at_most=True)
            for case in DECODE_CASES for backward in (False, True) for level in KERNEL_LEVELS]


LONG_SOFTMAX = Benchmark("softmax forward float32 4096x262144", "softmax", (4096, 262144), torch.float32)
"""Rows of 262,144 float32 elements (1 MB each): more than one SM's registers and shared memory hold."""

SWEEPS = {
    "sweep": [(component, dtype, False) for component in ROW_COMPONENTS for dtype in (torch.float32, torch.bfloat16)],
    "sweep-backward": [(component, dtype, True) for component in ("layer_norm", "rms_norm")
                       for dtype in (torch.float32, torch.bfloat16)],
}
"""(component, dtype, backward) of each row-length sweep, per suite part."""

SWEEP_BUDGET_S = 0.1
"""Seconds of timing per row in a sweep: its nine points of seven rows each at the default second a row
outlast a ten-minute call (the forward+backward sweep stopped after three of its four tables on an H100)."""

SWEEP_TARGETS_FROM = 512
"""Row lengths below this are measured and plotted but not judged by the targets."""


def sweep_name(component: str, dtype: torch.dtype, backward: bool) -> str:
    return f"{component} {_pass_name(backward)} {str(dtype).removeprefix('torch.')}"


def sweep_targets(name: str, backward: bool) -> list[Target]:
    """Held at every row length from ``SWEEP_TARGETS_FROM`` up: forward ≥ 85 % of copy bandwidth and no
    slower than torch.compile; forward+backward ≥ 70 % and no slower than torch.compile or PyTorch's
    own kernel."""
    targets = []
    for level in KERNEL_LEVELS:
        targets += [Target(name, level, 70.0 if backward else 85.0), Target(name, level, 1.0, "compile")]
        if backward:
            targets.append(Target(name, level, 1.0, FASTEST_REFERENCE))
    return targets


def run_sweeps(device: torch.device, out: Path, part: str, budget_s: float, only: str = "") -> dict[str, pd.DataFrame]:
    sweeps = {}
    for component, dtype, backward in SWEEPS[part]:
        name = sweep_name(component, dtype, backward)
        if not _chosen(name, only):
            continue
        sweeps[name] = row_length_sweep(component, dtype=dtype, device=device, backward=backward, budget_s=budget_s)
        tqdm.write(format_sweep(sweeps[name]) + "\n")
        # Rewritten after every sweep, so a run cut short still leaves what it measured.
        pd.concat([with_setup_columns(sweep) for sweep in sweeps.values()]).to_csv(out / f"{part}.csv", index=False)
    if sweeps:
        plot_sweeps(list(sweeps.values()), str(out / f"{part}.png"))
    return sweeps


def check_sweep_targets(sweeps: dict[str, pd.DataFrame], path: Path, extra: str = "") -> str:
    """Each sweep target at its worst row length from ``SWEEP_TARGETS_FROM`` up: the value judged and
    where it falls, with the same point's graph-replay value beside it."""
    lines = [f"| target (every row length ≥ {SWEEP_TARGETS_FROM}) | worst eager | at row length | graph replay there "
             "| met (eager) |", "| --- | --- | --- | --- | --- |"]
    for name, sweep in sweeps.items():
        points = {row_length: {name: table} for row_length, table in sweep.groupby("row_length")
                  if row_length >= SWEEP_TARGETS_FROM}
        if not points:
            continue
        for target in sweep_targets(name, sweep.attrs["backward"]):
            eager = {row_length: target.measure(tables) for row_length, tables in points.items()}
            # A point that did not run is the worst of all: it must show, not vanish into min().
            worst = min(eager, key=lambda row_length: (not math.isnan(eager[row_length]), eager[row_length]))
            graph = target.measure(points[worst], "graph_ms")
            lines.append(f"| {target.describe()} | {target.shown(eager[worst])} | {worst:,} | {target.shown(graph)} | "
                         f"{target.met(eager[worst])} |")
    report = "\n".join(lines) + ("\n\n" + extra if extra else "")
    path.write_text(report + "\n")
    return report


FLOAT_TYPES = (torch.float32, torch.bfloat16)


def _version_ladders() -> list[tuple[str, Callable[[], dict], tuple[int, ...], tuple[torch.dtype, ...]]]:
    """(component, its versions as {"version N: what": module}, shape, dtypes): the climbs the lessons
    show, level 5's Swish (lesson 01) and level 4's LayerNorm, softmax and attention (lessons 02–04).
    Attention runs at GPT-2's shape (8, 12, 1024, 64), where version 1's scores take 400 MB a pass."""
    from levels.attention import attention_triton_versions
    from levels.layer_norm import layer_norm_triton_versions
    from levels.softmax import softmax_triton_versions
    from levels.swish import swish_cuda_versions

    return [("swish", swish_cuda_versions, (8192, 8192), FLOAT_TYPES),
            ("layer_norm", lambda: layer_norm_triton_versions(8192), (8192, 8192), FLOAT_TYPES),
            ("softmax", softmax_triton_versions, (8192, 8192), FLOAT_TYPES),
            ("attention", attention_triton_versions, (8, 12, 1024, 64), (torch.bfloat16,))]


def run_version_benchmarks(device: torch.device, out: Path, budget_s: float, only: str = "") -> dict[str, pd.DataFrame]:
    """Each kernel's climb (``_version_ladders``), its versions side by side, against the first
    version's float64 run; forward only, as the earlier versions are."""
    tables = {}
    for component, versions, shape, dtypes in _version_ladders():
        for dtype in dtypes:
            name = f"{component} versions {str(dtype).removeprefix('torch.')}"
            if not _chosen(name, only):
                continue
            tables[name] = compare_optimization_levels(versions(), shape, dtype=dtype, device=device, budget_s=budget_s)
            tables[name].attrs["benchmark"] = name
            tqdm.write(f"{name}\n{format_table(tables[name])}\n")
            pd.concat([with_setup_columns(t) for t in tables.values()]).to_csv(out / "versions.csv", index=False)
    return tables


def _huggingface_benchmarks() -> dict:
    """A ``transformers`` GPT-2 small patched at each level beside ``transformers`` as people run it
    (profiling.huggingface): a bfloat16 training step on 8 × 1024 tokens, greedy generation at batch 1
    and 32, and at batch 1 in float32, where every level must choose the sdpa row's tokens."""
    from .huggingface import generation_rows, training_rows

    benchmarks = {"hf training step 8x1024": lambda device: training_rows((8, 1024), torch.bfloat16, device)}
    for batch in (1, 32):
        benchmarks[f"hf generation batch {batch}"] = lambda device, batch=batch: generation_rows(
            batch, 16, 112, torch.bfloat16, device)
    benchmarks["hf generation batch 1 float32"] = lambda device: generation_rows(
        1, 16, 112, torch.float32, device, rows=("sdpa", "native", "torchscript", "compile", "triton", "cuda"))
    return benchmarks


def huggingface_targets() -> list[Target]:
    """Patched at level 5, a training step well past transformers' sdpa and no slower than its compiled
    model; level 4 past sdpa; generation at batch 1 no slower than sdpa."""
    step = "hf training step 8x1024"
    return [Target(step, "cuda", 1.3, "sdpa"), Target(step, "cuda", 1.0, "sdpa+compile"),
            Target(step, "triton", 1.15, "sdpa"), Target("hf generation batch 1", "cuda", 1.0, "sdpa")]


def run_huggingface_benchmarks(device: torch.device, out: Path, only: str = "") -> dict[str, pd.DataFrame]:
    from .language_model import format_throughput

    tables = {}
    for name, measure in _huggingface_benchmarks().items():
        if not _chosen(name, only):
            continue
        table = measure(device)
        # Target reads eager times from median_ms; these rows time a whole step or generation.
        tables[name] = table.assign(kind=["reference" if key in ("eager", "sdpa", "sdpa+compile") else "level"
                                          for key in table["level"]])
        print(f"{name}\n{format_throughput(table)}", end="\n\n", flush=True)
        pd.concat([t.assign(benchmark=key) for key, t in tables.items()]).to_csv(out / "huggingface.csv", index=False)
    return tables


def environment(device: torch.device) -> dict:
    import triton

    return {
        "device": describe_device(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_bandwidth_gb_per_s": round(copy_bandwidth(str(device)) / 1e9, 1),
    }


SCALING_TARGETS = {2: {"ddp": 1.95, "fsdp": 1.85}, 4: {"ddp": 3.8, "fsdp": 3.5}}
"""GPT-2 small at level 5, bf16, 8 × 1024 tokens a GPU: tokens/s on N GPUs ≥ this × one GPU's, per
strategy (DDP overlaps its all-reduces with the backward; FSDP2 must gather each unit's weights before
it computes, and as ZeRO-3, resharding after the forward, sends half as much again as DDP)."""
FSDP_PER_GPU_VERSUS_DDP = 0.8
"""... and FSDP's tokens/s per GPU ≥ this × DDP's on as many GPUs: sharding may cost memory traffic
and latency, not most of the speed."""


def run_distributed(device: torch.device, out: Path, only: str = "") -> str:
    """DDP and FSDP2 on every visible GPU (``profiling.distributed`` under torchrun: GPT-2 small at level
    5 in bf16, 8 × 1024 tokens a GPU, each launch timing one GPU alone, then 2, 4, ... and all, then
    every GPU alone at once), their steps in ``distributed.csv``, the last run's rates in
    ``distributed-each-alone.csv`` and the scaling targets; on the CPU, a dry run of two gloo processes
    on the tiny GPT."""
    from .distributed import STRATEGIES, each_alone_path

    if device.type == "cuda":
        processes = torch.cuda.device_count()
        settings = ["--config", "gpt2-small", "--dtype", "bfloat16", "--batch", "8", "--seq", "1024", "--steps", "30"]
    else:
        processes, settings = 2, ["--config", "tiny", "--steps", "4"]
    if processes < 2:
        return f"distributed: {processes} GPU visible; this part needs 2 or more (a several-GPU machine)"
    # 1, 2, 4, ... and all: every count a target is set for, one launch a strategy.
    counts = sorted({count for count in (1, 2, 4, 8) if count < processes} | {processes})
    strategies = [strategy for strategy in STRATEGIES if _chosen(strategy, only)]
    if not strategies:
        return f"distributed: no strategy matches --only {only!r} (strategies: {', '.join(STRATEGIES)})"
    runs, alone = [], []
    for strategy in strategies:
        csv = out / f"distributed-{strategy}.csv"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                        "-m", "profiling.distributed", "--level", "cuda", "--strategy", strategy, "--device",
                        device.type, *settings, "--processes", *map(str, counts), "--each-alone", "--csv", str(csv),
                        "--breakdown", str(out)], check=True, timeout=480)
        runs.append(pd.read_csv(csv))
        alone.append(pd.read_csv(each_alone_path(csv)).assign(strategy=strategy))
        csv.unlink()
        each_alone_path(csv).unlink()
    steps, each_alone = pd.concat(runs), pd.concat(alone)
    steps.to_csv(out / "distributed.csv", index=False)
    each_alone.to_csv(out / "distributed-each-alone.csv", index=False)
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return check_scaling_targets(steps, out / "targets-distributed.md", machine, each_alone)


def check_scaling_targets(steps: pd.DataFrame, path: Path, machine: str, each_alone: pd.DataFrame | None = None) -> str:
    """The scaling targets judged on one launch per strategy (``run_distributed``'s steps) on
    processes of ``machine`` (one each), as a markdown table written to ``path`` and returned; with
    ``each_alone`` (``--each-alone``'s rates, a ``strategy`` column added), each strategy's rate of
    every process alone, all at once, beside its table."""
    from .distributed import format_scaling_table, scaling_table

    tables = {strategy: scaling_table(run, int(run["batch"].iloc[0] * run["seq"].iloc[0]))
              for strategy, run in steps.groupby("strategy")}
    most = int(steps["processes"].max())
    lines = [f"# Scaling targets on up to {most} × {machine}, {steps['config'].iloc[0]}, "
             f"{steps['dtype'].iloc[0]}", "", "| target | measured | met |", "| --- | --- | --- |"]

    def at(strategy: str, processes: int, column: str) -> float:
        rows = tables.get(strategy)
        chosen = rows.loc[rows["processes"] == processes, column] if rows is not None else ()
        return float(chosen.iloc[0]) if len(chosen) else math.nan

    for processes in sorted(set(steps["processes"]) - {1}):
        for strategy, threshold in SCALING_TARGETS.get(processes, {}).items():
            speedup = at(strategy, processes, "speedup")
            lines.append(f"| {strategy} on {processes}: ≥ {threshold:g}× one's tokens/s | {speedup:.2f}× | "
                         f"{speedup >= threshold} |")
        ratio = at("fsdp", processes, "tokens_per_s_per_process") / at("ddp", processes, "tokens_per_s_per_process")
        lines.append(f"| fsdp on {processes}: tokens/s per process ≥ {FSDP_PER_GPU_VERSUS_DDP:g}× ddp's | {ratio:.2f}× | "
                     f"{ratio >= FSDP_PER_GPU_VERSUS_DDP} |")
    lines += [""] + [f"{strategy}:\n\n```\n{format_scaling_table(table)}\n```" for strategy, table in tables.items()]
    for strategy, rates in ([] if each_alone is None else each_alone.groupby("strategy")):
        lines.append(f"\n{strategy}, each process alone, all at once (its own one-process group, nothing to send): "
                     + ", ".join(f"{rate:,.0f}" for rate in rates.sort_values("process")["tokens_per_s"]) + " tokens/s")
    report = "\n".join(lines) + "\n"
    path.write_text(report)
    return report


TEST_SELECTIONS = {"tests": ("gpu", "not compile"), "tests-compile": ("gpu", "compile"),
                   "tests-cpu": ("not gpu", "not test_equivalence"),
                   "tests-cpu-grid": ("not gpu", "test_equivalence")}
"""(pytest marker expression, keyword expression) per test part: the GPU-marked tests (what only this machine
checks) in two parts, because level 3's cases compile Inductor kernels from a cold cache for most of their time
(an attention case in float16 about a minute) and all of them in one part outlast a ten-minute call; then the rest,
in two parts as well: the equivalence grid's CPU cases (about 650) and the other files (about 630). All ~1,280 in
one part did not finish in a ten-minute call on an H200 (95 % by then); there test_distributed.py alone, one test
after another, did not finish in seven minutes."""


def run_tests(part: str, out: Path) -> int:
    """pytest over tests/ (the notebooks are CPU lessons, checked by CI), log under ``out``."""
    command = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-rfs",
               "--durations=30"]
    marker, keyword = TEST_SELECTIONS[part]
    command += ["-m", marker] + (["-k", keyword] if keyword else [])
    if importlib.util.find_spec("xdist") is not None:
        # Most GPU tests are small and host-bound (compiles, launches, checks): eight processes share
        # the GPU well. The extension is built first, once, so the workers only load it.
        importlib.import_module("cuda_kernels.ops")
        command += ["-n", str(min(8, os.cpu_count() or 1))]
    log_path = out / f"pytest-{part}.log"
    with open(log_path, "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tail = log_path.read_text().strip().splitlines()[-1:]
    print(f"pytest ({part}): exit {result.returncode}; {' '.join(tail)}", flush=True)
    return result.returncode


def _chosen(name: str, only: str) -> bool:
    """``--only a,b``: the benchmarks whose name contains any of the comma-separated texts."""
    return any(part in name for part in only.split(","))


def run_kernel_benchmarks(device: torch.device, out: Path, budget_s: float, only: str = "",
                          benchmarks: list[Benchmark] = BENCHMARKS, name: str = "benchmarks") -> dict[str, pd.DataFrame]:
    tables = {}
    for benchmark in tqdm([b for b in benchmarks if _chosen(b.name, only)], desc=name, unit="table"):
        table = compare_optimization_levels(benchmark.component, benchmark.shape, dtype=benchmark.dtype, device=device,
                                            levels=benchmark.levels, backward=benchmark.backward,
                                            config=benchmark.config, budget_s=budget_s)
        table.attrs["benchmark"] = benchmark.name
        tables[benchmark.name] = table
        tqdm.write(f"{benchmark.name} {benchmark.config or ''}\n{format_table(table)}\n")
        # Rewritten after every table, so a run cut short still leaves what it measured.
        pd.concat([with_setup_columns(t) for t in tables.values()]).to_csv(out / f"{name}.csv", index=False)
    if tables:
        save_plots(list(tables.values()), str(out / f"{name}.png"))
    return tables


def run_language_model_benchmarks(device: torch.device, out: Path, part: str, only: str = "") -> dict[str, pd.DataFrame]:
    tables = {}
    for name, measure in _language_model_benchmarks(part).items():
        if not _chosen(name, only):
            continue
        tables[name] = measure(device)
        print(f"{name} {tables[name].attrs['shape']} {tables[name].attrs['dtype']}\n{format_throughput(tables[name])}",
              end="\n\n", flush=True)
        pd.concat([table.assign(benchmark=key) for key, table in tables.items()]).to_csv(
            out / ("language_model.csv" if part == "models" else "generation.csv"), index=False)
    return tables


def run_overhead(device: torch.device, out: Path, budget_s: float, only: str = "") -> dict[str, pd.DataFrame]:
    table = call_overhead(device, cases=[case for case in DECODE_CASES if _chosen(case, only)], budget_s=budget_s)
    table.to_csv(out / "overhead.csv", index=False)
    print(format_overhead(table), end="\n\n", flush=True)
    return {name: rows for name, rows in table.groupby("benchmark", sort=False)}


# dict.fromkeys: LayerNorm fwd+bwd against torch.compile on 8192 × 8192 is both a memory-bound and a
# GPT-2-size target; it is listed once.
TARGETS = {"kernels": list(dict.fromkeys(memory_bound_targets() + gpt2_size_targets())), "attention": attention_targets(),
           "huggingface": huggingface_targets(),
           "models": training_targets(), "generation": generation_targets(), "overhead": decode_targets()}


def check_targets(tables: dict[str, pd.DataFrame], targets: list[Target], path: Path) -> str:
    lines = ["| target | eager | graph replay | met (eager) |", "| --- | --- | --- | --- |"]
    for target in targets:
        if target.benchmark not in tables or (target.versus_benchmark or target.benchmark) not in tables:
            continue  # a benchmark left out with --only
        eager, graph = target.measure(tables), target.measure(tables, "graph_ms")
        lines.append(f"| {target.describe()} | {target.shown(eager)} | {target.shown(graph)} | {target.met(eager)} |")
    report = "\n".join(lines)
    path.write_text(report + "\n")
    return report


BREAKDOWN_ROWS = ("gpt:cuda", "gpt:triton", "hf:sdpa+compile", "hf:cuda", "hf:triton")
"""The breakdown part's steps: the same GPT-2 small at level 5 and 4 as our GPT and as transformers' patched
model, beside the compiled transformers model its targets are measured against."""

PARTS = ("tests", "tests-compile", "tests-cpu", "tests-cpu-grid", "kernels", "attention", "huggingface", "breakdown",
         "models", "generation", "overhead", "sweep", "sweep-backward", "versions", "hopper", "sanitize", "distributed")
CPU_PARTS = ("overhead", "distributed")
"""The parts with a dry run on the CPU; the others are sized for a GPU."""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.gpu_suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the results (created if missing)")
    parser.add_argument("--part", choices=PARTS, action="append",
                        help="run this part (repeatable; default: every part in turn)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of timing per row (default 1; the sweeps 0.1, their 9 points × 7 rows a table; "
                             f"hopper {hopper.BUDGET_S:g} per point; sanitize {sanitize.BUDGET_S:g} for all its cases)")
    parser.add_argument("--only", default="", help="run only the benchmarks (overhead: the decode cases; sanitize: "
                        "its cases) whose name contains one of these comma-separated texts")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default), or cpu for a dry run of the overhead part")
    arguments = parser.parse_args(argv)
    parts = arguments.part or list(PARTS)
    device = torch.device(arguments.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("The GPU suite needs a CUDA device; on the CPU run `pytest` and `python -m profiling`, or this "
              "suite's overhead part with --device cpu.", file=sys.stderr)
        return 2
    if device.type == "cpu" and set(parts) - set(CPU_PARTS):
        print(f"On the CPU only {' and '.join(CPU_PARTS)} run (the others are sized for a GPU): --part overhead "
              "--device cpu", file=sys.stderr)
        return 2
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    info = environment(device)
    (out / "environment.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info), flush=True)
    budget_s = 1.0 if arguments.budget is None else arguments.budget
    status = 0
    for part in parts:
        if part in TEST_SELECTIONS:
            status = run_tests(part, out) or status
            continue
        if part in SWEEPS:
            sweep_budget_s = SWEEP_BUDGET_S if arguments.budget is None else arguments.budget
            sweeps = run_sweeps(device, out, part, sweep_budget_s, arguments.only)
            long_rows = ""
            if part == "sweep" and _chosen(LONG_SOFTMAX.name, arguments.only):
                tables = run_kernel_benchmarks(device, out, budget_s, benchmarks=[LONG_SOFTMAX],
                                               name="softmax-long-rows")
                long_rows = check_targets(tables, [Target(LONG_SOFTMAX.name, level, 90.0) for level in KERNEL_LEVELS],
                                          out / "targets-softmax-long-rows.md")
            print(check_sweep_targets(sweeps, out / f"targets-{part}.md", long_rows), flush=True)
            continue
        if part == "versions":
            run_version_benchmarks(device, out, budget_s, arguments.only)
            continue
        if part == "hopper":
            hopper.write_sequence_sweep(device, out, hopper.BUDGET_S if arguments.budget is None else arguments.budget)
            continue
        if part == "distributed":
            print(run_distributed(device, out, arguments.only), flush=True)
            continue
        if part == "sanitize":
            cases = [name for name in sanitize.CASES if _chosen(name, arguments.only)]
            print(sanitize.sanitize_all(out, cases, sanitize.BUDGET_S if arguments.budget is None else arguments.budget),
                  flush=True)
            continue
        if part == "breakdown":
            breakdown.breakdown(BREAKDOWN_ROWS, "gpt2-small", (8, 1024), torch.bfloat16, device, out=out)
            continue
        if part == "kernels":
            tables = run_kernel_benchmarks(device, out, budget_s, arguments.only)
        elif part == "huggingface":
            tables = run_huggingface_benchmarks(device, out, arguments.only)
        elif part == "attention":
            tables = run_kernel_benchmarks(device, out, budget_s, arguments.only, ATTENTION_BENCHMARKS,
                                           name="attention")
        elif part == "models":
            tables = run_kernel_benchmarks(device, out, budget_s, arguments.only, _training_benchmarks(),
                                           name="training")
            tables |= run_language_model_benchmarks(device, out, part, arguments.only)
        elif part == "generation":
            tables = run_language_model_benchmarks(device, out, part, arguments.only)
        else:
            tables = run_overhead(device, out, budget_s, arguments.only)
        print(check_targets(tables, TARGETS[part], out / f"targets-{part}.md"), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
