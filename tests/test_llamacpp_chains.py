"""llama.cpp on GGUFs whose batched kernels are exact only for short chains (K-quant mixes): the
runtime measures the largest exact tree per machine and speculates within it (moaspec/targets/
llamacpp.py's module docstring), losslessly.

The K-quant GGUF is SmolLM2-135M requantized to Q4_K_S by llama.cpp itself (~3 s): on the
AVX-512 EPYC chains of up to 3 tokens are exact there and 4 are not. Other CPUs may find another
length (or a fully exact GGUF); every assertion holds for any measured length.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moaspec.bench.prompts import load_prompts
from moaspec.chat import encode_chat_prompt
from moaspec.config import GenerationConfig, NgramConfig
from moaspec.drafters.ngram import NgramDrafter
from moaspec.drafters.none import NoDrafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.targets.llamacpp import MAX_TREE_NODES, LlamaCppTarget
from moaspec.tree import DraftTree, leaf_groups

LLAMA_FTYPE_MOSTLY_Q4_K_S = 14


@pytest.fixture(scope="module")
def k_quant_target(tmp_path_factory):
    from moaspec.api import load_target
    from moaspec.model_store import builtin_gguf_path
    from moaspec.targets.llamacpp_model import load_bindings

    lib = load_bindings()
    params = lib.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = LLAMA_FTYPE_MOSTLY_Q4_K_S, True, 2
    path = tmp_path_factory.mktemp("gguf") / "smollm2-q4_k_s.gguf"
    assert lib.llama_model_quantize(str(builtin_gguf_path("smollm2-135m")).encode(), str(path).encode(), ctypes.byref(params)) == 0
    # Its float32 copy (517 MB) and its exactness record go with the test's files, not the user's
    # cache (the record is keyed by this temporary path: one more file there every run).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOASPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        target = load_target(str(path), runtime="llama.cpp", threads=2)
        assert target.exact_tree_nodes >= 1  # measured now (~35 s), kept on its weights for the module
    return target


@pytest.fixture(scope="module")
def prompts(llama_target) -> dict[str, list[int]]:
    """The first prompt of three benchmark categories, through the chat template."""
    found = load_prompts(("mt_bench", "humaneval", "summarization", "qa"), 1)
    return {name: encode_chat_prompt(llama_target.tokenizer, items[0].turns[0]) for name, items in found.items()}


def plain_decode(target, prompt: list[int], count: int) -> tuple[list[int], list[torch.Tensor]]:
    """One-token greedy decoding: tokens and the logits after each (the first from the prefill)."""
    target.reset()
    logits = [target.prefill(torch.tensor(prompt)).logits[0]]
    tokens = []
    for _ in range(count):
        tokens.append(int(logits[-1].argmax()))
        logits.append(target.verify(DraftTree.root_only(tokens[-1])).logits[0])
        target.commit([0])
    return tokens, logits


def test_chains_up_to_the_measured_length_give_one_token_decodings_logits(k_quant_target, prompts) -> None:
    """On real prompts, every chain of up to `max_tree_nodes` tokens verifies to exactly the
    logits one-token decoding computes, and the token after a committed chain too."""
    target = k_quant_target
    longest = min(target.max_tree_nodes, 8)
    for name in ("mt_bench", "humaneval", "summarization"):
        prompt = prompts[name][:200]
        tokens, logits = plain_decode(target, prompt, longest + 1)
        for length in range(2, longest + 1):
            target.set_context(torch.tensor(prompt))  # held: the prompt and more (a fresh prefill's bits)
            out = target.verify(DraftTree.chain(tokens[:length]))
            # logits[k + 1] follow tokens[k]; tokens[0] is the root (after the prompt)
            for k in range(length):
                assert np.array_equal(out.logits[k], logits[k + 1]), (name, length, k)
            target.commit(list(range(length)))
            after = target.verify(DraftTree.root_only(tokens[length]))
            assert np.array_equal(after.logits[0], logits[length + 1]), (name, length)


def test_a_k_quant_gguf_speculates_within_its_exact_chains_and_keeps_plain_decodings_tokens(
    k_quant_target, prompts, monkeypatch
) -> None:
    """Bug: every K-quant GGUF decoded plainly on llama.cpp (trees were all or nothing). Prompt
    lookup drafting wider and deeper tries than the runtime takes is cut to its chains: greedy
    tokens equal plain decoding's in every category, and no verified tree is larger or branches."""
    target = k_quant_target
    verified: list[DraftTree] = []
    verify = LlamaCppTarget.verify

    def recording(self, tree, hidden_layers=()):
        verified.append(tree)
        return verify(self, tree, hidden_layers)

    monkeypatch.setattr(LlamaCppTarget, "verify", recording)
    lookup = NgramConfig(min_ngram=1, max_depth=6, max_branches=3, max_nodes=16)
    generation = GenerationConfig(max_new_tokens=64)
    drafted = 0
    for name in ("mt_bench", "humaneval", "summarization"):
        prompt = prompts[name]
        plain = Engine(target, NoDrafter.for_target(target)).generate(prompt, generation=generation)
        verified.clear()
        speculated = Engine(target, NgramDrafter(lookup)).generate(prompt, generation=generation)
        assert speculated.token_ids == plain.token_ids, name
        assert max(tree.num_nodes for tree in verified) <= target.max_tree_nodes
        if target.max_tree_nodes < MAX_TREE_NODES:
            assert all(len(leaf_groups(tree.parents)[0]) == 1 for tree in verified)  # chains
        drafted += speculated.stats.drafted_nodes
    assert drafted > 0 if target.max_tree_nodes > 1 else drafted == 0


def test_where_only_short_chains_are_exact_the_calibration_chooses_chains_within_them(
    llama_target, monkeypatch, tmp_path, capsys
) -> None:
    """With exactness measured up to 3-node chains (as K-quant GGUFs on the AVX-512 EPYC), the
    calibration costs and weighs only chains of at most 3 nodes, for prompt lookup and for model
    drafters, and caches that length with the costs; a tree --tree-* fixes beyond that is said
    to be cut; the length is saved, so a new process measures it no more."""
    from moaspec.calibration import costs_store
    from moaspec.calibration.plan import EXACT_NODES_FIELD, drafter_for
    from moaspec.drafters.moa import MoADrafter
    from moaspec.targets import llamacpp

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))  # a machine with nothing measured yet
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    target = llama_target.new_session()
    monkeypatch.setattr(target.weights, "exact_nodes", None)
    monkeypatch.setattr(llamacpp, "exact_tree_nodes_here", lambda target: 3)  # measured here, then saved
    for spec in (None, "ngram", "moa", "moa+ngram"):
        drafter, calibration = drafter_for(target, spec)
        lookup = calibration.chosen.lookup
        assert lookup is None or (lookup.max_branches == 1 and lookup.max_nodes <= 3), spec
        if isinstance(drafter, MoADrafter):
            tree = drafter.tree_config
            assert tree.top_k == 1 and tree.depth <= 2 and drafter.tree_source == "calibrated", spec
    assert "cut" not in capsys.readouterr().err
    for fixed in ({"top_k": 2}, {"depth": 2, "top_k": 2, "budget": 3}):  # the calibration's other fields / none
        drafter, _ = drafter_for(target, "moa", fixed)
        assert all(getattr(drafter.tree_config, field) == value for field, value in fixed.items())
        assert "verifies chains of at most 3 nodes here: the drafter's tree (depth" in capsys.readouterr().err
    records = list(costs_store.cache_dir(target.name).glob("verify-*.json"))
    assert len(records) == 1
    record = costs_store._read(records[0])
    assert record[EXACT_NODES_FIELD] == 3 and max(int(n) for n in record["verify_s"]["row"]) == 3
    monkeypatch.setattr(target.weights, "exact_nodes", None)  # a new process: the saved length is read
    monkeypatch.setattr(llamacpp, "exact_tree_nodes_here", lambda target: pytest.fail("measured again"))
    drafter_for(target, "ngram")
    assert target.weights.exact_nodes == 3


def test_serve_lowers_its_default_tree_limit_to_the_runtimes_exact_length(llama_target, monkeypatch, tmp_path, capsys) -> None:
    """`moaspec serve` on such a GGUF: split clients are told the chains the runtime verifies
    (it refused to start: its default --max-tree-nodes 64 was above the runtime's); a larger
    --max-tree-nodes named on the command line is still refused."""
    from moaspec.cli import _build_parser
    from moaspec.split.commands import build_server

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(llama_target.weights, "exact_nodes", 3)
    monkeypatch.setattr("moaspec.api.load_target", lambda *args, **kwargs: llama_target.new_session())
    args = _build_parser().parse_args(["serve"])
    args.runtime_options = {}
    server, _ = build_server(args, ["k" * 16])
    assert server.limits.max_tree_nodes == 3 and server.info["max_tree_leaves"] == 1
    assert "chains of at most 3 nodes verify exactly here (--max-tree-nodes 3)" in capsys.readouterr().err
    args = _build_parser().parse_args(["serve", "--max-tree-nodes", "64"])  # named, though the default's value
    args.runtime_options = {}
    with pytest.raises(MoaspecError, match="--max-tree-nodes 64 is more than the llama.cpp runtime verifies in one tree \\(3\\)"):
        build_server(args, ["k" * 16])


def test_a_chain_limit_cuts_trees_to_their_first_chain() -> None:
    """What the engine does with a branching draft for such a target (decode_step.limit_nodes)."""
    from moaspec.decode_step import limit_nodes

    target = SimpleNamespace(max_tree_nodes=3, max_tree_leaves=1)
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, 0, 1, 0, 2]))  # 5 -> 6 -> 7, 5 -> 8
    cut = limit_nodes(tree, target.max_tree_nodes, target.max_tree_leaves)
    assert cut.token_ids.tolist() == [5, 6, 7] and cut.parents.tolist() == [-1, 0, 1]
    wide = DraftTree(torch.tensor([5, 6, 8, 7]), torch.tensor([-1, 0, 0, 1]))  # breadth first
    assert limit_nodes(wide, 3, 1).token_ids.tolist() == [5, 6]


def test_a_prompt_after_a_generation_gets_the_bits_of_a_fresh_prefill(k_quant_target, prompts) -> None:
    """Bug: set_context kept the start a new prompt shares with the held context and decoded the
    rest alone, which on kernels that change with the batch size gives other bits than a fresh
    prefill: the same prompt sent twice (a chat's next turn, an OpenAI client) got other logits."""
    target = k_quant_target
    prompt = prompts["mt_bench"][:120]
    tokens, logits = plain_decode(target, prompt, 4)  # a fresh prefill, then 4 tokens held
    assert np.array_equal(target.set_context(torch.tensor(prompt)).logits[0], logits[0])
    longer = prompt + tokens
    target.reset()
    fresh = target.set_context(torch.tensor(longer)).logits[0]
    plain_decode(target, prompt, 6)  # held: the longer prompt and two tokens more
    assert np.array_equal(target.set_context(torch.tensor(longer)).logits[0], fresh)


def test_a_session_of_a_target_that_keeps_final_hidden_states_keeps_them_through_exact_batches(
    k_quant_target, prompts
) -> None:
    """new_session carries keep_final_hidden (a drafter built in the background reads every
    verified token's final hidden state when it joins) as it carries the key/value capture: a
    mutation audit found a session that kept none untested. The session keeps them unasked for a
    prompt, for tokens appended after it (decoded in the short batches one-token decoding agrees
    with here, each batch's rows in place) and for a committed chain, equal to those asked for."""
    target = k_quant_target
    parent = target.new_session()
    parent.keep_final_hidden()
    kept, asked = parent.new_session(), target.new_session()
    last = (target.num_layers,)
    prompt = torch.tensor(prompts["humaneval"][:60])
    n = len(prompt)
    wanted = asked.set_context(prompt, last)
    assert np.array_equal(kept.set_context(prompt).logits, wanted.logits)
    appended = torch.tensor([7, 8, 9, 10, 11, 12, 13])  # more than one batch where chains are short
    kept.prefill(appended)
    more = asked.prefill(appended, last)
    chain = DraftTree.chain([int(more.logits.argmax()), 5, 6][: target.max_tree_nodes])
    kept.verify(chain)
    verified = asked.verify(chain, last)
    path = list(range(chain.num_nodes))
    kept.commit(path)
    asked.commit(path)
    assert kept.num_cached == n + len(appended) + len(path)
    want = torch.cat([wanted.hidden, more.hidden, verified.hidden])
    assert torch.equal(kept.verified_hidden(0, kept.num_cached), want)


@pytest.mark.parametrize(("gguf", "prompt_tokens", "cut"), [
    ("k_quant", 120, 16),  # batches of more than the exact chain round otherwise
    ("q4_1", 340, 50),  # prompt + answer past 384 tokens: prefilled with the prompt context's attention kernel
    ("q4_1", 400, 20),  # a long prompt (moved in from the prompt context) and its answer
])
def test_a_resumed_split_session_continues_with_the_uninterrupted_logits(
    request, prompts, gguf: str, prompt_tokens: int, cut: int
) -> None:
    """Bug: a split session resumed after a cut (an open with root_id) prefilled the prompt and the
    answer so far as one prompt; where batched kernels round otherwise, the generated tokens'
    cells then differed from the uninterrupted session's and so could the tokens after the cut.
    Given the prompt's length, the answer is appended as verification decoded it."""
    from moaspec.config import SamplingConfig
    from moaspec.session import TargetSession

    target = request.getfixturevalue("k_quant_target" if gguf == "k_quant" else "llama_target")
    prompt = prompts["qa"][:prompt_tokens]
    tokens, logits = plain_decode(target, prompt, cut + 8)
    session = TargetSession(target.new_session(), (), SamplingConfig(), 0)
    session.resume(torch.tensor(prompt + tokens[:cut]), len(prompt))
    for k in range(cut, cut + 8):  # logits[k + 1] follow tokens[k]
        out = session.target.verify(DraftTree.root_only(tokens[k]))
        session.target.commit([0])
        assert np.array_equal(out.logits[0], logits[k + 1]), (gguf, k)


def test_long_prompts_of_sliding_window_models_are_prefilled_in_the_verified_context(
    llama_target, prompts, monkeypatch
) -> None:
    """Bug: Gemma-3 (sliding-window layers: llama.cpp keeps a second cache, which its sequence
    state holds too) failed on every prompt of 384 tokens or more, plain decoding included
    ("llama.cpp's sequence state has a layout this version of moaspec does not know"): the prompt
    context's cells could not be moved. Such models prefill long prompts where they verify."""
    target = llama_target.new_session()
    prompt = prompts["qa"][:400]
    monkeypatch.setattr(target.weights, "sliding_window", 512)
    target.set_context(torch.tensor(prompt))
    assert target.num_cached == len(prompt) and target._moved == 0 and target._prompt_ctx is None
    monkeypatch.setattr(target.weights, "sliding_window", 0)
    target.reset()
    target.set_context(torch.tensor(prompt))
    assert target._moved == len(prompt)  # the prompt context's path, as before
