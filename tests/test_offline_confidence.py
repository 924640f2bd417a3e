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
    [nothing] = script.stopping_table(generations, (0.95,))  # no first token is that sure
    assert (nothing["written"], nothing["agreement"]) == (0, None)  # not shown as 0 % agreement
    assert script.conditional_precision(generations) == {"all": [3, 4], "model": [3, 3], "lookup": [0, 1]}


def test_agreement_at_equal_output_interpolates_over_the_stopping_sweep() -> None:
    """A drafter whose probabilities are on another scale writes another amount at the same P;
    agreeing_at compares drafters at the same total written, and the report ends with that table."""
    script = load_bench_script("offline_confidence")
    confident = [rows((0.9, True), (0.9, True), (0.9, False), (0.9, False))]  # totals 0..4 as P falls
    assert script.agreeing_at(confident, 2) == 2.0
    assert script.agreeing_at(confident, 4) == 2.0
    assert script.agreeing_at(confident, 5) is None
    modest = [rows((0.5, True)), rows((0.4, False))]  # writes 0, 1 (P in (0.4, 0.5]) or 2 tokens
    assert script.agreeing_at(modest, 1) == 1.0
    assert script.agreeing_at(modest, 2) == 1.0
    assert script.agreeing_at([rows((0.5, True), (0.2, True))], 1.5) == 1.5  # between totals 1 and 2

    results = {"command": "c", "drafters": {
        "ngram": {"generations": {"a": confident[0]}, "stopping": script.stopping_table(confident),
                  "conditional_precision": script.conditional_precision(confident)},
        "old": {"generations": {"a": modest[0], "b": modest[1]}, "stopping": script.stopping_table(modest),
                "conditional_precision": [1, 2]},  # the format before sources were recorded
    }}
    lines = script.report(results)
    assert "## old (2 generations; right when the prefix agreed: 1 of 2)" in lines
    table = lines[lines.index("| drafter | 4 written |"):]
    assert table[2:4] == ["| ngram | 2.0 (0.50) |", "| old | – |"]
