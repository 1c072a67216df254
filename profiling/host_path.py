"""The host's share of a level-4 call: time ``module(x)`` (and its backward) with every Triton launch
stubbed out, so that what is left is the Python between the user's call and the kernels.

On a GPU a decode-size kernel runs in a few microseconds, so the Python around it decides the time
of a call. Here no kernel runs at all: each launch returns as soon as it reaches Triton's
interpreter, and the clock measures our checks, allocations, launch-size choices, autograd's
bookkeeping and the call into Triton. It runs where the interpreter is on (no GPU): on a GPU the
kernels would run, and Triton's own per-launch work (JITFunction.run, or ``launch.launch``'s direct
path) is part of what a GPU timing of the whole call measures.

    python -m profiling.host_path            # a table of microseconds per call, forward and forward+backward

On a GPU machine, ``--pieces`` takes one decode-size LayerNorm apart instead, kernels running: the
level-4 module, its two launchers alone (the backward's from another thread too, as autograd's device
thread calls it), and two baselines for autograd's engine, each timed in batches launched back to back:

    python -m profiling.host_path --pieces   # wall-clock µs per call on the GPU, bfloat16 (8, 768)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import threading
import time

import torch

import levels

from .overhead import DECODE_CASES
from .timing import time_back_to_back

@contextlib.contextmanager
def launches_stubbed():
    """Every launch of an interpreted Triton kernel returns at once."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        InterpretedFunction.run = run


def _best_us(function, iterations: int, batch: int = 20) -> float:
    """This thread's CPU time per call in the fastest of ``iterations // batch`` batches of ``batch``
    calls. The fastest, not the median: on a shared machine other processes only ever add time (to
    the caches and the core's pipeline, if not to this thread's clock), so the minimum is the
    stablest estimate of what the code itself costs."""
    for _ in range(10):
        function()
    best = float("inf")
    for _ in range(max(1, iterations // batch)):
        start = time.thread_time_ns()
        for _ in range(batch):
            function()
        best = min(best, (time.thread_time_ns() - start) / batch)
    return best / 1e3


def host_path_table(iterations: int = 2000, device: str = "cpu", dtype=torch.float32) -> list[tuple[str, float, float]]:
    """(component, forward µs, forward+backward µs) of level 4 with its launches stubbed."""
    rows = []
    for component, shape, config in DECODE_CASES.values():  # the cases profiling.call_overhead times on a GPU
        config = config if config is not None else levels.level_class(component, "native").config_for_shape(shape)
        module = levels.build(component, "triton", **config).to(device=device, dtype=dtype)
        inputs = module.example_inputs(shape, dtype, device)
        leaves = [x.clone().requires_grad_() for x in inputs]
        with launches_stubbed():
            with torch.no_grad():
                forward = _best_us(lambda: module(*inputs), iterations)
            grad = torch.ones_like(inputs[0])  # every decode case's output has its first input's shape

            def forward_backward():
                # Gradients land in fresh .grad tensors, not added to old ones (whose stubbed, never-written
                # contents may hold denormals that make the CPU's adds slow).
                module.zero_grad(set_to_none=True)
                for leaf in leaves:
                    leaf.grad = None
                module(*leaves).backward(grad)

            both = _best_us(forward_backward, iterations)
        rows.append((component, forward, both))
    return rows


class _Passthrough(torch.autograd.Function):
    """A Python autograd node that does nothing: what autograd's engine alone costs such a node."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def layer_norm_pieces(device: str = "cuda", dtype=torch.bfloat16, budget_s: float = 0.5) -> list[tuple[str, float]]:
    """(what, µs per call) for a LayerNorm on (8, 768) at level 4, kernels running, piece by piece: the
    median per call of batches launched back to back (``profiling.timing.time_back_to_back``)."""
    device = torch.device(device)

    def us(function) -> float:
        return time_back_to_back(function, device, budget_s=budget_s).median_s * 1e6

    launchers = importlib.import_module("triton_kernels.layer_norm")
    backward_launchers = importlib.import_module("triton_kernels.layer_norm_backward")
    x = torch.randn(8, 768, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(8, 768, device=device, dtype=dtype)
    rows = []
    for level in ("triton", "native"):
        module = levels.build("layer_norm", level, normalized_shape=768).to(device, dtype)

        def forward_backward(module=module):
            x.grad = None
            module.zero_grad(set_to_none=True)
            module(x).backward(grad)

        if level == "triton":
            rows.append((f"{levels.LEVEL_TITLES[level]}: forward with grad on", us(lambda: module(x))))
        rows.append((f"{levels.LEVEL_TITLES[level]}: forward + .backward()",
                     us(forward_backward)))
    values = x.detach()
    weight, bias = (torch.randn(768, device=device, dtype=dtype) for _ in range(2))
    _, mean, rstd = launchers.launch_layer_norm_fwd(values, weight, bias, 1e-5)
    rows.append(("launch_layer_norm_fwd alone (checks, three allocations, one launch)",
                 us(lambda: launchers.launch_layer_norm_fwd(values, weight, bias, 1e-5))))

    def backward_launch():
        backward_launchers.launch_norm_bwd_unchecked(grad, values, weight, mean, rstd)

    rows.append(("launch_norm_bwd_unchecked alone, main thread", us(backward_launch)))
    other_thread = {}
    thread = threading.Thread(target=lambda: other_thread.update(us=us(backward_launch)))
    thread.start()
    thread.join()
    rows.append(("the same from another thread (as autograd's device thread calls it)", other_thread["us"]))

    def passthrough():
        x.grad = None
        _Passthrough.apply(x).backward(grad)

    def multiply():
        x.grad = None
        (x * 1).backward(grad)

    rows.append(("an autograd.Function returning its input, forward + .backward()", us(passthrough)))
    rows.append(("(x * 1).backward()", us(multiply)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000, help="stubbed table: calls per case")
    parser.add_argument("--pieces", action="store_true",
                        help="on a GPU: a decode-size LayerNorm at level 4 piece by piece, kernels running")
    args = parser.parse_args(argv)
    if args.pieces:
        if not torch.cuda.is_available():
            raise SystemExit("profiling.host_path --pieces times real launches: run it on a GPU machine")
        print(f"level 4 LayerNorm (8, 768) bfloat16 on {torch.cuda.get_device_name()}, wall-clock µs per call "
              "(median of batches launched back to back)")
        for what, us in layer_norm_pieces("cuda", torch.bfloat16):
            print(f"{what:<72}{us:>8.1f}")
        return
    if torch.cuda.is_available():
        raise SystemExit("profiling.host_path stubs the interpreter's launches: run it where no GPU is present")
    device = "cpu"
    print(f"level 4 host path, launches stubbed, {device} float32, µs per call (best batch, {args.iterations} calls)")
    print(f"{'component':<14}{'forward':>10}{'fwd+bwd':>10}")
    for component, forward, both in host_path_table(args.iterations, device):
        print(f"{component:<14}{forward:>10.1f}{both:>10.1f}")


if __name__ == "__main__":
    main()
