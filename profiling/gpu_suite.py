"""The GPU suite: every test (GPU ones included) and every benchmark, in one offline command.

    python -m profiling.gpu_suite --out profiling/results/h100

writes, under ``--out``:
    environment.json   device, driver-visible name, torch / Triton / CUDA versions, date, copy bandwidth
    pytest.log         the full test run (``--tests gpu`` runs only GPU-marked tests, ``none`` skips)
    benchmarks.csv     one row per component × dtype × pass × level, as compare_optimization_levels
    benchmarks.png     the same as bar charts
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

from .cli import save_plots, with_setup_columns
from .compare import compare_optimization_levels
from .peaks import copy_bandwidth, describe_device
from .report import format_table

BENCHMARK_SHAPE = (8192, 8192)
BENCHMARKS = [
    (component, dtype, backward)
    for component in ("swish", "layer_norm")
    for dtype in (torch.float32, torch.bfloat16)
    for backward in (False, True)
]


@dataclass(frozen=True)
class Target:
    """``level`` must reach ``threshold`` in ``metric``: a percent of copy bandwidth, or a speedup
    over the row named ``versus``, for one benchmark."""

    component: str
    dtype: torch.dtype
    backward: bool
    level: str
    threshold: float
    versus: str | None = None  # None: percent of copy bandwidth

    def describe(self) -> str:
        what = f"≥ {self.threshold:g}× {self.versus}" if self.versus else f"≥ {self.threshold:g} % of copy bandwidth"
        return f"{self.component} {'fwd+bwd' if self.backward else 'forward'} {str(self.dtype).removeprefix('torch.')}: {self.level} {what}"

    def measure(self, table: pd.DataFrame) -> float:
        """From CUDA-graph replays: the kernels' own speed, with Python's launch overhead (which on a
        slow host can exceed a 0.1 ms kernel) left out for every row alike."""
        rows = table.set_index("level")
        if self.versus is None:
            return float(rows.loc[self.level, "pct_copy_bandwidth"])
        return float(rows.loc[self.versus, "graph_ms"] / rows.loc[self.level, "graph_ms"])


def issue_targets() -> list[Target]:
    """The foundation issue's targets at (8192, 8192)."""
    targets = []
    for level in ("4 Triton", "5 CUDA C++"):
        for dtype in (torch.float32, torch.bfloat16):
            targets += [
                Target("swish", dtype, False, level, 90.0),
                Target("swish", dtype, False, level, 1.0, "3 torch.compile"),
                Target("layer_norm", dtype, False, level, 90.0 if dtype == torch.float32 else 85.0),
                Target("layer_norm", dtype, False, level, 1.0, "3 torch.compile"),
                Target("layer_norm", dtype, False, level, 1.5, "F.layer_norm (PyTorch fused)"),
                Target("layer_norm", dtype, True, level, 1.0, "3 torch.compile"),
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
        "benchmark_shape": list(BENCHMARK_SHAPE),
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


def run_benchmarks(device: torch.device, out: Path, budget_s: float) -> list[pd.DataFrame]:
    tables = []
    for component, dtype, backward in BENCHMARKS:
        table = compare_optimization_levels(component, BENCHMARK_SHAPE, dtype=dtype, device=device, backward=backward,
                                            budget_s=budget_s)
        tables.append(table)
        print(format_table(table), end="\n\n", flush=True)
    pd.concat([with_setup_columns(t) for t in tables]).to_csv(out / "benchmarks.csv", index=False)
    save_plots(tables, str(out / "benchmarks.png"))
    return tables


def check_targets(tables: list[pd.DataFrame], out: Path) -> str:
    by_setup = {(t.attrs["component"], t.attrs["dtype"], t.attrs["backward"]): t for t in tables}
    lines = ["| target | measured | met |", "| --- | --- | --- |"]
    for target in issue_targets():
        table = by_setup[(target.component, str(target.dtype).removeprefix("torch."), target.backward)]
        value = target.measure(table)
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
        print(check_targets(run_benchmarks(device, out, arguments.budget), out), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
