"""``compare_optimization_levels``: every level of a component, side by side, in one table.

For each level (and each of PyTorch's own fused kernels, as reference rows) it measures, on the same
weights and the same fresh random input:

* steady-state time launched from Python (median, 10th-90th percentile spread), the speedup over
  level 1, and on CUDA also the time of a CUDA-graph replay of the same call: the GPU's own time with
  Python's launch overhead taken out (the gap between the two is what launching costs),
* achieved GB/s and TFLOP/s from the component's cost model, and the percent of this device's
  measured copy bandwidth (the ceiling of a memory-bound kernel), from the graph time on CUDA,
* the error against a float64 run of level 1, relative to the reference's largest value,
* peak memory and kernels launched (CUDA), and the one-time cost of the first call (compilation,
  extension build, autotuning) kept apart from the steady state.
"""

from __future__ import annotations

import copy
import math
from typing import Iterable, Mapping, Sequence

import pandas as pd
import torch
from torch import nn
from tqdm import tqdm

import levels as ladder
from levels.spec import (
    LEVEL_TITLES,
    TOLERANCE,
    ComponentSpec,
    as_reference_input,
    default_device_and_dtype,
    relative_max_error,
    resolve_level,
)

from .peaks import copy_bandwidth, matmul_throughput
from .timing import synchronize, time_once, time_runs

COLUMNS = [
    "level", "kind", "median_ms", "p10_ms", "p90_ms", "runs", "graph_ms", "speedup_vs_level_1", "GB/s", "TFLOP/s",
    "pct_copy_bandwidth", "pct_matmul_peak", "max_error", "within_tolerance", "peak_memory_MB", "kernels", "first_call_s", "status",
]


def perturb_parameters_(module: nn.Module, scale: float = 0.1, seed: int = 0) -> nn.Module:
    """Move every parameter off its initial value (LayerNorm's ones and zeros would hide a kernel
    that forgets the weight or the bias) by deterministic noise, in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.add_((noise * scale).to(parameter))
    return module


def compare_optimization_levels(
    component_or_modules: str | Mapping[str, nn.Module],
    input_shape: Sequence[int],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    levels: Iterable[str | int] | None = None,
    backward: bool = False,
    *,
    config: dict | None = None,
    references: bool = True,
    budget_s: float = 1.0,
    progress: bool = True,
) -> pd.DataFrame:
    """Time and check every level of a component on one input shape; one row per level.

    Args:
        component_or_modules: a component name (``"layer_norm"``) to build every level of it, or a
            dict ``{name: module}`` of your own modules; the first one is the baseline.
        input_shape: the shape of the input tensor, e.g. ``(8192, 8192)``.
        dtype, device: default float32 on the GPU if there is one, else the CPU.
        levels: which levels to run (names or 1-5); default all five.
        backward: time forward + backward (gradients of the input and every parameter).
        config: constructor arguments for the component; default derived from ``input_shape``.
        references: add PyTorch's own fused kernels (``F.layer_norm``, ``F.silu``) as reference rows.
        budget_s: about how long to spend timing each row.

    Returns:
        A DataFrame with the columns in ``COLUMNS``. A level that cannot run here (say, bfloat16 on
        the CPU) gets a row whose ``status`` says why instead of numbers.
    """
    dtype, device = default_device_and_dtype(dtype, device)
    if device.type == "cuda":
        # Blocks cached by earlier comparisons (and CUDA-graph pools) would otherwise crowd out this
        # one's float64 reference, and blur its peak-memory column.
        torch.cuda.empty_cache()
    input_shape = tuple(int(s) for s in input_shape)
    candidates, spec = _candidates(component_or_modules, input_shape, levels, config, references, device)
    for module in candidates.values():
        module.to(device=device, dtype=dtype)

    torch.manual_seed(0)
    if spec is not None:
        inputs = spec.example_inputs(input_shape, dtype, device)
        reference = ladder.float64_reference(spec)
    else:
        inputs = (torch.randn(input_shape, dtype=dtype, device=device),)
        reference = copy.deepcopy(next(iter(candidates.values()))).to(dtype=torch.float64)
    reference_inputs = tuple(as_reference_input(x).requires_grad_(backward and x.is_floating_point()) for x in inputs)
    reference_output = reference(*reference_inputs)
    grad_output = torch.randn_like(reference_output).to(dtype) if backward else None
    reference_values = [reference_output]
    if backward:
        reference_output.backward(grad_output.to(torch.float64))
        reference_values += _gradients(reference_inputs, reference)

    bandwidth = copy_bandwidth(str(device))
    cost_model = spec or next((m for m in candidates.values() if isinstance(m, ComponentSpec)), None)
    # Only compute-bound components (matmul-heavy, like attention) are judged against the matrix
    # units; elementwise and reduction work is judged against copy bandwidth alone.
    matmul_peak = matmul_throughput(str(device), dtype) if getattr(cost_model, "compute_bound", False) else None
    bytes_moved = cost_model.bytes_moved(input_shape, dtype, backward) if cost_model else math.nan
    flops = cost_model.flops(input_shape, backward) if cost_model else math.nan

    rows = []
    bar = tqdm(candidates.items(), desc="comparing levels", unit="level", disable=not progress, leave=False)
    for name, module in bar:
        bar.set_postfix_str(name)
        row = {"level": name, "kind": "level" if isinstance(module, ComponentSpec) else "reference"}
        row.update(_measure(module, inputs, grad_output, reference_values, device, dtype, budget_s))
        if row["status"] == "ok":
            # What the kernels achieve: the graph replay where there is one, else the eager time.
            seconds = (row["graph_ms"] if not math.isnan(row["graph_ms"]) else row["median_ms"]) / 1e3
            row["GB/s"] = bytes_moved / seconds / 1e9
            row["TFLOP/s"] = flops / seconds / 1e12
            row["pct_copy_bandwidth"] = 100 * bytes_moved / seconds / bandwidth
            row["pct_matmul_peak"] = 100 * flops / seconds / matmul_peak if matmul_peak else math.nan
        rows.append(row)

    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    baseline = table["median_ms"].iloc[0]
    table["speedup_vs_level_1"] = baseline / table["median_ms"]
    table.attrs.update(
        component=getattr(cost_model, "component", None), input_shape=input_shape, dtype=str(dtype).removeprefix("torch."),
        device=str(device), backward=backward, copy_bandwidth_GBps=bandwidth / 1e9,
        matmul_TFLOPs=matmul_peak / 1e12 if matmul_peak else math.nan,
    )
    return table


def _candidates(component_or_modules, input_shape, chosen_levels, config, references, device):
    """The modules to compare, in order, and the spec that owns the cost model (if any)."""
    if isinstance(component_or_modules, str):
        component = component_or_modules
        spec_class = ladder.level_class(component, "native")
        config = config if config is not None else spec_class.config_for_shape(input_shape)
        names = [resolve_level(level) for level in (chosen_levels or ladder.LEVELS)]
        native = perturb_parameters_(ladder.build(component, "native", **config))
        candidates = {}
        for name in names:
            module = native if name == "native" else ladder.build(component, name, **config)
            module.load_state_dict(native.state_dict())
            candidates[LEVEL_TITLES[name]] = module
        if references:
            candidates.update(native.reference_modules(device))
        return candidates, native
    if isinstance(component_or_modules, nn.Module):
        component_or_modules = {type(component_or_modules).__name__: component_or_modules}
    candidates = dict(component_or_modules)
    if not candidates:
        raise ValueError("compare_optimization_levels needs a component name or a non-empty {name: module} dict")
    first = next(iter(candidates.values()))
    return candidates, first if isinstance(first, ComponentSpec) else None


def _gradients(inputs, module) -> list[torch.Tensor]:
    tensors = [x.grad for x in inputs if x.is_floating_point()] + [p.grad for p in module.parameters()]
    return [g if g is not None else torch.zeros(()) for g in tensors]


def _measure(module, inputs, grad_output, reference_values, device, dtype, budget_s) -> dict:
    inputs = tuple(x.detach().requires_grad_(grad_output is not None and x.is_floating_point()) for x in inputs)
    parameters = list(module.parameters())

    def step():
        if grad_output is None:
            # A forward-only row is inference: no level pays for autograd's bookkeeping.
            with torch.no_grad():
                return module(*inputs)
        for tensor in (*inputs, *parameters):
            tensor.grad = None
        output = module(*inputs)
        output.backward(grad_output)
        return output

    try:
        first_call_s = time_once(step, device)
    except Exception as error:  # a level that cannot run here says why in its row, the rest go on
        return {"status": f"{type(error).__name__}: {str(error).splitlines()[0]}"}

    output = step()
    values = [output] + (_gradients(inputs, module) if grad_output is not None else [])
    error = max(relative_max_error(value, reference) for value, reference in zip(values, reference_values))
    timing = time_runs(step, device, budget_s=budget_s)
    return {
        "median_ms": timing.median_s * 1e3,
        "p10_ms": timing.p10_s * 1e3,
        "p90_ms": timing.p90_s * 1e3,
        "runs": timing.runs,
        "graph_ms": _graph_replay_ms(step, device, budget_s),
        "max_error": error,
        "within_tolerance": error <= TOLERANCE[dtype],
        "peak_memory_MB": _peak_memory_mb(step, device),
        "kernels": _kernels_launched(step, device),
        "first_call_s": first_call_s,
        "status": "ok",
    }


def _graph_replay_ms(step, device, budget_s) -> float:
    """Median ms of one call captured as a CUDA graph and replayed: every kernel of the call, launched
    by the GPU's own front end instead of Python. NaN on the CPU, or where the call cannot be captured."""
    if device.type != "cuda":
        return math.nan
    graph = torch.cuda.CUDAGraph()
    try:
        # Warm up on a side stream first, as capture requires (autograd and the allocator settle there).
        side_stream = torch.cuda.Stream(device)
        side_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side_stream):
            step()
        torch.cuda.current_stream(device).wait_stream(side_stream)
        with torch.cuda.graph(graph):
            step()
    except Exception:  # e.g. a level that synchronises inside its call: it simply has no graph time
        return math.nan
    return time_runs(graph.replay, device, budget_s=budget_s).median_s * 1e3


def _peak_memory_mb(step, device) -> float:
    """Memory the call allocates beyond what already lives (CUDA caching allocator's high-water mark)."""
    if device.type != "cuda":
        return math.nan
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def _kernels_launched(step, device) -> float:
    """GPU kernels one call launches, counted by the profiler (fusion's first visible effect)."""
    if device.type != "cuda":
        return math.nan
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        step()
        synchronize(device)
    return sum(1 for event in profiler.events() if event.device_type == DeviceType.CUDA
               and not event.name.startswith(("Memcpy", "Memset")))
