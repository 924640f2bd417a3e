"""Reduced draft vocabulary selection."""

from __future__ import annotations

import pytest

from moaspec.drafters.vocab import coverage, most_frequent_token_ids


def test_most_frequent_with_forced_ids_and_ties() -> None:
    sequences = [[5, 5, 5, 7, 7, 9], [7, 3, 3, 11]]
    assert most_frequent_token_ids(sequences, 2).tolist() == [5, 7]  # 5 and 7 both thrice: returned in id order
    assert most_frequent_token_ids(sequences, 1).tolist() == [5]  # ... and the tie goes to the lower id
    assert most_frequent_token_ids(sequences, 3).tolist() == [3, 5, 7]
    assert most_frequent_token_ids(sequences, 3, always_include=[2]).tolist() == [2, 5, 7]
    assert most_frequent_token_ids(sequences, 10).tolist() == [3, 5, 7, 9, 11]
    with pytest.raises(ValueError):
        most_frequent_token_ids(sequences, 0)


def test_coverage_counts_occurrences() -> None:
    sequences = [[1, 1, 2], [3]]
    ids = most_frequent_token_ids(sequences, 1)
    assert ids.tolist() == [1]
    assert coverage(sequences, ids) == pytest.approx(0.5)
