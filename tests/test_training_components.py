"""The two components a training step adds to the blocks: the LM head fused with its loss
(``linear_cross_entropy``) and the optimizer (``build_optimizer``: AdamW), at every level."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import levels
from levels import TOLERANCE, relative_max_error

from .conftest import device_dtype_params, level_devices

SMALL_HEAD = {"n_embd": 24, "vocab_size": 101}


def level_device_params():
    return [pytest.param(level, device, id=f"{level}-{device}", marks=[pytest.mark.gpu] if device == "cuda" else [])
            for level in levels.LEVELS for device in level_devices(level)]


# --- linear_cross_entropy ----------------------------------------------------------------------------


@pytest.mark.parametrize("level,device", level_device_params())
def test_a_batch_whose_every_target_is_ignored_has_loss_zero_and_zero_gradients(level, device):
    head = levels.build("linear_cross_entropy", level, **SMALL_HEAD).to(device)
    hidden = torch.randn(6, 24, device=device, requires_grad=True)
    loss = head(hidden, torch.full((6,), -100, device=device))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(hidden.grad, torch.zeros_like(hidden))
    assert torch.equal(head.weight.grad, torch.zeros_like(head.weight))


@pytest.mark.parametrize("level,device", level_device_params())
@pytest.mark.parametrize("bad_target", [101, -3])
def test_a_target_outside_the_vocabulary_names_it_and_the_range(level, device, bad_target):
    head = levels.build("linear_cross_entropy", level, **SMALL_HEAD).to(device)
    targets = torch.tensor([3, bad_target, -100, 7], device=device)
    with pytest.raises(ValueError, match=rf"{bad_target}.*\[0, .*101\)"):
        head(torch.randn(4, 24, device=device), targets)
    # Levels 4 and 5 raise after their kernels ran on the bad target: they read nothing outside its row,
    # so the device still computes (a fault would fail every later call on a GPU).
    good_targets = torch.tensor([3, 100, -100, 0], device=device)
    assert torch.isfinite(head(torch.randn(4, 24, device=device), good_targets)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["triton", "cuda"])
def test_the_fused_loss_reads_nothing_back_before_its_kernels_are_queued(level):
    """Levels 4 and 5 count the valid targets on the device and read their range only after queuing their
    kernels, from a copy that travels without stopping the host (OnTheWayToHost): no ``.item()``,
    ``.tolist()`` or ``.cpu()`` of a CUDA tensor, which PyTorch's sync debug mode turns into errors."""
    head = levels.build("linear_cross_entropy", level, **SMALL_HEAD).cuda()
    hidden = torch.randn(6, 24, device="cuda", requires_grad=True)
    targets = torch.tensor([3, 5, -100, 7, 100, 0], device="cuda")
    head(hidden, targets).backward()  # the first call compiles and tunes, which may wait
    torch.cuda.set_sync_debug_mode("error")
    try:
        head(hidden, targets).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("vocab_size,dtype,kernel", [
    (50304, torch.bfloat16, "cross_entropy_staged_rows_kernel"),  # GPT-2's rows, 100 KB: staged in shared memory
    (50304, torch.float32, "cross_entropy_rows_kernel"),  # 201 KB: longer than the staged kernel takes
    (101, torch.bfloat16, "cross_entropy_rows_kernel"),  # not whole 16-byte packs
])
def test_level_5s_loss_stages_the_rows_that_fit_in_shared_memory(vocab_size, dtype, kernel):
    """Which row kernel level 5 launches (linear_cross_entropy.cu): a GPT-2 row in bfloat16 read once into
    shared memory, rows too long or not in whole packs in two passes. Both compute the same loss, so only the
    kernel's name tells them apart."""
    head = levels.build("linear_cross_entropy", "cuda", n_embd=64, vocab_size=vocab_size).to("cuda", dtype)
    hidden = torch.randn(8, 64, device="cuda", dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab_size, (8,), device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        head(hidden, targets).backward()
        torch.cuda.synchronize()
    row_kernels = {event.key.split("<")[0].split("::")[-1] for event in profile.key_averages()
                   if "cross_entropy" in event.key and "rows_kernel" in event.key}
    assert row_kernels == {kernel}


@pytest.mark.parametrize("tokens,chunks", [(8192, 2), (12288, 3), (16384, 4), (65536, 13)])
def test_level_4_walks_gpt2s_tokens_in_equal_chunks_under_the_logits_budget(tokens, chunks):
    """Level 4's chunking (triton_kernels/linear_cross_entropy.py; level 5's C++ makes the same choice):
    the fewest chunks of at most LOGITS_PER_CHUNK logits, whole multiples of 128 rows, all but the last full.
    GPT-2's training steps (8192 and 16384 tokens) never hold their logits whole."""
    from triton_kernels.linear_cross_entropy import CHUNK_ROW_MULTIPLE, LOGITS_PER_CHUNK, choose_chunk_rows

    vocabulary = 50304
    rows = choose_chunk_rows(tokens, vocabulary)
    assert rows % CHUNK_ROW_MULTIPLE == 0
    assert (rows - CHUNK_ROW_MULTIPLE) * vocabulary < LOGITS_PER_CHUNK  # under the budget, but for rounding up
    assert -(-tokens // rows) == chunks
    assert choose_chunk_rows(300, 1000) == 300  # a small call is one chunk
    assert choose_chunk_rows(tokens, vocabulary, requested=64) == 64


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["triton", "cuda"])
def test_gpt2s_8192_token_step_runs_the_loss_in_two_chunks(level):
    """The row kernel runs once a chunk: the 8192-token step's logits (824 MB in bfloat16) in two chunks of 4096
    rows at levels 4 and 5 alike."""
    head = levels.build("linear_cross_entropy", level, n_embd=64, vocab_size=50304).to("cuda", torch.bfloat16)
    hidden = torch.randn(8192, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 50304, (8192,), device="cuda")
    head(hidden, targets).backward()  # compiles level 4's kernels outside the profile
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        head(hidden, targets).backward()
        torch.cuda.synchronize()
    row_kernel_launches = sum(event.count for event in profile.key_averages()
                              if "cross_entropy" in event.key and "rows_kernel" in event.key)
    assert row_kernel_launches == 2


@pytest.mark.parametrize("level", levels.LEVELS)
def test_targets_of_the_wrong_dtype_or_shape_are_refused(level):
    head = levels.build("linear_cross_entropy", level, **SMALL_HEAD)
    hidden = torch.randn(2, 3, 24)
    with pytest.raises(TypeError, match="int64"):
        head(hidden, torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        head(hidden, torch.zeros(6, dtype=torch.int64))
    with pytest.raises(ValueError, match="n_embd=24"):
        head(torch.randn(2, 3, 25), torch.zeros(2, 3, dtype=torch.int64))


def test_an_ignore_index_inside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="ignore_index=5"):
        levels.build("linear_cross_entropy", 1, n_embd=8, vocab_size=10, ignore_index=5)


@pytest.mark.parametrize("level,device", level_device_params())
def test_the_gpts_loss_is_the_cross_entropy_of_its_logits(level, device):
    config = {"vocab_size": 96, "n_layer": 1, "n_head": 2, "n_embd": 64, "block_size": 16}
    torch.manual_seed(0)
    native = levels.build("gpt", "native", **config)
    model = levels.build("gpt", level, **config)
    model.load_state_dict(native.state_dict())
    model.to(device)
    reference = native.to(device=device, dtype=torch.float64)
    assert model.lm_head.weight is model.wte.weight  # tied
    idx = torch.randint(0, 96, (2, 11), device=device)
    targets = torch.randint(0, 96, (2, 11), device=device)
    with torch.no_grad():
        loss = model(idx, targets)
        logits = reference(idx)
    expected = F.cross_entropy(logits.view(-1, 96), targets.view(-1))
    assert loss.dtype == torch.float32
    assert relative_max_error(loss, expected) <= TOLERANCE[torch.float32]


# --- AdamW ---------------------------------------------------------------------------------------------

# eps 1e-3, not AdamW's 1e-8: float16 holds nothing below 6e-8, so with a tiny eps a gradient whose
# square underflows divides its step by ~eps, in level 1 as anywhere, and the test would measure
# float16's range instead of the levels (the reason half-precision training keeps float32 moments).
HYPERPARAMETERS = {"lr": 1e-2, "betas": (0.8, 0.95), "eps": 1e-3, "weight_decay": 0.1}
SIZES = (1, 1000, 4099, 3 * 65537)  # one element; odd sizes; one tensor larger than any one block or chunk
VECTOR_SIZES = (8, 768, 4096, 3 * 65536)  # multiples of 16 bytes' worth in every dtype: the vectorised path
LAYOUTS = {  # (sizes, shift): the parameters' sizes, and how many elements into a buffer each one starts
    "odd sizes": (SIZES, 0),
    "16-byte multiples": (VECTOR_SIZES, 0),
    "16-byte multiples at unaligned addresses": (VECTOR_SIZES, 1),  # as slices of a buffer, FSDP's shards
}


def placed(tensor: torch.Tensor, shift: int) -> torch.Tensor:
    """``tensor``'s values in a buffer of their own, starting ``shift`` elements in."""
    buffer = torch.empty(tensor.numel() + shift, dtype=tensor.dtype, device=tensor.device)
    return buffer[shift:].copy_(tensor)


def run_steps(level, device, dtype, steps=5, seed=0, layout="odd sizes"):
    """The parameters after ``steps`` AdamW steps on fixed random gradients, from fixed random parameters
    laid out as ``LAYOUTS[layout]`` says."""
    sizes, shift = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(seed)
    initial = [torch.randn(size, generator=generator, dtype=torch.float64) for size in sizes]
    gradients = [[torch.randn(size, generator=generator, dtype=torch.float64) for size in sizes] for _ in range(steps)]
    params = [torch.nn.Parameter(placed(p.to(device=device, dtype=dtype), shift)) for p in initial]
    optimizer = levels.build_optimizer(level, params, **HYPERPARAMETERS)
    for step_gradients in gradients:
        for param, gradient in zip(params, step_gradients):
            param.grad = gradient.to(device=device, dtype=dtype)
        optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("level", levels.LEVELS)
def test_adamw_after_several_steps_matches_a_float64_level_1_run(level, layout):
    for device_dtype in device_dtype_params(level):
        device, dtype = device_dtype.values
        if device == "cuda" and not torch.cuda.is_available():
            continue
        params, _ = run_steps(level, device, dtype, layout=layout)
        expected, _ = run_steps("native", "cpu", torch.float64, layout=layout)
        for index, (actual, wanted) in enumerate(zip(params, expected)):
            error = relative_max_error(actual, wanted)
            assert error <= TOLERANCE[dtype], f"{device} {dtype} tensor {index}: {error:.2e}"


def test_adamw_level_1_is_torch_optim_adamw():
    params, _ = run_steps("native", "cpu", torch.float64)
    generator = torch.Generator().manual_seed(0)
    initial = [torch.randn(size, generator=generator, dtype=torch.float64) for size in SIZES]
    gradients = [[torch.randn(size, generator=generator, dtype=torch.float64) for size in SIZES] for _ in range(5)]
    reference = [torch.nn.Parameter(p) for p in initial]
    optimizer = torch.optim.AdamW(reference, foreach=False, **HYPERPARAMETERS)
    for step_gradients in gradients:
        for param, gradient in zip(reference, step_gradients):
            param.grad = gradient
        optimizer.step()
    for actual, wanted in zip(params, reference):
        assert relative_max_error(actual, wanted) <= TOLERANCE[torch.float64]


# Level 4 steps from a plan after its first step (levels/optimizer.py, AdamWTriton); each of these, done
# between two steps, must send the next one through the general step, which plans again.
def _replace_a_parameters_storage(optimizer, params, extra):
    params[0].data = params[0].data.clone()


def _replace_a_moment(optimizer, params, extra):
    optimizer.state[params[1]]["exp_avg"] = optimizer.state[params[1]]["exp_avg"].clone()


def _reset_a_parameters_state(optimizer, params, extra):
    optimizer.state[params[2]] = {}


def _edit_a_step_count(optimizer, params, extra):
    optimizer.state[params[0]]["step"] += 4


def _reload_the_state(optimizer, params, extra):
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))


def _add_a_parameter_group(optimizer, params, extra):
    optimizer.add_param_group({"params": [extra]})


def _append_a_parameter_to_a_group(optimizer, params, extra):
    optimizer.param_groups[0]["params"].append(extra)


def _halve_the_learning_rate(optimizer, params, extra):
    for group in optimizer.param_groups:
        group["lr"] /= 2


PLAN_DISRUPTIONS = {  # what is done; how many general steps a run then takes (the first one included)
    "a parameter's storage replaced": (_replace_a_parameters_storage, 2),
    "a moment replaced": (_replace_a_moment, 2),
    "load_state_dict": (_reload_the_state, 2),
    "a parameter group added": (_add_a_parameter_group, 2),
    "a gradient lost": (None, 2),
    "the learning rate halved": (_halve_the_learning_rate, 1),  # read from the group at every step
    # Parameters at different step counts are stepped apart by the general step, from then on.
    "a parameter's state reset": (_reset_a_parameters_state, 4),
    "a step count edited": (_edit_a_step_count, 4),
    "a gradient gained": (None, 4),
    "a parameter appended to a group": (_append_a_parameter_to_a_group, 4),
}
def run_disrupted_steps(level, disruption, dtype=torch.float32, steps=5, disrupt_before=3):
    """``steps`` AdamW steps at ``level`` on fixed random gradients, ``disruption`` done before step
    ``disrupt_before``. Returns the parameters, the optimizer and how many steps took the general path."""
    generator = torch.Generator().manual_seed(0)
    device = level_devices(level)[0]
    params = [torch.nn.Parameter(torch.randn(size, generator=generator, dtype=dtype).to(device)) for size in SIZES]
    extra = torch.nn.Parameter(torch.randn(7, generator=generator, dtype=dtype).to(device))
    optimizer = levels.build_optimizer(level, params, **HYPERPARAMETERS)
    updates = []  # the general step hands each group's lists to update(); a planned step does not
    update = optimizer.update
    optimizer.update = lambda *args: updates.append(1) or update(*args)
    action, _ = PLAN_DISRUPTIONS[disruption]
    general_steps = 0
    for step in range(1, steps + 1):
        after = step >= disrupt_before
        for index, param in enumerate([*params, extra]):
            trained = {"a gradient gained": index != 3 or after, "a gradient lost": index != 3 or not after}
            if trained.get(disruption, True):
                param.grad = torch.randn(param.shape, generator=generator, dtype=dtype).to(device)
            else:
                param.grad = None
        if step == disrupt_before and action is not None:
            action(optimizer, params, extra)
        updates.clear()
        optimizer.step()
        general_steps += bool(updates)
    return [*params, extra], optimizer, general_steps


@pytest.mark.parametrize("disruption", PLAN_DISRUPTIONS)
def test_a_planned_adamw_step_notices_what_changed_since_it_was_planned(disruption):
    params, optimizer, general_steps = run_disrupted_steps("triton", disruption)
    expected, reference, _ = run_disrupted_steps("native", disruption)
    assert general_steps == PLAN_DISRUPTIONS[disruption][1]
    for index, (actual, wanted) in enumerate(zip(params, expected)):
        assert relative_max_error(actual, wanted) <= TOLERANCE[torch.float32], f"parameter {index}"
        state, wanted_state = optimizer.state[actual], reference.state[wanted]
        assert state.keys() == wanted_state.keys(), f"parameter {index}"
        if state:
            assert state["step"] == wanted_state["step"], f"parameter {index}"
            for moment in ("exp_avg", "exp_avg_sq"):
                assert relative_max_error(state[moment], wanted_state[moment]) <= TOLERANCE[torch.float32], \
                    f"parameter {index} {moment}"


@pytest.mark.parametrize("gradient,error,message", [
    (lambda device: torch.randn(6, 4, device=device).t(), RuntimeError, "contiguous"),
    (lambda device: torch.randn(4, 6, device=device).to_sparse(), TypeError, "sparse"),
], ids=["not contiguous", "sparse"])
def test_a_planned_adamw_step_refuses_a_gradient_the_general_step_refuses(gradient, error, message):
    device = level_devices("triton")[0]
    params = [torch.nn.Parameter(torch.randn(4, 6, device=device)) for _ in range(2)]
    optimizer = levels.build_optimizer("triton", params)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    params[1].grad = gradient(device)
    with pytest.raises(error, match=message):
        optimizer.step()


def test_a_planned_adamw_step_over_two_dtypes_launches_once_per_dtype_and_matches_level_1():
    def run(level):
        generator = torch.Generator().manual_seed(0)
        dtypes = (torch.float32, torch.float64, torch.float32, torch.float64)
        params = [torch.nn.Parameter(torch.randn(size, generator=generator, dtype=dtype).to(level_devices(level)[0]))
                  for size, dtype in zip(SIZES, dtypes)]
        optimizer = levels.build_optimizer(level, params, **HYPERPARAMETERS)
        for _ in range(4):
            for param in params:
                param.grad = torch.randn(param.shape, generator=generator, dtype=param.dtype).to(param.device)
            optimizer.step()
        return params, optimizer

    params, optimizer = run("triton")
    expected, _ = run("native")
    assert sorted(indices for indices, *_ in optimizer._plans[0].launch._launches) == [[0, 2], [1, 3]]
    for actual, wanted in zip(params, expected):
        assert relative_max_error(actual, wanted) <= TOLERANCE[actual.dtype]


@pytest.mark.parametrize("level", levels.LEVELS)
def test_adamw_skips_parameters_without_a_gradient_and_counts_steps_per_parameter(level):
    device = level_devices(level)[0] if level == "triton" else "cpu"
    trained, frozen = (torch.nn.Parameter(torch.randn(10, device=device)) for _ in range(2))
    before = frozen.detach().clone()
    optimizer = levels.build_optimizer(level, [trained, frozen], lr=0.1)
    for _ in range(3):
        trained.grad = torch.randn_like(trained)
        optimizer.step()
    assert torch.equal(frozen, before) and frozen not in optimizer.state
    assert optimizer.state[trained]["step"] == 3
    assert optimizer.state[trained]["exp_avg"].dtype == trained.dtype


# Compiles level 4's AdamW kernel for an H100 (sm_90), aligned and not, in a fresh process that tells
# triton_kernels a GPU is present so that its kernels are compiled rather than interpreted (Triton compiles
# without a device), and prints, per variant, how many 16-byte and 2-byte global loads and stores one
# thread issues in bfloat16.
_COUNT_ADAMW_ACCESSES = """
import torch
torch.cuda.is_available = lambda: True
import triton.language as tl
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
except ImportError:
    raise SystemExit(3)  # a Triton whose ahead-of-time API lives elsewhere
from triton_kernels.adamw import _adamw_kernel as kernel
for aligned in (True, False):
    constants = {"BLOCK": 1024, "ELEMENT": tl.bfloat16, "COMPUTE": tl.float32, "ALIGNED": aligned, "VECTOR": 8}
    signature = {name: "constexpr" if name in constants else "*i32" if name == "Programs" else "*i64"
                 if name in ("Addresses", "GradAddresses", "Numels") else "i32" if name == "n_tensors" else "fp32"
                 for name in kernel.arg_names}
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constants.items()})
    ptx = compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    # Each instruction's opcode, its predicate ("@%p1") left out; cache hints (".L1::evict_last" and such)
    # may stand between its parts.
    opcodes = [next(word for word in line.split() if not word.startswith("@")) for line in ptx.splitlines()
               if "ld.global" in line or "st.global" in line]
    print(*(sum(opcode.startswith(kind) and width in opcode.split(".") for opcode in opcodes)
            for kind, width in (("ld.global", "v4"), ("st.global", "v4"), ("ld.global", "b16"), ("st.global", "b16"))))
"""


def test_level_4_adamw_moves_16_bytes_a_thread_when_its_tensors_are_aligned():
    """A hint on an address read from a table must reach the loads: with it, each thread moves a parameter's
    eight bfloat16 values in one 16-byte load (4 tensors read, 3 written); without it, one value at a time.
    (On an H200 this was 100 % against 72 % of copy bandwidth: profiling/results/h200/README.md.)"""
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH"))))}
    environment.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", _COUNT_ADAMW_ACCESSES], cwd=root, env=environment,
                            capture_output=True, text=True, timeout=300)
    if result.returncode == 3:
        pytest.skip("this Triton has no triton.compiler.ASTSource / triton.backends.compiler.GPUTarget")
    assert result.returncode == 0, result.stderr
    aligned, unaligned = (tuple(map(int, line.split())) for line in result.stdout.splitlines())
    assert aligned == (4, 3, 0, 0)
    assert unaligned == (0, 0, 32, 24)


@pytest.mark.parametrize("hyperparameters,message", [
    ({"lr": -1.0}, "lr"), ({"betas": (0.9, 1.0)}, "betas"), ({"eps": -1e-8}, "eps"), ({"weight_decay": -0.1}, "weight_decay"),
])
def test_adamw_rejects_hyperparameters_out_of_range(hyperparameters, message):
    with pytest.raises(ValueError, match=message):
        levels.build_optimizer("native", [torch.nn.Parameter(torch.randn(3))], **hyperparameters)


def test_build_optimizer_takes_level_names_and_numbers():
    parameter = [torch.nn.Parameter(torch.randn(3))]
    for number, name in enumerate(levels.LEVELS, start=1):
        assert type(levels.build_optimizer(number, parameter)) is type(levels.build_optimizer(name, parameter))
        assert levels.build_optimizer(name, parameter).level == name
