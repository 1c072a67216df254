"""Whole-model measurements of the GPT at every level: a training step and generation, in tokens/s.

``compare_optimization_levels`` times one call of a component; a language model is judged by what it
does per second. Both functions here build the GPT at each level with the *same* weights, run the same
work, and return one row per level: tokens per second, the speedup over level 1, and the one-time cost
of the first call (compilation, autotuning, the extension's build) kept apart.

    training_throughput(config, (batch, tokens), dtype, device)        forward, loss, backward, AdamW step
    generation_throughput(config, batch, prompt_tokens, new_tokens, dtype, device)   KV-cache decoding
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

import levels as ladder
from levels.spec import LEVEL_TITLES, resolve_level

from .timing import time_once


def models_at_levels(config: dict, chosen_levels: Iterable[str | int] | None, dtype: torch.dtype,
                     device: torch.device) -> dict[str, torch.nn.Module]:
    """The GPT at each level, all holding level 1's freshly initialised weights, on ``device`` in ``dtype``."""
    torch.manual_seed(0)
    native = ladder.build("gpt", "native", **config)
    models = {}
    for level in (resolve_level(level) for level in (chosen_levels or ladder.LEVELS)):
        model = native if level == "native" else ladder.build("gpt", level, **config)
        model.load_state_dict(native.state_dict())
        models[LEVEL_TITLES[level]] = model.to(device=device, dtype=dtype)
    return models


def _timed_rows(models, work, tokens_per_call: int, device, repeats: int, description: str) -> pd.DataFrame:
    rows = []
    for name, model in tqdm(models.items(), desc=description, unit="level", leave=False):
        row = {"level": name}
        try:
            row["first_call_s"] = time_once(lambda: work(model), device)
            # A second untimed call: torch.compile compiles again once it sees a second shape (the
            # decode step's one query, the growing cache) and then generalises to dynamic shapes.
            work(model)
            seconds = statistics.median(time_once(lambda: work(model), device) for _ in range(repeats))
        except Exception as error:  # a level that cannot run here says why in its row, the rest go on
            rows.append({**row, "status": f"{type(error).__name__}: {str(error).splitlines()[0]}"})
            continue
        rows.append({**row, "ms": seconds * 1e3, "tokens_per_s": tokens_per_call / seconds, "status": "ok"})
    table = pd.DataFrame(rows)
    if "tokens_per_s" in table:
        table["speedup_vs_level_1"] = table["tokens_per_s"] / table["tokens_per_s"].iloc[0]
    return table


def training_throughput(config: dict, shape: Sequence[int], dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cuda", levels: Iterable[str | int] | None = None,
                        repeats: int = 5) -> pd.DataFrame:
    """Tokens per second of one training step (forward, cross-entropy, backward, AdamW) on random tokens
    of ``shape`` (batch, tokens). The loss is taken in float32 whatever ``dtype`` the model runs in."""
    device = torch.device(device)
    batch, tokens = shape
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randint(0, config["vocab_size"], (2, batch, tokens), generator=generator).to(device)
    models = models_at_levels(config, levels, dtype, device)
    optimizers = {id(model): torch.optim.AdamW(model.parameters(), lr=1e-4) for model in models.values()}

    def step(model):
        optimizer = optimizers[id(model)]
        optimizer.zero_grad(set_to_none=True)
        logits = model(inputs)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        loss.backward()
        optimizer.step()

    table = _timed_rows(models, step, batch * tokens, device, repeats, "training step")
    table.attrs.update(what="training step", shape=tuple(shape), dtype=str(dtype).removeprefix("torch."),
                       device=str(device), config=config)
    return table


def generation_throughput(config: dict, batch: int, prompt_tokens: int, new_tokens: int,
                          dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                          levels: Iterable[str | int] | None = None, repeats: int = 3) -> pd.DataFrame:
    """New tokens per second of greedy decoding with a KV cache: ``batch`` prompts of ``prompt_tokens``
    random tokens, each continued by ``new_tokens``. The column ``same_tokens_as_level_1`` says whether
    the level chose exactly level 1's tokens (expected in float32; half precision may round apart)."""
    device = torch.device(device)
    if prompt_tokens + new_tokens > config["block_size"]:
        raise ValueError(f"{prompt_tokens} + {new_tokens} tokens exceed block_size={config['block_size']}")
    prompt = torch.randint(0, config["vocab_size"], (batch, prompt_tokens), generator=torch.Generator().manual_seed(2))
    prompt = prompt.to(device)
    models = models_at_levels(config, levels, dtype, device)
    outputs = {}

    def generate(model):
        outputs[id(model)] = model.generate(prompt, new_tokens)

    table = _timed_rows(models, generate, batch * new_tokens, device, repeats, f"generation, batch {batch}")
    native = outputs.get(id(next(iter(models.values()))))
    table["same_tokens_as_level_1"] = [
        bool(native is not None and id(model) in outputs and torch.equal(outputs[id(model)], native))
        for model in models.values()]
    table.attrs.update(what=f"generation batch {batch}", shape=(batch, prompt_tokens + new_tokens),
                       dtype=str(dtype).removeprefix("torch."), device=str(device), config=config)
    return table


def format_throughput(table: pd.DataFrame) -> str:
    """The table as text: level, ms, tokens/s, speedup (and token agreement for generation)."""
    columns = [c for c in ("level", "ms", "tokens_per_s", "speedup_vs_level_1", "same_tokens_as_level_1",
                           "first_call_s", "status") if c in table]
    formats = {"ms": "{:.2f}".format, "tokens_per_s": "{:,.0f}".format, "speedup_vs_level_1": "{:.2f}×".format,
               "first_call_s": "{:.1f}".format}
    shown = table[columns].copy()
    for column, formatter in formats.items():
        if column in shown:
            shown[column] = [formatter(v) if isinstance(v, float) and not math.isnan(v) else "" for v in shown[column]]
    return shown.to_string(index=False)
