"""Hopper's attention: level 5's portable mma.sync kernel against its sm_90a kernel, cuDNN and flash.

Lesson 09 asks what Hopper's new instructions buy. ``sequence_sweep`` answers in TFLOP/s: causal
bfloat16 attention forward over sequence lengths 512 … 16384 at head dims 64 and 128, with the total
tokens fixed at B·S = 16384 and the model width at H·D = 2048, FlashAttention-3's plot convention (so
every point does work of one model layer, and a short sequence means a large batch, not an idle GPU).
Its rows, timed side by side at every point (eager medians, ``time_side_by_side``):

    SDPA cuDNN, SDPA flash         PyTorch's fastest Hopper kernel and FlashAttention-2
    4 Triton                       level 4 (its tl.dot compiles to wgmma on Hopper)
    5 CUDA mma.sync (portable)     level 5 inside ``cuda_kernels.ops.portable_attention()``
    5 CUDA sm_90a (wgmma, TMA)     level 5's default on compute capability 9.0

TFLOP/s counts the causal FLOPs as 4·B·H·S²·D / 2, FlashAttention-3's count. Every row's output is
checked against float64 level 1 on the first and the last (sequence, head) of the batch: level 1
materialises S² scores, too many in float64 for the whole batch at S = 16384, and a kernel that
mixes up heads shows in the last one.

``--ncu`` then profiles both level-5 kernels at the attention component's GPU shape (4, 16, 4096,
128) with Nsight Compute: a child process runs ``NCU_WARMUP_LAUNCHES`` calls and one more, and ncu
profiles that last one with the metrics in ``NCU_METRICS`` (registers, occupancy, issue slots, tensor
pipe, instruction counts, stall reasons). ncu replays the kernel with the caches flushed and the
clocks locked to base, so its durations are longer than the sweep's: compare the two kernels with it,
not with the sweep. Where ncu cannot run (not installed, no permission for the counters) the reason
goes into the file's status column and the run carries on.

    python -m profiling.hopper --out profiling/results/h100 [--ncu]    # on a GPU, about a minute

writes ``hopper-attention.csv`` and ``hopper-attention.png`` (and ``hopper-ncu.csv``); the GPU suite's
``--part hopper`` runs the same sweep. The numbers live in those files, which lesson 09 reads.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

import levels
from levels.attention import AttentionSpec
from levels.spec import LEVEL_TITLES

from .peaks import describe_device
from .timing import time_side_by_side

SEQUENCE_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128)
TOTAL_TOKENS = 16384
"""B·S at every point of the sweep."""
MODEL_WIDTH = 2048
"""H·D at every point: 32 heads of 64 or 16 heads of 128."""

PORTABLE_TITLE = "5 CUDA mma.sync (portable)"
HOPPER_TITLE = "5 CUDA sm_90a (wgmma, TMA)"
ROW_TITLES = {"SDPA cudnn": "SDPA cuDNN", "SDPA flash": "SDPA flash", "triton": LEVEL_TITLES["triton"],
              "cuda portable": PORTABLE_TITLE, "cuda": HOPPER_TITLE}
"""The sweep's rows: key (the CSV's ``row``) -> title. SDPA's rows are the references."""
REFERENCE_ROWS = ("SDPA cudnn", "SDPA flash")

BUDGET_S = 0.4
"""Seconds of timing per row and point: 12 points × 5 rows take about half a minute on an H100."""


def sequence_sweep_points(sequence_lengths=SEQUENCE_LENGTHS, head_dims=HEAD_DIMS, total_tokens: int = TOTAL_TOKENS,
                          model_width: int = MODEL_WIDTH) -> list[tuple[int, int, int, int]]:
    """(S, B, H, D) of every point: each head dim, each sequence length, B = total_tokens / S and
    H = model_width / D."""
    misfits = [f"sequence length {seq}" for seq in sequence_lengths if total_tokens % seq] + \
              [f"head dim {head_dim}" for head_dim in head_dims if model_width % head_dim]
    if misfits:
        raise ValueError(f"{', '.join(misfits)}: the sweep keeps B·S = {total_tokens} and H·D = {model_width} "
                         "fixed, so each must divide its total")
    return [(seq, total_tokens // seq, model_width // head_dim, head_dim) for head_dim in head_dims
            for seq in sequence_lengths]


def causal_flops(batch: int, heads: int, seq: int, head_dim: int) -> int:
    """Two matmuls of 2·S²·D FLOPs per head, halved by the causal mask: FlashAttention-3's count (the
    spec's ``flops`` counts the S(S+1)/2 visible pairs exactly, 0.1 % more at S = 512)."""
    return 4 * batch * heads * seq * seq * head_dim // 2


def first_and_last_heads(tensor: torch.Tensor) -> torch.Tensor:
    """(2, 1, S, D): the first head of the first sequence and the last head of the last, in float64."""
    return torch.stack([tensor[0, 0], tensor[-1, -1]]).unsqueeze(1).double()


def hopper_unavailable(device: torch.device) -> str | None:
    """Why level 5's default is not the sm_90a kernel on ``device``, or None on a Hopper GPU."""
    if device.type != "cuda":
        return f"the sm_90a kernel needs a Hopper GPU; this device is the {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return (f"the sm_90a kernel needs compute capability 9.0; this GPU has {capability[0]}.{capability[1]}, "
                "where level 5 runs its portable kernel")
    return None


def _sweep_rows(device: torch.device) -> dict[str, object]:
    """Each row's callable ``(q, k, v) -> o``, or the text of why it cannot run on ``device``."""
    from cuda_kernels.ops import portable_attention

    references = levels.build("attention", "native", causal=True).reference_modules(device)
    level_5 = levels.build("attention", "cuda", causal=True)

    def portable(q, k, v):
        with portable_attention():
            return level_5(q, k, v)

    rows = {key: references.get(key, f"{key} is not offered on the {device.type}") for key in REFERENCE_ROWS}
    rows |= {"triton": levels.build("attention", "triton", causal=True), "cuda portable": portable,
             "cuda": hopper_unavailable(device) or level_5}
    return rows


def sequence_sweep(device: torch.device | str, points: list[tuple[int, int, int, int]] | None = None,
                   dtype: torch.dtype = torch.bfloat16, budget_s: float = BUDGET_S,
                   progress: bool = True) -> pd.DataFrame:
    """Causal attention forward, every row of ``ROW_TITLES`` at every point of ``sequence_sweep_points()``
    (or ``points``): one table row per point and row, TFLOP/s from the eager median, and the error
    against float64 level 1 on ``first_and_last_heads``. A row that cannot run says why in ``status``."""
    device = torch.device(device)
    rows = _sweep_rows(device)
    reference = levels.float64_reference(levels.build("attention", "native", causal=True))
    records = []
    with torch.no_grad():
        for seq, batch, heads, head_dim in tqdm(points or sequence_sweep_points(), desc="sequence sweep", unit="point",
                                                disable=not progress):
            shape = (batch, heads, seq, head_dim)
            # Fresh random inputs: tensor cores draw less power, and run faster, on zeros.
            q, k, v = (torch.randn(shape, dtype=dtype, device=device) for _ in range(3))
            truth = reference(*(first_and_last_heads(t) for t in (q, k, v)))
            point = {"seq": seq, "batch": batch, "heads": heads, "head_dim": head_dim,
                     "device": describe_device(device), "dtype": str(dtype).removeprefix("torch.")}
            checked, runnable = {}, {}
            for key, row in rows.items():
                checked[key] = _check_row(row, q, k, v, truth, dtype)
                if checked[key]["status"] == "ok":
                    runnable[key] = partial(row, q, k, v)
            timings = time_side_by_side(runnable, device, budget_s=budget_s) if runnable else {}
            flops = causal_flops(batch, heads, seq, head_dim)
            for key in rows:
                timing = timings.get(key)
                records.append({**point, "row": key, "title": ROW_TITLES[key],
                                "kind": "reference" if key in REFERENCE_ROWS else "level",
                                "median_ms": timing.median_s * 1e3 if timing else math.nan,
                                "p10_ms": timing.p10_s * 1e3 if timing else math.nan,
                                "p90_ms": timing.p90_s * 1e3 if timing else math.nan,
                                "tflop_per_s": flops / timing.median_s / 1e12 if timing else math.nan,
                                **checked[key]})
    return pd.DataFrame(records)


def _check_row(row, q, k, v, truth, dtype) -> dict:
    """The row's first call: its error on the checked heads, within the dtype's tolerance or not, and
    ``status`` "ok", or the reason it cannot run (an error it raised, or the text ``row`` holds)."""
    if isinstance(row, str):
        return {"max_error": math.nan, "within_tolerance": False, "status": row}
    try:
        error = levels.relative_max_error(first_and_last_heads(row(q, k, v)), truth)
    except Exception as failure:  # a backend that refuses this shape is a row of the table, not a crash
        return {"max_error": math.nan, "within_tolerance": False,
                "status": f"{type(failure).__name__}: {failure}".splitlines()[0]}
    return {"max_error": error, "within_tolerance": error <= levels.TOLERANCE[dtype], "status": "ok"}


def format_sequence_sweep(table: pd.DataFrame) -> str:
    """TFLOP/s per row at every sequence length, one block per head dim, each followed by every
    row's ratio to SDPA cuDNN; rows that did not run say why underneath."""
    ok = table[table["status"] == "ok"]
    blocks = []
    for head_dim, points in ok.groupby("head_dim"):
        tflops = points.pivot_table(index="title", columns="seq", values="tflop_per_s", sort=False)
        tflops = tflops.reindex([title for title in ROW_TITLES.values() if title in tflops.index])
        first = points.iloc[0]
        blocks.append(f"head dim {head_dim} ({first['heads']} heads, batch × seq = "
                      f"{first['batch'] * first['seq']:,}), causal forward, TFLOP/s:\n"
                      + tflops.to_string(float_format=lambda value: f"{value:.0f}"))
        if ROW_TITLES["SDPA cudnn"] in tflops.index:
            ratio = tflops / tflops.loc[ROW_TITLES["SDPA cudnn"]]
            blocks.append("  against SDPA cuDNN:\n" + ratio.to_string(float_format=lambda value: f"{value:.2f}×"))
    points = table.drop_duplicates(["seq", "head_dim"]).shape[0]
    failed = table[table["status"] != "ok"].groupby(["title", "status"], sort=False).size()
    if len(failed):
        blocks.append("not run:\n" + "\n".join(f"  {title}, {count} of {points} points: {status}"
                                               for (title, status), count in failed.items()))
    return "\n\n".join(blocks)


def plot_sequence_sweep(table: pd.DataFrame, path: str) -> None:
    """One panel per head dim: TFLOP/s (eager) against sequence length on a log₂ axis, a line per row,
    PyTorch's SDPA rows dashed as in the other sweeps' plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = table[table["status"] == "ok"]
    head_dims = sorted(set(table["head_dim"]))
    figure, axes = plt.subplots(1, len(head_dims), figsize=(7 * len(head_dims), 4.4), squeeze=False)
    for head_dim, ax in zip(head_dims, axes[0]):
        points = ok[ok["head_dim"] == head_dim]
        for key, title in ROW_TITLES.items():
            line = points[points["row"] == key]
            if len(line):
                ax.plot(line["seq"], line["tflop_per_s"], marker="o", markersize=3, label=title,
                        linestyle="--" if key in REFERENCE_ROWS else "-")
        first = table[table["head_dim"] == head_dim].iloc[0]
        lengths = sorted(set(table["seq"]))
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{length:,}" for length in lengths])
        ax.set_ylim(bottom=0)
        ax.set_xlabel(f"sequence length S (batch = {first['batch'] * first['seq']:,} / S)")
        ax.set_ylabel("TFLOP/s (eager; causal FLOPs 4·B·H·S²·D / 2)")
        ax.set_title(f"causal attention forward, head dim {head_dim}, {first['heads']} heads, {first['dtype']}\n"
                     f"{first['device']}", fontsize=10)
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_sequence_sweep(device: torch.device, out: Path, budget_s: float = BUDGET_S) -> pd.DataFrame:
    """``sequence_sweep`` on ``device``, printed and written to ``out``: ``hopper-attention.csv`` and ``.png``."""
    table = sequence_sweep(device, budget_s=budget_s)
    table.to_csv(out / "hopper-attention.csv", index=False)
    plot_sequence_sweep(table, str(out / "hopper-attention.png"))
    tqdm.write(format_sequence_sweep(table))
    return table


# --- Nsight Compute ----------------------------------------------------------------------------------------

NCU_METRICS = {
    "gpu__time_duration.sum": "duration, ns (base clocks, cold caches)",
    "launch__registers_per_thread": "registers per thread",
    "launch__shared_mem_per_block_dynamic": "dynamic shared memory per block, bytes",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved occupancy, % of 64 warps",
    "sm__inst_issued.avg.pct_of_peak_sustained_active": "issue slots busy, %",
    # On sm_90 this pipe counts both mma.sync (HMMA) and wgmma (HGMMA) cycles: one utilisation for both kernels.
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor pipe busy, %",
    "sm__inst_executed_pipe_tensor_op_hmma.sum": "tensor-pipe instructions, mma.sync + wgmma (per warp)",
    "sm__inst_executed_pipe_tensor_op_gmma.sum": "wgmma instructions (per warp)",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM throughput, % of peak",
    # Stall reasons: warps waiting for that reason, on average, per cycle a warp issued.
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "stall: long scoreboard (global memory)",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "stall: barrier (__syncthreads, bar.sync)",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio": "stall: MIO throttle (shared memory queue)",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio": "stall: math pipe throttle",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "stall: wait (fixed latency)",
    "smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio": "stall: gmma (waiting for wgmma)",
}
"""The metrics ncu collects on each level-5 kernel, and what each says. Names as in Nsight Compute's
sm_90 metric list; the gmma stall exists on compute capability 9.0 only."""

NCU_KERNELS = {"portable": "cuda portable", "hopper": "cuda"}
"""``--ncu-child`` argument -> the sweep row whose kernel it runs."""
NCU_WARMUP_LAUNCHES = 3
"""Calls before the profiled one: the first pays for the kernel's shared-memory attribute and cold caches."""
NCU_SHAPE = AttentionSpec.default_shapes["cuda"]
"""(4, 16, 4096, 128): the attention component's GPU shape, the one lesson 04 measures."""


def _ncu_number(text: str) -> float:
    """A value as ncu prints it ("1,234.56", "96", "n/a") as a float, NaN if it is not a number."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return math.nan


def parse_ncu_csv(text: str) -> pd.DataFrame:
    """ncu's ``--csv`` output (its details page: one line per kernel launch and metric) as one row per
    profiled launch: ``kernel`` and one float column per metric. Lines that are not CSV (``==PROF==``
    progress, ``==ERROR==``, the program's own output) are skipped."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    launches: dict[str, dict] = {}
    for record in csv.DictReader(lines):
        launch = launches.setdefault(record["ID"], {"kernel": record["Kernel Name"]})
        launch[record["Metric Name"]] = _ncu_number(record["Metric Value"])
    return pd.DataFrame(list(launches.values()), columns=["kernel", *dict.fromkeys(
        name for launch in launches.values() for name in launch if name != "kernel")])


def _ncu_row(version: str, status: str, kernel: str | None = None, **metrics) -> dict:
    return {"version": version, "title": ROW_TITLES[NCU_KERNELS[version]], "kernel": kernel, "status": status,
            **metrics}


def ncu_result(version: str, output: str, returncode: int) -> dict:
    """One row of ``hopper-ncu.csv`` from a finished ncu run: the profiled launch's metrics and status
    "ok", or the first ``==ERROR==`` line (ERR_NVGPUCTRPERM: no permission for the counters), or why
    there is no row, with the run's last line (a traceback's, when the child failed)."""
    launches = parse_ncu_csv(output)
    if len(launches) == 1:
        return _ncu_row(version, "ok", **launches.iloc[0].to_dict())
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if "==ERROR==" in line]
    if errors:
        return _ncu_row(version, errors[0])
    return _ncu_row(version, f"ncu exited with {returncode} and profiled {len(launches)} launches, not 1"
                    + (f"; its last line: {lines[-1]}" if lines else ""))


def profile_with_ncu(version: str, timeout_s: float = 300) -> dict:
    """ncu on one launch of a level-5 kernel (``version`` "portable" or "hopper") in a child process."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return _ncu_row(version, "ncu not found on PATH (Nsight Compute ships with the CUDA toolkit)")
    command = [ncu, "--kernel-name", "regex:attention_forward", "--launch-skip", str(NCU_WARMUP_LAUNCHES),
               "--launch-count", "1", "--csv", "--print-units", "base", "--print-metric-name", "name",
               "--metrics", ",".join(NCU_METRICS), sys.executable, "-m", "profiling.hopper", "--ncu-child", version]
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return _ncu_row(version, f"ncu did not finish in {timeout_s:.0f} s")
    return ncu_result(version, finished.stdout + finished.stderr, finished.returncode)


def run_ncu_child(version: str) -> None:
    """What ncu profiles: ``NCU_WARMUP_LAUNCHES`` + 1 calls of level 5 at ``NCU_SHAPE``, bfloat16, causal."""
    from cuda_kernels.ops import portable_attention

    module = levels.build("attention", "cuda", causal=True)
    q, k, v = module.example_inputs(NCU_SHAPE, torch.bfloat16, "cuda")
    with torch.no_grad(), (portable_attention() if version == "portable" else contextlib.nullcontext()):
        for _ in range(NCU_WARMUP_LAUNCHES + 1):
            module(q, k, v)
    torch.cuda.synchronize()


def format_ncu(table: pd.DataFrame) -> str:
    """The ncu rows side by side, one line per metric (``NCU_METRICS``'s wording), then each run that
    did not profile and why."""
    lines = [f"Nsight Compute, level 5 at {NCU_SHAPE} bfloat16 causal, one launch each:"]
    ok = table[table["status"] == "ok"].set_index("title")
    if len(ok):
        shown = pd.DataFrame({title: [_format_metric(ok.loc[title].get(metric, math.nan)) for metric in NCU_METRICS]
                              for title in ok.index}, index=list(NCU_METRICS.values()))
        lines.append(shown.to_string())
    lines += [f"  {title}: {status}" for title, status in zip(table["title"], table["status"]) if status != "ok"]
    return "\n".join(lines)


def _format_metric(value: float) -> str:
    """Counts and large values whole, with thousands separators; percents and ratios to two decimals."""
    if math.isnan(value):
        return "—"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def write_ncu(out: Path) -> pd.DataFrame:
    """Both level-5 kernels under ncu, written to ``out / "hopper-ncu.csv"`` and printed."""
    table = pd.DataFrame([profile_with_ncu(version) for version in NCU_KERNELS])
    table.to_csv(out / "hopper-ncu.csv", index=False)
    print(format_ncu(table), flush=True)
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.hopper", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for the results (created if missing)")
    parser.add_argument("--ncu", action="store_true", help="also profile both level-5 kernels with Nsight Compute")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help=f"seconds of timing per row and point (default {BUDGET_S})")
    parser.add_argument("--ncu-child", choices=NCU_KERNELS, help=argparse.SUPPRESS)  # what ncu runs
    arguments = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("The Hopper sweep needs a CUDA device (lesson 09 reads its results on the CPU).", file=sys.stderr)
        return 2
    if arguments.ncu_child:
        run_ncu_child(arguments.ncu_child)
        return 0
    if arguments.out is None:
        parser.error("--out is required")
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    write_sequence_sweep(torch.device("cuda"), out, arguments.budget)
    if arguments.ncu:
        write_ncu(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
