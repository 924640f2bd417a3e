"""bench/offline_confidence.py: what `--offline-min-prob P` would write, computed as the split
client stops (product of reported probabilities), and agreement counted from the first token,
in all and by the tokens' source."""

from __future__ import annotations

from conftest import load_bench_script


def rows(*pairs, source: str = "model"):
    return [{"token": i, "probability": p, "right": right, "source": source} for i, (p, right) in enumerate(pairs)]


def test_stopping_follows_the_product_and_agreement_counts_from_the_first() -> None:
    script = load_bench_script("offline_confidence")
    generations = [
        rows((0.9, True), (0.8, True), (0.5, True)),  # products 0.9, 0.72, 0.36
        rows((0.6, False), (0.99, True), source="lookup"),  # wrong first: nothing after it agrees
    ]
    table = {row["min_prob"]: row for row in script.stopping_table(generations)}
    assert (table[0.0]["written"], table[0.0]["agreeing"]) == (5, 3)
    assert (table[0.5]["written"], table[0.5]["agreeing"]) == (4, 2)  # 0.36 stops the first; the second writes 2
    assert (table[0.7]["written"], table[0.7]["agreeing"], table[0.7]["agreement"]) == (2, 2, 1.0)
    assert (table[0.9]["written"], table[0.9]["agreeing"]) == (1, 1)
    assert script.conditional_precision(generations) == {"all": [3, 4], "model": [3, 3], "lookup": [0, 1]}
