"""The llama.cpp runtime (moaspec/targets/llamacpp.py) on the real SmolLM2-135M GGUF.

Exactness here is bit-for-bit: a tree's logits must equal what one-token decoding computes for
the same context (module docstring), so the checks compare logits with `np.array_equal`, and the
engine's greedy tokens with plain decoding's on one prompt of every benchmark category.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from llamacpp_helpers import check_oracle_trees, one_token, oracle_tree, plain_decode, require_exact_trees

from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.decode_step import limit_nodes
from moaspec.drafters import make_drafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.targets.llamacpp import (
    MAX_LEAVES,
    MAX_TREE_NODES,
    PROMPT_CONTEXT_MIN_TOKENS,
    LlamaCppTarget,
)
from moaspec.targets.llamacpp_prompt_paths import PROMPT_CHUNK
from moaspec.targets.llamacpp_value_cache import VALUE_CACHE_ENV, VALUE_CACHE_TYPES
from moaspec.tree import DraftTree, ancestor_mask, depths, leaf_groups
from moaspec.verify import verify_greedy


def random_tree(generator: random.Random, size: int) -> torch.Tensor:
    parents = [-1] + [generator.randrange(i) for i in range(1, size)]
    return torch.tensor(parents)


@pytest.mark.parametrize("seed", range(20))
def test_leaf_sequences_make_llama_cpp_attend_to_exactly_the_ancestors(seed: int) -> None:
    """llama.cpp's rule (a token sees the cells holding its first sequence id at positions up to
    its own) must give each node its ancestors and itself, nothing else."""
    parents = random_tree(random.Random(seed), 1 + seed * 3)
    seqs = leaf_groups(parents)
    node_depths = depths(parents).tolist()
    expected = ancestor_mask(parents)  # [N, N]: node i sees node j
    for i, own in enumerate(seqs):
        assert own == sorted(own) and own
        for j, other in enumerate(seqs):
            sees = own[0] in other and node_depths[j] <= node_depths[i]
            assert sees == bool(expected[i, j]), (i, j, seqs)
    assert seqs[0] == list(range(len(seqs[0])))  # the root carries every leaf's sequence


def test_a_chain_is_sequence_zero_alone() -> None:
    assert leaf_groups(torch.tensor([-1, 0, 1, 2])) == [[0], [0], [0], [0]]


@pytest.fixture(scope="module")
def llama_target(llama_target):
    assert llama_target.value_cache_name == "f16"  # the calibration is off in tests: chosen now, not by a test's variable
    return llama_target














@pytest.mark.parametrize(("cells", "names", "length", "decoys", "sliding_window"), [
    (8192, ("mt_bench", "humaneval"), 200, 0, 0),
    (264, ("mt_bench", "humaneval"), 200, 24, 0),  # many parked cells: reclaimed through the sequence state
    (264, ("mt_bench", "humaneval"), 200, 24, 512),  # ... or re-decoded, as for a sliding-window model
    (8192, ("qa",), 400, 0, 0),  # a long prompt: prefilled in the prompt context, moved in
    (460, ("qa",), 400, 40, 0),  # ... its moved cells kept when parked cells are reclaimed
])
def test_tree_logits_are_bit_identical_to_one_token_decoding(
    llama_target, category_prompts, monkeypatch, cells: int, names, length: int, decoys: int, sliding_window: int
) -> None:
    """Random trees holding the true continuation, committed step by step (rejected nodes parked;
    with few cells they are reclaimed): every accepted node's logits equal plain decoding's
    exactly, so the greedy path is the same."""
    require_exact_trees(llama_target)
    monkeypatch.setattr(llama_target.weights, "sliding_window", sliding_window)  # the path reclaiming takes
    target = llama_target if cells == 8192 else llama_target.__class__(
        llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, cells=cells, threads=2
    )
    generator = random.Random(cells)
    for name in names:
        prompt = category_prompts[name][:length]
        assert (len(prompt) >= PROMPT_CONTEXT_MIN_TOKENS) == (name == "qa")
        tokens, logits = plain_decode(target, prompt, 52)
        target.reset()
        target.prefill(torch.tensor(prompt))
        done = 0
        while done < 44:
            tree = oracle_tree(generator, tokens[done], tokens[done + 1 : done + 5], target.vocab_size, decoys)
            out = target.verify(tree)
            accepted = verify_greedy(tree, out.logits)
            for k, node in enumerate(accepted.path_node_idx):
                assert np.array_equal(out.logits[node], logits[done + k + 1]), (name, done, k)
            target.commit(accepted.path_node_idx)
            assert accepted.emitted_ids == tokens[done + 1 : done + 2 + accepted.num_accepted]
            done += accepted.num_accepted + 1
            assert target.num_cached == len(prompt) + done
    assert (target.compactions > 0) == (cells < 8192)


def test_a_q8_0_value_cache_stays_exact_and_takes_long_prompts_from_the_prompt_context(
    llama_target, category_prompts, monkeypatch
) -> None:
    """MOASPEC_LLAMA_VALUE_CACHE=q8_0 (faster where f16 values cost much: module docstring): the
    verified context holds q8_0 values, a long prompt is prefilled in the prompt context and moved
    in with its values rotated and quantized as llama.cpp's q8_0 value cache holds them (decoding
    after it stays close to the per-query prefill's), the accepted nodes of random trees have
    one-token decoding's logits bit for bit, greedy output with drafters equals plain decoding in
    every category, and the calibration keys it apart."""
    import moaspec.targets.llamacpp as llamacpp
    from moaspec.calibration.machine import runtime_description
    from moaspec.targets.llamacpp_cells import SequenceState

    monkeypatch.setenv(VALUE_CACHE_ENV, "q8_0")
    target = LlamaCppTarget(
        llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, threads=2,
        parts_loader=llama_target._parts_loader, parts=llama_target._parts,  # as new_session() passes them
    )
    require_exact_trees(target)
    assert target.value_cache_name == "q8_0" and target.uses_prompt_context
    f16_values = LlamaCppTarget(llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name,
                                value_cache=VALUE_CACHE_TYPES["f16"])
    assert "q8_0/q8_0 KV" in runtime_description(target) and "q8_0/f16 KV" in runtime_description(f16_values)
    prompt = category_prompts["qa"][:400]
    assert len(prompt) >= PROMPT_CONTEXT_MIN_TOKENS
    tokens, logits = plain_decode(target, prompt, 40)
    assert target._prompt_ctx is not None and target._moved == len(prompt)
    state = SequenceState.parse(memoryview(target._sequence_state(target.ctx)))
    assert {kind for kind, _ in state.values} == {VALUE_CACHE_TYPES["q8_0"]}
    with monkeypatch.context() as patch:
        patch.setattr(llamacpp, "PROMPT_CONTEXT_MIN_TOKENS", len(prompt) + 1)
        per_query = target.new_session()
        _, per_query_logits = plain_decode(per_query, prompt, 9)
    assert per_query._prompt_ctx is None
    # both valid numerics (f16 / f16 tiled vs per-query q8_0): within 0.8 on this target; values
    # moved without their rotation put the logits 18-33 apart
    assert max(float(np.abs(a - b).max()) for a, b in zip(logits[1:9], per_query_logits[1:])) < 3.0
    target.reset()
    target.prefill(torch.tensor(prompt))
    check_oracle_trees(target, tokens, logits, decoys=2)
    plain = Engine(target, make_drafter("none", target))
    generation = GenerationConfig(max_new_tokens=48)
    for drafter in ("ngram", "moa+ngram"):
        engine = Engine(target, make_drafter(drafter, target))
        for name, category_prompt in category_prompts.items():
            expected = plain.generate(category_prompt, SamplingConfig(), generation).token_ids
            assert engine.generate(category_prompt, SamplingConfig(), generation).token_ids == expected, (drafter, name)
    monkeypatch.setenv(VALUE_CACHE_ENV, "q4_0")
    with pytest.raises(MoaspecError, match="MOASPEC_LLAMA_VALUE_CACHE must be f16 or q8_0, not 'q4_0'"):
        LlamaCppTarget(llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name)


@pytest.mark.parametrize("faster", ["f16", "q8_0"])
def test_the_value_cache_measurement_chooses_the_faster_cache(faster: str, monkeypatch) -> None:
    """A fake clock that charges each one-token decode by its context's value cache: the cache
    whose decodes cost less is chosen (by more than the margin), whichever it is."""
    from moaspec import timing
    from moaspec.targets import llamacpp_value_cache

    cost = {VALUE_CACHE_TYPES[name]: (1.0 if name == faster else 2.0) for name in ("f16", "q8_0")}
    clock = {"now": 0.0}

    def timed_decode(target, ctx, tokens):
        clock["now"] += cost[ctx] if len(tokens) == 1 else 0.0
        return 0

    fake = SimpleNamespace(vocab_size=16, new_measuring_context=lambda cells, kind: kind,
                           free_measuring_context=lambda ctx: None)
    monkeypatch.setattr(llamacpp_value_cache, "_decode", timed_decode)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])
    assert llamacpp_value_cache.measure_value_cache_type(fake) == VALUE_CACHE_TYPES[faster]


def test_the_value_cache_is_measured_once_per_machine_where_the_calibration_is_on(
    llama_target, tmp_path, monkeypatch
) -> None:
    """With the calibration on, the first context a target needs is preceded by timing both value
    caches; the answer is saved and read by later targets. The variable fixes it; the calibration
    off means f16 unmeasured. The measurement's contexts carry no capture callback."""
    from moaspec.targets import llamacpp_value_cache

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    monkeypatch.delenv(VALUE_CACHE_ENV, raising=False)

    def new_target():
        return LlamaCppTarget(llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, threads=2)

    measured = []
    measure = llamacpp_value_cache.measure_value_cache_type
    monkeypatch.setattr(llamacpp_value_cache, "measure_value_cache_type", lambda target: measured.append(1) or measure(target))
    first = new_target()
    first.keep_layer_kv(range(26, 30))  # a capture set: the measurement must not feed it
    first.set_context(torch.tensor([1, 2, 3]))
    assert len(measured) == 1 and first.value_cache_type in VALUE_CACHE_TYPES.values()
    assert first._kv.valid == 3
    [record] = (tmp_path / "cache" / "calibration" / llama_target.name).glob("value-cache-*.json")
    assert json.loads(record.read_text())["value_cache_type"] == first.value_cache_type
    second = new_target()
    assert second.value_cache_type == first.value_cache_type and len(measured) == 1  # read, not measured
    monkeypatch.setenv("MOASPEC_NO_CALIBRATION", "1")  # f16 for a target of its own, yet a session decodes as its parent
    parent = LlamaCppTarget(llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name,
                            value_cache=VALUE_CACHE_TYPES["q8_0"])
    assert parent.new_session().value_cache_name == "q8_0"
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION")
    monkeypatch.setenv(VALUE_CACHE_ENV, "q8_0" if first.value_cache_name == "f16" else "f16")
    assert new_target().value_cache_name != first.value_cache_name and len(measured) == 1
    monkeypatch.delenv(VALUE_CACHE_ENV)
    monkeypatch.setenv("MOASPEC_NO_CALIBRATION", "1")
    assert new_target().value_cache_name == "f16" and len(measured) == 1
    assert llamacpp_value_cache.faster_value_cache(10.0, 8.9) == VALUE_CACHE_TYPES["q8_0"]
    assert llamacpp_value_cache.faster_value_cache(10.0, 9.5) == VALUE_CACHE_TYPES["f16"]  # within the margin

    def no_context(cells, value_type):
        raise MoaspecError("llama.cpp cannot create a context")

    untimeable = new_target()
    monkeypatch.setattr(untimeable, "new_measuring_context", no_context)
    assert measure(untimeable) == VALUE_CACHE_TYPES["f16"]  # the default where it cannot be timed


def park_four_cells(target, tokens: list[int], logits: list[torch.Tensor]) -> None:
    """Commit tokens[0..7] (plain decoding's, after the prefilled prompt) in four trees, each with
    a wrong sibling before the true one: one cell parked per tree; the true nodes' logits checked."""
    for done in range(0, 8, 2):
        out = target.verify(DraftTree(torch.tensor([tokens[done], 7, tokens[done + 1]]), torch.tensor([-1, 0, 0])))
        assert np.array_equal(out.logits[2], logits[done + 2])
        target.commit([0, 2])


def test_a_wide_tree_at_the_context_end_has_a_cell_for_every_node(llama_target, category_prompts) -> None:
    """Bug: the verified context had exactly `cells` cells, so near its end a tree that fits by
    depth (what the engine prunes it to) but has more nodes than free cells failed in llama_decode
    and reset the context: a generation reaching the context's end with a wide tree died there."""
    require_exact_trees(llama_target)
    cells = 512  # llama.cpp rounds a context up to a multiple of 256 cells
    target = LlamaCppTarget(
        llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, cells=cells, threads=2,
        parts_loader=llama_target._parts_loader, parts=llama_target._parts,  # as new_session() passes them
    )
    text = [t for name in sorted(category_prompts) for t in category_prompts[name]]
    prompt = text[: cells - 4]
    tokens, logits = plain_decode(target, prompt, 3)
    target.reset()
    target.prefill(torch.tensor(prompt))
    tree = DraftTree(torch.tensor([tokens[0], tokens[1], *range(100, 107)]), torch.tensor([-1] + [0] * 8))  # 9 nodes, 4 cells free
    out = target.verify(tree)
    assert np.array_equal(out.logits[0], logits[1]) and np.array_equal(out.logits[1], logits[2])
    target.commit([0, 1])
    assert target.num_cached == len(prompt) + 2
    drafter = make_drafter("moa", target, {"depth": 6, "top_k": 4, "budget": 16})  # the reference tree: 17 nodes
    for room in (3, 9):
        prompt = text[: cells - room]
        plain = Engine(target, make_drafter("none", target)).generate(prompt, generation=GenerationConfig(max_new_tokens=64))
        drafted = Engine(target, drafter).generate(prompt, generation=GenerationConfig(max_new_tokens=64))
        assert drafted.token_ids == plain.token_ids and drafted.stop_reason == plain.stop_reason == "context"


def test_a_tree_at_the_context_end_uses_the_headroom_before_re_decoding_the_context(llama_target, category_prompts) -> None:
    """Bug: parked cells were reclaimed (the whole context re-decoded) as soon as the used cells
    and a tree passed `cells`, though the context has TREE_HEADROOM cells more: near the
    context's end every verify after a rejection re-decoded the whole context."""
    require_exact_trees(llama_target)
    cells = 384  # + TREE_HEADROOM = 512 cells, what llama.cpp allocates
    target = LlamaCppTarget(
        llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, cells=cells, threads=2,
    )
    text = [t for name in sorted(category_prompts) for t in category_prompts[name]]
    prompt = text[: cells - 14]
    tokens, logits = plain_decode(target, prompt, 12)
    target.reset()
    target.prefill(torch.tensor(prompt))
    park_four_cells(target, tokens, logits)
    tree = DraftTree(torch.tensor([tokens[8], tokens[9], *range(100, 118)]), torch.tensor([-1] + [0] * 19))
    out = target.verify(tree)  # 20 nodes: past `cells` with the 4 parked cells, within the headroom
    assert np.array_equal(out.logits[1], logits[10])
    assert target.compactions == 0


def test_reclaiming_parked_cells_decodes_nothing(llama_target, category_prompts, monkeypatch) -> None:
    """Parked cells used to be reclaimed by re-decoding the whole verified context (~3.5 ms a token
    on 2 cores, once a few hundred tokens into a generation with branching trees); sequence 0 now
    moves through llama.cpp's sequence state, and the next tree's logits are plain decoding's."""
    require_exact_trees(llama_target)
    target = LlamaCppTarget(
        llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, cells=384, threads=2,
    )
    prompt = category_prompts["mt_bench"][:120]
    tokens, logits = plain_decode(target, prompt, 12)
    target.reset()
    target.prefill(torch.tensor(prompt))
    park_four_cells(target, tokens, logits)

    def no_decode(ctx=None) -> None:
        raise AssertionError("reclaiming parked cells decoded")

    with monkeypatch.context() as patched:
        patched.setattr(target, "_decode", no_decode)
        target._reclaim_parked()
    assert target.compactions == 1 and target.num_cached == len(prompt) + 8
    out = target.verify(DraftTree(torch.tensor([tokens[8], tokens[9], 5, tokens[10]]), torch.tensor([-1, 0, 0, 1])))
    assert np.array_equal(out.logits[0], logits[9]) and np.array_equal(out.logits[1], logits[10])
    assert np.array_equal(out.logits[3], logits[11])


def test_a_prompt_or_later_turn_the_context_cannot_hold_is_a_clear_error(llama_target) -> None:
    """Beyond the context's cells: a first prompt says its length, a later turn (an append after
    the verified context) counts both (it used to name its own length only, below the limit)."""
    target = LlamaCppTarget(
        llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, cells=64, threads=2,
    )
    with pytest.raises(MoaspecError, match="the prompt has 65 tokens but the target's context holds 64"):
        target.prefill(torch.arange(100, 165))
    target.prefill(torch.arange(100, 140))
    with pytest.raises(MoaspecError, match="30 more tokens after the 40 verified make 70, but the target's context holds 64"):
        target.prefill(torch.arange(100, 130))
    assert target.num_cached == 40


def test_uncommitted_tree_rollback_and_reset_leave_a_consistent_context(llama_target, category_prompts) -> None:
    require_exact_trees(llama_target)
    prompt = category_prompts["qa"][:120]
    tokens, logits = plain_decode(llama_target, prompt, 8)
    llama_target.reset()
    llama_target.prefill(torch.tensor(prompt))
    llama_target.verify(DraftTree(torch.tensor([tokens[0], 5, 6]), torch.tensor([-1, 0, 0])))  # never committed
    out = llama_target.verify(one_token(tokens[0]))
    assert np.array_equal(out.logits[0], logits[1])
    llama_target.commit([0])
    llama_target.verify(one_token(tokens[1]))
    llama_target.commit([0])
    llama_target.rollback(len(prompt) + 1)  # forget tokens[1]
    out = llama_target.verify(one_token(tokens[1]))
    assert np.array_equal(out.logits[0], logits[2])
    with pytest.raises(ValueError):
        llama_target.rollback(len(prompt) + 5)


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "eagle+ngram", "moa", "moa+ngram", "moa-tli1"])
def test_greedy_output_equals_plain_decoding_in_every_category(llama_target, category_prompts, drafter: str) -> None:
    require_exact_trees(llama_target)
    engine = Engine(llama_target, make_drafter(drafter, llama_target))
    plain = Engine(llama_target, make_drafter("none", llama_target))
    generation = GenerationConfig(max_new_tokens=64)
    tokens = forwards = 0
    for name, prompt in category_prompts.items():
        expected = plain.generate(prompt, SamplingConfig(), generation).token_ids
        result = engine.generate(prompt, SamplingConfig(), generation)
        assert result.token_ids == expected, name
        tokens, forwards = tokens + result.stats.new_tokens, forwards + result.stats.target_forwards
    assert forwards < tokens  # drafts were accepted: the comparison covered verified trees


def test_the_client_server_bench_serves_moa_from_the_default_runtime(tmp_path, capsys) -> None:
    """`bench --client-server` loads the target where `serve` would (llama.cpp for the built-in
    GGUF target), and its MoA server captures the keys/values its context encoder reads (it used
    to build the server's drafter on another session of the target: every verify failed)."""
    from moaspec.cli import main

    out = tmp_path / "split"
    argv = ["bench", "--client-server", "--out", str(out), "--network", "lan", "--categories", "math",
            "--limit", "1", "--max-new-tokens", "6", "--methods", "moa", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["runtime"] == "llama.cpp" and results["mismatches"] == []
    threads = results["config"]["threads"]  # recorded and named, as the single-device bench does
    assert threads >= 1 and f"on the llama.cpp runtime ({threads} thread" in (out / "results.md").read_text()
    split = [row for row in results["client_server"] if row["method"] == "moa" and row["mode"] == "split"]
    assert len(split) == 1 and split[0]["new_tokens"] == 6 and split[0]["tau"] >= 1.0


def test_a_split_generation_prints_the_json_fields_of_a_local_one(llama_target, capsys, monkeypatch) -> None:
    """Issue 6: `generate --server URL --json` has every field of a local `generate --json` (the
    runtime being the server's), the split's own figures besides, and the same greedy tokens."""
    from moaspec.cli import main
    from moaspec.split.server import ServerLimits, ServerThread, SplitServer

    monkeypatch.setenv("MOASPEC_API_KEY", "split-json-key")
    monkeypatch.setenv("MOASPEC_NO_CALIBRATION", "1")
    server = ServerThread(SplitServer(llama_target.new_session(), make_drafter("ngram", llama_target),
                                      ["split-json-key"], ServerLimits())).start()
    common = ["generate", "--prompt", "Name three colours.", "--drafter", "ngram", "--max-new-tokens", "12", "--json"]
    try:
        assert main([*common, "--server", f"http://127.0.0.1:{server.port}"]) == 0
        split = json.loads(capsys.readouterr().out)
    finally:
        server.stop()
    assert main(common) == 0
    local = json.loads(capsys.readouterr().out)
    assert set(local) <= set(split) and "split" in split
    assert split["runtime"] == local["runtime"] == "llama.cpp" and split["token_ids"] == local["token_ids"]


def test_a_budget_above_what_llama_cpp_verifies_is_said_to_be_cut(capsys) -> None:
    """Sessions 34-36's notes: `--tree-budget 200` on llama.cpp, which verifies at most
    MAX_TREE_NODES nodes in one tree, drafted trees cut to that without a word; a budget within
    the limit gets no note."""
    from moaspec.cli import main

    common = ["generate", "--prompt", "Name three colours.", "--drafter", "moa", "--max-new-tokens", "4", "--json"]
    assert main([*common, "--tree-depth", "8", "--tree-top-k", "8", "--tree-budget", "200"]) == 0
    err = capsys.readouterr().err
    assert "--tree-budget 200 is more than the llama.cpp runtime verifies in one tree" in err
    assert "trees are cut to" in err and "drafted nodes" in err
    assert main([*common, "--tree-depth", "2", "--tree-top-k", "2", "--tree-budget", "4"]) == 0
    assert "--tree-budget" not in capsys.readouterr().err
    # an audit's: --tree-* without --drafter silently left the calibrated default for moa+ngram
    assert main([*common[:3], *common[5:], "--tree-depth", "2"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["drafter"] == "moa+ngram"
    assert "--tree-* name the default model drafter, moa+ngram, rather than the calibrated default" in captured.err
    assert main(common) == 0 and "default model drafter" not in capsys.readouterr().err


def test_a_split_client_drafts_the_tree_its_flags_ask_for(llama_target, capsys, monkeypatch) -> None:
    """Bug: `generate --server` dropped --tree-depth/--tree-top-k/--tree-budget (the client drafts
    the trees, so they are its to size): a one-node tree and a wide one drafted the same."""
    from moaspec.cli import main
    from moaspec.split.server import ServerLimits, ServerThread, SplitServer

    monkeypatch.setenv("MOASPEC_API_KEY", "split-tree-key")
    served = llama_target.new_session()  # the server's drafter announces the layers it reads to this one
    server = ServerThread(SplitServer(served, make_drafter("moa", served), ["split-tree-key"], ServerLimits())).start()
    common = ["generate", "--prompt", "Name three colours.", "--drafter", "moa", "--max-new-tokens", "12", "--json",
              "--server", f"http://127.0.0.1:{server.port}"]
    drafted = {}
    try:
        for name, tree in {"chain of 1": ["1", "1", "1"], "wide": ["3", "3", "9"]}.items():
            flags = ["--tree-depth", tree[0], "--tree-top-k", tree[1], "--tree-budget", tree[2]]
            assert main([*common, *flags]) == 0
            drafted[name] = json.loads(capsys.readouterr().out)["mean_drafted_nodes"]
    finally:
        server.stop()
    assert drafted["chain of 1"] <= 1.0 < 4.0 < drafted["wide"]


def test_the_one_shot_generate_takes_the_keywords_that_place_the_target(monkeypatch) -> None:
    """`moaspec.generate()` passes where the target runs (runtime, threads, n_gpu_layers, ...) to
    load() and the generation settings to its generate(); load() takes llama.cpp's spelling
    n_gpu_layers as well as gpu_layers, and refuses the two disagreeing."""
    import moaspec
    import moaspec.api

    seen = {}
    real_load_target = moaspec.api.load_target

    def recording_load_target(*args, **kwargs):
        seen["args"] = args
        return real_load_target(*args, **kwargs)

    monkeypatch.setattr(moaspec.api, "load_target", recording_load_target)
    out = moaspec.generate("Name three colours.", drafter="ngram", runtime="llama.cpp", threads=2, n_gpu_layers=0,
                           calibrate=False, max_new_tokens=6, seed=3)
    assert out.stats.new_tokens == 6 and seen["args"][3:7] == ("llama.cpp", "cpu", 2, 0)
    with pytest.raises(MoaspecError, match="disagree"):
        moaspec.load(drafter="none", gpu_layers=1, n_gpu_layers=2, calibrate=False)


def test_gpu_layers_on_a_build_without_gpu_offload_are_said_to_be_ignored(llama_target, capsys) -> None:
    """An audit's: --n-gpu-layers on a CPU-only llama-cpp-python build was accepted without a word,
    and as a number of offloaded layers turned the float prefill off and keyed the machine's saved
    choices apart. On a build that offloads, the layers are kept."""
    from moaspec.targets.llamacpp_model import LlamaCppModel

    model = LlamaCppModel(llama_target.weights.path, 3)
    offloads = bool(llama_target.lib.llama_supports_gpu_offload())
    assert model.gpu_layers == (3 if offloads else 0)
    note = capsys.readouterr().err
    assert ("--n-gpu-layers 3 (gpu_layers) is ignored" in note) != offloads and len(note.splitlines()) == (0 if offloads else 1)


AMX_BUILD_INFO = b"CPU : AVX2 = 1 | AVX512 = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | REPACK = 1 | "
PLAIN_BUILD_INFO = b"CPU : AVX2 = 1 | AVX512 = 1 | AVX512_BF16 = 1 | REPACK = 1 | "


@pytest.mark.parametrize("info, repacked", [(AMX_BUILD_INFO, False), (PLAIN_BUILD_INFO, True)])
def test_a_build_with_amx_kernels_loads_weights_unrepacked(info, repacked) -> None:
    """Bug (session 56, an AMX Xeon): llama.cpp built natively there repacks weights for its AMX
    kernels, whose first product crashed the process (SIGSEGV in ggml_backend_amx_mul_mat), so
    `moaspec generate` died on its first decode. Such a build now loads weights without extra
    buffer types (plain CPU kernels); any other keeps them."""
    import llama_cpp

    from moaspec.targets.llamacpp_model import model_params

    lib = SimpleNamespace(
        llama_model_default_params=llama_cpp.llama_model_default_params, llama_print_system_info=lambda: info
    )
    params = model_params(lib, 2)
    assert params.use_extra_bufts is repacked and params.n_gpu_layers == 2


@pytest.mark.parametrize("info, repacked", [(AMX_BUILD_INFO, False), (PLAIN_BUILD_INFO, True)])
def test_the_llama_cpp_baselines_load_their_weights_as_the_runtime_does(monkeypatch, info, repacked) -> None:
    """llama-cpp-python's `Llama` (the bench's `llama.cpp` methods) takes its model parameters from
    llama_model_default_params: while one is built that answers as our runtime loads (no AMX
    kernels, which crash), and the library's own function is back afterwards."""
    import llama_cpp.llama_cpp as bindings

    from moaspec.bench.llamacpp_methods import _loaded_as_the_runtime_loads

    monkeypatch.setattr(bindings, "llama_print_system_info", lambda: info)
    defaults = bindings.llama_model_default_params
    with _loaded_as_the_runtime_loads():
        assert bindings.llama_model_default_params().use_extra_bufts is repacked
    assert bindings.llama_model_default_params is defaults and defaults().use_extra_bufts is True


def test_hf_methods_run_beside_a_llama_cpp_target(tmp_path, capsys) -> None:
    """`bench --methods hf,hf-pld` on the default (llama.cpp) runtime: transformers' generate() runs
    on a transformers copy of the same target, as another runtime's generation, so its greedy
    output is compared for agreement and never reported as a mismatch."""
    from moaspec.cli import main

    out = tmp_path / "hf-beside-llama"
    argv = ["bench", "--out", str(out), "--categories", "math,summarization", "--limit", "1", "--max-new-tokens", "8",
            "--methods", "none,hf,hf-pld", "--no-progress", "--no-plots"]
    assert main(argv) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["runtime"] == "llama.cpp" and results["mismatches"] == []
    assert [row["method"] for row in results["summary"]] == ["none", "hf", "hf-pld"]
    assert {entry["method"] for entry in results["agreement"]} == {"hf", "hf-pld"}  # every prompt, identical or not
    assert all(row["tokens_per_s"] > 0 for row in results["summary"])


def test_a_split_server_reuses_a_finished_sessions_context_exactly(llama_target) -> None:
    """A llama.cpp context costs ~100 ms to create: the split server keeps finished sessions'
    targets (IdleTargets) and gives a key back its own, holding its previous turn (the next
    turn's prefill keeps what they share), or another key's emptied. Every output still equals
    local plain decoding, and three split sessions made one context (sized to the first session's
    reservation, rounded up: room for the next turns)."""
    from moaspec.chat import encode_chat_messages
    from moaspec.drafters.ngram import NgramDrafter
    from moaspec.split.client import SplitClient
    from moaspec.split.generator import SplitGenerator
    from moaspec.split.server import ServerLimits, ServerThread, SplitServer

    served = llama_target.new_session()
    made = []
    real_new_session = served.new_session
    served.new_session = lambda *size: made.append(1) or real_new_session(*size)
    keys = ["key-of-alice-000", "key-of-bob-00000"]
    server = ServerThread(SplitServer(served, make_drafter("ngram", served), keys, ServerLimits())).start()
    made.clear()  # the OpenAI routes' own session
    reference = Engine(llama_target.new_session(), make_drafter("none", llama_target))
    generation = GenerationConfig(max_new_tokens=12)
    first = [{"role": "user", "content": "Name three colours."}]
    try:
        def split(key: str, messages: list[dict]) -> list[int]:
            prompt = encode_chat_messages(llama_target.tokenizer, messages)
            generator = SplitGenerator(SplitClient(f"http://127.0.0.1:{server.port}", key), NgramDrafter())
            got = generator.generate(prompt, SamplingConfig(), generation, llama_target.stop_ids).token_ids
            assert got == reference.generate(prompt, SamplingConfig(), generation, llama_target.stop_ids).token_ids
            return got

        answer = llama_target.tokenizer.decode(split(keys[0], first), skip_special_tokens=True)
        split(keys[0], [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And three more?"}])
        split(keys[1], [{"role": "user", "content": "What is two plus two?"}])
    finally:
        server.stop()
    assert len(made) == 1


def test_serve_generates_openai_requests_with_the_calibrated_choice(llama_target, tmp_path, monkeypatch) -> None:
    """`moaspec serve` with no drafter named: split sessions get the default model drafter's
    context encoder (MoA, capturing keys/values), while the OpenAI routes generate as `moaspec
    generate` would, with the machine calibration's choice, in a session that captures only what
    that choice reads (it used to decode with `moa+ngram`: 0.7x plain decoding on 2 cores). Its
    routes hold the calibration that chose their drafter, the named one's too."""
    from moaspec.calibration.plan import drafter_for
    from moaspec.cli import _build_parser
    from moaspec.drafters.moa import MoADrafter
    from moaspec.split.commands import build_server

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))  # the calibration measures afresh there
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    monkeypatch.setattr("moaspec.api.load_target", lambda *args, **kwargs: llama_target.new_session())
    args = _build_parser().parse_args(["serve"])  # every flag at its default: no drafter named
    args.runtime_options = {}
    server, described = build_server(args, ["k" * 16])
    _, calibration = drafter_for(llama_target.new_session(), None)
    assert server.info["drafter"] == "moa+ngram" and server.target.capture is not None
    assert described.endswith(f"(OpenAI API: {calibration.chosen.drafter})")
    reads_layers = isinstance(server.openai_drafter, MoADrafter)  # what the calibration chose here
    assert (server.openai_target.capture is not None) == reads_layers
    assert server.openai_drafter is not server.drafter
    assert server.openai_calibration.chosen == calibration.chosen  # for the busy-machine note in the log
    args = _build_parser().parse_args(["serve", "--drafter", "moa+ngram"])  # named: the split's drafter decodes
    args.runtime_options = {}
    named, _ = build_server(args, ["k" * 16])
    assert named.openai_drafter is named.drafter and named.openai_calibration is not None
    assert named.openai_calibration.chosen.drafter.startswith("moa")


@pytest.mark.parametrize("trees_exact", [True, False])
def test_a_drafter_for_another_target_is_one_line_with_the_calibration_on(
    llama_target, tmp_path, monkeypatch, capsys, trees_exact: bool
) -> None:
    """The calibration weighs a named drafter lazily: one made for another target is the user's
    error, said once (it also came out as a calibration warning before), and before anything is
    measured (it came after 15-30 s of calibration); where llama.cpp's trees are not exact here,
    that error too, not the trees' (which would send the user to a run that fails next)."""
    from conftest import make_random_drafter_net, make_tiny_target

    from moaspec.calibration import plan
    from moaspec.cli import main

    if not trees_exact:
        monkeypatch.setattr(plan, "_exact_tree_nodes", lambda target, say, model: 1)
    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    tiny = make_tiny_target("llama", dtype=torch.float32)
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(tiny.config), tiny)
    checkpoint = save_checkpoint(tmp_path / "other", "moa", net, tiny, {"depth": 1, "top_k": 1, "budget": 1})
    from moaspec.model_store import cache_root

    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "targets").symlink_to(cache_root() / "targets")  # converted once (llama_target)
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))  # a calibration measured afresh
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "2", "--drafter", str(checkpoint)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moaspec: error:") and "was trained for target" in lines[0]


def test_final_hidden_state_comes_with_the_logits(llama_target, category_prompts) -> None:
    require_exact_trees(llama_target)
    prompt = torch.tensor(category_prompts["math"][:40])
    llama_target.reset()
    last = llama_target.num_layers
    out = llama_target.prefill(prompt, (last,))
    assert out.hidden.shape == (prompt.numel(), 1, llama_target.hidden_size)
    assert torch.isfinite(out.hidden).all()
    tree = DraftTree(torch.tensor([int(out.logits.argmax()), 5, 6]), torch.tensor([-1, 0, 0]))
    verified = llama_target.verify(tree, (last,))
    assert verified.hidden.shape == (3, 1, llama_target.hidden_size)
    # the LM head over the returned state gives the logits (tied embeddings): close, not equal, as
    # llama.cpp's head runs on its quantized embedding (measured 0.32 on logits up to ~30, AVX2
    # EPYC); another node's state is ~38 off, far outside the bound
    head = llama_target.parts(0).lm_head_weight
    logits = torch.from_numpy(verified.logits)
    assert torch.allclose(verified.hidden[:, 0] @ head.T, logits, atol=0.5)
    assert not torch.allclose(verified.hidden[[1, 2, 0], 0] @ head.T, logits, atol=0.5)


def test_target_layer_inference_runs_the_targets_own_last_layers(llama_target, category_prompts) -> None:
    """Issue 21: a TLI drafter on llama.cpp runs the target's last k layers in torch, read once from
    the converted weights: the same weights the transformers runtime runs there, and with
    llama.cpp's captured keys/values as their context the drafter's depth-1 choices are about as
    good as with the transformers runtime's own (llama.cpp's activations are quantized: close,
    not equal)."""
    from moaspec.api import load_target

    exact = load_target("smollm2-135m", runtime="transformers")
    layers = llama_target.parts(1).tli_layers
    assert len(layers) == 1 and layers[0] is not exact.parts(1).tli_layers[0]
    for (name, got), (_, want) in zip(layers[0].state_dict().items(), exact.parts(1).tli_layers[0].state_dict().items()):
        assert torch.equal(got, want), name
    generation = GenerationConfig(max_new_tokens=48)
    rates = {}
    for target in (llama_target, exact):
        engine = Engine(target, make_drafter("moa-tli1", target, {"depth": 1, "top_k": 1, "budget": 1}))
        tokens = forwards = 0
        for name in ("mt_bench", "qa", "math"):  # tokens per target forward, pooled (measured: 1.36 / 1.31)
            stats = engine.generate(category_prompts[name], SamplingConfig(), generation).stats
            tokens, forwards = tokens + stats.new_tokens, forwards + stats.target_forwards
        rates[target.runtime] = tokens / forwards
    assert rates["llama.cpp"] > 1.15 and abs(rates["llama.cpp"] - rates["transformers"]) < 0.25, rates


def test_what_llama_cpp_cannot_give_is_refused_clearly(llama_target) -> None:
    llama_target.reset()
    with pytest.raises(MoaspecError, match="layer"):
        llama_target.prefill(torch.tensor([1, 2, 3]), (3,))
    wide = DraftTree(torch.tensor([1] * (MAX_LEAVES + 2)), torch.tensor([-1] + [0] * (MAX_LEAVES + 1)))
    with pytest.raises(MoaspecError, match="leaves"):
        llama_target.verify(wide)


def test_runtime_choice_and_its_errors(tmp_path) -> None:
    from moaspec.targets.options import check_runtime, default_runtime

    assert default_runtime("smollm2-135m") == "llama.cpp"
    assert default_runtime(str(tmp_path)) == "transformers"
    with pytest.raises(MoaspecError, match="GGUF"):
        check_runtime("llama.cpp", str(tmp_path))
    with pytest.raises(MoaspecError, match="unknown runtime"):
        check_runtime("vllm", "smollm2-135m")


def test_sessions_share_weights_and_keep_their_own_context(llama_target, category_prompts) -> None:
    prompt = category_prompts["translation"][:60]
    other = llama_target.new_session()
    assert isinstance(other, LlamaCppTarget) and other.weights is llama_target.weights
    llama_target.reset()
    first = llama_target.prefill(torch.tensor(prompt)).logits
    other.prefill(torch.tensor(prompt[:30]))
    again = llama_target.verify(one_token(int(first.argmax())))
    assert other.num_cached == 30 and llama_target.num_cached == len(prompt)
    assert np.isfinite(again.logits).all()


def test_keys_and_values_match_the_transformers_runtime() -> None:
    """Captured through the eval callback, un-permuted to transformers' RoPE layout: close to the
    float32 runtime's (llama.cpp quantizes activations), and far from a wrong layout."""
    from moaspec.api import load_target

    llama = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    require_exact_trees(llama)
    exact = load_target("smollm2-135m", runtime="transformers")
    llama.keep_layer_kv([0, 14, 29])
    ids = torch.tensor(llama.tokenizer("The quick brown fox jumps over the lazy dog. " * 3)["input_ids"])
    llama.prefill(ids[:20])
    tree = DraftTree(ids[20:24], torch.tensor([-1, 0, 1, 2]))
    llama.commit(verify_greedy(tree, llama.verify(tree).logits).path_node_idx[:1])  # the root only
    llama.prefill(ids[21:])
    exact.prefill(ids)
    got, want = llama.layer_kv(0, len(ids), [29, 0]), exact.layer_kv(0, len(ids), [29, 0])
    assert got.shape == want.shape == (len(ids), 2, 384)
    error = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
    assert error < 0.1
    keys = got.view(len(ids), 2, 3, 2, 64)[:, :, :, 0]
    interleaved = keys[..., torch.cat([torch.arange(0, 64, 2), torch.arange(1, 64, 2)])]
    wrong = ((interleaved - want.view(len(ids), 2, 3, 2, 64)[:, :, :, 0]).norm() / want.norm())
    assert wrong > 10 * error
    with pytest.raises(MoaspecError, match="not captured"):
        llama.layer_kv(0, 2, [5])
    long_ids = torch.tensor(llama.tokenizer("The quick brown fox jumps over the lazy dog. " * 60)["input_ids"])
    long_ids = long_ids[: PROMPT_CONTEXT_MIN_TOKENS + 8]  # captured in the prompt context
    llama.set_context(long_ids)
    exact.set_context(long_ids)
    got, want = llama.layer_kv(0, len(long_ids), [29, 0]), exact.layer_kv(0, len(long_ids), [29, 0])
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--threads", "0"], "--threads must be >= 1"),
        (["--n-gpu-layers", "-1"], "--n-gpu-layers must be >= 0"),
        (["--gpu-layers", "-1"], "--n-gpu-layers must be >= 0"),
        (["-ngl", "-1"], "--n-gpu-layers must be >= 0"),
        (["--device", "cuda"], "--device applies to the transformers runtime"),
        (["--runtime", "transformers", "--threads", "2"], "apply to the llama.cpp runtime"),
        (["--runtime", "transformers", "--device", "tpu"], "--device must be cpu or cuda"),
        (["--runtime", "transformers", "--device", "cuda:7"], "no such CUDA device"),
        (["--runtime", "vllm"], "invalid choice"),
        (["--dtype", "bfloat16"], "--dtype applies to the transformers runtime"),
        (["--runtime", "transformers", "--dtype", "float64"], "invalid choice"),
    ],
)
def test_runtime_flags_are_checked_before_anything_loads(flags: list[str], message: str, capsys) -> None:
    from moaspec.cli import main

    if "cuda:7" in flags and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 CUDA devices")
    assert main(["generate", "--prompt", "hi", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
@pytest.mark.parametrize("spelling", ["--n-gpu-layers", "--gpu-layers", "-ngl"])
def test_gpu_layers_reach_the_llama_cpp_runtime_under_each_spelling(command: str, spelling: str) -> None:
    """Issue 21: llama.cpp's `--n-gpu-layers` passes through (llama.cpp's own name; `--gpu-layers`
    and `-ngl` are aliases) on every command that loads a target."""
    from moaspec.cli import _build_parser
    from moaspec.targets.options import runtime_options

    required = {"generate": ["--prompt", "hi"], "serve": [], "bench": ["--out", "unused"]}[command]
    args = _build_parser().parse_args([command, *required, spelling, "3"])
    assert runtime_options(args, "smollm2-135m")["gpu_layers"] == 3


def test_the_cli_generate_path_on_llama_cpp_imports_no_transformers(tmp_path) -> None:
    """Start-up (issue 21): the default generation loads neither transformers' modeling code nor
    transformers at all (light tokenizer, own text printer)."""
    import subprocess
    import sys

    probe = (
        "import sys; from moaspec.cli import main; "
        "code = main(['generate', '--prompt', 'Name three colours.', '--max-new-tokens', '4', '--drafter', 'none']); "
        "print(); print(code, sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "0 []"


HYPERTHREADED_CPUINFO = "\n\n".join(
    f"processor\t: {cpu}\nphysical id\t: 0\ncore id\t\t: {cpu % 2}\nflags\t\t: avx2" for cpu in range(4)
)


def test_physical_cores_count_distinct_cores_among_the_allowed_processors() -> None:
    from moaspec.targets.options import physical_cores

    assert physical_cores(HYPERTHREADED_CPUINFO, {0, 1, 2, 3}) == 2  # two cores, two threads each
    assert physical_cores(HYPERTHREADED_CPUINFO, {0, 2}) == 1  # both threads of core 0
    assert physical_cores("processor\t: 0\nFeatures\t: asimd\n\nprocessor\t: 1\n", {0, 1}) == 2  # no core ids (ARM)


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "1"}, {"MKL_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "64"},
                                 {"MKL_NUM_THREADS": "64", "OMP_NUM_THREADS": "1"}])
def test_llama_cpp_threads_default_to_torchs_count_without_importing_torch(env: dict) -> None:
    """The llama.cpp runtime's default threads, read without torch, are the count torch's pool
    takes in the same environment (the target and a model drafter share the cores alike)."""
    import os
    import subprocess
    import sys

    probe = (
        "import sys; from moaspec.targets.options import default_threads; mine = default_threads(); "
        "assert 'torch' not in sys.modules; import torch; print(mine, torch.get_num_threads())"
    )
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env={**clean, **env})
    assert proc.returncode == 0, proc.stderr
    mine, torchs = proc.stdout.split()
    assert mine == torchs


_TORCH_FREE_PROBE = """
import json, sys
from moaspec.cli import main
code = main(json.loads(sys.argv[1]))
print()
print(json.dumps([code, "torch" in sys.modules]))
"""


def _generate_reporting_torch(*args: str, env: dict | None = None) -> tuple[int, bool, str]:
    """`moaspec generate ARGS --json` in a fresh interpreter -> (exit status, whether torch was
    imported, the JSON record's line)."""
    import subprocess
    import sys

    prompt = "Write the numbers from one to twenty in words, separated by commas, then write them again."
    argv = ["generate", "--prompt", prompt, "--max-new-tokens", "24", "--json", *args]
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE_PROBE, json.dumps(argv)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    code, imported = json.loads(lines[-1])
    return code, imported, lines[0]


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_greedy_generation_without_a_model_drafter_never_imports_torch(drafter: str) -> None:
    """Start-up (issue 21): greedy `none` and `ngram` on llama.cpp run on numpy alone (torch's
    import is 1-2.5 s of a 2-core machine's start); a sampled generation does import it, which
    shows the probe sees an import. The ngram case verifies trees (it copies from the prompt)."""
    code, imported, line = _generate_reporting_torch("--drafter", drafter)
    record = json.loads(line)
    assert code == 0 and not imported and record["drafter"] == drafter and record["new_tokens"] == 24
    if drafter == "ngram":
        assert record["mean_drafted_nodes"] > 0
    code, imported, _ = _generate_reporting_torch("--drafter", drafter, "--temperature", "0.7")
    assert code == 0 and imported


_HELD_IMPORT_PROBE = """
import json, signal, sys
import moaspec
from moaspec.signals import DeferredSignals

held = []

class ReportsTorchsFirstImport:  # a finder that only looks: is SIGINT held when torch first loads?
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not held:
            handler = signal.getsignal(signal.SIGINT)
            held.append(isinstance(getattr(handler, "__self__", None), DeferredSignals))
        return None

class PrintsTensors:  # a streamer of transformers' kind: torch tensors, no takes_token_lists
    def put(self, ids): pass
    def end(self): pass

lm = moaspec.load(drafter="none", calibrate=False)
sys.meta_path.insert(0, ReportsTorchsFirstImport())
assert "torch" not in sys.modules
kind = sys.argv[1]
if kind == "sampled":
    lm.generate("Name three colours.", max_new_tokens=4, temperature=0.7)
else:
    lm.generate("Name three colours.", max_new_tokens=4, streamer=PrintsTensors())
print(json.dumps(held))
"""


@pytest.mark.parametrize("kind", ["sampled", "tensor streamer"])
def test_the_library_imports_torch_first_with_signals_held(kind: str) -> None:
    """A library user's llama.cpp generation loads torch only where it samples or streams
    tensors; that first import (1-3 s) happens with Ctrl-C held, as the CLI's does (an interrupt
    half-way left it half-imported, or was swallowed)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _HELD_IMPORT_PROBE, kind], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [True]


@pytest.mark.slow
def test_a_cached_calibration_that_picks_no_model_drafter_imports_no_torch() -> None:
    """The calibrated default on llama.cpp: its first run may measure (in torch); a run on its
    cached costs imports torch only where it chose a model drafter."""
    import os

    env = {key: value for key, value in os.environ.items() if key != "MOASPEC_NO_CALIBRATION"}
    _generate_reporting_torch(env=env)
    code, imported, line = _generate_reporting_torch(env=env)
    record = json.loads(line)
    assert code == 0 and record["calibration"]["source"] == "cached"
    assert imported == (record["drafter"] not in ("none", "ngram")), record["drafter"]


def _console_script(*args: str, **popen):
    """The `moaspec` console script (cli.entry) in a child process, its stdout a pipe."""
    import subprocess
    import sys

    command = [sys.executable, "-c", "from moaspec.cli import entry; entry()", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def test_the_console_script_exits_fast_after_generate_without_losing_output() -> None:
    """`generate` ends with os._exit (no interpreter teardown): its buffered output must be out
    first, on success and on error."""
    proc = _console_script("generate", "--prompt", "Name three colours.", "--max-new-tokens", "3", "--drafter", "none", "--json")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    record = json.loads(out.decode())  # one whole line: stdout is block-buffered into a pipe
    assert record["new_tokens"] == 3 and record["runtime"] == "llama.cpp"
    proc = _console_script("generate", "--prompt", " ")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.decode().strip() == "moaspec: error: the prompt is empty"


def test_a_reader_closing_the_stream_ends_generate_quietly() -> None:
    """`moaspec generate ... | head -c 1`: no BrokenPipeError traceback, exit status 1."""
    proc = _console_script("generate", "--prompt", "Write a long story.", "--max-new-tokens", "200", "--drafter", "none")
    assert proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 1
    assert "Traceback" not in err and "Exception" not in err, err


@pytest.mark.parametrize(("drafter", "name", "length"), [
    ("none", "mt_bench", 150), ("eagle", "mt_bench", 150), ("moa", "mt_bench", 150),
    ("none", "qa", 450), ("eagle", "qa", 450), ("moa", "qa", 450),  # long: the prompt context reuses whole chunks
])
def test_a_new_prompt_reuses_the_shared_start_exactly(category_prompts, drafter: str, name: str, length: int) -> None:
    """A chat's next turn starts with the previous prompt and answer: set_context decodes only the
    new part (a long prompt: from the last whole chunk the prompt context holds), and the logits,
    hidden states and keys/values equal a fresh context's bit for bit."""
    from moaspec.api import load_target

    warm = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    fresh = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    require_exact_trees(warm)
    engine = Engine(warm, make_drafter(drafter, warm))
    make_drafter(drafter, fresh)  # the same key/value capture
    first = category_prompts[name][:length]
    answer = engine.generate(first, SamplingConfig(), GenerationConfig(max_new_tokens=24)).token_ids
    follow_up = first + answer + [2, 198, 1, 4093, 198, 11, 12, 13]
    hidden = (warm.num_layers,) if drafter == "eagle" else ()
    decoded = len(warm._tokens) if length < PROMPT_CONTEXT_MIN_TOKENS else len(warm._prompt_tokens)
    got = warm.set_context(torch.tensor(follow_up), hidden)
    want = fresh.set_context(torch.tensor(follow_up), hidden)
    assert np.array_equal(got.logits, want.logits)
    assert warm.num_cached == fresh.num_cached == len(follow_up)
    assert decoded >= min(len(first), PROMPT_CHUNK)  # there was something to reuse
    if hidden:
        assert torch.equal(got.hidden, want.hidden)
    if drafter == "moa":
        assert torch.equal(warm.layer_kv(0, len(follow_up)), fresh.layer_kv(0, len(follow_up)))
    generation = GenerationConfig(max_new_tokens=24)
    plain = Engine(fresh, make_drafter("none", fresh)).generate(follow_up, SamplingConfig(), generation)
    assert engine.generate(follow_up, SamplingConfig(), generation).token_ids == plain.token_ids


def test_a_gpu_target_gets_the_same_default_drafter_as_a_cpu_target(monkeypatch) -> None:
    """generate, load() and bench pick the default drafter by the target's name, not its device:
    the shipped `moa+ngram` on a GPU too (faster than `ngram` in every category on an H200,
    session 29), and the bench's default methods list the shipped drafters there."""
    from moaspec.bench.methods import default_methods
    from moaspec.calibration import plan

    monkeypatch.setenv("MOASPEC_NO_CALIBRATION", "1")
    made = []
    monkeypatch.setattr(plan, "make_drafter", lambda spec, target, overrides: made.append(spec) or spec)
    gpu_target = SimpleNamespace(name="smollm2-135m", runtime="transformers", device=torch.device("cuda"))
    assert plan.drafter_for(gpu_target, None) == ("moa+ngram", None) and made == ["moa+ngram"]
    assert default_methods("smollm2-135m", "transformers") == "none,hf,hf-pld,ngram,moa,moa-tli1,eagle,moa+ngram,default"


def test_the_exactness_check_finds_the_largest_tree_on_this_machines_kernels(llama_target) -> None:
    """exact_tree_nodes_here gives the largest tree where the kernels keep every tree exact (the
    other tests hold this machine to that)."""
    from moaspec.targets import llamacpp

    require_exact_trees(llama_target)
    assert llamacpp.exact_tree_nodes_here(llama_target) == MAX_TREE_NODES


@pytest.mark.parametrize(("rounds_from", "exact"), [(2, 1), (4, 3), (8, 7), (16, 8), (121, 8)])
def test_the_exactness_check_finds_the_batch_size_where_kernels_round_differently(
    llama_target, monkeypatch, rounds_from: int, exact: int
) -> None:
    """Where batches of `rounds_from` tokens or more move a logit by one rounding step (K-quant
    GGUFs: 4 on the AVX-512 EPYC), exact_tree_nodes_here gives the longest chain below that, up
    to 8 (16: only the 64-node tree sees it, as a 16-row matrix path would; 121: only the largest,
    filled up to 128 nodes, the most a tree may have); trees are then refused beyond it, and
    branching ones altogether."""
    from moaspec.targets import llamacpp

    require_exact_trees(llama_target)
    verify = LlamaCppTarget.verify

    def rounded_differently(self, tree, hidden_layers=()):
        out = verify(self, tree, hidden_layers)
        if tree.num_nodes >= rounds_from:
            out.logits[:, 0] = np.nextafter(out.logits[:, 0], np.float32(1e9))
        return out

    monkeypatch.setattr(LlamaCppTarget, "verify", rounded_differently)
    assert llamacpp.exact_tree_nodes_here(llama_target) == exact
    monkeypatch.setattr(llama_target.weights, "exact_nodes", exact)
    assert llama_target.max_tree_nodes == exact and llama_target.max_tree_leaves == 1
    if exact == 1:
        with pytest.raises(MoaspecError, match="bit for bit"):
            verify(llama_target, DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0])))
        return
    with pytest.raises(MoaspecError, match=f"a tree of {exact + 1} nodes exceeds the {exact}"):
        verify(llama_target, DraftTree.chain(list(range(1, exact + 2))))
    with pytest.raises(MoaspecError, match="2 leaves exceeds the 1"):
        verify(llama_target, DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0])))


@pytest.mark.parametrize("exact", [1, 2, 3])
def test_the_tree_tests_skip_where_the_runtime_refuses_branching_trees(llama_target, monkeypatch, exact: int) -> None:
    """The tree tests' guard failed instead of skipping where only 2-token chains are exact: the
    3-node branching tree it offers is refused for its size there, not for its leaves."""
    monkeypatch.setattr(llama_target.weights, "exact_nodes", exact)
    with pytest.raises(pytest.skip.Exception):
        require_exact_trees(llama_target)


def test_plain_decoding_measures_no_exact_tree_size_and_small_contexts_are_checked(
    llama_target, category_prompts, monkeypatch, tmp_path
) -> None:
    """Bug: plain decoding on llama.cpp read the runtime's tree limits at every step, so with no
    calibration its first generation measured the exact tree size (~6 s inside its timed
    decoding), and a GGUF whose context holds fewer than the check's 300-token prompt could not
    decode at all ("the prompt has 300 tokens but the target's context holds 256"). Now only a
    drafted tree reads them, and the check fits a small context."""
    from moaspec.targets import llamacpp

    prompt, generation = category_prompts["mt_bench"], GenerationConfig(max_new_tokens=8)
    expected = Engine(llama_target, make_drafter("none", llama_target)).generate(prompt, generation=generation)
    exact = llama_target.exact_tree_nodes
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))  # nothing saved
    monkeypatch.setattr(llama_target.weights, "exact_nodes", None)
    monkeypatch.setattr(llamacpp, "exact_tree_nodes_here", lambda target: pytest.fail("measured for plain decoding"))
    fresh = llama_target.new_session()  # a chat's next turn would measure it: keeping cells depends on it
    plain = Engine(fresh, make_drafter("none", fresh)).generate(prompt, generation=generation)
    assert plain.token_ids == expected.token_ids and fresh.weights.exact_nodes is None
    monkeypatch.undo()
    monkeypatch.setattr(llama_target.weights, "context_train", 256)  # as a GGUF trained on 256 positions
    assert llama_target.max_positions == 256
    assert llamacpp.exact_tree_nodes_here(llama_target) == exact


def test_the_exact_tree_size_is_saved_per_machine_gguf_and_thread_count(tmp_path, monkeypatch) -> None:
    """Every process that verified trees on llama.cpp measured the exact tree size again (~6 s:
    4 minutes of the test suite): it is saved, and measured again only for another CPU, GGUF
    content, thread count, value cache type or an unreadable record."""
    import os

    from moaspec.targets import llamacpp_exactness
    from moaspec.targets.llamacpp_exactness import saved_exact_tree_nodes, saved_or_measured

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(16))
    target = SimpleNamespace(
        name="model.gguf", weights=SimpleNamespace(path=gguf, gpu_layers=0), threads=2, value_cache_name="f16"
    )
    measured = []

    def measure(answer: int):
        return lambda: measured.append(answer) or answer

    assert saved_exact_tree_nodes(target) is None
    assert saved_or_measured(target, measure(128)) == 128 and measured == [128]
    assert saved_or_measured(target, measure(7)) == 128 and measured == [128]  # a new process: read
    target.threads = 1
    assert saved_or_measured(target, measure(7)) == 7 and measured == [128, 7]
    target.threads = 2
    target.value_cache_name = "q8_0"
    assert saved_or_measured(target, measure(5)) == 5 and measured == [128, 7, 5]
    target.value_cache_name = "f16"
    assert saved_or_measured(target, measure(9)) == 128
    os.utime(gguf, ns=(1, 1))  # the same bytes touched (or installed again): the same model
    assert saved_or_measured(target, measure(4)) == 128
    gguf.write_bytes(b"GGUF" + bytes(15) + b"\1")  # the file replaced by another model
    assert saved_or_measured(target, measure(3)) == 3
    monkeypatch.setattr(llamacpp_exactness, "cpu_description", lambda: "another CPU [avx2]")
    assert saved_exact_tree_nodes(target) is None and saved_or_measured(target, measure(1)) == 1
    records = (tmp_path / "cache" / "calibration" / "model.gguf").glob("exactness-*.json")
    [record] = [path for path in records if "another CPU" in path.read_text()]
    record.write_text("{not json")
    assert saved_or_measured(target, measure(2)) == 2 and measured == [128, 7, 5, 3, 1, 2]
    assert saved_or_measured(target, measure(5)) == 2


def test_where_trees_are_not_exact_the_default_decodes_plainly_and_named_drafters_are_refused(
    llama_target, monkeypatch, tmp_path, capsys
) -> None:
    """Bug: on a GGUF whose batched kernels are not exact here (Gemma-3-270M Q4_K_M on the
    AVX-512 EPYC), the calibration's cost measurement failed on its first tree, and the default
    drafter (`ngram`) then ended the generation with an error: plain decoding is the default there."""
    from moaspec.api import SpeculativeLM
    from moaspec.calibration.plan import drafter_for
    from moaspec.drafters.none import NoDrafter
    from moaspec.targets import llamacpp

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))  # a machine with nothing measured yet
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    target = llama_target.new_session()
    monkeypatch.setattr(target.weights, "exact_nodes", None)
    monkeypatch.setattr(llamacpp, "exact_tree_nodes_here", lambda target: 1)  # measured here, then saved
    drafter, calibration = drafter_for(target, None)
    assert isinstance(drafter, NoDrafter) and calibration is None
    assert "plain decoding (--runtime transformers speculates)" in capsys.readouterr().err
    assert isinstance(drafter_for(target, "none")[0], NoDrafter)
    monkeypatch.setattr(target.weights, "exact_nodes", None)  # a new process: the saved answer is read, not measured
    monkeypatch.setattr(llamacpp, "exact_tree_nodes_here", lambda target: pytest.fail("measured again"))
    assert isinstance(drafter_for(target, None)[0], NoDrafter) and target.weights.exact_nodes == 1
    for named in ("ngram", "moa+ngram"):
        with pytest.raises(MoaspecError, match="bit for bit .*: use --drafter none or --runtime transformers"):
            drafter_for(target, named)
    prompt = [1, 2, 3, 4]
    result = SpeculativeLM(target, drafter, "none").generate(prompt, max_new_tokens=4)
    assert result.stats.num_verifications == 4 - 1 and len(result.token_ids) == 4
    from moaspec.bench.cli import _without_trees_where_inexact
    from moaspec.bench.methods import default_methods, parse_methods

    specs = _without_trees_where_inexact(parse_methods(default_methods(target.name, "llama.cpp")), target)
    assert [spec.label for spec in specs] == ["none", "llama.cpp", "llama.cpp-pld", "default"]  # bench ran none of them
    assert "ngram, moa, moa-tli1, eagle, moa+ngram left out" in capsys.readouterr().err


def test_the_calibration_keys_a_gguf_by_its_file_and_offloaded_layers(tmp_path, monkeypatch) -> None:
    """Bug: the cached costs and the exact tree size were keyed by the target's name (a GGUF's file
    name) and the CPU: two different `model.gguf` files, or the same one with --n-gpu-layers, shared
    them, and a cached exactness could let a file whose trees are not exact speculate. The same
    file installed at another path (another virtual environment) shares them."""
    from pathlib import Path

    from moaspec.calibration.plan import target_identity

    def llama_target_at(path: Path, gpu_layers: int = 0):
        weights = SimpleNamespace(path=path, gpu_layers=gpu_layers)
        return SimpleNamespace(runtime="llama.cpp", name=path.name, weights=weights)

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    first, second, twin = (tmp_path / name / "model.gguf" for name in "abc")
    for path, size in ((first, 10), (second, 20), (twin, 10)):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(size))
    identities = {target_identity(llama_target_at(first)), target_identity(llama_target_at(second)),
                  target_identity(llama_target_at(first, gpu_layers=8))}
    assert len(identities) == 3 and target_identity(llama_target_at(first)) in identities
    assert target_identity(llama_target_at(twin)) == target_identity(llama_target_at(first))
    assert target_identity(SimpleNamespace(runtime="transformers", name="smollm2-135m")) == "smollm2-135m"


def test_the_machine_records_of_one_gguf_installed_twice_are_one(tmp_path, monkeypatch) -> None:
    """Bug: the value cache, float prefill and exactness records were keyed by the GGUF's path, so a
    second virtual environment measured again and could choose another value cache: the same
    machine and model then gave two different (each lossless) texts."""
    from moaspec.targets import llamacpp_exactness
    from moaspec.targets.llamacpp_exactness import machine_record_path

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    first, twin, other = (tmp_path / name / "model.gguf" for name in "abc")
    for path, payload in ((first, b"one"), (twin, b"one"), (other, b"two")):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + payload)

    def record(path):
        weights = SimpleNamespace(path=path, gpu_layers=0)
        return machine_record_path(SimpleNamespace(name="model", weights=weights, threads=2), "value-cache", "1")

    assert record(twin) == record(first) != record(other)
    before = record(first)  # another build of llama.cpp (other kernels: AMX, repacking) measures again
    monkeypatch.setattr(llamacpp_exactness, "build_features", lambda lib: "CPU : AVX2 = 1 | AMX_INT8 = 1 | ")
    assert record(first) != before


def test_an_interrupt_inside_the_capture_callback_is_raised_after_the_decode(llama_target, category_prompts) -> None:
    """ctypes swallows exceptions raised in the eval callback, and a callback that answers False
    stops llama.cpp's graph mid-way: Ctrl-C (or SIGTERM through the CLI's handler) arriving while
    keys/values are copied out must surface as KeyboardInterrupt after llama_decode, never as a
    silently wrong decode; the context is reset and decodes exactly afterwards."""
    prompt = category_prompts["math"][:60]
    _, logits = plain_decode(llama_target, prompt, 2)
    capturing = llama_target.new_session()
    capturing.keep_layer_kv([28, 29])
    real = capturing.capture.ggml

    class InterruptOnce:
        fired = False

        def __getattr__(self, name):
            return getattr(real, name)

        def ggml_backend_tensor_get(self, *args):
            if not self.fired:
                self.fired = True
                raise KeyboardInterrupt
            return real.ggml_backend_tensor_get(*args)

    capturing.capture.ggml = InterruptOnce()
    with pytest.raises(KeyboardInterrupt):
        capturing.set_context(torch.tensor(prompt))
    assert capturing.num_cached == 0 and capturing.capture.failure is None
    capturing.capture.ggml = real
    assert np.array_equal(capturing.set_context(torch.tensor(prompt)).logits[-1], logits[0])


def _raise_time_out(number, frame) -> None:
    raise TimeoutError("the application's time-out")


@pytest.mark.parametrize("signal_name, handler, raised", [
    ("SIGINT", None, KeyboardInterrupt),  # Python's own Ctrl-C handler
    ("SIGALRM", _raise_time_out, TimeoutError),  # an application's time-out
])
def test_a_signal_arriving_during_a_capturing_decode_is_raised_after_it(
    llama_target, category_prompts, signal_name, handler, raised
) -> None:
    """Bug: Ctrl-C landing while llama_decode ran the capture callback was raised at the callback's
    entry, before its `try`; ctypes swallowed it and answered False, the graph stopped part-way, and
    generation went on with wrong keys/values (wrong text, exit status 0). Now the signal waits for
    the decode's end and the context is reset. Bug (session 39): only SIGINT and SIGTERM were held,
    so an application's SIGALRM handler raising TimeoutError (a common way to time-limit a call)
    did the same (wrong text in 5 of 20 time-limited calls in an audit); every signal with a Python
    handler is held now. The signal comes from another thread 0.1 s into a decode of ~1 s that
    captures every layer, so it lands while llama.cpp runs (in C, where the bug struck); had the
    decode ended first, the context would hold the prompt and the test fail."""
    import signal
    import threading

    number = getattr(signal, signal_name)
    prompt = (category_prompts["qa"] * 4)[:350]
    _, logits = plain_decode(llama_target, prompt, 1)
    capturing = llama_target.new_session()
    capturing.keep_layer_kv(list(range(capturing.num_layers)))
    capturing.set_context(torch.tensor(prompt[:10]))  # the context made now: the signal lands in the decode
    capturing.reset()
    previous = signal.getsignal(number) if handler is None else signal.signal(number, handler)
    timer = threading.Timer(0.1, signal.pthread_kill, (threading.main_thread().ident, number))
    timer.start()
    try:
        with pytest.raises(raised):
            capturing.set_context(torch.tensor(prompt))
    finally:
        timer.cancel()
        signal.signal(number, previous)
    assert capturing.num_cached == 0 and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert np.array_equal(capturing.set_context(torch.tensor(prompt)).logits[-1], logits[0])


def test_ctrl_c_while_llama_cpp_logs_is_raised_after_the_call(llama_target, category_prompts) -> None:
    """Bug: llama.cpp logs ~1,300 lines through moaspec's Python log callback while it makes a
    context (and while it loads weights); Ctrl-C landing in one was raised inside the callback and
    swallowed by ctypes: the keypress was lost. Now those calls hold signals, deliver them after,
    and keep no context made half-way to an interrupt."""
    import ctypes
    import signal

    import moaspec.targets.llamacpp_model as llamacpp_model

    lib = llamacpp_model.load_bindings()
    lines = []

    def ctrl_c_on_the_first_line(level, text, data) -> None:
        lines.append(text)
        if len(lines) == 1:
            signal.raise_signal(signal.SIGINT)

    callback = lib.llama_log_callback(ctrl_c_on_the_first_line)
    lib.llama_log_set(callback, ctypes.c_void_p(0))
    session = llama_target.new_session()
    try:
        with pytest.raises(KeyboardInterrupt):
            session.set_context(torch.tensor(category_prompts["qa"][:20]))  # makes the context: logs
    finally:
        lib.llama_log_set(llamacpp_model._LOG_CALLBACK, ctypes.c_void_p(0))
    assert len(lines) > 100 and session._ctx is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _, logits = plain_decode(llama_target, category_prompts["qa"][:20], 1)
    assert np.array_equal(session.set_context(torch.tensor(category_prompts["qa"][:20])).logits[-1], logits[0])


@pytest.mark.parametrize("length", [100, PROMPT_CONTEXT_MIN_TOKENS + 100])
def test_a_cancelled_prefill_stops_and_leaves_an_empty_context(llama_target, category_prompts, length: int) -> None:
    """Target.cancellable on llama.cpp: a set event stops a prefill at its next decode chunk (on
    either prefill path) with the context reset, and the next prefill is exact. A server uses it
    when a client leaves during a long prompt."""
    import threading

    from moaspec.targets.base import PrefillCancelled

    prompt = (category_prompts["qa"] * 8)[:length]
    _, logits = plain_decode(llama_target, prompt, 1)
    cancel = threading.Event()
    cancel.set()
    with llama_target.cancellable(cancel), pytest.raises(PrefillCancelled):
        llama_target.set_context(torch.tensor(prompt))
    assert llama_target.num_cached == 0
    assert np.array_equal(llama_target.set_context(torch.tensor(prompt)).logits[-1], logits[0])  # no longer cancellable


def test_prompts_crossing_the_prompt_context_threshold_equal_fresh_ones(llama_target, category_prompts) -> None:
    """A short conversation growing past PROMPT_CONTEXT_MIN_TOKENS, then a short prompt sharing a
    long one's start: each takes the path a fresh context takes (nothing computed on the other
    path is reused), so the logits equal a fresh context's bit for bit."""
    from moaspec.api import load_target

    fresh = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    short = category_prompts["mt_bench"][:100]
    grown = short + category_prompts["qa"][: PROMPT_CONTEXT_MIN_TOKENS]
    shrunk = grown[:120] + [11, 12, 13]
    for prompt in (short, grown, shrunk, grown):
        fresh.reset()
        assert np.array_equal(llama_target.set_context(torch.tensor(prompt)).logits, fresh.set_context(torch.tensor(prompt)).logits)
    assert llama_target._moved == len(grown)
    llama_target.rollback(len(grown) - 10)  # into the moved cells, then on in this context
    fresh.set_context(torch.tensor(grown[:-10]))
    for token in grown[-10:]:
        want = fresh.verify(one_token(token))
        fresh.commit([0])
        got = llama_target.verify(one_token(token))
        llama_target.commit([0])
        assert np.array_equal(got.logits, want.logits)


def test_an_interrupted_long_prefill_leaves_an_empty_context(llama_target, category_prompts, monkeypatch) -> None:
    """Ctrl-C between the prompt context's chunks: the target holds nothing (not the previous
    conversation with half-replaced rows), and the same prompt afterwards equals a fresh one."""
    from moaspec.api import load_target

    prompt = category_prompts["qa"]
    assert len(prompt) > PROMPT_CHUNK + 1 and len(prompt) >= PROMPT_CONTEXT_MIN_TOKENS  # two chunks
    llama_target.set_context(torch.tensor(category_prompts["mt_bench"]))
    original, calls = LlamaCppTarget._fill, []

    def interrupted(self, *args) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        original(self, *args)

    monkeypatch.setattr(LlamaCppTarget, "_fill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llama_target.set_context(torch.tensor(prompt))
    monkeypatch.undo()
    assert llama_target.num_cached == 0
    fresh = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    assert np.array_equal(llama_target.set_context(torch.tensor(prompt)).logits, fresh.set_context(torch.tensor(prompt)).logits)


def test_trees_beyond_the_runtimes_node_limit_are_cut_to_it_and_stay_lossless(llama_target, category_prompts) -> None:
    """A tree larger than llama.cpp verifies (MAX_TREE_NODES, the context's headroom; MAX_LEAVES
    leaves) is cut to its longest prefix within both by the engine (a prefix of a tree is a tree)
    instead of failing, and a split server is refused a larger --max-tree-nodes at start."""
    require_exact_trees(llama_target)
    prompt = category_prompts["mt_bench"]
    drafter = make_drafter("moa", llama_target, {"depth": 6, "top_k": 8, "budget": 200})
    plain = Engine(llama_target, make_drafter("none", llama_target)).generate(prompt, generation=GenerationConfig(max_new_tokens=12))
    wide = Engine(llama_target, drafter).generate(prompt, generation=GenerationConfig(max_new_tokens=12))
    assert wide.token_ids == plain.token_ids
    assert 0 < wide.stats.to_dict()["mean_drafted_nodes"] <= MAX_TREE_NODES - 1
    tree = DraftTree(torch.tensor([5] * 80), torch.tensor([-1] + [0] * 79))  # 79 leaves: cut at 62
    assert limit_nodes(tree, llama_target.max_tree_nodes, llama_target.max_tree_leaves).num_nodes == 1 + MAX_LEAVES
    from moaspec.split.server import ServerLimits, SplitServer

    with pytest.raises(MoaspecError, match="--max-tree-nodes 200 is more than the llama.cpp runtime verifies"):
        SplitServer(llama_target, drafter, ["key"], ServerLimits(max_tree_nodes=200))


def test_a_session_sized_to_its_tokens_decodes_as_the_whole_context_does(llama_target, category_prompts) -> None:
    """A split server sizes each session's llama.cpp context to its reservation (a full one held
    ~160 MB whatever the session reserved): the output of a small context equals the full one's."""
    require_exact_trees(llama_target)
    plain = Engine(llama_target, make_drafter("none", llama_target))
    for name in ("mt_bench", "qa"):  # a short prompt, and a long one (through the prompt context)
        prompt = category_prompts[name][:600]
        small = llama_target.new_session(len(prompt) + 24)
        assert small.max_positions < llama_target.max_positions
        expected = plain.generate(prompt, generation=GenerationConfig(max_new_tokens=24))
        got = Engine(small, make_drafter("moa+ngram", small)).generate(prompt, generation=GenerationConfig(max_new_tokens=24))
        assert got.token_ids == expected.token_ids, name


def test_a_sessions_context_is_its_reservation_rounded_up_to_a_power_of_two(llama_target) -> None:
    """docs/protocol.md: a split session's context is its reservation rounded up to a power of
    two (a chat's next turns fit in it: IdleTargets reuses it), 1,024 cells at least and the
    target's own at most. Contexts are made on first use: nothing is allocated here."""
    positions = (10, 1024, 1025, 1500, 4096, llama_target.cells + 1)
    assert [llama_target.new_session(n).cells for n in positions] == [1024, 1024, 2048, 2048, 4096, llama_target.cells]
    assert llama_target.new_session().cells == llama_target.cells


@pytest.mark.parametrize("length", [300, 400])  # a short prompt, and a long one (through the prompt context)
def test_a_context_that_grows_mid_generation_keeps_every_bit(llama_target, category_prompts, monkeypatch, length) -> None:
    """The verified context starts at SESSION_CELLS_MIN positions (its cache is allocated and
    cleared up front: ~150 MB for 8,192) and doubles when verified tokens or a tree pass them,
    its cells moved through llama.cpp's sequence state. Started at 256 here, the prompt takes it
    past 256 positions and trees with parked cells past 512: every accepted node's logits equal plain
    decoding's in a context made large at once, with the final hidden states still output after
    each move; an engine with a keys/values-reading drafter gives plain decoding's tokens across
    the moves."""
    require_exact_trees(llama_target)
    import moaspec.targets.llamacpp_contexts as llamacpp_contexts

    text = [t for name in sorted(category_prompts) for t in category_prompts[name]]
    prompt = category_prompts["qa"][:length] if length >= PROMPT_CONTEXT_MIN_TOKENS else text[:length]
    assert len(prompt) == length
    fresh = llama_target.new_session()
    assert fresh.lib.llama_n_ctx(fresh.ctx) == 1280 and fresh.max_positions == llama_target.max_positions  # 1,024 + 128
    decoded = 512 - length + 48  # verified tokens that take the context well past 512 positions
    tokens, logits = plain_decode(llama_target, prompt, decoded + 10)
    monkeypatch.setattr(llamacpp_contexts, "SESSION_CELLS_MIN", 256)
    target = llama_target.new_session()
    assert target.lib.llama_n_ctx(target.ctx) == 512  # 256 + TREE_HEADROOM, as llama.cpp rounds it up
    generator = random.Random(length)
    last = (target.num_layers,)
    target.prefill(torch.tensor(prompt), last)
    done = 0
    while done < decoded:
        tree = oracle_tree(generator, tokens[done], tokens[done + 1 : done + 5], target.vocab_size, decoys=3)
        out = target.verify(tree, last)
        assert out.hidden is not None and out.hidden.shape == (tree.num_nodes, 1, target.hidden_size)
        accepted = verify_greedy(tree, out.logits)
        for k, node in enumerate(accepted.path_node_idx):
            assert np.array_equal(out.logits[node], logits[done + k + 1]), (done, k)
        target.commit(accepted.path_node_idx)
        done += accepted.num_accepted + 1
    assert target.num_cached == length + done and target._allocated == 1024
    session = llama_target.new_session()
    generation = GenerationConfig(max_new_tokens=150)
    expected = Engine(llama_target, make_drafter("none", llama_target)).generate(prompt, generation=generation)
    got = Engine(session, make_drafter("moa+ngram", session)).generate(prompt, generation=generation)
    assert got.token_ids == expected.token_ids and session._allocated == (512 if length + 150 <= 512 else 1024)


def test_a_sliding_window_models_context_is_allocated_whole(llama_target, monkeypatch) -> None:
    """Growing moves a context's cells through llama.cpp's sequence state, which for a
    sliding-window model (Gemma-3) holds a second cache that no test here can move: such a
    model's verified context is allocated whole, as before contexts grew."""
    monkeypatch.setattr(llama_target.weights, "sliding_window", 512)
    assert llama_target.new_session()._allocated == llama_target.cells == 8192
    monkeypatch.setattr(llama_target.weights, "sliding_window", 0)
    assert llama_target.new_session()._allocated == 1024


def test_a_context_that_cannot_grow_leaves_an_empty_target(llama_target, category_prompts, monkeypatch) -> None:
    """Bug (audit): when making the larger context failed (memory, a signal), the target kept its
    verified tokens with no context holding their cells, and the next call decoded after positions
    that had none: wrong logits, no error. Now the target is reset and the error raised."""
    import moaspec.targets.llamacpp_contexts as llamacpp_contexts

    text = [t for name in sorted(category_prompts) for t in category_prompts[name]]
    monkeypatch.setattr(llamacpp_contexts, "SESSION_CELLS_MIN", 256)
    target = llama_target.new_session()
    target.prefill(torch.tensor(text[:200]))
    made = target._new_llama_context

    def fails(*args):
        raise MoaspecError("llama.cpp cannot create a context")

    monkeypatch.setattr(target, "_new_llama_context", fails)
    with pytest.raises(MoaspecError, match="cannot create a context"):
        target.prefill(torch.tensor(text[200:300]))
    assert target.num_cached == 0 and target._ctx is None
    monkeypatch.setattr(target, "_new_llama_context", made)
    fresh = llama_target.new_session()
    assert np.array_equal(target.prefill(torch.tensor(text[:40])).logits, fresh.prefill(torch.tensor(text[:40])).logits)
