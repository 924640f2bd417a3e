"""Targets with sliding-window attention (targets/hf_attention.py): Mistral (every layer slides),
Qwen2 with `use_sliding_window` and Gemma 2 (both kinds mixed; Gemma 2 soft-caps its logits and
has no sdpa path). With a window of 8, shorter than the prompt and the generation, trees verified
by the transformers runtime give transformers' own greedy output (float64). Bug: the cache kept
only each sliding layer's window, so the first tree that rejected a node ended in an IndexError
(Gemma 2: a shape error at any length)."""

from __future__ import annotations

import pytest
import torch
from conftest import _tiny_config
from test_engine import PROMPT, ScriptedDrafter
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from moaspec.config import GenerationConfig
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.targets.hf import HFTarget
from moaspec.targets.hf_attention import FULL, SLIDING, AttentionLayout
from moaspec.targets.load import load_causal_lm

WINDOW = 8
FAMILIES = {  # config, model, settings, attention, the layers' kinds
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": WINDOW}, "sdpa", (SLIDING, SLIDING)),
    "qwen2": (
        Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        "sdpa", (FULL, SLIDING),
    ),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": WINDOW, "head_dim": 16}, "eager", (SLIDING, FULL)),
}


def sliding_target(family: str) -> HFTarget:
    config_class, model_class, settings, attention, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(_tiny_config(config_class, **settings))
    model.config._attn_implementation = attention
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # well-separated argmax (conftest.make_tiny_target)
    return HFTarget(model.to(torch.float64).eval(), None, f"tiny-{family}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trees_on_sliding_window_targets_give_transformers_greedy_output(family: str) -> None:
    target = sliding_target(family)
    assert target.attention == AttentionLayout(FAMILIES[family][4], WINDOW)
    with torch.no_grad():
        reference = target.model.generate(
            torch.tensor([PROMPT]), max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0
        )[0, len(PROMPT):].tolist()
    for depth, correct, siblings in [(4, 4, 0), (5, 2, 2), (3, 1, 1), (6, 6, 3)]:
        drafter = ScriptedDrafter(reference, target.vocab_size, depth, correct, siblings)
        result = Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=30))
        assert result.token_ids == reference, (family, depth, correct, siblings)
    assert target.num_cached > WINDOW


def test_the_tree_mask_of_a_sliding_layer_hides_keys_outside_the_window() -> None:
    """A node at position q sees keys at positions > q - window: the context's and its ancestors'."""
    parents = torch.tensor([-1, 0, 1, 0])  # positions 5, 6, 7, 6 after 5 verified tokens
    layout = AttentionLayout((FULL, SLIDING), 3)
    masks = layout.tree_mask(parents, 5, torch.float64)
    visible = {kind: (mask[0, 0] == 0).int().tolist() for kind, mask in masks.items()}
    assert visible[FULL] == [[1, 1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 0, 0, 1]]
    assert visible[SLIDING] == [[0, 0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0, 0],
                                [0, 0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 0, 0, 1]]
    only_sliding = AttentionLayout((SLIDING, SLIDING), 3).tree_mask(parents, 5, torch.float64)
    assert torch.equal(only_sliding, masks[SLIDING])


def test_layers_the_runtime_cannot_verify_trees_on_are_refused() -> None:
    chunked = LlamaConfig(num_hidden_layers=2, layer_types=["chunked_attention", "full_attention"], attention_chunk_size=4)
    with pytest.raises(MoaspecError, match="target odd has chunked_attention layers"):
        AttentionLayout.of(chunked, "odd")
    assert AttentionLayout.of(LlamaConfig(num_hidden_layers=2), "plain") == AttentionLayout((FULL, FULL), None)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_layout_is_the_same_without_transformers_per_layer_helper(family: str, monkeypatch) -> None:
    """transformers before 5.16 has no get_layer_types_and_kwargs: the config's own fields say it."""
    import transformers.cache_utils

    config_class, _, settings, _, kinds = FAMILIES[family]
    config = _tiny_config(config_class, **settings)
    monkeypatch.delattr(transformers.cache_utils, "get_layer_types_and_kwargs")
    assert AttentionLayout.of(config, family) == AttentionLayout(kinds, WINDOW)


def test_a_model_without_sdpa_loads_with_eager_attention(tmp_path) -> None:
    """Bug: a Gemma 2 directory failed to load (the runtime asked for sdpa, which it has not)."""
    torch.manual_seed(0)
    Gemma2ForCausalLM(_tiny_config(Gemma2Config, head_dim=16)).save_pretrained(tmp_path / "gemma2")
    MistralForCausalLM(_tiny_config(MistralConfig)).save_pretrained(tmp_path / "mistral")
    assert load_causal_lm(tmp_path / "gemma2", torch.float32).config._attn_implementation == "eager"
    assert load_causal_lm(tmp_path / "mistral", torch.float32).config._attn_implementation == "sdpa"
    assert load_causal_lm(tmp_path / "mistral", torch.float32, "eager").config._attn_implementation == "eager"


def test_a_mistral_config_with_layer_types_is_verified_exactly_or_refused() -> None:
    """MistralModel applies config.sliding_window to every layer and ignores `layer_types`
    (transformers warns that such configs exist); AttentionLayout reads `layer_types`, so the
    trees' masks have no window while prefills and chains have one: greedy output changes."""
    torch.manual_seed(0)
    config = _tiny_config(MistralConfig, sliding_window=3, layer_types=["full_attention", "full_attention"])
    model = MistralForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    target = HFTarget(model.to(torch.float64).eval(), None, "tiny-mistral-layer-types")
    assert target.attention == AttentionLayout((SLIDING, SLIDING), 3)
    with torch.no_grad():
        reference = target.model.generate(
            torch.tensor([PROMPT]), max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0
        )[0, len(PROMPT):].tolist()
    drafter = ScriptedDrafter(reference, target.vocab_size, 5, 2, 2)
    result = Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=30))
    assert result.token_ids == reference
