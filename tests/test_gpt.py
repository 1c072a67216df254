"""The tiny GPT and its parts: the same tokens at every level, a KV cache that changes nothing, training
on the course's text, and clear errors for bad token ids, too-long sequences and widths that do not
split into heads.
(Logits and every parameter gradient against float64 are in the equivalence grid, test_equivalence.py.)"""

import pytest
import torch

import levels
from levels.attention import decode_attention_math
from levels.gpt import TINY
from levels.spec import LEVEL_DTYPES
from levels.self_attention import DecodePosition, StaticKVCache
from profiling import perturb_parameters_
from profiling.language_model import CHARACTERS, decode, encode, load_text, random_windows, train

from .conftest import device_param, kernel_level_device_params, level_devices

ALL_LEVELS = levels.LEVELS
CONFIG = dict(TINY, block_size=32)


def tiny_gpt(level, device="cpu"):
    """The tiny GPT at ``level`` with the weights of one seeded level-1 model, in float32 on ``device``."""
    torch.manual_seed(1)  # the same initial weights at every call
    native = perturb_parameters_(levels.build("gpt", "native", **CONFIG))
    model = levels.build("gpt", level, **CONFIG)
    model.load_state_dict(native.state_dict())
    return model.to(device).eval()


@pytest.mark.parametrize("device", [device_param("cpu"), device_param("cuda")])
def test_greedy_generation_gives_identical_tokens_at_every_level(device):
    prompt = torch.randint(0, CONFIG["vocab_size"], (2, 5), device=device)
    generated = {}
    for level in ALL_LEVELS:
        if device not in level_devices(level):
            continue  # Triton runs CPU tensors only when no GPU is present
        generated[level] = tiny_gpt(level, device).generate(prompt, max_new_tokens=20)
    native = generated["native"]
    assert native.shape == (2, 25) and torch.equal(native[:, :5], prompt)
    for level, tokens in generated.items():
        assert torch.equal(tokens, native), f"level {level!r} generated {tokens.tolist()}, level 1 {native.tolist()}"


@pytest.mark.parametrize("level,device", [device_param(device, "native", id_prefix="native-") for device in ("cpu", "cuda")]
                         + kernel_level_device_params())
def test_generation_with_kv_cache_matches_recomputing_the_whole_sequence(level, device):
    model = tiny_gpt(level, device)
    prompt = torch.randint(0, CONFIG["vocab_size"], (3, 4), device=device)
    with torch.no_grad():
        recomputed = prompt
        for _ in range(6):
            next_token = model(recomputed)[:, -1].argmax(dim=-1, keepdim=True)
            recomputed = torch.cat((recomputed, next_token), dim=1)
    assert torch.equal(model.generate(prompt, max_new_tokens=6), recomputed)


@pytest.mark.parametrize("level,device", [device_param(device, level, id_prefix=f"{level}-")
                                          for level in ALL_LEVELS for device in level_devices(level)])
def test_static_cache_decoding_gives_the_growing_caches_tokens(level, device):
    """The static KV cache with its device-side position (a CUDA graph replayed per token on a GPU, the
    same step run eagerly on the CPU) decodes exactly as the growing cache does, windowed layers too."""
    for window in (None, 3):
        torch.manual_seed(1)
        native = perturb_parameters_(levels.build("gpt", "native", **CONFIG, window=window))
        model = levels.build("gpt", level, **CONFIG, window=window)
        model.load_state_dict(native.state_dict())
        model.to(device).eval()
        prompt = torch.randint(0, CONFIG["vocab_size"], (3, 4), device=device)
        growing = model.generate(prompt, max_new_tokens=9, cuda_graph=False)
        static = model.generate(prompt, max_new_tokens=9, cuda_graph=True)
        assert torch.equal(static, growing), f"window {window}: {static.tolist()} != {growing.tolist()}"


@pytest.mark.parametrize("level,device", kernel_level_device_params())
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 2, 64), (6, 2, 40)], ids=["heads-2", "grouped-6-over-2-dim-40"])
def test_decode_attention_over_a_static_cache_matches_the_masked_math(level, device, window, heads, kv_heads, head_dim):
    """Levels 4 and 5 write the new token's key and value into the caches and attend its query over the
    keys each sequence has filled (a count read on the device), visiting only those; level 1's math
    masks the whole cache. q, k and v come strided, as heads split off the fused projection; with
    grouped-query attention the caches hold kv_heads heads, and a head dim that is no tile width pads."""
    attention = levels.build("attention", level, causal=True, window=window or None)
    for dtype in LEVEL_DTYPES[level][device]:
        batch, capacity = 3, 150
        projection = torch.randn(batch, 1, heads + 2 * kv_heads, head_dim, dtype=dtype, device=device)
        q, k_new, v_new = projection.transpose(1, 2).split([heads, kv_heads, kv_heads], dim=1)
        k_cache, v_cache = (torch.randn(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device)
                            for _ in range(2))
        key_lengths = torch.tensor([1, 77, capacity], dtype=torch.int32, device=device)
        expected_k, expected_v = k_cache.double(), v_cache.double()
        expected = decode_attention_math(q.double(), k_new.double(), v_new.double(), expected_k, expected_v,
                                         key_lengths, window, head_dim ** -0.5)
        with torch.no_grad():
            out = attention.decode(q, k_new, v_new, k_cache, v_cache, key_lengths)
        assert out.shape == (batch, heads, 1, head_dim) and out.dtype == dtype
        assert levels.relative_max_error(out, expected) <= levels.TOLERANCE[dtype], dtype
        assert torch.equal(k_cache.double(), expected_k) and torch.equal(v_cache.double(), expected_v)


@pytest.mark.parametrize("level,device", [device_param(device, level, id_prefix=f"{level}-")
                                          for level in ("native", "cuda") for device in ("cpu", "cuda")])
def test_a_kept_static_decoder_serves_the_next_prompt_and_a_move_drops_it(level, device):
    model = tiny_gpt(level, device)
    long_prompt, short_prompt = (torch.randint(0, CONFIG["vocab_size"], (2, length), device=device) for length in (9, 3))
    model.generate(long_prompt, max_new_tokens=12, cuda_graph=True)  # leaves keys at positions a shorter call masks
    decoder = model.__dict__["_decoder"]
    assert torch.equal(model.generate(short_prompt, 7, cuda_graph=True), model.generate(short_prompt, 7, cuda_graph=False))
    assert model.__dict__["_decoder"] is decoder
    model.to(torch.float64)
    assert "_decoder" not in model.__dict__


def test_a_static_cache_decodes_one_token_per_call_after_the_prompt():
    model = tiny_gpt("native")
    caches = [StaticKVCache(1, 2, CONFIG["block_size"], 32, torch.float32, DecodePosition(1, torch.device("cpu")))
              for _ in model.h]
    with torch.no_grad():
        model.compute(torch.randint(0, 96, (1, 4)), caches)
        with pytest.raises(ValueError, match="one token per call"):
            model.compute(torch.randint(0, 96, (1, 2)), caches)


def test_sampling_with_temperature_is_reproducible_and_in_range():
    model = tiny_gpt("native")
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, 3))
    first = model.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(0))
    again = model.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(first, again)
    assert first.min() >= 0 and first.max() < CONFIG["vocab_size"]


@pytest.mark.parametrize("level,device", [device_param(device, level, id_prefix=f"{level}-")
                                          for level in ALL_LEVELS for device in level_devices(level)])
def test_token_ids_out_of_range_name_the_vocabulary_size(level, device):
    """On a CUDA tensor the forward checks the ids without waiting for the GPU (IdRangeOnTheWay): the
    error comes before the forward returns, whether or not targets are given."""
    model = levels.build("gpt", level, **CONFIG).to(device)
    with pytest.raises(ValueError, match=r"vocab_size=96.*to 96"):
        model(torch.tensor([[1, 2, 96]], device=device))
    with pytest.raises(ValueError, match=r"vocab_size=96.*from -1"):
        model(torch.tensor([[-1, 2]], device=device), torch.tensor([[2, 3]], device=device))
    with pytest.raises(ValueError, match=r"vocab_size=96.*from -1 to 96"):
        model.generate(torch.tensor([[-1, 96]], device=device), max_new_tokens=1)


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_sequences_longer_than_block_size_are_an_error(level):
    model = levels.build("gpt", level, **CONFIG)
    with pytest.raises(ValueError, match="33 tokens do not fit the model's block_size=32"):
        model(torch.zeros(1, 33, dtype=torch.int64))
    with pytest.raises(ValueError, match="34 tokens do not fit the model's block_size=32"):
        model.generate(torch.zeros(1, 30, dtype=torch.int64), max_new_tokens=4)


@pytest.mark.parametrize("level", ALL_LEVELS)
def test_float_token_ids_are_a_type_error(level):
    model = levels.build("gpt", level, **CONFIG)
    with pytest.raises(TypeError, match="int64 or int32"):
        model(torch.rand(1, 4))


@pytest.mark.parametrize("component", ["self_attention", "transformer_block"])
def test_width_that_does_not_split_into_heads_fails_at_construction(component):
    with pytest.raises(ValueError, match="n_embd=100 must be a positive multiple of n_head=3"):
        levels.build(component, "native", n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="n_embd=100 must be a positive multiple of n_head=3"):
        levels.build("gpt", "native", **dict(CONFIG, n_embd=100, n_head=3))


@pytest.mark.parametrize("component", ["feed_forward", "self_attention", "transformer_block"])
@pytest.mark.parametrize("level", ALL_LEVELS)
def test_wrong_width_names_the_expected_one(component, level):
    config = {"n_embd": 32} if component == "feed_forward" else {"n_embd": 32, "n_head": 2}
    module = levels.build(component, level, **config)
    with pytest.raises(ValueError, match=r"n_embd=32.*\(2, 5, 24\)"):
        module(torch.randn(2, 5, 24))


@pytest.mark.parametrize("level,device", kernel_level_device_params())
def test_head_dim_the_kernels_do_not_support_names_the_supported_ones(level, device):
    module = levels.build("self_attention", level, n_embd=100, n_head=1).to(device)
    with pytest.raises(ValueError, match=r"head_dim 100 is not supported.*multiples of 8 from 8 to 256"):
        module(torch.randn(1, 4, 100, device=device))


def test_course_text_round_trips_through_the_tiny_models_vocabulary():
    text = load_text()
    tokens = encode(text)
    assert len(CHARACTERS) == TINY["vocab_size"] and tokens.dtype == torch.int64
    assert tokens.numel() == len(text) > 5000 and decode(tokens) == text
    with pytest.raises(ValueError, match="outside the vocabulary.*'é'"):
        encode("café")


def test_training_windows_are_their_inputs_shifted_by_one_token():
    data = torch.arange(100)
    inputs, targets = random_windows(data, 4, 10, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (4, 10)
    assert torch.equal(targets, inputs + 1)  # data[i] == i, so the next token is the id plus one
    with pytest.raises(ValueError, match="100 tokens of data cannot give windows of 100 tokens"):
        random_windows(data, 1, 100, torch.Generator())


def test_training_on_the_course_text_lowers_the_loss():
    torch.manual_seed(0)
    model = levels.build("gpt", "native", **CONFIG)
    losses = train(model, encode(load_text()), steps=40, batch=8, tokens=32, progress=False)
    # From ln(96) = 4.56 (a uniform guess) to the character statistics of English: below 3.3.
    assert losses[0] > 4.3 and sum(losses[-5:]) / 5 < 3.3


def test_level_5_training_follows_level_1s_loss_curve():
    """The same weights, the same windows, the same AdamW steps: level 5's own forward and backward
    kernels give level 1's loss at every step, within the float32 tolerance."""
    data = encode(load_text())
    torch.manual_seed(0)
    native = levels.build("gpt", "native", **CONFIG)
    ours = levels.build("gpt", "cuda", **CONFIG)
    ours.load_state_dict(native.state_dict())
    native_losses, our_losses = (train(model, data, steps=20, batch=4, tokens=32, progress=False)
                                 for model in (native, ours))
    differences = [abs(a - b) / a for a, b in zip(native_losses, our_losses)]
    assert max(differences) <= levels.TOLERANCE[torch.float32], differences
