"""Reduced draft vocabulary: the N most frequent target tokens of the training data.

On this CPU the full LM head (576 x 49,152 for SmolLM2) costs 12-19 ms per call, a quarter of a
target decode step, and a tree drafter calls it once per level. Scoring only the frequent tokens
cuts that cost by V / N. Losslessness is unaffected: the verifier uses the target's full
distribution, and a token outside the draft vocabulary simply has draft probability zero.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch


def most_frequent_token_ids(
    sequences: Iterable[Sequence[int]], size: int, always_include: Iterable[int] = ()
) -> torch.Tensor:
    """The `size` most frequent ids over `sequences` (ties: lower id first), plus `always_include`
    (e.g. the stop tokens). -> sorted long tensor [<= size]."""
    if size < 1:
        raise ValueError(f"draft vocabulary size must be >= 1, got {size}")
    counts: Counter[int] = Counter()
    for sequence in sequences:
        counts.update(sequence)
    forced = sorted(set(always_include))
    ranked = sorted((token for token in counts if token not in forced), key=lambda token: (-counts[token], token))
    chosen = forced[:size] + ranked[: max(0, size - len(forced))]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def target_token_ids(rows: int | torch.Tensor, draft_vocab_ids: torch.Tensor | None) -> int | torch.Tensor:
    """Rows of a reduced draft vocabulary (an index or a tensor of them) -> the target's token ids
    at those rows; the rows themselves with the full vocabulary (draft_vocab_ids None)."""
    return rows if draft_vocab_ids is None else draft_vocab_ids[rows]


def coverage(sequences: Iterable[Sequence[int]], draft_vocab_ids: torch.Tensor) -> float:
    """Fraction of token occurrences inside the draft vocabulary (an upper bound on what the
    drafter can ever propose correctly)."""
    vocab = set(draft_vocab_ids.tolist())
    total = inside = 0
    for sequence in sequences:
        total += len(sequence)
        inside += sum(1 for token in sequence if token in vocab)
    return inside / total if total else 0.0
