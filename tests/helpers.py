"""What several test files do the same way: build a level and its float64 reference, run them."""

from __future__ import annotations

import torch

import levels
from levels import relative_max_error
from levels.spec import as_reference_input
from profiling import perturb_parameters_


def build_pair(component, level, config, device, dtype):
    """``level`` of ``component`` with perturbed weights, and the float64 level-1 run of the same weights."""
    module = levels.build(component, level, **config)
    perturb_parameters_(module, seed=1)
    module.to(device=device, dtype=dtype)
    return module, levels.float64_reference(module)


def make_inputs(module, shape, dtype, device):
    """The component's own example inputs for ``shape``, or one random tensor per shape when ``shape``
    is a tuple of shapes (attention with queries shorter than keys)."""
    if shape and isinstance(shape[0], tuple):
        return tuple(torch.randn(s, dtype=dtype, device=device) for s in shape)
    return module.example_inputs(shape, dtype, device)


def forward_and_gradients(module, inputs, grad_output):
    """The output and the gradients of every floating input (not token ids) and every parameter, for
    ``grad_output`` flowing back."""
    inputs = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
    output = module(*inputs)
    output.backward(grad_output.to(output.dtype))
    gradients = [x.grad for x in inputs if x.is_floating_point()] + [p.grad for p in module.parameters()]
    return output, gradients


def assert_matches_float64_reference(module, reference, inputs, tolerance):
    """``module`` on ``inputs`` and ``reference`` on their float64 copies agree, output and every
    gradient, for one random grad_output."""
    with torch.no_grad():
        grad_output = torch.randn_like(reference(*map(as_reference_input, inputs)))
    output, gradients = forward_and_gradients(module, inputs, grad_output)
    expected, expected_gradients = forward_and_gradients(reference, list(map(as_reference_input, inputs)), grad_output)
    assert output.shape == expected.shape
    for actual, wanted in zip([output, *gradients], [expected, *expected_gradients]):
        assert relative_max_error(actual, wanted) <= tolerance
