"""compute-sanitizer's memcheck over levels 4 and 5, at the shapes where their kernels take special paths.

A kernel can read past the end of its shared memory, or past a tensor, and still give the right answer: the
bytes it reads there are masked away, or happen to be harmless on this GPU. No equivalence test sees that; the
next GPU, driver or compiler may turn it into wrong answers or a fault. Level 4's causal attention forward at
head dims 72 and 88 did exactly that on an H200 (Triton 3.6: invalid ``__shared__`` reads, outputs right;
``profiling/results/h200/README.md``, session of 2026-11-29, seventh). NVIDIA's compute-sanitizer catches it:
its memcheck tool instruments every load and store of every kernel and reports each access outside an
allocation, with the kernel's name.

Each case (``CASES``: a component, its config and an input shape, at levels 4 and 5, in the dtypes whose
kernels differ) runs two forwards and backwards (``run_case`` says why two) in a process of its own under
memcheck, so an error belongs to one case; ``PROCESSES`` of them at a time, since each spends most of its
seconds on one host core. The head dims are the ones whose tiles differ (a padded tile, two column slices,
256); the row lengths are one program looping over a row (70,001) and a row split over many programs (524,288).

    python -m profiling.sanitize --out profiling/results/h100       # every case, a GPU and compute-sanitizer
    python -m profiling.sanitize --case "attention causal head dim 72" --level triton --dtype bfloat16

The second form is one case without the sanitizer, what each child process runs (on the CPU too, through
Triton's interpreter and the extension's CPU kernels, where memcheck has nothing to check). The GPU suite's
``--part sanitize`` runs the first (``--only`` picks cases by name there); it writes ``sanitize.md``, a row per
case: errors found, or why none could be counted.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import levels

ROW_WISE = ("layer_norm", "rms_norm", "softmax")
"""The components whose kernels take a row-length-dependent path, and float32 paths of their own (``dtypes``)."""

CASES = {
    # (batch, heads, seq, head_dim); a tuple of three shapes is q, k, v (grouped-query attention).
    **{f"attention causal head dim {d}": ("attention", {"causal": True}, (1, 2, 200, d))
       for d in (40, 72, 80, 88, 96, 168, 256)},
    "attention full head dim 72": ("attention", {"causal": False}, (1, 2, 200, 72)),
    "attention window head dim 96": ("attention", {"causal": True, "window": 37}, (1, 2, 200, 96)),
    "attention grouped heads": ("attention", {"causal": True}, ((1, 6, 130, 64), (1, 2, 130, 64), (1, 2, 130, 64))),
    **{f"{component} rows of {n}": (component, config, (rows, n))
       for component, config in zip(ROW_WISE, ({"normalized_shape": None}, {"normalized_shape": None}, {"dim": -1}))
       for rows, n in ((4, 70001), (2, 524288))},
    "swish": ("swish", {"beta": 1.0}, (4099,)),
    "feed_forward": ("feed_forward", {"n_embd": 48}, (3, 7, 48)),
    "linear_cross_entropy": ("linear_cross_entropy", {"n_embd": 40, "vocab_size": 1003}, (70, 40)),
}
"""name: (component, config, input shape). A ``normalized_shape`` of None is the row length."""

LEVELS = ("triton", "cuda")

BUDGET_S = 480.0
"""Seconds for all the cases of one run, each child process included."""

PROCESSES = 6
"""Cases under memcheck at once. One case took 7-13 s on an H200 machine, one after the other: 50 cases, 430 s,
more than a device call has beside the tests. Most of a case is host work on one core (starting Python, torch
and Triton, loading the extension, the sanitizer instrumenting each kernel as it loads) while the GPU idles;
the machines lent have 16 host cores, and one GPU takes several processes' contexts."""


def dtypes(name: str) -> tuple[str, ...]:
    """bfloat16 for every case (the 16-bit tiles, where the attention kernels' paths differ most); float32 too
    for the row-wise kernels, whose float32 paths stage other sizes in shared memory."""
    return ("bfloat16", "float32") if CASES[name][0] in ROW_WISE else ("bfloat16",)


def run_case(name: str, level: str, dtype: torch.dtype, device: torch.device) -> None:
    """Two forwards and backwards of case ``name`` at ``level``, every gradient computed, then a
    synchronisation, so any kernel's error surfaces inside this call. Two, because on a GPU level 4 replays
    a signature's second call from C++ where it can (``triton_kernels/replay.py``): the same kernels, launched
    with arguments the replay filled in, which memcheck then checks as well."""
    component, config, shape = CASES[name]
    if config.get("normalized_shape", 0) is None:
        config = {**config, "normalized_shape": shape[-1]}
    module = levels.build(component, level, **config).to(device)
    if any(p.is_floating_point() for p in module.parameters()):
        module = module.to(dtype)
    if isinstance(shape[0], tuple):
        inputs = tuple(torch.randn(s, dtype=dtype, device=device) for s in shape)
    else:
        inputs = module.example_inputs(shape, dtype, device)
    inputs = tuple(x.requires_grad_(x.is_floating_point()) for x in inputs)
    for _ in range(2):
        output = module(*inputs)
        output.backward(torch.randn_like(output))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ERROR_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")


def error_count(report: str) -> int | None:
    """The error count of compute-sanitizer's closing line, or None where the report has none (the process
    was killed, or the sanitizer itself failed)."""
    found = ERROR_SUMMARY.findall(report)
    return int(found[-1]) if found else None


def first_error(report: str) -> str:
    """The first error compute-sanitizer reported, in one line: what was accessed, where and by which kernel."""
    lines = [line.strip("= ").strip() for line in report.splitlines() if line.startswith("=========")]
    for i, line in enumerate(lines):
        if line.startswith(("Invalid", "Misaligned", "Out-of-range", "Address")):
            where = next((later for later in lines[i + 1:i + 4] if later.startswith("at ")), "")
            return f"{line} {where}".strip()
    return ""


def sanitize(name: str, level: str, dtype: str, sanitizer: str, timeout_s: float) -> dict:
    """Case ``name`` at ``level`` in ``dtype`` (a torch dtype's name) under memcheck, in a child process: its
    row of the table."""
    command = [sanitizer, "--tool", "memcheck", "--print-limit", "4", sys.executable, "-m", "profiling.sanitize",
               "--case", name, "--level", level, "--dtype", dtype]
    row = {"case": name, "level": level, "dtype": dtype}
    started = time.perf_counter()
    try:
        finished = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return row | {"errors": None, "seconds": timeout_s, "note": f"did not finish in {timeout_s:.0f} s"}
    report = finished.stdout + finished.stderr
    errors = error_count(report)
    note = first_error(report) if errors else ""
    if errors is None or (errors == 0 and finished.returncode != 0):
        note = f"exit {finished.returncode}: " + " ".join(report.strip().splitlines()[-2:])[:300]
    return row | {"errors": errors, "seconds": round(time.perf_counter() - started, 1), "note": note}


def sanitize_all(out: Path, names=tuple(CASES), budget_s: float = BUDGET_S, timeout_s: float = 120.0,
                 processes: int = PROCESSES) -> str:
    """The cases ``names`` (every case by default), at both levels and in their dtypes, each under memcheck,
    ``processes`` at a time, none started once ``budget_s`` is spent; the table, in the cases' order, goes
    to ``out/sanitize.md`` and is returned."""
    sanitizer = shutil.which("compute-sanitizer")
    header = ["| case | level | dtype | errors | seconds | first error, or why none were counted |",
              "| --- | --- | --- | --- | --- | --- |"]
    if sanitizer is None:
        table = "\n".join(header + ["| every case | | | | | compute-sanitizer is not on PATH (it ships with the "
                                    "CUDA toolkit) |"])
    else:
        started = time.perf_counter()

        def run(name: str, level: str, dtype: str) -> dict:
            if time.perf_counter() - started > budget_s:
                return {"case": name, "level": level, "dtype": dtype, "errors": None, "seconds": 0,
                        "note": f"not run: the part's {budget_s:.0f} s were spent"}
            row = sanitize(name, level, dtype, sanitizer, timeout_s)
            print(f"memcheck {name}, {level}, {dtype}: {row['errors']} errors", flush=True)
            return row

        runs = [(name, level, dtype) for name in names for level in LEVELS for dtype in dtypes(name)]
        # Threads, each waiting on its own child process: the work is in the children.
        with ThreadPoolExecutor(max_workers=processes) as pool:
            rows = list(pool.map(lambda job: run(*job), runs))
        table = "\n".join(header + [
            f"| {r['case']} | {r['level']} | {r['dtype']} | {'-' if r['errors'] is None else r['errors']} | "
            f"{r['seconds']} | {r['note'].replace('|', '/')} |" for r in rows])
    (out / "sanitize.md").write_text(table + "\n")
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiling.sanitize", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for sanitize.md: every case under memcheck")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all cases (default {BUDGET_S:g})")
    parser.add_argument("--processes", type=int, default=PROCESSES,
                        help=f"cases under memcheck at once (default {PROCESSES})")
    parser.add_argument("--case", choices=sorted(CASES), help="run this one case, without the sanitizer")
    parser.add_argument("--level", choices=LEVELS, default="triton")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    arguments = parser.parse_args(argv)
    if arguments.case:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        run_case(arguments.case, arguments.level, getattr(torch, arguments.dtype), device)
        print(f"ran {arguments.case}, {arguments.level}, {arguments.dtype}", flush=True)
        return 0
    if not arguments.out:
        parser.error("--out (every case under memcheck) or --case (one case)")
    out = Path(arguments.out)
    out.mkdir(parents=True, exist_ok=True)
    print(sanitize_all(out, budget_s=arguments.budget, processes=arguments.processes), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
