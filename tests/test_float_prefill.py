"""The float32 prompt prefill the llama.cpp runtime uses (moaspec/targets/float_prefill.py), against
transformers' own Llama forward on a tiny random model; its cells as llama.cpp's sequence state."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_tiny_target

from moaspec.targets.float_prefill import FloatLlama, FloatPrefillCache
from moaspec.targets.llamacpp_cells import STATE_HEADER, SequenceState
from moaspec.targets.llamacpp_prefill import float_prefill_unsupported


def saved_tiny_llama(tmp_path, **overrides):
    """A tiny random Llama (rope_theta 10,000, GQA 4 / 2 heads) saved as float32 safetensors with
    float16-exact weights (what FloatLlama holds), and transformers' model of it in float32."""
    model = make_tiny_target("llama", seed=3, dtype=torch.float32, **overrides).model
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())
    model.save_pretrained(tmp_path)
    config = SimpleNamespace(**json.loads((tmp_path / "config.json").read_text()))
    return model, config


@torch.inference_mode()
def test_the_float_forward_is_transformers_llama(tmp_path) -> None:
    """Keys (after the rotary embedding), values and final-normed hidden states of a prompt equal
    transformers' float32 forward up to the float16 rounding of keys and values; a wrong rotary
    half or head grouping would be off by the values' own size."""
    model, config = saved_tiny_llama(tmp_path)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    cache = FloatPrefillCache(FloatLlama(tmp_path, config), chunk_size=16)  # three chunks: attention over past chunks
    cache.prefill(ids.tolist())
    out = model(ids[None], output_hidden_states=True, use_cache=True)
    hidden = out.hidden_states[-1][0]  # transformers' last hidden state is after the final norm
    assert torch.allclose(cache.hidden[:40], hidden, atol=2e-3, rtol=2e-3)
    for layer in range(config.num_hidden_layers):
        keys = out.past_key_values.layers[layer].keys[0].transpose(0, 1)  # [T, n_kv, head_dim]
        values = out.past_key_values.layers[layer].values[0].transpose(0, 1)
        assert torch.allclose(cache.keys[layer, :40].float(), keys, atol=2e-3, rtol=2e-3)
        assert torch.allclose(cache.values[layer, :40].float(), values, atol=2e-3, rtol=2e-3)
        assert keys.abs().max() > 0.1  # not trivially small


@torch.inference_mode()
def test_bfloat16_products_stay_within_their_rounding_of_float32s_but_the_cache_is_float32s(tmp_path) -> None:
    """compute "bfloat16": the hidden states, keys and values move by bfloat16's rounding (2^-8 a
    product) from the float32 forward's, not more (a product left in bfloat16, or inputs not
    rounded back, would be far off), and not less (the products do run in bfloat16); the key and
    value projections stay float32 products (FLOAT32_ALWAYS), so the first layer's keys and
    values, which read only the embedding, are float32's bit for bit."""
    _, config = saved_tiny_llama(tmp_path)
    model = FloatLlama(tmp_path, config)
    ids = torch.randint(0, config.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    float32, bfloat16 = FloatPrefillCache(model, 16), FloatPrefillCache(model, 16, "bfloat16")
    float32.prefill(ids)
    bfloat16.prefill(ids)

    def relative(got: torch.Tensor, want: torch.Tensor) -> float:
        return float((got.float() - want.float()).norm() / want.float().norm())

    assert 1e-4 < relative(bfloat16.hidden[:40], float32.hidden[:40]) < 0.01
    assert 1e-4 < relative(bfloat16.keys[1:, :40], float32.keys[1:, :40]) < 0.01
    assert 1e-4 < relative(bfloat16.values[1:, :40], float32.values[1:, :40]) < 0.01
    assert torch.equal(bfloat16.keys[0, :40], float32.keys[0, :40]) and torch.equal(bfloat16.values[0, :40], float32.values[0, :40])
    with pytest.raises(ValueError, match="compute must be one of"):
        FloatPrefillCache(model, 16, "float16").prefill(ids)


@torch.inference_mode()
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_a_kept_chunk_gives_a_fresh_prefills_bits(tmp_path, compute) -> None:
    """A second prompt keeps the whole chunks it shares with the one held and computes the rest;
    its keys, values and hidden states equal a fresh cache's bit for bit, a partial shared chunk
    included (computed again), with either product type."""
    _, config = saved_tiny_llama(tmp_path)
    model = FloatLlama(tmp_path, config)
    first = list(range(10, 60))
    second = first[:37] + [5, 6, 7, 8, 9]
    warm = FloatPrefillCache(model, chunk_size=16, compute=compute)
    assert warm.prefill(first) == 0
    assert warm.prefill(second) == 32  # 37 shared tokens: two whole chunks kept
    fresh = FloatPrefillCache(model, chunk_size=16, compute=compute)
    fresh.prefill(second)
    count = len(second)
    assert warm.tokens == fresh.tokens == second
    assert torch.equal(warm.keys[:, :count], fresh.keys[:, :count])
    assert torch.equal(warm.values[:, :count], fresh.values[:, :count])
    assert torch.equal(warm.hidden[:count], fresh.hidden[:count])
    rows = warm.layer_rows((1,), count)  # [T, 1, n_kv * 2 * head_dim], per KV head [k, v]
    head_dim = model.head_dim
    assert rows.shape == (count, 1, model.num_kv_heads * 2 * head_dim)
    assert torch.equal(rows[:, 0, head_dim : 2 * head_dim], warm.values[1, :count, 0].float())
    assert torch.equal(rows[:, 0, 2 * head_dim : 3 * head_dim], warm.keys[1, :count, 1].float())


@torch.inference_mode()
@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_chunks_computed_together_give_the_bits_of_chunks_computed_one_by_one(tmp_path, compute) -> None:
    """The forward runs every chunk through a layer before the next layer (its weights widened
    once); each chunk gets the bits it gets computed alone after the chunks before it."""
    _, config = saved_tiny_llama(tmp_path)
    model = FloatLlama(tmp_path, config)
    ids = list(range(3, 43))
    one_by_one = FloatPrefillCache(model, chunk_size=16, compute=compute)
    assert [one_by_one.prefill(ids[:end]) for end in (16, 32, 40)] == [0, 16, 32]  # each call computes one chunk
    together = FloatPrefillCache(model, chunk_size=16, compute=compute)
    assert together.prefill(ids) == 0
    assert torch.equal(one_by_one.keys[:, :40], together.keys[:, :40])
    assert torch.equal(one_by_one.values[:, :40], together.values[:, :40])
    assert torch.equal(one_by_one.hidden[:40], together.hidden[:40])


@torch.inference_mode()
def test_a_cancelled_prefill_holds_only_the_chunks_it_kept(tmp_path) -> None:
    _, config = saved_tiny_llama(tmp_path)
    cache = FloatPrefillCache(FloatLlama(tmp_path, config), chunk_size=8)
    cache.prefill(list(range(20)))
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) == 2  # before the second layer

    assert cache.prefill([*range(18), 90, 91, 92, 93], cancelled) == 16
    assert cache.tokens == list(range(16)) and len(asked) == 2
    cache.prefill([*range(18), 90, 91, 92, 93])
    fresh = FloatPrefillCache(cache.model, chunk_size=8)
    fresh.prefill([*range(18), 90, 91, 92, 93])
    assert torch.equal(cache.keys[:, :22], fresh.keys[:, :22]) and torch.equal(cache.hidden[:22], fresh.hidden[:22])


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"model_type": "qwen2"}, "model type 'qwen2' (only 'llama')"),
        ({"attention_bias": True}, "biases"),
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "scaled rotary embedding"),
    ],
)
def test_configurations_the_forward_does_not_compute_are_named(tmp_path, change, reason) -> None:
    _, config = saved_tiny_llama(tmp_path)
    assert float_prefill_unsupported(config) is None
    assert float_prefill_unsupported(SimpleNamespace(**(vars(config) | change))) == reason


def test_float_cells_are_a_sequence_state_llama_cpp_reads() -> None:
    """of_floats writes the layout `parse` reads (positions 0.., sequence 0, per-layer typed rows)."""
    header = bytes(range(STATE_HEADER))
    keys = [np.arange(24, dtype=np.float32).reshape(3, 8) + layer for layer in range(2)]
    values = [np.arange(24, dtype=np.float16).reshape(3, 8) - layer for layer in range(2)]
    state = SequenceState.parse(memoryview(bytes(SequenceState.of_floats(header, keys, values).to_buffer())))
    assert state.header == header and state.cells == 3
    assert [kind for kind, _ in state.keys] == [0, 0] and [kind for kind, _ in state.values] == [1, 1]
    assert np.array_equal(state.keys[1][1].view(np.float32), keys[1])
    assert np.array_equal(state.values[0][1].view(np.float16), values[0])


def test_a_prompts_first_turn_ends_after_the_first_generation_prompt() -> None:
    from moaspec.chat import generation_prompt_ids
    from moaspec.targets.llamacpp_prompt_paths import end_of_first

    assert end_of_first((7, 8), [1, 7, 8, 2, 7, 8]) == 3
    assert end_of_first((7, 8), [1, 7, 2, 8]) == 4  # none: the whole prompt
    assert end_of_first((), [1, 2, 3]) == 3
    assert generation_prompt_ids(None) == ()
    assert generation_prompt_ids(SimpleNamespace(chat_template=None)) == ()
