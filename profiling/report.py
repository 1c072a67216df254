"""Reading a comparison: a terminal table and a bar chart of where each level stands.

Both show, for each row, the ceiling that fits the work: percent of copy bandwidth for a memory-bound
call, percent of matmul peak (with TFLOP/s) for a compute-bound one (``table.attrs["bound"]``, from
the cost model's FLOPs per byte against this device's ridge point). A percent above 100 is possible
and gets a footnote saying why, rather than being hidden.
"""

from __future__ import annotations

import math
import textwrap

import pandas as pd

from .peaks import copy_bytes, matmul_size

LEVEL_COLOUR, REFERENCE_COLOUR, GRAPH_COLOUR = "#1f77b4", "#9e9e9e", "#d62728"


def ceiling_column(table: pd.DataFrame) -> str:
    """The percent-of-peak column that fits this table's work: matmul peak if compute-bound, else copy bandwidth."""
    return "pct_matmul_peak" if table.attrs.get("bound") == "compute" else "pct_copy_bandwidth"


def over_100_footnote(table: pd.DataFrame) -> str | None:
    """Why some row's percent of peak exceeds 100, or None if none does."""
    column = ceiling_column(table)
    if not (table[column] > 100).any():
        return None
    attrs = table.attrs
    device_type = str(attrs.get("device", "cpu")).split(":")[0]
    if column == "pct_copy_bandwidth":
        moved, copied = attrs.get("bytes_moved", math.nan), copy_bytes(device_type)
        if moved < copied:
            return (f"* above 100 %: this call moves {moved / 1e6:.3g} MB, little enough to stay in the caches "
                    f"between runs, while the copy that sets 100 % moves {copied / 1e6:.0f} MB, more than the caches hold")
        # As large as the copy, so no cache holds it: the difference is DRAM's. A copy reads and writes
        # equally, and DRAM loses cycles each time its bus turns from reads to writes; a call that reads
        # more than it writes (AdamW reads four arrays and writes three) turns it less often.
        return (f"* above 100 %: this call moves {moved / 1e6:.3g} MB, as much as the copy that sets 100 % "
                f"({copied / 1e6:.0f} MB, one measurement in this process), so no cache holds it: a call that reads "
                "more than it writes turns DRAM's bus around less often than a copy, and can beat it by a little")
    size = matmul_size(device_type)
    return (f"* above 100 %: 100 % is one measured {size}×{size} matmul in this process; "
            "on a shared or clock-boosting device another call can run faster")


def _percent(value: float) -> str:
    text = f"{value:.0f}%" if value >= 10 else f"{value:.2g}%"
    return text + ("*" if value > 100 else "")


def _row_label(row, bound: str | None) -> str:
    """Speedup, then the throughput and share of the ceiling that fit the work."""
    if bound == "compute":
        return f"  {row['speedup']:.2f}×, {row['tflop_per_s']:.3g} TFLOP/s, {_percent(row['pct_matmul_peak'])} of matmul peak"
    if bound == "memory":
        return f"  {row['speedup']:.2f}×, {row['gb_per_s']:.3g} GB/s, {_percent(row['pct_copy_bandwidth'])} of copy BW"
    return f"  {row['speedup']:.2f}×"


def plot_comparison(table: pd.DataFrame, ax=None, title: str | None = None):
    """Horizontal bars of the median eager time per row on a log axis (so a slow interpreted row
    does not flatten the others), whiskers at the 10th and 90th percentiles, levels in blue and
    PyTorch's reference kernels in grey, a red diamond at the CUDA-graph replay time where there is
    one, and each bar labelled with its speedup and its throughput against the ceiling that fits."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    rows = table[table["status"] == "ok"].iloc[::-1]
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.8))
    attrs = table.attrs
    # Bars start at the axis's left edge: a log axis has no zero.
    low = min(rows["p10_ms"].min(), rows["graph_ms"].min(skipna=True) if rows["graph_ms"].notna().any() else math.inf)
    left = low / 2
    high = rows["p90_ms"].max()
    # Keep the longest bar in the left ~60 % of the axis, so its label fits to its right.
    right = 10 ** (math.log10(left) + (math.log10(high) - math.log10(left)) / 0.6)
    colours = [REFERENCE_COLOUR if kind == "reference" else LEVEL_COLOUR for kind in rows["kind"]]
    spread = [rows["median_ms"] - rows["p10_ms"], rows["p90_ms"] - rows["median_ms"]]
    ax.set_xscale("log")
    ax.barh(rows["title"], rows["median_ms"] - left, left=left, xerr=spread, color=colours, capsize=3)
    handles = [Patch(color=LEVEL_COLOUR, label="level (eager, launched from Python)"),
               Patch(color=REFERENCE_COLOUR, label="PyTorch reference (eager)")]
    if rows["graph_ms"].notna().any():
        # The GPU's own time: what is left of each bar when Python's launch overhead is taken out.
        ax.scatter(rows["graph_ms"], rows["title"], marker="D", color=GRAPH_COLOUR, s=18, zorder=3)
        handles.append(Line2D([], [], marker="D", color=GRAPH_COLOUR, linestyle="", label="CUDA-graph replay"))
    ax.legend(handles=handles, loc="best", fontsize=7)
    for position, (_, row) in enumerate(rows.iterrows()):
        # Labels start past the spread's far end so they never sit on a bar or its whisker.
        ax.annotate(_row_label(row, attrs.get("bound")), (row["p90_ms"], position), va="center", fontsize=8)
    ax.set_xlim(left, right)
    xlabel = "median time per call, ms (log scale; whiskers: 10th-90th percentile)"
    footnote = over_100_footnote(rows)
    # Wrapped to the axis' width: a footnote on one line runs past the figure's edge.
    ax.set_xlabel(xlabel + ("\n" + textwrap.fill(footnote, 150) if footnote else ""), fontsize=9)
    ax.set_title(title or "{component} {pass_} {shape} {dtype} on {device}: {bound}speedup vs {baseline}".format(
        component=attrs.get("component", ""), pass_="fwd+bwd" if attrs.get("backward") else "forward",
        shape=attrs.get("input_shape", ()), dtype=attrs.get("dtype", ""), device=attrs.get("device", ""),
        bound=f"{attrs['bound']}-bound, " if attrs.get("bound") else "", baseline=attrs.get("baseline_title", "")),
        fontsize=10)
    ax.figure.tight_layout()
    return ax


DISPLAY_COLUMNS = {
    "title": "level",
    "median_ms": "median ms",
    "p10_ms": "p10 ms",
    "p90_ms": "p90 ms",
    "graph_ms": "graph ms",
    "speedup": "speedup",
    "gb_per_s": "GB/s",
    "tflop_per_s": "TFLOP/s",
    "pct_copy_bandwidth": "% copy BW",
    "pct_matmul_peak": "% matmul peak",
    "max_error": "rel. error",
    "peak_memory_mb": "peak MB",
    "kernels": "kernels",
    "first_call_s": "first call s",
}


def format_table(table: pd.DataFrame) -> str:
    """The comparison as a terminal table: a header naming what was measured and against what, then
    one line a row; a level that could not run shows its reason instead of numbers."""
    attrs = table.attrs
    bound = attrs.get("bound")
    ceiling = (f" | {bound}-bound: {attrs['flop_per_byte']:.3g} FLOP/byte, ridge point {attrs['ridge_flop_per_byte']:.3g}"
               if bound else "")
    header = (f"{attrs.get('component')} {'forward+backward' if attrs.get('backward') else 'forward'} | "
              f"input {attrs.get('input_shape', ())} {attrs.get('dtype')} on {attrs.get('device')}{ceiling} | "
              f"copy {attrs.get('copy_bandwidth_gb_per_s', math.nan):.3g} GB/s, "
              f"matmul {attrs.get('matmul_peak_tflop_per_s', math.nan):.3g} TFLOP/s\n"
              f"speedup vs {attrs.get('baseline_title')} | times {attrs.get('timing', 'per call')}, eager | "
              "error = max|level - float64 level 1| / max|float64 level 1|")
    ok = table[table["status"] == "ok"]
    # Only the ceiling that fits the work: % of matmul peak says little about a memory-bound call.
    hidden = {"pct_copy_bandwidth", "pct_matmul_peak"} - {ceiling_column(table)} if bound else set()
    columns = {key: name for key, name in DISPLAY_COLUMNS.items() if key not in hidden}
    shown = ok[list(columns)].rename(columns=columns).dropna(axis=1, how="all")
    formats = {"rel. error": "{:.1e}".format, "first call s": "{:.2f}".format, "speedup": "{:.2f}x".format,
               "% copy BW": _percent, "% matmul peak": _percent}
    body = shown.to_string(index=False, float_format="{:.3g}".format, formatters=formats)
    footnote = over_100_footnote(ok)
    skipped = [f"  {row.title}: {row.status}" for row in table.itertuples() if row.status != "ok"]
    return "\n".join([header, body] + ([footnote] if footnote else []) + (["not run:"] + skipped if skipped else []))


def with_setup_columns(table: pd.DataFrame) -> pd.DataFrame:
    """The table with its attrs (component, shape, dtype, device, pass, baseline, ceilings) as leading columns."""
    setup = {key: str(value) for key, value in table.attrs.items()}
    return table.assign(**setup)[list(setup) + list(table.columns)]
