"""Level 4's way to its kernels. ``triton_kernels.launch.launch``: the first call per specialization goes
through Triton's JIT, later ones straight to the compiled kernel's launcher with the same arguments,
and anything Triton would specialize on differently goes back through the JIT. And a contiguous
input (and gradient) reaches the kernels as it is, never copied on the way.

No GPU is needed: the JIT's run is replaced by a recorder that returns a stand-in CompiledKernel whose
launcher records its arguments, and PyTorch's current device and stream by stand-ins that name device 0
and stream 7."""

import importlib
import inspect
import re
import types

import pytest
import torch

import levels

from .conftest import level_devices
from .helpers import assert_matches_float64_reference, build_pair, make_inputs

pytest.importorskip("triton")
launch_module = importlib.import_module("triton_kernels.launch")
replay = importlib.import_module("triton_kernels.replay")
import triton  # noqa: E402  (after triton_kernels, which decides whether the interpreter runs)
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TRITON_DEVICE = level_devices("triton")[0]
"""Where level 4's kernels really run, for the tests below that launch them rather than a recorder: the GPU
when there is one (Triton's interpreter, the only way its kernels take CPU tensors, is then off), else the
CPU through the interpreter."""


def _scale_kernel(X, Y, n, scale, BLOCK: tl.constexpr, COMPUTE: tl.constexpr):
    pass


class Recorder:
    def __init__(self):
        self.jit_calls, self.launches = [], []
        self.compiled = object.__new__(triton.compiler.CompiledKernel)
        self.compiled._run = lambda *arguments: self.launches.append(arguments)
        self.compiled.function, self.compiled.packed_metadata = "function", "metadata"
        self.compiled.module = None  # (nothing loaded: CompiledKernel.__del__ has nothing to unload)

    def jit_run(self, *args, grid, warmup, **kwargs):
        self.jit_calls.append((grid, args, kwargs))
        return self.compiled


@pytest.fixture
def kernel(monkeypatch):
    """A compiled-mode JITFunction (even where the interpreter is on) whose JIT path is recorded."""
    kernel = JITFunction(_scale_kernel)
    kernel.recorder = Recorder()
    monkeypatch.setattr(kernel, "run", kernel.recorder.jit_run)
    monkeypatch.setattr(launch_module, "INTERPRETING", False)
    monkeypatch.setattr(launch_module, "DIRECT_LAUNCH", True)
    monkeypatch.setattr(launch_module, "_current_cuda_device", lambda: 0)
    monkeypatch.setattr(launch_module, "_current_raw_stream", lambda device: 7)
    monkeypatch.setattr(launch_module, "_compiled_kernels", {})
    return kernel


def call(kernel, x, y, n=4096, scale=0.5, block=1024, grid=(4,)):
    launch_module.launch(kernel, grid, x, y, n, scale, BLOCK=block, COMPUTE=tl.float32, num_warps=4)


def test_repeat_calls_skip_the_jit_and_pass_every_parameter_in_order(kernel):
    x, y = torch.zeros(4096), torch.zeros(4096)
    call(kernel, x, y)
    assert len(kernel.recorder.jit_calls) == 1 and not kernel.recorder.launches
    call(kernel, x, y, scale=2.0, grid=(3, 2))  # a new scalar value of the same type: the same kernel
    assert len(kernel.recorder.jit_calls) == 1
    assert kernel.recorder.launches == [(3, 2, 1, 7, "function", "metadata", None, None, None,
                                         x, y, 4096, 2.0, 1024, tl.float32)]


@pytest.mark.parametrize("change", [
    {"x": "misaligned"},  # a view 4 bytes into its storage: no longer a multiple of 16
    {"x": "float64"},
    {"n": 1},  # Triton makes an int equal to 1 a constant
    {"n": 4097},  # no longer a multiple of 16
    {"n": 2**40},  # 64-bit
    {"block": 512},  # a constexpr
])
def test_anything_triton_specializes_on_goes_back_through_the_jit(kernel, change):
    x, y = torch.zeros(4097)[:4096], torch.zeros(4096)
    call(kernel, x, y)
    if change.get("x") == "misaligned":
        x = torch.zeros(4097)[1:]
    elif change.get("x") == "float64":
        x = x.double()
    call(kernel, x, y, n=change.get("n", 4096), block=change.get("block", 1024))
    assert len(kernel.recorder.jit_calls) == 2 and not kernel.recorder.launches


def test_ints_of_one_specialization_share_a_kernel(kernel):
    x, y = torch.zeros(4096), torch.zeros(4096)
    call(kernel, x, y, n=4097)
    call(kernel, x, y, n=33)  # neither 1 nor a multiple of 16, 32 bits: as 4097
    assert len(kernel.recorder.jit_calls) == 1 and len(kernel.recorder.launches) == 1


def test_a_knob_the_jit_folds_into_its_options_changes_the_key(kernel, monkeypatch):
    x, y = torch.zeros(4096), torch.zeros(4096)
    call(kernel, x, y)
    monkeypatch.setattr(triton.knobs.runtime, "debug", True)  # TRITON_DEBUG: a different kernel
    call(kernel, x, y)
    assert len(kernel.recorder.jit_calls) == 2 and not kernel.recorder.launches


def test_the_key_holds_every_option_this_tritons_jit_adds_from_its_knobs():
    # JITFunction.run writes them into its kwargs, one `kwargs["name"] = ...` line each.
    added = set(re.findall(r'kwargs\["(\w+)"\] = ', inspect.getsource(JITFunction.run)))
    assert added == {name for _, name in launch_module._OPTION_KNOBS}


def test_switched_off_or_hooked_calls_always_take_the_jit(kernel, monkeypatch):
    x, y = torch.zeros(4096), torch.zeros(4096)
    call(kernel, x, y)
    monkeypatch.setattr(launch_module, "DIRECT_LAUNCH", False)
    call(kernel, x, y)
    monkeypatch.setattr(launch_module, "DIRECT_LAUNCH", True)
    hook = lambda metadata: None  # noqa: E731  (a profiler's launch hook)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        call(kernel, x, y)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.recorder.jit_calls) == 3 and not kernel.recorder.launches
    call(kernel, x, y)
    assert len(kernel.recorder.launches) == 1


@pytest.mark.parametrize("kernels", ["pointers", "tma"])
def test_an_autotuned_matmul_asks_the_autotuner_once_per_key_then_launches_its_choice(monkeypatch, kernels):
    """Both kernels: the TMA kernel where each operand's outer stride is a multiple of 16 bytes (B's rows
    100 floats apart), the pointer kernel where it is not (101 floats)."""
    matmul = importlib.import_module("triton_kernels.matmul")
    tma = kernels == "tma"
    if tma and not matmul.interpreter_is_on():
        pytest.skip("with a GPU the TMA kernel takes CUDA tensors only; these launches are stubbed CPU ones")
    autotuned, kernel = ((matmul._matmul_tma_autotuned, matmul._matmul_tma_kernel) if tma
                         else (matmul._matmul_autotuned, matmul._matmul_kernel))
    chosen = matmul.TENSOR_CORE_TILES[1]
    launched = []

    def record(kernel, grid, *args, **constants):
        launched.append((kernel, grid, constants))
        if kernel is autotuned:  # what Autotuner.run leaves behind once it has chosen
            config = triton.Config(dict(BLOCK_M=chosen.block_m, BLOCK_N=chosen.block_n, BLOCK_K=chosen.block_k),
                                   num_warps=chosen.num_warps, num_stages=chosen.num_stages)
            monkeypatch.setattr(kernel, "best_config", config, raising=False)

    monkeypatch.setattr(matmul, "launch", record)
    monkeypatch.setattr(matmul, "_tile_choice", lambda dtype, rows, columns, depth: None)  # every matmul "large"
    monkeypatch.setattr(matmul, "_tuned_tiles", {})
    a, b = torch.randn(300, 32), torch.randn(32, 100 if tma else 101)[:, :100]
    b_transposed = torch.randn(100, 32 if tma else 33)[:, :32].t()  # columns 32 (or 33) floats apart
    matmul.launch_matmul(a, b)
    matmul.launch_matmul(a, b)
    matmul.launch_matmul(a, b_transposed)  # b transposed in memory: another key, tuned anew
    assert [kernel for kernel, _, _ in launched] == [autotuned, kernel, autotuned]
    _, grid, constants = launched[1]
    assert grid == (2 * 1,)  # 300 rows in tiles of 256, 100 columns in one of 128 (fewer than 4 programs)
    assert {name: constants[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")} == dict(
        zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), chosen))
    if tma:
        assert (constants["B_TRANSPOSED"], launched[2][2]["B_TRANSPOSED"]) == (False, True)


# --- no hidden copies ---------------------------------------------------------------------------------

LEVEL_CASES = [
    ("swish", {}, [(2, 16)]),
    ("layer_norm", {"normalized_shape": 16}, [(2, 16)]),
    ("rms_norm", {"normalized_shape": 16}, [(2, 16)]),
    ("softmax", {}, [(2, 16)]),
    ("attention", {"causal": True}, [(1, 2, 1, 16), (1, 2, 8, 16), (1, 2, 8, 16)]),
    ("feed_forward", {"n_embd": 16}, [(1, 2, 16)]),
]


@pytest.fixture
def kernel_arguments(monkeypatch):
    """The addresses of every tensor the interpreter's kernels are launched with, as they are launched."""
    from triton.runtime.interpreter import InterpretedFunction

    addresses = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        addresses.update(arg.data_ptr() for arg in args if isinstance(arg, torch.Tensor))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    return addresses


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches (no GPU present)")
@pytest.mark.parametrize("component,config,shapes", LEVEL_CASES, ids=[case[0] for case in LEVEL_CASES])
def test_contiguous_inputs_and_gradients_reach_the_kernels_uncopied(component, config, shapes, kernel_arguments):
    addresses = kernel_arguments
    module = levels.build(component, "triton", **config)
    inputs = [torch.randn(shape, requires_grad=True) for shape in shapes]
    grad = torch.randn(shapes[0])
    module(*inputs).backward(grad)
    assert {x.data_ptr() for x in inputs} | {grad.data_ptr()} <= addresses


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's launches (no GPU present)")
def test_the_heads_of_a_fused_projection_and_their_gradient_reach_the_attention_kernels_uncopied(kernel_arguments):
    """Self-attention's q, k, v are strided views of one projection, and the gradient of the output reaches
    the attention as a strided view of the merged heads' gradient: level 4 reads them where they lie. Its
    output is laid out so that merging the heads is a view."""
    qkv = torch.randn(2, 8, 3, 2, 16, requires_grad=True)  # (batch, tokens, q k v, heads, head_dim)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    out = levels.build("attention", "triton", causal=True)(q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    grad = torch.randn(2, 8, 2, 16).transpose(1, 2)  # (batch, heads, tokens, head_dim) over (batch, tokens, ...)
    out.backward(grad)
    assert {q.data_ptr(), k.data_ptr(), v.data_ptr(), grad.data_ptr()} <= kernel_arguments


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's device and dtypes (no GPU present)")
def test_launchers_refuse_other_devices_and_dtypes_by_name():
    from cuda_kernels.limits import LevelUnavailableError

    swish = importlib.import_module("triton_kernels").swish
    with pytest.raises(LevelUnavailableError, match="got a tensor on meta"):
        swish(torch.randn(4, device="meta"), 1.0)
    # The interpreter has no 16-bit arithmetic; the GPU's kernels take every float dtype, and no integer.
    unsupported, supported = ((torch.float16, "float32, float64") if TRITON_DEVICE == "cpu"
                              else (torch.int32, "float16, bfloat16, float32, float64"))
    refusal = f"got dtype {str(unsupported).removeprefix('torch.')}; on {TRITON_DEVICE} it supports: {supported}"
    with pytest.raises(TypeError, match=refusal):
        swish(torch.randn(4, device=TRITON_DEVICE).to(unsupported), 1.0)
    layer_norm = importlib.import_module("triton_kernels").layer_norm
    with pytest.raises(LevelUnavailableError, match="got a tensor on meta"):
        layer_norm(torch.randn(2, 4, device=TRITON_DEVICE), torch.randn(4, device="meta"),
                   torch.randn(4, device=TRITON_DEVICE), 1e-5)


# --- work done once per input signature -----------------------------------------------------------------


def test_attention_forward_checks_and_plans_a_signature_once_and_every_new_one_again(monkeypatch):
    """A training or decode loop calls the forward with one signature every step: checked and planned once
    (attention_forward.forward_launch), it launches from the kept plan after that. Any change of shape,
    stride, dtype, mask or scale is a new signature, checked again; operands copied to be readable are
    copied at every call, never kept."""
    attention_forward = importlib.import_module("triton_kernels.attention_forward")
    checked = []
    check = attention_forward.checked_readable_inputs
    monkeypatch.setattr(attention_forward, "checked_readable_inputs",
                        lambda *args: checked.append(args[0].shape) or check(*args))
    monkeypatch.setattr(attention_forward, "_FORWARD_LAUNCHES", attention_forward.SignatureTable())
    q, k, v = (torch.randn(1, 2, 8, 16, device=TRITON_DEVICE) for _ in range(3))
    first, _ = attention_forward.launch_attention_fwd(q, k, v, True, 0, 0.25)
    again, _ = attention_forward.launch_attention_fwd(q, k, v, True, 0, 0.25)
    assert len(checked) == 1 and torch.equal(first, again)
    attention_forward.launch_attention_fwd(q, k, v, True, 0, 0.5)  # another scale
    attention_forward.launch_attention_fwd(q, k, v, False, 0, 0.25)  # another mask
    assert len(checked) == 3
    with pytest.raises(RuntimeError, match="causal attention with 8 queries but only 4 keys"):
        attention_forward.launch_attention_fwd(q, k[:, :, :4], v[:, :, :4], True, 0, 0.25)
    # head_dim values 16 apart: copied to be read
    odd_view = torch.randn(1, 2, 16, 8, device=TRITON_DEVICE).transpose(2, 3)
    for _ in range(2):
        out, _ = attention_forward.launch_attention_fwd(q, odd_view, v, False, 0, 0.25)
    assert len(checked) == 6 and torch.allclose(out, attention_forward.launch_attention_fwd(
        q, odd_view.contiguous(), v, False, 0, 0.25)[0])


def test_attention_forward_serves_a_growing_kv_cache_from_one_plan(monkeypatch):
    """A decode loop's keys and values grow by a token a step: only the key length and the k, v strides
    change, and attention_forward.forward_launch fills them into the plan it kept instead of checking and
    planning again. Every step matches float64; a step whose k and v disagree, or a causal step with fewer
    keys than queries, is checked in full and refused."""
    attention_forward = importlib.import_module("triton_kernels.attention_forward")
    checked = []
    check = attention_forward.checked_readable_inputs
    monkeypatch.setattr(attention_forward, "checked_readable_inputs",
                        lambda *args: checked.append(args[1].shape[2]) or check(*args))
    for table in ("_FORWARD_LAUNCHES", "_GROWING_KEYS_LAUNCHES"):
        monkeypatch.setattr(attention_forward, table, attention_forward.SignatureTable())
    q = torch.randn(1, 2, 1, 16, device=TRITON_DEVICE)
    keys, values = torch.randn(1, 2, 5, 16, device=TRITON_DEVICE), torch.randn(1, 2, 5, 16, device=TRITON_DEVICE)
    for _ in range(4):  # the cache grows as GrowingCacheDecoder's does: concatenated, contiguous
        keys, values = (torch.cat((cache, torch.randn(1, 2, 1, 16, device=TRITON_DEVICE)), 2)
                        for cache in (keys, values))
        out, _ = attention_forward.launch_attention_fwd(q, keys, values, True, 0, 0.25)
        # One query, aligned to the end of the keys, sees them all.
        expected = torch.softmax(q.double() @ keys.double().transpose(2, 3) * 0.25, -1) @ values.double()
        assert levels.relative_max_error(out, expected) <= levels.TOLERANCE[torch.float32]
    assert checked == [6]  # planned at the first step only
    with pytest.raises(RuntimeError, match="shapes do not fit together"):
        attention_forward.launch_attention_fwd(q, keys, values[:, :, :-1], True, 0, 0.25)
    with pytest.raises(RuntimeError, match="causal attention with 3 queries but only 2 keys"):
        q3 = torch.randn(1, 2, 3, 16, device=TRITON_DEVICE)
        attention_forward.launch_attention_fwd(q3, keys, values, True, 0, 0.25)  # plans (1, 2, 3, 16)
        attention_forward.launch_attention_fwd(q3, keys[:, :, :2], values[:, :, :2], True, 0, 0.25)


@pytest.mark.parametrize("head_dim,slices,tile", [
    (64, (64, 0), (128, 64, 8, 3)),
    (72, (128, 0), (128, 64, 8, 3)),  # a 64 + 16 split, 8 columns masked, read past shared memory
    (80, (64, 16), (64, 64, 4, 3)),
    (88, (128, 0), (128, 64, 8, 3)),  # likewise 64 + 32 with 8 masked
    (96, (64, 32), (128, 64, 4, 3)),
    (112, (128, 0), (128, 64, 8, 3)),  # 64 + 64 is no narrower than the padded 128
    (136, (128, 16), (128, 64, 8, 2)),
    (176, (128, 64), (128, 64, 8, 2)),
])
def test_the_forward_splits_a_head_dim_only_where_its_kernel_stays_in_its_shared_memory(head_dim, slices, tile):
    """attention_tiles.head_dim_slices: two power-of-two column slices where they are narrower than the
    padded tile, except behind a 64-column slice whose second is not full (72 and 88: compute-sanitizer found
    invalid shared-memory reads there on an H200). And the 16-bit tile each head dim's forward launches."""
    attention_tiles = importlib.import_module("triton_kernels.attention_tiles")
    attention_forward = importlib.import_module("triton_kernels.attention_forward")
    assert attention_tiles.head_dim_slices(head_dim) == slices
    assert tuple(attention_forward.forward_tile(head_dim, torch.bfloat16)) == tile


def test_a_level_checks_each_new_attention_signature_after_one_has_passed():
    """Levels 4 and 5 keep the last signature of (q, k, v) that passed their checks, and compare the next
    call's to it: a call whose shapes, dtypes or devices differ is checked in full. A key length that grows
    passes without (a decode loop's KV cache), unless k and v disagree on it or it falls short of causal
    attention's queries."""
    attention = levels.build("attention", "triton", causal=True)
    q = torch.randn(1, 2, 8, 16, device=TRITON_DEVICE)
    attention(q, q, q)
    grown = torch.randn(1, 2, 9, 16, device=TRITON_DEVICE)
    expected = levels.build("attention", "native", causal=True)(*(t.double() for t in (q, grown, grown)))
    assert levels.relative_max_error(attention(q, grown, grown), expected) <= levels.TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="shapes do not fit together"):
        attention(q, grown, torch.randn(1, 2, 10, 16, device=TRITON_DEVICE))
    with pytest.raises(ValueError, match="causal attention with 8 queries but only 4 keys"):
        attention(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(ValueError, match="shapes do not fit together"):
        attention(q, q, torch.randn(1, 2, 8, 8, device=TRITON_DEVICE))
    with pytest.raises(TypeError, match="q, k and v must share dtype"):
        attention(q, q, q.double())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        attention(q, q, None)
    with pytest.raises(ValueError, match="head_dim"):
        attention(*(torch.randn(1, 2, 8, 12, device=TRITON_DEVICE) for _ in range(3)))


def test_a_norm_forward_checks_and_plans_a_signature_once_and_every_new_one_again(monkeypatch):
    """LayerNorm's and RMSNorm's forward keep a row kernel's launch per signature (layer_norm.launch_norm_fwd):
    the second call with one signature is not checked again; another eps, weight, dtype or shape is."""
    layer_norm = importlib.import_module("triton_kernels.layer_norm")
    checked = []
    check = layer_norm.check_norm_shapes
    monkeypatch.setattr(layer_norm, "check_norm_shapes", lambda op, x, **kw: checked.append(op) or check(op, x, **kw))
    monkeypatch.setattr(layer_norm, "_NORM_FORWARD_LAUNCHES", layer_norm.SignatureTable())
    x = torch.randn(4, 16, device=TRITON_DEVICE)
    weight, bias = (torch.randn(16, device=TRITON_DEVICE) for _ in range(2))
    first = layer_norm.launch_norm_fwd("layer_norm_forward", x, weight, bias, 1e-5, True)
    again = layer_norm.launch_norm_fwd("layer_norm_forward", x, weight, bias, 1e-5, True)
    assert checked == ["layer_norm_forward"] and all(torch.equal(a, b) for a, b in zip(first, again))
    layer_norm.launch_norm_fwd("layer_norm_forward", x, weight, bias, 1e-3, True)  # another eps
    y, mean, rstd = layer_norm.launch_norm_fwd("rms_norm_forward", x, weight, None, 1e-5, False)  # RMSNorm, no stats
    assert len(checked) == 3 and mean is None and rstd is None
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight)
    with pytest.raises(RuntimeError, match="weight is \\(8,\\) torch.float32, expected \\(16,\\)"):
        layer_norm.launch_norm_fwd("layer_norm_forward", x, weight[:8], bias, 1e-5, True)
    with pytest.raises(RuntimeError, match="bias is \\(16,\\) torch.float64"):
        layer_norm.launch_norm_fwd("layer_norm_forward", x, weight, bias.double(), 1e-5, True)


@pytest.fixture
def split_rows(monkeypatch):
    """launch.py's settings lowered so that (3, 5000) rows are split across programs in slices of 1024, even
    under the interpreter; row_tile's answers, which depend on them, are cleared before and after."""
    for name, value in {"SPLIT_MIN_ROW": 4096, "SPLIT_MAX_ROWS_PER_SM": 4, "SPLIT_BLOCK": 1024}.items():
        monkeypatch.setattr(launch_module, name, value)
    launch_module.row_tile.cache_clear()
    yield
    launch_module.row_tile.cache_clear()


@pytest.mark.parametrize("bias", [True, False], ids=["layer_norm", "rms_norm"])
def test_a_norm_forward_over_split_rows_is_planned_once_too(bias, split_rows, monkeypatch):
    """Rows split across programs (layer_norm_split.SplitNormForwardLaunch) are kept per signature like a row
    kernel's launch: the second call is not checked or planned again, and both match float64."""
    layer_norm = importlib.import_module("triton_kernels.layer_norm")
    checked = []
    check = layer_norm.check_norm_shapes
    monkeypatch.setattr(layer_norm, "check_norm_shapes", lambda op, x, **kw: checked.append(op) or check(op, x, **kw))
    monkeypatch.setattr(layer_norm, "_NORM_FORWARD_LAUNCHES", layer_norm.SignatureTable())
    x = torch.randn(3, 5000, device=TRITON_DEVICE, dtype=torch.float64)  # 3 rows of 5 slices: "split"
    weight, shift = (torch.randn(5000, device=TRITON_DEVICE, dtype=torch.float64) for _ in range(2))
    op, bias_or_none = ("layer_norm_forward", shift) if bias else ("rms_norm_forward", None)
    centered = x - x.mean(-1, keepdim=True) if bias else x
    rstd = torch.rsqrt(centered.pow(2).mean(-1) + 1e-5)
    expected = centered * rstd[:, None] * weight + (shift if bias else 0)
    assert launch_module.row_strategy(3, 5000, x, cooperative=True, loop_in_l2=True) == "split"
    calls = [layer_norm.launch_norm_fwd(op, x, weight, bias_or_none, 1e-5, True) for _ in range(2)]
    assert checked == [op]
    [plan] = layer_norm._NORM_FORWARD_LAUNCHES.values()
    assert isinstance(plan, importlib.import_module("triton_kernels.layer_norm_split").SplitNormForwardLaunch)
    for y, mean, kept_rstd in calls:
        torch.testing.assert_close(y, expected)
        torch.testing.assert_close(kept_rstd, rstd)
        assert (mean is None) == (not bias)


@pytest.mark.parametrize("bias", [True, False], ids=["layer_norm", "rms_norm"])
def test_a_norm_backward_over_split_rows_is_planned_once_too(bias, split_rows, monkeypatch):
    """The backward over rows split across programs (layer_norm_backward.SplitNormBackwardRows) is kept per
    signature like the row kernel's: the second call plans neither the split nor its column reduction
    again, and both calls' gradients match float64 autograd."""
    backward = importlib.import_module("triton_kernels.layer_norm_backward")
    layer_norm = importlib.import_module("triton_kernels.layer_norm")
    monkeypatch.setattr(layer_norm, "_NORM_FORWARD_LAUNCHES", layer_norm.SignatureTable())
    monkeypatch.setattr(backward, "_NORM_BACKWARD_LAUNCHES", backward.SignatureTable())
    planned = []
    for name in ("_column_reduction_plan", "row_strategy"):
        original = getattr(backward, name)
        monkeypatch.setattr(backward, name, lambda *args, _original=original, _name=name, **kw:
                            planned.append(_name) or _original(*args, **kw))
    x = torch.randn(3, 5000, device=TRITON_DEVICE, dtype=torch.float64)  # 3 rows of 5 slices: "split"
    weight, shift = (torch.randn(5000, device=TRITON_DEVICE, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn_like(x)
    op = "layer_norm_forward" if bias else "rms_norm_forward"
    _, mean, rstd = layer_norm.launch_norm_fwd(op, x, weight, shift if bias else None, 1e-5, True)
    calls = [backward.launch_norm_bwd_unchecked(grad_out, x, weight, mean, rstd) for _ in range(2)]
    assert planned == ["row_strategy", "_column_reduction_plan"]
    [plan] = backward._NORM_BACKWARD_LAUNCHES.values()
    assert isinstance(plan, backward.SplitNormBackwardRows)
    inputs = [tensor.detach().clone().requires_grad_() for tensor in (x, weight, shift)]
    if bias:
        expected = torch.nn.functional.layer_norm(inputs[0], (5000,), inputs[1], inputs[2], 1e-5)
    else:
        expected = torch.nn.functional.rms_norm(inputs[0], (5000,), inputs[1], 1e-5)
    expected.backward(grad_out)
    for grad_x, grad_weight, grad_bias in calls:
        torch.testing.assert_close(grad_x, inputs[0].grad)
        torch.testing.assert_close(grad_weight, inputs[1].grad)
        if bias:
            torch.testing.assert_close(grad_bias, inputs[2].grad)
        else:
            assert grad_bias is None


def test_a_norm_backward_plans_a_signature_once_and_each_norm_and_shape_again(monkeypatch):
    """LayerNorm's and RMSNorm's backward keep the row kernel's launch per signature
    (layer_norm_backward.launch_norm_bwd_unchecked): a repeat call is not planned again and still matches
    the float64 reference; the other norm, another shape or another dtype is planned anew."""
    backward = importlib.import_module("triton_kernels.layer_norm_backward")
    planned = []
    plan = backward._plan_norm_bwd_rows
    monkeypatch.setattr(backward, "_plan_norm_bwd_rows", lambda x, *args: planned.append((x.dtype, *args)) or plan(x, *args))
    monkeypatch.setattr(backward, "_NORM_BACKWARD_LAUNCHES", backward.SignatureTable())
    for component in ("layer_norm", "rms_norm"):
        for dtype in (torch.float32, torch.float64):
            module, reference = build_pair(component, "triton", {"normalized_shape": 16}, TRITON_DEVICE, dtype)
            for rows in (4, 4, 64, 64):  # 64 rows: several programs, their partial buffers and the column sums
                inputs = make_inputs(module, (rows, 16), dtype, TRITON_DEVICE)
                assert_matches_float64_reference(module, reference, inputs, levels.TOLERANCE[dtype])
    assert planned == [(dtype, rows, 16, subtract_mean) for subtract_mean in (True, False)
                       for dtype in (torch.float32, torch.float64) for rows in (4, 64)]


def test_softmax_plans_a_signature_once_forward_and_backward_and_each_shape_and_dtype_again(monkeypatch):
    """Softmax's launchers keep a row kernel's launch per signature (softmax.SoftmaxLaunch): a repeat call is
    neither checked nor planned again and still matches the float64 reference, forward and backward; another
    shape or dtype is planned anew, and rows that loop over their blocks keep the looped kernel's launch."""
    softmax = importlib.import_module("triton_kernels.softmax")
    planned = []
    strategy = softmax.row_strategy
    monkeypatch.setattr(softmax, "row_strategy", lambda rows, n, *args: planned.append((rows, n)) or
                        strategy(rows, n, *args))
    monkeypatch.setattr(softmax, "_SOFTMAX_LAUNCHES", softmax.SignatureTable())
    # Rows past the forward's one-array tile, looped over both ways (on a GPU too: no cooperative grid, no split)
    looped = launch_module.MAX_ONE_ARRAY_ROW_BLOCK + 3
    monkeypatch.setattr(launch_module, "COOPERATIVE_ROWS", False)
    monkeypatch.setattr(launch_module, "SPLIT_MIN_ROW", 2 * looped)
    for dtype in (torch.float32, torch.float64):
        module, reference = build_pair("softmax", "triton", {"dim": -1}, TRITON_DEVICE, dtype)
        for shape in ((5, 37), (5, 37), (2, looped), (2, looped)):
            inputs = make_inputs(module, shape, dtype, TRITON_DEVICE)
            assert_matches_float64_reference(module, reference, inputs, levels.TOLERANCE[dtype])
    # each new (shape, dtype) planned once forward and once backward
    assert planned == [(rows, n) for dtype in (torch.float32, torch.float64) for rows, n in ((5, 37), (2, looped))
                       for _ in ("forward", "backward")]
    kernels = {plan.kernel.fn.__name__ for plan in softmax._SOFTMAX_LAUNCHES.values()}
    assert kernels == {"_softmax_fwd_kernel", "_softmax_bwd_kernel", "softmax_fwd_online_kernel",
                       "_softmax_bwd_looped_kernel"}


def test_the_linear_and_feed_forward_launchers_plan_a_signature_once_and_a_new_layout_again(monkeypatch):
    """Level 4's linear and feed-forward launchers, forward and backward, keep their matmuls' launches per
    signature (feed_forward._LINEAR_FORWARD_LAUNCHES and its three siblings): a repeat call plans nothing
    (and the forwards check it no more); an input that starts off 16 bytes (which the TMA kernel cannot
    read), more rows or no bias is planned anew, and every call matches float64."""
    feed_forward = importlib.import_module("triton_kernels.feed_forward")
    planned = []
    plan = feed_forward.plan_matmul
    monkeypatch.setattr(feed_forward, "plan_matmul", lambda a, b, out, epilogue="none", *tensors, **named:
                        planned.append(epilogue) or plan(a, b, out, epilogue, *tensors, **named))
    for table in ("_LINEAR_FORWARD_LAUNCHES", "_FEED_FORWARD_FORWARD_LAUNCHES", "_LINEAR_BACKWARD_LAUNCHES",
                  "_FEED_FORWARD_BACKWARD_LAUNCHES"):
        monkeypatch.setattr(feed_forward, table, feed_forward.SignatureTable())
    weight, bias = torch.randn(24, 16, device=TRITON_DEVICE), torch.randn(24, device=TRITON_DEVICE)
    off_16_bytes = torch.randn(5 * 16 + 1, device=TRITON_DEVICE)[1:].view(5, 16)  # 4 bytes past an aligned start
    five_rows, seven_rows = torch.randn(5, 16, device=TRITON_DEVICE), torch.randn(7, 16, device=TRITON_DEVICE)
    for x, w, b in ((five_rows, weight, bias), (five_rows.clone(), weight, bias), (off_16_bytes, weight, bias),
                    (seven_rows, weight, bias), (five_rows.clone(), weight, None)):
        expected = x.double() @ w.double().t() + (0 if b is None else b.double())
        torch.testing.assert_close(feed_forward.launch_linear_fwd(x, w, b), expected.float())
    assert len(planned) == 4  # the repeat planned nothing
    proj_weight, proj_bias = torch.randn(16, 24, device=TRITON_DEVICE), torch.randn(16, device=TRITON_DEVICE)
    planned.clear()
    for save in (True, True, False, False):
        x = torch.randn(5, 16, device=TRITON_DEVICE)
        out, pre_activation, activation = feed_forward.launch_feed_forward_fwd(x, weight, bias, proj_weight, proj_bias,
                                                                                save_for_backward=save)
        hidden = x.double() @ weight.double().t() + bias.double()
        expected = torch.nn.functional.gelu(hidden, approximate="tanh") @ proj_weight.double().t() + proj_bias.double()
        torch.testing.assert_close(out, expected.float())
        assert (pre_activation is not None) == save
    assert planned == ["gelu_saving_pre_activation", "none", "gelu", "none"]
    planned.clear()
    for has_bias in (True, True, False):  # the backwards: a repeat plans nothing; without biases, anew
        x, grad_out = (torch.randn(5, width, dtype=torch.float64, device=TRITON_DEVICE) for width in (16, 24))
        w = weight.double()
        grads = feed_forward.launch_linear_bwd_unchecked(grad_out, x, w, has_bias)
        for got, expected in zip(grads, (grad_out @ w, grad_out.t() @ x, grad_out.sum(0) if has_bias else None)):
            assert (got is None) == (expected is None) and (got is None or torch.allclose(got, expected))
    assert planned == ["none", "none"] * 2
    planned.clear()
    for has_bias in (True, True, False):
        x, grad_out = (torch.randn(5, 16, dtype=torch.float64, device=TRITON_DEVICE) for _ in range(2))
        fc_w, proj_w = weight.double(), proj_weight.double()
        h = x @ fc_w.t()
        a = torch.nn.functional.gelu(h, approximate="tanh")
        grads = feed_forward.launch_feed_forward_bwd_unchecked(grad_out, x, fc_w, proj_w, h, a, has_bias)
        h_ = h.clone().requires_grad_()
        torch.nn.functional.gelu(h_, approximate="tanh").backward(grad_out @ proj_w)
        expected = (h_.grad @ fc_w, h_.grad.t() @ x, h_.grad.sum(0) if has_bias else None, grad_out.t() @ a,
                    grad_out.sum(0) if has_bias else None)
        for got, wanted in zip(grads, expected):
            assert (got is None) == (wanted is None) and (got is None or torch.allclose(got, wanted))
    assert planned == ["gelu_backward", "none", "none", "none"] * 2


def test_attention_backward_plans_a_signature_once_and_a_new_gradient_layout_again(monkeypatch):
    monkeypatch.setattr(replay, "REPLAY", False)  # the Python backward's own plans (a replayed call has none)
    attention_backward = importlib.import_module("triton_kernels.attention_backward")
    planned = []
    plan = attention_backward._plan_backward
    monkeypatch.setattr(attention_backward, "_plan_backward", lambda *args: planned.append(1) or plan(*args))
    monkeypatch.setattr(attention_backward, "_BACKWARD_LAUNCHES", attention_backward.SignatureTable())
    attention = levels.build("attention", "triton", causal=True)
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True, device=TRITON_DEVICE) for _ in range(3))
    grads = []
    merged_heads_view = torch.randn(1, 8, 2, 16, device=TRITON_DEVICE).transpose(1, 2)
    for grad_out in (torch.randn(1, 2, 8, 16, device=TRITON_DEVICE), merged_heads_view):
        for _ in range(2):
            q.grad = k.grad = v.grad = None
            attention(q, k, v).backward(grad_out)
            grads.append([t.grad for t in (q, k, v)])
    assert len(planned) == 2  # one plan per layout of the output's gradient
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))


def test_a_signature_table_starts_again_once_full():
    table = importlib.import_module("triton_kernels.launch").SignatureTable(most=2)
    assert table.keep("a", 1) == 1 and table.keep("b", 2) == 2
    table.keep("c", 3)
    assert table == {"c": 3}


# --- calls replayed from C++ (triton_kernels/replay.py) -------------------------------------------------

# What the stand-in CompiledKernel says about itself, as Triton's would: its parameters' types (constexprs
# included), its launch metadata, and its PTX entry (the four arguments, then Triton's two scratch pointers).
_SCALE_SIGNATURE = {"X": "*fp32", "Y": "*fp32", "n": "i32", "scale": "fp32", "BLOCK": "constexpr", "COMPUTE": "constexpr"}
_SCALE_PTX = """.visible .entry _scale_kernel(
	.param .u64 .ptr .global .align 1 _scale_kernel_param_0,
	.param .u64 .ptr .global .align 1 _scale_kernel_param_1,
	.param .u32 _scale_kernel_param_2,
	.param .f32 _scale_kernel_param_3,
	.param .u64 .ptr .global .align 1 _scale_kernel_param_4,
	.param .u64 .ptr .global .align 1 _scale_kernel_param_5
)"""


@pytest.fixture
def compiled_scale_kernel(kernel):
    compiled = kernel.recorder.compiled
    compiled.function = 0xF00D
    compiled.src = type("Source", (), {"signature": _SCALE_SIGNATURE})()
    compiled.metadata = type("Metadata", (), {"num_warps": 4, "shared": 512, "num_ctas": 1})()
    compiled.asm = {"ptx": _SCALE_PTX}
    return kernel


def _bits(value: float) -> int:
    return int.from_bytes(torch.tensor([value], dtype=torch.float32).numpy().tobytes(), "little")


def test_a_pass_of_allocations_and_launches_is_recorded_slot_by_slot(compiled_scale_kernel):
    x = torch.randn(64)
    with replay.Recorder([x, 0.5]) as forward:  # the arguments' slots; the float has none
        out = torch.empty_like(x)
        statistics = x.new_empty((8, 8))
        call(compiled_scale_kernel, x, out, n=64, scale=1.5, grid=(4,))  # through the JIT
        call(compiled_scale_kernel, out, statistics, n=64, scale=-2.0, grid=(2, 3))  # straight to the launcher
    record = forward.forward_record(out, [x, statistics])
    assert not isinstance(record, replay.Refused), record
    allocations, views, launches, output_slot, saved_slots = record
    assert allocations == [[6, 0, 1, 64, 1], [6, 0, 2, 8, 8, 8, 1]]  # c10::ScalarType Float, not zero-filled, dims,
    # sizes, strides
    assert views == []
    aligned = replay._ALIGNED_TENSOR
    scratch = [replay._BITS64, 0, replay._BITS64, 0]
    assert launches == [
        [0xF00D, 4, 1, 1, 128, 512, 0, aligned, 0, aligned, 2, replay._BITS32, 64, replay._BITS32, _bits(1.5), *scratch],
        [0xF00D, 2, 3, 1, 128, 512, 0, aligned, 2, aligned, 3, replay._BITS32, 64, replay._BITS32, _bits(-2.0), *scratch],
    ]
    assert (output_slot, saved_slots) == (2, [0, 3])
    grad = torch.randn(64)
    with replay.Recorder([grad, x, statistics]) as backward:
        grad_x = torch.empty_like(x)
        call(compiled_scale_kernel, grad, grad_x, n=64, grid=(4,))
    assert backward.backward_record((grad_x, None))[3] == [3, -1]


def test_views_are_recorded_as_slots_of_their_own(compiled_scale_kernel):
    """A kernel reading a transposed weight, a slice of a buffer as a kernel's pointer, an output returned as a
    view of a buffer: each view is a slot, named by the slot it was taken of, its offset, sizes and strides."""
    weight = torch.randn(8, 4)
    with replay.Recorder([weight]) as forward:
        buffer = weight.new_empty_strided((4, 16), (1, 4))  # a column-major allocation
        call(compiled_scale_kernel, weight.t(), buffer, n=32, grid=(1,))  # the weight's view at its own address
        call(compiled_scale_kernel, weight, buffer.t().view(64)[32:], n=32, grid=(1,))  # 32 elements in
        out = buffer.t()
    allocations, views, launches, output_slot, saved_slots = forward.forward_record(out, [weight])
    assert allocations == [[6, 0, 2, 4, 16, 1, 4]]
    assert views == [[0, 0, 2, 4, 8, 1, 4],  # slot 2: weight.t()
                     [1, 0, 2, 16, 4, 4, 1],  # 3: buffer.t()
                     [3, 0, 1, 64, 1],  # 4: its view(64)
                     [4, 32, 1, 32, 1],  # 5: that one's slice
                     [1, 0, 2, 16, 4, 4, 1]]  # 6: buffer.t() again, the output
    assert [row[10] for row in launches] == [1, 5]  # each launch's second pointer: the buffer, then the slice
    assert launches[0][8] == 2 and launches[1][8] == 0  # the first pointer: weight.t() (by identity), weight
    assert (output_slot, saved_slots) == (6, [0])


def test_a_kernel_that_asks_for_global_scratch_gets_it_per_launch(compiled_scale_kernel):
    """Triton's launcher hands such a kernel (a TMA descriptor built on the device) so many bytes a program in
    its first scratch pointer: the plan asks the C++ op for the same, for the recorded grid."""
    compiled_scale_kernel.recorder.compiled.metadata.global_scratch_size = 128
    x = torch.randn(64)
    with replay.Recorder([x]) as recorder:
        out = torch.empty_like(x)
        call(compiled_scale_kernel, x, out, n=64, grid=(4, 2))
    launch_row = recorder.forward_record(out, [])[2][0]
    assert launch_row[-4:] == [replay._SCRATCH, 128 * 4 * 2, replay._BITS64, 0]


@pytest.mark.parametrize("case", ["a buffer filled with ones", "a gradient that is a view of an argument",
                                  "a buffer seen as another dtype", "a PTX of other parameters",
                                  "a kernel through the JIT"])
def test_a_pass_the_op_could_not_replay_exactly_keeps_its_python(compiled_scale_kernel, monkeypatch, case):
    grad, saved = torch.randn(64), torch.randn(64)
    if case == "a PTX of other parameters":  # e.g. a Triton that passes one scratch pointer fewer, as 32 bits
        compiled_scale_kernel.recorder.compiled.asm = {
            "ptx": _SCALE_PTX.replace(".u64 .ptr .global .align 1 _scale_kernel_param_5", ".u32 _scale_kernel_param_5")}
    if case == "a kernel through the JIT":
        monkeypatch.setattr(launch_module, "DIRECT_LAUNCH", False)
    with replay.Recorder([grad, saved]) as recorder:
        buffer = torch.ones_like(saved) if case == "a buffer filled with ones" else torch.empty(64)
        written = buffer.view(torch.int32) if case == "a buffer seen as another dtype" else buffer
        call(compiled_scale_kernel, grad, written, n=64, grid=(4,))
        gradient = grad.view(64) if case == "a gradient that is a view of an argument" else buffer
    assert isinstance(recorder.backward_record((gradient, None)), replay.Refused)


class _OccupancyDriver:
    """The CUDA driver's occupancy query, answering ``per_multiprocessor`` programs an SM."""

    def __init__(self, per_multiprocessor: int):
        self.per_multiprocessor = per_multiprocessor

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, count, function, threads, shared_bytes):
        count._obj.value = self.per_multiprocessor
        return 0


@pytest.mark.parametrize("programs_at_once", [3, 64], ids=["too-few-rows-fit", "every-row-fits"])
def test_a_cooperative_grid_is_recorded_as_a_cooperative_launch_over_zeroed_counters(compiled_scale_kernel, monkeypatch,
                                                                                     programs_at_once):
    """``launch_cooperative`` asks how many programs fit at once (the driver's occupancy, once per key), compiling
    the kernel with the counters' dtype standing in for them: asking allocates nothing. A grid that would hold
    too few of its rows launches nothing, and the caller runs its two phases. A grid that launches is recorded
    as a cooperative launch whose row counters are a zero-filled allocation, which the C++ op fills again."""
    compiled = compiled_scale_kernel.recorder.compiled
    compiled.metadata.launch_cooperative_grid = True  # as launch_cooperative compiles it
    compiled._init_handles = lambda: None
    monkeypatch.setattr(launch_module, "_cuda_driver", lambda: _OccupancyDriver(programs_at_once))
    monkeypatch.setattr(launch_module, "_multiprocessor_count", lambda device: 1)
    monkeypatch.setattr(launch_module, "_cooperative_kernels", {})
    monkeypatch.setattr(launch_module, "_with_row_arrivals", lambda args, rows, device: tuple(
        torch.zeros(rows, dtype=torch.int32) if arg is launch_module.ROW_ARRIVALS else arg for arg in args))
    x = torch.randn(4 * 16 * 1024)
    with replay.Recorder([x]) as recorder:  # 4 rows of 16 slices: all 4 must fit at once (64 programs)
        launched = launch_module.launch_cooperative(compiled_scale_kernel, 4, 16, x, launch_module.ROW_ARRIVALS,
                                                    16 * 1024, 0.5, BLOCK=1024, COMPUTE=tl.float32)
    stand_in = compiled_scale_kernel.recorder.jit_calls[0][1][1]
    assert not isinstance(stand_in, torch.Tensor) and stand_in.dtype == torch.int32
    if programs_at_once == 3:
        assert not launched and not compiled_scale_kernel.recorder.launches and not recorder.allocations
        return
    assert launched and len(compiled_scale_kernel.recorder.launches) == 1
    allocations, _, launches, _ = recorder.backward_record(())  # the rows alone
    assert allocations == [[3, 1, 1, 4, 1]]  # int32, zero-filled, the 4 rows' counters
    assert launches[0][:9] == [0xF00D, 64, 1, 1, 128, 512, 1, replay._ALIGNED_TENSOR, 0]  # cooperative; x
    assert launches[0][9:11] == [replay._ALIGNED_TENSOR, 1]  # the counters


def test_a_pass_that_tuned_a_kernel_is_recorded_again_at_the_next_call(compiled_scale_kernel):
    """An autotuner's launch (a new key's first call, timing candidates) postpones the recording; a launch
    through the JIT otherwise refuses it."""
    autotuned = triton.autotune(configs=[triton.Config({"BLOCK": 1024})], key=["n"])(compiled_scale_kernel)
    x = torch.randn(64)
    with replay.Recorder([x]) as recorder:
        launch_module.launch(autotuned, (1,), x, torch.empty(64), 64, 0.5, COMPUTE=tl.float32)
    assert recorder.postponed and recorder.refusal is None
    with replay.Recorder([x]) as recorder:
        launch_module._tell_recorder("launched_through_jit", compiled_scale_kernel)
    assert not recorder.postponed and "through Triton's JIT" in recorder.refusal


def test_a_signature_tells_apart_what_a_recorded_launch_depends_on():
    square = torch.randn(64, 64)
    base = replay.signature([square, 1e-5])
    assert base == replay.signature([square.clone(), 1e-5])  # another tensor alike: the same plan
    for other in ([square.t(), 1e-5],  # strides (a launcher may pass them to its kernel as integers)
                  [square.double(), 1e-5], [square.detach().requires_grad_(), 1e-5],
                  [torch.randn(64 * 64 + 1)[1:].view(64, 64), 1e-5],  # 4 bytes past a multiple of 16
                  [square, 1e-6]):  # a scalar's value
        assert replay.signature(other) != base
    assert replay.signature([square, 0]) != replay.signature([square, 0.0])  # and its type


def _extension_ops():
    pytest.importorskip("cuda_kernels.ops")  # builds level 5's extension (the CPU one here)
    return torch.ops.cuda_kernels


_ALLOCATIONS_ONLY_PLAN = ([[6, 0, 2, 8, 4, 4, 1]], [[3, 0, 2, 4, 8, 1, 4]], [], 4, [0], [1, 4],
                         [[6, 0, 2, 8, 4, 4, 1], [6, 1, 1, 4, 1]], [], [], [2, 3, -1])
"""``make_triton_plan``'s arguments for a plan that launches nothing, so it runs on the CPU. Forward: slots x,
weight, eps, then out (8, 4) and its transpose (4, 8), returned; saved: x. Backward: grad (laid out as the
output), x, then grad_x and grad_weight, zero-filled."""


def test_a_replayed_call_is_an_output_whose_grad_fn_is_the_cpp_node():
    """The op's autograd, on the CPU with a plan of allocations only (no kernels to launch): the output, its
    node's edges, the gradient buffers, and PyTorch's own errors for a saved tensor changed in place, a
    second backward, a second derivative and a forgotten plan."""
    ops = _extension_ops()
    plan = _ALLOCATIONS_ONLY_PLAN
    number = ops.make_triton_plan.default(*plan)
    x, weight = torch.randn(8, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    out = ops.run_triton_plan.default(0, [x, weight], [1.0], number)
    assert out.shape == (4, 8) and out.stride() == (1, 4) and out.grad_fn.name() == "TritonBackward"
    assert [node.name() if node else None for node, _ in out.grad_fn.next_functions] == [
        "torch::autograd::AccumulateGrad", "torch::autograd::AccumulateGrad", None]
    out.backward(torch.ones(4, 8))  # contiguous: copied into the recorded layout
    assert x.grad.shape == (8, 4) and torch.equal(weight.grad, torch.zeros(4))  # zero-filled, and no kernel ran
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward(torch.ones(4, 8))
    with torch.no_grad():
        assert ops.run_triton_plan.default(0, [x, weight], [1.0], number).grad_fn is None
    y = x * 1.0
    out = ops.run_triton_plan.default(0, [y, weight], [1.0], number)
    y.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(torch.ones(4, 8))
    direction = torch.ones(4, 8, requires_grad=True)
    (first,) = torch.autograd.grad(ops.run_triton_plan.default(0, [x, weight], [1.0], number), x, direction, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        first.sum().backward()
    ops.release_triton_plan.default(number)
    with pytest.raises(RuntimeError, match="no plan number"):
        ops.run_triton_plan.default(0, [x, weight], [1.0], number)
    transposed_x = [0, 0, 2, 4, 8, 1, 4]  # a view of an argument: slot 5 after out's transpose
    for changes, message in [({3: 2}, "the output must be a forward allocation or a view of one"),
                             ({1: [transposed_x]}, "the output must be a forward allocation"),
                             ({1: [[5, 0, 2, 4, 8, 1, 4]]}, "a view of no earlier slot"),
                             ({1: [plan[1][0], transposed_x], 4: [5]}, "a saved slot must be an argument, a forward"),
                             ({9: [0, 3, -1]}, "a gradient must be a backward allocation"),
                             ({0: [[6, 2, 2, 8, 4, 4, 1]]}, "whether it is zero-filled"),
                             ({2: [[0, 1, 1, 1, 32, 0, 2]]}, "whether it is cooperative")]:
        with pytest.raises(RuntimeError, match=message):
            ops.make_triton_plan.default(*[changes.get(position, part) for position, part in enumerate(plan)])


def test_a_call_alike_finds_its_plan_in_cpp_and_any_other_call_does_not():
    """``run_known_triton_call``: after ``run_triton_plan`` ran a call, a call alike (same function, tensors
    alike in what a launch depends on, same numbers) runs the plan without Python; any other call gets None,
    and so does every call once Python released the plan."""
    ops = _extension_ops()
    number = ops.make_triton_plan.default(*_ALLOCATIONS_ONLY_PLAN)
    function = 1000 + number  # a function number no level-4 op has
    x, weight = torch.randn(8, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    assert ops.run_known_triton_call.default(function, [x, weight], [1.0]) is None  # not run yet
    ops.run_triton_plan.default(function, [x, weight], [1.0], number)
    out = ops.run_known_triton_call.default(function, [x.detach().clone().requires_grad_(), weight], [1.0])
    assert out.shape == (4, 8) and out.grad_fn.name() == "TritonBackward"
    out.backward(torch.ones(4, 8))
    unaligned = torch.randn(8 * 4 + 1)[1:].view(8, 4)
    for tensors, numbers, what in [([x, weight], [2.0], "another number"),
                                   ([x.detach(), weight], [1.0], "an argument that does not require grad"),
                                   ([x.t().contiguous().t(), weight], [1.0], "other strides"),
                                   ([x.double(), weight], [1.0], "another dtype"),
                                   ([unaligned.requires_grad_(), weight], [1.0], "another address modulo 16"),
                                   ([x, None], [1.0], "an absent tensor"),
                                   ([_escaped_functorch_wrapper(x), weight], [1.0], "a dead functorch wrapper")]:
        assert ops.run_known_triton_call.default(function, tensors, numbers) is None, what
    assert ops.run_known_triton_call.default(function + 1, [x, weight], [1.0]) is None  # another function
    ops.release_triton_plan.default(number)
    assert ops.run_known_triton_call.default(function, [x, weight], [1.0]) is None


def _escaped_functorch_wrapper(x: torch.Tensor) -> torch.Tensor:
    """What ``torch.func.grad`` made of ``x`` inside its transform, kept past it: a dead wrapper, which an op
    called outside the transform gets if user code hands it on."""
    inside = []
    torch.func.grad(lambda tensor: inside.append(tensor) or tensor.sum())(x.detach())
    return inside[0]


def test_a_signatures_first_call_and_backward_become_a_plan_and_its_next_call_the_op(compiled_scale_kernel,
                                                                                      monkeypatch):
    """The whole path through ``eager.EagerFunction``, on the CPU: the first call is recorded, the signature
    waits for a backward, the backward is recorded and the plan made by level 5's extension; the next call
    goes to the C++ op (which, handed CPU tensors and kernels to launch, says so)."""
    ops = _extension_ops()
    monkeypatch.setattr(replay, "REPLAY", True)
    monkeypatch.setattr(replay, "_extension", replay.cpp_ops)
    eager = importlib.import_module("triton_kernels.eager")

    class ScaleEager(eager.EagerFunction):  # a level-4 op's shape: allocate, launch, save
        @staticmethod
        def forward(ctx, x, scale):
            out = torch.empty_like(x)
            call(compiled_scale_kernel, x, out, n=x.numel(), scale=scale)
            ctx.save_for_backward(x)
            ctx.scale = scale
            return out

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            grad_x = torch.empty_like(x)
            call(compiled_scale_kernel, grad, grad_x, n=x.numel(), scale=ctx.scale)
            return grad_x, None

    x = torch.randn(64, requires_grad=True)
    signature = replay.signature([x, 1.5])
    out = ScaleEager.call((x,), (1.5,))
    assert isinstance(ScaleEager._replay_plans[signature], replay.Pending)
    ScaleEager.call((x,), (1.5,))  # before any backward: the Python path, not recorded again
    assert len(compiled_scale_kernel.recorder.launches) + len(compiled_scale_kernel.recorder.jit_calls) == 2
    assert replay.plans()["ScaleEager"] == {"replayed": 0, "pending": 1, "refused": []}
    out.backward(torch.ones(64))
    assert x.grad.shape == (64,)
    assert isinstance(ScaleEager._replay_plans[signature], replay.Plan), ScaleEager._replay_plans[signature]
    assert replay.plans()["ScaleEager"] == {"replayed": 1, "pending": 0, "refused": []}
    with pytest.raises(RuntimeError, match="launches CUDA kernels; got tensors on cpu"):
        ScaleEager.call((x,), (1.5,))


def _node_names(output: torch.Tensor) -> set[str]:
    """The names of every node of ``output``'s autograd graph."""
    names, stack = set(), [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            names.add(node.name())
            stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _fresh_fwd_bwd_matches(module, reference, shape, dtype):
    """One forward+backward of fresh random inputs against the float64 reference (gradients zeroed first);
    returns the names of the nodes of a second forward's graph."""
    module.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    inputs = make_inputs(module, shape, dtype, "cuda")
    assert_matches_float64_reference(module, reference, inputs, levels.TOLERANCE[dtype])
    return _node_names(module(*(x.requires_grad_() for x in inputs)))


_REPLAYED = [("swish", {"beta": 1.3}, (8, 768)), ("layer_norm", {"normalized_shape": 768}, (64, 768)),
             ("layer_norm", {"normalized_shape": 96}, (1000, 96)), ("rms_norm", {"normalized_shape": 768}, (64, 768)),
             ("softmax", {"dim": -1}, (64, 1024)),
             # The output a (B, H, L, D) view of a (B, L, H, D) buffer, and q, k and v views of one projection:
             ("attention", {"causal": True}, (2, 4, 256, 64)), ("self_attention", {"n_embd": 768, "n_head": 12}, (2, 64, 768)),
             # Transposed weights; in bfloat16, matmuls large enough to be autotuned (a first call recorded again)
             # and, on Hopper, TMA kernels with global scratch:
             ("feed_forward", {"n_embd": 768}, (2, 512, 768))]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("component,config,shape", _REPLAYED,
                         ids=[f"{c}-{'x'.join(map(str, s))}" for c, _, s in _REPLAYED])
def test_a_signatures_later_calls_are_the_cpp_op_and_stay_right(component, config, shape, dtype, monkeypatch):
    module, reference = build_pair(component, "triton", config, "cuda", dtype)
    inputs = make_inputs(module, shape, dtype, "cuda")
    assert "TritonBackward" not in _node_names(module(*(x.requires_grad_() for x in inputs)))  # not recorded yet
    for _ in range(4):  # the first backward runs in Python and is recorded; fresh inputs each time after it
        names = _fresh_fwd_bwd_matches(module, reference, shape, dtype)
    assert "TritonBackward" in names, replay.plans()

    def python_signature(args):
        raise AssertionError("a call alike to a replayed one reached Python's lookup")

    monkeypatch.setattr(replay, "signature", python_signature)  # the C++ op finds the call's plan itself
    assert "TritonBackward" in _fresh_fwd_bwd_matches(module, reference, shape, dtype)


def _forget_recorded_plans():
    """Empty every eager op's replay plans, refusals included: a test that counts what Python does on the
    first calls of a signature must not find it recorded by an earlier test in the same worker."""
    for function in importlib.import_module("triton_kernels.eager").EagerFunction.__subclasses__():
        function._replay_plans.clear()


_LONG_ROWS = [("layer_norm", {"normalized_shape": 1 << 17}), ("rms_norm", {"normalized_shape": 1 << 17}),
              ("softmax", {"dim": -1})]


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["cooperative", "two phases"])
@pytest.mark.parametrize("component,config", _LONG_ROWS, ids=[component for component, _ in _LONG_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rows_too_long_for_one_program_are_replayed_over_either_grid(component, config, dtype, grid, monkeypatch):
    """Rows too long for one program ask for a cooperative grid. All four rows of 2^17 fit at once on any GPU
    of this course, and it launches: the C++ op zeroes its row counters and launches it cooperatively too.
    Where the GPU holds too few rows at once (here: forced), the forward and the backward run their two
    phases instead, and the C++ op replays those."""
    fitting_rows = launch_module._rows_at_once
    answers = []  # rows at once, as each call that asked for the grid was told (0: two phases)

    def rows_at_once(resident, rows, slices):
        answers.append(0 if grid == "two phases" else fitting_rows(resident, rows, slices))
        return answers[-1]

    monkeypatch.setattr(launch_module, "_rows_at_once", rows_at_once)
    _forget_recorded_plans()  # the other grid's test of this signature, run before in this worker, recorded it
    module, reference = build_pair(component, "triton", config, "cuda", dtype)
    for _ in range(4):
        names = _fresh_fwd_bwd_matches(module, reference, (4, 1 << 17), dtype)
    assert "TritonBackward" in names, replay.plans()
    assert answers and (all(answers) if grid == "cooperative" else not any(answers)), answers


@pytest.mark.gpu
def test_a_gpt_training_step_runs_every_level_4_op_but_the_loss_from_cpp():
    """Once a step's first calls and backwards are recorded, level 4's GPT runs its LayerNorms, projections,
    attention and feed-forwards from C++. The LM head + loss keeps its Python: it counts the targets that are
    not ignored and checks their range on the host, work and a wait the C++ op could not repeat."""
    tiny = importlib.import_module("levels.gpt").TINY
    _forget_recorded_plans()
    model = levels.build("gpt", "triton", **dict(tiny, block_size=32)).to("cuda")
    idx, targets = (torch.randint(0, tiny["vocab_size"], (2, 32), device="cuda") for _ in range(2))
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(idx, targets).backward()
    report = {name: entry for name, entry in replay.plans().items() if any(entry.values())}
    assert {name for name, entry in report.items() if entry["refused"]} == {"_LinearCrossEntropyEager"}, report
    for name in ("_LayerNormEager", "_LinearEager", "_AttentionEager", "_FeedForwardEager"):
        assert report[name]["replayed"] and not report[name]["pending"], report


@pytest.mark.gpu
def test_a_backward_that_runs_pytorch_ops_stays_in_python_and_right(monkeypatch):
    softmax = importlib.import_module("triton_kernels.softmax")
    launch_backward = softmax.launch_softmax_bwd_unchecked

    def with_a_pytorch_op(grad_out, y):
        torch.ones(1, device=y.device)  # work the node could not replay (a zero fill it could)
        return launch_backward(grad_out, y)

    monkeypatch.setattr(softmax, "launch_softmax_bwd_unchecked", with_a_pytorch_op)
    _forget_recorded_plans()  # a plan recorded without that op would replay it
    module, reference = build_pair("softmax", "triton", {"dim": -1}, "cuda", torch.float32)
    for _ in range(3):
        assert "TritonBackward" not in _fresh_fwd_bwd_matches(module, reference, (48, 520), torch.float32)


@pytest.mark.gpu
def test_switched_off_no_backward_is_replayed(monkeypatch):
    monkeypatch.setattr(replay, "REPLAY", False)
    module, reference = build_pair("layer_norm", "triton", {"normalized_shape": 200}, "cuda", torch.float32)
    for _ in range(3):
        assert "TritonBackward" not in _fresh_fwd_bwd_matches(module, reference, (24, 200), torch.float32)


def _replayed_layer_norm(shape=(32, 256), dtype=torch.float32):
    """A level-4 LayerNorm whose signature ``shape`` has been recorded, so its next backward is the C++ node."""
    module, reference = build_pair("layer_norm", "triton", {"normalized_shape": shape[-1]}, "cuda", dtype)
    _fresh_fwd_bwd_matches(module, reference, shape, dtype)
    return module, reference


@pytest.mark.gpu
def test_the_node_refuses_a_saved_tensor_changed_in_place_and_a_second_backward():
    module, _ = _replayed_layer_norm()
    x = (torch.randn(32, 256, device="cuda", requires_grad=True) * 1.0)  # not a leaf: may change in place
    out = module(x)
    assert "TritonBackward" in _node_names(out)
    x.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    out = module(torch.randn(32, 256, device="cuda", requires_grad=True))
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


@pytest.mark.gpu
def test_the_node_takes_a_gradient_at_an_unaligned_address():
    module, reference = _replayed_layer_norm(dtype=torch.bfloat16)
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(32 * 256 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(32, 256)  # 2 bytes in
    out = module(x)
    assert "TritonBackward" in _node_names(out)
    out.backward(grad_out)
    x64 = x.detach().double().requires_grad_()
    reference(x64).backward(grad_out.double())
    assert levels.relative_max_error(x.grad, x64.grad) <= levels.TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
def test_the_node_makes_a_second_derivative_raise():
    module, reference = _replayed_layer_norm()
    x = torch.randn(32, 256, device="cuda", requires_grad=True)
    direction = torch.randn_like(x, requires_grad=True)
    out = module(x)
    assert "TritonBackward" in _node_names(out)
    (first,) = torch.autograd.grad(out, x, direction, create_graph=True)
    x64 = x.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad(reference(x64), x64, direction.detach().double())
    assert levels.relative_max_error(first, expected) <= levels.TOLERANCE[torch.float32]
    with pytest.raises(RuntimeError, match="differentiate twice"):
        first.sum().backward()
