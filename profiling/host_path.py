"""The host's share of a level-4 call: time ``module(x)`` (and its backward) with every Triton launch
stubbed out, so that what is left is the Python between the user's call and the kernels.

On a GPU a decode-size kernel runs in a few microseconds, so the Python around it decides the time
of a call. Here no kernel runs at all: each ``@triton.jit`` function returns as soon as it is
called, and the clock measures our checks, allocations, launch-size choices, autograd's
bookkeeping and the call into Triton. Run on a machine without a GPU (Triton's interpreter is on),
it measures everything up to Triton's launcher; on a GPU, where the stub replaces
``JITFunction.run``, Triton's own per-call work (argument binding, specialization key, cache
lookup, the C launcher) is left out as well: time that with ``gpu_overhead`` numbers instead.

    python -m profiling.host_path            # a table of median microseconds, forward and forward+backward
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import levels

# component, build config, input shapes: one call at GPT-2-small decode sizes (batch 1, 8 tokens,
# width 768, 12 heads of 64; attention: one query against 64 keys).
DECODE_CASES = [
    ("swish", {}, [(8, 768)]),
    ("layer_norm", {"normalized_shape": 768}, [(8, 768)]),
    ("softmax", {}, [(8, 1024)]),
    ("attention", {"causal": True}, [(1, 12, 1, 64), (1, 12, 64, 64), (1, 12, 64, 64)]),
    ("feed_forward", {"n_embd": 768}, [(1, 8, 768)]),
]


@contextlib.contextmanager
def launches_stubbed():
    """Every Triton kernel launch returns at once (interpreter and compiled kernels alike)."""
    import triton  # noqa: F401  (imported by triton_kernels; named here for the classes below)
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (InterpretedFunction, JITFunction)}
    try:
        for cls in originals:
            cls.run = lambda self, *args, **kwargs: None
        yield
    finally:
        for cls, run in originals.items():
            cls.run = run


def _median_us(function, iterations: int, batch: int = 50) -> float:
    """Median over batches of ``batch`` calls of this thread's CPU time per call: CPU time, not wall
    time, so that other processes taking the core (a shared CI runner) do not count."""
    for _ in range(10):
        function()
    samples = []
    for _ in range(max(1, iterations // batch)):
        start = time.thread_time_ns()
        for _ in range(batch):
            function()
        samples.append((time.thread_time_ns() - start) / batch)
    return statistics.median(samples) / 1e3


def host_path_table(iterations: int = 2000, device: str = "cpu", dtype=torch.float32) -> list[tuple[str, float, float]]:
    """(component, forward µs, forward+backward µs) of level 4 with its launches stubbed."""
    rows = []
    for component, config, shapes in DECODE_CASES:
        module = levels.build(component, "triton", **config).to(device=device, dtype=dtype)
        inputs = [torch.randn(shape, device=device, dtype=dtype) for shape in shapes]
        leaves = [x.clone().requires_grad_() for x in inputs]
        with launches_stubbed():
            with torch.no_grad():
                forward = _median_us(lambda: module(*inputs), iterations)
            grad = torch.ones(shapes[0], device=device, dtype=dtype)

            def forward_backward():
                # Gradients land in fresh .grad tensors, not added to old ones (whose stubbed, never-written
                # contents may hold denormals that make the CPU's adds slow).
                module.zero_grad(set_to_none=True)
                for leaf in leaves:
                    leaf.grad = None
                module(*leaves).backward(grad)

            both = _median_us(forward_backward, iterations)
        rows.append((component, forward, both))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"level 4 host path, launches stubbed, {device} float32, median µs of {args.iterations} calls")
    print(f"{'component':<14}{'forward':>10}{'fwd+bwd':>10}")
    for component, forward, both in host_path_table(args.iterations, device):
        print(f"{component:<14}{forward:>10.1f}{both:>10.1f}")


if __name__ == "__main__":
    main()
