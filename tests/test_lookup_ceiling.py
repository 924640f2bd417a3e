"""bench/lookup_ceiling.py: the oracle's copy lengths and its cheapest schedule of chains."""

from __future__ import annotations

import itertools

import pytest
from conftest import load_bench_script

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


def brute_force_s(num_tokens: int, longest: list[int], verify_s) -> float:
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
                seconds += verify_s(1 + drafted)
                root = position
        if ok:
            best = min(best, seconds)
    return best


@pytest.mark.parametrize("longest", [[2, 0, 0, 0, 0], [0, 3, 1, 0, 2], [4, 4, 4, 4, 4], [0, 0, 0, 0, 0]])
def test_cheapest_schedule_is_the_brute_force_optimum(longest: list[int]) -> None:
    script = load_bench_script("lookup_ceiling")
    concave = {1: 1.0, 2: 1.7, 3: 2.1, 4: 2.4, 5: 3.1}.__getitem__
    assert script.cheapest_decode_s(5, longest, concave) == pytest.approx(brute_force_s(5, longest, concave))
    linear = float  # a node costs a step: no schedule beats plain decoding
    assert script.cheapest_decode_s(5, longest, linear) == pytest.approx(4.0)
