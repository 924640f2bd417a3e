"""The transformers runtime in bfloat16 / float16 (`--dtype`, targets/hf.py): verifiers get float32
logits, drafters float32 features and float32 copies of the modules they borrow, read from the
target's files, so a drafter trained on the float32 target loads (same fingerprint) and computes
as it was trained."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import make_random_drafter_net, make_tiny_target
from test_eagle import overfit

from moaspec.config import GenerationConfig, SamplingConfig, TreeConfig
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.none import NoDrafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.nn.checkpoint import target_fingerprint
from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
from moaspec.targets.hf import HFTarget
from moaspec.targets.load import _torch_parts, load_target, torch_dtype
from moaspec.targets.safetensors_weights import SafetensorsWeights
from moaspec.tree import DraftTree

PROMPT = torch.tensor([5, 17, 3, 42, 8, 61, 29, 11])


def _saved_pair(directory: Path, dtype: torch.dtype, **save_options) -> tuple[HFTarget, HFTarget]:
    """A tiny float32 target saved to `directory`, and the same weights loaded in `dtype` with
    its parts read from the files, as targets/load.py loads a reduced-precision target."""
    exact = make_tiny_target("llama", dtype=torch.float32)
    exact.model.save_pretrained(directory, **save_options)
    reduced_model = make_tiny_target("llama", dtype=torch.float32).model.to(dtype)
    loader = functools.partial(_torch_parts, directory, reduced_model.config)
    return exact, HFTarget(reduced_model, None, exact.name, loader)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_reduced_precision_target_hands_out_float32(tmp_path: Path, dtype: torch.dtype) -> None:
    exact, reduced = _saved_pair(tmp_path, dtype)
    assert reduced.weights_dtype == dtype and reduced.dtype == torch.float32
    out = reduced.prefill(PROMPT, hidden_layers=(1, 2))
    assert out.logits.dtype == torch.float32 and out.hidden.dtype == torch.float32
    assert reduced.layer_kv(0, len(PROMPT)).dtype == torch.float32
    tree = DraftTree(torch.tensor([7, 9, 4]), torch.tensor([-1, 0, 0]))
    assert reduced.verify(tree).logits.dtype == torch.float32
    # the reduced model's own answer, widened: close to the float32 target's, not equal. The bound
    # scales with the dtype's unit roundoff and the largest logit; its factor 8 is empirical, with a
    # 4-6x margin (measured: bfloat16 0.046 of 0.30, float16 0.0086 of 0.038); another model's
    # logits are far outside it (~14)
    want = exact.prefill(PROMPT).logits
    bound = 8 * torch.finfo(dtype).eps / 2 * float(want.abs().max())
    assert not torch.equal(out.logits, want)
    assert float((out.logits - want).abs().max()) < bound
    other = make_tiny_target("llama", seed=1, dtype=torch.float32).prefill(PROMPT).logits
    assert float((other - want).abs().max()) > 10 * bound


def test_borrowed_parts_are_the_float32_files_and_the_fingerprint_holds(tmp_path: Path) -> None:
    exact, reduced = _saved_pair(tmp_path, torch.bfloat16)
    parts = reduced.parts(1)
    assert torch.equal(parts.embed_tokens.weight, exact.embed_tokens.weight)
    assert torch.equal(parts.lm_head_weight, exact.lm_head.weight)
    assert torch.equal(parts.final_norm.weight, exact.final_norm.weight)
    want_layer = exact.decoder_layers[-1].state_dict()
    got_layer = parts.tli_layers[0].state_dict()
    assert all(torch.equal(got_layer[name], want_layer[name]) for name in want_layer)
    assert target_fingerprint(reduced) == target_fingerprint(exact)
    # a session shares the loaded copies
    assert reduced.new_session().parts(1) is parts


def test_sharded_weights_are_read_by_their_index(tmp_path: Path) -> None:
    exact, reduced = _saved_pair(tmp_path, torch.bfloat16, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert torch.equal(reduced.parts(0).embed_tokens.weight, exact.embed_tokens.weight)
    with SafetensorsWeights(tmp_path) as weights, pytest.raises(MoaspecError, match="no tensor 'nope'"):
        weights.get_tensor("nope")


def test_a_directory_without_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(MoaspecError, match="no safetensors weights"):
        SafetensorsWeights(tmp_path)


def test_a_model_made_in_memory_lends_widened_copies() -> None:
    target = make_tiny_target("qwen2", dtype=torch.bfloat16)
    parts = target.parts(1)
    assert parts.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(parts.embed_tokens.weight, target.embed_tokens.weight.float())
    assert next(parts.tli_layers[0].parameters()).dtype == torch.float32
    assert target.decoder_layers[-1].mlp.up_proj.weight.dtype == torch.bfloat16  # the model stays


def test_a_float32_drafter_runs_against_a_bfloat16_target(tmp_path: Path) -> None:
    """The engine with a float32 EAGLE drafter on a bfloat16 target: the drafter computes in
    float32 on float32 features, and its drafts are verified and accepted. Not compared with plain
    decoding: a bfloat16 tree's rows may round differently from one-token steps (README)."""
    _, reduced = _saved_pair(tmp_path, torch.bfloat16)
    plain = Engine(reduced, NoDrafter()).generate(
        PROMPT.tolist(), generation=GenerationConfig(max_new_tokens=24), stop_ids=frozenset()
    )
    net = make_random_drafter_net(EagleDrafterNet, EagleConfig.for_target(reduced.config), reduced).float()
    overfit(net, reduced, PROMPT.tolist() + plain.token_ids)  # so that drafts are accepted
    drafter = EagleDrafter(net, reduced, TreeConfig(depth=3, top_k=2, budget=6))
    assert drafter.dtype == torch.float32 and drafter.head.dtype == torch.float32
    result = Engine(reduced, drafter).generate(
        PROMPT.tolist(), SamplingConfig(temperature=0.0), GenerationConfig(max_new_tokens=24), stop_ids=frozenset()
    )
    assert len(result.token_ids) == 24
    # an audit's: with the random net no draft was accepted (24 forwards, as plain decoding)
    assert sum(result.stats.accepted_depth) > 0 and result.stats.target_forwards < 24


def test_dtype_names() -> None:
    assert torch_dtype("bfloat16") is torch.bfloat16
    assert torch_dtype(torch.float64) is torch.float64
    with pytest.raises(MoaspecError, match="unknown target dtype 'int8'"):
        torch_dtype("int8")
    with pytest.raises(MoaspecError, match="unsupported target dtype"):
        torch_dtype(torch.int8)


def test_llama_cpp_takes_no_dtype() -> None:
    with pytest.raises(MoaspecError, match="^dtype applies to the transformers runtime"):
        load_target("smollm2-135m", "llama.cpp", dtype="bfloat16")


@pytest.mark.parametrize("device, message", [("tpu", "^device must be cpu or cuda"), ("cuda:99", "^device cuda:99: this")])
def test_library_errors_name_the_keyword_not_the_flag(device: str, message: str) -> None:
    """An audit's: load(device="tpu") said `--device must be ...`, a flag the library has not."""
    with pytest.raises(MoaspecError, match=message):
        load_target("smollm2-135m", "transformers", device=device)


def test_the_calibration_keeps_each_precision_apart() -> None:
    """Costs measured in bfloat16 are not float32's: the calibration's runtime key names the
    model's precision, not the float32 its drafters read."""
    from moaspec.calibration.machine import runtime_description

    exact, reduced = make_tiny_target("llama", dtype=torch.float32), make_tiny_target("llama", dtype=torch.bfloat16)
    assert " float32 " in runtime_description(exact) and " bfloat16 " in runtime_description(reduced)
