"""The climb to level 4's attention forward (triton_kernels/attention_versions.py): every version is
causal attention, within tolerance of level 1's float64 run, and says clearly what it cannot do."""

from __future__ import annotations

import pytest
import torch

import levels
from levels.attention import AttentionTritonVersion, attention_triton_versions

from .conftest import HAS_CUDA

DEVICE = "cuda" if HAS_CUDA else "cpu"  # where level 4 runs: the GPU, or Triton's interpreter on the CPU

# (q's shape, k's and v's shape): a sequence that is a multiple of every tile, one that is a multiple
# of none (the last query and key blocks are partly padding), and 5 queries aligned to the end of 70 keys.
SHAPES = [((1, 2, 64, 16), (1, 2, 64, 16)), ((2, 1, 70, 32), (2, 1, 70, 32)), ((1, 2, 5, 32), (1, 2, 70, 32))]


def assert_every_version_matches_float64_reference(query_shape, key_shape, dtype, device):
    q, k, v = (torch.randn(shape, dtype=dtype, device=device) for shape in (query_shape, key_shape, key_shape))
    reference = levels.float64_reference(levels.build("attention", "native", causal=True))
    expected = reference(q.double(), k.double(), v.double())
    versions = attention_triton_versions()
    assert [module.version for module in versions.values()] == [1, 2, 3, 4]
    for name, module in versions.items():
        error = levels.relative_max_error(module(q, k, v), expected)
        assert error <= levels.TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("query_shape, key_shape", SHAPES, ids=str)
def test_every_version_matches_float64_reference(query_shape, key_shape):
    assert_every_version_matches_float64_reference(query_shape, key_shape, torch.float32, DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("query_shape, key_shape", [((2, 3, 200, 64), (2, 3, 200, 64)),
                                                    ((1, 2, 257, 128), (1, 2, 257, 128)),
                                                    ((1, 2, 7, 40), (1, 2, 300, 40))], ids=str)
def test_every_version_matches_float64_reference_in_16_bits(query_shape, key_shape, dtype):
    assert_every_version_matches_float64_reference(query_shape, key_shape, dtype, "cuda")


def test_an_unknown_version_is_refused():
    from triton_kernels import attention_forward_version

    q = torch.randn(1, 1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"version 5 does not exist \(versions: 1, 2, 3, 4\)"):
        attention_forward_version(q, q, q, 5)


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_an_unsupported_head_dim_is_refused(version):
    from triton_kernels import attention_forward_version

    q = torch.randn(1, 1, 8, 12, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 12 is not supported by the Triton attention kernel"):
        AttentionTritonVersion(version)(q, q, q)
    with pytest.raises(RuntimeError, match="head_dim 12 is not supported by the Triton attention kernel"):
        attention_forward_version(q, q, q, version)


def test_versions_are_forward_only():
    q, k, v = (torch.randn(1, 1, 8, 16, device=DEVICE, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match="attention version 2 is forward only"):
        AttentionTritonVersion(2)(q, k, v)


def test_versions_below_the_level_4_kernel_need_as_many_kv_heads_as_query_heads():
    from triton_kernels import attention_forward_version

    q, k = torch.randn(1, 4, 8, 16, device=DEVICE), torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(RuntimeError, match="versions 1-3 take as many k, v heads as q heads, got 4 and 2"):
        attention_forward_version(q, k, k, 3)
    attention_forward_version(q, k, k, 4)  # grouped-query attention is the level-4 kernel's


def test_compare_optimization_levels_times_the_versions_side_by_side():
    from profiling import compare_optimization_levels

    table = compare_optimization_levels(attention_triton_versions(), (1, 2, 40, 16), dtype=torch.float32,
                                        device=DEVICE, budget_s=0.01, progress=False)
    assert table["level"].tolist() == list(attention_triton_versions())
    assert bool(table["within_tolerance"].all())
