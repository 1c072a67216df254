"""``python -m profiling``: compare the levels of one or more components from the shell.

    python -m profiling                                   # every component, sized for this device
    python -m profiling --component layer_norm --shape 8192 8192 --dtype bfloat16 --backward
    python -m profiling --csv results.csv --plot results.png
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd
import torch

import levels as ladder

from .compare import compare_optimization_levels
from .peaks import describe_device
from .report import format_table, plot_comparison

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m profiling", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--component", nargs="+", choices=ladder.COMPONENTS, default=list(ladder.COMPONENTS))
    parser.add_argument("--shape", nargs="+", type=int, help="input shape (default: each component's, sized to the device)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--levels", nargs="+", help="levels to run, by name or 1-5 (default: all)")
    parser.add_argument("--backward", action="store_true", help="time forward + backward")
    parser.add_argument("--no-references", action="store_true", help="leave out PyTorch's fused kernels")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per level (default 1)")
    parser.add_argument("--csv", help="write all rows to this CSV file")
    parser.add_argument("--plot", help="write a bar chart of time per level to this PNG file")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    arguments = parse_arguments(argv)
    device = torch.device(arguments.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"Kernel Ladder on {describe_device(device)} | torch {torch.__version__}", file=sys.stderr)
    tables = []
    for component in arguments.component:
        shape = tuple(arguments.shape or ladder.level_class(component, "native").default_shapes[device.type])
        table = compare_optimization_levels(
            component, shape, dtype=DTYPES[arguments.dtype], device=device, levels=arguments.levels,
            backward=arguments.backward, references=not arguments.no_references, budget_s=arguments.budget,
        )
        print(format_table(table), end="\n\n", flush=True)
        tables.append(table)
    if arguments.csv:
        pd.concat([with_setup_columns(table) for table in tables]).to_csv(arguments.csv, index=False)
    if arguments.plot:
        save_plots(tables, arguments.plot)
    return 0


def with_setup_columns(table: pd.DataFrame) -> pd.DataFrame:
    """The table with its attrs (component, shape, dtype, device, pass) as leading columns."""
    setup = {key: str(value) for key, value in table.attrs.items()}
    return table.assign(**setup)[list(setup) + list(table.columns)]


def save_plots(tables, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(tables), 1, figsize=(9, 3.2 * len(tables)), squeeze=False)
    for table, ax in zip(tables, axes[:, 0]):
        plot_comparison(table, ax=ax)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
