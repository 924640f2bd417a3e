"""Task accuracy of a free-text answer: token F1 against reference answers.

The metric ChatRAG-Bench scores its conversational QA sets with (SQuAD-style): lower-case, drop
punctuation and the articles a / an / the, split on whitespace, then the F1 of the two bags of
words; the best over the references counts.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalized_words(text: str) -> list[str]:
    """'The Cat, sat.' -> ['cat', 'sat']."""
    return _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split()


def token_f1(answer: str, references: Sequence[str]) -> float:
    """Best token F1 of `answer` over `references` (0.0 with no reference or no overlap)."""
    words = Counter(normalized_words(answer))
    best = 0.0
    for reference in references:
        expected = Counter(normalized_words(reference))
        common = sum((words & expected).values())
        if common:
            precision, recall = common / sum(words.values()), common / sum(expected.values())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
