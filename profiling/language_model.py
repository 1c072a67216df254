"""Whole-model measurements of the GPT at every level: a training step and generation, in tokens/s.

``compare_optimization_levels`` times one call of a component; a language model is judged by what it
does per second. Both functions here build the GPT at each level with the *same* weights, run the same
work, and return one row per level: tokens per second, the speedup over level 1, and the one-time cost
of the first call (compilation, autotuning, the extension's build) kept apart. Their columns follow
``compare_optimization_levels``: ``level`` is the key (``"native"`` … ``"cuda"``), ``title`` the
display name, ``speedup`` is over level 1 (the first level run).

    training_throughput(config, (batch, tokens), dtype, device)        forward and loss, backward, AdamW step
    generation_throughput(config, batch, prompt_tokens, new_tokens, dtype, device, cuda_graph)   KV-cache decoding

And what a lesson needs to train the model on real text, offline: a small text that ships with the
package (``load_text``), a character vocabulary (``encode`` / ``decode``: newline and the 95 printable
ASCII characters, the 96 token ids of ``levels.gpt.TINY``), and ``train``, a loop of the same
``training_step`` that ``training_throughput`` times.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

import levels as ladder
from levels.spec import LEVEL_TITLES, resolve_level

from .timing import peak_memory_mb, quiet_compile_workers, time_once

TEXT_PATH = Path(__file__).parent / "data" / "the_ladder_dialogue.txt"
"""A 10 kB dialogue written for this course (no download): what the lessons train the tiny GPT on."""

CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))
"""The character vocabulary: token id i is ``CHARACTERS[i]``; 96 ids, ``levels.gpt.TINY``'s vocab_size."""

_TOKEN_OF_CHARACTER = {character: token for token, character in enumerate(CHARACTERS)}


def load_text() -> str:
    """The course's training text."""
    return TEXT_PATH.read_text(encoding="ascii")


def encode(text: str) -> torch.Tensor:
    """Token ids (int64) of ``text``, one per character; characters outside ``CHARACTERS`` are an error."""
    unknown = sorted(set(text) - _TOKEN_OF_CHARACTER.keys())
    if unknown:
        raise ValueError(f"characters outside the vocabulary (newline and printable ASCII): {unknown}")
    return torch.tensor([_TOKEN_OF_CHARACTER[character] for character in text], dtype=torch.int64)


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """The text of a 1-d sequence of token ids."""
    return "".join(CHARACTERS[int(token)] for token in tokens)


def random_windows(data: torch.Tensor, batch: int, tokens: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows of ``tokens`` consecutive ids from ``data`` at random offsets, and the same
    windows shifted by one: the inputs and the next-token targets of a language-model step."""
    if data.numel() <= tokens:
        raise ValueError(f"{data.numel()} tokens of data cannot give windows of {tokens} tokens and their targets")
    starts = torch.randint(0, data.numel() - tokens, (batch,), generator=generator)
    offsets = starts.unsqueeze(1) + torch.arange(tokens + 1)
    windows = data[offsets]
    return windows[:, :-1], windows[:, 1:]


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                  targets: torch.Tensor) -> torch.Tensor:
    """One step: forward and next-token loss (the model's own ``linear_cross_entropy``, float32 whatever
    the model's dtype), backward, optimizer step. Returns the loss, detached and left on the device
    (reading it would wait for the GPU)."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(inputs, targets)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(model: torch.nn.Module, data: torch.Tensor, steps: int, batch: int, tokens: int,
          learning_rate: float = 3e-3, seed: int = 0, progress: bool = True) -> list[float]:
    """Train ``model`` on random windows of ``data`` (token ids) with its level's AdamW
    (``levels.build_optimizer``) for ``steps`` steps; returns the loss of every step. The learning
    rate decays along a cosine to a tenth, and the same ``seed`` draws the same windows, so two levels
    trained alike see the same data in the same order."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    optimizer = ladder.build_optimizer(model.level, model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=learning_rate / 10)
    model.train()
    losses = []
    # Refreshed once a second: a step takes milliseconds, and a notebook keeps every refresh it prints.
    bar = tqdm(range(steps), desc=f"training {type(model).__name__}", unit="step", mininterval=1.0,
               disable=not progress)
    for _ in bar:
        inputs, targets = (t.to(device) for t in random_windows(data, batch, tokens, generator))
        losses.append(training_step(model, optimizer, inputs, targets).item())
        schedule.step()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


def models_at_levels(config: dict, chosen_levels: Iterable[str | int] | None, dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.nn.Module]:
    """The GPT at each level (keyed by level name), all holding level 1's freshly initialised weights,
    on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    native = ladder.build("gpt", "native", **config)
    models = {}
    for level in (resolve_level(level) for level in (chosen_levels or ladder.LEVELS)):
        model = native if level == "native" else ladder.build("gpt", level, **config)
        model.load_state_dict(native.state_dict())
        models[level] = model.to(device=device, dtype=dtype)
    return models


def training_work(config: dict, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                  levels: Iterable[str | int] | None = None):
    """(models, step): the GPT at each level (``models_at_levels``) and ``step(model)``, one
    ``training_step`` on the same random tokens of ``shape`` (batch, tokens) with the model's level's
    AdamW."""
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randint(0, config["vocab_size"], (2, *shape), generator=generator).to(device)
    models = models_at_levels(config, levels, dtype, device)
    optimizers = {id(model): ladder.build_optimizer(model.level, model.parameters(), lr=1e-4)
                  for model in models.values()}

    def step(model):
        training_step(model, optimizers[id(model)], inputs, targets)

    return models, step


def timed_rows(models, work, tokens_per_call: int, device, repeats: int, description: str,
                titles: Mapping[str, str] = LEVEL_TITLES) -> pd.DataFrame:
    """One row per model (keyed by its ``level`` column, titled by ``titles``): the first call, then the
    median of ``repeats`` timed calls of ``work(model)``, and its peak memory."""
    rows = []
    for name, model in tqdm(models.items(), desc=description, unit="level", leave=False):
        row = {"level": name, "title": titles[name]}
        try:
            row["first_call_s"] = time_once(lambda: work(model), device)
            # A second untimed call: torch.compile compiles again once it sees a second shape (the
            # decode step's one query, the growing cache) and then generalises to dynamic shapes.
            work(model)
            quiet_compile_workers()
            seconds = statistics.median(time_once(lambda: work(model), device) for _ in range(repeats))
            row["peak_memory_mb"] = peak_memory_mb(lambda: work(model), device)
        except Exception as error:  # a level that cannot run here says why in its row, the rest go on
            rows.append({**row, "status": f"{type(error).__name__}: {str(error).splitlines()[0]}"})
            continue
        rows.append({**row, "median_ms": seconds * 1e3, "tokens_per_s": tokens_per_call / seconds, "status": "ok"})
    table = pd.DataFrame(rows)
    if "tokens_per_s" in table:
        table["speedup"] = table["tokens_per_s"] / table["tokens_per_s"].iloc[0]
    return table


def training_throughput(config: dict, shape: Sequence[int], dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cuda", levels: Iterable[str | int] | None = None,
                        repeats: int = 5) -> pd.DataFrame:
    """Tokens per second of one training step (forward, cross-entropy, backward, AdamW) on random tokens
    of ``shape`` (batch, tokens), each level with its own LM head + loss and its own AdamW. The loss is
    taken in float32 whatever ``dtype`` the model runs in."""
    device = torch.device(device)
    models, step = training_work(config, shape, dtype, device, levels)
    table = timed_rows(models, step, shape[0] * shape[1], device, repeats, "training step")
    table.attrs.update(what="training step", shape=tuple(shape), dtype=str(dtype).removeprefix("torch."),
                       device=str(device), config=config)
    return table


def generation_throughput(config: dict, batch: int, prompt_tokens: int, new_tokens: int,
                          dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                          levels: Iterable[str | int] | None = None, repeats: int = 3,
                          cuda_graph: bool = False) -> pd.DataFrame:
    """New tokens per second of greedy decoding with a KV cache: ``batch`` prompts of ``prompt_tokens``
    random tokens, each continued by ``new_tokens``, every kernel launched from Python (``cuda_graph``
    False) or each decode step replayed as one CUDA graph (``GPTSpec.generate``'s ``cuda_graph``; the
    capture is part of every timed call, as it is of every call a user makes). The column
    ``same_tokens_as_level_1`` says whether the level chose exactly level 1's tokens (expected in
    float32; half precision may round apart)."""
    device = torch.device(device)
    if prompt_tokens + new_tokens > config["block_size"]:
        raise ValueError(f"{prompt_tokens} + {new_tokens} tokens exceed block_size={config['block_size']}")
    prompt = torch.randint(0, config["vocab_size"], (batch, prompt_tokens), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(device)
    models = models_at_levels(config, levels, dtype, device)
    outputs = {}

    def generate(model):
        outputs[id(model)] = model.generate(prompt, new_tokens, cuda_graph=cuda_graph)

    table = timed_rows(models, generate, batch * new_tokens, device, repeats, f"generation, batch {batch}")
    native = outputs.get(id(next(iter(models.values()))))
    table["same_tokens_as_level_1"] = [
        bool(native is not None and id(model) in outputs and torch.equal(outputs[id(model)], native))
        for model in models.values()]
    table.attrs.update(what=f"generation batch {batch}" + (", CUDA graph" if cuda_graph else ""),
                       shape=(batch, prompt_tokens + new_tokens),
                       dtype=str(dtype).removeprefix("torch."), device=str(device), config=config)
    return table


def format_throughput(table: pd.DataFrame) -> str:
    """The table as text: level, ms, tokens/s, speedup (and token agreement for generation)."""
    columns = [c for c in ("title", "median_ms", "tokens_per_s", "speedup", "vs_sdpa", "same_tokens_as_level_1",
                           "same_tokens_as_sdpa", "peak_memory_mb", "first_call_s", "status") if c in table]
    formats = {"median_ms": "{:.2f}".format, "tokens_per_s": "{:,.0f}".format, "speedup": "{:.2f}×".format,
               "vs_sdpa": "{:.2f}×".format,
               "peak_memory_mb": "{:,.0f}".format, "first_call_s": "{:.1f}".format}
    shown = table[columns].copy()
    for column, formatter in formats.items():
        if column in shown:
            shown[column] = [formatter(v) if isinstance(v, float) and not math.isnan(v) else "" for v in shown[column]]
    return shown.rename(columns={"title": "level"}).to_string(index=False)
