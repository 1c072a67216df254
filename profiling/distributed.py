"""The GPT at one level on several processes: data-parallel (DDP) or sharded (FSDP2), launched by torchrun.

    torchrun --nproc_per_node=2 -m profiling.distributed --level cuda --strategy ddp --config gpt2-small \\
        --device cuda --steps 20 --batch 8 --seq 1024 --csv ddp.csv
    torchrun --nproc_per_node=2 -m profiling.distributed --level native --strategy fsdp --device cpu   # gloo

Every process holds the whole model (DDP) or a 1/N shard of every block's parameters (FSDP2's
``fully_shard``, one unit per block and one for the rest), takes its 1/N of each global batch, and
after the backward the processes agree on the gradients: DDP all-reduces them (overlapped with the
backward, bucket by bucket), FSDP all-gathers each block's parameters before its forward and backward
and reduce-scatters its gradients after. The levels need no change for either: their ops see plain
tensors (DDP's gradient hooks fire on the parameters; FSDP gathers a block's parameters before the
block's forward runs), which ``step_on_slices`` and the two-process test check, parameter by parameter,
against one process on the whole batch.

Rank 0 shows a progress bar, prints tokens/s per process and in total, and writes a CSV of the loss
and time of every step. Scaling efficiency is a ratio of two runs, N processes against one, on the
same per-process batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist

import levels
from levels.gpt import GPT2_SMALL, TINY

# NCCL's NVLink multicast (NVLS) reserves a multicast buffer per communicator on NVSwitch machines,
# and some lent machines' drivers and containers fail or hang while setting it up; the collectives of
# a few processes gain little from it. Off in everything the course launches.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

CONFIGS = {"tiny": dict(TINY, block_size=64), "gpt2-small": GPT2_SMALL}
STRATEGIES = ("ddp", "fsdp")


def build_model(level: str, config: dict, strategy: str, device: torch.device, group=None) -> torch.nn.Module:
    """The GPT at ``level``, the same initial weights on every process (seed 0), wrapped for ``strategy``
    over ``group`` (default: every process)."""
    torch.manual_seed(0)
    model = levels.build("gpt", level, **config).to(device)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       process_group=group)
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    for block in model.h:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def build_optimizer(model: torch.nn.Module, level: str, strategy: str) -> torch.optim.Optimizer:
    """The level's AdamW under DDP (each process updates a whole replica); under FSDP the parameters
    are DTensor shards, which PyTorch's AdamW (multi-tensor) updates where they live."""
    if strategy == "ddp":
        return levels.build_optimizer(level, model.parameters(), lr=1e-3, weight_decay=0.0)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=True)


def global_batch(step: int, batch: int, seq: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch of ``batch`` random token windows and their next tokens, the same on
    every process (seeded by the step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def step_on_slices(model, optimizer, inputs: torch.Tensor, targets: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """One training step on this process's 1/world of the batch. The model's loss is a mean over its
    tokens, and DDP and FSDP average the gradients over the processes, so with equal slices the step
    is the one a single process takes on the whole batch."""
    per_process = inputs.shape[0] // world
    rows = slice(rank * per_process, (rank + 1) * per_process)
    optimizer.zero_grad(set_to_none=True)
    loss = model(inputs[rows], targets[rows])
    loss.backward()
    optimizer.step()
    return loss.detach()


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU: FSDP's shards gathered (a collective: call it on every process)."""
    gathered = {}
    for name, parameter in model.named_parameters():
        tensor = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
        gathered[name.removeprefix("module.")] = tensor.detach().cpu()
    return gathered


def train_steps(level: str, strategy: str, steps: int, batch: int, seq: int, rank: int = 0, world: int = 1,
                wrap: bool = True) -> dict[str, torch.Tensor]:
    """``steps`` steps of the tiny GPT on the CPU in float64, on this process's slice of each global
    batch of ``batch`` sequences, with ``strategy``'s optimizer; the whole parameters after them.
    ``wrap`` False: one process on the whole batch, no DDP or FSDP, the reference the processes must
    agree with. Float64, because AdamW's first steps divide a gradient by its own magnitude: a
    gradient near zero whose float32 sum over processes rounds the other way moves its weight by 2 × lr."""
    config = CONFIGS["tiny"]
    torch.set_default_dtype(torch.float64)  # built, wrapped and sharded in float64 from the start
    try:
        if wrap:
            model = build_model(level, config, strategy, torch.device("cpu"))
        else:
            torch.manual_seed(0)
            model = levels.build("gpt", level, **config)
    finally:
        torch.set_default_dtype(torch.float32)
    optimizer = build_optimizer(model, level, strategy)
    for step in range(steps):
        inputs, targets = global_batch(step, batch, seq, config["vocab_size"])
        step_on_slices(model, optimizer, inputs, targets, rank, world)
    return full_parameters(model)


def two_process_worker(rank: int, world: int, port: int, level: str, strategy: str, steps: int, batch: int, seq: int,
                       path: str) -> None:
    """One of ``world`` gloo processes (``torch.multiprocessing.spawn``): trains, and rank 0 saves the
    whole parameters to ``path``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parameters = train_steps(level, strategy, steps, batch, seq, rank, world)
    if rank == 0:
        torch.save(parameters, path)
    leave_process_group()


def leave_process_group() -> NoReturn:
    """Wait for every process, destroy the group and end this process. Called on success only: after
    an error the other processes may never reach the barrier, and torchrun or spawn ends them instead.

    Why the process ends here, without Python's shutdown: a gloo worker thread frees a finished
    collective (and the tensors it holds) only after the Python thread waiting on it has woken, and
    freeing a tensor Python has seen takes the GIL. When the main thread reaches interpreter shutdown
    first, Python stops any thread that asks for the GIL, here one inside a C++ destructor, and the
    process aborts ("terminate called without an active exception"): about one FSDP run in fifteen on
    a loaded 2-core machine. Every result is written by now, so the process flushes its output and
    exits at once, and the worker threads end with it."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m profiling.distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--level", default="cuda", help="native, torchscript, compile, triton, cuda or 1-5")
    parser.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    parser.add_argument("--config", choices=CONFIGS, default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=2, help="sequences per process and step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--no-baseline", dest="baseline", action="store_false",
                        help="skip the one-process run that scaling efficiency is measured against")
    parser.add_argument("--csv", help="rank 0 writes every step's loss and time here")
    return parser.parse_args(argv)


def timed_steps(arguments: argparse.Namespace, level: str, device: torch.device, group) -> list[dict]:
    """``arguments.steps`` training steps of a fresh model on the processes of ``group``, each on
    ``arguments.batch`` sequences a process; every step's loss (averaged over the group) and seconds."""
    from tqdm.auto import tqdm

    rank, processes = dist.get_rank(group), dist.get_world_size(group)
    config = CONFIGS[arguments.config]
    model = build_model(level, config, arguments.strategy, device, group)
    if arguments.dtype == "bfloat16":
        model.to(torch.bfloat16)
    optimizer = build_optimizer(model, level, arguments.strategy)
    records = []
    for step in tqdm(range(arguments.steps), desc=f"{arguments.strategy} × {processes}, level {level}",
                     disable=rank != 0):
        inputs, targets = global_batch(step, arguments.batch * processes, arguments.seq, config["vocab_size"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = step_on_slices(model, optimizer, inputs.to(device), targets.to(device), rank, processes)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)  # also waits for the step on every process
        records.append({"processes": processes, "step": step, "loss": loss.item(),
                        "seconds": time.perf_counter() - start})
    return records


def tokens_per_second(table, processes: int, tokens_per_process: int) -> float:
    """Tokens a second per process of the run on ``processes`` processes: the median step after the
    first two, which compile, autotune and build communicators."""
    seconds = table.loc[table["processes"] == processes, "seconds"]
    return tokens_per_process / seconds.iloc[min(2, len(seconds) - 1):].median()


def main(argv=None) -> NoReturn:
    """Train on every process; first, unless ``--no-baseline``, on process 0 alone (its own one-process
    group, wrapped the same way) while the others wait, so that scaling efficiency, tokens/s on N
    processes over N × one process's, comes from one launch on one machine."""
    import pandas as pd

    arguments = parse_arguments(argv)
    level = levels.resolve_level(arguments.level)
    backend = "nccl" if arguments.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(arguments.device, int(os.environ.get("LOCAL_RANK", 0))) if arguments.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    records = []
    if arguments.baseline and world > 1:
        alone = dist.new_group([0])  # every process takes part in creating a group, members or not
        if rank == 0:
            records += timed_steps(arguments, level, device, alone)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the baseline's model and optimizer state are garbage by now
        dist.barrier()
    records += timed_steps(arguments, level, device, dist.group.WORLD)
    if rank == 0:
        table = pd.DataFrame(records).assign(level=level, strategy=arguments.strategy, config=arguments.config,
                                             device=arguments.device, dtype=arguments.dtype)
        tokens = arguments.batch * arguments.seq
        together = tokens_per_second(table, world, tokens)
        last = table[table["processes"] == world]["loss"]
        print(f"{arguments.strategy} on {world} × {arguments.device}, level {level}: {together:,.0f} tokens/s per "
              f"process, {world * together:,.0f} in total; loss {last.iloc[0]:.3f} -> {last.iloc[-1]:.3f}")
        if (table["processes"] == 1).any() and world > 1:
            alone_rate = tokens_per_second(table, 1, tokens)
            print(f"one process alone: {alone_rate:,.0f} tokens/s; {world} processes: {world * together / alone_rate:.2f}× "
                  f"it, scaling efficiency {together / alone_rate:.0%}")
        if arguments.csv:
            table.to_csv(arguments.csv, index=False)
    leave_process_group()


if __name__ == "__main__":
    main()
