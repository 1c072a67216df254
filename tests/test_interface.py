"""The common interface: names, numbers, one parameter layout, lazy loading of levels 4 and 5."""

import subprocess
import sys
import warnings

import pytest
import torch

import levels
from levels.backends import TORCHSCRIPT_DEPRECATION, torchscript


def test_importing_levels_loads_neither_triton_nor_the_extension():
    # cuda_kernels.limits (a leaf of facts) may load; cuda_kernels.ops would build the extension.
    code = "import sys, levels; levels.build('swish', 1); print(sorted(m for m in ('triton', 'triton_kernels', 'cuda_kernels.ops') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("component", levels.COMPONENTS)
def test_levels_are_addressable_by_name_and_number(component):
    for number, name in enumerate(levels.LEVELS, start=1):
        assert levels.level_class(component, number) is levels.level_class(component, name)
        assert levels.level_class(component, str(number)).level == name


def test_unknown_levels_and_components_are_rejected_with_the_choices():
    with pytest.raises(ValueError, match="1-5"):
        levels.build("swish", 6)
    with pytest.raises(ValueError, match="native"):
        levels.build("swish", "fastest")
    with pytest.raises(ValueError, match="layer_norm"):
        levels.build("group_norm", 1)


@pytest.mark.parametrize("component,config", [("swish", {"beta": 1.3}), ("layer_norm", {"normalized_shape": (4, 6)}),
                                              ("rms_norm", {"normalized_shape": (4, 6), "eps": 1e-5})])
def test_every_level_shares_one_parameter_layout(component, config):
    modules = [levels.build(component, level, **config) for level in levels.LEVELS]
    source = modules[0]
    for parameter in source.parameters():
        torch.nn.init.normal_(parameter)
    for module in modules[1:]:
        module.load_state_dict(source.state_dict())  # strict: same keys, same shapes
        assert module.config == source.config
        for mine, theirs in zip(module.parameters(), source.parameters()):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize("component", ["layer_norm", "rms_norm"])
def test_norms_reject_non_positive_normalized_shape(component):
    with pytest.raises(ValueError, match="normalized_shape"):
        levels.build(component, 1, normalized_shape=(4, 0))


def test_torchscript_level_silences_exactly_its_deprecation_warning():
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scripted = torchscript(double)
        warnings.warn("an unrelated deprecation", DeprecationWarning)
    assert torch.equal(scripted(torch.ones(2)), torch.full((2,), 2.0))
    messages = [str(w.message) for w in caught]
    assert messages == ["an unrelated deprecation"]


def test_torchscript_filter_matches_pytorchs_own_wording():
    import re

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.jit.script(lambda_free_function)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    if not deprecations:
        pytest.skip(f"torch {torch.__version__} does not deprecate torch.jit.script")
    assert any(re.fullmatch(TORCHSCRIPT_DEPRECATION, message) for message in deprecations)


def lambda_free_function(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def test_a_blocks_cost_model_is_its_parts_plus_its_two_residual_adds():
    block = levels.build("transformer_block", "native", n_embd=64, n_head=2)
    shape, elements = (2, 16, 64), 2 * 16 * 64
    parts = (block.ln_1, block.attn, block.ln_2, block.mlp)
    for backward, passes in ((False, 1), (True, 2)):
        # each add: one FLOP an element; two tensors read and one written (the backward: as much again)
        assert block.flops(shape, backward) == sum(p.flops(shape, backward) for p in parts) + 2 * elements * passes
        assert block.bytes_moved(shape, torch.float32, backward) == (
            sum(p.bytes_moved(shape, torch.float32, backward) for p in parts) + 2 * 3 * elements * 4 * passes)


@pytest.mark.parametrize("backward", [False, True])
def test_grouped_query_attention_moves_keys_and_values_once_per_kv_head(backward):
    attention = levels.build("attention", "native", causal=True)
    grouped = ((2, 8, 64, 32), (2, 2, 64, 32), (2, 2, 64, 32))  # 4 query heads per kv head
    one_kv_head_each = (2, 8, 64, 32)
    key_and_value_bytes_saved = 2 * 2 * (8 - 2) * 64 * 32 * 2  # k and v at 6 fewer heads, float16
    passes = 3 if backward else 1  # forward: read k, v; backward: read k, v and write dk, dv
    assert (attention.bytes_moved(one_kv_head_each, torch.float16, backward)
            - attention.bytes_moved(grouped, torch.float16, backward)) == passes * key_and_value_bytes_saved
    assert attention.flops(grouped, backward) == attention.flops(one_kv_head_each, backward)  # per query head


def test_self_attention_backward_counts_two_matmuls_per_projection_and_the_attention_backward():
    attention = levels.build("self_attention", "native", n_embd=64, n_head=2)
    projections = 2 * (2 * 16) * 64 * (4 * 64)  # q·k·v (3 · 64 outputs) and output (64), 2 FLOPs a multiply-add
    heads = (2, 2, 16, 32)
    assert attention.flops((2, 16, 64)) == projections + attention.attention.flops(heads)
    assert attention.flops((2, 16, 64), backward=True) == 3 * projections + attention.attention.flops(heads, backward=True)


@pytest.mark.parametrize("level", levels.LEVELS)
def test_parameter_check_runs_again_after_the_parameters_change(level):
    # The parameter walk is skipped while inputs keep the (device, dtype) that last matched; moving the
    # module or assigning a new parameter must bring it back. Level 4 runs on the GPU where there is one.
    device = "cuda" if level == "triton" and torch.cuda.is_available() else "cpu"
    module = levels.build("layer_norm", level, normalized_shape=8).to(device)
    module(torch.randn(2, 8, device=device))
    module.to(torch.float64)
    with pytest.raises(TypeError, match="float32 but weight has dtype torch.float64"):
        module(torch.randn(2, 8, device=device))
    module(torch.randn(2, 8, dtype=torch.float64, device=device))
    module.bias = torch.nn.Parameter(torch.zeros(8, device=device))
    with pytest.raises(TypeError, match="float64 but bias has dtype torch.float32"):
        module(torch.randn(2, 8, dtype=torch.float64, device=device))
