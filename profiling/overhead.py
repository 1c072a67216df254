"""What one call costs at decode size: ``call_overhead``.

Generating text with a KV cache calls every component on one new token at a time. At those sizes the
work is a few kilobytes and the time of a call is almost all fixed cost: Python, the dispatcher,
autograd's bookkeeping, argument checks, the kernel launch. A level whose kernels are the fastest at
8192 × 8192 can still lose here, and this table shows by how much, forward and forward+backward, at
every level beside PyTorch's own kernels.
"""

from __future__ import annotations

import math
from typing import Iterable

import pandas as pd
import torch

from levels.spec import default_device_and_dtype

from .compare import compare_optimization_levels
from .report import with_setup_columns

DECODE_CASES: dict[str, tuple[str, tuple, dict | None]] = {
    # name: (component, input shape, config): GPT-2 small's widths, a handful of rows.
    "swish": ("swish", (8, 768), None),
    "layer_norm": ("layer_norm", (8, 768), None),
    "softmax": ("softmax", (8, 1024), None),
    # One new query of 12 heads of 64 against a cache of 64 keys: q, k and v shapes.
    "attention": ("attention", ((1, 12, 1, 64), (1, 12, 64, 64), (1, 12, 64, 64)), {"causal": True}),
    "feed_forward": ("feed_forward", (1, 8, 768), None),
}


def call_overhead(device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                  levels: Iterable[str | int] | None = None, cases: Iterable[str] | None = None,
                  budget_s: float = 0.2, progress: bool = True) -> pd.DataFrame:
    """Eager time of one call at decode size, per case × pass (forward, forward+backward) × row.

    Method: ``compare_optimization_levels(..., back_to_back=True)``: each sample times a batch of
    calls launched back to back from Python between two device synchronisations (wall clock), divided
    by the batch size; the median over up to 21 samples is ``median_ms``. That is what a decode loop pays
    per call, launch and dispatch included; on CUDA ``graph_ms`` beside it replays the same call as a
    CUDA graph, the GPU's own time, so the difference is the launch overhead.

    Args:
        device: default the GPU if there is one, else the CPU.
        dtype: default bfloat16 on a GPU (what a model serves in), float32 on the CPU (where levels
            4 and 5 compute only the IEEE types).
        levels: which levels (default all five); PyTorch's reference rows are always included.
        cases: names from ``DECODE_CASES`` (default all).
        budget_s: about how long to time each row.

    Returns:
        One DataFrame of every case: the setup columns (``benchmark`` names the case and pass, e.g.
        ``"decode swish forward"``), then the columns of ``compare_optimization_levels``.
    """
    _, device = default_device_and_dtype(None, device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    names = list(DECODE_CASES) if cases is None else list(cases)
    unknown = set(names) - DECODE_CASES.keys()
    if unknown or not names:
        raise ValueError(f"choose decode cases from {', '.join(DECODE_CASES)} (got {', '.join(names) or 'none'})")
    tables = []
    for name in names:
        component, shape, config = DECODE_CASES[name]
        for backward in (False, True):
            table = compare_optimization_levels(component, shape, dtype=dtype, device=device, levels=levels,
                                                backward=backward, config=config, budget_s=budget_s,
                                                back_to_back=True, progress=progress)
            table.attrs["benchmark"] = f"decode {name} {'fwd+bwd' if backward else 'forward'}"
            tables.append(with_setup_columns(table))
    return pd.concat(tables, ignore_index=True)


def format_overhead(table: pd.DataFrame) -> str:
    """Microseconds per call, one line per case and pass, one column per level or reference (eager;
    graph replay in brackets where there is one)."""
    ok = table[table["status"] == "ok"]
    cells = ok.assign(cell=[f"{eager * 1e3:.1f}" + ("" if math.isnan(graph) else f" ({graph * 1e3:.1f})")
                            for eager, graph in zip(ok["median_ms"], ok["graph_ms"])])
    grid = cells.pivot(index="benchmark", columns="title", values="cell")
    titles = list(dict.fromkeys(ok["title"]))
    grid = grid.reindex(index=list(dict.fromkeys(ok["benchmark"])), columns=titles).fillna("-")
    grid = grid.rename_axis(index=None, columns=None)
    return "µs per call, launched back to back (CUDA-graph replay in brackets)\n" + grid.to_string()
