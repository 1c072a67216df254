"""What every component shares: the base class, the level names, input checks, dtype tables and
the one tolerance table.

A *component* is one mathematical function with one parameter layout; a *level* is one way to
compute it. ``ComponentSpec`` is the component half: it owns the parameters, the argument checks,
``example_inputs`` and the cost model. Each level subclasses a component's spec and implements only
``compute``. So every level of a component has the same constructor, the same ``state_dict`` and
the same ``forward`` signature: load one level's weights into another and compare.
"""

from __future__ import annotations

import math
from typing import ClassVar, Sequence

import torch
from cuda_kernels.limits import LevelUnavailableError  # noqa: F401  (public here; defined on the kernel side)
from torch import nn

LEVELS = ("native", "torchscript", "compile", "triton", "cuda")
"""The five rungs of the ladder, in order. ``build`` also accepts 1-5."""

LEVEL_TITLES = {
    "native": "1 native PyTorch",
    "torchscript": "2 TorchScript",
    "compile": "3 torch.compile",
    "triton": "4 Triton",
    "cuda": "5 CUDA C++",
}

FLOATING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Which dtypes each level computes, per device type. Levels 1-3 run whatever PyTorch runs. Our own
# kernels (levels 4 and 5) accumulate in float32 (float64 for float64 inputs). On the CPU, Triton's
# interpreter runs on NumPy, which has no bfloat16 arithmetic, and our C++ CPU kernels are written
# for the two IEEE types, so half precision is a GPU-only feature of levels 4 and 5.
LEVEL_DTYPES: dict[str, dict[str, tuple[torch.dtype, ...]]] = {
    "native": {"cpu": FLOATING_DTYPES, "cuda": FLOATING_DTYPES},
    "torchscript": {"cpu": FLOATING_DTYPES, "cuda": FLOATING_DTYPES},
    "compile": {"cpu": FLOATING_DTYPES, "cuda": FLOATING_DTYPES},
    "triton": {"cpu": (torch.float32, torch.float64), "cuda": FLOATING_DTYPES},
    "cuda": {"cpu": (torch.float32, torch.float64), "cuda": FLOATING_DTYPES},
}

# The one tolerance table. Every check (tests, notebooks, profiling's error column) compares a level
# against a float64 run of level 1 on the same weights and inputs, and measures
#     max |actual - reference| / max |reference|
# so one number per dtype works for outputs and gradients of any scale. The budget is a few units in
# the last place of the dtype's mantissa (float16: 2**-11, bfloat16: 2**-8), leaving room for
# reductions rounding in a different order.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 4e-2,
}




def resolve_level(level: str | int) -> str:
    """Map ``"triton"``, ``4`` or ``"4"`` to the canonical level name."""
    if isinstance(level, int) or (isinstance(level, str) and level.isdigit()):
        index = int(level)
        if not 1 <= index <= len(LEVELS):
            raise ValueError(f"level {level!r} is out of range: levels are 1-{len(LEVELS)} or {LEVELS}")
        return LEVELS[index - 1]
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}: choose one of {LEVELS} or 1-{len(LEVELS)}")
    return level


def relative_max_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``max |actual - reference| / max |reference|``, computed in float64 on the reference's device."""
    reference = reference.detach().to(torch.float64)
    actual = actual.detach().to(device=reference.device, dtype=torch.float64)
    if actual.shape != reference.shape:
        raise ValueError(f"shape {tuple(actual.shape)} differs from the reference's {tuple(reference.shape)}")
    if reference.numel() == 0:
        return 0.0
    scale = reference.abs().max().clamp_min(torch.finfo(torch.float64).tiny)
    return ((actual - reference).abs().max() / scale).item()


def as_reference_input(tensor: torch.Tensor) -> torch.Tensor:
    """The float64 reference's copy of an input: floating tensors in float64, token ids as they are."""
    return tensor.detach().to(torch.float64) if tensor.is_floating_point() else tensor


def check_floating_input(name: str, tensor: torch.Tensor, level: str) -> None:
    """Raise ``TypeError`` unless ``tensor`` has a dtype that ``level`` computes on its device."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    device_type = tensor.device.type
    supported = LEVEL_DTYPES[level].get(device_type)
    if supported is None:
        raise LevelUnavailableError(
            f"level {level!r} does not run on {device_type} tensors (it runs on: {', '.join(LEVEL_DTYPES[level])})"
        )
    if tensor.dtype not in supported:
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        raise TypeError(
            f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}, but level {level!r} on {device_type} "
            f"supports: {names}"
        )


def check_matches_parameters(name: str, tensor: torch.Tensor, parameters: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Inputs and parameters must share one device and one dtype; say which one differs."""
    for parameter_name, parameter in parameters:
        if parameter.device != tensor.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {parameter_name} is on {parameter.device}: "
                f"move the module with .to({str(tensor.device)!r}) or the input to {parameter.device}"
            )
        if parameter.dtype != tensor.dtype:
            raise TypeError(
                f"{name} has dtype {tensor.dtype} but {parameter_name} has dtype {parameter.dtype}: "
                f"convert the module with .to({tensor.dtype})"
            )


class ComponentSpec(nn.Module):
    """Base of every component: parameters, checks, example inputs and cost model.

    Subclasses for a component set ``component`` and define ``__init__``, ``example_inputs``,
    ``bytes_moved`` and ``flops``. Subclasses for a level set ``level`` and define ``compute``.
    """

    component: ClassVar[str] = ""
    level: ClassVar[str] = ""
    # The input shape a comparison uses when none is given: on a GPU large enough to fill an H100 and
    # leave its 50 MB L2 behind; on the CPU small enough for Triton's interpreter (level 4) to take seconds.
    default_shapes: ClassVar[dict[str, tuple[int, ...]]] = {"cuda": (8192, 8192), "cpu": (256, 1024)}

    def __init__(self, **config):
        super().__init__()
        # The constructor arguments, kept so that any level (the float64 reference too) can be
        # rebuilt with the same configuration.
        self.config = dict(config)
        # The (device, dtype) of inputs last found to match every parameter. Walking the parameters
        # costs microseconds per call (tens for a transformer block), which a decode step pays in every
        # module, so the walk runs only when that pair changes or the parameters may have (below).
        self._parameters_match = None

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half() and friends all come through here, and may move or convert parameters.
        self.__dict__["_parameters_match"] = None
        return super()._apply(fn, *args, **kwargs)

    def register_parameter(self, name, param):
        # Assigning a new Parameter (module.weight = ...) comes through here too.
        self.__dict__["_parameters_match"] = None
        super().register_parameter(name, param)

    # --- the computation ---------------------------------------------------------------------------
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        self.check_inputs(*inputs)
        return self.compute(*inputs)

    def compute(self, *inputs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} is a spec; build a level with levels.build()")

    def check_inputs(self, *inputs: torch.Tensor) -> None:
        """Dtype and device checks shared by every component; components add shape checks."""
        passed = self._parameters_match
        for index, tensor in enumerate(inputs):
            # A (device, dtype) pair that passed both checks below passes them again: they read
            # nothing else. So a decode loop, which calls with the same pair every step, pays one
            # compare per input here, not the checks.
            if isinstance(tensor, torch.Tensor) and (tensor.device, tensor.dtype) == passed:
                continue
            name = "input" if len(inputs) == 1 else f"input {index}"
            check_floating_input(name, tensor, self.level or "native")
            check_matches_parameters(name, tensor, list(self.named_parameters()))
            self.__dict__["_parameters_match"] = (tensor.device, tensor.dtype)

    # --- what the lessons and the profiler ask of a component ---------------------------------------
    @classmethod
    def config_for_shape(cls, input_shape: Sequence[int]) -> dict:
        """The configuration ``build`` needs to accept inputs of ``input_shape`` (profiling's default)."""
        return {}

    def example_inputs(self, shape: Sequence[int], dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def bytes_moved(self, shape: Sequence[int], dtype: torch.dtype, backward: bool = False) -> int:
        """The fewest bytes a fused kernel must read and write: every input once, every output once."""
        raise NotImplementedError

    def flops(self, shape: Sequence[int], backward: bool = False) -> int:
        raise NotImplementedError

    def reference_modules(self, device: torch.device | None = None) -> dict[str, nn.Module]:
        """PyTorch's own fused kernels for this function on ``device``, shown beside the levels in comparisons."""
        return {}

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={value!r}" for key, value in self.config.items())


def default_device_and_dtype(dtype: torch.dtype | None, device) -> tuple[torch.dtype, torch.device]:
    """float32 on the GPU when there is one, else on the CPU."""
    device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return (dtype or torch.float32), device


def element_count(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)
