"""Levels 4 and 5 are our own ops: check their gradients numerically (float64 ``gradcheck``) and
their registration (``torch.library.opcheck``: schema, fake tensor, autograd, torch.compile)."""

import pytest
import torch
from torch.func import functional_call

import levels
from levels.backends import cuda_backend, triton_backend

from .conftest import kernel_level_device_params

NAMESPACES = {"triton": ("triton_kernels", triton_backend), "cuda": ("cuda_kernels", cuda_backend)}


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("component,config,shape", [
    ("swish", {"beta": 1.3}, (3, 5)),
    ("layer_norm", {"normalized_shape": 9}, (4, 9)),
    ("layer_norm", {"normalized_shape": (2, 3)}, (3, 2, 3)),
])
def test_gradients_pass_float64_gradcheck(component, config, shape, level, device):
    module = levels.build(component, level, **config).to(device=device, dtype=torch.float64)
    names = [name for name, _ in module.named_parameters()]
    parameters = tuple(torch.randn_like(p).requires_grad_(True) for p in module.parameters())
    (x,) = module.example_inputs(shape, torch.float64, device)

    def function(x, *parameters):
        return functional_call(module, dict(zip(names, parameters)), (x,))

    assert torch.autograd.gradcheck(function, (x.requires_grad_(True), *parameters))


def op_samples(device, dtype):
    """(op name, args) for every op of a backend, on fresh random tensors."""
    x = torch.randn(6, 37, device=device, dtype=dtype)
    weight = torch.randn(37, device=device, dtype=dtype)
    bias = torch.randn(37, device=device, dtype=dtype)
    grad = torch.randn(6, 37, device=device, dtype=dtype)
    statistics_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    mean = x.to(statistics_dtype).mean(-1)
    rstd = torch.rsqrt(x.to(statistics_dtype).var(-1, unbiased=False) + 1e-5)
    return [
        ("swish_forward", (x.clone().requires_grad_(True), 1.5)),
        ("swish_backward", (grad, x, 1.5)),
        ("layer_norm_forward", (x.clone().requires_grad_(True), weight.clone().requires_grad_(True),
                                bias.clone().requires_grad_(True), 1e-5)),
        ("layer_norm_backward", (grad, x, weight, mean, rstd)),
    ]


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_every_op_passes_opcheck(level, device):
    namespace, load = NAMESPACES[level]
    load()
    for op_name, args in op_samples(device, torch.float32):
        op = getattr(getattr(torch.ops, namespace), op_name).default
        torch.library.opcheck(op, args)
