"""levels.huggingface: a transformers GPT-2 patched at each level computes what the unpatched one does
(logits, loss and every gradient against a float64 run of the unpatched model; greedy tokens identical
in float32), keeps its parameters, state_dict and optimizer, reverts cleanly, and refuses what its
kernels cannot compute (other classes, configs, padding masks, attention dropout) before changing anything."""

import copy

import pytest
import torch

import levels
from levels import huggingface
from levels.spec import TOLERANCE, relative_max_error
from profiling import perturb_parameters_

from .conftest import device_param, level_devices

transformers = pytest.importorskip("transformers", reason="levels.huggingface needs transformers: "
                                   "pip install -e '.[huggingface]'")

TINY = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=96, n_positions=32,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=None)
"""2 layers, 64 wide, 4 heads (head dim 16), no dropout (attention dropout is refused while training)."""


def tiny_model(cls=None, **overrides):
    """A seeded GPT2LMHeadModel (or ``cls``) of the tiny config, every parameter moved off its
    initial value (zero biases and unit LayerNorm weights would hide a kernel that forgets them)."""
    torch.manual_seed(3)
    cls = cls or transformers.GPT2LMHeadModel
    return perturb_parameters_(cls(transformers.GPT2Config(**{**TINY, **overrides}))).eval()


def float64_reference(model):
    """The unpatched model in float64 with transformers' eager attention: the truth we compare against."""
    reference = copy.deepcopy(model).double()
    reference.set_attn_implementation("eager")
    return reference


def gradients(model):
    return {name: parameter.grad for name, parameter in model.named_parameters()}


def assert_close(actual, reference, dtype, what):
    error = relative_max_error(actual, reference)
    assert error < TOLERANCE[dtype], f"{what}: relative error {error:.2e} > {TOLERANCE[dtype]:.0e}"


def check_against_unpatched(level, device, dtype):
    """Logits, loss and one backward's gradients of the patched model against the float64 unpatched model."""
    model = tiny_model().to(device)
    reference = float64_reference(model)
    keys = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    parameters = dict(model.named_parameters())
    model = huggingface.apply(model.to(dtype), level)

    # The level's parts hold the model's own parameters, under the same names and shapes.
    assert {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()} == keys
    assert all(parameter is parameters[name] for name, parameter in model.named_parameters())
    block = model.transformer.h[0]
    assert isinstance(block.mlp, levels.level_class("feed_forward", level))
    assert isinstance(block.ln_1, levels.level_class("layer_norm", level))
    assert isinstance(block.attn.ladder_attention, levels.level_class("attention", level))
    assert isinstance(model.lm_head, levels.level_class("linear_cross_entropy", level))
    assert model.config._attn_implementation == huggingface.ATTENTION_IMPLEMENTATION

    ids = torch.randint(0, TINY["vocab_size"], (2, 19), device=device)
    with torch.no_grad():
        assert_close(model(ids).logits, reference(ids).logits, dtype, "logits")
    output = model(ids, labels=ids)
    assert output.logits is None  # the fused head never makes them
    reference_loss = reference(ids, labels=ids).loss
    assert_close(output.loss, reference_loss, dtype, "loss")
    output.loss.backward()
    reference_loss.backward()
    reference_gradients = gradients(reference)
    for name, gradient in gradients(model).items():
        assert_close(gradient, reference_gradients[name], dtype, f"gradient of {name}")


@pytest.mark.parametrize("level", [level for level in levels.LEVELS if "cpu" in level_devices(level)])
def test_patched_model_matches_float64_unpatched_model_on_cpu(level):
    check_against_unpatched(level, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("level", levels.LEVELS)
def test_patched_model_matches_float64_unpatched_model_on_gpu(level, dtype):
    check_against_unpatched(level, "cuda", dtype)


@pytest.mark.parametrize("device", [device_param("cpu"), device_param("cuda")])
def test_greedy_generation_gives_the_unpatched_tokens_at_every_level(device):
    model = tiny_model().to(device)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 5), device=device)
    # No padding: an all-ones mask, said outright (else generate guesses one from a pad token in the prompt).
    settings = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
    unpatched = model.generate(prompt, **settings)
    for level in levels.LEVELS:
        if device not in level_devices(level):
            continue  # Triton runs CPU tensors only when no GPU is present
        patched = huggingface.apply(copy.deepcopy(model), level)
        tokens = patched.generate(prompt, **settings)
        assert torch.equal(tokens, unpatched), f"level {level!r}: {tokens.tolist()}, unpatched: {unpatched.tolist()}"


def test_gpt2model_without_head_is_patched_too():
    model = tiny_model(transformers.GPT2Model)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        expected = float64_reference(model)(ids).last_hidden_state
        patched = huggingface.apply(model, "native")(ids).last_hidden_state
    assert_close(patched, expected, torch.float32, "hidden states")


def test_scale_by_inverse_layer_index_is_honoured():
    model = tiny_model(scale_attn_by_inverse_layer_idx=True)
    ids = torch.randint(0, TINY["vocab_size"], (1, 12))
    with torch.no_grad():
        expected = float64_reference(model)(ids).logits
        assert_close(huggingface.apply(model, "native")(ids).logits, expected, torch.float32, "logits")


def test_loss_honours_num_items_in_batch_and_all_ones_masks():
    model = tiny_model()
    ids = torch.randint(0, TINY["vocab_size"], (2, 10))
    ids_labels = ids.masked_fill(torch.rand(ids.shape) < 0.3, -100)
    with torch.no_grad():
        expected = model(ids, labels=ids_labels, num_items_in_batch=torch.tensor(7)).loss
        huggingface.apply(model, "native")
        patched = model(ids, attention_mask=torch.ones_like(ids), labels=ids_labels, num_items_in_batch=torch.tensor(7))
    assert_close(patched.loss, expected, torch.float32, "loss")


def test_optimizer_state_dict_and_save_pretrained_keep_working(tmp_path):
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # made before patching: the same parameters
    huggingface.apply(model, "native")
    ids = torch.randint(0, TINY["vocab_size"], (2, 8))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        trained = model(ids).logits
        loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
        assert_close(loaded(ids).logits, trained, torch.float32, "logits of the saved model")
        reverted = huggingface.revert(model)(ids).logits  # transformers' own modules, on the trained weights
        assert_close(reverted, trained, torch.float32, "logits after revert")


def test_revert_restores_the_original_modules_and_outputs():
    model = tiny_model()
    ids = torch.randint(0, TINY["vocab_size"], (2, 8))
    modules = dict(model.named_modules())
    with torch.no_grad():
        before = model(ids).logits
    huggingface.apply(model, "native")
    assert huggingface.patched_level(model) == "native"
    huggingface.revert(model)
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(module is modules[name] for name, module in model.named_modules())
    assert "forward" not in model.__dict__ and huggingface.patched_level(model) is None
    assert model.config._attn_implementation != huggingface.ATTENTION_IMPLEMENTATION
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_applying_twice_is_a_no_op_and_another_level_asks_for_revert():
    model = huggingface.apply(tiny_model(), "native")
    modules = dict(model.named_modules())
    assert huggingface.apply(model, 1) is model
    assert all(module is modules[name] for name, module in model.named_modules())
    with pytest.raises(ValueError, match="already patched at level 'native'.*revert"):
        huggingface.apply(model, "torchscript")


def test_unsupported_model_class_is_a_type_error_naming_the_supported_ones():
    model = tiny_model(transformers.GPT2ForSequenceClassification)
    with pytest.raises(TypeError, match="GPT2Model and GPT2LMHeadModel.*not GPT2ForSequenceClassification"):
        huggingface.apply(model, "native")


@pytest.mark.parametrize("overrides,level,message", [
    ({"n_embd": 72, "n_head": 4}, "cuda", r"head_dim 18 is not supported by the cuda attention kernel \(supported: multiples of 8"),
    ({"reorder_and_upcast_attn": True}, "native", "reorder_and_upcast_attn"),
    ({"activation_function": "relu"}, "native", "activation_function='relu'.*tanh"),
], ids=["head_dim", "reorder_and_upcast_attn", "activation"])
def test_config_the_level_cannot_serve_is_refused_before_anything_changes(overrides, level, message):
    model = tiny_model(**overrides)
    modules = dict(model.named_modules())
    implementation = model.config._attn_implementation
    with pytest.raises(ValueError, match=message):
        huggingface.apply(model, level)
    assert all(module is modules[name] for name, module in model.named_modules())
    assert model.config._attn_implementation == implementation and huggingface.patched_level(model) is None


def test_padding_mask_is_refused_with_the_reason():
    model = huggingface.apply(tiny_model(), "native")
    ids = torch.randint(0, TINY["vocab_size"], (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in the first row
    with pytest.raises(ValueError, match="not plain causal .*padding"):
        model(ids, attention_mask=mask)
    # A 4-D mask reaches the attention as the caller built it: causal is served, padding refused.
    causal = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=causal).logits, model(ids).logits)
    additive = torch.zeros(2, 1, 8, 8).masked_fill(~causal, torch.finfo(torch.float32).min)
    additive[0, :, :, :3] = torch.finfo(torch.float32).min
    with pytest.raises(ValueError, match="not plain causal"):
        model(ids, attention_mask=additive)


def test_attention_dropout_while_training_is_refused():
    model = huggingface.apply(tiny_model(attn_pdrop=0.1), "native").train()
    ids = torch.randint(0, TINY["vocab_size"], (1, 8))
    with pytest.raises(ValueError, match="attention dropout p=0.1 .*attn_pdrop"):
        model(ids, labels=ids)


def test_profiling_rows_time_each_way_against_sdpa_and_agree_on_tokens():
    from profiling.huggingface import generation_rows, training_rows

    training = training_rows((1, 8), torch.float32, "cpu", rows=["sdpa", "native"], config=TINY, repeats=1)
    assert list(training["status"]) == ["ok", "ok"] and training["vs_sdpa"].iloc[0] == 1.0
    generation = generation_rows(1, 4, 3, torch.float32, "cpu", rows=["eager", "sdpa", "cuda"], config=TINY, repeats=1)
    assert list(generation["status"]) == ["ok"] * 3 and generation["same_tokens_as_sdpa"].all()
