"""The earlier versions of level 4's LayerNorm and softmax forward kernels (triton_kernels/layer_norm_versions.py,
softmax_versions.py): every version matches the float64 reference, and what they cannot do fails clearly."""

import pytest
import torch

import levels
from levels import TOLERANCE, relative_max_error
from levels.layer_norm import layer_norm_triton_versions
from levels.softmax import softmax_triton_versions
from profiling import perturb_parameters_
from tests.conftest import device_dtype_params

# Versions 1 and 2 walk a row in blocks of launch.LOOPED_ROW_BLOCK (4096): a one-element row, a short
# ragged block, one full block, one block and one element, three blocks with a ragged tail.
ROW_LENGTHS = [1, 300, 4096, 4097, 9000]
COMPONENTS = ["layer_norm", "softmax"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where level 4 runs: the GPU, else the interpreter


def versions_of(component: str, row_length: int) -> dict:
    """``{"version N: ...": module}``, every module with the same perturbed weights (LayerNorm's ones and
    zeros would hide a version that forgets the weight or the bias)."""
    modules = layer_norm_triton_versions(row_length) if component == "layer_norm" else softmax_triton_versions()
    first = perturb_parameters_(next(iter(modules.values())), seed=1)
    for module in modules.values():
        module.load_state_dict(first.state_dict())
    return modules


@pytest.mark.parametrize("row_length", ROW_LENGTHS)
@pytest.mark.parametrize("component", COMPONENTS)
@pytest.mark.parametrize("device, dtype", device_dtype_params("triton"))
def test_every_version_matches_float64_reference(component, row_length, device, dtype):
    modules = versions_of(component, row_length)
    assert [module.version for module in modules.values()] == [1, 2, 3]
    torch.manual_seed(row_length)
    spec = next(iter(modules.values())).to(device)
    x = spec.example_inputs((3, row_length), dtype, device)[0]
    expected = levels.float64_reference(spec)(x.double())
    for name, module in modules.items():
        with torch.no_grad():
            output = module.to(device=device, dtype=dtype)(x)
        error = relative_max_error(output, expected)
        assert error <= TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_an_unknown_version_raises(component):
    module = next(iter(versions_of(component, 8).values())).to(DEVICE)
    module.version = 4
    with torch.no_grad(), pytest.raises(ValueError, match=r"version 4 does not exist \(versions: 1, 2, 3\)"):
        module(torch.randn(2, 8, device=DEVICE))


@pytest.mark.parametrize("component", COMPONENTS)
def test_versions_are_forward_only(component):
    module = next(iter(versions_of(component, 8).values())).to(DEVICE)
    output = module(torch.randn(2, 8, device=DEVICE, requires_grad=True))
    with pytest.raises(NotImplementedError, match="forward only"):
        output.sum().backward()


@pytest.mark.parametrize("version", [1, 2])
def test_versions_reuse_level_4_input_checks(version):
    from triton_kernels import layer_norm_forward_version, softmax_forward_version

    weight, bias = torch.randn(8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(TypeError, match="got dtype int32"):
        softmax_forward_version(torch.ones(2, 8, dtype=torch.int32, device=DEVICE), version)
    with pytest.raises(RuntimeError, match="needs contiguous tensors"):
        layer_norm_forward_version(torch.randn(8, 2, device=DEVICE).t(), weight, bias, 1e-5, version)
    with pytest.raises(RuntimeError, match="rows of 0 elements have no mean"):
        layer_norm_forward_version(torch.randn(2, 0, device=DEVICE), weight[:0], bias[:0], 1e-5, version)


def test_version_ops_pass_opcheck():
    from triton_kernels import layer_norm_forward_version, softmax_forward_version

    x, weight, bias = (torch.randn(*shape, device=DEVICE) for shape in ((3, 40), (40,), (40,)))
    for version in (1, 2, 3):
        torch.library.opcheck(layer_norm_forward_version, (x, weight, bias, 1e-5, version))
        torch.library.opcheck(softmax_forward_version, (x, version))
