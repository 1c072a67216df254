"""Level 4: hand-written Triton kernels, forward and backward, registered as ``torch.ops.triton_kernels``.

    swish(x, beta)                             -> y     (triton_kernels/swish.py)
    layer_norm(x, weight, bias, eps)           -> y     (triton_kernels/layer_norm.py)
    rms_norm(x, weight, eps)                   -> y     (triton_kernels/rms_norm.py: LayerNorm's kernels
                                                         without the mean and the bias)
    softmax(x)                                 -> y     (triton_kernels/softmax.py)
    attention(q, k, v, causal, window, scale)  -> o     (triton_kernels/attention.py: flash attention,
                                                         kernels in attention_forward.py, attention_backward.py)
    attention_forward_version(q, k, v,         -> o     (triton_kernels/attention_versions.py: the climb to
                              version, scale)            the forward kernel, ATTENTION_VERSIONS; no op, forward only)
    decode_attention(q, k_cache, v_cache,      -> o     (triton_kernels/attention_decode.py: one query per
                     key_lengths, window, scale)         sequence over a static KV cache; inference only)
    linear(x2d, weight, bias)                  -> y     (triton_kernels/feed_forward.py: matmul with a fused
                                                         epilogue, kernels in matmul.py)
    feed_forward(x2d, fc_weight, fc_bias,      -> y     (triton_kernels/feed_forward.py: GPT-2's MLP, bias and
                 proj_weight, proj_bias)                 GELU in the matmul epilogues, gelu' in the backward's)
    linear_cross_entropy(hidden, weight,       -> loss  (triton_kernels/linear_cross_entropy.py: LM head and
                         targets, ignore_index)          cross-entropy fused, the logits never whole in memory)
    adamw_step(params, grads, exp_avgs,        -> None  (triton_kernels/adamw.py: AdamW over every parameter
               exp_avg_sqs, lr, beta1, beta2,            in one launch, in place)
               eps, weight_decay, step)
    layer_norm_forward_version(x, weight,      -> y     (triton_kernels/layer_norm_versions.py: the earlier
                               bias, eps, version)       versions of the forward, for the lesson's timings)
    softmax_forward_version(x, version)        -> y     (triton_kernels/softmax_versions.py: the same for softmax)

Importing this package registers the ops ``triton_kernels::swish_forward``, ``swish_backward``,
``layer_norm_forward``, ``layer_norm_backward``, ``rms_norm_forward``, ``rms_norm_backward``,
``softmax_forward``, ``softmax_backward``,
``attention_forward``, ``attention_backward``, ``linear_forward``, ``linear_backward``,
``feed_forward_forward``, ``feed_forward_backward``, ``linear_cross_entropy_forward`` and
``linear_cross_entropy_backward``, each with a fake (shape-only) implementation for torch.compile and an
autograd formula; and ``adamw_step`` (which updates its lists in place) and ``decode_attention``, each
with a fake and no gradient; and ``layer_norm_forward_version`` and ``softmax_forward_version``, each with
a fake and a backward that refuses. On a machine without a GPU the same kernels run through Triton's
interpreter, on CPU tensors: correct, and slow.

Two doors to the same launchers. Under torch.compile, ``swish``, ``layer_norm``, ``rms_norm``, ``softmax``,
``attention``, ``linear``, ``feed_forward``, ``linear_cross_entropy`` and ``adamw_step`` call the
registered ops, which is what lets Inductor place our kernels in its graph. Called eagerly, they go
through a ``torch.autograd.Function`` (``eager.EagerFunction``, which trims Function.apply's and
once_differentiable's Python; or, when no gradient is wanted, straight to the launcher): a
custom-op call crosses the dispatcher twice and runs Python wrappers on the way, and at decode sizes the
GPU finishes a kernel before the host has launched the next one, so those wrappers are the time of the
call. ``torch.library.triton_op`` with ``wrap_triton`` (in torch since 2.6, so in 2.11 and 2.13) would be
a third way to register: it is a custom op too, so its eager calls pay the same dispatcher crossing (plus
a context manager), and its gain is under torch.compile, where Inductor traces into the kernels. It would
not make eager calls cheaper, so the two doors stay. Both run the same kernels.

On a GPU the eager door has a shortcut (``replay.py``): the first call of an input signature, and its
first backward, run the Function under a recorder, and when each was only allocations, views and
launches, later calls of that signature are one C++ op of level 5's extension that launches the same compiled
kernels, its backward a C++ autograd node: no Python past the call, none on autograd's device thread.

Where the checks run. A launcher checks what reaches it (the ops and the package functions take
anything a caller passes). A level module's forward checks the user's arguments first, so that its
errors speak of the module, and the launcher then checks the tensors it was handed: two layers, each a
few compares when the inputs are fine. The eager backward checks nothing: it calls the
``..._unchecked`` launchers, because its inputs are what the forward saved and a gradient that
autograd has already matched to the output in shape, dtype and device.

The path from a call to the kernel is kept short (``launch.py``): launch sizes and constants are
cached per shape and value, checks are attribute compares that build a message only when they fail,
and repeat launches skip JITFunction.run for the compiled kernel's own launcher (``launch.launch``;
``launch.DIRECT_LAUNCH = False`` goes back through Triton's JIT). Measured host times:
profiling/results/host_path.md.
"""

import importlib
import os
import sys

import torch

# --- where the kernels run: the GPU, or Triton's CPU interpreter ------------------------------------
# Each @triton.jit decorator decides, when it runs, whether its function is compiled for a GPU or
# interpreted on NumPy. So the switch must be thrown here, before the kernel modules below are
# imported. Triton (>= 3.4) reads TRITON_INTERPRET lazily; setting the knob as well overrides a value
# someone set in code. Triton's own helpers (tl.sum, tl.sigmoid, tl.zeros, ...) are @triton.jit
# functions too: if Triton was imported before the switch (torch.compile imports it), they were made
# for the compiler and the interpreter cannot call them, so we run triton.language's definitions again.
if not torch.cuda.is_available():
    triton_was_imported = "triton.language" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"
    import triton

    triton.knobs.runtime.interpret = True
    if triton_was_imported:
        importlib.reload(triton.language.standard)
        importlib.reload(triton.language)
    print("triton_kernels: no CUDA GPU found, so Triton's interpreter runs the level-4 kernels on the CPU "
          "(correct, but slowly)", file=sys.stderr)

from .adamw import AdamWStepPlan, adamw_step  # noqa: E402  (after the switch above, on purpose)
from .attention import attention  # noqa: E402
from .attention_decode import decode_attention  # noqa: E402
from .feed_forward import feed_forward, linear  # noqa: E402
from .layer_norm import layer_norm  # noqa: E402
from .linear_cross_entropy import linear_cross_entropy  # noqa: E402
from .rms_norm import rms_norm  # noqa: E402
from .softmax import softmax  # noqa: E402
from .swish import swish  # noqa: E402

# The earlier versions of kernels that the lessons time (their ops are registered when first used):
# loaded on first access, so importing the package costs nothing for them.
_LESSON_VERSIONS = {"ATTENTION_VERSIONS": "attention_versions", "attention_forward_version": "attention_versions",
                    "layer_norm_forward_version": "layer_norm_versions", "softmax_forward_version": "softmax_versions"}


def __getattr__(name: str):
    if name in _LESSON_VERSIONS:
        return getattr(importlib.import_module(f".{_LESSON_VERSIONS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ATTENTION_VERSIONS", "AdamWStepPlan", "adamw_step", "attention", "attention_forward_version", "decode_attention",
           "feed_forward", "layer_norm", "layer_norm_forward_version", "linear", "linear_cross_entropy", "rms_norm",
           "softmax", "softmax_forward_version", "swish"]
