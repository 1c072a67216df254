"""compare_optimization_levels, call_overhead and ``python -m profiling``: the table a learner reads must
be complete, on one basis, honest about what could not run and about percentages past 100, and written
to CSV and PNG on request."""

import math
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import levels
from profiling import COLUMNS, call_overhead, compare_optimization_levels, format_table, plot_comparison
from profiling.cli import main
from profiling.gpu_suite import FASTEST_REFERENCE, OWN_VALUE, Target, check_targets
from profiling.peaks import copy_bytes
from profiling.timing import Timing, time_back_to_back, time_runs, time_side_by_side

from .conftest import level_devices


def test_spread_stays_within_the_samples():
    # Five samples far apart, as a busy machine gives: the deciles must not extrapolate past them.
    timing = Timing.from_samples([0.001, 0.002, 0.2, 0.4, 0.9], runs=5)
    assert 0.001 <= timing.p10_s <= timing.median_s <= timing.p90_s <= 0.9


def test_one_row_per_level_plus_reference_rows():
    # Triton runs CPU tensors only through its interpreter, i.e. only where no GPU is present.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table = compare_optimization_levels("layer_norm", (16, 64), device=device, levels=["native", 4, "cuda"],
                                        backward=True, budget_s=0.05, progress=False)
    # PyTorch's kernel, and Liger-Kernel's where it is installed and a GPU is here (an optional peer).
    references = list(levels.build("layer_norm", "native", normalized_shape=64).reference_modules(device))
    assert references[0] == "F.layer_norm (PyTorch fused)"
    assert list(table.columns) == COLUMNS
    assert list(table["level"]) == ["native", "triton", "cuda", *references]
    assert list(table["title"]) == ["1 native PyTorch", "4 Triton", "5 CUDA C++", *references]
    assert list(table["kind"]) == ["level", "level", "level"] + ["reference"] * len(references)
    assert (table["status"] == "ok").all(), table["status"].tolist()
    assert table["within_tolerance"].all()
    assert table["speedup"].iloc[0] == pytest.approx(1.0)
    assert (table["median_ms"] > 0).all() and (table["gb_per_s"] > 0).all() and (table["pct_copy_bandwidth"] > 0).all()
    assert (table["p10_ms"] <= table["median_ms"]).all() and (table["median_ms"] <= table["p90_ms"]).all()
    assert table.attrs["backward"] is True and table.attrs["input_shape"] == (16, 64)
    assert table.attrs["baseline"] == "native" and table.attrs["bound"] == "memory"


def test_every_ratio_in_a_row_comes_from_its_eager_time():
    table = compare_optimization_levels("swish", (64, 64), device="cpu", levels=[1, 2], budget_s=0.02, progress=False)
    bytes_moved, eager_s = table.attrs["bytes_moved"], table["median_ms"] / 1e3
    assert table["gb_per_s"].to_numpy() == pytest.approx((bytes_moved / eager_s / 1e9).to_numpy())
    assert table["speedup"].to_numpy() == pytest.approx((table["median_ms"].iloc[0] / table["median_ms"]).to_numpy())
    copy_bytes_per_s = table.attrs["copy_bandwidth_gb_per_s"] * 1e9
    assert table["pct_copy_bandwidth"].to_numpy() == pytest.approx((100 * bytes_moved / eager_s / copy_bytes_per_s).to_numpy())


def test_speedups_are_relative_to_the_named_baseline_and_the_table_says_which():
    table = compare_optimization_levels("swish", (64, 64), device="cpu", levels=[1, 2], baseline="F.silu (PyTorch fused)",
                                        budget_s=0.02, progress=False)
    assert table.set_index("level").loc["F.silu (PyTorch fused)", "speedup"] == pytest.approx(1.0)
    assert "speedup vs F.silu (PyTorch fused)" in format_table(table)
    # Without level 1 the first row is the baseline, and the header names it.
    table = compare_optimization_levels("swish", (64, 64), device="cpu", levels=[2], budget_s=0.02, progress=False)
    assert table.attrs["baseline"] == "torchscript" and "speedup vs 2 TorchScript" in format_table(table)
    with pytest.raises(ValueError, match=r"baseline 3 \(compile\) is not a row"):
        compare_optimization_levels("swish", (64, 64), device="cpu", levels=[2], baseline=3, budget_s=0.02, progress=False)


def test_a_level_that_cannot_run_says_why_and_the_rest_still_run():
    table = compare_optimization_levels("swish", (8, 8), dtype=torch.bfloat16, device="cpu",
                                        levels=["native", "triton"], references=False, budget_s=0.02, progress=False)
    native, triton = table.itertuples()
    assert native.status == "ok"
    assert triton.status.startswith("TypeError") and "float32, float64" in triton.status
    assert "not run:" in format_table(table)


def test_a_dict_of_modules_is_compared_against_its_first_entry():
    class Doubling(nn.Module):
        def forward(self, x):
            return x * 2

    class AlmostDoubling(nn.Module):
        def forward(self, x):
            return x * 2.01

    table = compare_optimization_levels({"exact": Doubling(), "off": AlmostDoubling()}, (32,), device="cpu",
                                        budget_s=0.02, progress=False)
    exact, off = table.itertuples()
    assert exact.level == exact.title == "exact" and table.attrs["baseline"] == "exact"
    assert exact.max_error == 0 and exact.within_tolerance
    assert off.max_error == pytest.approx(0.005, rel=1e-3) and not off.within_tolerance


@pytest.mark.parametrize("timer", [time_runs, time_back_to_back])
def test_rows_are_timed_in_turns_and_each_keeps_its_own_samples(timer):
    calls = []

    def quick():
        calls.append("quick")

    def slow():
        calls.append("slow")
        time.sleep(2e-3)

    timings = time_side_by_side({"quick": quick, "slow": slow}, torch.device("cpu"), timer, budget_s=0.06, rounds=3)
    turns = [name for index, name in enumerate(calls) if index == 0 or calls[index - 1] != name]
    assert turns == ["quick", "slow"] * 3  # three rounds, each row's calls together within a round
    assert timings["slow"].median_s > 2e-3 > timings["quick"].median_s
    assert len(timings["slow"].samples) >= 3 and timings["quick"].runs >= len(timings["quick"].samples)


@pytest.mark.parametrize("timer", [time_runs, time_back_to_back])
def test_torch_compiles_worker_pool_is_shut_down_before_anything_is_timed_and_not_started_again(timer, monkeypatch):
    # Inductor's pool of compile workers slows every Python call while it lives (timing.quiet_compile_workers).
    from torch._inductor import async_compile, config

    monkeypatch.setattr(config, "compile_threads", 2)  # restored after the test, as quiet_compile_workers leaves it
    async_compile.AsyncCompile.process_pool()  # what torch.compile's first compile starts
    assert async_compile._pool_set
    timer(lambda: None, torch.device("cpu"), budget_s=0.01)
    assert not async_compile._pool_set
    async_compile.AsyncCompile.warm_pool()  # what the next compile would start
    assert not async_compile._pool_set and not async_compile.AsyncCompile.use_process_pool()


def test_one_query_over_a_cache_is_a_memory_bound_attention_case():
    spec = levels.build("attention", "native", causal=True)
    one_query = ((1, 12, 1, 64), (1, 12, 64, 64), (1, 12, 64, 64))
    q, k, v = spec.example_inputs(one_query, torch.float32, "cpu")
    assert q.shape == (1, 12, 1, 64) and k.shape == v.shape == (1, 12, 64, 64)
    assert spec.flops(one_query) == 4 * 12 * 64 * 64  # the one query sees all 64 keys
    assert spec.bytes_moved(one_query, torch.float32) == 4 * (2 * 12 * 64 + 2 * 12 * 64 * 64) + 4 * 12
    # With one shape for all three, the cost model is the square case's.
    assert spec.flops((1, 12, 64, 64)) == 4 * 12 * 64 * spec.visible_pairs(64, 64)


def test_call_overhead_times_every_case_forward_and_backward_back_to_back():
    table = call_overhead("cpu", levels=[1], cases=["swish", "attention"], budget_s=0.02, progress=False)
    assert list(dict.fromkeys(table["benchmark"])) == [
        "decode swish forward", "decode swish fwd+bwd", "decode attention forward", "decode attention fwd+bwd"]
    assert (table["status"] == "ok").all(), table["status"].tolist()
    assert set(table["kind"]) == {"level", "reference"} and (table["timing"] == "back to back").all()
    assert set(table.loc[table["benchmark"].str.startswith("decode attention"), "bound"]) == {"memory"}
    assert (table["runs"] >= 5).all() and (table["median_ms"] > 0).all()


def synthetic_table(bound: str, pct: float) -> pd.DataFrame:
    """A two-row comparison, no timing: what the report functions are given."""
    table = pd.DataFrame([
        {"level": "native", "title": "1 native PyTorch", "kind": "level", "median_ms": 1000.0, "p10_ms": 900.0,
         "p90_ms": 1100.0, "graph_ms": 800.0, "speedup": 1.0, "gb_per_s": 1.0, "tflop_per_s": 0.1,
         "pct_copy_bandwidth": 10.0, "pct_matmul_peak": 10.0, "status": "ok"},
        {"level": "F.silu", "title": "F.silu", "kind": "reference", "median_ms": 0.01, "p10_ms": 0.009, "p90_ms": 0.011,
         "graph_ms": 0.005, "speedup": 1e5, "gb_per_s": 1e5, "tflop_per_s": 1e4, "pct_copy_bandwidth": pct,
         "pct_matmul_peak": pct, "status": "ok"},
    ]).reindex(columns=COLUMNS)
    table.attrs.update(component="swish", input_shape=(8, 8), dtype="float32", device="cpu", backward=False,
                       baseline="native", baseline_title="1 native PyTorch", bound=bound, bytes_moved=512,
                       flop_per_byte=1.0, ridge_flop_per_byte=4.0, copy_bandwidth_gb_per_s=10.0,
                       matmul_peak_tflop_per_s=1.0)
    return table


@pytest.mark.parametrize("bound,unit,ceiling", [("memory", "GB/s", "of copy BW"), ("compute", "TFLOP/s", "of matmul peak")])
def test_the_plot_has_a_log_time_axis_a_legend_and_the_ceiling_that_fits(bound, unit, ceiling):
    import matplotlib

    matplotlib.use("Agg")
    ax = plot_comparison(synthetic_table(bound, pct=50.0))
    assert ax.get_xscale() == "log"
    # Five decades apart, both bars are visible: the axis starts below the faster one.
    assert ax.get_xlim()[0] < 0.009 and ax.get_xlim()[1] > 1100
    assert [text.get_text() for text in ax.get_legend().get_texts()] == [
        "level (eager, launched from Python)", "PyTorch reference (eager)", "CUDA-graph replay"]
    labels = [text.get_text() for text in ax.texts]
    assert all(unit in label and ceiling in label for label in labels), labels
    assert "*" not in ax.get_xlabel()


def test_a_percent_above_100_gets_a_footnote_saying_why():
    import matplotlib

    matplotlib.use("Agg")
    memory = synthetic_table("memory", pct=130.0)
    assert "130%*" in format_table(memory) and "stay in the caches" in format_table(memory)
    assert "stay in the caches" in plot_comparison(memory).get_xlabel()
    assert "measured 1024×1024 matmul" in format_table(synthetic_table("compute", pct=130.0))
    assert "*" not in format_table(synthetic_table("memory", pct=99.0))
    # A call as large as the copy that sets 100 % (AdamW over GPT-2's parameters: 1.7 GB) stays in no cache.
    large = synthetic_table("memory", pct=101.0)
    large.attrs["bytes_moved"] = 2 * copy_bytes("cpu")
    assert "no cache holds it" in format_table(large) and "stay in the caches" not in format_table(large)


def test_targets_read_eager_times_with_graph_replay_beside_them():
    table = synthetic_table("memory", pct=50.0)
    tables = {"case": table.assign(median_ms=[0.012, 0.010], graph_ms=[0.006, 0.005], level=["cuda", "F.silu"])}
    within = Target("case", "cuda", 1.3, FASTEST_REFERENCE, at_most=True)
    assert within.measure(tables) == pytest.approx(1.2) and within.met(1.2) == "yes"
    assert within.measure(tables, "graph_ms") == pytest.approx(1.2)
    faster = Target("case", "cuda", 1.0, "F.silu")
    assert faster.measure(tables) == pytest.approx(10 / 12) and faster.met(10 / 12) == "**no**"
    assert math.isnan(Target("case", "triton", 1.0, "F.silu").measure(tables))


def test_a_memory_target_compares_peak_memory_and_has_no_graph_replay_twin():
    table = synthetic_table("memory", pct=50.0)
    tables = {"case": table.assign(peak_memory_mb=[300.0, 1000.0], level=["cuda", "native"])}
    lighter = Target("case", "cuda", 0.25, "native", at_most=True, column="peak_memory_mb")
    assert lighter.measure(tables) == pytest.approx(0.3) and lighter.met(0.3) == "**no**"
    assert math.isnan(lighter.measure(tables, "graph_ms"))
    assert "peak memory mb ≤ 0.25×" in lighter.describe()


def test_a_rate_target_reads_the_rows_own_tokens_per_second(tmp_path):
    tables = {"step": pd.DataFrame({"level": ["native", "cuda"], "median_ms": [80.0, 20.0],
                                    "tokens_per_s": [102_400.0, 409_600.0], "status": ["ok", "ok"]})}
    fast_enough = Target("step", "cuda", 350_000, OWN_VALUE, column="tokens_per_s")
    assert fast_enough.measure(tables) == pytest.approx(409_600) and fast_enough.met(409_600) == "yes"
    assert Target("step", "native", 350_000, OWN_VALUE, column="tokens_per_s").met(102_400) == "**no**"
    assert math.isnan(fast_enough.measure(tables, "graph_ms"))
    report = check_targets(tables, [fast_enough], tmp_path / "targets.md")
    assert "| step: 5 CUDA C++ ≥ 350,000 tokens/s | 409,600 | - | yes |" in report


def test_adamw_compares_one_step_per_level_against_pytorchs_adamw():
    shapes = ((33, 7), (1000,), (1,))
    table = compare_optimization_levels("adamw", shapes, torch.float32, "cpu", levels=["native", "compile"],
                                        budget_s=0.05, progress=False)
    assert list(table["level"]) == ["native", "compile", "torch.optim.AdamW(foreach=True)",
                                    "torch.optim.AdamW(fused=True)"]
    assert (table["status"] == "ok").all() and table["within_tolerance"].all()
    assert table.attrs["bytes_moved"] == 7 * (33 * 7 + 1000 + 1) * 4  # p, g, m, v read; p, m, v written
    assert table.attrs["bound"] == "memory" and "1,232 values" in table.attrs["input_shape"]


def test_the_command_line_says_what_it_will_do_prints_the_table_and_writes_csv_and_png(tmp_path, capsys):
    csv, png = tmp_path / "comparison.csv", tmp_path / "comparison.png"
    status = main(["--component", "swish", "layer_norm", "--shape", "8", "32", "--device", "cpu", "--levels", "1", "3",
                   "--budget", "0.02", "--csv", str(csv), "--plot", str(png)])
    assert status == 0
    captured = capsys.readouterr()
    assert "comparing swish (8, 32), layer_norm (8, 32)" in captured.err and "2 PyTorch reference rows" in captured.err
    assert "CPU timings on a shared machine are noisy" in captured.err
    assert f"wrote {csv}" in captured.err and f"wrote {png}" in captured.err
    assert "swish forward" in captured.out and "layer_norm forward" in captured.out and "3 torch.compile" in captured.out
    written = pd.read_csv(csv)
    assert set(written["component"]) == {"swish", "layer_norm"}
    assert list(written["level"]) == ["native", "compile", "F.silu (PyTorch fused)",
                                      "native", "compile", "F.layer_norm (PyTorch fused)"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_row_length_sweep_keeps_the_total_and_writes_a_table_csv_and_plot(tmp_path, capsys):
    csv, png = tmp_path / "sweep.csv", tmp_path / "sweep.png"
    status = main(["--sweep", "row_length", "--component", "softmax", "--device", "cpu", "--levels", "1", "5",
                   "--total", "1024", "--budget", "0.02", "--csv", str(csv), "--plot", str(png)])
    assert status == 0
    written = pd.read_csv(csv)
    # Row lengths above the total are left out; every point holds the same 1024 elements.
    assert sorted(set(written["row_length"])) == [128, 512]
    assert (written["rows"] * written["row_length"] == 1024).all()
    assert (written["status"] == "ok").all() and written["within_tolerance"].all()
    table = capsys.readouterr().out
    assert "softmax forward, float32 on cpu, 1,024 elements per point" in table and "5 CUDA C++" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_of_a_component_that_is_not_row_wise_is_refused():
    with pytest.raises(SystemExit):
        main(["--sweep", "row_length", "--component", "attention", "--device", "cpu"])


def test_sweep_targets_judge_the_worst_row_length_and_report_where_it_is(tmp_path):
    from profiling.gpu_suite import check_sweep_targets

    points = []
    for row_length, pct in ((128, 10.0), (512, 90.0), (2048, 80.0)):
        table = synthetic_table("memory", pct=pct).assign(level=["compile", "cuda"], row_length=row_length)
        points.append(table)
    sweep = pd.concat(points, ignore_index=True)
    sweep.attrs.update(backward=False)
    report = check_sweep_targets({"softmax forward float32": sweep}, tmp_path / "targets.md")
    # 128 is below the judged range; 2048 (80 %) is the worst point from 512 up.
    assert "| softmax forward float32: 5 CUDA C++ ≥ 85 % of copy bandwidth | 80.00 % | 2,048 |" in report
    assert "**no**" in report and (tmp_path / "targets.md").read_text().strip() == report.strip()


def test_a_throughput_target_compares_tflops_across_benchmarks_higher_is_better():
    table = synthetic_table("compute", pct=50.0)
    tables = {"head dim 96": table.assign(tflop_per_s=[300.0, 1.0], level=["cuda", "F.silu"]),
              "head dim 128": table.assign(tflop_per_s=[400.0, 1.0], level=["cuda", "F.silu"])}
    no_cliff = Target("head dim 96", "cuda", 0.8, "cuda", "head dim 128", column="tflop_per_s")
    assert no_cliff.measure(tables) == pytest.approx(0.75) and no_cliff.met(0.75) == "**no**"
    assert math.isnan(no_cliff.measure(tables, "graph_ms"))
    assert "tflop/s ≥ 0.8×" in no_cliff.describe()


@pytest.mark.gpu
def test_a_comparison_without_level_1_still_checks_against_its_float64_run_on_the_gpu():
    table = compare_optimization_levels("layer_norm", (16, 64), device="cuda", levels=["cuda"], references=False,
                                        budget_s=0.05, progress=False)
    assert list(table["level"]) == ["cuda"] and (table["status"] == "ok").all() and table["within_tolerance"].all()


@pytest.mark.parametrize("component,config,module,title", [
    ("layer_norm", {"normalized_shape": 8}, "layer_norm", "Liger LayerNorm"),
    ("rms_norm", {"normalized_shape": 8}, "layer_norm", "Liger RMSNorm"),  # RMSNorm's spec is layer_norm.py's
    ("softmax", {"dim": -1}, "softmax", "Liger softmax"),
])
def test_liger_joins_the_reference_rows_where_it_is_installed(component, config, module, title, monkeypatch):
    import importlib
    import types

    fake_liger = types.SimpleNamespace(LigerLayerNormFunction=None, LigerRMSNormFunction=None, LigerSoftmaxFunction=None)
    monkeypatch.setattr(importlib.import_module(f"levels.{module}"), "liger_ops", lambda device: fake_liger)
    references = levels.build(component, "native", **config).reference_modules("cuda")
    assert list(references)[1:] == [title]
    if component != "softmax":  # Liger normalises the last dim only
        assert title not in levels.build(component, "native", normalized_shape=(2, 4)).reference_modules("cuda")


def test_the_transformer_blocks_reference_keeps_pytorchs_own_layer_norm_where_liger_is_installed(monkeypatch):
    import importlib
    import types

    fake_liger = types.SimpleNamespace(LigerLayerNormFunction=None)
    monkeypatch.setattr(importlib.import_module("levels.layer_norm"), "liger_ops", lambda device: fake_liger)
    block = levels.build("transformer_block", "native", n_embd=16, n_head=2)
    (reference,) = block.reference_modules("cuda").values()
    assert [type(norm).__name__ for norm in (reference.ln_1, reference.ln_2)] == ["_PyTorchFusedLayerNorm"] * 2
    x = torch.randn(2, 3, 16)
    torch.testing.assert_close(reference(x), block(x))


def test_liger_fused_linear_cross_entropy_is_the_loss_reference_row_where_it_is_installed(monkeypatch):
    import importlib
    import types

    calls = []

    class RecordingFunction:
        @staticmethod
        def apply(*args):
            calls.append(args)
            return torch.tensor(1.5), None, None, None

    module = importlib.import_module("levels.linear_cross_entropy")
    spec = levels.build("linear_cross_entropy", "native", n_embd=8, vocab_size=16, ignore_index=-1)
    assert spec.reference_modules("cpu") == {}  # no Liger on a CPU (nor, here, installed)
    monkeypatch.setattr(module, "liger_ops",
                        lambda device: types.SimpleNamespace(LigerFusedLinearCrossEntropyFunction=RecordingFunction))
    references = spec.reference_modules("cuda")
    assert list(references) == ["Liger fused linear cross-entropy"]
    hidden, targets = torch.randn(2, 3, 8), torch.randint(0, 16, (2, 3))
    assert references["Liger fused linear cross-entropy"](hidden, targets).item() == 1.5
    (rows, weight, flat_targets, bias, class_weights, ignore_index), = calls
    assert torch.equal(rows, hidden.reshape(6, 8)) and weight is spec.weight and torch.equal(flat_targets, targets.reshape(6))
    assert bias is None and class_weights is None and ignore_index == -1


def test_inductor_kernels_names_each_generated_kernel_and_cuts_its_definition():
    from profiling.lessons import inductor_kernels

    module_source = ("import torch\n"
                     "cpp_fused_mul_0 = async_compile.cpp_pybinding(['float*'], '''\n    body 0\n''')\n"
                     "triton_poi_fused_1 = async_compile.triton('triton_', '''\n    body 1\n''')\n"
                     "async_compile.wait(globals())\n")
    kernels = inductor_kernels(module_source)
    assert list(kernels) == ["cpp_fused_mul_0", "triton_poi_fused_1"]
    assert kernels["cpp_fused_mul_0"].endswith("body 0\n''')") and "body 1" not in kernels["cpp_fused_mul_0"]
    assert kernels["triton_poi_fused_1"].endswith("body 1\n''')") and "wait" not in kernels["triton_poi_fused_1"]
    assert inductor_kernels("import torch\n") == {}


def test_cuda_kernel_sources_returns_every_global_function_whole():
    from profiling.lessons import cuda_kernel_sources

    text = (Path(__file__).parent.parent / "cuda_kernels" / "swish.cu").read_text()
    kernels = cuda_kernel_sources("swish.cu")
    assert len(kernels) == text.count("__global__") > 0
    for kernel in kernels:
        assert "__global__" in kernel and kernel.endswith("}") and kernel in text


def test_source_lines_cuts_a_function_from_one_marker_to_the_next_or_to_its_end():
    from profiling.lessons import source_lines
    from triton_kernels.attention_forward import merge_key_blocks

    own_lines = source_lines(source_lines, "lines = source.splitlines", "start = next")
    assert own_lines.strip().startswith("lines = source.splitlines") and "start = next" not in own_lines
    assert source_lines(source_lines, "end = len").strip().endswith('return "\\n".join(lines[start:end])')
    kernel_lines = source_lines(merge_key_blocks, "if EXP2", "row_sum = row_sum * rescale")  # a @triton.jit's Python
    assert kernel_lines.strip().startswith("if EXP2") and "tl.exp(row_max - shift)" in kernel_lines
    cuda_text = "__global__ void k() {\n  load();\n  for (;;) {\n    mma();\n  }\n  store();\n}"  # source as text
    assert source_lines(cuda_text, "for (;;)", "store();") == "  for (;;) {\n    mma();\n  }"


def test_the_layer_norm_host_path_is_timed_piece_by_piece():
    from profiling.host_path import layer_norm_pieces

    # Where level 4 runs: interpreted kernels on the CPU (a few calls each), or compiled ones on a GPU machine.
    rows = layer_norm_pieces(level_devices("triton")[0], torch.float32, budget_s=0.01)
    names = [what for what, _ in rows]
    assert names[:3] == ["4 Triton: forward with grad on", "4 Triton: forward + .backward()",
                         "1 native PyTorch: forward + .backward()"]
    assert len(names) == 8 and all(math.isfinite(us) and us > 0 for _, us in rows)


def test_the_hopper_sweep_keeps_the_tokens_and_the_model_width_of_every_point():
    from profiling.hopper import causal_flops, sequence_sweep_points

    points = sequence_sweep_points()
    assert [(seq, head_dim) for seq, _, _, head_dim in points] == [
        (seq, head_dim) for head_dim in (64, 128) for seq in (512, 1024, 2048, 4096, 8192, 16384)]
    assert all(seq * batch == 16384 and heads * head_dim == 2048 for seq, batch, heads, head_dim in points)
    assert points[0] == (512, 32, 32, 64) and points[-1] == (16384, 1, 16, 128)
    # FlashAttention-3's causal count: half of full attention's two matmuls.
    assert causal_flops(1, 1, 4, 8) == 4 * 4 * 4 * 8 // 2
    with pytest.raises(ValueError, match="sequence length 3000, head dim 96"):
        sequence_sweep_points(sequence_lengths=(1024, 3000), head_dims=(64, 96))


# What `ncu --csv --print-units base --print-metric-name name --metrics ...` prints: its progress lines,
# then the details page, one line per launch and metric, values with thousands separators.
NCU_OUTPUT = """==PROF== Connected to process 4242 (/usr/bin/python3.11)
==PROF== Profiling "attention_forward_tensor_core_kernel": 0%....50%....100% - 9 passes
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.11","127.0.0.1","void kernel_ladder::attention_forward_tensor_core_kernel<__nv_bfloat16, 128, 4>(kernel_ladder::AttentionShape, const T1 *, const T1 *, const T1 *, T1 *, float *)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,234,567"
"0","4242","python3.11","127.0.0.1","void kernel_ladder::attention_forward_tensor_core_kernel<__nv_bfloat16, 128, 4>(kernel_ladder::AttentionShape, const T1 *, const T1 *, const T1 *, T1 *, float *)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","launch__registers_per_thread","register/thread","230"
"0","4242","python3.11","127.0.0.1","void kernel_ladder::attention_forward_tensor_core_kernel<__nv_bfloat16, 128, 4>(kernel_ladder::AttentionShape, const T1 *, const T1 *, const T1 *, T1 *, float *)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","sm__inst_issued.avg.pct_of_peak_sustained_active","%","1,234.56"
"0","4242","python3.11","127.0.0.1","void kernel_ladder::attention_forward_tensor_core_kernel<__nv_bfloat16, 128, 4>(kernel_ladder::AttentionShape, const T1 *, const T1 *, const T1 *, T1 *, float *)","1","7","(128, 1, 1)","(4096, 1, 1)","0","9.0","Command line profiler metrics","smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio","","n/a"
"""


def test_ncu_csv_becomes_one_row_per_launch_and_one_float_column_per_metric():
    from profiling.hopper import parse_ncu_csv

    launches = parse_ncu_csv(NCU_OUTPUT)
    assert list(launches.columns) == ["kernel", "gpu__time_duration.sum", "launch__registers_per_thread",
                                      "sm__inst_issued.avg.pct_of_peak_sustained_active",
                                      "smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio"]
    launch = launches.iloc[0]
    assert len(launches) == 1 and launch["kernel"].startswith("void kernel_ladder::attention_forward_tensor_core_kernel<")
    assert launch["gpu__time_duration.sum"] == 1234567.0 and launch["launch__registers_per_thread"] == 230.0
    assert launch["sm__inst_issued.avg.pct_of_peak_sustained_active"] == pytest.approx(1234.56)
    assert math.isnan(launch["smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio"])
    # A second launch (ID 1) is a second row; the same metric of each stays with its own launch.
    second = NCU_OUTPUT.replace('"0","4242"', '"1","4242"').replace("1,234,567", "2,000")
    both = parse_ncu_csv(NCU_OUTPUT + "\n".join(second.splitlines()[4:]))
    assert list(both["gpu__time_duration.sum"]) == [1234567.0, 2000.0]


def test_an_ncu_run_without_counters_records_why_instead_of_failing():
    from profiling.hopper import format_ncu, ncu_result

    denied = ("==PROF== Connected to process 4242 (/usr/bin/python3.11)\n"
              "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission to access NVIDIA GPU Performance "
              "Counters on the target device 0.\n==PROF== Disconnected from process 4242\n")
    row = ncu_result("portable", denied, 0)
    assert row["status"].startswith("==ERROR== ERR_NVGPUCTRPERM") and row["kernel"] is None
    assert ncu_result("hopper", "", 1)["status"] == "ncu exited with 1 and profiled 0 launches, not 1"
    crashed = ncu_result("hopper", "Traceback (most recent call last):\nRuntimeError: no kernel image\n", 1)
    assert crashed["status"].endswith("not 1; its last line: RuntimeError: no kernel image")
    profiled = ncu_result("hopper", NCU_OUTPUT, 0)
    assert profiled["status"] == "ok" and profiled["launch__registers_per_thread"] == 230.0
    table = format_ncu(pd.DataFrame([profiled, row]))
    assert "registers per thread" in table and "230" in table and "ERR_NVGPUCTRPERM" in table


@pytest.mark.parametrize("name,kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel",
     "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "matmul"),
    ("_matmul_kernel", "matmul"),
    ("void kernel_ladder::attention_forward_hopper_kernel<__nv_bfloat16, 64>(CUtensorMap, AttentionShape, float*)",
     "attention"),
    ("void kernel_ladder::cross_entropy_rows_kernel<__nv_bfloat16>(...)", "loss"),
    ("void kernel_ladder::cross_entropy_staged_rows_kernel<__nv_bfloat16>(...)", "loss"),
    ("_cross_entropy_rows_kernel", "loss"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::LogSoftMaxForwardEpilogue>", "loss"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
     "namespace)::SoftMaxForwardEpilogue>", "attention"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
     "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}> >", "copy"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>", "copy"),
    ("Memset (Device)", "memset"),
    ("_layer_norm_fwd_kernel", "norm"),
    ("autograd::engine::evaluate_function: LayerNormBackward", "norm"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("triton_poi_fused_add_0", "elementwise"),
    ("_FeedForwardEagerBackward", "elementwise"),
    ("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<...>", "embedding"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<...>>>", "reduction"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("some_kernel_nobody_named", "other"),
])
def test_a_kernel_is_sorted_by_what_its_name_says_it_does(name, kind):
    from profiling.breakdown import kernel_kind

    assert kernel_kind(name) == kind


def test_a_training_step_breakdown_accounts_for_the_whole_step(tmp_path, capsys):
    """On the CPU every op's own time counts once (callees excluded), so the kinds add up to the step, and
    level 1's step has the matmuls, the attention and the loss a GPT must run."""
    from profiling.breakdown import breakdown

    table = breakdown(["gpt:native", "gpt:cuda"], "tiny", (2, 16), torch.float32, "cpu", steps=1, top=3, out=tmp_path)
    assert set(table["row"]) == {"gpt:native", "gpt:cuda"}
    native = table[table["row"] == "gpt:native"]
    assert {"matmul", "attention", "loss", "optimizer"} <= set(native["kind"])
    assert (native["ms_per_step"] >= 0).all() and native["share"].sum() == pytest.approx(1.0)
    assert native["ms_per_step"].sum() <= native["wall_ms"].iloc[0] * 1.01  # own times never exceed the step
    assert pd.read_csv(tmp_path / "breakdown.csv").shape == table.shape
    printed = capsys.readouterr().out
    assert "ms per training step by kind" in printed and "gpt:cuda" in printed


MEMCHECK_REPORT = """========= COMPUTE-SANITIZER
========= Invalid __shared__ read of size 512 bytes
=========     at _attention_fwd_kernel+0x1a30
=========     by thread (0,0,0) in block (3,0,0)
=========     Address 0x2400 is out of bounds
=========
========= ERROR SUMMARY: 10 errors
"""


def test_a_memcheck_report_gives_its_error_count_and_first_error():
    from profiling.sanitize import error_count, first_error

    assert error_count(MEMCHECK_REPORT) == 10
    assert first_error(MEMCHECK_REPORT) == "Invalid __shared__ read of size 512 bytes at _attention_fwd_kernel+0x1a30"
    assert error_count("========= COMPUTE-SANITIZER\nok\n========= ERROR SUMMARY: 0 errors\n") == 0
    assert error_count("========= ERROR SUMMARY: 1 error\n") == 1
    assert error_count("Killed\n") is None  # no closing line: not "no errors"


def test_every_memcheck_case_runs_forward_and_backward_at_both_levels_here():
    """Each child process of the sanitize part runs one case; here, without the sanitizer and in float32 (the
    interpreter has no bfloat16), a case of every component: the case table builds, feeds and differentiates
    each, which on a GPU memcheck then watches."""
    from profiling.sanitize import CASES, run_case

    components = {component: name for name, (component, _, shape) in CASES.items()
                  if "524288" not in name}  # a long row is minutes in the interpreter
    assert set(components) == {"attention", "layer_norm", "rms_norm", "softmax", "swish", "feed_forward",
                               "linear_cross_entropy"}
    for name in [*components.values(), "attention grouped heads", "attention causal head dim 72"]:
        for level in ("triton", "cuda"):
            run_case(name, level, torch.float32, torch.device("cpu"))


def test_the_sanitize_part_counts_each_cases_errors_in_a_process_of_its_own(tmp_path, monkeypatch):
    """The driver's table, with compute-sanitizer stood in for: one child per case, level and dtype; a report
    without a closing line (a timeout, a crash) is a row that says so, never a zero; spent time leaves rows
    that say they did not run."""
    import subprocess

    from profiling import sanitize

    calls = []

    def fake_run(command, capture_output, text, timeout):
        calls.append(command)
        case, level = command[command.index("--case") + 1], command[command.index("--level") + 1]
        if "72" in case and level == "triton":
            return subprocess.CompletedProcess(command, 1, MEMCHECK_REPORT, "")
        if "88" in case:
            raise subprocess.TimeoutExpired(command, timeout)
        return subprocess.CompletedProcess(command, 0, "ran\n========= ERROR SUMMARY: 0 errors\n", "")

    monkeypatch.setattr(sanitize.shutil, "which", lambda name: "/usr/local/cuda/bin/compute-sanitizer")
    monkeypatch.setattr(sanitize.subprocess, "run", fake_run)
    table = sanitize.sanitize_all(tmp_path, ["attention causal head dim 72", "attention causal head dim 88",
                                             "rms_norm rows of 70001"])
    assert (tmp_path / "sanitize.md").read_text() == table + "\n"
    assert len(calls) == 2 * 2 + 2 * 2  # two attention cases in bfloat16, RMSNorm in two dtypes; both levels
    assert all(call[:4] == ["/usr/local/cuda/bin/compute-sanitizer", "--tool", "memcheck", "--print-limit"]
               for call in calls)
    rows = table.splitlines()[2:]
    assert any(row.startswith("| attention causal head dim 72 | triton | bfloat16 | 10 |")
               and "Invalid __shared__ read of size 512 bytes at _attention_fwd_kernel" in row for row in rows)
    assert any(row.startswith("| attention causal head dim 72 | cuda | bfloat16 | 0 |") for row in rows)
    assert any(row.startswith("| attention causal head dim 88 | triton | bfloat16 | - |")
               and "did not finish" in row for row in rows)
    spent = sanitize.sanitize_all(tmp_path, ["swish"], budget_s=-1.0)
    assert all(row.endswith("not run: the part's -1 s were spent |") for row in spent.splitlines()[2:])
    monkeypatch.setattr(sanitize.shutil, "which", lambda name: None)
    assert "compute-sanitizer is not on PATH" in sanitize.sanitize_all(tmp_path)


@pytest.mark.parametrize("processes", [1, 4])
def test_the_sanitize_part_runs_its_cases_processes_at_a_time_and_reports_them_in_order(tmp_path, monkeypatch,
                                                                                         processes):
    """``processes`` children under the (stood-in) sanitizer at once, never more; the table keeps the cases'
    order whichever child finishes first."""
    import subprocess
    import threading
    import time

    from profiling import sanitize

    running, most, lock, first_wave_in = 0, 0, threading.Lock(), threading.Event()

    def fake_run(command, capture_output, text, timeout):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            if running == processes:
                first_wave_in.set()
        first_wave_in.wait(timeout=5)  # the first children wait for each other, however slowly threads start
        # The first case's children finish last, so finishing order and case order differ.
        time.sleep(0.2 if "head dim 40" in command[command.index("--case") + 1] else 0.0)
        with lock:
            running -= 1
        return subprocess.CompletedProcess(command, 0, "========= ERROR SUMMARY: 0 errors\n", "")

    monkeypatch.setattr(sanitize.shutil, "which", lambda name: "/usr/local/cuda/bin/compute-sanitizer")
    monkeypatch.setattr(sanitize.subprocess, "run", fake_run)
    names = ["attention causal head dim 40", "swish", "feed_forward", "attention grouped heads"]
    table = sanitize.sanitize_all(tmp_path, names, processes=processes)
    assert most == processes
    rows = table.splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [name for name in names for _ in sanitize.LEVELS]
