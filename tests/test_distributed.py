"""Two gloo processes on the CPU, each on half of every batch, end where one process on the whole batch
ends: the levels' ops work under DDP's gradient hooks and FSDP2's parameter sharding unchanged."""

import socket
import subprocess
import sys

import pandas as pd
import pytest
import torch
import torch.multiprocessing

from levels import TOLERANCE, relative_max_error
from profiling.distributed import (BLOCKS_PER_UNIT, EVERY_GATHER, each_alone_path, format_scaling_table,
                                  scaling_table, show_several_gpu_run, train_steps, two_process_worker)

from .conftest import level_devices

STEPS, BATCH, SEQ = 2, 4, 16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


LAUNCHER_UNITS = {"blocks_per_unit": BLOCKS_PER_UNIT, "reshard_after_forward": False}  # as main() wraps FSDP
# Every level that runs on the CPU here: level 4 does only without a GPU (its interpreter takes CPU tensors).
CASES = [pytest.param(level, strategy, EVERY_GATHER, id=f"{level}-{strategy}")
         for level in ("native", "torchscript", "compile", "triton", "cuda") if "cpu" in level_devices(level)
         for strategy in ("ddp", "fsdp")]
CASES += [pytest.param(level, "fsdp", LAUNCHER_UNITS, id=f"{level}-fsdp-as-launched")
          for level in ("native", "cuda")]  # level 5: the level the launcher measures


@pytest.mark.parametrize("level,strategy,fsdp_units", CASES)
def test_two_processes_on_half_batches_match_one_process_on_the_whole_batch(level, strategy, fsdp_units, tmp_path):
    path = tmp_path / "parameters.pt"
    torch.multiprocessing.spawn(two_process_worker, nprocs=2, args=(2, free_port(), level, strategy, STEPS, BATCH, SEQ,
                                                                    str(path), fsdp_units))
    together = torch.load(path)
    alone = train_steps(level, strategy, STEPS, BATCH, SEQ, wrap=False)
    assert together.keys() == alone.keys()
    for name, parameter in alone.items():
        error = relative_max_error(together[name], parameter)
        assert error <= TOLERANCE[torch.float64], f"{name}: relative error {error:.2e}"
    # The weights moved: steps that did nothing would match trivially.
    initial = train_steps(level, strategy, 0, BATCH, SEQ, wrap=False)
    assert any(not torch.equal(initial[name], alone[name]) for name in alone)


def test_fsdp_shards_the_matrices_and_leaves_the_vectors_whole_for_its_optimizer_to_average():
    """FSDP2's host work is per parameter, so it manages only the matrices (``replicated_parameters``);
    the vectors stay plain tensors on every process, and ``ShardedAdamW`` updates both kinds."""
    from torch.distributed.tensor import DTensor

    from profiling.distributed import (CONFIGS, ShardedAdamW, build_model, build_optimizer, one_process_group,
                                      replicated_parameters)

    with one_process_group():
        model = build_model("native", CONFIGS["tiny"], "fsdp", torch.device("cpu"))
        sharded = {name for name, parameter in model.named_parameters() if isinstance(parameter, DTensor)}
        matrices = {name for name, parameter in model.named_parameters() if parameter.dim() >= 2}
        assert sharded == matrices and "wte.weight" in sharded and "h.0.ln_1.bias" not in sharded
        assert replicated_parameters(model) == {parameter for name, parameter in model.named_parameters()
                                                if name not in matrices}
        optimizer = build_optimizer(model, "native")
        assert isinstance(optimizer, ShardedAdamW)
        assert len(optimizer.shards) + len(optimizer.replicated) == len(list(model.parameters()))


def test_the_lessons_host_cost_table_times_every_wrapping_and_counts_what_fsdp_manages():
    from profiling.distributed import THIN, WRAPPINGS, host_milliseconds_per_step

    table = host_milliseconds_per_step("native", steps=1, rounds=1)
    assert list(table.index) == list(WRAPPINGS)
    # 12 blocks: 148 parameters, 50 of them matrices; a unit per block and the root's, or one and the root's.
    assert table["parameters FSDP manages"].tolist() == [0, 0, 148, 148, 50] and THIN["n_layer"] == 12
    assert table["FSDP units"].tolist() == [0, 0, 13, 2, 2]
    assert (table["ms a step"] > 0).all() and table.loc["unwrapped", "over unwrapped"] == 0
    assert not torch.distributed.is_initialized()  # its one-process group is gone


def test_the_launcher_measures_one_process_then_all_in_one_run(tmp_path):
    """``torchrun -m profiling.distributed`` trains on process 0 alone, then on both, and prints the
    scaling efficiency of the two runs; rank 0's CSV holds every step of both. With ``--each-alone``
    both processes then train alone at once, and each one's rate is written beside the CSV."""
    csv = tmp_path / "steps.csv"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "profiling.distributed",
               "--level", "native", "--strategy", "ddp", "--device", "cpu", "--steps", "3", "--csv", str(csv),
               "--each-alone"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "scaling efficiency" in result.stdout and "each process alone, all at once" in result.stdout
    table = pd.read_csv(csv)
    assert table.groupby("processes")["step"].apply(list).to_dict() == {1: [0, 1, 2], 2: [0, 1, 2]}
    assert (table["seconds"] > 0).all() and table["loss"].notna().all()
    each_alone = pd.read_csv(each_alone_path(csv))
    assert each_alone["process"].tolist() == [0, 1] and (each_alone["tokens_per_s"] > 0).all()


def test_the_launcher_times_each_process_count_it_is_given_on_that_many_processes(tmp_path):
    """``--processes 2 3`` on three processes: a run on the first two, then one on all three, in one CSV;
    a count the launch cannot hold is refused before any training."""
    csv = tmp_path / "steps.csv"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "-m", "profiling.distributed",
              "--level", "native", "--strategy", "ddp", "--device", "cpu", "--steps", "2", "--csv", str(csv)]
    result = subprocess.run(launch + ["--processes", "3", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert pd.read_csv(csv).groupby("processes")["step"].apply(list).to_dict() == {2: [0, 1], 3: [0, 1]}
    refused = subprocess.run(launch + ["--processes", "1", "4"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "each count must be between 1 and 3" in refused.stderr


def test_scaling_table_rates_each_process_count_by_its_median_step_after_the_first_two():
    # 100 tokens a process; the first two steps of each run (compiling, building communicators) are left out.
    steps = pd.DataFrame({"processes": [1] * 5 + [2] * 5,
                          "seconds": [9.0, 9.0, 1.0, 2.0, 3.0] + [9.0, 9.0, 2.5, 2.5, 4.0]})
    table = scaling_table(steps, tokens_per_process=100).set_index("processes")
    assert table["tokens_per_s_per_process"].to_dict() == {1: 50.0, 2: 40.0}  # 100 / 2.0 s, 100 / 2.5 s
    assert table["tokens_per_s"].to_dict() == {1: 50.0, 2: 80.0}
    assert table["speedup"].tolist() == pytest.approx([1.0, 1.6])  # 80 / 50
    assert table["scaling_efficiency"].tolist() == pytest.approx([1.0, 0.8])  # 1.6 / 2
    shown = format_scaling_table(table.reset_index())
    assert "scaling efficiency" in shown and "80%" in shown and "1.60×" in shown
    # Without a one-process run there is nothing to compare with: no speedup, no efficiency.
    alone_missing = scaling_table(steps[steps["processes"] == 2], tokens_per_process=100)
    assert alone_missing["tokens_per_s"].tolist() == [80.0] and alone_missing["speedup"].isna().all()


def test_the_lesson_shows_a_several_gpu_run_or_the_command_that_makes_it(tmp_path, capsys):
    path = tmp_path / "distributed.csv"
    show_several_gpu_run(path)
    assert "no several-GPU run yet" in capsys.readouterr().out
    steps = pd.DataFrame({"processes": [1] * 3 + [2] * 3, "step": [0, 1, 2] * 2, "loss": 5.0,
                          "seconds": [9.0, 9.0, 2.0, 9.0, 9.0, 2.5]})
    steps.assign(level="cuda", strategy="ddp", config="gpt2-small", device="cuda", dtype="bfloat16", batch=8,
                 seq=1024).to_csv(path, index=False)
    show_several_gpu_run(path)
    shown = capsys.readouterr().out
    assert "ddp on cuda, level cuda, gpt2-small, bfloat16, 8 × 1024 tokens" in shown and "80%" in shown


def _launch_steps(strategy: str, seconds_alone: float, seconds_together: float) -> pd.DataFrame:
    """A launch's steps as ``profiling.distributed`` writes them: 3 steps alone, then 3 on 2 processes,
    100 tokens a process and step; the first two steps of each are left out of its rate."""
    return pd.DataFrame({"processes": [1] * 3 + [2] * 3, "step": [0, 1, 2] * 2, "loss": 5.0,
                         "seconds": [9.0, 9.0, seconds_alone, 9.0, 9.0, seconds_together]}).assign(
        strategy=strategy, level="cuda", config="gpt2-small", device="cuda", dtype="bfloat16", batch=10, seq=10)


def test_the_scaling_targets_are_judged_from_each_strategys_launch(tmp_path):
    from profiling.gpu_suite import check_scaling_targets

    # ddp: 50 tokens/s alone, 2 × 49 together: 1.96× (target 1.95, met). fsdp: 50 alone, 2 × 45: 1.80×
    # (target 1.85, missed); fsdp per process 45 against ddp's 49: 0.92× (target 0.8, met).
    steps = pd.concat([_launch_steps("ddp", 2.0, 100 / 49), _launch_steps("fsdp", 2.0, 100 / 45)])
    each_alone = pd.DataFrame({"process": [1, 0], "tokens_per_s": [47.0, 50.0], "strategy": "ddp"})
    report = check_scaling_targets(steps, tmp_path / "targets.md", "NVIDIA H200", each_alone)
    assert "| ddp on 2: ≥ 1.95× one's tokens/s | 1.96× | True |" in report
    assert "| fsdp on 2: ≥ 1.85× one's tokens/s | 1.80× | False |" in report
    assert "| fsdp on 2: tokens/s per process ≥ 0.8× ddp's | 0.92× | True |" in report
    assert "ddp, each process alone, all at once (its own one-process group, nothing to send): 50, 47 tokens/s" in report
    assert (tmp_path / "targets.md").read_text() == report


def test_the_gpu_suites_distributed_part_has_a_dry_run_on_the_cpu(tmp_path):
    """Both strategies launched through torchrun as on a several-GPU machine: every step of one process
    alone and of two, in one CSV, and the targets judged on them (on the CPU the numbers mean nothing)."""
    result = subprocess.run([sys.executable, "-m", "profiling.gpu_suite", "--part", "distributed", "--device", "cpu",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = pd.read_csv(tmp_path / "distributed.csv")
    assert sorted(steps.groupby(["strategy", "processes"]).size().items()) == [
        (("ddp", 1), 4), (("ddp", 2), 4), (("fsdp", 1), 4), (("fsdp", 2), 4)]
    assert (tmp_path / "targets-distributed.md").read_text().count("| ddp") == 1
    each_alone = pd.read_csv(tmp_path / "distributed-each-alone.csv")
    assert sorted(each_alone.groupby("strategy")["process"].apply(list).items()) == [("ddp", [0, 1]), ("fsdp", [0, 1])]


def test_the_breakdown_groups_each_runs_kernels_into_compute_communication_and_idle(tmp_path):
    from profiling.distributed import several_gpu_breakdown

    kernels = pd.DataFrame({"kernel": ["gemm", "ncclDevKernel_AllReduce", "idle", "layer_norm"],
                            "kind": ["matmul", "communication", "idle", "norm"], "ms_per_step": [5.0, 3.0, 1.5, 0.5]})
    kernels.to_csv(tmp_path / "breakdown-ddp-2.csv", index=False)
    kernels[kernels["kind"] != "communication"].to_csv(tmp_path / "breakdown-ddp-1.csv", index=False)
    table = several_gpu_breakdown(tmp_path)
    assert list(table.index) == ["ddp × 1", "ddp × 2"]
    assert table.loc["ddp × 2"].tolist() == [5.5, 3.0, 1.5]
    assert table.loc["ddp × 1"].tolist() == [5.5, 0.0, 1.5]
    assert several_gpu_breakdown(tmp_path / "nothing here").empty


def test_the_several_gpu_plot_draws_each_strategys_scaling_its_ideal_line_and_every_step(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from profiling.distributed import plot_several_gpu_run

    path = tmp_path / "distributed.csv"
    pd.concat([_launch_steps("ddp", 2.0, 2.5), _launch_steps("fsdp", 2.0, 4.0)]).to_csv(path, index=False)
    pd.DataFrame({"process": [0, 1], "tokens_per_s": [50.0, 45.0], "strategy": "ddp"}).to_csv(
        each_alone_path(path), index=False)
    scaling, spread = plot_several_gpu_run(path)
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in scaling.get_lines()}
    # 100 tokens a process and step: ddp 50 tokens/s alone, 2 × 40 together; fsdp 50, 2 × 25 (in thousands).
    assert drawn["ddp"] == ([1, 2], [0.05, 0.08]) and drawn["ddp: N × one GPU"] == ([1, 2], [0.05, 0.1])
    assert drawn["fsdp"] == ([1, 2], [0.05, 0.05]) and drawn["ddp: every GPU alone, at once"] == ([2], [0.095])
    assert "fsdp: every GPU alone, at once" not in drawn  # only ddp's rates were written
    assert [label.get_text() for label in spread.get_yticklabels()] == ["ddp × 1", "ddp × 2", "fsdp × 1", "fsdp × 2"]
