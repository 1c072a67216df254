"""The climb to level 4's attention forward (triton_kernels/attention_versions.py): every version is
causal attention, within tolerance of level 1's float64 run, and says clearly what it cannot do. And
level 5's two 16-bit kernels of each direction, the portable mma.sync ones and Hopper's wgmma/TMA ones, side
by side."""

from __future__ import annotations

import pytest
import torch

import levels
from levels.attention import AttentionTritonVersion, attention_triton_versions, visible_keys_mask

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


# --- level 5: the portable forward kernel and Hopper's ------------------------------------------------------

# (config, q's (batch, heads, seq), k's and v's): sequences that are multiples of no tile (300 keys: two
# whole 128-key tiles and a ragged one; the 112- and 80-key tiles of the widest heads), a sequence long
# enough that every stage of a 2-stage ring is refilled several times, queries shorter than keys (77: the
# second 64 queries of the 128-query block are mostly padding; 130: two queries in a second block, whose
# second 64 are all padding), a window, and grouped-query attention.
LEVEL_5_CASES = [
    ({"causal": False, "window": 0}, (2, 3, 300), (2, 3, 300)),
    ({"causal": True, "window": 0}, (2, 3, 300), (2, 3, 300)),
    ({"causal": True, "window": 0}, (1, 2, 1000), (1, 2, 1000)),
    ({"causal": True, "window": 100}, (1, 2, 300), (1, 2, 300)),
    ({"causal": True, "window": 0}, (1, 2, 77), (1, 2, 300)),
    ({"causal": False, "window": 0}, (1, 2, 130), (1, 2, 300)),
    ({"causal": True, "window": 0}, (1, 4, 200), (1, 2, 200)),
]
# One head dim per tile width of the Hopper kernel (64, 80, 96, 128, 192, 256), and 144, which runs on the
# 192 tile with columns past it zero-filled.
LEVEL_5_HEAD_DIMS = [64, 80, 96, 128, 144, 192, 256]


def float64_attention_and_lse(q, k, v, causal, window, scale):
    """Level 1's output in float64, and the log-sum-exp of each query's visible scaled scores beside it."""
    reference = levels.float64_reference(levels.build("attention", "native", causal=causal, window=window or None,
                                                      scale=scale))
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    scores = q @ k.repeat_interleave(group, dim=1).transpose(-2, -1) * scale
    if causal:
        scores = scores.masked_fill(~visible_keys_mask(q.shape[2], k.shape[2], window, q.device), float("-inf"))
    return reference(q, k, v), torch.logsumexp(scores, dim=-1)


def assert_both_level_5_forward_kernels_match_float64(q, k, v, causal, window, scale, case):
    """On a Hopper GPU the default is the wgmma/TMA kernel and portable_attention() the mma.sync one; on
    any other GPU both are the mma.sync kernel. Out and lse of both, finite and within q's tolerance of float64."""
    from cuda_kernels.ops import portable_attention

    forward = torch.ops.cuda_kernels.attention_forward.default
    expected_out, expected_lse = float64_attention_and_lse(q, k, v, causal, window, scale)
    with portable_attention():
        portable = forward(q, k, v, causal, window, scale)
    default = forward(q, k, v, causal, window, scale)
    for kernel, (out, lse) in {"portable": portable, "default": default}.items():
        where = f"{kernel} kernel, {case}"
        assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all()), where
        assert levels.relative_max_error(out, expected_out) <= levels.TOLERANCE[q.dtype], where
        assert levels.relative_max_error(lse, expected_lse) <= levels.TOLERANCE[q.dtype], where


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", LEVEL_5_HEAD_DIMS)
def test_both_level_5_cuda_forward_kernels_match_float64_reference(head_dim, dtype):
    """Out and lse of both level-5 forward kernels, every case."""
    for config, query_shape, key_shape in LEVEL_5_CASES:
        q = torch.randn(*query_shape, head_dim, dtype=dtype, device="cuda")
        k, v = (torch.randn(*key_shape, head_dim, dtype=dtype, device="cuda") for _ in range(2))
        assert_both_level_5_forward_kernels_match_float64(q, k, v, config["causal"], config["window"],
                                                          head_dim ** -0.5, f"{config}, q {query_shape}, k {key_shape}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_level_5_cuda_forward_follows_a_running_max_that_keeps_growing(head_dim, dtype, causal):
    """The kernels' running max lags (kMaxLag in tensor_core.cuh): it moves only when a tile's max passes it by
    more than 2^8, and the output is rescaled only then. Keys whose scores grow along the sequence (k scaled by
    1 … 12) make a row's max pass the lag again and again, beside tiles that stay under it: out and lse still
    match float64 in both kernels, where random scores of unit size never pass the lag after the first tile."""
    length = 1000
    q = torch.randn(1, 2, length, head_dim, dtype=dtype, device="cuda")
    growth = torch.linspace(1, 12, length, device="cuda")[:, None]
    k = (torch.randn(1, 2, length, head_dim, device="cuda") * growth).to(dtype)
    v = torch.randn(1, 2, length, head_dim, dtype=dtype, device="cuda")
    assert_both_level_5_forward_kernels_match_float64(q, k, v, causal, 0, head_dim ** -0.5, "growing keys")


def float64_attention_gradients(q, k, v, grad_out, causal, window, scale):
    """Level 1's grad_q, grad_k, grad_v in float64 for grad_out flowing back."""
    reference = levels.float64_reference(levels.build("attention", "native", causal=causal, window=window or None,
                                                      scale=scale))
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    reference(q, k, v).backward(grad_out.double())
    return q.grad, k.grad, v.grad


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_both_level_5_cuda_backward_kernels_match_float64_reference(head_dim, dtype):
    """The backward likewise: on a Hopper GPU the wgmma/TMA kernel by default, the mma.sync one under
    portable_attention(). grad_q, grad_k, grad_v, every case, both ways, from the same out and lse."""
    from cuda_kernels.ops import portable_attention

    forward = torch.ops.cuda_kernels.attention_forward.default
    backward = torch.ops.cuda_kernels.attention_backward.default
    scale = head_dim ** -0.5
    for config, query_shape, key_shape in LEVEL_5_CASES:
        q = torch.randn(*query_shape, head_dim, dtype=dtype, device="cuda")
        k, v = (torch.randn(*key_shape, head_dim, dtype=dtype, device="cuda") for _ in range(2))
        grad_out = torch.randn_like(q)
        out, lse = forward(q, k, v, config["causal"], config["window"], scale)
        arguments = (grad_out, q, k, v, out, lse, config["causal"], config["window"], scale)
        expected = float64_attention_gradients(q, k, v, grad_out, config["causal"], config["window"], scale)
        with portable_attention():
            portable = backward(*arguments)
        default = backward(*arguments)
        for kernel, gradients in {"portable": portable, "default": default}.items():
            for name, actual, wanted in zip(("grad_q", "grad_k", "grad_v"), gradients, expected):
                case = f"{kernel} kernel, {name}, {config}, q {query_shape}, k {key_shape}"
                assert bool(torch.isfinite(actual).all()), case
                assert levels.relative_max_error(actual, wanted) <= levels.TOLERANCE[dtype], case


def cuda_kernel_names(function) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        function()
        torch.cuda.synchronize()
    return {event.key for event in profiler.key_averages()}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper GPU (compute capability 9.0)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", LEVEL_5_HEAD_DIMS)
def test_a_hopper_gpu_runs_the_hopper_kernel_unless_told_not_to(head_dim, dtype):
    """The build added the sm_90a target (cuda_kernels/ops.py), and the launchers took it: the forward at
    every width, the backward up to head_dim 128 (wider heads keep the mma.sync backward)."""
    from cuda_kernels.ops import portable_attention

    q = torch.randn(1, 2, 200, head_dim, dtype=dtype, device="cuda")

    def call():
        out, lse = torch.ops.cuda_kernels.attention_forward(q, q, q, True, 0, 0.125)
        torch.ops.cuda_kernels.attention_backward(q, q, q, q, out, lse, True, 0, 0.125)

    names = cuda_kernel_names(call)
    assert any("attention_forward_hopper_kernel" in name for name in names)
    assert any("attention_backward_hopper_kernel" in name for name in names) == (head_dim <= 128)
    with portable_attention():
        names = cuda_kernel_names(call)
    assert not any("hopper" in name for name in names)
    assert any("attention_forward_tensor_core_kernel" in name for name in names)
    assert any("attention_backward_tensor_core_kernel" in name for name in names)


def test_use_hopper_attention_returns_the_previous_setting():
    from cuda_kernels.ops import portable_attention

    switch = torch.ops.cuda_kernels.use_hopper_attention.default
    original = switch(True)
    try:
        assert switch(False) is True
        assert switch(False) is False
        assert switch(True) is False
        with portable_attention():
            assert switch(False) is False  # off inside the block
        assert switch(True) is True  # and on again after it
    finally:
        switch(original)
