"""End-to-end engine: greedy losslessness with scripted drafters, stopping, streaming, stats, and
the distribution of sampled output on a tiny-vocabulary target (float64)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, make_tiny_target
from scipy.stats import chisquare

from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.drafters.base import VerifiedUpdate
from moaspec.drafters.ngram import NgramDrafter
from moaspec.drafters.none import NoDrafter
from moaspec.engine import Engine, GenerationResult
from moaspec.errors import MoaspecError
from moaspec.sampling import target_probs
from moaspec.targets.hf import HFTarget
from moaspec.tree import DraftTree, depths

PROMPT = [5, 17, 33, 2, 71, 5, 17]
NO_STOP: frozenset[int] = frozenset()


class ScriptedDrafter:
    """Knows the target's greedy continuation; proposes `depth` tokens of which the first
    `num_correct` are right (the rest are deliberately wrong). With `siblings`, each level also
    gets wrong siblings placed before the right node, so the accepted path is not node order."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, continuation: list[int], vocab: int, depth: int, num_correct: int, siblings: int = 0) -> None:
        self.continuation, self.vocab = continuation, vocab
        self.depth, self.num_correct, self.siblings = depth, num_correct, siblings

    def reset(self) -> None:
        self.num_verified = 0

    def accept(self, update: VerifiedUpdate) -> None:
        self.num_verified += len(update.token_ids)

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree:
        start = self.num_verified - len(PROMPT) + 1  # index in the continuation of the first draft
        token_ids, parents, node = [root_id], [-1], 0
        for d in range(self.depth):
            if start + d >= len(self.continuation):
                break
            right = self.continuation[start + d]
            token = right if d < self.num_correct else (right + 1) % self.vocab
            for s in range(self.siblings):
                token_ids.append((right + 2 + s) % self.vocab)
                parents.append(node)
            token_ids.append(token)
            parents.append(node)
            node = len(token_ids) - 1
        return DraftTree(torch.tensor(token_ids), torch.tensor(parents))


def greedy_reference(target: HFTarget, max_new: int) -> list[int]:
    """Target-only greedy decoding with transformers' own generate()."""
    out = target.model.generate(
        torch.tensor([PROMPT]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "depth, num_correct, siblings",
    [(4, 4, 0), (4, 0, 0), (5, 2, 0), (6, 3, 0), (3, 3, 2), (4, 1, 2), (1, 1, 0)],
    ids=["all", "none", "j=2", "j=3", "tree-all", "tree-j=1", "depth1"],
)
def test_greedy_output_identical_to_target_alone(family: str, depth: int, num_correct: int, siblings: int) -> None:
    target = make_tiny_target(family)
    expected = greedy_reference(target, 40)
    drafter = ScriptedDrafter(expected, target.vocab_size, depth, num_correct, siblings)
    result = Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=40), stop_ids=NO_STOP)
    assert result.token_ids == expected
    stats = result.stats
    assert stats.new_tokens == 40
    accepted = min(num_correct, depth)
    # every tree deep enough accepts exactly `accepted` drafts (trees near the end of the budget
    # are pruned shorter), never more
    reached = stats.reached_depth + [0] * depth
    accepted_counts = stats.accepted_depth + [0] * depth
    for d in range(depth):
        assert accepted_counts[d] == (reached[d] if d < accepted else 0)
    if accepted == depth:
        assert stats.target_forwards < 40 / (accepted + 1) + 3
    else:
        assert stats.target_forwards >= 40 / (accepted + 1)


def test_the_drafter_reads_the_hidden_states_of_the_accepted_path() -> None:
    """With wrong siblings before each right node the accepted path is not nodes 0..k: the hidden
    states a drafter is handed must be those of the path's nodes, equal to a plain forward over
    the verified tokens (EAGLE-2 and MoA's hidden-state memory read them)."""
    target = make_tiny_target("llama")
    expected = greedy_reference(target, 20)

    class Recording(ScriptedDrafter):
        hidden_layers = (1, 2)

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.updates: list[VerifiedUpdate] = []

        def accept(self, update: VerifiedUpdate) -> None:
            super().accept(update)
            self.updates.append(update)

    drafter = Recording(expected, target.vocab_size, depth=3, num_correct=3, siblings=2)
    Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=20), stop_ids=NO_STOP)
    verified = np.concatenate([update.token_ids for update in drafter.updates])
    handed = torch.cat([update.hidden for update in drafter.updates])
    assert verified.tolist() == PROMPT + expected[: len(verified) - len(PROMPT)]
    plain = target.set_context(verified, drafter.hidden_layers).hidden
    # eager attention takes its softmax in float32: ~5e-7 apart here; another node's state is O(1) apart
    torch.testing.assert_close(handed, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_with_ngram_and_none(family: str) -> None:
    target = make_tiny_target(family)
    expected = greedy_reference(target, 60)
    for drafter in (NoDrafter(), NgramDrafter()):
        result = Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=60), stop_ids=NO_STOP)
        assert result.token_ids == expected
    none_stats = Engine(target, NoDrafter()).generate(PROMPT, generation=GenerationConfig(max_new_tokens=60), stop_ids=NO_STOP).stats
    assert none_stats.tau == 1.0 and none_stats.target_forwards == 60


def test_stop_token_ends_generation_and_is_kept() -> None:
    """...and the target holds what plain decoding would (the prompt and every emitted token but
    the last), though the accepted path ran past the stop token: before, the next generation on
    it (a chat's next turn) started from another context than plain decoding's."""
    target = make_tiny_target("llama")
    expected = greedy_reference(target, 30)
    stop = expected[9]
    first = expected.index(stop)
    drafter = ScriptedDrafter(expected, target.vocab_size, 5, 5)
    result = Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=30), stop_ids=frozenset({stop}))
    assert result.token_ids == expected[: first + 1]
    assert result.stop_reason == "stop_token"
    assert target.num_cached == len(PROMPT) + first
    earlier = GenerationResult(token_ids=[1, 2, 3])  # a caller's result holding earlier tokens
    drafter = ScriptedDrafter(expected, target.vocab_size, 5, 5)
    for _ in Engine(target, drafter).stream(PROMPT, generation=GenerationConfig(max_new_tokens=30),
                                            stop_ids=frozenset({stop}), result=earlier):
        pass
    assert earlier.token_ids[3:] == expected[: first + 1] and target.num_cached == len(PROMPT) + first


def test_max_new_tokens_truncates_mid_verification_and_streams_everything() -> None:
    target = make_tiny_target("llama")
    expected = greedy_reference(target, 13)
    drafter = ScriptedDrafter(expected + [0] * 10, target.vocab_size, 5, 5)
    engine = Engine(target, drafter)
    chunks = list(engine.stream(PROMPT, generation=GenerationConfig(max_new_tokens=13), stop_ids=NO_STOP))
    assert [t for chunk in chunks for t in chunk] == expected
    assert len(chunks) < 13  # several tokens per step
    assert target.num_cached == len(PROMPT) + 13 - 1  # as plain decoding leaves it
    earlier = GenerationResult(token_ids=[1, 2, 3])  # a caller's result: its tokens are not this generation's
    drafter = ScriptedDrafter(expected + [0] * 10, target.vocab_size, 5, 5)
    generation = GenerationConfig(max_new_tokens=13)
    for _ in Engine(target, drafter).stream(PROMPT, generation=generation, stop_ids=NO_STOP, result=earlier):
        pass
    assert earlier.token_ids == [1, 2, 3, *expected] and earlier.stop_reason == "length"
    assert target.num_cached == len(PROMPT) + 13 - 1


def test_a_reused_result_adds_up_its_stats_wall_time_included() -> None:
    """Bug: with one result reused across generations, new tokens and the prefill, draft and
    verify seconds added up but the wall time restarted at each, so tokens/s grew with every
    generation and the time split exceeded the wall time."""
    target = make_tiny_target("llama")
    expected = greedy_reference(target, 12)
    result = GenerationResult()
    for _ in range(3):
        drafter = ScriptedDrafter(expected, target.vocab_size, 3, 3)
        for _ in Engine(target, drafter).stream(PROMPT, generation=GenerationConfig(max_new_tokens=12), stop_ids=NO_STOP,
                                                result=result):
            pass
    stats = result.stats
    assert result.token_ids == expected * 3 and stats.new_tokens == 36
    assert stats.prefill_s + stats.draft_s + stats.verify_s <= stats.wall_s


def test_context_limit_stops_generation_cleanly() -> None:
    target = make_tiny_target("llama", max_position_embeddings=12)
    result = Engine(target, NgramDrafter()).generate(PROMPT, generation=GenerationConfig(max_new_tokens=50), stop_ids=NO_STOP)
    assert len(result.token_ids) == 12 - len(PROMPT)
    assert result.stop_reason == "context"
    with pytest.raises(MoaspecError, match="holds 12, the answer's first token included: at most 11"):
        Engine(target, NoDrafter()).generate(list(range(12)))
    with pytest.raises(MoaspecError):
        Engine(target, NoDrafter()).generate([])
    # a budget that fills the context exactly ends for its length (a mutation audit, session 50)
    room = 12 - len(PROMPT)
    for max_new, reason in ((room, "length"), (room - 1, "length"), (room + 1, "context")):
        result = Engine(target, NoDrafter()).generate(PROMPT, generation=GenerationConfig(max_new_tokens=max_new), stop_ids=NO_STOP)
        assert (len(result.token_ids), result.stop_reason) == (min(max_new, room), reason), max_new


def test_sampling_is_reproducible_and_seed_dependent() -> None:
    target = make_tiny_target("llama")
    sampling = SamplingConfig(temperature=1.0)
    runs = [
        Engine(target, NgramDrafter()).generate(PROMPT, sampling, GenerationConfig(max_new_tokens=30, seed=seed), NO_STOP).token_ids
        for seed in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


class SampledTreeDrafter:
    """Draws two siblings without replacement from a fixed q at the root, and one child under
    the first, storing the exact conditional distributions (lossless stochastic contract)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q

    def reset(self) -> None:
        pass

    def accept(self, update: VerifiedUpdate) -> None:
        pass

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree:
        first = int(torch.multinomial(self.q, 1, generator=generator))
        q_rest = self.q.clone()
        q_rest[first] = 0
        q_rest /= q_rest.sum()
        second = int(torch.multinomial(q_rest, 1, generator=generator))
        child = int(torch.multinomial(self.q, 1, generator=generator))
        probs = torch.stack([self.q, self.q, q_rest, self.q])
        return DraftTree(torch.tensor([root_id, first, second, child]), torch.tensor([-1, 0, 0, 1]), probs)



def test_sampled_drafts_are_reproducible_per_seed_on_one_engine() -> None:
    """A mutation audit (session 50): the test above drafts by prompt lookup, which draws nothing,
    so an engine reusing its drafter's generator across generations passed it. With a drafter that
    samples its trees, the same seed gives the same tokens on one engine, run after run."""
    target = make_tiny_target("llama")
    q = torch.full((target.vocab_size,), 1.0 / target.vocab_size, dtype=torch.float64)
    engine = Engine(target, SampledTreeDrafter(q))
    sampling = SamplingConfig(temperature=1.0)
    runs = [
        engine.generate(PROMPT, sampling, GenerationConfig(max_new_tokens=30, seed=seed), NO_STOP).token_ids
        for seed in (1, 1, 2, 1)
    ]
    assert runs[0] == runs[1] == runs[3] != runs[2]


def test_the_engine_verifies_no_node_deeper_than_it_may_emit() -> None:
    """A mutation audit (session 50): with one level too many allowed, the output was the same but
    every tree near the end was verified a level deeper than could be emitted (wasted target work,
    depth statistics off); only decode_step was tested for it, not the engine."""
    target = make_tiny_target("llama")
    q = torch.full((target.vocab_size,), 1.0 / target.vocab_size, dtype=torch.float64)
    verify, seen = target.verify, []

    def recording(tree, *args, **kwargs):
        seen.append((target.num_cached, int(depths(tree.parents).max())))
        return verify(tree, *args, **kwargs)

    target.verify = recording
    for max_new in range(1, 7):
        seen.clear()
        engine = Engine(target, SampledTreeDrafter(q))
        engine.generate(PROMPT, SamplingConfig(temperature=1.0), GenerationConfig(max_new_tokens=max_new, seed=3), NO_STOP)
        for cached, depth in seen:  # the root is emitted, not cached: cached - len(PROMPT) + 1 tokens out
            remaining = max_new - (cached - len(PROMPT) + 1)
            assert depth <= remaining - 1, (max_new, cached, depth)
        assert max_new < 4 or any(depth == 2 for _, depth in seen)  # full trees verified while there was room


def exact_joint(target: HFTarget, prompt: list[int], sampling: SamplingConfig, length: int) -> torch.Tensor:
    """P(first `length` new tokens) by enumeration over a tiny vocabulary.  -> [V] * length."""
    vocab = target.vocab_size
    probs_after: dict[tuple[int, ...], torch.Tensor] = {}
    for cut in range(length):
        for prefix in itertools.product(range(vocab), repeat=cut):
            target.reset()
            probs_after[prefix] = target_probs(target.prefill(torch.tensor([*prompt, *prefix])).logits[-1], sampling)
    joint = torch.zeros([vocab] * length, dtype=torch.float64)
    for seq in itertools.product(range(vocab), repeat=length):
        joint[seq] = torch.stack([probs_after[seq[:cut]][seq[cut]] for cut in range(length)]).prod()
    return joint


def far_sampled_drafter(target: HFTarget, later: torch.Tensor) -> SampledTreeDrafter:
    """Peaked on the target's least likely token: it rejects often, so a verifier with a wrong
    residual would visibly distort the output."""
    vocab = later.shape[0]
    q = torch.full((vocab,), 0.1 / (vocab - 1), dtype=torch.float64)
    q[int(later.sum(1).argmin())] = 0.9
    return SampledTreeDrafter(q)


def random_model_drafter(method: str, target: HFTarget):
    """An untrained MoA or EAGLE drafter: deterministic dynamic trees, or with "moa-sampled" a
    tree drawn from the drafter over a reduced vocabulary, with its probabilities; "+lookup"
    adds prompt lookup (its continuations when the context has a match, else the model's tree)."""
    from conftest import make_random_drafter_net

    from moaspec.config import TreeConfig
    from moaspec.drafters.eagle import EagleDrafter
    from moaspec.drafters.moa import MoADrafter
    from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    if method.endswith("+lookup"):
        drafter = random_model_drafter(method.removesuffix("+lookup"), target)
        drafter.enable_lookup()
        return drafter
    tree = TreeConfig(depth=3, top_k=2, budget=5)
    if method == "moa-sampled":
        config = MoAConfig.for_target(target.config, draft_vocab_size=4)
        net = make_random_drafter_net(MoADrafterNet, config, target, torch.tensor([0, 1, 3, 4]))
        return MoADrafter(net, target, TreeConfig(depth=2, top_k=2, sampled=True))
    if method == "moa":
        net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config, tli_layers=1), target)
        return MoADrafter(net, target, tree)
    net = make_random_drafter_net(EagleDrafterNet, EagleConfig.for_target(target.config), target)
    return EagleDrafter(net, target, tree)


FILTERED = SamplingConfig(temperature=0.6, top_k=4)  # both act on the target's and the drafter's laws


@pytest.mark.statistical
@pytest.mark.parametrize(
    "drafter_kind, sampling",
    [
        ("sampled-tree", SamplingConfig(temperature=1.0)), ("moa", SamplingConfig(temperature=1.0)),
        ("eagle", SamplingConfig(temperature=1.0)), ("moa-sampled", SamplingConfig(temperature=1.0)),
        ("moa-sampled+lookup", SamplingConfig(temperature=1.0)),
        ("sampled-tree", FILTERED), ("moa-sampled", FILTERED), ("eagle", SamplingConfig(temperature=1.3, top_p=0.8)),
    ],
)
def test_sampled_joint_of_first_verified_tokens_matches_target(drafter_kind: str, sampling: SamplingConfig) -> None:
    """Token 1 comes from the prefill, tokens 2 and 3 are the first ones a verification emits;
    their laws must be the target's, with a sampled-tree drafter (draft_probs), with the MoA
    (TLI 1) and EAGLE drafters (deterministic trees), and with prompt lookup beside a sampled tree
    (lookup tries where the context repeats, sampled trees elsewhere), at temperature 1 and with
    another temperature, top-k or top-p. A broken residual fails this test (checked by hand:
    monkeypatching `moaspec.verify._residual` to return p unchanged gave a joint p-value of 1e-8
    with the sampled-tree drafter); so did the temperature applied twice to the verified logits,
    or not at all to the prefill's token, both unseen at temperature 1 alone."""
    vocab = 5
    target = make_tiny_target("llama", vocab_size=vocab)
    with torch.no_grad():
        target.model.lm_head.weight.mul_(0.3)  # soften: a spread-out but uneven distribution
    prompt = [1, 4, 2]
    exact = exact_joint(target, prompt, sampling, 3)
    assert abs(float(exact.sum()) - 1.0) < 1e-12
    later = exact.sum(0)  # [V, V]: law of (token 2, token 3)

    drafter = far_sampled_drafter(target, later) if drafter_kind == "sampled-tree" else random_model_drafter(drafter_kind, target)
    trees = []
    propose = drafter.propose
    drafter.propose = lambda *args: trees.append(propose(*args)) or trees[-1]
    counts, first_counts = torch.zeros(vocab, vocab), torch.zeros(vocab)
    engine = Engine(target, drafter)
    num_samples = 1200
    for seed in range(num_samples):
        tokens = engine.generate(prompt, sampling, GenerationConfig(max_new_tokens=3, seed=seed), NO_STOP).token_ids
        counts[tokens[1], tokens[2]] += 1
        first_counts[tokens[0]] += 1
    if drafter_kind.startswith("moa-sampled"):  # sampling drew sampled trees, with their laws
        assert any(tree.draft_probs is not None for tree in trees)
    assert_drawn_from(counts.flatten(), later.flatten())  # tokens 2 and 3
    assert_drawn_from(counts.sum(1), later.sum(1))  # token 2
    assert_drawn_from(first_counts, exact.sum((1, 2)))  # token 1


def assert_drawn_from(counts: torch.Tensor, law: torch.Tensor) -> None:
    """Chi-square of `counts` [n] against the law [n] (p > 1e-4); cells the law gives no mass
    (top-k, top-p) must stay empty, and cells expecting under 5 draws are pooled."""
    expected = law * counts.sum()
    impossible = expected == 0
    assert counts[impossible].sum() == 0
    keep = expected > 5
    pooled = ~keep & ~impossible
    observed, predicted = counts[keep], expected[keep]
    if pooled.any():
        observed = torch.cat([observed, counts[pooled].sum().view(1)])
        predicted = torch.cat([predicted, expected[pooled].sum().view(1)])
    assert chisquare(observed.numpy(), predicted.numpy()).pvalue > 1e-4


def record_model_proposals(drafter) -> list[int]:
    """The roots of the proposals the drafter's model makes from now on (its `start` calls)."""
    roots: list[int] = []
    model_start = drafter.start
    drafter.start = lambda root_id: roots.append(root_id) or model_start(root_id)
    return roots


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_greedy_with_prompt_lookup_beside_model_trees(method: str) -> None:
    """`moa+ngram` / `eagle+ngram`: lookup tries and model trees alternate, and the model's caches
    catch up on the tokens verified while it did not draft."""
    target = make_tiny_target("llama")
    expected = greedy_reference(target, 60)
    runs, model_runs = {}, []
    for kind in (method, f"{method}+lookup"):
        drafter = random_model_drafter(kind, target)
        if kind.endswith("+lookup"):
            model_runs = record_model_proposals(drafter)
        engine = Engine(target, drafter)
        runs[kind] = engine.generate(PROMPT, generation=GenerationConfig(max_new_tokens=60), stop_ids=NO_STOP)
        assert runs[kind].token_ids == expected
    # the output repeats itself: once it does, the lookup's tries replace the model's trees, and
    # they are accepted
    hybrid, plain = runs[f"{method}+lookup"].stats, runs[method].stats
    assert 0 < len(model_runs) < hybrid.num_verifications
    assert hybrid.target_forwards < plain.target_forwards


def test_prompt_lookup_first_then_the_model_and_restarts_with_the_drafter() -> None:
    """A context with a repeated n-gram gets the n-gram drafter's trie, without running the model;
    after a reset the lookup forgets that context: with no repeated n-gram the proposal is the
    model's tree, as without lookup."""
    from moaspec.drafters.ngram import NgramDrafter

    target = make_tiny_target("llama")
    hybrid, plain = random_model_drafter("moa+lookup", target), random_model_drafter("moa", target)
    hybrid.net.load_state_dict(plain.net.state_dict())
    first = [1, 2, 3, 4, 1, 2]
    target.prefill(torch.tensor(first))
    hybrid.accept(VerifiedUpdate(torch.tensor(first), 0, None, target))
    lookup = NgramDrafter()
    lookup.accept_context(torch.tensor(first), 0, {})
    model_runs = record_model_proposals(hybrid)
    tree = hybrid.propose(3, SamplingConfig(), torch.Generator())
    expected = lookup.propose(3, SamplingConfig(), torch.Generator())
    assert tree.token_ids.tolist() == [3, 4, 1, 2, 3] == expected.token_ids.tolist()  # (2, 3) -> 4, 1, 2, 3
    assert np.array_equal(tree.parents, expected.parents) and tree.draft_probs is None and model_runs == []
    second = [9, 8, 2]
    for drafter in (hybrid, plain):
        target.reset()
        target.prefill(torch.tensor(second))
        drafter.reset()
        drafter.accept(VerifiedUpdate(torch.tensor(second), 0, None, target))
    trees = [drafter.propose(3, SamplingConfig(), torch.Generator()) for drafter in (hybrid, plain)]
    assert model_runs == [3]
    assert np.array_equal(trees[0].token_ids, trees[1].token_ids) and np.array_equal(trees[0].parents, trees[1].parents)


class FaultyDrafter(NoDrafter):
    """Proposes `root + shift` as the root, or a drafted token outside the vocabulary."""

    def __init__(self, shift: int = 0, token: int | None = None) -> None:
        self.shift, self.token = shift, token

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree:
        tokens = [root_id + self.shift] + ([] if self.token is None else [self.token])
        return DraftTree(torch.tensor(tokens), torch.tensor(list(range(-1, len(tokens) - 1))))


@pytest.mark.parametrize(
    "drafter, message",
    [(FaultyDrafter(shift=1), "starts at token"), (FaultyDrafter(token=10**6), "outside the target's vocabulary"),
     (FaultyDrafter(token=TINY_VOCAB), "outside the target's vocabulary"), (FaultyDrafter(token=-1), "outside")],
)
def test_a_drafter_cannot_change_what_is_emitted(drafter: FaultyDrafter, message: str) -> None:
    """A tree whose root is not the last emitted token would emit tokens the target never chose
    (greedy output silently differed from plain decoding); an out-of-vocabulary token failed deep
    in the runtime. Both are refused, naming the drafter's fault."""
    target = make_tiny_target("llama")
    with pytest.raises(MoaspecError, match=message):
        Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=4), stop_ids=NO_STOP)


def test_the_end_rule_stops_at_the_first_stop_token_within_the_limit() -> None:
    """decode_step.last_emitted: one rule for the engine, the split client and the split server."""
    from moaspec.decode_step import last_emitted

    stop = frozenset({0})
    assert last_emitted([5, 6, 7], 4, stop) is None  # room left, no stop token
    assert last_emitted([5, 6, 7], 3, stop) == 2  # the limit's token
    assert last_emitted([5, 6, 7], 2, stop) == 1
    assert last_emitted([5, 0, 7], 4, stop) == 1  # the stop token
    assert last_emitted([5, 6, 0], 2, stop) == 1  # a stop token past the limit is not emitted
    assert last_emitted([5, 0], 2, stop) == 1
    assert last_emitted([], 1, stop) is None
    with pytest.raises(ValueError):
        last_emitted([5], 0, stop)


def test_spec_stats_follow_the_documented_conventions() -> None:
    """metrics.py: acceptance at depth d counts only verifications whose tree reached depth d;
    drafted nodes leave the root out; prefill, draft, verify and other add up to the wall time."""
    from moaspec.metrics import SpecStats

    stats = SpecStats()
    stats.record_prefill(1.0)
    stats.record_verification(tree_depth=3, num_nodes=4, num_accepted=2)
    stats.record_verification(tree_depth=1, num_nodes=2, num_accepted=1)
    stats.record_verification(tree_depth=2, num_nodes=3, num_accepted=0)
    assert stats.reached_depth == [3, 2, 1] and stats.accepted_depth == [2, 1]
    assert stats.acceptance_per_depth == pytest.approx([2 / 3, 1 / 2, 0.0])
    assert stats.drafted_nodes == 3 + 1 + 2 and stats.to_dict()["mean_drafted_nodes"] == pytest.approx(2.0)
    assert stats.tau == pytest.approx((1 + 3 + 2 + 1) / 4)
    stats.draft_s, stats.verify_s, stats.wall_s = 0.5, 2.0, 4.0
    assert stats.other_s == pytest.approx(0.5)
    assert sum(stats.to_dict()["time_s"].values()) == pytest.approx(stats.wall_s)


def test_a_step_verifies_no_deeper_than_it_may_emit_and_counts_the_hand_over_as_drafting(monkeypatch) -> None:
    """With 3 tokens left to emit, a drafted chain of 5 is verified 2 deep (2 drafts + the next
    token); the drafter taking in the verified tokens (hand_over) counts as drafting time."""
    from types import SimpleNamespace

    import moaspec.decode_step as decode_step_module
    from moaspec.metrics import SpecStats

    clock = {"now": 0.0}
    monkeypatch.setattr(decode_step_module.time, "perf_counter", lambda: clock["now"])

    class ChainDrafter:
        def propose(self, root_id, sampling, generator) -> DraftTree:
            return DraftTree(torch.tensor([root_id, 1, 2, 3, 4, 5]), torch.arange(-1, 5))

    verified: list[DraftTree] = []

    def verify(tree: DraftTree):
        verified.append(tree)
        clock["now"] += 1.0  # the verify
        return SimpleNamespace(path_node_idx=[0, 1], next_token=9, hand_over=lambda: clock.update(now=clock["now"] + 5.0))

    stats = SpecStats()
    step = decode_step_module.decode_step(ChainDrafter(), 7, 3, SamplingConfig(), torch.Generator(), stats, verify)
    assert verified[0].token_ids.tolist() == [7, 1, 2] and step.emitted == [1, 9]
    assert stats.draft_s == pytest.approx(5.0) and stats.verify_s == pytest.approx(1.0)
