"""Reading a comparison: a terminal table and a bar chart of where each level stands."""

from __future__ import annotations

import pandas as pd


def plot_comparison(table: pd.DataFrame, ax=None, title: str | None = None):
    """Horizontal bars of median time per level launched from Python (with the 10th-90th percentile
    spread), reference rows in grey, a red diamond at the CUDA-graph replay time where there is one,
    and each bar labelled with its speedup over level 1 and its share of copy bandwidth."""
    import matplotlib.pyplot as plt

    rows = table[table["status"] == "ok"].iloc[::-1]
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.5))
    colours = ["#9e9e9e" if kind == "reference" else "#1f77b4" for kind in rows["kind"]]
    spread = [rows["median_ms"] - rows["p10_ms"], rows["p90_ms"] - rows["median_ms"]]
    ax.barh(rows["level"], rows["median_ms"], xerr=spread, color=colours, capsize=3, label="launched from Python")
    if rows["graph_ms"].notna().any():
        # The GPU's own time: what is left of each bar when Python's launch overhead is taken out.
        ax.scatter(rows["graph_ms"], rows["level"], marker="D", color="#d62728", s=18, zorder=3,
                   label="CUDA-graph replay")
        ax.legend(loc="lower right", fontsize=7)
    for position, (_, row) in enumerate(rows.iterrows()):
        # Labels start past the spread's far end so they never sit on a bar or its whisker.
        ax.annotate(f"  {row['speedup_vs_level_1']:.2f}x, {row['pct_copy_bandwidth']:.0f}% of copy BW",
                    (row["p90_ms"], position), va="center", fontsize=8)
    ax.set_xlabel("median time per call (ms)")
    ax.set_xlim(0, rows["p90_ms"].max() * 1.7)
    attrs = table.attrs
    ax.set_title(title or "{component} {pass_} {shape} {dtype} on {device}".format(
        component=attrs.get("component", ""), pass_="fwd+bwd" if attrs.get("backward") else "forward",
        shape=tuple(attrs.get("input_shape", ())), dtype=attrs.get("dtype", ""), device=attrs.get("device", "")))
    ax.figure.tight_layout()
    return ax


DISPLAY_COLUMNS = {
    "level": "level",
    "median_ms": "median ms",
    "p10_ms": "p10 ms",
    "p90_ms": "p90 ms",
    "graph_ms": "graph ms",
    "speedup_vs_level_1": "speedup",
    "GB/s": "GB/s",
    "TFLOP/s": "TFLOP/s",
    "pct_copy_bandwidth": "% copy BW",
    "pct_matmul_peak": "% matmul peak",
    "max_error": "rel. error",
    "peak_memory_MB": "peak MB",
    "kernels": "kernels",
    "first_call_s": "first call s",
}


def format_table(table: pd.DataFrame) -> str:
    """The comparison as a terminal table: a header naming what was measured, then one line a level;
    a level that could not run shows its reason instead of numbers."""
    attrs = table.attrs
    header = (f"{attrs.get('component')} {'forward+backward' if attrs.get('backward') else 'forward'} | "
              f"input {tuple(attrs.get('input_shape', ()))} {attrs.get('dtype')} on {attrs.get('device')} | "
              f"copy bandwidth {attrs.get('copy_bandwidth_GBps', float('nan')):.0f} GB/s | "
              "error = max|level - float64 level 1| / max|float64 level 1|")
    ok = table[table["status"] == "ok"]
    shown = ok[list(DISPLAY_COLUMNS)].rename(columns=DISPLAY_COLUMNS).dropna(axis=1, how="all")
    formats = {"rel. error": "{:.1e}".format, "first call s": "{:.2f}".format, "speedup": "{:.2f}x".format}
    body = shown.to_string(index=False, float_format="{:.3g}".format, formatters=formats)
    skipped = [f"  {row.level}: {row.status}" for row in table.itertuples() if row.status != "ok"]
    return "\n".join([header, body] + (["not run:"] + skipped if skipped else []))
