"""A ``transformers`` GPT-2 patched by ``levels.huggingface``, measured against ``transformers`` as people
run it: tokens per second of a training step and of greedy generation.

    training_rows(shape=(8, 1024), dtype, device)                 forward + loss, backward, AdamW step
    generation_rows(batch, prompt_tokens, new_tokens, dtype, device)   model.generate, greedy, KV cache

One row per way of running the same model, all holding the same weights:

    eager           transformers, its eager attention (the score matrix in memory)
    sdpa            transformers, ``F.scaled_dot_product_attention`` (its default; flash on an H100):
                    the baseline, ``vs_sdpa`` is every row's tokens/s over this one's
    sdpa+compile    the same, ``model.forward = torch.compile(model.forward)`` (transformers' own recipe)
    native … cuda   the ``sdpa`` model patched at each level with ``levels.huggingface.apply``

The columns follow ``profiling.language_model`` (whose timing they reuse): ``level`` is the row's key,
``title`` its display name, then the median time, ``tokens_per_s``, ``peak_memory_mb`` beyond the
model, the first call's time (compilation, autotuning) kept apart, and ``status``. Generation adds
``same_tokens_as_sdpa`` (expected True in float32; bfloat16 may round apart).

The config is GPT-2 small (``GPT2Config()``'s defaults) with dropout off in every row: the ladder's
attention kernels have no dropout, and rows that differ in it would not do the same work. Random
weights: nothing is downloaded. Measured figures: profiling/results/h100/huggingface.csv.
"""

from __future__ import annotations

import copy
from typing import Iterable, Sequence

import pandas as pd
import torch

import levels.huggingface
from levels.spec import LEVEL_TITLES, LEVELS

from .language_model import timed_rows

NO_DROPOUT = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}

TITLES = {
    "eager": "transformers, eager attention",
    "sdpa": "transformers, sdpa attention",
    "sdpa+compile": "transformers, sdpa + torch.compile",
    **{level: f"patched: {title}" for level, title in LEVEL_TITLES.items()},
}
"""Row keys and titles, in the order the rows run."""

BASELINE = "sdpa"


def models(config: dict | None, rows: Iterable[str] | None, dtype: torch.dtype,
           device: torch.device) -> dict[str, torch.nn.Module]:
    """A ``GPT2LMHeadModel`` of ``config`` (default: ``GPT2Config()`` without dropout) for each row, all with
    one seeded model's weights, on ``device`` in ``dtype``, in eval mode; generation never stops at an
    end-of-text token (random weights would stop the rows at different lengths)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(**(config if config is not None else NO_DROPOUT))).to(device=device, dtype=dtype)
    base.generation_config.eos_token_id = None
    built = {}
    for row in rows or TITLES:
        if row not in TITLES:
            raise ValueError(f"unknown row {row!r}: choose from {', '.join(TITLES)}")
        model = copy.deepcopy(base).eval()
        model.set_attn_implementation("eager" if row == "eager" else "sdpa")
        if row == "sdpa+compile":
            model.forward = torch.compile(model.forward)
        elif row in LEVELS:
            levels.huggingface.apply(model, row)
        built[row] = model
    return built


def _with_ratio(table: pd.DataFrame, what: str, shape, dtype, device, config) -> pd.DataFrame:
    if "tokens_per_s" in table and BASELINE in set(table["level"]):
        baseline = table.loc[table["level"] == BASELINE, "tokens_per_s"].iloc[0]
        # language_model's speedup is over the first row; here every ratio is over the sdpa row.
        table = table.drop(columns="speedup").assign(vs_sdpa=table["tokens_per_s"] / baseline)
    table.attrs.update(what=what, shape=tuple(shape), dtype=str(dtype).removeprefix("torch."), device=str(device),
                       config=config or NO_DROPOUT)
    return table


def training_rows(shape: Sequence[int] = (8, 1024), dtype: torch.dtype = torch.bfloat16,
                  device: torch.device | str = "cuda", rows: Iterable[str] | None = None, config: dict | None = None,
                  repeats: int = 5) -> pd.DataFrame:
    """Tokens per second of one training step on random tokens of ``shape`` (batch, tokens), as
    ``training_work`` sets it up."""
    device = torch.device(device)
    built, step = training_work(shape, dtype, device, rows, config)
    table = timed_rows(built, step, shape[0] * shape[1], device, repeats, "transformers training step", TITLES)
    return _with_ratio(table, "transformers training step", shape, dtype, device, config)


def training_work(shape: Sequence[int], dtype: torch.dtype, device: torch.device, rows: Iterable[str] | None = None,
                  config: dict | None = None):
    """(models, step): a ``models`` row each, in training mode, and ``step(model)``, one training step on
    the same random tokens of ``shape`` (batch, tokens): ``model(input_ids, labels=input_ids).loss``
    (transformers shifts the labels), backward, and ``torch.optim.AdamW`` (fused on the GPU, the same
    optimizer in every row)."""
    built = models(config, rows, dtype, device)
    vocab_size = next(iter(built.values())).config.vocab_size
    inputs = torch.randint(0, vocab_size, tuple(shape), generator=torch.Generator().manual_seed(1)).to(device)
    optimizers = {id(model): torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
                  for model in built.values()}
    for model in built.values():
        model.train()  # dropout is off: the mode changes nothing computed, but it is how a training step runs

    def step(model):
        optimizer = optimizers[id(model)]
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=inputs, labels=inputs).loss.backward()
        optimizer.step()

    return built, step


def generation_rows(batch: int, prompt_tokens: int = 16, new_tokens: int = 112, dtype: torch.dtype = torch.bfloat16,
                    device: torch.device | str = "cuda", rows: Iterable[str] | None = None,
                    config: dict | None = None, repeats: int = 3) -> pd.DataFrame:
    """New tokens per second of ``model.generate`` (greedy, transformers' dynamic KV cache) continuing
    ``batch`` random prompts of ``prompt_tokens`` by ``new_tokens``; ``same_tokens_as_sdpa`` says whether
    a row chose exactly the sdpa row's tokens."""
    device = torch.device(device)
    built = models(config, rows, dtype, device)
    vocab_size = next(iter(built.values())).config.vocab_size
    prompt = torch.randint(0, vocab_size, (batch, prompt_tokens), generator=torch.Generator().manual_seed(2)).to(device)
    outputs = {}

    def generate(model):
        # The mask said outright: else generate would guess one from a pad token, which random prompts may hold.
        outputs[id(model)] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                            do_sample=False)

    table = timed_rows(built, generate, batch * new_tokens, device, repeats, f"transformers generation, batch {batch}",
                        TITLES)
    baseline = outputs.get(id(built.get(BASELINE)))
    table["same_tokens_as_sdpa"] = [bool(baseline is not None and id(model) in outputs
                                         and torch.equal(outputs[id(model)], baseline)) for model in built.values()]
    return _with_ratio(table, f"transformers generation batch {batch}", (batch, prompt_tokens + new_tokens), dtype,
                       device, config)
