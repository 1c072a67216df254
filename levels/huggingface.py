"""The ladder inside a Hugging Face ``transformers`` GPT-2: ``apply(model, level)`` and ``revert(model)``.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> import levels.huggingface
    >>> model = levels.huggingface.apply(GPT2LMHeadModel(GPT2Config()), "cuda")

A model someone already uses, made to run on one level's parts, in place, with its own parameters:

    attention   ``transformers``' attention-function registry: ``AttentionInterface.register`` of ours,
                then the model's attention implementation set to it. GPT-2 still makes q, k and v with its
                own ``c_attn`` and updates its own KV cache (``model.generate`` works as before); each
                layer's ``attn`` holds the level's attention component (``ladder_attention``), which
                attends the queries over the cached keys, aligned to their end.
    ln_1, ln_2, ln_f   the level's LayerNorm, holding the ``nn.LayerNorm``'s weight and bias.
    mlp         the level's feed-forward, holding GPT-2's two ``Conv1D`` layers themselves (and its
                dropout). A Conv1D stores its weight (in, out), the transpose of ``nn.Linear``'s (out, in)
                that our feed-forward computes with. Copying it into that layout would cost a pass over
                the weights at every call (or a second copy to keep in step with the optimizer), so the
                adapter hands the level's math the transposed *view*: a stride swap. Matmuls read it in
                place (cuBLAS and MKL transpose for free, our Triton matmul takes any strides), and
                levels 4 and 5 write the weight gradients in the Conv1D's layout, so autograd
                accumulates them without a copy either.
    lm_head     the level's ``linear_cross_entropy`` holding the tied embedding: logits by the level's
                ``linear``, and, when ``labels`` are passed, the loss by the fused LM head + cross-entropy.

The state_dict keeps its keys and layouts, the optimizer sees the same parameters, ``save_pretrained``
writes what it wrote before. What stays ``transformers``' own: the embeddings, the attention's two
projections (Conv1D: one cuBLAS call each), the residual adds and the dropouts outside attention.

With ``labels``, a patched ``GPT2LMHeadModel`` returns the loss and ``logits=None``: the point of the
fused head is that the (tokens × vocabulary) logits are never in memory whole. The labels are shifted
inside the model, as ``transformers`` does (``labels=input_ids`` is right), and ``num_items_in_batch``
(gradient accumulation) and ``shift_labels`` are honoured.

What the kernels cannot express is refused, never approximated: attention masks other than causal
(padding in a batch, a static cache's unfilled slots) raise a ``ValueError`` when they arrive (all-ones
masks are fine), attention dropout raises when training with it, and a config the level cannot serve
raises before anything is changed.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
import torch.nn.functional as F
from torch import nn

from cuda_kernels.limits import attention_head_dim_supported, unsupported_head_dim_message

from . import attention as attention_component
from .backends import cuda_backend, linear, triton_backend
from .spec import resolve_level

SUPPORTED_CLASSES = ("GPT2Model", "GPT2LMHeadModel")
"""The ``transformers`` classes ``apply`` patches."""

ATTENTION_IMPLEMENTATION = "kernel_ladder"
"""The name ours is registered under, in ``AttentionInterface`` and ``AttentionMaskInterface``."""

TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
"""GPT-2's activation names for GELU's tanh approximation, the one our feed-forward computes."""

IGNORE_INDEX = -100
"""``transformers``' label for a token left out of the loss (its ``ForCausalLMLoss`` default)."""

_PATCH = "_kernel_ladder_patch"  # what revert() needs, kept in the model's __dict__: no state_dict entry


# --- apply and revert ---------------------------------------------------------------------------------------


def apply(model: nn.Module, level: str | int) -> nn.Module:
    """Make ``model`` (a ``GPT2Model`` or ``GPT2LMHeadModel``) run on ``level``'s parts, in place; returns it.

    Applying the same level again is a no-op; another level needs ``revert(model)`` first. Every check
    runs before anything changes: an unsupported class raises ``TypeError``, a config the level cannot
    serve ``ValueError``, a level that cannot load here ``LevelUnavailableError``."""
    level = resolve_level(level)
    transformers = _import_transformers()
    body = _check_model_class(model, transformers)
    patch = model.__dict__.get(_PATCH)
    if patch is not None:
        if patch.level == level:
            return model
        raise ValueError(f"this model is already patched at level {patch.level!r}: call "
                         f"levels.huggingface.revert(model) before applying level {level!r}")
    _check_config(model.config, level)
    _load_level(level)
    _register_attention()

    patch = _Patch(level, model.config._attn_implementation)
    for block in body.h:
        patch.replace(block, "ln_1", level_layer_norm(block.ln_1, level))
        patch.replace(block, "ln_2", level_layer_norm(block.ln_2, level))
        patch.replace(block, "mlp", _feed_forward(block.mlp, level))
        # A child without parameters: the state_dict is unchanged.
        block.attn.ladder_attention = attention_component.IMPLEMENTATIONS[level](causal=True,
                                                                                 scale=_attention_scale(block.attn))
        patch.attention_layers.append(block.attn)
    patch.replace(body, "ln_f", level_layer_norm(body.ln_f, level))
    if body is not model:
        patch.replace(model, "lm_head", _lm_head(model.lm_head, level))
        model.forward = types.MethodType(_forward_with_fused_loss(type(model).forward), model)
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    model.__dict__[_PATCH] = patch
    return model


def revert(model: nn.Module) -> nn.Module:
    """Undo ``apply``: ``transformers``' own modules, forward and attention implementation again, holding
    the same parameters (trained ones included). A model that is not patched is returned as it is."""
    patch = model.__dict__.pop(_PATCH, None)
    if patch is None:
        return model
    for parent, name, original in patch.replaced:
        setattr(parent, name, original)
    for layer in patch.attention_layers:
        del layer.ladder_attention
    model.__dict__.pop("forward", None)  # the class's forward again
    model.set_attn_implementation(patch.original_attention)
    return model


def patched_level(model: nn.Module) -> str | None:
    """The level ``model`` is patched at, or None."""
    patch = model.__dict__.get(_PATCH)
    return None if patch is None else patch.level


class _Patch:
    """What ``revert`` puts back: the replaced modules, the layers given an attention, the implementation."""

    def __init__(self, level: str, original_attention: str):
        self.level = level
        self.original_attention = original_attention
        self.replaced: list[tuple[nn.Module, str, nn.Module]] = []
        self.attention_layers: list[nn.Module] = []

    def replace(self, parent: nn.Module, name: str, module: nn.Module) -> None:
        self.replaced.append((parent, name, getattr(parent, name)))
        setattr(parent, name, module)


# --- checks, all before anything changes --------------------------------------------------------------------


def _import_transformers():
    try:
        import transformers
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401  (the mask registry we need)
        from transformers.modeling_utils import AttentionInterface  # noqa: F401
    except ImportError as error:
        raise ImportError("levels.huggingface needs transformers with AttentionInterface and AttentionMaskInterface: "
                          f"pip install 'kernel-ladder[huggingface]' (import failed: {error})") from error
    return transformers


def _check_model_class(model, transformers) -> nn.Module:
    """The GPT2Model inside ``model``, or TypeError naming the classes we patch."""
    if isinstance(model, transformers.GPT2LMHeadModel):
        return model.transformer
    if isinstance(model, transformers.GPT2Model):
        return model
    raise TypeError(f"levels.huggingface patches {' and '.join(SUPPORTED_CLASSES)} (transformers), "
                    f"not {type(model).__name__}")


def _check_config(config, level: str) -> None:
    """ValueError naming whatever in ``config`` the level's parts do not compute."""
    head_dim = config.n_embd // config.n_head
    if level in ("triton", "cuda") and not attention_head_dim_supported(head_dim):
        raise ValueError(f"{unsupported_head_dim_message(head_dim, level)}; n_embd={config.n_embd} / n_head={config.n_head}")
    if config.activation_function not in TANH_GELUS:
        raise ValueError(f"activation_function={config.activation_function!r}: the ladder's feed-forward computes "
                         f"GELU's tanh approximation only ({' or '.join(TANH_GELUS)})")
    if config.add_cross_attention:
        raise ValueError("add_cross_attention=True: the ladder's attention is causal self-attention only")
    if config.reorder_and_upcast_attn:
        raise ValueError("reorder_and_upcast_attn=True asks for transformers' own float32 score path "
                         "(eager attention only), which the ladder's attention does not mirror")


def _load_level(level: str) -> None:
    """Import Triton or build the extension now, so that a level that cannot run here says so before any change."""
    if level == "triton":
        triton_backend()
    elif level == "cuda":
        cuda_backend()


# --- the parts ----------------------------------------------------------------------------------------------


@functools.cache
def _adapted_class(component: str, level: str, adapter: type) -> type:
    """The level's class of ``component`` with ``adapter`` in front: still the level's module."""
    from . import level_class

    base = level_class(component, level)
    return type(f"{base.__name__}{adapter.__name__}", (adapter, base), {"__doc__": adapter.__doc__})


def level_layer_norm(original: nn.LayerNorm, level: str) -> nn.Module:
    """``level``'s LayerNorm in place of ``original``, holding ``original``'s own weight and bias."""
    from . import build

    layer_norm = build("layer_norm", level, normalized_shape=original.normalized_shape, eps=original.eps)
    layer_norm.weight, layer_norm.bias = original.weight, original.bias  # the same Parameters
    return layer_norm


class OnConv1D:
    """GPT-2's MLP as the level's feed-forward, on GPT-2's own ``Conv1D`` layers: their (in, out) weights
    go to the level's math as transposed views (a stride swap, no copy; see the module docstring), and
    the MLP's dropout follows, as in ``GPT2MLP``."""

    def parameter_tensors(self):
        return self.c_fc.weight.t(), self.c_fc.bias, self.c_proj.weight.t(), self.c_proj.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(super().forward(x))


def _attention_scale(layer: nn.Module) -> float:
    """The scores' scale as GPT-2's eager attention applies it: 1/√head_dim (unless ``scale_attn_weights``
    is off), divided by the layer's number with ``scale_attn_by_inverse_layer_idx``."""
    scale = layer.head_dim ** -0.5 if layer.scale_attn_weights else 1.0
    return scale / (layer.layer_idx + 1) if layer.scale_attn_by_inverse_layer_idx else scale


def _feed_forward(mlp: nn.Module, level: str) -> nn.Module:
    embedding, hidden = mlp.c_fc.weight.shape
    feed_forward = _adapted_class("feed_forward", level, OnConv1D)(n_embd=embedding, hidden=hidden)
    feed_forward.c_fc, feed_forward.c_proj = mlp.c_fc, mlp.c_proj  # the same modules: same keys, same Parameters
    feed_forward.dropout = mlp.dropout
    return feed_forward


class AsLMHead:
    """The level's LM head + loss as GPT-2's ``lm_head``: ``lm_head(hidden)`` gives the logits by the level's
    ``linear`` (what ``transformers`` calls), ``lm_head(hidden, targets)`` the fused mean cross-entropy."""

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return linear(self.level, hidden, self.weight)
        return super().forward(hidden, targets)


def _lm_head(original: nn.Linear, level: str) -> nn.Module:
    vocab_size, embedding = original.weight.shape
    head = _adapted_class("linear_cross_entropy", level, AsLMHead)(n_embd=embedding, vocab_size=vocab_size,
                                                                   ignore_index=IGNORE_INDEX)
    head.weight = original.weight  # the same Parameter: still tied to the token embedding
    return head


# --- the loss, through the fused LM head --------------------------------------------------------------------

_LOSS_ARGUMENTS = ("num_items_in_batch", "shift_labels", "ignore_index")


def _forward_with_fused_loss(original_forward):
    """``GPT2LMHeadModel.forward`` whose loss, when ``labels`` are passed, comes from the body's last hidden
    states through the fused LM head (no logits); without labels, the original forward. ``functools.wraps``
    keeps the original's signature, which ``generate`` inspects."""
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    signature = inspect.signature(original_forward)

    @functools.wraps(original_forward)
    def forward(self, *args, **kwargs):
        if len(args) > 1:  # arguments after input_ids given by position: name them (labels among them?)
            kwargs = dict(signature.bind_partial(self, *args, **kwargs).arguments)
            kwargs.pop("self")
            kwargs.update(kwargs.pop("kwargs", {}))
            args = ()
        labels = kwargs.pop("labels", None)
        if labels is None:
            return original_forward(self, *args, **kwargs)
        loss_arguments = {name: kwargs.pop(name) for name in _LOSS_ARGUMENTS if name in kwargs}
        if loss_arguments.get("ignore_index", IGNORE_INDEX) != IGNORE_INDEX:
            raise ValueError(f"ignore_index={loss_arguments['ignore_index']}: the patched loss ignores label "
                             f"{IGNORE_INDEX}, transformers' default")
        kwargs.pop("logits_to_keep", None)  # the loss covers every token, as transformers' does
        return_dict = kwargs.pop("return_dict", None)
        outputs = self.transformer(*args, **kwargs)
        hidden = outputs[0]
        targets = loss_arguments.get("shift_labels")
        if targets is None:  # token t predicts label t + 1; the last token predicts nothing
            targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        targets = targets.to(hidden.device)
        loss = self.lm_head(hidden, targets)
        if loss_arguments.get("num_items_in_batch") is not None:  # a sum over this batch, divided by the whole count
            loss = loss * (targets != IGNORE_INDEX).sum() / loss_arguments["num_items_in_batch"]
        fields = dict(outputs.items()) if hasattr(outputs, "items") else {}
        fields.pop("last_hidden_state", None)
        output = CausalLMOutputWithCrossAttentions(loss=loss, logits=None, **fields)
        use_dict = return_dict if return_dict is not None else getattr(self.config, "return_dict", True)
        return output if use_dict else output.to_tuple()

    return forward


# --- attention, through transformers' registries ------------------------------------------------------------


def _register_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION_IMPLEMENTATION, ladder_attention_forward)
    AttentionMaskInterface.register(ATTENTION_IMPLEMENTATION, causal_or_refused_mask)


def ladder_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """What GPT-2's attention calls once ours is its implementation, with sdpa's contract: q (B, H, Lq, D)
    and the cached k, v (B, H, Lk, D) in, (B, Lq, H, D) and no attention weights out.

    ``attention_mask`` is None for causal attention (our mask function below made sure), or a 4-D mask the
    caller built, which must be causal too (queries aligned to the end of the keys)."""
    if kwargs.get("head_mask") is not None:
        raise ValueError("head_mask: the ladder's attention kernels do not scale heads; pass head_mask=None")
    if dropout > 0:
        raise ValueError(f"attention dropout p={dropout} while training: the ladder's attention kernels have none; "
                         "set every layer's attn.attn_dropout.p = 0 (config.attn_pdrop=0.0), or call model.eval()")
    queries, keys = query.shape[-2], key.shape[-2]
    if attention_mask is not None:
        check_causal(attention_mask, queries, keys)
    elif 1 < queries < keys:
        # transformers passes no mask here only for a static cache's first call, whose unfilled slots
        # follow the prompt (sdpa's is_causal aligns queries to the *start* of the keys).
        raise ValueError(f"{queries} queries over {keys} keys with no mask: a static cache's prefill, which the "
                         f"ladder's attention (queries aligned to the end of the keys) does not serve; use the "
                         f"default dynamic cache")
    return module.ladder_attention(query, key, value).transpose(1, 2), None


def causal_or_refused_mask(*args, **kwargs) -> None:
    """The mask function registered beside our attention: transformers' sdpa mask, which is None whenever
    plain causal attention will do (no padding, or all-ones masks); any other mask is checked once per
    forward, here rather than in every layer, and is either causal after all (None) or refused."""
    from transformers.masking_utils import AttentionMaskInterface

    mask = AttentionMaskInterface._global_mapping["sdpa"](*args, **kwargs)
    if mask is not None:
        check_causal(mask, mask.shape[-2], mask.shape[-1])
    return None


def check_causal(mask: torch.Tensor, queries: int, keys: int) -> None:
    """ValueError unless ``mask`` (boolean: True where a query sees a key; or additive float: 0 or very
    negative) is exactly causal for ``queries`` aligned to the end of ``keys``: all our kernels compute.
    Reads the answer back from the device: one synchronisation."""
    if tuple(mask.shape[-2:]) != (queries, keys):
        raise ValueError(f"attention mask of shape {tuple(mask.shape)} for {queries} queries over {keys} keys")
    visible = attention_component.visible_keys_mask(queries, keys, 0, mask.device)
    if mask.dtype == torch.bool:
        causal = torch.equal(mask, visible.expand_as(mask))
    else:
        hidden_blocked = mask.masked_fill(visible, float("-inf")) <= torch.finfo(mask.dtype).min / 2
        causal = bool(((mask == 0) | ~visible).all() and hidden_blocked.all())
    if not causal:
        raise ValueError("this attention mask is not plain causal (padding in the batch, or a static cache's unfilled "
                         "slots): the ladder's attention kernels compute causal attention only. Pass batches without "
                         "padding (an all-ones attention_mask is fine) with the default dynamic cache, or "
                         "levels.huggingface.revert(model) for this call")


__all__ = ["ATTENTION_IMPLEMENTATION", "SUPPORTED_CLASSES", "apply", "patched_level", "revert"]
