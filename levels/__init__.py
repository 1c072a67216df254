"""The ladder: every component at five levels behind one interface.

    >>> import levels
    >>> layer_norm = levels.build("layer_norm", "triton", normalized_shape=4096)
    >>> swish = levels.build("swish", 5, beta=1.0)
    >>> optimizer = levels.build_optimizer("cuda", layer_norm.parameters(), lr=1e-3)

Importing this package imports neither Triton nor the CUDA extension: levels 4 and 5 load them on
first use, and say what to install if they cannot.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from .optimizer import build_optimizer
from .spec import (
    LEVEL_DTYPES,
    LEVEL_TITLES,
    LEVELS,
    TOLERANCE,
    ComponentSpec,
    LevelUnavailableError,
    relative_max_error,
    resolve_level,
)

COMPONENTS = ("swish", "layer_norm", "rms_norm", "softmax", "attention", "feed_forward", "self_attention",
              "transformer_block", "linear_cross_entropy", "gpt")
"""Component names, in the order the lessons take them."""


def component_module(component: str):
    """The module ``levels.<component>``, which holds the spec and its five level classes."""
    if component not in COMPONENTS:
        raise ValueError(f"unknown component {component!r}: choose one of {COMPONENTS}")
    return importlib.import_module(f"{__name__}.{component}")


def level_class(component: str, level: str | int) -> type[ComponentSpec]:
    return component_module(component).IMPLEMENTATIONS[resolve_level(level)]


def build(component: str, level: str | int, **config) -> nn.Module:
    """Build ``component`` at ``level`` ("native", "torchscript", "compile", "triton", "cuda" or 1-5)."""
    return level_class(component, level)(**config)


def float64_reference(module: ComponentSpec) -> ComponentSpec:
    """Level 1 of ``module``'s component in float64, with ``module``'s weights: the truth we test against."""
    reference = build(module.component, "native", **module.config)
    reference.load_state_dict(module.state_dict())
    parameters = list(module.parameters())
    device = parameters[0].device if parameters else None
    return reference.to(device=device, dtype=torch.float64)


__all__ = [
    "COMPONENTS",
    "LEVELS",
    "LEVEL_DTYPES",
    "LEVEL_TITLES",
    "TOLERANCE",
    "ComponentSpec",
    "LevelUnavailableError",
    "build",
    "build_optimizer",
    "component_module",
    "float64_reference",
    "level_class",
    "relative_max_error",
    "resolve_level",
]
