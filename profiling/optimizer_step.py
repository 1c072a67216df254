"""``compare_optimizers``: one AdamW step at every level, side by side, as ``compare_optimization_levels``
compares a component (which hands ``"adamw"`` here).

The "input" of an optimizer step is the model's parameters: the comparison takes their shapes (a tuple
of shapes, e.g. ``gpt2_small_parameter_shapes()``), gives every row the same random parameters and
gradients, and times ``optimizer.step()``. The step is memory-bound: the cost model counts the
parameters, gradients and both moments read and the parameters and moments written, 7 tensors' worth
of bytes, and no row can beat the copy bandwidth that moves them. PyTorch's own AdamW appears twice as
reference rows: ``foreach=True`` (a few kernels per step over lists of tensors, its default on the
GPU) and ``fused=True`` (one fused multi-tensor kernel, its fastest).
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import pandas as pd
import torch
from tqdm import tqdm

import levels as ladder
from levels.spec import LEVEL_TITLES, TOLERANCE, relative_max_error, resolve_level

from .peaks import copy_bandwidth, matmul_throughput
from .timing import kernels_launched, time_once, time_runs, time_side_by_side

HYPERPARAMETERS = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
"""GPT-2's training setting (nanoGPT's betas and decay); the step counts are the same for every row."""


def gpt2_small_parameter_shapes() -> tuple[tuple[int, ...], ...]:
    """The shapes of GPT-2 small's ~150 parameter tensors (124M values), read off a model built on the
    meta device (no memory, no initialisation)."""
    from levels.gpt import GPT2_SMALL

    with torch.device("meta"):
        model = ladder.build("gpt", "native", **GPT2_SMALL)
    return tuple(tuple(parameter.shape) for parameter in model.parameters())


def adamw_bytes_moved(parameter_shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> int:
    """Parameters, gradients and two moments read; parameters and two moments written."""
    return 7 * sum(math.prod(shape) for shape in parameter_shapes) * dtype.itemsize


def compare_optimizers(parameter_shapes: Sequence[Sequence[int]], dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None, levels: Iterable[str | int] | None = None,
                       references: bool = True, budget_s: float = 1.0, steps_checked: int = 3,
                       progress: bool = True) -> pd.DataFrame:
    """Time one AdamW step per level (and PyTorch's AdamW, foreach and fused) on parameters of
    ``parameter_shapes``; one row each, with ``compare_optimization_levels``'s columns where they apply.

    ``max_error`` compares the parameters after ``steps_checked`` steps from the same start with a
    float64 run of level 1, relative to the largest parameter."""
    from .compare import COLUMNS

    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or torch.float32
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(tuple(shape), generator=generator) for shape in parameter_shapes]
    gradients = [torch.randn(tuple(shape), generator=generator) * 1e-2 for shape in parameter_shapes]

    def fresh_parameters(on_dtype):
        parameters = [torch.nn.Parameter(p.to(device=device, dtype=on_dtype, copy=True)) for p in initial]
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient.to(device=device, dtype=on_dtype)
        return parameters

    def level_optimizer(level):
        return lambda params: ladder.build_optimizer(level, params, **HYPERPARAMETERS)

    chosen = [resolve_level(level) for level in (levels or ladder.LEVELS)]
    builders = {level: (LEVEL_TITLES[level], "level", level_optimizer(level)) for level in chosen}
    if references:
        for variant in ("foreach", "fused"):
            if variant == "fused" and device.type == "cpu" and dtype in (torch.float16, torch.bfloat16):
                continue
            builders[f"torch.optim.AdamW({variant}=True)"] = (
                f"torch.optim.AdamW({variant}=True)", "reference",
                lambda params, variant=variant: torch.optim.AdamW(params, **HYPERPARAMETERS, **{variant: True}))

    expected = fresh_parameters(torch.float64)
    reference_optimizer = ladder.build_optimizer("native", expected, **HYPERPARAMETERS)
    for _ in range(steps_checked):
        reference_optimizer.step()

    bytes_moved = adamw_bytes_moved(parameter_shapes, dtype)
    rows, steps = [], {}
    for key, (title, kind, build) in tqdm(builders.items(), desc="checking optimizers", unit="row", disable=not progress,
                                          leave=False):
        row = {"level": key, "title": title, "kind": kind}
        try:
            checked = fresh_parameters(dtype)
            optimizer = build(checked)
            row["first_call_s"] = time_once(optimizer.step, device)
            for _ in range(steps_checked - 1):
                optimizer.step()
            row["max_error"] = max(relative_max_error(a, b) for a, b in zip(checked, expected))
            row["within_tolerance"] = row["max_error"] <= TOLERANCE[dtype]
            row["kernels"] = kernels_launched(optimizer.step, device)
        except Exception as error:  # a row that cannot run here says why; the others go on
            rows.append({**row, "status": f"{type(error).__name__}: {str(error).splitlines()[0]}"})
            continue
        steps[key] = optimizer.step
        rows.append({**row, "status": "ok"})
    timings = time_side_by_side(steps, device, time_runs, budget_s=budget_s, progress=progress)
    bandwidth, matmul_peak = copy_bandwidth(str(device)), matmul_throughput(str(device), dtype)
    for row in rows:
        if row["level"] in timings:
            timing = timings[row["level"]]
            row.update(median_ms=timing.median_s * 1e3, p10_ms=timing.p10_s * 1e3, p90_ms=timing.p90_s * 1e3,
                       runs=timing.runs, gb_per_s=bytes_moved / timing.median_s / 1e9,
                       pct_copy_bandwidth=100 * bytes_moved / timing.median_s / bandwidth)
    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    baseline = "native" if "native" in steps else next(iter(steps), None)
    if baseline is not None:
        table["speedup"] = table.loc[table["level"] == baseline, "median_ms"].iloc[0] / table["median_ms"]
    table.attrs.update(component="adamw", input_shape=f"{len(parameter_shapes)} tensors, "
                       f"{sum(math.prod(s) for s in parameter_shapes):,} values", dtype=str(dtype).removeprefix("torch."),
                       device=str(device), backward=False, baseline=baseline,
                       baseline_title=LEVEL_TITLES.get(baseline, baseline), timing="per call",
                       copy_bandwidth_gb_per_s=bandwidth / 1e9, matmul_peak_tflop_per_s=matmul_peak / 1e12,
                       bytes_moved=bytes_moved, bound="memory",
                       # about 14 FLOPs per value (decay, two moments, square root, division, step)
                       flop_per_byte=14 / (7 * dtype.itemsize), ridge_flop_per_byte=matmul_peak / bandwidth)
    return table
