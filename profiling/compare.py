"""``compare_optimization_levels``: every level of a component, side by side, in one table.

For each level (and each of PyTorch's own fused kernels, as reference rows) it measures, on the same
weights and the same fresh random input:

* steady-state time launched from Python (median, 10th-90th percentile spread): the *eager* time, what
  a user gets, and the basis of every ratio in the row: the speedup over the baseline row (level 1
  unless told otherwise), GB/s and TFLOP/s from the component's cost model, and the percent of this
  device's measured copy bandwidth (the ceiling of memory-bound work) and matrix throughput (the
  ceiling of compute-bound work),
* on CUDA, beside it, the time of a CUDA-graph replay of the same call: the GPU's own time with
  Python's launch overhead taken out (the gap between the two is what launching costs),
* the error against a float64 run of level 1, relative to the reference's largest value,
* peak memory and kernels launched (CUDA), and the one-time cost of the first call (compilation,
  extension build, autotuning) kept apart from the steady state.

Which ceiling applies is the roofline's question: a call whose arithmetic intensity (FLOPs per byte
of the cost model) is below this device's ridge point (matmul FLOP/s over copy bytes/s) cannot keep
the matrix units busy, so it is memory-bound; ``table.attrs["bound"]`` says which, per shape (attention
over a long sequence is compute-bound, one decoded query over a cache is not).

``call_overhead`` asks the other question: at decode sizes (one token to a few rows) what does one
call cost, launch and dispatch included, at every level?
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
from levels.backends import cuda_backend, triton_backend
from levels.spec import (
    LEVEL_TITLES,
    TOLERANCE,
    ComponentSpec,
    LevelUnavailableError,
    as_reference_input,
    default_device_and_dtype,
    relative_max_error,
    resolve_level,
)

from .peaks import copy_bandwidth, matmul_throughput
from .timing import (
    kernels_launched,
    peak_memory_mb,
    time_back_to_back,
    time_once,
    time_runs,
    time_side_by_side,
)

COLUMNS = [
    "level", "title", "kind", "median_ms", "p10_ms", "p90_ms", "runs", "graph_ms", "speedup", "gb_per_s",
    "tflop_per_s", "pct_copy_bandwidth", "pct_matmul_peak", "max_error", "within_tolerance", "peak_memory_mb",
    "kernels", "first_call_s", "status",
]
"""The columns of a comparison. ``level`` is the row's key (``"native"`` … ``"cuda"``, or a reference's
name), ``title`` its display name; times in ms, ``speedup`` over the baseline row, throughputs from
``median_ms`` (eager), ``graph_ms`` the CUDA-graph replay beside it."""


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
    input_shape: Sequence[int] | Sequence[Sequence[int]],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    levels: Iterable[str | int] | None = None,
    backward: bool = False,
    *,
    config: dict | None = None,
    references: bool = True,
    baseline: str | int | None = None,
    budget_s: float = 1.0,
    back_to_back: bool = False,
    progress: bool = True,
) -> pd.DataFrame:
    """Time and check every level of a component on one input shape; one row per level.

    Args:
        component_or_modules: a component name (``"layer_norm"``) to build every level of it, or a
            dict ``{name: module}`` of your own modules; or ``"adamw"``, the optimizer (one step per
            level, ``profiling.optimizer_step``).
        input_shape: the shape of the input tensor, e.g. ``(8192, 8192)``; for attention also a tuple
            of three shapes (q, k, v), e.g. one query over a cache of keys; for ``"adamw"`` the shapes
            of the parameters (``optimizer_step.gpt2_small_parameter_shapes()``).
        dtype, device: default float32 on the GPU if there is one, else the CPU.
        levels: which levels to run (names or 1-5); default all five.
        backward: time forward + backward (gradients of the input and every parameter).
        config: constructor arguments for the component; default derived from ``input_shape``.
        references: add PyTorch's own fused kernels (``F.layer_norm``, ``F.silu``) as reference rows.
        baseline: the row every ``speedup`` is relative to (a level name or 1-5, a reference's or a
            dict's key); default level 1 if it is in the table, else the first row.
        budget_s: about how long to spend timing each row.
        back_to_back: time batches of calls launched back to back between two synchronisations, for
            calls so short that one timed call would measure the timer (see ``call_overhead``).

    Returns:
        A DataFrame with the columns in ``COLUMNS``; ``table.attrs`` holds the setup (component,
        shape, dtype, device, pass), the baseline, the device's ceilings and whether this shape is
        memory- or compute-bound. A level that cannot run here (say, bfloat16 on the CPU) gets a row
        whose ``status`` says why instead of numbers.
    """
    if isinstance(component_or_modules, str) and component_or_modules == "adamw":
        # An optimizer has no forward to call: its "input" is the parameters, given by their shapes.
        from .optimizer_step import compare_optimizers

        return compare_optimizers(input_shape, dtype, device, levels, references, budget_s, progress=progress)
    dtype, device = default_device_and_dtype(dtype, device)
    if device.type == "cuda":
        # Blocks cached by earlier comparisons (and CUDA-graph pools) would otherwise crowd out this
        # one's float64 reference, and blur its peak-memory column.
        torch.cuda.empty_cache()
    input_shape = _as_shape(input_shape)
    candidates, titles, spec = _candidates(component_or_modules, input_shape, levels, config, references, device)
    baseline_key = _baseline_key(baseline, candidates)
    for module in candidates.values():
        module.to(device=device, dtype=dtype)
    if spec is not None:
        # The float64 reference is built from the spec's weights on the spec's device, also when level 1
        # itself is not a row.
        spec.to(device=device, dtype=dtype)

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

    cost_model = spec or next((m for m in candidates.values() if isinstance(m, ComponentSpec)), None)
    bytes_moved = cost_model.bytes_moved(input_shape, dtype, backward) if cost_model else math.nan
    flops = cost_model.flops(input_shape, backward) if cost_model else math.nan
    bandwidth = copy_bandwidth(str(device))
    matmul_peak = matmul_throughput(str(device), dtype)
    _load_kernel_backends(candidates)

    timer = time_back_to_back if back_to_back else time_runs
    rows, steps = [], {}
    bar = tqdm(candidates.items(), desc="checking levels", unit="level", disable=not progress, leave=False)
    for key, module in bar:
        bar.set_postfix_str(titles[key])
        row = {"level": key, "title": titles[key], "kind": "level" if isinstance(module, ComponentSpec) else "reference"}
        step, checks = _check(module, inputs, grad_output, reference_values, device, dtype, budget_s, timer)
        row.update(checks)
        if step is not None:
            steps[key] = step
        rows.append(row)
    # The rows are timed side by side, in turns, so that their ratios compare like with like.
    timings = time_side_by_side(steps, device, timer, budget_s=budget_s, progress=progress)
    for row in rows:
        if row["level"] not in timings:
            continue
        timing = timings[row["level"]]
        row.update(median_ms=timing.median_s * 1e3, p10_ms=timing.p10_s * 1e3, p90_ms=timing.p90_s * 1e3,
                   runs=timing.runs)
        # One basis for every ratio in the row: the eager time, what a user gets.
        seconds = timing.median_s
        row["gb_per_s"] = bytes_moved / seconds / 1e9
        row["tflop_per_s"] = flops / seconds / 1e12
        row["pct_copy_bandwidth"] = 100 * bytes_moved / seconds / bandwidth
        row["pct_matmul_peak"] = 100 * flops / seconds / matmul_peak

    table = pd.DataFrame(rows).reindex(columns=COLUMNS)
    table["speedup"] = table.loc[table["level"] == baseline_key, "median_ms"].iloc[0] / table["median_ms"]
    intensity = flops / bytes_moved
    ridge = matmul_peak / bandwidth
    table.attrs.update(
        component=getattr(cost_model, "component", None), input_shape=input_shape,
        dtype=str(dtype).removeprefix("torch."), device=str(device), backward=backward,
        baseline=baseline_key, baseline_title=titles[baseline_key], timing="back to back" if back_to_back else "per call",
        copy_bandwidth_gb_per_s=bandwidth / 1e9, matmul_peak_tflop_per_s=matmul_peak / 1e12,
        bytes_moved=bytes_moved, flop_per_byte=intensity, ridge_flop_per_byte=ridge,
        bound=None if math.isnan(intensity) else ("compute" if intensity >= ridge else "memory"),
    )
    return table


def _as_shape(shape) -> tuple:
    """``shape`` as a tuple of ints, or a tuple of such tuples (one per input)."""
    if shape and isinstance(shape[0], Sequence):
        return tuple(tuple(int(s) for s in one) for one in shape)
    return tuple(int(s) for s in shape)


def _candidates(component_or_modules, input_shape, chosen_levels, config, references, device):
    """The modules to compare, by key and in order, their display titles, and the spec that owns the
    cost model (if any)."""
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
            candidates[name] = module
        titles = {name: LEVEL_TITLES[name] for name in candidates}
        if references:
            for name, module in native.reference_modules(device).items():
                candidates[name], titles[name] = module, name
        return candidates, titles, native
    if isinstance(component_or_modules, nn.Module):
        component_or_modules = {type(component_or_modules).__name__: component_or_modules}
    candidates = dict(component_or_modules)
    if not candidates:
        raise ValueError("compare_optimization_levels needs a component name or a non-empty {name: module} dict")
    first = next(iter(candidates.values()))
    return candidates, {name: name for name in candidates}, first if isinstance(first, ComponentSpec) else None


def _baseline_key(baseline, candidates) -> str:
    """The key of the row speedups are relative to: as asked, else level 1 if present, else the first row."""
    if baseline is None:
        return "native" if "native" in candidates else next(iter(candidates))
    if baseline in candidates:
        return baseline
    try:
        key = resolve_level(baseline)
    except ValueError:
        key = None
    if key not in candidates:
        named = f" ({key})" if key and key != baseline else ""
        raise ValueError(f"baseline {baseline!r}{named} is not a row of this comparison (rows: {', '.join(candidates)})")
    return key


def _load_kernel_backends(candidates) -> None:
    """Import Triton and build or load the extension before any progress bar starts, so that what
    they print (the interpreter notice on the CPU, the build log) stands on its own lines. A backend
    that cannot load is left for its level's row to report."""
    for level, load in (("triton", triton_backend), ("cuda", cuda_backend)):
        if any(getattr(module, "level", None) == level for module in candidates.values()):
            try:
                load()
            except (ImportError, LevelUnavailableError, RuntimeError, OSError):
                pass


def _gradients(inputs, module) -> list[torch.Tensor]:
    tensors = [x.grad for x in inputs if x.is_floating_point()] + [p.grad for p in module.parameters()]
    return [g if g is not None else torch.zeros(()) for g in tensors]


def _check(module, inputs, grad_output, reference_values, device, dtype, budget_s, timer) -> tuple:
    """Everything about one row but its eager time: the first call, the error against the float64
    reference, graph replay, peak memory and kernel count. Returns the call to time (None if the row
    cannot run here) and the row's columns."""
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
        return None, {"status": f"{type(error).__name__}: {str(error).splitlines()[0]}"}

    output = step()
    values = [output] + (_gradients(inputs, module) if grad_output is not None else [])
    error = max(relative_max_error(value, reference) for value, reference in zip(values, reference_values))
    return step, {
        "graph_ms": _graph_replay_ms(step, device, budget_s, timer),
        "max_error": error,
        "within_tolerance": error <= TOLERANCE[dtype],
        "peak_memory_mb": peak_memory_mb(step, device),
        "kernels": kernels_launched(step, device),
        "first_call_s": first_call_s,
        "status": "ok",
    }


def _graph_replay_ms(step, device, budget_s, timer) -> float:
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
    return timer(graph.replay, device, budget_s=budget_s).median_s * 1e3
