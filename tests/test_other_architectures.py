"""Targets beyond Llama / Qwen2 on the transformers runtime: GPT-2 (absolute positions, LayerNorm,
its modules under `transformer.h` / `ln_f`, its config's own names). Model drafters without TLI
run on it and keep plain decoding's output; TLI is refused (no rotary embedding to run its last
layers by hand); `moaspec train` checks `--max-seq-len` against its context first (float64)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_random_drafter_net
from test_eagle import overfit as overfit_eagle
from test_engine import PROMPT
from test_moa import greedy_reference, overfit_moa
from transformers import GPT2Config, GPT2LMHeadModel

from moaspec.config import GenerationConfig, TreeConfig
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.moa import MoADrafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
from moaspec.nn.moa import MoAConfig, MoADrafterNet
from moaspec.targets.hf import HFTarget

VOCAB = 300
NO_STOP: frozenset[int] = frozenset()


def gpt2_config(**overrides) -> GPT2Config:
    settings = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=0, eos_token_id=VOCAB + 5)
    return GPT2Config(**(settings | overrides))


def gpt2_target() -> HFTarget:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config())
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # tied to the embeddings: well-separated argmax, as conftest's targets
    return HFTarget(model.to(torch.float64).eval(), None, "tiny-gpt2")


def test_a_gpt2_target_exposes_its_modules_and_only_stop_ids_in_its_vocabulary() -> None:
    target = gpt2_target()
    assert target.decoder_layers is target.model.transformer.h and target.final_norm is target.model.transformer.ln_f
    assert target.rotary_emb is None and target.max_positions == 128
    assert target.stop_ids == frozenset()  # eos VOCAB + 5 can never be generated (bug: an IndexError in training)


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_model_drafters_on_a_gpt2_target_keep_plain_decodings_output(method: str) -> None:
    """Bug: the drafters' configs read `rms_norm_eps` / `intermediate_size` and the target's
    modules `model.layers` / `model.norm`, which GPT-2 does not have: a traceback."""
    target = gpt2_target()
    if method == "moa":
        net_class, drafter_class, config = MoADrafterNet, MoADrafter, MoAConfig.for_target(target.config)
    else:
        net_class, drafter_class, config = EagleDrafterNet, EagleDrafter, EagleConfig.for_target(target.config)
    assert config.rms_norm_eps == target.config.layer_norm_epsilon
    expected = greedy_reference(target, PROMPT, 40)  # transformers' own decoding, not our engine's
    net = make_random_drafter_net(net_class, config, target)
    if method == "moa":  # fitted to the answer, so that real drafts are accepted (an audit's: none were)
        overfit_moa(net, target, PROMPT + expected, len(PROMPT))
    else:
        overfit_eagle(net, target, PROMPT + expected)
    drafter = drafter_class(net, target, TreeConfig(depth=3, top_k=2, budget=5))
    drafted = Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=40), stop_ids=NO_STOP)
    assert drafted.token_ids == expected and sum(drafted.stats.accepted_depth[1:]) > 0


def test_tli_on_a_target_without_rotary_embedding_is_refused() -> None:
    target = gpt2_target()
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config, tli_layers=1), target)
    with pytest.raises(MoaspecError, match=r"GPT2Block computes something else \(ValueError: no rotary embedding\)"):
        MoADrafter(net, target, TreeConfig(depth=2, top_k=2, budget=3))


def test_train_checks_max_seq_len_against_the_targets_context(tmp_path, capsys) -> None:
    from moaspec.cli import main

    GPT2LMHeadModel(gpt2_config()).save_pretrained(tmp_path / "gpt2")
    capsys.readouterr()  # transformers' progress bar
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-00000.jsonl").write_text("")
    flags = ["--method", "eagle", "--target", str(tmp_path / "gpt2"), "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run")]
    assert main(["train", *flags]) == 2  # --max-seq-len 768 by default
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["moaspec: error: --max-seq-len 768 exceeds the target's context of 128 positions"]
    assert not (tmp_path / "run").exists()


def test_a_reduced_precision_gpt2_target_lends_its_parts(tmp_path, monkeypatch) -> None:
    """_load_transformers gives a bfloat16 / float16 target the parts loader `_torch_parts`,
    which reads `model.embed_tokens.weight` / `model.norm.weight` and builds an RMSNorm:
    GPT-2's are `transformer.wte` / `transformer.ln_f` (a LayerNorm). A SafetensorError traceback."""
    import moaspec.targets.load as load

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=128)).save_pretrained(tmp_path)
    model = load.load_causal_lm(tmp_path, torch.bfloat16)
    monkeypatch.setattr(load, "resolve_target", lambda spec: ("tiny-gpt2", tmp_path))
    monkeypatch.setattr(load, "load_tokenizer", lambda directory: None)
    target = load.load_target(str(tmp_path), runtime="transformers", dtype=torch.bfloat16)
    assert target._parts_loader is None  # not a Llama-style file layout: the model's own modules, widened
    parts = target.parts(0)
    x = torch.randn(3, 64)
    expected = torch.nn.functional.layer_norm(
        x, (64,), model.transformer.ln_f.weight.float(), model.transformer.ln_f.bias.float(), model.config.layer_norm_epsilon
    )
    assert torch.allclose(parts.final_norm(x), expected, atol=1e-5)
