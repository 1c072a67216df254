"""Levels 4 and 5 are our own ops: check their gradients numerically (float64 ``gradcheck``) and
their registration (``torch.library.opcheck``: schema, fake tensor, autograd, torch.compile)."""

import importlib
import shutil

import pytest
import torch
import torch.utils.checkpoint
from torch.func import functional_call

import levels
from levels.backends import TORCHSCRIPT_DEPRECATION, cuda_backend, triton_backend

from levels.spec import TOLERANCE, relative_max_error

from .conftest import device_dtype_params, kernel_level_device_params

NAMESPACES = {"triton": ("triton_kernels", triton_backend), "cuda": ("cuda_kernels", cuda_backend)}


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("component,config,shape", [
    ("swish", {"beta": 1.3}, (3, 5)),
    ("layer_norm", {"normalized_shape": 9}, (4, 9)),
    ("layer_norm", {"normalized_shape": (2, 3)}, (3, 2, 3)),
    ("rms_norm", {"normalized_shape": 9}, (4, 9)),
    ("rms_norm", {"normalized_shape": (2, 3)}, (3, 2, 3)),
    ("softmax", {"dim": -1}, (3, 7)),
    ("softmax", {"dim": 0}, (5, 2)),
])
def test_gradients_pass_float64_gradcheck(component, config, shape, level, device):
    module = levels.build(component, level, **config).to(device=device, dtype=torch.float64)
    names = [name for name, _ in module.named_parameters()]
    parameters = tuple(torch.randn_like(p).requires_grad_(True) for p in module.parameters())
    (x,) = module.example_inputs(shape, torch.float64, device)

    def function(x, *parameters):
        return functional_call(module, dict(zip(names, parameters)), (x,))

    assert torch.autograd.gradcheck(function, (x.requires_grad_(True), *parameters))


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("config,query_length,heads,kv_heads,head_dim", [
    ({"causal": True}, 9, 2, 2, 16),
    ({"causal": True, "window": 3}, 9, 2, 2, 16),
    ({"causal": False}, 9, 2, 2, 16),
    ({"causal": True}, 4, 2, 2, 16),  # queries aligned to the end of 9 keys
    ({"causal": True}, 9, 6, 2, 16),  # grouped-query attention: dk, dv summed over 3 query heads
    ({"causal": True, "window": 3}, 9, 1, 1, 24),  # a head dim on a wider tile, the rest masked
])
def test_attention_gradients_pass_float64_gradcheck(config, query_length, heads, kv_heads, head_dim, level, device):
    module = levels.build("attention", level, **config)
    q = torch.randn(1, heads, query_length, head_dim, dtype=torch.float64, device=device, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, 9, head_dim, dtype=torch.float64, device=device, requires_grad=True)
            for _ in range(2))
    # fast_mode checks random projections of the Jacobian: a few calls instead of one per input
    # element, which keeps Triton's CPU interpreter to seconds.
    assert torch.autograd.gradcheck(module, (q, k, v), fast_mode=True)


def _heads_of_a_fused_projection(qkv, heads, kv_heads):
    """q, k and v as self-attention makes them: (batch, heads, tokens, head_dim) views of one projection
    (batch, tokens, heads + 2 * kv_heads, head_dim), strided, nothing copied."""
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("config,tokens,heads,kv_heads,head_dim", [
    ({"causal": True}, 70, 3, 3, 64),
    ({"causal": True, "window": 5}, 33, 4, 2, 24),  # grouped-query heads, a head dim on a wider tile
    ({"causal": False}, 1, 2, 2, 128),
    # 72 and 88: on the padded 128-wide tile, 56 and 40 columns masked (two slices with a partly masked
    # second one read past shared memory on an H200: attention_tiles.head_dim_slices)
    ({"causal": True}, 70, 4, 2, 72),
    ({"causal": True}, 45, 2, 2, 88),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_attention_of_heads_split_off_a_fused_projection_matches_float64(config, tokens, heads, kv_heads, head_dim,
                                                                          dtype, level, device):
    """The kernels take strided heads (level 5 reads them where they lie): output and the projection's
    gradient match the float64 reference on contiguous copies."""
    if dtype not in levels.LEVEL_DTYPES[level][device]:
        pytest.skip(f"level {level} computes no {dtype} on {device}")
    module = levels.build("attention", level, **config)
    qkv = torch.randn(2, tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, device=device, requires_grad=True)
    reference_qkv = qkv.detach().to(torch.float64).requires_grad_(True)
    out = module(*_heads_of_a_fused_projection(qkv, heads, kv_heads))
    expected = levels.float64_reference(module)(*(x.contiguous() for x in
                                                  _heads_of_a_fused_projection(reference_qkv, heads, kv_heads)))
    grad_out = torch.randn_like(expected)
    out.backward(grad_out.to(dtype))
    expected.backward(grad_out)
    tolerance = levels.TOLERANCE[dtype]
    assert levels.relative_max_error(out, expected) <= tolerance
    assert levels.relative_max_error(qkv.grad, reference_qkv.grad) <= tolerance


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_attention_output_merges_its_heads_without_a_copy(level, device):
    """Levels 4 and 5 write the output in (batch, tokens, heads, head_dim) order, so that merging the heads
    back into one row per token, as self-attention does before its output projection, is a view."""
    q = torch.randn(2, 3, 5, 16, device=device)
    out = levels.build("attention", level, causal=True)(q, q, q)
    assert out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_attention_gradients_are_laid_out_as_their_operands(level, device, dtype):
    """Levels 4 and 5 write the gradient of heads split off a fused projection tokens first, (batch, tokens,
    heads, head_dim), so that unbind's backward stacks the three into the projection's layout at copy
    speed; and the gradient of a contiguous operand contiguous, so that autograd keeps it as a leaf's
    ``.grad`` as it is. (On a GPU, bfloat16 takes the tensor-core kernels, float32 the SIMT ones.)"""
    if dtype not in levels.LEVEL_DTYPES[level][device]:
        pytest.skip(f"level {level} computes no {dtype} on {device}")
    module = levels.build("attention", level, causal=True)
    qkv = torch.randn(2, 7, 3, 4, 64, dtype=dtype, device=device, requires_grad=True)
    q, k, v = (part.transpose(1, 2) for part in qkv.unbind(2))
    out = module(q, k, v)
    for gradient in torch.autograd.grad(out, (q, k, v), torch.randn_like(out)):
        assert gradient.transpose(1, 2).is_contiguous()
    q, k, v = (torch.randn(2, 4, 7, 64, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    module(q, k, v).backward(torch.randn(2, 4, 7, 64, dtype=dtype, device=device))
    assert all(x.grad.is_contiguous() for x in (q, k, v))


@pytest.mark.parametrize("level", ["native", "cuda"])
def test_self_attentions_projection_gradient_comes_back_in_one_pass(level):
    """Self-attention splits q, k and v off one (batch, tokens, 3, heads, head_dim) projection. Its backward
    stacks their three gradients into that layout in one pass; nothing copies a tensor of that shape again
    (splitting the heads in the other order cost a second pass: a view's backward copying it all)."""
    batch, tokens, heads, head_dim = 2, 5, 2, 16
    module = levels.build("self_attention", level, n_embd=heads * head_dim, n_head=heads)
    x = torch.randn(batch, tokens, heads * head_dim, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        module(x).sum().backward()
    projection_shape = [batch, tokens, 3, heads, head_dim]
    copies = [event.name for event in profile.events()
              if event.name in ("aten::copy_", "aten::clone") and projection_shape in event.input_shapes]
    assert copies == [], copies


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("component,config", [
    ("swish", {"beta": 1.3}), ("layer_norm", {"normalized_shape": 6}), ("rms_norm", {"normalized_shape": 6}),
    ("softmax", {"dim": -1}),
])
def test_a_second_derivative_raises_instead_of_coming_out_zero(component, config, level, device):
    """Our backward kernels are first-order only. A backward run with create_graph=True still gives the
    right first derivative; differentiating that again must raise, not return zeros (softmax's second
    derivative is not zero, and PyTorch's default for an op without an autograd formula is a warning and
    a zero gradient)."""
    module = levels.build(component, level, **config).to(device=device, dtype=torch.float64)
    reference = levels.build(component, "native", **config).to(device=device, dtype=torch.float64)
    (x,) = module.example_inputs((3, 6), torch.float64, device)
    x.requires_grad_(True)
    direction = torch.randn_like(x, requires_grad=True)
    (first,) = torch.autograd.grad(module(x), x, direction, create_graph=True)
    (expected,) = torch.autograd.grad(reference(x), x, direction)
    torch.testing.assert_close(first, expected)
    with pytest.raises(RuntimeError, match="differentiate twice|not implemented"):
        first.sum().backward()


DIFFERENTIABLE_OPS = [
    ("swish", {"beta": 1.3}, (3, 6)), ("layer_norm", {"normalized_shape": 6}, (3, 6)),
    ("rms_norm", {"normalized_shape": 6}, (3, 6)), ("softmax", {"dim": -1}, (3, 6)),
    ("attention", {"causal": True}, (1, 2, 5, 8)), ("feed_forward", {"n_embd": 8}, (3, 8)),
    ("linear_cross_entropy", {"n_embd": 8, "vocab_size": 16}, (3, 8)),
]
"""Every component whose level 4 and 5 are one differentiable op, with a config and an input shape."""


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("component,config,shape", DIFFERENTIABLE_OPS,
                         ids=lambda value: value if isinstance(value, str) else None)
def test_saved_tensors_guard_the_backward(component, config, shape, level, device):
    """The graph node keeps what its backward needs as saved tensors, as PyTorch's own nodes do: a second
    backward without retain_graph, or a backward after a saved tensor was changed in place, raises
    PyTorch's own error instead of computing from freed or stale memory."""
    module = levels.build(component, level, **config).to(device=device, dtype=torch.float64)
    inputs = module.example_inputs(shape, torch.float64, device)
    leaf = inputs[0].clone().requires_grad_(True)
    out = module(leaf * 1, *inputs[1:])
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()
    if component == "linear_cross_entropy":
        return  # it saves its own gradients, made in the forward: nothing a caller holds
    x = leaf * 1  # not a leaf, so it may change in place after the forward
    out = module(x, *inputs[1:])
    (out if component == "softmax" else x).add_(1)  # softmax saves its output, the others their input
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_saved_tensors_pass_through_autograds_hooks(level, device):
    """Our nodes save through autograd's saved-tensor hooks, as PyTorch's own nodes do, so the tools built on
    those hooks work with them: non-reentrant activation checkpointing, which drops what the forward saved
    and recomputes it during the backward, leaves a transformer block's gradients as they were."""
    torch.manual_seed(0)
    block = levels.build("transformer_block", level, n_embd=32, n_head=2).to(device=device, dtype=torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64, device=device, requires_grad=True)
    inputs = (x, *block.parameters())
    direction = torch.randn_like(x)
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: packed.append(tensor) or tensor, lambda tensor: tensor):
        block.ln_1(x)
    assert packed, "the LayerNorm's node saved nothing through the hooks"
    expected = torch.autograd.grad(block(x), inputs, direction)
    checkpointed = torch.autograd.grad(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False), inputs, direction)
    for got, wanted in zip(checkpointed, expected):
        assert relative_max_error(got, wanted) <= TOLERANCE[torch.float64]


# Forward AD's first use in a process makes PyTorch script its own jvp decompositions, which raises
# TorchScript's deprecation notice: that one warning, and nothing else, is not the test's business.
@pytest.mark.filterwarnings(f"ignore:{TORCHSCRIPT_DEPRECATION}:DeprecationWarning")
@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("component,config,shape", DIFFERENTIABLE_OPS,
                         ids=lambda value: value if isinstance(value, str) else None)
def test_forward_mode_ad_raises_instead_of_dropping_the_tangent(component, config, shape, level, device):
    """Our kernels have reverse-mode formulas only. An input with a forward-mode tangent (a dual tensor of
    torch.autograd.forward_ad, as torch.func.jvp makes) must raise, not give an output without one, with or
    without parameters that require grad."""
    module = levels.build(component, level, **config).to(device=device, dtype=torch.float64)
    inputs = module.example_inputs(shape, torch.float64, device)
    for wants_parameter_gradients in (True, False):
        module.requires_grad_(wants_parameter_gradients)
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(inputs[0], torch.randn_like(inputs[0]))
            with pytest.raises(NotImplementedError, match="forward-mode AD is not implemented"):
                module(dual, *inputs[1:])


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_linear_and_feed_forward_pass_float64_gradcheck(bias, level, device):
    backend = NAMESPACES[level][1]()

    def parameter(*shape):
        return torch.randn(*shape, dtype=torch.float64, device=device, requires_grad=True)

    x = parameter(5, 7)
    fc_weight, fc_bias, proj_weight, proj_bias = parameter(11, 7), parameter(11), parameter(7, 11), parameter(7)
    if not bias:
        fc_bias = proj_bias = None
    assert torch.autograd.gradcheck(backend.linear, (x, fc_weight, fc_bias), fast_mode=True)
    assert torch.autograd.gradcheck(backend.feed_forward, (x, fc_weight, fc_bias, proj_weight, proj_bias),
                                    fast_mode=True)


@pytest.mark.parametrize("device,dtype", device_dtype_params("triton"))
@pytest.mark.parametrize("rows,columns,depth", [(70, 40, 45), (70, 40, 0), (0, 40, 45)],
                         ids=["tiles-and-a-tail", "empty-depth", "no-rows"])
def test_the_level_4_matmul_sums_the_rows_of_a_as_it_multiplies(rows, columns, depth, device, dtype):
    """A weight gradient's matmul gives the bias gradient too: Σ_k A[m, k] for every row of every tile-row,
    stored once (by tile-column 0), with a K that ends in a partial step, or no K at all. A is read
    transposed in place, as grad_outᵀ is."""
    matmul = importlib.import_module("triton_kernels.matmul")
    a = torch.randn(depth, rows, dtype=dtype, device=device).t()
    b = torch.randn(depth, columns, dtype=dtype, device=device)
    row_sums = torch.full((rows,), float("nan"), dtype=dtype, device=device)
    product = matmul.launch_matmul(a, b, row_sums=row_sums)
    wanted_product, wanted_sums = a.double() @ b.double(), a.double().sum(dim=1)
    assert relative_max_error(product.double(), wanted_product) <= TOLERANCE[dtype]
    assert relative_max_error(row_sums.double(), wanted_sums) <= TOLERANCE[dtype]


@pytest.mark.parametrize("device,dtype", device_dtype_params("triton"))
@pytest.mark.parametrize("rows,columns,tile", [(1, 96, "NARROW_DECODE_MATMUL_TILE"), (17, 96, "NARROW_DECODE_MATMUL_TILE"),
                                               (32, 1100, "DECODE_MATMUL_TILE"), (33, 96, "SMALL_MATMUL_TILE")],
                         ids=["one-row", "two-tile-rows", "wide-weight", "past-decode-rows"])
def test_the_level_4_matmul_at_a_decode_steps_rows_matches_float64(rows, columns, tile, device, dtype):
    """A decode step's few tokens through a projection with its bias and GELU, against float64. On a GPU
    16-bit matmuls of up to DECODE_ROWS rows take a 16-row decode tile, 32 columns wide on a narrow weight
    and 64 on a wide one (1100 columns: a ragged last tile); 17 rows make a second, ragged tile-row; 33
    take SMALL_MATMUL_TILE again. K = 200 ends in a partial 128-deep step."""
    matmul = importlib.import_module("triton_kernels.matmul")
    a = torch.randn(rows, 200, dtype=dtype, device=device)
    w = torch.randn(columns, 200, dtype=dtype, device=device) / 200 ** 0.5
    bias = torch.randn(columns, dtype=dtype, device=device)
    out = matmul.launch_matmul(a, w.t(), epilogue="gelu", bias=bias)
    wanted = torch.nn.functional.gelu(a.double() @ w.double().t() + bias.double(), approximate="tanh")
    assert relative_max_error(out.double(), wanted) <= TOLERANCE[dtype]
    if device == "cuda" and dtype.itemsize == 2:
        constants = matmul.plan_matmul(a, w.t(), out, "gelu", bias).constants
        assert (constants["BLOCK_M"], constants["BLOCK_N"], constants["BLOCK_K"]) == getattr(matmul, tile)[:3]


TMA_MATMUL_CASES = [(False, "none"), (True, "none"), (False, "accumulate"), (True, "accumulate"), (True, "gelu"),
                    (True, "gelu_saving_pre_activation"), (False, "gelu_backward")]
"""(B stored transposed, epilogue): every layout and epilogue the TMA kernel takes, each GELU one in the layout
the feed-forward gives it (x·W_fcᵀ with a bias; grad_y·W_proj)."""


def _gelu_tanh_and_derivative(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = h.detach().requires_grad_()
    gelu = torch.nn.functional.gelu(h, approximate="tanh")
    (derivative,) = torch.autograd.grad(gelu.sum(), h)
    return gelu.detach(), derivative


@pytest.mark.parametrize("device,dtype", device_dtype_params("triton"))
@pytest.mark.parametrize("b_transposed,epilogue", TMA_MATMUL_CASES,
                         ids=[f"{'BT' if bt else 'B'}-{e}" for bt, e in TMA_MATMUL_CASES])
def test_the_level_4_tma_matmul_matches_float64(b_transposed, epilogue, device, dtype, monkeypatch):
    """The persistent TMA kernel, through launch_matmul, against float64: 136 rows (an edge tile-row), 72
    columns, K = 88 (a partial last step, which the TMA box reads as zeros). On the GPU it runs 16-bit
    matmuls on a Hopper GPU (the GELU epilogues through tanh.approx); every size is made "large" and the
    autotuner given one candidate, so that the test compiles one kernel a case. Under the interpreter it
    runs every matmul it can read."""
    matmul = importlib.import_module("triton_kernels.matmul")
    if device == "cuda":
        if dtype.itemsize != 2 or not matmul._has_tma(torch.cuda.current_device()):
            pytest.skip("the TMA kernel runs 16-bit matmuls on a Hopper GPU")
        monkeypatch.setattr(matmul, "SMALL_MATMUL", 0)
        monkeypatch.setattr(matmul._matmul_tma_autotuned, "configs", matmul._matmul_tma_autotuned.configs[2:3])
    monkeypatch.setattr(matmul, "_tuned_tiles", {})
    rows, columns, depth = 136, 72, 88
    a = torch.randn(rows, depth, dtype=dtype, device=device)
    b = (torch.randn(columns, depth, dtype=dtype, device=device).t() if b_transposed
         else torch.randn(depth, columns, dtype=dtype, device=device))
    assert matmul._tma_operands(a, b, None, None) == (b_transposed, depth, b.stride(1 if b_transposed else 0))
    bias = torch.randn(columns, dtype=dtype, device=device) if b_transposed or epilogue == "none" else None
    out = torch.randn(rows, columns, dtype=dtype, device=device)
    product = a.double() @ b.double() + (bias.double() if bias is not None else 0)
    pre_activation = {"gelu_saving_pre_activation": torch.empty_like(out),
                      "gelu_backward": torch.randn_like(out)}.get(epilogue)
    wanted = {"none": product, "accumulate": product + out.double()}.get(epilogue)
    if epilogue.startswith("gelu"):
        h = pre_activation.double() if epilogue == "gelu_backward" else product
        gelu, derivative = _gelu_tanh_and_derivative(h)
        wanted = product * derivative if epilogue == "gelu_backward" else gelu
    matmul.launch_matmul(a, b, epilogue, bias=bias, pre_activation=pre_activation, out=out)
    assert relative_max_error(out.double(), wanted) <= TOLERANCE[dtype]
    if epilogue == "gelu_saving_pre_activation":
        assert relative_max_error(pre_activation.double(), product) <= TOLERANCE[dtype]


def test_the_level_4_matmuls_that_stay_on_the_pointer_kernel():
    """What the TMA kernel was slower at on an H100 goes to the pointer kernel wherever it runs: A read
    transposed (a weight gradient) and row sums; and so does what TMA cannot read in place (an outer stride
    that is not a multiple of 16 bytes), and an empty K. The GELU epilogues take the TMA kernel."""
    matmul = importlib.import_module("triton_kernels.matmul")
    device = "cpu" if matmul.interpreter_is_on() else "cuda"
    a, b = torch.randn(64, 32, device=device), torch.randn(32, 48, device=device)
    # (On a GPU this float32 matmul would take the pointer kernel anyway: the TMA kernel is for 16-bit ones.)
    assert matmul._tma_operands(a, b, None, None) is not None or device == "cuda"
    assert matmul._tma_operands(a.t().contiguous().t(), b, None, None) is None
    assert matmul._tma_operands(a, b, None, torch.empty(64, device=device)) is None
    assert matmul._tma_operands(torch.randn(64, 33, device=device)[:, :32], b, None, None) is None
    empty_k = torch.randn(64, 0, device=device), torch.randn(0, 48, device=device)
    assert matmul._tma_operands(*empty_k, None, None) is None  # an empty K: a descriptor has no zero-sized dim
    if device == "cpu":  # the routing as launched: the GELU epilogues take the TMA kernel too
        out, pre_activation = torch.empty(64, 48), torch.randn(64, 48)
        for epilogue in ("gelu", "gelu_saving_pre_activation", "gelu_backward"):
            assert matmul.plan_matmul(a, b, out, epilogue, pre_activation=pre_activation).tma


class _HopperMatrixStandIn:
    """What _tma_operands asks of a contiguous bfloat16 matrix on a Hopper GPU, for a CPU-only machine."""

    is_cuda = True

    def __init__(self, rows: int, columns: int):
        self.shape = (rows, columns)

    def get_device(self) -> int:
        return 0

    def stride(self) -> tuple[int, int]:
        return self.shape[1], 1

    def element_size(self) -> int:
        return 2

    def data_ptr(self) -> int:
        return 0


@pytest.mark.parametrize("rows", [1, 32, 64, 65, 8192])
def test_every_large_matmul_leaves_its_autotuner_a_tile_to_time(rows, monkeypatch):
    """On a Hopper GPU a large 16-bit matmul is autotuned over the tiles that fit it, on the TMA kernel
    (128-row tiles) or the pointer kernel (down to 64 rows). A decode step's 32 tokens through GPT-2's LM
    head (32 × 768 by 768 × 50304) fit no TMA tile: they must take the pointer kernel, or its autotuner has
    no candidate left (generation at batch 32 failed so)."""
    matmul = importlib.import_module("triton_kernels.matmul")
    monkeypatch.setattr(matmul, "interpreter_is_on", lambda: False)
    monkeypatch.setattr(matmul, "_has_tma", lambda device_index: True)
    tma = matmul._tma_operands(_HopperMatrixStandIn(rows, 768), _HopperMatrixStandIn(768, 50304), None, None)
    assert (tma is not None) == (rows > 64)
    autotuned = matmul._matmul_tma_autotuned if tma is not None else matmul._matmul_autotuned
    assert matmul._tiles_worth_timing(autotuned.configs, {"M": rows, "N": 50304})


def test_the_level_4_matmul_refuses_row_sums_it_has_no_programs_for():
    """An (M, 0) product launches no program, so nothing would sum A's M rows: an error, not zeros."""
    matmul = importlib.import_module("triton_kernels.matmul")
    a, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(M, N\) = \(4, 0\)"):
        matmul.launch_matmul(a, b, row_sums=torch.empty(4, dtype=torch.float64))


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_a_linear_layer_without_input_features_still_gets_its_bias_gradient(level, device):
    """x·Wᵀ + b with no input features is b on every row, and b's gradient is Σ_rows grad_y, although the
    weight gradient's matmul is empty."""
    backend = NAMESPACES[level][1]()
    x = torch.randn(5, 0, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(3, 0, dtype=torch.float64, device=device, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, device=device, requires_grad=True)
    grad_y = torch.randn(5, 3, dtype=torch.float64, device=device)
    backend.linear(x, weight, bias).backward(grad_y)
    torch.testing.assert_close(bias.grad, grad_y.sum(dim=0))
    assert weight.grad.shape == (3, 0) and x.grad.shape == (5, 0)


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_feed_forward_takes_transposed_weights_and_returns_their_gradients_in_that_layout(level, device):
    """GPT-2's Conv1D stores (in, out): levels.huggingface passes the transposed view. The op must read it
    in place and give its gradient the view's strides, so autograd accumulates it without a copy."""
    backend = NAMESPACES[level][1]()
    x = torch.randn(5, 7, dtype=torch.float64, device=device)
    stored = [torch.randn(7, 11, dtype=torch.float64, device=device, requires_grad=True),  # (in, out), as Conv1D
              torch.randn(11, 7, dtype=torch.float64, device=device, requires_grad=True)]
    fc_bias, proj_bias = (torch.randn(n, dtype=torch.float64, device=device) for n in (11, 7))
    fc_weight, proj_weight = (weight.t() for weight in stored)
    gradients = torch.autograd.grad(backend.feed_forward(x, fc_weight, fc_bias, proj_weight, proj_bias).square().sum(),
                                    (fc_weight, proj_weight))
    assert [g.stride() for g in gradients] == [fc_weight.stride(), proj_weight.stride()]
    expected = torch.autograd.grad(backend.feed_forward(x, fc_weight.contiguous(), fc_bias, proj_weight.contiguous(),
                                                        proj_bias).square().sum(), stored)
    for gradient, reference in zip(gradients, expected):
        torch.testing.assert_close(gradient, reference.t())


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_linear_cross_entropy_passes_float64_gradcheck_over_several_chunks(level, device):
    backend = NAMESPACES[level][1]()
    hidden = torch.randn(7, 5, dtype=torch.float64, device=device, requires_grad=True)
    weight = torch.randn(11, 5, dtype=torch.float64, device=device, requires_grad=True)
    targets = torch.tensor([0, 10, -100, 3, 3, 7, 1], device=device)
    for chunk_rows in (0, 3):  # one chunk; three chunks, the last one short
        assert torch.autograd.gradcheck(lambda h, w: backend.linear_cross_entropy(h, w, targets, -100, chunk_rows),
                                        (hidden, weight), fast_mode=True)


def op_samples(namespace, device, dtype):
    """(op name, args) for every op of a backend, on fresh random tensors."""
    x = torch.randn(6, 37, device=device, dtype=dtype)
    weight = torch.randn(37, device=device, dtype=dtype)
    bias = torch.randn(37, device=device, dtype=dtype)
    grad = torch.randn(6, 37, device=device, dtype=dtype)
    statistics_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v, attention_grad = (torch.randn(2, 3, 19, 16, device=device, dtype=dtype) for _ in range(4))
    attention_args = (True, 5, 0.25)  # causal, window, scale
    out, log_sum_exp = getattr(torch.ops, namespace).attention_forward(q, k, v, *attention_args)
    # Grouped-query attention (4 query heads over 2 kv heads) at a head dim that is no tile width.
    grouped_q, grouped_grad = (torch.randn(1, 4, 11, 24, device=device, dtype=dtype) for _ in range(2))
    grouped_k, grouped_v = (torch.randn(1, 2, 13, 24, device=device, dtype=dtype) for _ in range(2))
    grouped_out, grouped_lse = getattr(torch.ops, namespace).attention_forward(grouped_q, grouped_k, grouped_v,
                                                                              *attention_args)
    # Heads of one fused (batch, tokens, 3, heads, head_dim) projection: their gradients come back tokens first.
    fused_projection = torch.randn(2, 19, 3, 3, 16, device=device, dtype=dtype)
    fused_q, fused_k, fused_v = (part.transpose(1, 2) for part in fused_projection.unbind(2))
    fused_out, fused_lse = getattr(torch.ops, namespace).attention_forward(fused_q, fused_k, fused_v, *attention_args)
    fc_weight, fc_bias = torch.randn(29, 37, device=device, dtype=dtype), torch.randn(29, device=device, dtype=dtype)
    proj_weight, proj_bias = torch.randn(37, 29, device=device, dtype=dtype), torch.randn(37, device=device, dtype=dtype)
    ops = getattr(torch.ops, namespace)
    _, pre_activation, activation = ops.feed_forward_forward(x, fc_weight, fc_bias, proj_weight, proj_bias)
    targets = torch.tensor([3, 28, 0, -100, 11, 7], device=device)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    mean = x.to(statistics_dtype).mean(-1)
    rstd = torch.rsqrt(x.to(statistics_dtype).var(-1, unbiased=False) + 1e-5)
    rms_rstd = torch.rsqrt(x.to(statistics_dtype).square().mean(-1) + 1e-6)
    samples = [
        ("swish_forward", (x.clone().requires_grad_(True), 1.5)),
        ("swish_backward", (grad, x, 1.5)),
        ("layer_norm_forward", (x.clone().requires_grad_(True), weight.clone().requires_grad_(True),
                                bias.clone().requires_grad_(True), 1e-5)),
        ("layer_norm_backward", (grad, x, weight, mean, rstd)),
        ("rms_norm_forward", (x.clone().requires_grad_(True), weight.clone().requires_grad_(True), 1e-6)),
        ("rms_norm_backward", (grad, x, weight, rms_rstd)),
        ("softmax_forward", (x.clone().requires_grad_(True),)),
        ("softmax_backward", (grad, torch.softmax(x, -1))),
        # The row-wise ops take x as it comes, (..., N): its leading dims are the rows.
        ("layer_norm_forward", (x.view(2, 3, 37).clone().requires_grad_(True), weight, bias, 1e-5)),
        ("layer_norm_backward", (grad.view(2, 3, 37), x.view(2, 3, 37), weight, mean, rstd)),
        ("rms_norm_forward", (x.view(2, 3, 37).clone().requires_grad_(True), weight, 1e-6)),
        ("rms_norm_backward", (grad.view(2, 3, 37), x.view(2, 3, 37), weight, rms_rstd)),
        ("softmax_forward", (x.view(3, 2, 37).clone().requires_grad_(True),)),
        ("softmax_backward", (grad.view(3, 2, 37), torch.softmax(x, -1).view(3, 2, 37))),
        ("attention_forward", (q.clone().requires_grad_(True), k.clone().requires_grad_(True),
                               v.clone().requires_grad_(True), *attention_args)),
        ("attention_backward", (attention_grad, q, k, v, out, log_sum_exp, *attention_args)),
        ("attention_forward", (grouped_q.clone().requires_grad_(True), grouped_k.clone().requires_grad_(True),
                               grouped_v.clone().requires_grad_(True), *attention_args)),
        ("attention_backward", (grouped_grad, grouped_q, grouped_k, grouped_v, grouped_out, grouped_lse,
                                *attention_args)),
        ("attention_backward", (attention_grad, fused_q, fused_k, fused_v, fused_out, fused_lse, *attention_args)),
        ("linear_forward", (x.clone().requires_grad_(True), fc_weight.clone().requires_grad_(True),
                            fc_bias.clone().requires_grad_(True))),
        ("linear_forward", (x, fc_weight, None)),
        ("linear_backward", (torch.randn(6, 29, device=device, dtype=dtype), x, fc_weight)),
        ("feed_forward_forward", tuple(t.clone().requires_grad_(True)
                                       for t in (x, fc_weight, fc_bias, proj_weight, proj_bias))),
        ("feed_forward_backward", (grad, x, fc_weight, proj_weight, pre_activation, activation)),
        # The LM head + loss: 6 tokens of width 37 over 29 classes, one ignored; with and without gradients.
        ("linear_cross_entropy_forward", (x.clone().requires_grad_(True), fc_weight.clone().requires_grad_(True),
                                          targets, -100, True)),
        ("linear_cross_entropy_forward", (x, fc_weight, targets, -100, False)),
        ("linear_cross_entropy_backward", (torch.rand((), device=device, dtype=loss_dtype), x, fc_weight)),
        # AdamW updates its lists in place (no gradient: the optimizer calls it under torch.no_grad).
        ("adamw_step", ([weight.clone(), x.clone()], [bias, grad], [weight.clone(), x.clone()],
                        [weight.abs(), x.abs()], 1e-2, 0.9, 0.99, 1e-8, 0.1, 3)),
        ("decode_attention", (q[:, :, :1].contiguous(), k[:, :, :1].contiguous(), v[:, :, :1].contiguous(), k.clone(),
                              v.clone(), torch.tensor([19, 4], dtype=torch.int32, device=device), 5, 0.25)),
        ("decode_attention", (grouped_q[:, :, :1].contiguous(), grouped_k[:, :, :1].contiguous(),
                              grouped_v[:, :, :1].contiguous(), grouped_k.clone(), grouped_v.clone(),
                              torch.tensor([13], dtype=torch.int32, device=device), 0, 0.25)),
    ]
    if namespace == "cuda_kernels":
        # Level 5's linear and feed-forward take x as the model holds it, (..., features): tokens in its leading
        # dims. (Level 4's launchers take the (tokens, features) matrix.)
        samples += [
            ("linear_forward", (x.view(2, 3, 37).clone().requires_grad_(True), fc_weight, fc_bias)),
            ("linear_backward", (torch.randn(2, 3, 29, device=device, dtype=dtype), x.view(2, 3, 37), fc_weight)),
            ("feed_forward_forward", (x.view(3, 2, 37).clone().requires_grad_(True), fc_weight, fc_bias, proj_weight,
                                      proj_bias)),
            ("feed_forward_backward", (grad.view(3, 2, 37), x.view(3, 2, 37), fc_weight, proj_weight, pre_activation,
                                       activation)),
        ]
    return samples


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_every_op_passes_opcheck(level, device):
    namespace, load = NAMESPACES[level]
    load()
    for op_name, args in op_samples(namespace, device, torch.float32):
        op = getattr(getattr(torch.ops, namespace), op_name).default
        torch.library.opcheck(op, args)


@pytest.mark.skipif(shutil.which("c++") is None or shutil.which("gcc") is None, reason="needs gcc's drivers")
@pytest.mark.parametrize("wrapper", [
    '#!/bin/sh\nexec {cxx} -static-libstdc++ "$@"\n',   # copies libstdc++ in
    '#!/bin/sh\nexec {gcc} "$@"\n',                       # links as C: no C++ runtime at all
])
def test_a_compiler_that_does_not_link_the_shared_cxx_runtime_is_not_used(wrapper, tmp_path, monkeypatch):
    # Either way the extension carried C++ runtime code of its own, never initialised, and the first
    # TORCH_CHECK message crashed the process (seen on the H100 machine).
    from cuda_kernels import ops

    script = tmp_path / "cxx-wrapper"
    script.write_text(wrapper.format(cxx=shutil.which("c++"), gcc=shutil.which("gcc")))
    script.chmod(0o755)
    assert not ops._links_the_shared_cxx_runtime(str(script))
    assert ops._links_the_shared_cxx_runtime(shutil.which("c++"))
    monkeypatch.setenv("CXX", str(script))
    compiler, why = ops._cxx_compiler_for_the_extension()
    assert compiler != str(script) and "shared C++ runtime" in why
    monkeypatch.delenv("CXX")
    assert ops._cxx_compiler_for_the_extension() == ("c++", None)


def test_a_hopper_gpu_gets_the_sm_90a_target_and_every_other_gpu_its_own(monkeypatch):
    # wgmma and TMA exist only in sm_90a; once we name one arch, PyTorch names none, so we name them all.
    from cuda_kernels import ops

    capabilities = {0: (9, 0), 1: (8, 0)}
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capabilities[device])
    assert ops._cuda_arch_flags() == ["-DKERNEL_LADDER_SM90A", "-gencode=arch=compute_80,code=sm_80",
                                      "-gencode=arch=compute_90a,code=sm_90a"]
    capabilities[0] = (8, 6)
    assert ops._cuda_arch_flags() == []  # no Hopper GPU: PyTorch's own choice
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")  # the user's list stays in charge
    assert ops._cuda_arch_flags() == ["-DKERNEL_LADDER_SM90A"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert ops._cuda_arch_flags() == []


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_version_of_the_level_5_swish_matches_float64_reference(dtype):
    from levels.swish import swish_cuda_versions

    x = torch.randn(4099, 33, device="cuda", dtype=dtype)  # a ragged tail for every pack width
    expected = levels.float64_reference(levels.build("swish", "cuda", beta=1.3))(x.double())
    for name, module in swish_cuda_versions(beta=1.3).items():
        error = levels.relative_max_error(module.cuda()(x), expected)
        assert error <= levels.TOLERANCE[dtype], f"{name}: relative error {error:.2e}"
        torch.library.opcheck(torch.ops.cuda_kernels.swish_forward_version.default, (x, 1.3, module.version))


def test_swish_versions_are_cuda_kernels_and_number_one_to_three():
    from cuda_kernels import ops

    with pytest.raises(NotImplementedError, match="the versions are CUDA kernels"):
        ops.swish_version(torch.randn(8), 1.0, 2)
    with pytest.raises(ValueError, match="version 4 does not exist"):
        ops.swish_version(torch.randn(8), 1.0, 4)
