"""Every component × level × dtype computes the same function as a float64 run of level 1: the
output and every gradient (input, weight, bias), within the one tolerance table."""

import importlib

import pytest
import torch

from levels import TOLERANCE, relative_max_error
from levels.spec import as_reference_input
from triton_kernels.layer_norm import loops_a_constant_row_length, norm_row_tile, pipelines_rows, row_loop_tile

from .conftest import device_param, grid_params, level_devices
from .helpers import assert_matches_float64_reference, build_pair, forward_and_gradients, make_inputs


def expected_output_dtype(module, dtype):
    """The input's dtype, unless the component says otherwise (a loss is float32 for 16-bit inputs)."""
    return module.output_dtype(dtype) if hasattr(module, "output_dtype") else dtype


@pytest.mark.parametrize("component,config,shape,level,device,dtype", grid_params())
def test_forward_and_backward_match_float64_reference(component, config, shape, level, device, dtype):
    module, reference = build_pair(component, level, config, device, dtype)
    inputs = make_inputs(module, shape, dtype, device)
    with torch.no_grad():
        # Rounded to the level's dtype first, so the level and the reference see the same gradient
        # (otherwise float16 rounding of grad_output alone, amplified by cancellation, is "error").
        grad_output = torch.randn_like(reference(*map(as_reference_input, inputs))).to(dtype).to(torch.float64)

    output, gradients = forward_and_gradients(module, inputs, grad_output)
    expected, expected_gradients = forward_and_gradients(reference, list(map(as_reference_input, inputs)), grad_output)

    assert output.dtype == expected_output_dtype(module, dtype) and output.shape == expected.shape
    floating_inputs = [x for x in inputs if x.is_floating_point()]  # token ids have no gradient
    input_names = ["grad input"] if len(floating_inputs) == 1 else [f"grad input {i}" for i in range(len(floating_inputs))]
    names = ["output", *input_names] + [f"grad {name}" for name, _ in module.named_parameters()]
    for name, actual, wanted in zip(names, [output, *gradients], [expected, *expected_gradients]):
        assert actual is not None, f"{name} was not computed"
        assert torch.isfinite(actual).all(), f"{name} has non-finite values"
        error = relative_max_error(actual, wanted)
        assert error <= TOLERANCE[dtype], f"{name}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize("component,config,shape,level,device,dtype",
                         [p for p in grid_params() if p.values[3] in ("triton", "cuda") and p.values[5] != torch.float64])
def test_inference_forward_matches_float64_reference(component, config, shape, level, device, dtype):
    """Under torch.no_grad levels 4 and 5 take their own path (no autograd, no statistics saved for a
    backward): it must compute the same function."""
    module, reference = build_pair(component, level, config, device, dtype)
    inputs = make_inputs(module, shape, dtype, device)
    with torch.no_grad():
        output = module(*inputs)
        expected = reference(*map(as_reference_input, inputs))
    assert output.dtype == expected_output_dtype(module, dtype) and output.shape == expected.shape
    error = relative_max_error(output, expected)
    assert error <= TOLERANCE[dtype], f"relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


# --- level 4's row-length strategies (launch.row_strategy), each forced at a size the interpreter runs in
# seconds, for the row-wise components that choose one ---------------------------------------------------

NORM_SPLIT_FORWARD_KERNELS = {"_norm_fwd_split_statistics_kernel", "_norm_fwd_split_normalize_kernel"}
NORM_SPLIT_BACKWARD_KERNELS = {"_norm_bwd_split_sums_kernel", "_norm_bwd_split_dx_kernel"}
NORM_SPLIT_KERNELS = NORM_SPLIT_FORWARD_KERNELS | NORM_SPLIT_BACKWARD_KERNELS
SOFTMAX_SPLIT_FORWARD_KERNELS = {"_softmax_fwd_split_statistics_kernel", "_softmax_fwd_split_normalize_kernel"}
SOFTMAX_SPLIT_KERNELS = SOFTMAX_SPLIT_FORWARD_KERNELS | {"_softmax_bwd_split_dot_kernel", "_softmax_bwd_split_dx_kernel"}
LOOPED_SETTINGS = {"MAX_ROW_BLOCK": 2048, "MAX_ONE_ARRAY_ROW_BLOCK": 2048, "LOOPED_ROW_BLOCK": 1024,
                   "SPLIT_BLOCK": 1024}
"""launch.py's settings under which rows of 5000 loop (on the interpreter's one SM, and with no cooperative grid)."""


def looped_norm_forward(component, dtype, n=None):
    """The looped forward kernel a norm must launch in ``dtype`` (on rows of ``n``, if "looped_in_l2" runs
    them), by layer_norm.loops_a_constant_row_length and layer_norm.row_loop_tile."""
    subtract_mean = component == "layer_norm"
    if loops_a_constant_row_length(subtract_mean, dtype) or (n and row_loop_tile(n, dtype, subtract_mean)):
        return "layer_norm_fwd_looped_constant_n_kernel"
    return "layer_norm_fwd_looped_kernel"


LONGEST_ROW_NORM_FORWARD = object()
"""Stands, in a case's norm kernels, for the forward a norm launches in float32 at rows of MAX_ROW_BLOCK:
pipelined rows on the interpreter (layer_norm.pipelines_rows), a tile a program on a GPU."""


def norm_kernels_of(device, kernels):
    """A case's norm kernels on ``device``, LONGEST_ROW_NORM_FORWARD named."""
    longest = "_norm_fwd_pipelined_rows_kernel" if device == "cpu" else "_layer_norm_fwd_kernel"
    return {longest if kernel is LONGEST_ROW_NORM_FORWARD else kernel for kernel in kernels}


STRATEGY_CASES = {
    # case: (the strategy, the launch settings that force it, (rows, N),
    #        kernels it must launch for LayerNorm and RMSNorm, and for softmax)
    "tiled": ("tiled", {}, (5, 300), {"_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel"},
              {"_softmax_fwd_kernel", "_softmax_bwd_kernel"}),
    # (the tiled case's one tile is one program, which writes dw, db itself; these 9 rows are more tiles
    # than ONE_PROGRAM_TILES, so their programs leave partial rows for the column reduction)
    "row": ("row", {}, (9, 4000), {"_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_layer_norm_bwd_dwdb_kernel"},
            {"_softmax_fwd_kernel", "_softmax_bwd_kernel"}),
    # softmax's rows as long as a program's registers hold: persistent programs that load their next row early
    # (launch.loads_next_row_early); 9 rows on the interpreter's 4 programs, so each walks two or three
    "row-longest": ("row", {"MAX_ONE_ARRAY_ROW_BLOCK": 4096}, (9, 4000),
                    {"_layer_norm_fwd_kernel", "_layer_norm_bwd_kernel", "_layer_norm_bwd_dwdb_kernel"},
                    {"_softmax_fwd_next_row_kernel", "_softmax_bwd_kernel"}),
    # the norms' backward splits every row too long for registers (layer_norm_backward.py says why);
    # softmax's backward has no sum across rows, so its looped row stays one program's; in float32 both
    # norms' looped forward is compiled for the row length (test_looped_norms_take_a_constant_row_length_...)
    "looped": ("looped", LOOPED_SETTINGS, (3, 5000),
               {"layer_norm_fwd_looped_constant_n_kernel", *NORM_SPLIT_BACKWARD_KERNELS},
               {"softmax_fwd_online_kernel", "_softmax_bwd_looped_kernel"}),
    # rows the forward holds in registers and the norms' backward does not: it keeps four values a column,
    # twice the forward's two, so it splits rows past half the forward's limit (layer_norm_backward.ROW_ARRAYS).
    # Rows that long are the widest block, whose rows the interpreter's forward pipelines (pipelines_rows:
    # 7 rows on its 4 programs, so that each walks one or two)
    "row-backward-split": ("row", {"MAX_ROW_BLOCK": 4096, "SPLIT_BLOCK": 1024}, (7, 3000),
                           {LONGEST_ROW_NORM_FORWARD, *NORM_SPLIT_BACKWARD_KERNELS},
                           {"_softmax_fwd_kernel", "_softmax_bwd_kernel"}),
    # 3 rows of 5 slices, the last one short (5000 = 4 · 1024 + 904); the backward's programs take one
    # slice of every row (the interpreter's 4 program slots hold no two groups of 5 slices)
    "split": ("split", {"SPLIT_MIN_ROW": 4096, "SPLIT_MAX_ROWS_PER_SM": 4, "SPLIT_BLOCK": 1024}, (3, 5000),
              NORM_SPLIT_KERNELS, SOFTMAX_SPLIT_KERNELS),
    # 5 rows of 2 slices: the backward's rows fall into two groups (rows 0, 2, 4 and 1, 3), whose
    # partial dw rows the column reduction adds
    "split-groups": ("split", {"SPLIT_MIN_ROW": 2048, "SPLIT_MAX_ROWS_PER_SM": 8, "SPLIT_BLOCK": 2048}, (5, 3000),
                     NORM_SPLIT_KERNELS, SOFTMAX_SPLIT_KERNELS),
}


# On a GPU the forwards read every row too long for one program once, across a cooperative grid
# (launch.row_strategy's "cooperative"), and so do the norms' float32 backwards (layer_norm_split.py).
# Cases: a few rows, one slice short; more rows than the grid holds at once, so that every program walks
# several; bfloat16 (its backward in two phases); two that take the split's two phases both ways: rows
# of more slices than the GPU holds programs, and rows so long that fewer than
# launch.COOPERATIVE_MIN_ROWS_AT_ONCE fit at once; and enough rows short enough for one an SM to stay in
# L2, whose forward the norms loop over instead (launch.l2_looped_tile: in float32 here, a block wider
# than these rows of 40,000, half of it padding) and softmax does not.
COOPERATIVE_CASES = {
    "few-rows": ((3, 40000), torch.float32, "cooperative"),
    "many-rows": ((300, 131072), torch.float32, "cooperative"),  # 69 MB of rows an SM: more than L2 holds
    "bfloat16": ((5, 70000), torch.bfloat16, "cooperative"),
    "beyond-the-grid": ((2, 9_000_000), torch.float32, "split"),
    "lockstep": ((16, 2_097_152), torch.float32, "split"),
    "rows-in-l2": ((200, 40000), torch.float32, "looped_in_l2"),
    "rows-in-l2-bfloat16": ((200, 40000), torch.bfloat16, "looped_in_l2"),  # LayerNorm's tile is 16 warps
    "rows-in-l2-row-loop": ((200, 20000), torch.bfloat16, "looped_in_l2"),  # layer_norm.row_loop_tile's blocks
}


@pytest.mark.parametrize("case", STRATEGY_CASES)
@pytest.mark.parametrize("component", ["layer_norm", "rms_norm", "softmax"])
@pytest.mark.parametrize("device", [device_param(device) for device in level_devices("triton")])
def test_every_row_strategy_matches_float64_reference(component, case, device, monkeypatch):
    strategy, settings, shape, norm_kernels, softmax_kernels = STRATEGY_CASES[case]
    if case == "row-longest" and component == "softmax" and device == "cuda":
        pytest.skip("a GPU loads the next row early in bfloat16 only (launch.loads_next_row_early), where "
                    "test_a_gpu_loads_the_next_bfloat16_row_early_at_the_longest_rows_registers_hold checks it")
    _check_row_strategy(component, device, strategy, {"COOPERATIVE_ROWS": False, **settings}, shape, torch.float32,
                        softmax_kernels if component == "softmax" else norm_kernels_of(device, norm_kernels),
                        monkeypatch)


@pytest.mark.parametrize("component,dtype", [("layer_norm", torch.float64), ("rms_norm", torch.float64)])
@pytest.mark.parametrize("device", [device_param(device) for device in level_devices("triton")])
def test_looped_norms_take_a_constant_row_length_where_it_measured_faster(component, dtype, device, monkeypatch):
    """The interpreter's dtypes hold one case each way: LayerNorm in float64 keeps the run-time row length,
    RMSNorm compiles it (the 16-bit LayerNorm that keeps it runs in the GPU cases below)."""
    _check_row_strategy(component, device, "looped", {"COOPERATIVE_ROWS": False, **LOOPED_SETTINGS}, (3, 5000), dtype,
                        {looped_norm_forward(component, dtype), *NORM_SPLIT_BACKWARD_KERNELS}, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", COOPERATIVE_CASES)
@pytest.mark.parametrize("component", ["layer_norm", "rms_norm", "softmax"])
def test_cooperative_grids_match_float64_reference(component, case, monkeypatch):
    shape, dtype, forward_path = COOPERATIVE_CASES[case]
    if component == "softmax" and case == "rows-in-l2-row-loop":
        pytest.skip("softmax's forward keeps one array, so its registers hold rows of 20,000 (launch.row_tile)")
    if component == "softmax" and forward_path == "looped_in_l2":  # softmax does not ask for loop_in_l2
        forward_path = "cooperative"
    strategy = "looped_in_l2" if forward_path == "looped_in_l2" else "cooperative"
    if component == "softmax":
        kernels = SOFTMAX_SPLIT_FORWARD_KERNELS if forward_path == "split" else {"_softmax_fwd_cooperative_kernel"}
    elif forward_path == "split":
        kernels = NORM_SPLIT_KERNELS
    else:
        forward = (looped_norm_forward(component, dtype, shape[-1]) if forward_path == "looped_in_l2"
                   else "_norm_fwd_cooperative_kernel")
        backward = {"_norm_bwd_cooperative_kernel"} if dtype == torch.float32 else NORM_SPLIT_BACKWARD_KERNELS
        kernels = {forward, "_layer_norm_bwd_dwdb_kernel", *backward}
    _check_row_strategy(component, "cuda", strategy, {}, shape, dtype, kernels, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,forward", [(torch.bfloat16, "_softmax_fwd_next_row_kernel"),
                                           (torch.float16, "_softmax_fwd_kernel"),
                                           (torch.float32, "_softmax_fwd_kernel")])
def test_a_gpu_loads_the_next_bfloat16_row_early_at_the_longest_rows_registers_hold(dtype, forward, monkeypatch):
    """300 rows (more than the SMs: each program walks two or three) of 20,000 values, a 32,768 block."""
    # The backward keeps two values a column, so its rows of 20,000 loop (launch.row_tile).
    _check_row_strategy("softmax", "cuda", "row", {}, (300, 20000), dtype, {forward, "_softmax_bwd_looped_kernel"},
                        monkeypatch)


@pytest.mark.parametrize("wide_offsets", [False, True])
def test_the_next_row_kernel_indexes_rows_in_either_offset_width(wide_offsets):
    """``_softmax_fwd_next_row_kernel`` with int32 and int64 row offsets (a GPU takes int64 only from 2^31
    elements on): 7 rows on 3 programs, so that each walks two or three and loads one past the last."""
    softmax_module = importlib.import_module("triton_kernels.softmax")
    launch_module = importlib.import_module("triton_kernels.launch")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter has no bfloat16 arithmetic
    x = torch.randn(7, 300, device=device, dtype=dtype) * 3
    y = torch.empty_like(x)
    launch_module.launch(softmax_module._softmax_fwd_next_row_kernel, (3,), x, y, 7, 300, BLOCK_N=512,
                         COMPUTE=launch_module.compute_dtype(dtype), WIDE_OFFSETS=wide_offsets, num_warps=4)
    assert relative_max_error(y, torch.softmax(x.double(), -1)) <= TOLERANCE[dtype]


@pytest.mark.gpu
def test_the_next_row_kernel_reaches_rows_past_2_to_the_31_elements(monkeypatch):
    """65,540 bfloat16 rows of 32,768: 2^31 + 131,072 elements (4 GB), whose last rows only int64 offsets
    reach. The float64 reference is taken of the first and last rows only."""
    softmax_module = importlib.import_module("triton_kernels.softmax")
    launched = []

    def recording_launch(kernel, grid, *args, **constants):
        launched.append((kernel.__name__, constants.get("WIDE_OFFSETS")))
        return launch(kernel, grid, *args, **constants)

    launch = softmax_module.launch
    monkeypatch.setattr(softmax_module, "launch", recording_launch)
    x = torch.randn(65540, 32768, device="cuda", dtype=torch.bfloat16)
    y = softmax_module.launch_softmax_fwd(x)
    assert launched == [("_softmax_fwd_next_row_kernel", True)]
    for rows in (slice(0, 3), slice(-3, None)):
        assert relative_max_error(y[rows], torch.softmax(x[rows].double(), -1)) <= TOLERANCE[torch.bfloat16]


def test_the_interpreter_never_runs_a_cooperative_grid():
    """Its programs run one after another: a program waiting for its row's others would wait forever."""
    launch_module = importlib.import_module("triton_kernels.launch")
    assert launch_module.row_strategy(1, 40000, torch.empty(0), arrays=1, cooperative=True) == "split"
    assert launch_module.row_strategy(600, 40000, torch.empty(0), cooperative=True) == "looped"


class _GpuTensorStandIn:
    """What row_strategy asks of a CUDA tensor, for a CPU-only machine: where it lives, its element size."""

    is_cuda = True

    def __init__(self, element_size: int):
        self._element_size = element_size

    def get_device(self) -> int:
        return 0

    def element_size(self) -> int:
        return self._element_size


@pytest.mark.parametrize("rows,n,element_size,loop_in_l2,strategy", [
    (2048, 32768, 4, True, "looped_in_l2"),  # 132 rows of 128 KB in flight: 17 MB of L2's 50
    (2048, 65536, 2, True, "looped_in_l2"),  # the same bytes in bfloat16
    (2048, 65536, 4, True, "looped_in_l2"),  # 35 MB
    (512, 131072, 2, True, "looped_in_l2"),  # the same bytes in bfloat16
    (512, 131072, 4, True, "cooperative"),  # 69 MB: more than L2 holds
    (100, 32768, 4, True, "cooperative"),  # fewer rows than SMs: looped, they would leave SMs idle
    (2048, 16384, 4, True, "row"),  # fits one program's registers: neither
    (2048, 32768, 4, False, "cooperative"),  # a forward that does not ask (softmax)
])
def test_a_gpu_loops_over_the_rows_whose_second_read_l2_holds(rows, n, element_size, loop_in_l2, strategy,
                                                               monkeypatch):
    """launch.row_strategy on an H100-like GPU (132 SMs, 50 MB of L2), for a forward with a cooperative
    version: rows longer than one program's registers are looped only when the forward asks, one row an
    SM fits in L2 and every SM gets one; else they cross DRAM once on the cooperative grid."""
    launch_module = importlib.import_module("triton_kernels.launch")
    monkeypatch.setattr(launch_module, "_multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(launch_module, "_l2_cache_bytes", lambda device: 50 * 2**20)
    assert launch_module.row_strategy(rows, n, _GpuTensorStandIn(element_size), cooperative=True,
                                      loop_in_l2=loop_in_l2) == strategy


def _recording(launcher, launched: set, describe=lambda kernel, constants: kernel.__name__):
    """``launcher`` (launch.launch or launch.launch_cooperative), adding ``describe(kernel, constants)`` (the
    kernel's name unless told otherwise) of each kernel that it starts to ``launched`` (a cooperative launch
    that declines starts nothing)."""
    def recording_launcher(kernel, *args, **kwargs):
        started = launcher(kernel, *args, **kwargs)
        if started is not False:
            launched.add(describe(kernel, kwargs))
        return started
    return recording_launcher


def _launched_from_python(monkeypatch):
    """Every kernel is seen where Python launches it: no call replayed from C++ (triton_kernels/replay.py)."""
    monkeypatch.setattr(importlib.import_module("triton_kernels.replay"), "REPLAY", False)


def _check_row_strategy(component, device, strategy, settings, shape, dtype, kernels, monkeypatch):
    """``component`` at level 4 on (rows, N) ``shape``, with ``settings`` of triton_kernels.launch forced,
    takes ``strategy``, launches (at least) ``kernels`` and matches the float64 reference, with and
    without gradients."""
    launch_module = importlib.import_module("triton_kernels.launch")
    for name, value in settings.items():
        monkeypatch.setattr(launch_module, name, value)
    _launched_from_python(monkeypatch)
    launch_module.row_tile.cache_clear()  # row_tile's answers depend on MAX_ROW_BLOCK
    # The kept launches were planned under the settings before these (layer_norm.launch_norm_fwd,
    # layer_norm_backward.launch_norm_bwd_unchecked, softmax.SoftmaxLaunch).
    for module_name, table in (("triton_kernels.layer_norm", "_NORM_FORWARD_LAUNCHES"),
                               ("triton_kernels.layer_norm_backward", "_NORM_BACKWARD_LAUNCHES"),
                               ("triton_kernels.softmax", "_SOFTMAX_LAUNCHES")):
        monkeypatch.setattr(importlib.import_module(module_name), table, launch_module.SignatureTable())
    try:
        launched = set()
        for module_name in ("triton_kernels.layer_norm", "triton_kernels.layer_norm_backward",
                            "triton_kernels.layer_norm_split", "triton_kernels.softmax", "triton_kernels.softmax_split"):
            kernel_module = importlib.import_module(module_name)
            for launcher in ("launch", "launch_cooperative"):
                if hasattr(kernel_module, launcher):
                    monkeypatch.setattr(kernel_module, launcher, _recording(getattr(kernel_module, launcher), launched))
        config = {"dim": -1} if component == "softmax" else {"normalized_shape": shape[-1]}
        module, reference = build_pair(component, "triton", config, device, dtype)
        inputs = make_inputs(module, shape, dtype, device)
        assert launch_module.row_strategy(*shape, inputs[0], arrays=1 if component == "softmax" else 2,
                                          cooperative=True, loop_in_l2=component != "softmax") == strategy
        assert_matches_float64_reference(module, reference, inputs, TOLERANCE[dtype])
        with torch.no_grad():  # inference: no statistics stored
            output, expected = module(*inputs), reference(*map(as_reference_input, inputs))
        assert relative_max_error(output, expected) <= TOLERANCE[dtype]
        assert kernels <= launched, f"{strategy} launched {sorted(launched)}"
    finally:
        monkeypatch.undo()
        launch_module.row_tile.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_gpu_pipelines_16_bit_layer_norm_rows_of_the_widest_block(dtype, monkeypatch):
    """layer_norm.pipelines_rows: 300 rows of 16,000 values (a 16,384 block), more than the persistent grid's
    programs, so that each walks two or three. Only 16-bit LayerNorm's rows are pipelined there: RMSNorm's
    and float32 LayerNorm's loop, and float32 RMSNorm's at 16,384 keep a tile a program
    (test_norms_loop_over_rows_registers_hold_less_well)."""
    _check_row_strategy("layer_norm", "cuda", "row", {}, (300, 16000), dtype, {"_norm_fwd_pipelined_rows_kernel"},
                        monkeypatch)


def skip_16_bit_on_the_interpreter(device: str, dtype: torch.dtype) -> None:
    """These cases check level 4's float32 on the CPU: Triton's interpreter has no 16-bit arithmetic."""
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter has no 16-bit arithmetic; the GPU runs these")


# layer_norm.row_loop_tile: rows registers could hold whole that the forward loops over, compiled for the row
# length. The interpreter's float32 checks the rule's indexing up to 9000 values (both norms loop at 9000,
# LayerNorm holds its rows of 5000 and 8192, RMSNorm loops from 4097); the GPU's dtypes the rest, at both
# ends of each range.
ROW_LOOP_CASES = [("rms_norm", torch.float32, 9000, True), ("layer_norm", torch.float32, 9000, True),
                  ("rms_norm", torch.float32, 4096, False), ("rms_norm", torch.float32, 4097, True),
                  ("layer_norm", torch.float32, 5000, False),
                  ("layer_norm", torch.float32, 8192, False), ("layer_norm", torch.float32, 14000, True),
                  ("layer_norm", torch.bfloat16, 4097, True), ("layer_norm", torch.float16, 7168, True),
                  ("layer_norm", torch.bfloat16, 7169, False), ("rms_norm", torch.bfloat16, 6144, False),
                  ("rms_norm", torch.bfloat16, 6145, True),
                  ("rms_norm", torch.bfloat16, 8192, True), ("rms_norm", torch.float16, 16384, True),
                  ("rms_norm", torch.float32, 12288, True), ("rms_norm", torch.float32, 16384, False),
                  ("layer_norm", torch.bfloat16, 8193, True), ("layer_norm", torch.float16, 12288, True),
                  ("layer_norm", torch.bfloat16, 8192, False), ("layer_norm", torch.bfloat16, 12289, False)]


@pytest.mark.parametrize("component,dtype,n,loops", ROW_LOOP_CASES,
                         ids=lambda value: str(value).removeprefix("torch."))
@pytest.mark.parametrize("device", [device_param(device) for device in level_devices("triton")])
def test_norms_loop_over_rows_registers_hold_less_well(component, dtype, n, loops, device, monkeypatch):
    skip_16_bit_on_the_interpreter(device, dtype)
    if device == "cpu" and n > 9000:
        pytest.skip("the interpreter checks the rule up to 9000 values; the GPU runs the longer rows")
    held = ("_norm_fwd_pipelined_rows_kernel" if pipelines_rows(norm_row_tile(n, dtype), dtype)
            else "_layer_norm_fwd_kernel")
    _check_row_strategy(component, device, "row", {}, (3, n), dtype,
                        {"layer_norm_fwd_looped_constant_n_kernel" if loops else held}, monkeypatch)


# launch.short_row_tile: the forwards' short rows share programs of 2 warps (softmax's rows up to 2048 values, the
# norms' up to 1024), two 16-bit rows a program more where padding leaves a program under 2 KB; row counts no
# tile divides leave the last program's rows past the matrix masked (softmax's, all -inf, zeroed).
SHORT_ROW_CASES = [("softmax", (7, 100), torch.float32, 8), ("softmax", (5, 2048), torch.float32, 1),
                   ("layer_norm", (7, 100), torch.float32, 8), ("rms_norm", (3, 1000), torch.float32, 1),
                   ("softmax", (13, 768), torch.bfloat16, 2), ("layer_norm", (13, 768), torch.float16, 2),
                   ("rms_norm", (5, 512), torch.bfloat16, 2)]


@pytest.mark.parametrize("component,shape,dtype,rows_per_tile", SHORT_ROW_CASES,
                         ids=lambda value: str(value).removeprefix("torch."))
@pytest.mark.parametrize("device", [device_param(device) for device in level_devices("triton")])
def test_short_rows_share_programs_of_two_warps(component, shape, dtype, rows_per_tile, device, monkeypatch):
    skip_16_bit_on_the_interpreter(device, dtype)
    kernel_module = importlib.import_module("triton_kernels.softmax" if component == "softmax"
                                            else "triton_kernels.layer_norm")
    tiles = set()  # (kernel, rows a program, warps) of each launch
    monkeypatch.setattr(kernel_module, "launch", _recording(
        kernel_module.launch, tiles,
        describe=lambda kernel, constants: (kernel.__name__, constants.get("ROWS_PER_TILE"), constants["num_warps"])))
    _launched_from_python(monkeypatch)
    config = {"dim": -1} if component == "softmax" else {"normalized_shape": shape[-1]}
    module, reference = build_pair(component, "triton", config, device, dtype)
    assert_matches_float64_reference(module, reference, make_inputs(module, shape, dtype, device), TOLERANCE[dtype])
    forward = "_softmax_fwd_kernel" if component == "softmax" else "_layer_norm_fwd_kernel"
    assert (forward, rows_per_tile, 2) in tiles, tiles


# layer_norm_backward.loads_next_tile_early: the norms' backward programs load their next tile while they reduce this
# one in 16-bit dtypes (the interpreter's float32 too, to check the indexing), not in float32 on a GPU. 40 rows of
# 1000 are 10 tiles of 4 rows: more than ONE_PROGRAM_TILES, so the persistent grid runs, its programs' last loads
# past the matrix (the interpreter's 4 programs walk two or three tiles each).
NEXT_TILE_CASES = [("layer_norm", torch.float32), ("rms_norm", torch.float32), ("layer_norm", torch.bfloat16),
                   ("rms_norm", torch.float16)]


@pytest.mark.parametrize("component,dtype", NEXT_TILE_CASES, ids=lambda value: str(value).removeprefix("torch."))
@pytest.mark.parametrize("device", [device_param(device) for device in level_devices("triton")])
def test_16_bit_norm_backwards_load_their_next_tile_early(component, dtype, device, monkeypatch):
    skip_16_bit_on_the_interpreter(device, dtype)
    backward = importlib.import_module("triton_kernels.layer_norm_backward")
    launches = set()  # (kernel, LOADS_NEXT_TILE_EARLY) of each launch
    monkeypatch.setattr(backward, "launch", _recording(
        backward.launch, launches, describe=lambda kernel, constants: (kernel.__name__,
                                                                       constants.get("LOADS_NEXT_TILE_EARLY"))))
    _launched_from_python(monkeypatch)
    module, reference = build_pair(component, "triton", {"normalized_shape": 1000}, device, dtype)
    assert_matches_float64_reference(module, reference, make_inputs(module, (40, 1000), dtype, device), TOLERANCE[dtype])
    loads_early = device == "cpu" or dtype != torch.float32
    assert ("_layer_norm_bwd_kernel", loads_early) in launches, launches


# Level 4's norms hold two 16-bit rows of 8192 values or more in one program's registers
# (layer_norm.norm_row_tile; LayerNorm's rows of 12,289-16,384 are pipelined instead, and RMSNorm's of 8192 on
# and LayerNorm's of 8193-12,288 looped over: layer_norm.row_loop_tile; this test runs all three);
# with an odd row count the last program's second row is all masked.
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(5, 16384), (3, 8192), (4, 12000)], ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("component", ["layer_norm", "rms_norm"])
def test_level4_norms_two_16_bit_rows_a_program_match_float64_reference(component, shape):
    assert norm_row_tile(shape[-1], torch.bfloat16).rows_per_tile == 2  # the case this test is for
    module, reference = build_pair(component, "triton", {"normalized_shape": shape[-1]}, "cuda", torch.bfloat16)
    assert_matches_float64_reference(module, reference, module.example_inputs(shape, torch.bfloat16, "cuda"),
                                     TOLERANCE[torch.bfloat16])


# Level 5's softmax picks its kernel by row length (softmax.cu): 4 lanes a row (128 values), 32 (1000), a block
# staging the row in shared memory (4096), a cluster of 3 blocks on Hopper (40000 floats: 160 KB), and
# 2.4 MB rows split into 64 KB slices over a cooperative grid (a few, and 40: more than it holds at
# once); odd lengths take the unvectorised versions (600001: the two passes).
SOFTMAX_ROW_STRATEGY_SHAPES = [(4099, 128), (77, 1000), (33, 4096), (5, 40000), (3, 600000), (40, 600000), (3, 600001),
                               (2, 40001)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SOFTMAX_ROW_STRATEGY_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_softmax_matches_float64_reference_at_every_row_strategy(shape, dtype):
    module, reference = build_pair("softmax", "cuda", {"dim": -1}, "cuda", dtype)
    assert_matches_float64_reference(module, reference, module.example_inputs(shape, dtype, "cuda"), TOLERANCE[dtype])


# Level 5's LayerNorm and RMSNorm pick their kernels by row length (layer_norm.cu). Forward: 4 lanes a row (128 values;
# 37 unvectorised on 2 lanes), 32 (1000), a block's registers (4096; 8200, 12000 and 16384 floats, the last filling
# LayerNorm's 512 threads at 8 packs a thread and RMSNorm's 1024 at 4, 20000 and 30000 bfloat16 values in both norms';
# 30002 unvectorised past the scalar kernel's 512 threads), a persistent grid prefetching rows of 16384 to 32768 values
# when there are at least twice as many rows as SMs (300 rows of 20008 and 32768), on Hopper a cluster of 2 blocks
# (20000 and 30000 floats), of 3 (40000 floats: 160 KB; 2 in bfloat16) and of 16, the largest (262144 floats: 1 MB; 8 in
# bfloat16), longer rows split into 64 KB slices over a cooperative grid (a few 2.4 MB rows, 1.2 MB in bfloat16; and 40
# of them, more than the grid holds at once), the two passes for such rows unvectorised (600001), and a looped block for
# a long unvectorised row. Backward: rows in registers, float32 rows of more than 4096 (6000, 8192) with every pack's
# loads issued first, 6000's second pack past the row's end in some threads; longer rows in 16-byte packs (8200, 131072,
# 600000) on a cooperative grid of 32 KB column slices, with more rows than it holds at once from 300 on; unvectorised
# (8202) on the looped persistent grid; and the few long unvectorised rows (600001) cut into column slices. The backward
# reads the mean and rstd each forward path saved.
NORM_ROW_STRATEGY_SHAPES = [(4099, 128), (1000, 37), (77, 1000), (33, 4096), (300, 6000), (200, 8192), (300, 8200),
                            (300, 8202), (300, 12000), (40, 16384), (300, 20008), (300, 32768), (100, 20000), (64, 30000),
                            (64, 30002), (300, 131072), (5, 40000), (2, 262144), (3, 600000), (40, 600000), (3, 600001),
                            (2, 40001)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", NORM_ROW_STRATEGY_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("component", ["layer_norm", "rms_norm"])
def test_norm_matches_float64_reference_at_every_row_strategy(component, shape, dtype):
    module, reference = build_pair(component, "cuda", {"normalized_shape": shape[-1]}, "cuda", dtype)
    assert_matches_float64_reference(module, reference, module.example_inputs(shape, dtype, "cuda"), TOLERANCE[dtype])
