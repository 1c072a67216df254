"""Bad input gets a clear error, never a crash or a silently wrong answer; awkward but valid input
(empty, non-contiguous, sizes that are no multiple of a block) gets the right answer."""

import pytest
import torch

import levels
from levels import TOLERANCE, relative_max_error

from .conftest import kernel_level_device_params
from .helpers import build_pair, forward_and_gradients

ALL_LEVELS = levels.LEVELS
KERNEL_LEVELS = ("triton", "cuda")


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_wrong_normalized_shape_names_expected_and_actual(level):
    module = levels.build("layer_norm", level, normalized_shape=(4, 8))
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(2, 3, 8\)"):
        module(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(8,\)"):
        module(torch.randn(8))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("component,config", [("swish", {}), ("layer_norm", {"normalized_shape": 8})])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_integer_and_bool_tensors_name_the_supported_dtypes(level, component, config, dtype):
    module = levels.build(component, level, **config)
    with pytest.raises(TypeError, match="supports: .*float32"):
        module(torch.ones(2, 8, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", KERNEL_LEVELS)
def test_half_precision_on_cpu_is_a_clear_gpu_only_error(level, dtype):
    module = levels.build("swish", level)
    with pytest.raises(TypeError, match="on cpu supports: float32, float64"):
        module(torch.randn(4, dtype=dtype))


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_input_and_parameters_on_different_devices(level):
    module = levels.build("layer_norm", level, normalized_shape=8).to("meta")
    with pytest.raises(ValueError, match="input is on cpu but weight is on meta"):
        module(torch.randn(2, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_input_on_gpu_with_parameters_on_cpu(level):
    module = levels.build("layer_norm", level, normalized_shape=8)
    with pytest.raises(ValueError, match="input is on cuda:0 but weight is on cpu"):
        module(torch.randn(2, 8, device="cuda"))


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_input_and_parameters_of_different_dtypes(level):
    module = levels.build("layer_norm", level, normalized_shape=8)
    with pytest.raises(TypeError, match="float64 but weight has dtype torch.float32"):
        module(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("component,config,shape", [
    ("swish", {}, (0, 5)),
    ("swish", {}, (0,)),
    ("layer_norm", {"normalized_shape": 16}, (0, 16)),
    ("layer_norm", {"normalized_shape": 16}, (3, 0, 16)),
])
@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_empty_tensors_give_empty_outputs_and_zero_parameter_gradients(level, device, component, config, shape):
    module = levels.build(component, level, **config).to(device)
    x = torch.randn(shape, device=device, requires_grad=True)
    output = module(x)
    assert output.shape == shape
    output.backward(torch.randn(shape, device=device))
    assert x.grad.shape == shape
    for parameter in module.parameters():
        assert torch.equal(parameter.grad, torch.zeros_like(parameter))


@pytest.mark.parametrize("component,config,shape", [
    ("swish", {"beta": 1.2}, (40, 30)),
    ("layer_norm", {"normalized_shape": 40}, (30, 40)),
])
@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_non_contiguous_input_gets_the_right_answer(level, device, component, config, shape):
    module, reference = build_pair(component, level, config, device, torch.float32)
    (x,) = module.example_inputs(shape[::-1], torch.float32, device)
    x = x.transpose(0, 1)  # a strided view, as a transposed activation would be
    assert not x.is_contiguous()
    grad_output = torch.randn(shape, dtype=torch.float64, device=device)
    output, gradients = forward_and_gradients(module, [x], grad_output)
    expected, expected_gradients = forward_and_gradients(reference, [x.double()], grad_output)
    for actual, wanted in zip([output, *gradients], [expected, *expected_gradients]):
        assert relative_max_error(actual, wanted) <= TOLERANCE[torch.float32]
