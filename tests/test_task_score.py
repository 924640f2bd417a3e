"""Token F1 as ChatRAG-Bench scores conversational QA (moaspec/bench/task_score.py)."""

from __future__ import annotations

import pytest

from moaspec.bench.task_score import normalized_words, token_f1


def test_normalization_drops_case_punctuation_and_articles() -> None:
    assert normalized_words("The Cat, sat on a mat!  An apple.") == ["cat", "sat", "on", "mat", "apple"]


@pytest.mark.parametrize(
    "answer, references, expected",
    [
        ("The cat sat.", ["the cat sat"], 1.0),
        ("cat sat mat", ["cat sat"], 0.8),  # precision 2/3, recall 1
        ("cat", ["cat sat on mat"], 0.4),  # precision 1, recall 1/4
        ("dog", ["cat"], 0.0),
        ("cat cat", ["cat"], pytest.approx(2 / 3)),  # a repeated word counts once per reference word
        ("cat sat", ["dog", "cat sat on"], 0.8),  # the best reference counts
        ("anything", [], 0.0),
        ("", ["cat"], 0.0),
    ],
)
def test_token_f1(answer: str, references: list[str], expected: float) -> None:
    assert token_f1(answer, references) == expected
