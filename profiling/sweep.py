"""The row-length sweep: one row-wise component over rows of 128 to 4,194,304 elements, at one total size.

A kernel tuned on (8192, 8192) can fall off at other row lengths for two opposite reasons, and the
sweep shows both on one axis. Short rows: one program per row moves too few bytes to hide the memory
latency, so a program must take several rows. Long rows with few of them: 2^26 elements as 16 rows
of 4,194,304 give 16 programs to a GPU with 132 SMs, so most of the chip idles unless a row is split
across programs. Holding the total fixed (2^26 elements: 256 MB in float32, far beyond the L2) keeps
the bytes moved equal at every point, so the percent of copy bandwidth is comparable along the line.

    python -m profiling --sweep row_length --component layer_norm --dtype bfloat16 --plot sweep.png

Every point is ``compare_optimization_levels`` on shape (total / N, N): the same checks against the
float64 reference, eager medians with graph replay beside them. torch.compile is reset before each
point, so level 3 is compiled for that exact shape (what a user with one shape gets), not a
shape-generic kernel from an earlier point.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from levels.spec import LEVEL_TITLES, default_device_and_dtype

from .compare import compare_optimization_levels

ROW_COMPONENTS = ("layer_norm", "rms_norm", "softmax")
"""Components that reduce over rows, whose kernels must choose a strategy by row length."""

ROW_LENGTHS = tuple(2**exponent for exponent in (*range(7, 23, 2), 22))
"""128, 512, … 2,097,152 (every second power of two) and 4,194,304 elements."""

TOTAL_ELEMENTS = {"cuda": 2**26, "cpu": 2**20}
"""Elements per point: beyond the GPU's L2; on the CPU small enough for the interpreter and float64."""


def row_length_sweep(component: str, row_lengths: Sequence[int] = ROW_LENGTHS, total_elements: int | None = None,
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                     levels: Iterable[str | int] | None = None, backward: bool = False, references: bool = True,
                     budget_s: float = 0.25, progress: bool = True) -> pd.DataFrame:
    """``compare_optimization_levels`` of ``component`` at every row length N on shape (total / N, N).

    Returns every point's rows stacked, with ``row_length`` and ``rows`` columns added (row lengths
    above the total are left out); ``attrs`` holds the setup of the sweep.
    """
    if component not in ROW_COMPONENTS:
        raise ValueError(f"the row-length sweep takes a row-wise component ({', '.join(ROW_COMPONENTS)}), got {component!r}")
    dtype, device = default_device_and_dtype(dtype, device)
    total = total_elements or TOTAL_ELEMENTS[device.type]
    lengths = [n for n in row_lengths if n <= total]
    if not lengths:
        raise ValueError(f"no row length in {tuple(row_lengths)} fits the total of {total} elements")
    points = []
    for row_length in tqdm(lengths, desc=f"{component} row lengths", unit="point", disable=not progress):
        torch._dynamo.reset()  # level 3 compiled for this shape, not reused from the last point
        table = compare_optimization_levels(component, (total // row_length, row_length), dtype=dtype, device=device,
                                            levels=levels, backward=backward, references=references,
                                            budget_s=budget_s, progress=False)
        points.append(table.assign(row_length=row_length, rows=total // row_length))
    sweep = pd.concat(points, ignore_index=True)
    sweep.attrs.update(component=component, dtype=str(dtype).removeprefix("torch."), device=str(device),
                       backward=backward, total_elements=total)
    return sweep


def format_sweep(sweep: pd.DataFrame, column: str = "pct_copy_bandwidth") -> str:
    """One line per row length, one column per level or reference: ``column`` (default: percent of
    copy bandwidth, from eager time), rows that did not run left blank."""
    ok = sweep[sweep["status"] == "ok"]
    table = ok.pivot_table(index="row_length", columns="level", values=column, sort=False)
    order = [key for key in dict.fromkeys(sweep["level"]) if key in table.columns]
    table = table[order].rename(columns=lambda key: LEVEL_TITLES.get(key, key))
    attrs = sweep.attrs
    title = (f"{attrs['component']} {'forward+backward' if attrs['backward'] else 'forward'}, {attrs['dtype']} on "
             f"{attrs['device']}, {attrs['total_elements']:,} elements per point: {column.replace('_', ' ')} (eager)")
    return title + "\n" + table.to_string(float_format=lambda value: f"{value:.0f}")


def plot_sweeps(sweeps: Sequence[pd.DataFrame], path: str) -> None:
    """One panel per sweep: percent of copy bandwidth (eager) against row length on a log₂ axis, a
    line per level (PyTorch's references dashed), 100 % marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(2, len(sweeps))
    rows = -(-len(sweeps) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(7 * columns, 4.2 * rows), squeeze=False)
    for sweep, ax in zip(sweeps, axes.flat):
        ok = sweep[sweep["status"] == "ok"]
        for key, points in ok.groupby("level", sort=False):
            reference = (points["kind"] == "reference").all()
            ax.plot(points["row_length"], points["pct_copy_bandwidth"], marker="o", markersize=3,
                    label=LEVEL_TITLES.get(key, key), linestyle="--" if reference else "-")
        ax.axhline(100, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("row length (elements)")
        ax.set_ylabel("% of copy bandwidth (eager)")
        attrs = sweep.attrs
        ax.set_title(f"{attrs['component']} {'fwd+bwd' if attrs['backward'] else 'forward'} {attrs['dtype']}, "
                     f"{attrs['total_elements']:,} elements")
        ax.legend(fontsize=7)
    for ax in axes.flat[len(sweeps):]:
        ax.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
