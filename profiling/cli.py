"""python -m profiling: compare the levels of one or more components from the shell.

Every chosen component is built at every chosen level, with PyTorch's own kernels beside them, checked
against a float64 run of level 1 and timed; one table per component is printed, and written to CSV
and PNG on request.

examples:
  python -m profiling                                   every component, sized for this device
  python -m profiling --component layer_norm --shape 8192 8192 --dtype bfloat16 --backward
  python -m profiling --component swish attention --budget 0.2 --csv results.csv --plot results.png
  python -m profiling --sweep row_length --component layer_norm softmax --dtype bfloat16 --plot sweep.png
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
import torch

import levels as ladder
from levels.spec import LEVEL_TITLES, resolve_level

from .compare import compare_optimization_levels
from .peaks import describe_device
from .report import format_table, plot_comparison, with_setup_columns
from .sweep import ROW_COMPONENTS, format_sweep, plot_sweeps, row_length_sweep

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}

# Rough one-time costs of a first call, in seconds, for the run's estimate: torch.compile's Inductor
# (one compile per component and pass, more for backward), Triton's interpreter (on the CPU a level-4
# call takes about a second, and a row makes about ten calls: first, check, warm-up, minimum runs) or
# its JIT (on a GPU), and TorchScript's scripting. The extension's first build is reported apart.
FIRST_CALL_S = {"compile": {"cpu": 20.0, "cuda": 15.0}, "triton": {"cpu": 15.0, "cuda": 5.0},
                "torchscript": {"cpu": 1.0, "cuda": 1.0}}
EXTENSION_BUILD_S = {"cpu": 60.0, "cuda": 70.0}


def parse_arguments(argv=None) -> argparse.Namespace:
    description, examples = __doc__.split("examples:")
    parser = argparse.ArgumentParser(prog="python -m profiling", description=description, epilog="examples:" + examples,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--component", nargs="+", choices=ladder.COMPONENTS, default=list(ladder.COMPONENTS),
                        metavar="NAME", help=f"components to compare (default: all): {', '.join(ladder.COMPONENTS)}")
    parser.add_argument("--shape", nargs="+", type=int, help="input shape (default: each component's, sized to the device)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="element type of inputs and weights (default float32; half precision runs levels 4-5 "
                             "only on a GPU)")
    parser.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--levels", nargs="+", help="levels to run, by name or 1-5 (default: all)")
    parser.add_argument("--baseline", help="the row speedups are relative to: a level (name or 1-5) or a reference's "
                                           "name (default: level 1)")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--no-references", action="store_true", help="leave out PyTorch's fused kernels")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row (default 1)")
    parser.add_argument("--csv", help="write all rows to this CSV file")
    parser.add_argument("--plot", help="write a bar chart of time per level (a sweep: %% of copy bandwidth against "
                                       "row length) to this PNG file")
    parser.add_argument("--sweep", choices=("row_length",),
                        help="row_length: each row-wise component over rows of 128 to 4,194,304 elements at one total "
                             f"size ({', '.join(ROW_COMPONENTS)}; --shape is ignored)")
    parser.add_argument("--total", type=int, help="elements per point of a sweep (default 2^26 on a GPU, 2^20 on the CPU)")
    arguments = parser.parse_args(argv)
    if arguments.sweep and not set(arguments.component) <= set(ROW_COMPONENTS):
        if arguments.component == list(ladder.COMPONENTS):
            arguments.component = [c for c in ROW_COMPONENTS if c in ladder.COMPONENTS]
        else:
            parser.error(f"--sweep row_length takes row-wise components only: {', '.join(ROW_COMPONENTS)}")
    return arguments


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    device = torch.device(arguments.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if arguments.sweep:
        return run_sweep(arguments, device)
    names = [resolve_level(level) for level in (arguments.levels or ladder.LEVELS)]
    shapes = {component: tuple(arguments.shape or ladder.level_class(component, "native").default_shapes[device.type])
              for component in arguments.component}
    print(describe_plan(shapes, names, arguments, device), file=sys.stderr, flush=True)
    tables = []
    for component, shape in shapes.items():
        table = compare_optimization_levels(
            component, shape, dtype=DTYPES[arguments.dtype], device=device, levels=names,
            backward=arguments.backward, references=not arguments.no_references, baseline=arguments.baseline,
            budget_s=arguments.budget,
        )
        print(format_table(table), end="\n\n", flush=True)
        tables.append(table)
    write_outputs(tables, arguments, save_plots)
    return 0


def run_sweep(arguments: argparse.Namespace, device: torch.device) -> int:
    sweeps = []
    for component in arguments.component:
        sweep = row_length_sweep(component, total_elements=arguments.total, dtype=DTYPES[arguments.dtype],
                                 device=device, levels=arguments.levels, backward=arguments.backward,
                                 references=not arguments.no_references, budget_s=arguments.budget)
        print(format_sweep(sweep), end="\n\n", flush=True)
        sweeps.append(sweep)
    write_outputs(sweeps, arguments, plot_sweeps)
    return 0


def write_outputs(tables: list, arguments: argparse.Namespace, plot) -> None:
    """``--csv``: every table's rows with its setup columns, in one file; ``--plot``: ``plot(tables, path)``."""
    if arguments.csv:
        pd.concat([with_setup_columns(table) for table in tables]).to_csv(arguments.csv, index=False)
        print(f"wrote {arguments.csv}", file=sys.stderr)
    if arguments.plot:
        plot(tables, arguments.plot)
        print(f"wrote {arguments.plot}", file=sys.stderr)


def describe_plan(shapes: dict, names: list[str], arguments: argparse.Namespace, device: torch.device) -> str:
    """What the run covers and roughly how long it takes, before it starts."""
    references = 0 if arguments.no_references else sum(
        len(ladder.build(component, "native", **ladder.level_class(component, "native").config_for_shape(shape))
            .reference_modules(device)) for component, shape in shapes.items())
    rows = len(shapes) * len(names) + references
    # Each row is timed for the budget (twice on CUDA: eager, then CUDA-graph replay), plus a first
    # call, a checked call and warm-up calls that are cheap except where something compiles.
    timing_s = rows * arguments.budget * (2 if device.type == "cuda" else 1)
    first_calls_s = len(shapes) * sum(FIRST_CALL_S.get(name, {}).get(device.type, 0.0) for name in names)
    lines = [
        f"Kernel Ladder on {describe_device(device)} | torch {torch.__version__}",
        f"comparing {', '.join(f'{component} {shape}' for component, shape in shapes.items())}",
        f"  {arguments.dtype}, {'forward+backward' if arguments.backward else 'forward'}, levels: "
        f"{', '.join(LEVEL_TITLES[name] for name in names)}"
        f"{'' if arguments.no_references else f' + {references} PyTorch reference rows'}",
        f"  about {_minutes(timing_s + first_calls_s)}: {rows} rows × {arguments.budget:g} s of timing"
        f"{' × 2 (eager and CUDA-graph replay)' if device.type == 'cuda' else ''} + ~{first_calls_s:.0f} s of first "
        f"calls (compilation{', Triton interpreter' if device.type == 'cpu' and 'triton' in names else ''})"
        + (f"; + ~{EXTENSION_BUILD_S[device.type]:.0f} s once if level 5's extension is not built yet"
           if "cuda" in names else ""),
    ]
    if device.type == "cpu":
        lines.append("note: CPU timings on a shared machine are noisy: compare the ratios between rows, not the "
                     "milliseconds.")
    return "\n".join(lines)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def save_plots(tables, path: str) -> None:
    """One chart per table, stacked, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [0.35 * int((table["status"] == "ok").sum()) + 1.8 for table in tables]
    figure, axes = plt.subplots(len(tables), 1, figsize=(10, sum(heights)), squeeze=False,
                                gridspec_kw={"height_ratios": heights})
    for table, ax in zip(tables, axes[:, 0]):
        plot_comparison(table, ax=ax)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
