"""Bad input gets a clear error, never a crash or a silently wrong answer; awkward but valid input
(empty, non-contiguous, sizes that are no multiple of a block) gets the right answer."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import levels
from levels import TOLERANCE
from levels.backends import cuda_backend, triton_backend

from .conftest import kernel_level_device_params
from .helpers import assert_matches_float64_reference, build_pair, make_inputs

ALL_LEVELS = levels.LEVELS
KERNEL_LEVELS = ("triton", "cuda")


NORMS = ("layer_norm", "rms_norm")  # the components with a normalized_shape and a weight of that shape


@pytest.mark.parametrize("component", NORMS)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_wrong_normalized_shape_names_expected_and_actual(level, component):
    module = levels.build(component, level, normalized_shape=(4, 8))
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(2, 3, 8\)"):
        module(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(8,\)"):
        module(torch.randn(8))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
@pytest.mark.parametrize("component,config", [("swish", {}), ("layer_norm", {"normalized_shape": 8}),
                                              ("rms_norm", {"normalized_shape": 8})])
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


@pytest.mark.parametrize("component", NORMS)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_input_and_parameters_on_different_devices(level, component):
    module = levels.build(component, level, normalized_shape=8).to("meta")
    with pytest.raises(ValueError, match="input is on cpu but weight is on meta"):
        module(torch.randn(2, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("component", NORMS)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_input_on_gpu_with_parameters_on_cpu(level, component):
    module = levels.build(component, level, normalized_shape=8)
    with pytest.raises(ValueError, match="input is on cuda:0 but weight is on cpu"):
        module(torch.randn(2, 8, device="cuda"))


@pytest.mark.parametrize("component", NORMS)
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_input_and_parameters_of_different_dtypes(level, component):
    module = levels.build(component, level, normalized_shape=8)
    with pytest.raises(TypeError, match="float64 but weight has dtype torch.float32"):
        module(torch.randn(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("component,config,shape", [
    ("swish", {}, (0, 5)),
    ("swish", {}, (0,)),
    ("layer_norm", {"normalized_shape": 16}, (0, 16)),
    ("layer_norm", {"normalized_shape": 16}, (3, 0, 16)),
    ("rms_norm", {"normalized_shape": 16}, (0, 16)),
    ("rms_norm", {"normalized_shape": (2, 8)}, (3, 0, 2, 8)),
    ("feed_forward", {"n_embd": 16}, (0, 16)),
    ("feed_forward", {"n_embd": 16, "bias": False}, (2, 0, 16)),
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
    ("rms_norm", {"normalized_shape": 40}, (30, 40)),
    ("feed_forward", {"n_embd": 40}, (30, 40)),
])
@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_non_contiguous_input_gets_the_right_answer(level, device, component, config, shape):
    module, reference = build_pair(component, level, config, device, torch.float32)
    (x,) = module.example_inputs(shape[::-1], torch.float32, device)
    x = x.transpose(0, 1)  # a strided view, as a transposed activation would be
    assert not x.is_contiguous()
    assert_matches_float64_reference(module, reference, [x], TOLERANCE[torch.float32])


# --- AdamW's step: four lists that must line up, updated in place ------------------------------------


def _misaligned_adamw_lists(case: str, device: str):
    """(params, grads, exp_avgs, exp_avg_sqs) of two tensors each, spoiled as ``case`` says."""
    params = [torch.randn(5, 3, device=device), torch.randn(7, device=device)]
    grads = [torch.randn_like(param) for param in params]
    exp_avgs, exp_avg_sqs = [torch.randn_like(param) for param in params], [torch.rand_like(param) for param in params]
    if case == "lengths":
        grads = grads[:1]
    elif case == "dtype":
        exp_avgs[1] = exp_avgs[1].double()
    elif case == "shape":  # as many values as the parameter, in another shape
        grads[0] = grads[0].reshape(3, 5)
    elif case == "non-contiguous":  # the step writes in place: no copy can stand in for it
        exp_avg_sqs[0] = torch.rand(3, 5, device=device).t()
    elif case == "device":  # on a GPU machine, a CPU tensor among CUDA ones; on a CPU-only one, a meta tensor
        grads[1] = grads[1].to("meta" if device == "cpu" else "cpu")
    return params, grads, exp_avgs, exp_avg_sqs


@pytest.mark.parametrize("case,error,message", [
    ("lengths", {"triton": ValueError, "cuda": ValueError}, r"must be lists of equal length"),
    ("dtype", {"triton": TypeError, "cuda": TypeError}, r"exp_avgs\[1\] (is torch.float64|has dtype Double)"),
    ("shape", {"triton": ValueError, "cuda": ValueError}, r"grads\[0\] has shape .3, 5. but params\[0\]"),
    # level 4's contiguity check is the one its every launcher runs (torch._check: RuntimeError)
    ("non-contiguous", {"triton": RuntimeError, "cuda": ValueError}, r"contiguous"),
    # level 4 says where its kernels can run (LevelUnavailableError, a RuntimeError)
    ("device", {"triton": RuntimeError, "cuda": ValueError}, r"on (meta|cpu)"),
])
@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_adamw_step_rejects_lists_that_do_not_line_up_and_updates_nothing(level, device, case, error, message):
    params, grads, exp_avgs, exp_avg_sqs = _misaligned_adamw_lists(case, device)
    before = [tensor.clone() for tensor in (*params, *exp_avgs, *exp_avg_sqs)]
    backend = triton_backend() if level == "triton" else cuda_backend()
    with torch.no_grad(), pytest.raises(error[level], match=message):
        backend.adamw_step(params, grads, exp_avgs, exp_avg_sqs, 1e-2, 0.9, 0.999, 1e-8, 0.1, 1)
    assert all(torch.equal(after, was) for after, was in zip((*params, *exp_avgs, *exp_avg_sqs), before))


# --- attention ---------------------------------------------------------------------------------------

def attention_inputs(q_shape, kv_shape=None, dtype=torch.float32, device="cpu"):
    kv_shape = kv_shape or q_shape
    return make_inputs(None, (q_shape, kv_shape, kv_shape), dtype, device)


@pytest.mark.parametrize("level", ALL_LEVELS)
@pytest.mark.parametrize("q_shape,kv_shape", [
    ((1, 2, 8, 16), (1, 3, 8, 16)),  # more kv heads than query heads
    ((1, 6, 8, 16), (1, 4, 8, 16)),  # query heads not a multiple of the kv heads
    ((1, 2, 8, 16), (1, 2, 8, 32)),  # head dims differ
])
def test_attention_mismatched_shapes_name_all_three(level, q_shape, kv_shape):
    attention = levels.build("attention", level, causal=False)
    shapes = [re.escape(str(shape)) for shape in (q_shape, kv_shape, kv_shape)]
    with pytest.raises(ValueError, match=r"shapes do not fit together: q {}, k {}, v {}".format(*shapes)):
        attention(*attention_inputs(q_shape, kv_shape))


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_attention_k_and_v_with_different_head_counts_are_refused(level):
    q, k, _ = attention_inputs((1, 4, 8, 16), (1, 2, 8, 16))
    with pytest.raises(ValueError, match=r"shapes do not fit together: q \(1, 4, 8, 16\), k \(1, 2, 8, 16\), "
                                         r"v \(1, 1, 8, 16\)"):
        levels.build("attention", level)(q, k, torch.randn(1, 1, 8, 16))


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_attention_k_and_v_of_different_shapes(level):
    q, k, _ = attention_inputs((1, 2, 8, 16))
    with pytest.raises(ValueError, match="shapes do not fit together"):
        levels.build("attention", level)(q, k, torch.randn(1, 2, 9, 16))


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_attention_mixed_dtypes_are_refused(level):
    q, k, v = attention_inputs((1, 2, 8, 16))
    with pytest.raises(TypeError, match="q, k and v must share dtype and device"):
        levels.build("attention", level)(q, k.double(), v)


@pytest.mark.parametrize("window", [0, -3, 2.5])
def test_attention_window_must_be_a_positive_count(window):
    with pytest.raises(ValueError, match="window must be a positive number of keys"):
        levels.build("attention", "native", window=window)


def test_attention_window_needs_causal():
    with pytest.raises(ValueError, match="needs causal=True"):
        levels.build("attention", "native", causal=False, window=8)


@pytest.mark.parametrize("level", KERNEL_LEVELS)
@pytest.mark.parametrize("head_dim", [4, 100, 264])
def test_attention_unsupported_head_dim_names_the_supported_ones(level, head_dim):
    with pytest.raises(ValueError, match=rf"head_dim {head_dim} is not supported .*multiples of 8 from 8 to 256"):
        levels.build("attention", level)(*attention_inputs((1, 2, 8, head_dim)))


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_attention_more_causal_queries_than_keys_is_refused(level):
    with pytest.raises(ValueError, match="causal attention with 9 queries but only 4 keys"):
        levels.build("attention", level)(*attention_inputs((1, 2, 9, 16), (1, 2, 4, 16)))


@pytest.mark.parametrize("shape", [(0, 2, 8, 16), (1, 0, 8, 16), (1, 2, 0, 16)])
@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_attention_empty_batch_gives_empty_outputs_and_gradients(level, device, shape):
    q, k, v = (x.requires_grad_(True) for x in attention_inputs(shape, device=device))
    output = levels.build("attention", level)(q, k, v)
    assert output.shape == shape
    output.backward(torch.randn(shape, device=device))
    assert q.grad.shape == k.grad.shape == v.grad.shape == shape


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_decode_attention_with_a_gradient_wanted_is_refused_not_silently_cut_from_the_graph(level, device):
    """The decode kernels have no backward. An output with no graph would leave every gradient before it
    silently missing, so a call that asks for one raises; under torch.no_grad the same call runs."""
    module = levels.build("attention", level)
    q = torch.randn(1, 2, 1, 16, device=device, requires_grad=True)
    k_new, v_new = torch.randn(2, 1, 2, 1, 16, device=device)
    k_cache, v_cache = torch.randn(2, 1, 2, 8, 16, device=device)
    key_lengths = torch.tensor([5], dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=r"decode_attention is inference only.*torch\.no_grad"):
        module.decode(q, k_new, v_new, k_cache, v_cache, key_lengths)
    with torch.no_grad():
        assert module.decode(q, k_new, v_new, k_cache, v_cache, key_lengths).shape == q.shape


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_attention_non_contiguous_inputs_get_the_right_answer(level, device):
    module, reference = build_pair("attention", level, {"causal": True, "window": 5}, device, torch.float32)
    # (batch, seq, heads, head_dim) memory seen as (batch, heads, seq, head_dim): the layout a fused
    # qkv projection leaves behind.
    q, k, v = (x.transpose(1, 2) for x in attention_inputs((2, 19, 3, 32), device=device))
    assert not q.is_contiguous()
    assert_matches_float64_reference(module, reference, [q, k, v], TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_attention_integer_inputs_name_the_supported_dtypes(level, dtype):
    with pytest.raises(TypeError, match="supports: .*float32"):
        levels.build("attention", level)(*(torch.ones(1, 2, 8, 16, dtype=dtype) for _ in range(3)))


# --- softmax -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("shape,dim", [((0, 7), -1), ((3, 0), -1), ((4, 6), 0)])
def test_softmax_empty_and_other_dims(level, device, shape, dim):
    module, reference = build_pair("softmax", level, {"dim": dim}, device, torch.float32)
    (x,) = module.example_inputs(shape, torch.float32, device)
    assert_matches_float64_reference(module, reference, [x], TOLERANCE[torch.float32])


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_softmax_non_contiguous_input_gets_the_right_answer(level, device):
    module, reference = build_pair("softmax", level, {"dim": -1}, device, torch.float32)
    x = torch.randn(50, 30, device=device).t()
    assert not x.is_contiguous()
    assert_matches_float64_reference(module, reference, [x], TOLERANCE[torch.float32])


# --- the linear and feed-forward ops of levels 4 and 5 ---------------------------------------------------

def kernel_backend(level):
    return triton_backend() if level == "triton" else cuda_backend()


def linear_operands(device, *shapes):
    return [torch.randn(shape, device=device) if shape is not None else None for shape in shapes]


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_linear_with_a_weight_of_the_wrong_width_names_both_sizes(level, device):
    backend = kernel_backend(level)
    x, weight, bias = linear_operands(device, (5, 7), (11, 8), (11,))
    with pytest.raises((ValueError, RuntimeError), match=r"\b7\b.*\b8\b|\b8\b.*\b7\b"):
        backend.linear(x, weight, bias)
    x, weight, bias = linear_operands(device, (5, 7), (11, 7), (10,))
    with pytest.raises((ValueError, RuntimeError), match=r"\b10\b.*\b11\b|\b11\b.*\b10\b"):
        backend.linear(x, weight, bias)


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_feed_forward_with_projections_that_do_not_chain_or_one_bias_is_an_error(level, device):
    backend = kernel_backend(level)
    x, fc_weight, fc_bias, proj_weight, proj_bias = linear_operands(device, (5, 7), (11, 7), (11,), (7, 12), (7,))
    with pytest.raises((ValueError, RuntimeError), match=r"\b11\b.*\b12\b|\b12\b.*\b11\b"):
        backend.feed_forward(x, fc_weight, fc_bias, proj_weight, proj_bias)
    proj_weight = torch.randn(7, 11, device=device)
    with pytest.raises((ValueError, RuntimeError), match="bias"):
        backend.feed_forward(x, fc_weight, fc_bias, proj_weight, None)


# --- level 5's C++ checks, on every device ------------------------------------------------------------

# Each op of level 5 fed tensors that do not fit together, through its Python function and (with
# requires_grad) through its C++ autograd kernel; the last line says which exception each raised.
LEVEL_5_MISFITS = textwrap.dedent("""
    import sys
    import torch
    from cuda_kernels import ops

    device = sys.argv[1]
    elsewhere = "cpu" if device == "cuda" else "meta"
    def tensor(*shape, dtype=torch.float32, grad=False):
        return torch.randn(shape, device=device).to(dtype).requires_grad_(grad)
    raised = []
    for grad in (False, True):
        cases = {
            "swish dtype": lambda: ops.swish(tensor(3, dtype=torch.int32), 1.0),
            "swish_backward shape": lambda: torch.ops.cuda_kernels.swish_backward(tensor(3), tensor(4), 1.0),
            "layer_norm weight": lambda: ops.layer_norm(tensor(4, 8, grad=grad), tensor(7), tensor(8), 1e-5),
            "layer_norm weight device": lambda: ops.layer_norm(tensor(4, 8, grad=grad), torch.ones(8, device=elsewhere),
                                                               tensor(8), 1e-5),
            "rms_norm weight": lambda: ops.rms_norm(tensor(4, 8, grad=grad), tensor(7), 1e-6),
            "rms_norm weight dtype": lambda: ops.rms_norm(tensor(4, 8, grad=grad), tensor(8, dtype=torch.float64), 1e-6),
            "rms_norm empty rows": lambda: ops.rms_norm(tensor(4, 0, grad=grad), tensor(0), 1e-6),
            "softmax scalar": lambda: ops.softmax(tensor(grad=grad)),
            "attention head_dim": lambda: ops.attention(tensor(1, 2, 8, 16, grad=grad), tensor(1, 2, 8, 32),
                                                        tensor(1, 2, 8, 32), True, 0, 0.25),
            "attention causal": lambda: ops.attention(tensor(1, 2, 9, 16, grad=grad), tensor(1, 2, 4, 16),
                                                      tensor(1, 2, 4, 16), True, 0, 0.25),
            "linear width": lambda: ops.linear(tensor(5, 7, grad=grad), tensor(11, 8), tensor(11)),
            "linear bias": lambda: ops.linear(tensor(5, 7, grad=grad), tensor(11, 7), tensor(10)),
            "feed_forward chain": lambda: ops.feed_forward(tensor(5, 7, grad=grad), tensor(11, 7), tensor(11),
                                                           tensor(7, 12), tensor(7)),
            "feed_forward one bias": lambda: ops.feed_forward(tensor(5, 7, grad=grad), tensor(11, 7), tensor(11),
                                                              tensor(7, 11), None),
        }
        for name, call in cases.items():
            try:
                call()
            except (ValueError, TypeError) as error:
                raised.append(f"{name}: {type(error).__name__}")
            else:
                sys.exit(f"{name} (requires_grad={grad}) raised nothing")
    print("; ".join(raised))
""")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_level_5_ops_raise_python_exceptions_for_inputs_that_do_not_fit(device):
    # In a child process, so that a crash fails this test instead of ending the run: on an H100 machine
    # a rejected CUDA call once ended the process with a segmentation fault instead of raising.
    result = subprocess.run([sys.executable, "-c", LEVEL_5_MISFITS, device], capture_output=True, text=True,
                            timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, f"exit code {result.returncode}: {result.stderr[-3000:]}"
    raised = result.stdout.strip().splitlines()[-1].split("; ")
    assert len(raised) == 28
    assert all(entry.endswith("TypeError") == ("dtype" in entry) for entry in raised), raised
