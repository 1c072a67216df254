"""The GPU suite: every test (GPU ones included) and every benchmark, in one offline command.

    python -m profiling.gpu_suite --out profiling/results/h100

writes, under ``--out``:
    environment.json   device, driver-visible name, torch / Triton / CUDA versions, date, copy bandwidth
    pytest.log         the full test run (``--tests gpu`` runs only GPU-marked tests, ``none`` skips)
    benchmarks.csv     one row per component × dtype × pass × level, as compare_optimization_levels
    benchmarks.png     the same as bar charts
    language_model.csv GPT-2 small per level: training-step and generation tokens/s
    targets.md         each target from the issues, the ratio measured in this run, met or missed

Targets are ratios measured side by side in one run (never absolute times), so they mean the same
on any GPU; they live here and in the closing notes, never in timed unit tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from .cli import save_plots, with_setup_columns
from .compare import compare_optimization_levels
from .language_model import format_throughput, generation_throughput, training_throughput
from .peaks import copy_bandwidth, describe_device
from .report import format_table

@dataclass(frozen=True)
class Benchmark:
    """One comparison table: a component's levels and reference rows on one shape, dtype and pass."""

    name: str
    component: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    backward: bool = False
    config: dict | None = None  # constructor arguments; None: the component's default for the shape


def _elementwise_benchmarks() -> list[Benchmark]:
    benchmarks = []
    for component in ("swish", "layer_norm", "softmax"):
        for dtype in (torch.float32, torch.bfloat16):
            for backward in (False, True):
                kind = "fwd+bwd" if backward else "forward"
                benchmarks.append(Benchmark(f"{component} {kind} {str(dtype).removeprefix('torch.')}", component,
                                            (8192, 8192), dtype, backward))
    return benchmarks


ATTENTION_SHAPE = (4, 16, 4096, 128)  # batch, heads, seq, head_dim: the attention issue's shape
# Sliding window against full causal at a long sequence. Four heads keep the float64 level-1
# reference (five 16384² score matrices of 8 bytes) inside an 80 GB GPU.
LONG_ATTENTION_SHAPE = (1, 4, 16384, 128)
# Forward+backward at batch 2: the float64 level-1 reference keeps six 4096² score-sized tensors per
# head for its backward, which at batch 4 (8.6 GB each) does not fit an 80 GB GPU.
ATTENTION_BACKWARD_SHAPE = (2, 16, 4096, 128)

BENCHMARKS = _elementwise_benchmarks() + [
    Benchmark("attention forward causal", "attention", ATTENTION_SHAPE, torch.bfloat16, False, {"causal": True}),
    Benchmark("attention fwd+bwd causal", "attention", ATTENTION_BACKWARD_SHAPE, torch.bfloat16, True, {"causal": True}),
    Benchmark("attention forward causal seq 16384", "attention", LONG_ATTENTION_SHAPE, torch.bfloat16, False,
              {"causal": True}),
    Benchmark("attention forward window 1024 seq 16384", "attention", LONG_ATTENTION_SHAPE, torch.bfloat16, False,
              {"causal": True, "window": 1024}),
    # The feed-forward issue's shape: 8 × 1024 tokens, 768 -> 3072 -> 768.
    Benchmark("feed_forward forward bfloat16", "feed_forward", (8, 1024, 768), torch.bfloat16, False),
    Benchmark("feed_forward fwd+bwd bfloat16", "feed_forward", (8, 1024, 768), torch.bfloat16, True),
]


def _language_model_benchmarks():
    """GPT-2 small in bfloat16, as the capstone issue asks: a training step on 8 × 1024 tokens, and
    greedy generation of 112 tokens after a 16-token prompt at batch 1 and batch 32."""
    from levels.gpt import GPT2_SMALL

    return {
        "gpt training step": lambda device: training_throughput(GPT2_SMALL, (8, 1024), torch.bfloat16, device),
        "gpt generation batch 1": lambda device: generation_throughput(GPT2_SMALL, 1, 16, 112, torch.bfloat16, device),
        "gpt generation batch 32": lambda device: generation_throughput(GPT2_SMALL, 32, 16, 112, torch.bfloat16, device),
    }


@dataclass(frozen=True)
class Target:
    """In benchmark ``benchmark``, ``level`` must reach ``threshold`` in one metric: percent of copy
    bandwidth (``versus`` None), or a speedup over the row ``versus``, found in ``versus_benchmark``
    (default: the same benchmark)."""

    benchmark: str
    level: str
    threshold: float
    versus: str | None = None
    versus_benchmark: str | None = None

    def describe(self) -> str:
        if self.versus is None:
            what = f"≥ {self.threshold:g} % of copy bandwidth"
        else:
            where = f" in {self.versus_benchmark}" if self.versus_benchmark else ""
            what = f"≥ {self.threshold:g}× {self.versus}{where}"
        return f"{self.benchmark}: {self.level} {what}"

    def measure(self, tables: dict[str, pd.DataFrame]) -> float:
        """Component tables: from CUDA-graph replays, the kernels' own speed, with Python's launch
        overhead (which on a slow host can exceed a 0.1 ms kernel) left out for every row alike.
        Whole-model tables: tokens per second, launch overhead included, as a user would see it."""
        rows = tables[self.benchmark].set_index("level")
        if self.versus is None:
            return float(rows.loc[self.level, "pct_copy_bandwidth"])
        versus_rows = tables[self.versus_benchmark or self.benchmark].set_index("level")
        if "tokens_per_s" in rows:
            return float(rows.loc[self.level, "tokens_per_s"] / versus_rows.loc[self.versus, "tokens_per_s"])
        return float(versus_rows.loc[self.versus, "graph_ms"] / rows.loc[self.level, "graph_ms"])


KERNEL_LEVELS = ("4 Triton", "5 CUDA C++")


def issue_targets() -> list[Target]:
    """The targets of the foundation issue (Swish, LayerNorm), the attention issue and the GPT issue."""
    targets = []
    for level in KERNEL_LEVELS:
        for dtype in ("float32", "bfloat16"):
            targets += [
                Target(f"swish forward {dtype}", level, 90.0),
                Target(f"swish forward {dtype}", level, 1.0, "3 torch.compile"),
                Target(f"layer_norm forward {dtype}", level, 90.0 if dtype == "float32" else 85.0),
                Target(f"layer_norm forward {dtype}", level, 1.0, "3 torch.compile"),
                Target(f"layer_norm forward {dtype}", level, 1.5, "F.layer_norm (PyTorch fused)"),
                Target(f"layer_norm fwd+bwd {dtype}", level, 1.0, "3 torch.compile"),
            ]
    flash_forward, flash_backward = {"4 Triton": 1.0, "5 CUDA C++": 0.6}, {"4 Triton": 0.8, "5 CUDA C++": 0.4}
    for level in KERNEL_LEVELS:
        targets += [
            Target("softmax forward float32", level, 90.0),
            Target("attention forward causal", level, flash_forward[level], "SDPA flash"),
            Target("attention fwd+bwd causal", level, flash_backward[level], "SDPA flash"),
            Target("attention forward causal", level, 5.0, "1 native PyTorch"),
            Target("attention forward window 1024 seq 16384", level, 5.0, level, "attention forward causal seq 16384"),
            Target("feed_forward fwd+bwd bfloat16", level, 1.0, "3 torch.compile"),
            Target("gpt training step", level, 1.0, "3 torch.compile"),
            Target("gpt training step", level, 1.5, "1 native PyTorch"),
            Target("gpt generation batch 1", level, 1.0, "3 torch.compile"),
        ]
    return targets


def environment(device: torch.device) -> dict:
    import triton

    return {
        "device": describe_device(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "copy_bandwidth_GBps": round(copy_bandwidth(str(device)) / 1e9, 1),
    }


def run_tests(selection: str, out: Path) -> int:
    """pytest over tests/ (the notebooks are CPU lessons, checked by CI), log under ``out``."""
    command = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-rfs"]
    if selection == "gpu":
        command += ["-m", "gpu"]
    with open(out / "pytest.log", "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tail = (out / "pytest.log").read_text().strip().splitlines()[-1:]
    print(f"pytest ({selection}): exit {result.returncode}; {' '.join(tail)}", flush=True)
    return result.returncode


def _chosen(name: str, only: str) -> bool:
    """``--only a,b``: the benchmarks whose name contains any of the comma-separated texts."""
    return any(part in name for part in only.split(","))


def run_benchmarks(device: torch.device, out: Path, budget_s: float, only: str = "") -> dict[str, pd.DataFrame]:
    tables = {}
    for benchmark in tqdm([b for b in BENCHMARKS if _chosen(b.name, only)], desc="benchmarks", unit="table"):
        table = compare_optimization_levels(benchmark.component, benchmark.shape, dtype=benchmark.dtype, device=device,
                                            backward=benchmark.backward, config=benchmark.config, budget_s=budget_s)
        table.attrs["benchmark"] = benchmark.name
        tables[benchmark.name] = table
        print(f"{benchmark.name} {benchmark.shape} {benchmark.config or ''}\n{format_table(table)}", end="\n\n", flush=True)
        # Rewritten after every table, so a run cut short still leaves what it measured.
        pd.concat([with_setup_columns(t) for t in tables.values()]).to_csv(out / "benchmarks.csv", index=False)
    if tables:
        save_plots(list(tables.values()), str(out / "benchmarks.png"))
    model_tables = []
    for name, measure in _language_model_benchmarks().items():
        if not _chosen(name, only):
            continue
        table = measure(device)
        tables[name] = table
        model_tables.append(table.assign(benchmark=name))
        print(f"{name} {table.attrs['shape']} {table.attrs['dtype']}\n{format_throughput(table)}", end="\n\n", flush=True)
        pd.concat(model_tables).to_csv(out / "language_model.csv", index=False)
    return tables


def check_targets(tables: dict[str, pd.DataFrame], out: Path) -> str:
    lines = ["| target | measured | met |", "| --- | --- | --- |"]
    for target in issue_targets():
        if target.benchmark not in tables or (target.versus_benchmark or target.benchmark) not in tables:
            continue  # a benchmark left out with --only
        value = target.measure(tables)
        unit = "×" if target.versus else " %"
        lines.append(f"| {target.describe()} | {value:.2f}{unit} | {'yes' if value >= target.threshold else '**no**'} |")
    report = "\n".join(lines)
    (out / "targets.md").write_text(report + "\n")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.gpu_suite", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--tests", choices=("all", "gpu", "none"), default="all")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row")
    parser.add_argument("--no-benchmarks", action="store_true")
    parser.add_argument("--only", default="", help="run only the benchmarks whose name contains one of these "
                        "comma-separated texts")
    arguments = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("The GPU suite needs a CUDA device; on the CPU run `pytest` and `python -m profiling`.", file=sys.stderr)
        return 2
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    info = environment(device)
    (out / "environment.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info), flush=True)
    status = run_tests(arguments.tests, out) if arguments.tests != "none" else 0
    if not arguments.no_benchmarks:
        print(check_targets(run_benchmarks(device, out, arguments.budget, arguments.only), out), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
