"""The llama.cpp runtime's float32 prompt prefill (moaspec/targets/float_prefill.py, llamacpp.py) on
the real SmolLM2-135M GGUF: trees stay exact over the moved cells, greedy output with every drafter
equals plain decoding, what drafters read stays close to llama.cpp's own, and the choice of path is
measured once per machine (llamacpp_prefill.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from llamacpp_helpers import check_oracle_trees, plain_decode, require_exact_trees

from moaspec.bench.prompts import load_prompts
from moaspec.chat import encode_chat_messages, encode_chat_prompt, generation_prompt_ids
from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.drafters import make_drafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.targets.llamacpp import LlamaCppTarget
from moaspec.targets.llamacpp_prefill import FLOAT_PREFILL_MIN_TOKENS, NEVER, PREFILL_ENV
from moaspec.targets.llamacpp_prompt_paths import FLOAT_CHUNK
from moaspec.targets.llamacpp_value_cache import VALUE_CACHE_ENV
from moaspec.tree import DraftTree


def sibling(target: LlamaCppTarget) -> LlamaCppTarget:
    """A target of its own on the same weights, as new_session() makes them (the float weights shared)."""
    return LlamaCppTarget(
        target.weights, target.tokenizer, target.config, target.name, threads=2, parts_loader=target._parts_loader,
        parts=target._parts, float_llama=target._float,
    )


@pytest.mark.parametrize(("values", "path"), [("f16", "float"), ("q8_0", "float"), ("f16", "bfloat16")])
def test_float_prefilled_prompts_keep_trees_exact(llama_target, category_prompts, monkeypatch, values, path) -> None:
    """MOASPEC_LLAMA_PREFILL=float (or bfloat16): a prompt of FLOAT_PREFILL_MIN_TOKENS or more is
    prefilled in float torch, all but its last token moved in (keys, and q8_0 values, rotated and
    quantized as llama.cpp holds them); decoding after it stays close to llama.cpp's own prefill,
    and the accepted nodes of random trees have one-token decoding's logits bit for bit."""
    monkeypatch.setenv(VALUE_CACHE_ENV, values)
    monkeypatch.setenv(PREFILL_ENV, path)
    target = sibling(llama_target)
    require_exact_trees(target)
    prompt = category_prompts["summarization"]
    assert len(prompt) >= FLOAT_PREFILL_MIN_TOKENS and target.uses_float_prefill
    assert target.float_compute == {"float": "float32", "bfloat16": "bfloat16"}[path]
    tokens, logits = plain_decode(target, prompt, 40)
    assert target._moved == len(prompt) - 1 and target._prompt_ctx is None
    monkeypatch.setenv(PREFILL_ENV, "llama.cpp")
    in_llama = sibling(llama_target)
    _, llama_logits = plain_decode(in_llama, prompt, 9)
    assert in_llama._moved == 0
    # both valid numerics (llama.cpp's 8-bit activations or float32): 0.5-1.1 apart on this target;
    # keys moved in transformers' per-head order, or values left unrotated, put them far apart
    assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(logits[:9], llama_logits)) < 3.0
    target.set_context(torch.tensor(prompt))
    check_oracle_trees(target, tokens, logits)


@pytest.mark.parametrize("path", ["float", "bfloat16"])
def test_greedy_output_with_drafters_equals_plain_decoding_after_a_float_prefill(
    llama_target, category_prompts, monkeypatch, path
) -> None:
    """Every category's prompt (those of FLOAT_PREFILL_MIN_TOKENS or more through the float path,
    with either product type), every kind of drafter input: lookup, captured keys/values (MoA),
    hidden states (EAGLE-2)."""
    monkeypatch.setenv(PREFILL_ENV, path)
    target = sibling(llama_target)
    require_exact_trees(target)
    assert any(len(prompt) >= FLOAT_PREFILL_MIN_TOKENS for prompt in category_prompts.values())
    plain = Engine(target, make_drafter("none", target))
    generation = GenerationConfig(max_new_tokens=40)
    expected = {name: plain.generate(prompt, SamplingConfig(), generation).token_ids for name, prompt in category_prompts.items()}
    for drafter in ("ngram", "moa+ngram", "eagle"):
        engine = Engine(target, make_drafter(drafter, target))
        for name, prompt in category_prompts.items():
            assert engine.generate(prompt, SamplingConfig(), generation).token_ids == expected[name], (drafter, name)


def test_what_drafters_read_of_a_float_prefilled_prompt_is_close_to_llama_cpps(
    llama_target, category_prompts, monkeypatch
) -> None:
    """The keys/values a drafter captures (transformers' layout) and the final hidden states of a
    float-prefilled prompt (either product type) are within llama.cpp's own activation rounding of
    its prefill's."""
    prompt = torch.tensor(category_prompts["summarization"])
    hidden_layers = (llama_target.num_layers,)
    rows = {}
    for path in ("float", "bfloat16", "llama.cpp"):
        monkeypatch.setenv(PREFILL_ENV, path)
        target = sibling(llama_target)
        target.keep_layer_kv(range(26, 30))
        out = target.set_context(prompt, hidden_layers)
        rows[path] = (target.layer_kv(0, len(prompt)), out.hidden[:, 0])
        assert target._moved == (0 if path == "llama.cpp" else len(prompt) - 1)
    for path in ("float", "bfloat16"):
        for got, want in zip(rows[path], rows["llama.cpp"]):
            assert got.shape == want.shape
            assert float((got - want).norm() / want.norm()) < 0.05, path  # keys with halves interleaved: ~1.0


@pytest.mark.parametrize(("path", "name", "length"), [
    ("llama.cpp", "qa", 40),  # decoded in the verified context
    ("llama.cpp", "qa", 450),  # the prompt context, moved in
    ("float", "summarization", None),  # the float path, moved in
])
def test_final_hidden_states_kept_unasked_equal_those_asked(llama_target, category_prompts, monkeypatch, path, name, length) -> None:
    """keep_final_hidden (a drafter built in the background reads them when it joins): every
    verified token's final hidden state is kept, in numpy, without being asked for, on every
    prefill path, through a verified tree's commit and an append; `verified_hidden` gives the
    same bits as asking for them, and refuses positions not kept."""
    monkeypatch.setenv(PREFILL_ENV, path)
    kept, asked, bare = sibling(llama_target), sibling(llama_target), sibling(llama_target)
    require_exact_trees(kept)
    kept.keep_final_hidden()
    last = (kept.num_layers,)
    prompt = torch.tensor(category_prompts[name][:length])
    n = len(prompt)
    plain, wanted = kept.set_context(prompt), asked.set_context(prompt, last)
    assert plain.hidden is None and np.array_equal(plain.logits, wanted.logits)
    # every row an output does not change the last row's logits: the first token is plain decoding's
    assert np.array_equal(plain.logits, bare.set_context(prompt).logits)
    assert kept._moved_from == asked._moved_from == {40: None, 450: "prompt context", None: "float"}[length]
    assert torch.equal(kept.verified_hidden(0, n), wanted.hidden)
    tree = DraftTree(torch.tensor([int(wanted.logits.argmax()), 5, 6]), torch.tensor([-1, 0, 0]))
    assert kept.verify(tree).hidden is None
    verified = asked.verify(tree, last)
    kept.commit([0, 2])
    asked.commit([0, 2])
    assert torch.equal(kept.verified_hidden(n, n + 2), verified.hidden[[0, 2]])
    kept.prefill(torch.tensor([7, 8]))
    appended = asked.prefill(torch.tensor([7, 8]), last)
    assert torch.equal(kept.verified_hidden(n + 2, n + 4), appended.hidden)
    with pytest.raises(MoaspecError, match="not kept"):
        kept.verified_hidden(0, n + 5)
    with pytest.raises(MoaspecError, match="not kept"):
        sibling(llama_target).verified_hidden(0, 1)
    # asked for after a context that kept none: this append's own (an audit: they were refused)
    reference = sibling(llama_target)
    reference.set_context(prompt, last)
    for target, asking in ((bare, ()), (reference, last)):
        target.prefill(torch.tensor([7]), asking)
    assert torch.equal(bare.prefill(torch.tensor([8]), last).hidden, reference.prefill(torch.tensor([8]), last).hidden)
    kept.forget_final_hidden()
    kept.prefill(torch.tensor([9]))
    with pytest.raises(MoaspecError, match="not kept"):
        kept.verified_hidden(n + 4, n + 5)


def test_a_chats_next_turn_after_a_float_prefill_equals_a_fresh_prefill(llama_target, category_prompts, monkeypatch) -> None:
    """A follow-up sharing a long prompt's start keeps the float path's whole chunks and gives a
    fresh context's logits bit for bit; an interrupted float prefill leaves an empty context."""
    monkeypatch.setenv(PREFILL_ENV, "float")
    warm, fresh = sibling(llama_target), sibling(llama_target)
    require_exact_trees(warm)
    warm.keep_layer_kv(range(26, 30))
    fresh.keep_layer_kv(range(26, 30))
    first = category_prompts["qa"]
    assert len(first) > FLOAT_CHUNK + 1
    answer = Engine(warm, make_drafter("moa", warm)).generate(first, generation=GenerationConfig(max_new_tokens=16)).token_ids
    follow_up = first + answer + [2, 198, 1, 4093, 198, 11, 12, 13]
    got = warm.set_context(torch.tensor(follow_up))
    assert warm._float_cache.tokens[:FLOAT_CHUNK] == first[:FLOAT_CHUNK]
    assert np.array_equal(got.logits, fresh.set_context(torch.tensor(follow_up)).logits)
    assert torch.equal(warm.layer_kv(0, len(follow_up)), fresh.layer_kv(0, len(follow_up)))

    calls = []
    original = warm._float_cache.model._layer

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(*args)

    monkeypatch.setattr(warm._float_cache.model, "_layer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        warm.set_context(torch.tensor(first[:100] + follow_up))  # nothing kept: stopped inside the forward
    monkeypatch.undo()
    monkeypatch.setenv(PREFILL_ENV, "float")
    assert warm.num_cached == 0
    assert np.array_equal(warm.set_context(torch.tensor(follow_up)).logits, fresh.set_context(torch.tensor(follow_up)).logits)


@pytest.mark.parametrize("path", ["float", "bfloat16"])
def test_a_target_serving_one_prompt_releases_the_float_weights_and_prefills_the_same_bits(
    llama_target, category_prompts, monkeypatch, path
) -> None:
    """`serve_one_prompt` (what a one-shot command's load says) makes the float prefill drop each
    layer's weights once used; the logits and the keys and values drafters read stay those of a
    target that keeps them, for a first prompt and a next one (its pages read again)."""
    from moaspec.targets.llamacpp_prefill import SharedFloatLlama

    monkeypatch.setenv(PREFILL_ENV, path)
    shared = llama_target._float
    one_shot = LlamaCppTarget(
        llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, threads=2,
        parts_loader=llama_target._parts_loader, parts=llama_target._parts,
        float_llama=SharedFloatLlama(shared.model_dir, shared.config),
    )
    keeping = sibling(llama_target)
    one_shot.serve_one_prompt()
    assert one_shot._float.release_weights and not keeping._float.release_weights
    for target in (one_shot, keeping):
        target.keep_layer_kv(range(26, 30))
    for name in ("summarization", "qa"):
        prompt = torch.tensor(category_prompts[name])
        got, want = one_shot.set_context(prompt), keeping.set_context(prompt)
        assert np.array_equal(got.logits, want.logits), name
        assert torch.equal(one_shot.layer_kv(0, len(prompt)), keeping.layer_kv(0, len(prompt))), name
    assert one_shot._float.model.release_weights and one_shot._moved_from == "float"


def test_a_load_for_one_prompt_tells_the_target(monkeypatch) -> None:
    """The one-shot path (`moaspec generate`, `moaspec.generate()`) loads the target serving one prompt."""
    from moaspec.api import load_for_prompt

    monkeypatch.setenv(PREFILL_ENV, "float")
    lm, _ = load_for_prompt("Name three colours.", drafter="none", calibrate=False, runtime="llama.cpp", threads=2)
    assert lm.target._float.release_weights


def test_a_conversation_keeps_its_float_prefilled_first_turn(llama_target, category_prompts, monkeypatch) -> None:
    """The float path covers a prompt's first turn only (through the chat template's first
    generation prompt), so a chat's next turn keeps the cells held (first turn, answer) and decodes
    only the new tokens, and equals a fresh prefill of the whole conversation bit for bit; a
    conversation whose first turn is short takes no float path at all."""
    monkeypatch.setenv(PREFILL_ENV, "float")
    warm, fresh = sibling(llama_target), sibling(llama_target)
    require_exact_trees(warm)
    tokenizer = llama_target.tokenizer
    assert tokenizer.decode(list(generation_prompt_ids(tokenizer))) == "<|im_start|>assistant\n"
    question = load_prompts(("summarization",), 1)["summarization"][0].turns[0]
    first = encode_chat_prompt(tokenizer, question)
    answer = Engine(warm, make_drafter("ngram", warm)).generate(first, generation=GenerationConfig(max_new_tokens=20)).token_ids
    history = [{"role": "user", "content": question}, {"role": "assistant", "content": tokenizer.decode(answer)}]
    second = encode_chat_messages(tokenizer, [*history, {"role": "user", "content": "Shorter, please."}])
    assert second[: len(first)] == first and warm._moved == len(first) - 1
    warm.set_context(torch.tensor(first + answer))  # the conversation as generation left it
    def prefilled_again(*args):
        raise AssertionError("the first turn was prefilled again in float")

    kept = _shared_start_of(warm._tokens, second)
    with monkeypatch.context() as patch:
        patch.setattr(warm._float_cache.model, "forward", prefilled_again)
        got = warm.set_context(torch.tensor(second))
    assert warm._moved == len(first) - 1 and kept > len(first)
    want = fresh.set_context(torch.tensor(second))
    assert fresh._moved == len(first) - 1 and np.array_equal(got.logits, want.logits)
    short_first = encode_chat_messages(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                                   {"role": "user", "content": question}])
    assert len(short_first) >= FLOAT_PREFILL_MIN_TOKENS
    fresh.set_context(torch.tensor(short_first))
    assert fresh._moved == 0  # its first turn is under FLOAT_PREFILL_MIN_TOKENS: llama.cpp prefills it all


def _shared_start_of(held: list[int], ids: list[int]) -> int:
    count = 0
    for old, new in zip(held, ids):
        if old != new:
            break
        count += 1
    return count


def test_the_prefill_start_is_measured_once_per_machine_where_the_calibration_is_on(
    llama_target, category_prompts, tmp_path, monkeypatch
) -> None:
    """With the calibration on, the first prompt long enough is preceded by timing the float
    forward's two product types, then both paths; the answers are saved and read by later targets.
    The variable fixes them, the calibration off means llama.cpp unmeasured, a bad name is one
    line, and the exactness probe never takes the float path."""
    from moaspec.targets import llamacpp_prefill

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    monkeypatch.setenv(VALUE_CACHE_ENV, "f16")
    measured, computes = [], []
    measure = llamacpp_prefill.measure_float_prefill_start
    monkeypatch.setattr(
        llamacpp_prefill, "measure_float_prefill_start", lambda target: measured.append(1) or measure(target)
    )
    measure_compute = llamacpp_prefill.measure_float_compute
    monkeypatch.setattr(
        llamacpp_prefill, "measure_float_compute", lambda target: computes.append(1) or measure_compute(target)
    )
    first = sibling(llama_target)
    first.set_context(torch.tensor(category_prompts["mt_bench"][: FLOAT_PREFILL_MIN_TOKENS - 1]))
    assert not measured and not computes  # a short prompt: nothing to decide
    prompt = category_prompts["summarization"]
    first.set_context(torch.tensor(prompt))
    assert len(measured) == 1 and len(computes) == 1
    records = tmp_path / "cache" / "calibration" / llama_target.name
    [record] = records.glob("prefill-*.json")
    start = json.loads(record.read_text())["float_prefill_start"]
    [compute_record] = records.glob("float-compute-*.json")
    compute = json.loads(compute_record.read_text())["float_compute"]
    assert llamacpp_prefill.valid_start(start) and first.float_compute == compute in ("float32", "bfloat16")
    assert first._moved == (len(prompt) - 1) * (start != NEVER and len(prompt) >= start)
    again = sibling(llama_target)
    assert again.float_prefill_start == start and again.float_compute == compute
    assert len(measured) == 1 and len(computes) == 1  # read, not measured
    for setting, fixed, products in (
        ("float", FLOAT_PREFILL_MIN_TOKENS, "float32"), ("bfloat16", FLOAT_PREFILL_MIN_TOKENS, "bfloat16"),
        ("llama.cpp", NEVER, "float32"),
    ):
        monkeypatch.setenv(PREFILL_ENV, setting)
        assert (sibling(llama_target).float_prefill_start, sibling(llama_target).float_compute) == (fixed, products)
    monkeypatch.delenv(PREFILL_ENV)
    monkeypatch.setenv("MOASPEC_NO_CALIBRATION", "1")
    assert not sibling(llama_target).uses_float_prefill and len(measured) == 1
    monkeypatch.setenv(PREFILL_ENV, "torch")
    with pytest.raises(MoaspecError, match="MOASPEC_LLAMA_PREFILL must be float, bfloat16 or llama.cpp, not 'torch'"):
        sibling(llama_target)  # when the target is made (an audit's: a short prompt never asked, and ran)
    monkeypatch.setenv(PREFILL_ENV, "float")
    probe = sibling(llama_target)
    probe._probing_exactness = True
    assert not probe.uses_float_prefill


def test_the_float_path_takes_first_turns_from_the_machine_s_start(llama_target, category_prompts, monkeypatch) -> None:
    """A start measured above FLOAT_PREFILL_MIN_TOKENS (a CPU where float pays only for longer
    prompts): a first turn of exactly that many tokens takes the float path, one token fewer does
    not, and a new session keeps its parent's start and product type."""
    monkeypatch.setenv(VALUE_CACHE_ENV, "f16")
    monkeypatch.delenv(PREFILL_ENV, raising=False)
    prompt = category_prompts["summarization"]
    assert len(prompt) > FLOAT_PREFILL_MIN_TOKENS
    for start, moved in ((len(prompt), len(prompt) - 1), (len(prompt) + 1, 0)):
        target = LlamaCppTarget(
            llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, threads=2,
            parts_loader=llama_target._parts_loader, parts=llama_target._parts, float_llama=llama_target._float,
            float_prefill_start=start, float_compute="bfloat16",
        )
        target.set_context(torch.tensor(prompt))
        assert target._moved == moved
        session = target.new_session()
        assert session.float_prefill_start == start and session.float_compute == "bfloat16"
