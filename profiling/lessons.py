"""What the lessons share: op counting, the float64 check, the H100 measurements, and the exercises.

The notebooks import these instead of each defining its own copy:

    aten_ops, tensor_passes        what level 1 dispatches, and how many full-size tensor passes it makes
    inductor_kernels               the kernels level 3 generated, by name
    cuda_kernel_sources            the __global__ kernels of one of level 5's .cu files, as text
    source_lines                   a stretch of a function's or kernel's source, for a lesson to show
    matches_float64                one level's output and gradients against float64 level 1
    measured, show_measured        rows of the committed H100 run (``profiling/results/h100/``)
    check_exercise                 a learner's exercise against the float64 truth, as one line

The measurements are files in the repository, so a lesson that prints them prints the same numbers on
every machine: the numbers live in ``profiling/results/`` and nowhere else. Re-running the GPU suite
changes them, and the lessons that print them must then be executed again.

An exercise check runs the learner's function on fresh random inputs (fixed seeds, never the inputs
the lesson showed), compares each result with a float64 run of the formula (level 1 where it
exists, else our reference solution in ``levels/exercises.py``) within the tolerance of the dtype
the exercise computes in (float32, or float64 where the point is exact agreement), and prints one
line: ``exercise relu_squared: pass``, ``... not implemented yet`` (the skeleton raises
NotImplementedError) or ``... fail: <why>``, the why an error size or, for exercises that patch a
model, what was left unpatched or copied. Our own solutions, in ``triton_kernels/exercises.py``
and ``levels/exercises.py``, pass the same checks in ``tests/test_exercises.py``.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import pandas as pd
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import levels
from levels.attention import attention_math
from levels.exercises import post_norm_block
from levels.gpt import TINY

from .compare import perturb_parameters_
from .distributed import CONFIGS, backward_on_slice, build_optimizer, global_batch

# --- counting level 1's ops and passes --------------------------------------------------------------------

NO_KERNEL = {"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::expand", "aten::as_strided",
             "aten::detach", "aten::unsqueeze", "aten::squeeze", "aten::empty", "aten::empty_like",
             "aten::empty_strided"}
"""Ops that only relabel memory (views) or allocate without writing: no kernel, no bytes."""

REDUCTIONS = {"aten::sum", "aten::mean"}
"""Ops whose output is smaller than their input: they read a full-size tensor but write no full one."""


def aten_ops(function: Callable[[], object]) -> list[tuple[str, list[tuple[int, ...]]]]:
    """The ATen ops ``function()`` dispatches, with the shapes of their tensor inputs (top-level ops
    only: an op that another ATen op calls is part of its caller's kernel)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        function()
    return [(event.name, [tuple(shape) for shape in event.input_shapes if shape])
            for event in profiler.events()
            if event.name.startswith("aten::") and event.name not in NO_KERNEL
            and not (event.cpu_parent is not None and event.cpu_parent.name.startswith("aten::"))]


def tensor_passes(ops, shape) -> tuple[int, int]:
    """(reads, writes) of full-size tensors: full-size inputs are read, non-reductions write one output.
    A tensor passed twice to one op (``c * c``) counts as two reads, though a kernel reads it once."""
    reads = sum(input_shapes.count(tuple(shape)) for _, input_shapes in ops)
    writes = sum(1 for name, input_shapes in ops if tuple(shape) in input_shapes and name not in REDUCTIONS)
    return reads, writes


# --- showing what levels 3 and 5 run ------------------------------------------------------------------------

KERNEL_DEFINITION = re.compile(r"^(\w+) = async_compile\.\w+\(", re.MULTILINE)
"""How an Inductor-generated module defines each kernel: ``name = async_compile.cpp_pybinding(`` or ``.triton(``."""


def inductor_kernels(module_source: str) -> dict[str, str]:
    """``{name: definition}`` of every kernel in one module that ``run_and_get_code`` returns (a
    definition runs to the next one, or to the ``async_compile.wait`` that follows the last)."""
    starts = [match.start() for match in KERNEL_DEFINITION.finditer(module_source)]
    ends = [*starts[1:], module_source.find("async_compile.wait", starts[-1])] if starts else []
    return {KERNEL_DEFINITION.match(module_source, start)[1]: module_source[start:end].rstrip()
            for start, end in zip(starts, ends)}


def source_lines(function, first: str, stop: str | None = None) -> str:
    """The lines of ``function``'s source (a @triton.jit kernel's Python too, or source text such as a
    CUDA kernel from ``cuda_kernel_sources``) from the one holding ``first`` up to, not including, the
    next one holding ``stop``; to the end without ``stop``."""
    source = function if isinstance(function, str) else inspect.getsource(getattr(function, "fn", function))
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    end = len(lines) if stop is None else next(i for i in range(start + 1, len(lines)) if stop in lines[i])
    return "\n".join(lines[start:end])


def cuda_kernel_sources(file_name: str) -> list[str]:
    """Each ``__global__`` function of ``cuda_kernels/<file_name>``, with the comment and template lines
    above it, up to its closing brace in column 0. Read as text: importing cuda_kernels builds the extension."""
    folder = importlib.util.find_spec("cuda_kernels").submodule_search_locations[0]
    lines = (Path(folder) / file_name).read_text().splitlines()
    kernels = []
    for index, line in enumerate(lines):
        if "__global__" in line:
            start = index
            while start > 0 and lines[start - 1].startswith(("//", "template")):
                start -= 1
            kernels.append("\n".join(lines[start:lines.index("}", index) + 1]))
    return kernels


# --- the float64 check --------------------------------------------------------------------------------------

TOLERANCE = levels.TOLERANCE[torch.float32]


def matches_float64(component: str, level: str, inputs: dict[str, tuple[int, ...]], output: str = "y",
                    **config) -> dict[str, bool]:
    """Output and every gradient (of each input and each parameter) of ``component`` at ``level`` in
    float32, each within tolerance of a float64 run of level 1 with the same weights and inputs.

    ``inputs`` names the forward's arguments and their shapes, e.g. ``{"x": (37, 1000)}`` or
    ``{"q": ..., "k": ..., "v": ...}``; the result is keyed ``output``, ``d<input>``, ``d<parameter>``."""
    torch.manual_seed(0)
    module = perturb_parameters_(levels.build(component, level, **config))
    reference = levels.float64_reference(module)
    shapes = list(inputs.values())
    values = (module.example_inputs(shapes[0], torch.float32, "cpu") if len(shapes) == 1
              else [torch.randn(shape) for shape in shapes])
    results = []
    for candidate, dtype in ((module, torch.float32), (reference, torch.float64)):
        leaves = [value.to(dtype).detach().requires_grad_() for value in values]
        y = candidate(*leaves)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
        results.append((y, *(leaf.grad for leaf in leaves), *(p.grad for p in candidate.parameters())))
    names = [output, *(f"d{name}" for name in inputs), *(f"d{name}" for name, _ in module.named_parameters())]
    return {name: levels.relative_max_error(value, truth) <= TOLERANCE for name, value, truth in zip(names, *results)}


# --- the H100 measurements ---------------------------------------------------------------------------------

RESULTS = Path(__file__).parent / "results" / "h100"
"""Where ``python -m profiling.gpu_suite`` writes the H100 run that the lessons quote."""


def measured(benchmark: str, file: str = "benchmarks.csv") -> pd.DataFrame:
    """The rows of one benchmark (e.g. ``"swish forward float32"``) in a results file, indexed by level."""
    table = pd.read_csv(RESULTS / file)
    rows = table[table["benchmark"] == benchmark]
    if rows.empty:
        raise KeyError(f"no benchmark {benchmark!r} in {file}: it has {sorted(set(table['benchmark']))}")
    return rows.set_index("level")


FORMATS = {"median_ms": ("eager ms", "{:.3f}"), "graph_ms": ("graph ms", "{:.3f}"), "speedup": ("speedup", "{:.2f}×"),
           "pct_copy_bandwidth": ("% copy bw", "{:.0f}"), "pct_matmul_peak": ("% matmul", "{:.0f}"),
           "kernels": ("kernels", "{:.0f}"), "tokens_per_s": ("tokens/s", "{:,.0f}"),
           "peak_memory_mb": ("peak MB", "{:,.0f}"), "same_tokens_as_level_1": ("same tokens as 1", "{}")}
"""How each column prints: rounded so that the lesson shows what matters and nothing that is noise."""


DEFAULT_COLUMNS = ("median_ms", "graph_ms", "speedup", "pct_copy_bandwidth", "kernels")


def show_measured(benchmark: str, file: str = "benchmarks.csv", columns: tuple[str, ...] = DEFAULT_COLUMNS) -> None:
    """Print one benchmark of the committed H100 run: eager time (what a user gets) and CUDA-graph
    replay time (the same kernels without the host's launch cost) side by side. A benchmark the
    committed run does not hold yet says so."""
    try:
        rows = measured(benchmark, file)
    except (KeyError, FileNotFoundError):
        print(f"H100, {benchmark}: not measured yet (python -m profiling.gpu_suite writes it to {file})")
        return
    table = pd.DataFrame({"level": rows["title"]})
    for column in columns:
        heading, style = FORMATS[column]
        if column == "median_ms" and file != "benchmarks.csv":
            heading = "median ms"  # a whole training step or generation run, eager or graphed as its name says
        table[heading] = [("—" if pd.isna(value) else style.format(value)) for value in rows[column]]
    print(f"H100, {benchmark}:")
    print(table.to_string(index=False))


# --- the exercises -------------------------------------------------------------------------------------

Case = tuple[str, object, torch.Tensor]
"""(what the inputs were, the candidate's result, the float64 truth)."""


class ExerciseFailure(Exception):
    """What a check finds wrong that is not an error size (a module left unswapped, a copied Parameter):
    raised by an exercise's cases, reported as its ``fail:`` line."""


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _random(shape, generator, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * scale).to(_device(), torch.float32)


def _relu_squared_cases(candidate) -> Iterator[Case]:
    generator = torch.Generator().manual_seed(101)
    for shape in ((37, 1001), (5,)):  # 37 037 elements: not a multiple of any block, so the tail is masked
        x = _random(shape, generator)
        yield f"x of shape {shape}", candidate(x), torch.relu(x.double()) ** 2


def _rms_norm_cases(candidate) -> Iterator[Case]:
    generator = torch.Generator().manual_seed(102)
    eps = 1e-6
    for shape in ((37, 1001), (3, 5, 64)):
        x, weight = _random(shape, generator, 2.0) + 0.5, _random(shape[-1:], generator)
        x64 = x.double()
        truth = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
        yield f"x of shape {shape}", candidate(x, weight, eps), truth


def _log_softmax_cases(candidate) -> Iterator[Case]:
    generator = torch.Generator().manual_seed(103)
    for shape, scale in (((37, 1001), 4.0), ((4, 300), 60.0)):  # ×60: logits far apart, exp underflows
        x = _random(shape, generator, scale)
        yield f"x of shape {shape}, values ×{scale:g}", candidate(x), torch.log_softmax(x.double(), dim=-1)


def _windowed_attention_cases(candidate) -> Iterator[Case]:
    generator = torch.Generator().manual_seed(104)
    window = 17
    for queries, keys in ((70, 70), (5, 70)):  # 5 queries after 70 keys: a decode step with a cache
        q = _random((1, 2, queries, 32), generator)
        k, v = _random((1, 2, keys, 32), generator), _random((1, 2, keys, 32), generator)
        truth = attention_math(q.double(), k.double(), v.double(), True, window, 32**-0.5)
        yield f"{queries} queries, {keys} keys, window {window}", candidate(q, k, v, window), truth


def _linear_bias_residual_cases(candidate) -> Iterator[Case]:
    generator = torch.Generator().manual_seed(105)
    for m, n, k in ((37, 40, 48), (5, 3, 70)):  # no side a multiple of the 16-wide tile
        x, weight, bias, residual = (_random(shape, generator) for shape in ((m, k), (n, k), (n,), (m, n)))
        truth = x.double() @ weight.double().T + bias.double() + residual.double()
        yield f"x ({m}, {k}), weight ({n}, {k})", candidate(x, weight, bias, residual), truth


def _post_norm_block_cases(candidate) -> Iterator[Case]:
    generator = torch.Generator().manual_seed(106)
    block = perturb_parameters_(levels.build("transformer_block", "native", n_embd=32, n_head=2)).to(_device())
    reference = levels.float64_reference(block)
    x = _random((2, 9, 32), generator)
    with torch.no_grad():
        yield "x of shape (2, 9, 32)", candidate(block, x), post_norm_block(reference, x.double())


def _cuda_graph_decode_cases(candidate) -> Iterator[Case]:
    generator = torch.Generator().manual_seed(107)
    model = perturb_parameters_(levels.build("gpt", "native", **TINY, block_size=32), scale=0.5)
    model = model.to(_device(), torch.float64).eval()
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5), generator=generator).to(_device())
    truth = model.generate(prompt, 12, cuda_graph=False)  # level 1, growing cache, every step from Python
    yield "2 prompts of 5 tokens, 12 new tokens each", candidate(model, prompt, 12), truth


def _adamw_step_cases(candidate) -> Iterator[Case]:
    generator = torch.Generator().manual_seed(108)
    hyperparameters = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    start = torch.randn(33, 17, generator=generator, dtype=torch.float64)
    gradients = [torch.randn(33, 17, generator=generator, dtype=torch.float64) for _ in range(3)]
    parameter = torch.nn.Parameter(start.clone())
    optimizer = levels.build_optimizer("native", [parameter], **hyperparameters)
    for gradient in gradients:
        parameter.grad = gradient
        optimizer.step()
    param = start.to(_device(), torch.float32)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    for step, gradient in enumerate(gradients, start=1):
        candidate(param, gradient.to(param), exp_avg, exp_avg_sq, step, **hyperparameters)
    yield "a (33, 17) parameter after 3 steps", param, parameter.detach()


def _swap_layer_norms_cases(candidate) -> Iterator[Case]:
    from transformers import GPT2Config, GPT2LMHeadModel

    generator = torch.Generator().manual_seed(109)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, attn_pdrop=0.0,
                        resid_pdrop=0.0, embd_pdrop=0.0)
    for level in ("native", "cuda"):  # two levels: an answer must build the one it is asked for
        torch.manual_seed(109)
        # Every LayerNorm weight moved off 1 and bias off 0: a fresh module in its place would show.
        model = perturb_parameters_(GPT2LMHeadModel(config)).to(_device()).eval()
        reference = copy.deepcopy(model).double()
        originals = {name: module for name, module in model.named_modules() if isinstance(module, nn.LayerNorm)}
        candidate(model, level)
        for name, original in originals.items():
            swapped = model.get_submodule(name)
            if not isinstance(swapped, levels.level_class("layer_norm", level)):
                raise ExerciseFailure(f"{name} is a {type(swapped).__name__}, not level {level}'s LayerNorm")
            if swapped.weight is not original.weight or swapped.bias is not original.bias:
                raise ExerciseFailure(f"{name} holds copies of the LayerNorm's weight and bias, not its Parameters: "
                                      "an optimizer made before the swap would train tensors the model no longer uses")
        ids = torch.randint(0, config.vocab_size, (2, 19), generator=generator).to(_device())
        with torch.no_grad():
            yield f"level {level}, the logits of 2 × 19 tokens", model(ids).logits, reference(ids).logits


def _check_replicas_agree(replicas, tensors: Callable[[nn.Module], Iterator[torch.Tensor]], what: str) -> None:
    """ExerciseFailure naming the first of ``what`` in which a replica differs from replica 0."""
    names = [name for name, _ in replicas[0].named_parameters()]
    for index, replica in enumerate(replicas[1:], start=1):
        for name, mine, first in zip(names, tensors(replica), tensors(replicas[0])):
            if not levels.relative_max_error(mine, first) <= levels.TOLERANCE[torch.float64]:
                raise ExerciseFailure(f"replica {index}'s {what} of {name} differs from replica 0's: "
                                      "the replicas no longer hold one model")


def _average_gradients_cases(candidate) -> Iterator[Case]:
    config = CONFIGS["tiny"]
    torch.manual_seed(110)
    whole = levels.build("gpt", "native", **config).double()
    replicas = [copy.deepcopy(whole) for _ in range(2)]
    inputs, targets = global_batch(0, 4, 16, config["vocab_size"])
    backward_on_slice(whole, inputs, targets, 0, 1)
    for rank, replica in enumerate(replicas):
        backward_on_slice(replica, inputs, targets, rank, len(replicas))
    candidate(replicas)
    _check_replicas_agree(replicas, lambda model: (p.grad for p in model.parameters()), "gradient")
    # The gradients first: AdamW divides a gradient by its own size, so a sum in place of the mean
    # would move the weights almost exactly as the mean does; plain SGD would step twice as far.
    for (name, parameter), truth in zip(replicas[0].named_parameters(), whole.parameters()):
        yield f"the gradient of {name}", parameter.grad, truth.grad
    for model in (whole, *replicas):
        build_optimizer(model, "native").step()
    _check_replicas_agree(replicas, lambda model: model.parameters(), "weight")
    for (name, parameter), truth in zip(replicas[0].named_parameters(), whole.parameters()):
        yield f"{name} after one AdamW step", parameter.detach(), truth.detach()


class Exercise(NamedTuple):
    """The lesson an exercise closes, the cases its check runs, and the dtype the candidate computes
    in, whose tolerance (``levels.TOLERANCE``) its results are held to."""

    lesson: str
    cases: Callable[[Callable], Iterator[Case]]
    dtype: torch.dtype = torch.float32


EXERCISES: dict[str, Exercise] = {
    "relu_squared": Exercise("01", _relu_squared_cases),
    "rms_norm": Exercise("02", _rms_norm_cases),
    "log_softmax": Exercise("03", _log_softmax_cases),
    "windowed_attention": Exercise("04", _windowed_attention_cases),
    "linear_bias_residual": Exercise("05", _linear_bias_residual_cases),
    "post_norm_block": Exercise("06", _post_norm_block_cases),
    "cuda_graph_decode": Exercise("07", _cuda_graph_decode_cases),
    "adamw_step": Exercise("08", _adamw_step_cases),
    "swap_layer_norms": Exercise("10", _swap_layer_norms_cases),
    "average_gradients": Exercise("11", _average_gradients_cases, torch.float64),  # as train_steps, for its reason
}



def exercise_verdict(name: str, candidate: Callable) -> str:
    """The check's one line, without printing it (``check_exercise`` prints it)."""
    if name not in EXERCISES:
        raise KeyError(f"no exercise {name!r}: the exercises are {list(EXERCISES)}")
    exercise = EXERCISES[name]
    tolerance = levels.TOLERANCE[exercise.dtype]
    try:
        for inputs, result, truth in exercise.cases(candidate):
            if not isinstance(result, torch.Tensor):
                return f"exercise {name}: fail: returned {type(result).__name__} for {inputs}, expected a tensor"
            if result.shape != truth.shape:
                return (f"exercise {name}: fail: result of shape {tuple(result.shape)} for {inputs}, "
                        f"expected {tuple(truth.shape)}")
            if not truth.is_floating_point():
                if not torch.equal(result.cpu(), truth.cpu()):
                    return f"exercise {name}: fail: different tokens from level 1's for {inputs}"
                continue
            error = levels.relative_max_error(result, truth)
            if not error <= tolerance:  # also true for NaN
                return f"exercise {name}: fail: max relative error {error:.0e} > {tolerance:.0e} for {inputs}"
    except NotImplementedError:
        return f"exercise {name}: not implemented yet"
    except ExerciseFailure as failure:
        return f"exercise {name}: fail: {failure}"
    except Exception as error:  # the learner's bug, reported as the verdict rather than a traceback
        return f"exercise {name}: fail: {type(error).__name__}: {error}"
    if name == "cuda_graph_decode" and not torch.cuda.is_available():
        return f"exercise {name}: pass (tokens match; no CUDA device here, so the graph capture did not run)"
    return f"exercise {name}: pass"


def check_exercise(name: str, candidate: Callable) -> bool:
    """Run exercise ``name``'s check on ``candidate``, print its verdict, return whether it passed."""
    verdict = exercise_verdict(name, candidate)
    print(verdict)
    return verdict.startswith(f"exercise {name}: pass")
