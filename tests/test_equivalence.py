"""Every component × level × dtype computes the same function as a float64 run of level 1: the
output and every gradient (input, weight, bias), within the one tolerance table."""

import pytest
import torch

from levels import TOLERANCE, relative_max_error
from levels.spec import as_reference_input

from .conftest import grid_params
from .helpers import assert_matches_float64_reference, build_pair, forward_and_gradients, make_inputs


def expected_output_dtype(module, dtype):
    """The input's dtype, unless the component says otherwise (a loss is float32 for 16-bit inputs)."""
    return module.output_dtype(dtype) if hasattr(module, "output_dtype") else dtype


@pytest.mark.parametrize("component,config,shape,level,device,dtype", grid_params())
def test_forward_and_backward_match_float64_reference(component, config, shape, level, device, dtype):
    module, reference = build_pair(component, level, config, device, dtype)
    inputs = make_inputs(module, shape, dtype, device)
    with torch.no_grad():
        # Rounded to the level's dtype first, so the level and the reference see the same gradient
        # (otherwise float16 rounding of grad_output alone, amplified by cancellation, is "error").
        grad_output = torch.randn_like(reference(*map(as_reference_input, inputs))).to(dtype).to(torch.float64)

    output, gradients = forward_and_gradients(module, inputs, grad_output)
    expected, expected_gradients = forward_and_gradients(reference, list(map(as_reference_input, inputs)), grad_output)

    assert output.dtype == expected_output_dtype(module, dtype) and output.shape == expected.shape
    floating_inputs = [x for x in inputs if x.is_floating_point()]  # token ids have no gradient
    input_names = ["grad input"] if len(floating_inputs) == 1 else [f"grad input {i}" for i in range(len(floating_inputs))]
    names = ["output", *input_names] + [f"grad {name}" for name, _ in module.named_parameters()]
    for name, actual, wanted in zip(names, [output, *gradients], [expected, *expected_gradients]):
        assert actual is not None, f"{name} was not computed"
        assert torch.isfinite(actual).all(), f"{name} has non-finite values"
        error = relative_max_error(actual, wanted)
        assert error <= TOLERANCE[dtype], f"{name}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize("component,config,shape,level,device,dtype",
                         [p for p in grid_params() if p.values[3] in ("triton", "cuda") and p.values[5] != torch.float64])
def test_inference_forward_matches_float64_reference(component, config, shape, level, device, dtype):
    """Under torch.no_grad levels 4 and 5 take their own path (no autograd, no statistics saved for a
    backward): it must compute the same function."""
    module, reference = build_pair(component, level, config, device, dtype)
    inputs = make_inputs(module, shape, dtype, device)
    with torch.no_grad():
        output = module(*inputs)
        expected = reference(*map(as_reference_input, inputs))
    assert output.dtype == expected_output_dtype(module, dtype) and output.shape == expected.shape
    error = relative_max_error(output, expected)
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


# Level 5's softmax picks its kernel by row length (softmax.cu): 4 lanes a row (128 values), a block
# staging the row in shared memory (4096), a cluster of 3 blocks on Hopper (40000 floats: 160 KB), and
# a few 2.4 MB rows split over many blocks; odd lengths take the unvectorised versions.
SOFTMAX_ROW_STRATEGY_SHAPES = [(4099, 128), (33, 4096), (5, 40000), (3, 600000), (3, 600001), (2, 40001)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SOFTMAX_ROW_STRATEGY_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_matches_float64_reference_at_every_row_strategy(shape, dtype):
    module, reference = build_pair("softmax", "cuda", {"dim": -1}, "cuda", dtype)
    assert_matches_float64_reference(module, reference, module.example_inputs(shape, dtype, "cuda"), TOLERANCE[dtype])
