"""The prompt lookup's gate (drafters/lookup_gate.py): verify matches only while they pay, score
them in the shadow otherwise, and never change the output."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from moaspec.config import GenerationConfig, NgramConfig
from moaspec.drafters.lookup_gate import LookupGate
from moaspec.drafters.ngram import NgramDrafter
from moaspec.drafters.none import NoDrafter
from moaspec.engine import Engine

# llama.cpp on 2 cores (AVX2 EPYC): a trie of n nodes costs these plain steps beyond one
STEEP = (0.0, 0.0, 0.84, 1.46, 1.92, 2.41, 2.67, 3.1, 3.53)


def proposes(drafter: NgramDrafter, root: int) -> int:
    """Nodes of the drafter's proposal at `root`, which is then verified alone (a plain step)."""
    num_nodes = drafter.propose(root, None, torch.Generator()).num_nodes
    drafter.extend([root])
    return num_nodes


def test_the_mean_gain_decides_and_a_new_generation_starts_closed() -> None:
    gate = LookupGate(STEEP, decay=0.5)
    assert not gate.is_open  # evidence first
    gate.record(accepted=0, num_nodes=2)  # 0 - 0.84
    assert not gate.is_open and gate.score == pytest.approx(-0.42)
    gate.record(accepted=3, num_nodes=4)  # 3 - 1.92: 0.5 * -0.42 + 0.5 * 1.08
    assert gate.is_open and gate.score == pytest.approx(0.33)
    gate.record(accepted=1, num_nodes=40)  # larger tries cost the last entry
    assert gate.score == pytest.approx(0.5 * 0.33 + 0.5 * (1 - 3.53))
    gate.reset()
    assert not gate.is_open and gate.score == 0.0
    costs = {1: 10.0, 2: 18.0, 3: 25.0}
    assert LookupGate.from_cycle_costs(costs.__getitem__, 3).extra_cost == pytest.approx((0.0, 0.0, 0.8, 1.5))


def test_matches_are_verified_while_they_pay_and_scored_in_the_shadow_otherwise() -> None:
    """The history holds 1 2 3 4 5 6 7 and 11 12 13 14 15 16 17: after 11 12 13 the lookup
    proposes 14 15 16 17 (5 nodes: 2.41 extra steps). Closed at first, the match goes as the root
    alone and is scored in the shadow against the target's next tokens: right (4 drafts), which
    opens the gate. Verified and wrong the next time, it closes it again; then a wrong shadow
    match (11 12 13 is now followed by 13 90) and two right ones (1 2 3 -> 4 5 6 7) reopen it."""
    drafter = NgramDrafter(NgramConfig(min_ngram=3, max_ngram=3, max_depth=4, max_branches=1), LookupGate(STEEP, 0.5))
    drafter.extend([1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18, 11, 12])
    expected = 0.0

    def written_in_the_shadow(root: int, following: tuple[int, ...], drafts: int) -> None:
        """The target writes root + following one plain step at a time: the shadow match at
        `root` waits for its end, then scores `drafts` right drafts."""
        nonlocal expected
        for token in (root, *following[:-1]):
            assert proposes(drafter, token) == 1 and not drafter.gate.is_open
        drafter.extend([following[-1]])
        expected = 0.5 * expected + 0.5 * (drafts - 2.41)
        assert drafter.gate.score == pytest.approx(expected)

    written_in_the_shadow(13, (14, 15, 16, 17), drafts=4)
    assert drafter.gate.is_open
    drafter.extend([18, 11, 12])
    assert proposes(drafter, 13) == 5  # open: verified, root + 14 15 16 17; the target wrote 13 alone
    expected = 0.5 * expected + 0.5 * (0 - 2.41)
    assert not drafter.gate.is_open and drafter.gate.score == pytest.approx(expected)
    drafter.extend([90, 11, 12])
    written_in_the_shadow(13, (91,), drafts=0)  # the lookup said 90 11 12 13
    for _ in range(2):
        drafter.extend([1, 2])
        written_in_the_shadow(3, (4, 5, 6, 7), drafts=4)
    assert drafter.gate.is_open
    drafter.extend([1, 2])
    assert proposes(drafter, 3) == 5
    drafter.reset()
    assert not drafter.gate.is_open and drafter.history == []


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_output_is_plain_decodings_with_the_gate(family: str) -> None:
    """The gate changes what is proposed, never what is emitted: greedy tokens equal plain
    decoding's, and the gate both verified and held back matches (not vacuous)."""
    target = make_tiny_target(family, max_position_embeddings=512)
    generation = GenerationConfig(max_new_tokens=150)
    for prompt in ([3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59]):
        plain = Engine(target, NoDrafter.for_target(target)).generate(prompt, generation=generation)
        drafter = NgramDrafter(NgramConfig(max_depth=4, max_branches=1), LookupGate((0.0, 0.0, 0.5, 1.0, 1.5, 2.0)))
        closed = []
        original = drafter.propose_nodes

        def spy(root: int, original=original):
            nodes = original(root)
            closed.append(not drafter.gate.is_open)
            return nodes

        drafter.propose_nodes = spy
        gated = Engine(target, drafter).generate(prompt, generation=generation)
        assert gated.token_ids == plain.token_ids
        assert gated.stats.drafted_nodes > 0 and any(closed)
