"""The GPT at one level on several processes: data-parallel (DDP) or sharded (FSDP2), launched by torchrun.

    torchrun --nproc_per_node=2 -m profiling.distributed --level cuda --strategy ddp --config gpt2-small \\
        --device cuda --steps 20 --batch 8 --seq 1024 --csv ddp.csv
    torchrun --nproc_per_node=2 -m profiling.distributed --level native --strategy fsdp --device cpu   # gloo

Every process holds the whole model (DDP) or a 1/N shard of every matrix (FSDP2's ``fully_shard``, units
of ``BLOCKS_PER_UNIT`` blocks, all of GPT-2 small's in one, and one for the rest; the vectors,
``replicated_parameters``, stay whole on every process), takes its 1/N of each global batch, and after
the backward the processes agree on the gradients: DDP all-reduces them (overlapped with the backward,
bucket by bucket), FSDP all-gathers each unit's parameters before its forward (and, with
``--reshard-after-forward``, again before its backward) and reduce-scatters its gradients after, and the
vectors' gradients are averaged in one all-reduce before the optimizer's step. The levels need no change
for either: their ops see plain tensors (DDP's gradient hooks fire on the parameters; FSDP gathers a
unit's parameters before its forward runs), which ``step_on_slices`` and the two-process test check,
parameter by parameter, against one process on the whole batch.

Rank 0 shows a progress bar, prints ``scaling_table`` (tokens/s per process and in total, speedup and
scaling efficiency) and writes a CSV of the loss and time of every step. ``--each-alone`` adds a last
run in which every process trains alone at once: what sharing the machine costs, with nothing sent. Scaling efficiency is a ratio
of two runs, N processes against one, on the same per-process batch; ``show_several_gpu_run`` prints
the table of the committed several-GPU run, which lesson 11 shows.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import pandas as pd
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


BLOCKS_PER_UNIT = 12
"""Blocks FSDP gathers and reshards together: GPT-2 small's twelve in one unit, beside the root's
(embeddings, final norm, LM head). FSDP2's bookkeeping costs host time per unit and per parameter on
every step (hooks, DTensor views, copies into and out of the communication buffers), and a level-5
GPT-2 step of 8 × 1024 tokens keeps an H100 busy for only about 20 ms, so the host, not the GPU or
the NVLink, sets the pace. Kept gathered from forward to backward (``build_model``), units of four
blocks hold every weight at the step's peak as one unit of twelve does: fewer units cost no memory,
only the overlap of the first all-gather and the last reduce-scatter with compute (GPT-2 small's
170 MB over NVLink: well under a millisecond each). On 2 × H100, one unit gave FSDP more tokens/s
per GPU than units of four in both rounds of an alternated A/B (``profiling/results/h100x2/README.md``)."""


BUCKET_MB = 100
"""DDP's bucket size (see build_model)."""


def build_model(level: str, config: dict, strategy: str | None, device: torch.device, group=None,
                dtype: torch.dtype | None = None, blocks_per_unit: int = BLOCKS_PER_UNIT,
                reshard_after_forward: bool = False, bucket_mb: float = BUCKET_MB,
                replicate_vectors: bool = True) -> torch.nn.Module:
    """The GPT at ``level``, the same initial weights on every process (seed 0), moved to ``device``
    and ``dtype`` and then wrapped for ``strategy`` over ``group`` (default: every process); with
    ``strategy`` None, not wrapped. Moved first, because both wrappers lay out memory for the
    parameters as they find them: DDP its gradient buckets, FSDP its shards.

    FSDP shards every ``blocks_per_unit`` blocks as one unit, and the embeddings, final norm and LM
    head as the root's. ``reshard_after_forward`` False keeps a unit's gathered parameters from its
    forward to its backward (one all-gather a step instead of two: the memory of the whole
    parameters for a third less traffic; gradients and optimizer state stay sharded either way).
    ``replicate_vectors`` False shards every parameter, the vectors too (``replicated_parameters``)."""
    torch.manual_seed(0)
    model = levels.build("gpt", level, **config).to(device, dtype)
    if strategy is None:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # gradient_as_bucket_view: the gradients live in the all-reduce buckets, saving a copy of
        # each one a step. static_graph: the same parameters get gradients every step, so DDP
        # stops searching the graph for unused ones. 100 MB buckets: GPT-2 small's 250 MB of bf16
        # gradients go in 2 all-reduces a step instead of 7 (the profiles on 2 × H200 counted them),
        # less host work per step; NVLink moves 100 MB in well under a millisecond, so the last
        # bucket's wait after the backward stays short (25 MB buckets, tried on 4 × H100, scaled the
        # same within the run-to-run spread).
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      process_group=group, gradient_as_bucket_view=True, static_graph=True,
                                      bucket_cap_mb=bucket_mb)
        # Without a hook, the reducer divides every gradient by the number of processes as it lands in
        # its bucket: one small kernel per parameter (148 for GPT-2 small), launched from the backward's
        # thread while that thread should be launching the backward. The built-in all-reduce hook (C++)
        # divides each bucket once, whole, before its all-reduce: 2 kernels a step instead of 148 (profiled).
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        return ddp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    blocks, replicated = list(model.h), replicated_parameters(model) if replicate_vectors else set()
    for first in range(0, len(blocks), blocks_per_unit):
        fully_shard(blocks[first:first + blocks_per_unit], mesh=mesh, reshard_after_forward=reshard_after_forward,
                    ignored_params=replicated)
    return fully_shard(model, mesh=mesh, ignored_params=replicated)


def replicated_parameters(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """The parameters FSDP leaves whole on every process: the vectors (norms' weights and biases, the
    linear layers' biases), 98 of GPT-2 small's 148 parameters and 0.1 % of its elements.

    FSDP2 spends host time on every parameter it manages, every step: it builds a DTensor for each shard and
    each gradient, points each module at the gathered or the sharded tensor, and sizes each one's storage up and
    down. For GPT-2 small's 148 parameters on one H100 that added nearly as much host time as the GPU spends on
    the whole step (``profiling/results/h100x4/README.md``). Sharding a vector of 768 numbers saves a few
    kilobytes and costs as much host time as sharding a matrix. So, as DeepSpeed's ZeRO-3 keeps parameters under
    its "persistence threshold" whole, these stay replicated, and ``ShardedAdamW`` averages their gradients
    itself."""
    return {parameter for parameter in model.parameters() if parameter.dim() < 2}


class ShardedAdamW:
    """The level's AdamW over this process's shards of FSDP2's parameters and over the replicated ones
    (``replicated_parameters``), whose gradients it first averages over the processes.

    FSDP2's parameters are DTensors: every op on one goes through DTensor's Python dispatch, which
    works out the result's sharding before it runs the op on the local shard. An optimizer step is a
    dozen small ops on each of ~150 tensors, so that bookkeeping, not memory traffic, would set its
    speed. The shards underneath are plain tensors, the parameters' own storage; the level's AdamW updates
    them in place (level 4 in one Triton launch, level 5 in one multi-tensor apply), with no DTensor
    in sight, and the DTensors see the new values because they share that storage."""

    def __init__(self, model: torch.nn.Module, level: str, **hyperparameters):
        from torch.distributed.tensor import DTensor

        self.parameters = list(model.parameters())
        sharded = [parameter for parameter in self.parameters if isinstance(parameter, DTensor)]
        self.replicated = [parameter for parameter in self.parameters if not isinstance(parameter, DTensor)]
        self.group = sharded[0].device_mesh.get_group()
        # to_local(): the shard as a plain tensor over the parameter's storage; detach(): a leaf the
        # optimizer may update in place. A process whose shard of a small tensor is empty skips it.
        shards = {parameter: parameter.to_local().detach() for parameter in sharded}
        self.shards = {parameter: shard for parameter, shard in shards.items() if shard.numel()}
        self.optimizer = levels.build_optimizer(level, [*self.shards.values(), *self.replicated], **hyperparameters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    @torch.no_grad()
    def step(self) -> None:
        # Grad mode off, as in torch.optim's steps; it also makes to_local() an attribute read instead of
        # an autograd Function's call, one a shard and step.
        for parameter, shard in self.shards.items():
            shard.grad = None if parameter.grad is None else parameter.grad.to_local()
        self.average_replicated_gradients()
        self.optimizer.step()

    def average_replicated_gradients(self) -> None:
        """Every process's gradients of the replicated parameters, averaged, in one all-reduce: a
        hundred tensors of a few kilobytes each would pay a collective's latency a hundred times. A
        sum and a division, because gloo has no average."""
        with_gradient = [parameter for parameter in self.replicated if parameter.grad is not None]
        if not with_gradient:
            return
        flat = torch.cat([parameter.grad.reshape(-1) for parameter in with_gradient])
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        sizes = [parameter.numel() for parameter in with_gradient]
        for parameter, averaged in zip(with_gradient, flat.split(sizes)):
            parameter.grad = averaged.view_as(parameter)


def build_optimizer(model: torch.nn.Module, level: str):
    """The level's AdamW: over the whole parameters of a plain or DDP-wrapped model, over this
    process's shards of an FSDP-sharded one (``ShardedAdamW``)."""
    from torch.distributed.fsdp import FSDPModule

    hyperparameters = dict(lr=1e-3, weight_decay=0.0)
    if isinstance(model, FSDPModule):
        return ShardedAdamW(model, level, **hyperparameters)
    return levels.build_optimizer(level, model.parameters(), **hyperparameters)


THIN = {"vocab_size": 64, "n_layer": 12, "n_head": 2, "n_embd": 32, "block_size": 16}
"""GPT-2 small's twelve blocks and 148 parameters at a width that leaves the CPU almost nothing to
compute: a training step's time is then the host's work around the kernels."""

WRAPPINGS = {
    "unwrapped": (None, {}),
    "DDP": ("ddp", {}),
    "FSDP, a unit a block, every parameter sharded": ("fsdp", {"blocks_per_unit": 1, "replicate_vectors": False}),
    "FSDP, one unit, every parameter sharded": ("fsdp", {"replicate_vectors": False}),
    "FSDP, one unit, vectors replicated (launched)": ("fsdp", {}),
}
"""The wrappings ``host_milliseconds_per_step`` compares: (strategy, ``build_model``'s other arguments)."""


@contextlib.contextmanager
def one_process_group():
    """A gloo process group of this process alone, for the length of the block: enough to build and
    step DDP or FSDP without torchrun or a second process. Call it where no group exists."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def host_milliseconds_per_step(level: str = "cuda", steps: int = 20, rounds: int = 3) -> pd.DataFrame:
    """What each of ``WRAPPINGS`` adds to a training step's host work: the ``THIN`` GPT at ``level`` on the CPU,
    one gloo process (``one_process_group``), a batch of 8 tokens. Per wrapping: the parameters FSDP manages
    and its units, and the ms of a step, the fastest of ``rounds`` rounds of ``steps`` steps, the wrappings
    taking turns within each round so that a busy moment of the machine falls on all of them alike."""
    from torch.distributed.tensor import DTensor

    with one_process_group():
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, THIN["vocab_size"], (1, 9), generator=generator)
        trainers, rows = {}, {}
        for name, (strategy, arguments) in WRAPPINGS.items():
            model = build_model(level, THIN, strategy, torch.device("cpu"), **arguments)
            optimizer = build_optimizer(model, level)
            trainers[name] = lambda model=model, optimizer=optimizer: step_on_slices(
                model, optimizer, tokens[:, :-1], tokens[:, 1:], 0, 1)
            sharded = sum(isinstance(parameter, DTensor) for parameter in model.parameters())
            # the root's unit and one a group of blocks
            blocks_per_unit = arguments.get("blocks_per_unit", BLOCKS_PER_UNIT)
            units = 1 + math.ceil(THIN["n_layer"] / blocks_per_unit) if strategy == "fsdp" else 0
            rows[name] = {"FSDP units": units, "parameters FSDP manages": sharded, "ms a step": float("inf")}
        for train in trainers.values():
            train()  # first calls: allocations, DDP's static graph, FSDP's lazy init
        for _ in range(rounds):
            for name, train in trainers.items():
                start = time.perf_counter()
                for _ in range(steps):
                    train()
                rows[name]["ms a step"] = min(rows[name]["ms a step"], (time.perf_counter() - start) / steps * 1e3)
    table = pd.DataFrame.from_dict(rows, orient="index")
    table["over unwrapped"] = table["ms a step"] - table.loc["unwrapped", "ms a step"]
    return table


def global_batch(step: int, batch: int, seq: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s whole batch of ``batch`` random token windows and their next tokens, the same on
    every process (seeded by the step)."""
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab_size, (batch, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def backward_on_slice(model, inputs: torch.Tensor, targets: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Forward and backward on process ``rank``'s 1/world of the batch; its mean loss over those tokens."""
    per_process = inputs.shape[0] // world
    rows = slice(rank * per_process, (rank + 1) * per_process)
    loss = model(inputs[rows], targets[rows])
    loss.backward()
    return loss.detach()


def step_on_slices(model, optimizer, inputs: torch.Tensor, targets: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """One training step on this process's 1/world of the batch. The model's loss is a mean over its
    tokens, and DDP and FSDP average the gradients over the processes, so with equal slices the step
    is the one a single process takes on the whole batch."""
    optimizer.zero_grad(set_to_none=True)
    loss = backward_on_slice(model, inputs, targets, rank, world)
    optimizer.step()
    return loss


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on the CPU: FSDP's shards gathered (a collective: call it on every process)."""
    gathered = {}
    for name, parameter in model.named_parameters():
        tensor = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
        gathered[name.removeprefix("module.")] = tensor.detach().cpu()
    return gathered


EVERY_GATHER = {"blocks_per_unit": 1, "reshard_after_forward": True}
"""FSDP wrapped so that it does every gather and reshard it can: one unit per block, each resharded after
its forward and gathered again for its backward. What the two-process checks use unless told otherwise."""


def train_steps(level: str, strategy: str, steps: int, batch: int, seq: int, rank: int = 0, world: int = 1,
                wrap: bool = True, fsdp_units: dict = EVERY_GATHER) -> dict[str, torch.Tensor]:
    """``steps`` steps of the tiny GPT on the CPU in float64, on this process's slice of each global
    batch of ``batch`` sequences, with the level's AdamW; the whole parameters after them. FSDP's
    units as ``fsdp_units`` says (``build_model``'s blocks_per_unit and reshard_after_forward).
    ``wrap`` False: one process on the whole batch, no DDP or FSDP, the reference the processes must
    agree with. Float64, because AdamW's first steps divide a gradient by its own magnitude: a
    gradient near zero whose float32 sum over processes rounds the other way moves its weight by 2 × lr."""
    config = CONFIGS["tiny"]
    model = build_model(level, config, strategy if wrap else None, torch.device("cpu"), dtype=torch.float64,
                        **fsdp_units)
    optimizer = build_optimizer(model, level)
    for step in range(steps):
        inputs, targets = global_batch(step, batch, seq, config["vocab_size"])
        step_on_slices(model, optimizer, inputs, targets, rank, world)
    return full_parameters(model)


def two_process_worker(rank: int, world: int, port: int, level: str, strategy: str, steps: int, batch: int, seq: int,
                       path: str, fsdp_units: dict = EVERY_GATHER) -> None:
    """One of ``world`` gloo processes (``torch.multiprocessing.spawn``): trains, and rank 0 saves the
    whole parameters to ``path``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parameters = train_steps(level, strategy, steps, batch, seq, rank, world, fsdp_units=fsdp_units)
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
    parser.add_argument("--processes", type=int, nargs="+", metavar="N",
                        help="the process counts to time, one after another, each on the first N processes of the "
                             "launch (default: 1 and all of them; scaling efficiency is measured against 1)")
    parser.add_argument("--blocks-per-unit", type=int, default=BLOCKS_PER_UNIT,
                        help="FSDP: blocks gathered and resharded together")
    parser.add_argument("--reshard-after-forward", action="store_true",
                        help="FSDP: free each unit's gathered parameters after its forward and gather them "
                             "again for its backward (less memory, a third more traffic)")
    parser.add_argument("--shard-vectors", action="store_true",
                        help="FSDP: shard the vectors too (norms' weights and biases, linear biases), which "
                             "replicated_parameters otherwise leaves whole on every process")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="DDP: megabytes of gradients a bucket "
                        "(an all-reduce) holds")
    parser.add_argument("--each-alone", action="store_true",
                        help="last, every process trains alone at the same time, each on its own one-process group: "
                             "what sharing the machine costs with nothing sent (with --csv, written beside it)")
    parser.add_argument("--csv", help="rank 0 writes every step's loss and time here")
    parser.add_argument("--breakdown", metavar="DIR",
                        help="after each run's timed steps, profile 3 more (profiling.breakdown); rank 0 prints "
                             "where the GPU's time went and writes DIR/breakdown-<strategy>-<processes>.csv")
    return parser.parse_args(argv)


def timed_steps(arguments: argparse.Namespace, level: str, device: torch.device, group) -> list[dict]:
    """``arguments.steps`` training steps of a fresh model on the processes of ``group``, each on
    ``arguments.batch`` sequences a process; every step's loss (averaged over the group) and seconds.

    The steps run back to back, as in a training loop that reads its loss only when it logs: the host
    queues a step while the GPU still runs the one before. A step that synchronised (``loss.item()``)
    would leave every GPU idle while its host launches the next step's first kernels, and make the
    processes meet at each step's collectives as late as the slowest host's moment of jitter (Python,
    the wrappers' hooks, the OS) makes them; queued ahead, a host's jitter is absorbed while its GPU
    works. (Inside a level-4 or level-5 step the host waits once: the loss's check of its targets' range
    reads a copy queued after the forward, with the loss's kernels already queued behind it; so the host
    runs at most a forward ahead.) Each step's time is read on the GPU's stream (``seconds_per_run``), and
    the batches are on the device before the first step, so no copy from the host waits inside one."""
    from tqdm.auto import tqdm

    from .timing import seconds_per_run

    rank, processes = dist.get_rank(group), dist.get_world_size(group)
    config = CONFIGS[arguments.config]
    model = build_model(level, config, arguments.strategy, device, group, getattr(torch, arguments.dtype),
                        blocks_per_unit=arguments.blocks_per_unit,
                        reshard_after_forward=arguments.reshard_after_forward, bucket_mb=arguments.bucket_mb,
                        replicate_vectors=not arguments.shard_vectors)
    optimizer = build_optimizer(model, level)
    batches = [[tensor.to(device) for tensor in global_batch(step, arguments.batch * processes, arguments.seq,
                                                             config["vocab_size"])] for step in range(arguments.steps)]
    losses = []
    progress = tqdm(total=arguments.steps, desc=f"{arguments.strategy} × {processes}, level {level}", disable=rank != 0)

    def step() -> None:
        inputs, targets = batches[len(losses)]
        loss = step_on_slices(model, optimizer, inputs, targets, rank, processes)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)  # queued on the GPU: nothing waits for it here
        losses.append(loss)
        progress.update()

    seconds = seconds_per_run(step, device, arguments.steps)
    progress.close()
    if arguments.breakdown:
        show_breakdown(lambda: step_on_slices(model, optimizer, *batches[-1], rank, processes),
                       device, Path(arguments.breakdown) / f"breakdown-{arguments.strategy}-{processes}.csv", rank)
    return [{"processes": processes, "step": index, "loss": loss.item(), "seconds": step_seconds}
            for index, (loss, step_seconds) in enumerate(zip(losses, seconds))]


def show_breakdown(step, device: torch.device, path: Path, rank: int) -> None:
    """Profile ``step`` on every process (each must step, or the collectives wait forever); rank 0
    prints the GPU's time by kind of work, communication included, and writes the kernels to ``path``.
    NCCL's kernels run beside the compute they overlap, so the kinds may add up to more than the step."""
    from .breakdown import kernel_times, kinds_side_by_side

    table = kernel_times(step, device)
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        table.to_csv(path, index=False)
        print(f"{path.stem}: {table.attrs['wall_ms']:.1f} ms a step; ms a step by kind of work:")
        print(kinds_side_by_side({path.stem: table}).round(2).to_string())


def tokens_per_second(table, processes: int, tokens_per_process: int) -> float:
    """Tokens a second per process of the run on ``processes`` processes: the median step after the
    first two, which compile, autotune and build communicators."""
    seconds = table.loc[table["processes"] == processes, "seconds"]
    return tokens_per_process / seconds.iloc[min(2, len(seconds) - 1):].median()


def scaling_table(steps: pd.DataFrame, tokens_per_process: int) -> pd.DataFrame:
    """One row per process count in ``steps`` (``main``'s records): tokens/s per process and in total,
    the speedup of the total over one process's, and scaling efficiency, that speedup over the number
    of processes (100 %: every process as fast as one alone). Without a one-process run the last two
    are NaN."""
    table = pd.DataFrame({"processes": sorted(steps["processes"].unique())})
    table["tokens_per_s_per_process"] = [tokens_per_second(steps, processes, tokens_per_process)
                                         for processes in table["processes"]]
    table["tokens_per_s"] = table["processes"] * table["tokens_per_s_per_process"]
    alone = table.loc[table["processes"] == 1, "tokens_per_s"]
    table["speedup"] = table["tokens_per_s"] / (alone.iloc[0] if len(alone) else float("nan"))
    table["scaling_efficiency"] = table["speedup"] / table["processes"]
    return table


SCALING_FORMATS = {"processes": ("processes", "{:d}"), "tokens_per_s_per_process": ("tokens/s per process", "{:,.0f}"),
                   "tokens_per_s": ("tokens/s in total", "{:,.0f}"), "speedup": ("speedup", "{:.2f}×"),
                   "scaling_efficiency": ("scaling efficiency", "{:.0%}")}


def format_scaling_table(table: pd.DataFrame) -> str:
    """``scaling_table``'s rows as text, each column rounded to what it can tell."""
    shown = {heading: [("—" if pd.isna(value) else style.format(value)) for value in table[column]]  # —: no baseline
             for column, (heading, style) in SCALING_FORMATS.items()}
    return pd.DataFrame(shown).to_string(index=False)


SEVERAL_GPU_RUN = Path(__file__).parent / "results" / "h100x4" / "distributed.csv"
"""Where the lesson looks for a launch on several GPUs (the GPU suite's distributed part writes it)."""

SEVERAL_GPU_COMMAND = "python -m profiling.gpu_suite --part distributed --out profiling/results/h100x4"
"""DDP and FSDP2 of GPT-2 small at level 5 in bf16 on one GPU, then 2, 4, ... and all (gpu_suite)."""


def show_several_gpu_run(path: Path = SEVERAL_GPU_RUN) -> None:
    """Print the scaling table of every run in ``path``, or, where no several-GPU run exists yet, the
    command that makes one."""
    if not path.exists():
        print("no several-GPU run yet. On a machine with 2 or more GPUs, this command, from the repository's root, "
              f"makes the one shown here:\n  {SEVERAL_GPU_COMMAND}")
        return
    steps = pd.read_csv(path)
    for (strategy, level, config, device, dtype, batch, seq), run in steps.groupby(
            ["strategy", "level", "config", "device", "dtype", "batch", "seq"]):
        print(f"{strategy} on {device}, level {level}, {config}, {dtype}, {batch} × {seq} tokens a process and step:")
        print(format_scaling_table(scaling_table(run, batch * seq)))


def plot_several_gpu_run(path: Path = SEVERAL_GPU_RUN, axes=None):
    """``path``'s run (``show_several_gpu_run``) in two panels. Left: tokens/s in total against the
    number of GPUs, for each strategy beside its line of perfect scaling from one GPU's rate and, where
    ``--each-alone`` ran (``each_alone_path``), a star at the sum of every GPU's rate alone at once:
    the GPUs with nothing to send but the host shared. Right: every step's time after the first two,
    one row per strategy and GPU count, a tick per step and a dot at the median."""
    import matplotlib.pyplot as plt

    steps = pd.read_csv(path)
    alone_path = each_alone_path(path)
    each_alone = pd.read_csv(alone_path) if alone_path.exists() else pd.DataFrame(columns=["strategy", "tokens_per_s"])
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    scaling, spread = axes
    for (strategy, run), color in zip(steps.groupby("strategy"), ("tab:blue", "tab:orange", "tab:green")):
        table = scaling_table(run, int(run["batch"].iloc[0] * run["seq"].iloc[0]))
        one_gpu = table.loc[table["processes"] == 1, "tokens_per_s"].iloc[0]
        scaling.plot(table["processes"], table["tokens_per_s"] / 1e3, "o-", color=color, label=strategy)
        scaling.plot(table["processes"], table["processes"] * one_gpu / 1e3, ":", color=color,
                     label=f"{strategy}: N × one GPU")
        alone = each_alone.loc[each_alone["strategy"] == strategy, "tokens_per_s"]
        if len(alone):
            scaling.plot([len(alone)], [alone.sum() / 1e3], "*", markersize=12, color=color,
                         label=f"{strategy}: every GPU alone, at once")
    scaling.set(xlabel="GPUs", ylabel="thousand tokens/s in total", xticks=sorted(steps["processes"].unique()))
    scaling.legend(fontsize="small")
    labels = []
    for row, ((strategy, processes), run) in enumerate(steps.groupby(["strategy", "processes"])):
        milliseconds = run["seconds"].iloc[2:] * 1e3  # as scaling_table: the first two steps warm up
        spread.plot(milliseconds, [row] * len(milliseconds), "|", markersize=10, color="tab:gray")
        spread.plot([milliseconds.median()], [row], "o", color="black")
        labels.append(f"{strategy} × {processes}")
    spread.set_yticks(range(len(labels)), labels)
    spread.invert_yaxis()
    spread.set_xlabel("ms per step (ticks: steps, dot: median)")
    return axes


TIME_GROUPS = {"communication": "communication", "idle": "idle (the GPU waits for the host)"}
"""How ``several_gpu_breakdown`` groups the profile's kinds of work: these two apart, the rest as compute."""


def several_gpu_breakdown(folder: Path = SEVERAL_GPU_RUN.parent) -> pd.DataFrame:
    """ms per step of device time in each run profiled beside ``folder``'s several-GPU run (its
    ``breakdown-<strategy>-<processes>.csv``), one row per run (``ddp × 2``, ...), one column per group:
    compute (every kernel that is not NCCL's), communication, and idle. NCCL's kernels run beside the
    compute they overlap, and a rank that arrives first at a collective waits inside its kernel, so the
    three may add up to more than the step; idle, what the step's wall time leaves, is the GPU with
    nothing to run. Empty where no profiles exist."""
    rows = {}
    for path in sorted(folder.glob("breakdown-*-*.csv")):
        _, strategy, processes = path.stem.split("-")
        by_kind = pd.read_csv(path).groupby("kind")["ms_per_step"].sum()
        grouped = {"compute": by_kind.drop(list(TIME_GROUPS), errors="ignore").sum()}
        grouped |= {label: by_kind.get(kind, 0.0) for kind, label in TIME_GROUPS.items()}
        rows[f"{strategy} × {processes}"] = grouped
    return pd.DataFrame.from_dict(rows, orient="index")


def plot_several_gpu_breakdown(table: pd.DataFrame, ax=None):
    """``several_gpu_breakdown``'s table as stacked horizontal bars, one a run."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 0.6 * len(table) + 1.2), layout="constrained")
    table.plot.barh(stacked=True, ax=ax, color=["tab:blue", "tab:orange", "tab:gray"])
    ax.invert_yaxis()  # the runs top to bottom in the table's order
    ax.set_xlabel("ms of device time per training step")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize="small", frameon=False)
    return ax


def each_alone_path(csv: str | Path) -> Path:
    """Where ``--each-alone`` writes each process's tokens/s beside the steps' CSV ``csv``."""
    csv = Path(csv)
    return csv.with_name(f"{csv.stem}-each-alone.csv")


def each_alone_at_once(arguments: argparse.Namespace, level: str, device: torch.device) -> list[float]:
    """Every process trains alone at the same time, each on a one-process group of its own; each one's
    tokens/s, in rank order, on every process. Nothing passes between the processes, but they share
    the host (its cores, its memory, the OS's scheduling) as a run on all of them does: what a process
    loses here against process 0 alone, the run on all of them loses without sending a byte."""
    own_groups = [dist.new_group([member]) for member in range(dist.get_world_size())]  # every process makes every group
    unprofiled = argparse.Namespace(**{**vars(arguments), "breakdown": None})
    steps = pd.DataFrame(timed_steps(unprofiled, level, device, own_groups[dist.get_rank()]))
    rates = [None] * dist.get_world_size()
    dist.all_gather_object(rates, tokens_per_second(steps, 1, arguments.batch * arguments.seq))
    return rates


def main(argv=None) -> NoReturn:
    """Train on the first N processes for each N of ``--processes`` (default 1 and all), smallest first,
    each N on its own group, wrapped the same way, while the others wait: scaling efficiency, tokens/s
    on N processes over N × one process's, then comes from one launch on one machine."""
    arguments = parse_arguments(argv)
    level = levels.resolve_level(arguments.level)
    backend = "nccl" if arguments.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(arguments.device, int(os.environ.get("LOCAL_RANK", 0))) if arguments.device == "cuda" \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    counts = sorted(set(arguments.processes or (1, world)))
    if not 1 <= counts[0] <= counts[-1] <= world:
        raise SystemExit(f"--processes {' '.join(map(str, counts))}: each count must be between 1 and {world}, "
                         "the processes this launch has")
    records = []
    for count in counts:
        # Every process takes part in creating a group, members or not; the others wait at the barrier.
        group = dist.group.WORLD if count == world else dist.new_group(list(range(count)))
        if rank < count:
            records += timed_steps(arguments, level, device, group)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # this run's model and optimizer state are garbage by now
        dist.barrier()
    alone_at_once = each_alone_at_once(arguments, level, device) if arguments.each_alone and world > 1 else None
    if rank == 0:
        table = pd.DataFrame(records).assign(level=level, strategy=arguments.strategy, config=arguments.config,
                                             device=arguments.device, dtype=arguments.dtype, batch=arguments.batch,
                                             seq=arguments.seq)
        print(f"{arguments.strategy} on {world} × {arguments.device}, level {level}, "
              f"{arguments.batch} × {arguments.seq} tokens a process and step:")
        print(format_scaling_table(scaling_table(table, arguments.batch * arguments.seq)))
        if arguments.csv:
            table.to_csv(arguments.csv, index=False)
        if alone_at_once:
            print("each process alone, all at once (nothing to send, the host shared): "
                  + ", ".join(f"{rate:,.0f}" for rate in alone_at_once) + " tokens/s")
            if arguments.csv:
                pd.DataFrame({"process": range(world), "tokens_per_s": alone_at_once}).to_csv(
                    each_alone_path(arguments.csv), index=False)
    leave_process_group()


if __name__ == "__main__":
    main()
