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
from profiling.distributed import train_steps, two_process_worker

STEPS, BATCH, SEQ = 2, 4, 16


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("level", ["native", "torchscript", "compile", "triton", "cuda"])
def test_two_processes_on_half_batches_match_one_process_on_the_whole_batch(level, strategy, tmp_path):
    path = tmp_path / "parameters.pt"
    torch.multiprocessing.spawn(two_process_worker, args=(2, free_port(), level, strategy, STEPS, BATCH, SEQ, str(path)),
                                nprocs=2)
    together = torch.load(path)
    alone = train_steps(level, strategy, STEPS, BATCH, SEQ, wrap=False)
    assert together.keys() == alone.keys()
    for name, parameter in alone.items():
        error = relative_max_error(together[name], parameter)
        assert error <= TOLERANCE[torch.float64], f"{name}: relative error {error:.2e}"
    # The weights moved: steps that did nothing would match trivially.
    initial = train_steps(level, strategy, 0, BATCH, SEQ, wrap=False)
    assert any(not torch.equal(initial[name], alone[name]) for name in alone)


def test_the_launcher_measures_one_process_then_all_in_one_run(tmp_path):
    """``torchrun -m profiling.distributed`` trains on process 0 alone, then on both, and prints the
    scaling efficiency of the two runs; rank 0's CSV holds every step of both."""
    csv = tmp_path / "steps.csv"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "profiling.distributed",
               "--level", "native", "--strategy", "ddp", "--device", "cpu", "--steps", "3", "--csv", str(csv)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "scaling efficiency" in result.stdout
    table = pd.read_csv(csv)
    assert table.groupby("processes")["step"].apply(list).to_dict() == {1: [0, 1, 2], 2: [0, 1, 2]}
    assert (table["seconds"] > 0).all() and table["loss"].notna().all()
