"""bench/lookup_ceiling.py: the oracle's copy lengths and its cheapest schedule of chains."""

from __future__ import annotations

import itertools

import pytest
from conftest import load_bench_script

from moaspec.calibration.costs import CycleCosts
from moaspec.calibration.profile import LookupSequence


def test_longest_copies_follow_earlier_occurrences_of_the_root() -> None:
    script = load_bench_script("lookup_ceiling")
    sequence = LookupSequence([1, 2, 3, 4, 5, 1, 7], [1, 2, 3, 9, 1, 7, 8])
    # root 1 (twice before): after the first, 2 3 right then 4 != 9; root 2: 3 right; root 3: 4 != 9;
    # 9: never seen; root 1 again: the prompt's second 1 gives 7 right, then 1 != 8 (the others: 2 != 7);
    # root 7 (once before, followed by 1): 1 != 8; 8: last token, nothing to predict
    assert script.longest_copies(sequence) == [2, 1, 0, 0, 1, 0, 0]


def test_copies_never_read_tokens_not_yet_verified() -> None:
    script = load_bench_script("lookup_ceiling")
    # a run of 5s: a copy may read up to the root (verified) but never the tokens after it, so
    # the first roots copy 1 and 2 tokens although 4 and 3 would be right; later ones run out of future
    assert script.longest_copies(LookupSequence([5], [5, 5, 5, 5, 5])) == [1, 2, 2, 1, 0]


def brute_force_s(num_tokens: int, longest: list[int], costs: CycleCosts) -> float:
    """Every way of cutting tokens 1..num_tokens-1 into cycles, each within the copy at its root."""
    best = float("inf")
    for cuts in itertools.product((False, True), repeat=max(0, num_tokens - 2)):
        seconds, root, drafted, ok = 0.0, 0, 0, True
        for position, cut in enumerate([*cuts, True], start=1):  # token `position` ends a cycle?
            drafted = position - root - 1
            if cut:
                if drafted > longest[root]:
                    ok = False
                    break
                seconds += costs.tree_s(1 + drafted)
                root = position
        if ok:
            best = min(best, seconds)
    return best


def costs_of(verify_s: dict[int, float], plain_step_s: float | None = None, tree_penalty_s: float = 0.0) -> CycleCosts:
    return CycleCosts(verify_s, {}, (0.0, 0.0), plain_step_s, tree_penalty_s)


@pytest.mark.parametrize("longest", [[2, 0, 0, 0, 0], [0, 3, 1, 0, 2], [4, 4, 4, 4, 4], [0, 0, 0, 0, 0], [1, 0, 1, 0, 0]])
def test_cheapest_schedule_is_the_brute_force_optimum(longest: list[int]) -> None:
    """Without a tree penalty and with one (the plain steps after a chain cost 0.2 more per
    drafted node, as on llama.cpp)."""
    script = load_bench_script("lookup_ceiling")
    concave = {1: 1.0, 2: 1.7, 3: 2.1, 4: 2.4, 5: 3.1}
    for costs in (costs_of(concave), costs_of(concave, tree_penalty_s=0.2)):
        assert script.cheapest_decode_s(5, longest, costs) == pytest.approx(brute_force_s(5, longest, costs))
    linear = costs_of({n: float(n) for n in range(1, 6)})  # a node costs a step: no schedule beats plain decoding
    assert script.cheapest_decode_s(5, longest, linear) == pytest.approx(4.0)


def test_a_chain_pays_only_with_its_penalty_on_the_plain_steps_after_it_counted() -> None:
    """Tokens 1-3 with a 1-token copy at root 1: the 2-node chain (1.7) beats two plain steps
    (2.0) without a penalty, not with one of 0.5 per drafted node; a plain step among many costs
    0.8 where it is measured apart from the one-node forward among trees (1.0)."""
    script = load_bench_script("lookup_ceiling")
    longest = [0, 1, 0, 0]
    assert script.cheapest_decode_s(4, longest, costs_of({1: 1.0, 2: 1.7})) == pytest.approx(1.0 + 1.7)
    assert script.cheapest_decode_s(4, longest, costs_of({1: 1.0, 2: 1.7}, tree_penalty_s=0.5)) == pytest.approx(3.0)
    assert script.cheapest_decode_s(4, longest, costs_of({1: 1.0, 2: 1.7}, plain_step_s=0.8)) == pytest.approx(2.4)
