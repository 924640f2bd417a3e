"""bench/paired_tau.py: the paired bootstrap of τ differences between methods of one bench run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import load_bench_script


def bench_runs(method: str, taus: list[float], forwards: list[int]) -> list[dict]:
    return [{"category": "mt_bench", "prompt_id": str(i), "turn": 1, "method": method, "tau": tau, "target_forwards": f}
            for i, (tau, f) in enumerate(zip(taus, forwards))]


def test_pairs_generations_and_reports_the_difference(tmp_path, capsys) -> None:
    script = load_bench_script("paired_tau")
    forwards = [10, 100, 10, 100]  # uneven, so a mean of τs differs from the weighted τ
    base = bench_runs("a", [2.0, 1.5, 2.5, 1.8], forwards)
    better = bench_runs("b", [2.2, 1.6, 2.6, 1.9], forwards)
    rows_a, rows_b = script.per_generation(base + better, "a"), script.per_generation(base + better, "b")
    assert rows_a[("mt_bench", "0", 1)] == (20.0, 10)

    same = script.paired_differences(rows_a, rows_a, rounds=200)
    assert np.all(same == 0)
    diffs = script.paired_differences(rows_a, rows_b, rounds=2000)
    assert np.all(diffs > 0)  # b leads on every generation, so on every resample
    # every round, recomputed one generation at a time: τ is accepted tokens over target forwards
    # (weighted by each generation's forwards, not a mean of τs), both methods on the same picks
    # (paired). An audit's: the mean within 0.02 let an unweighted mean pass.
    picks = np.random.default_rng(0).integers(0, len(forwards), size=(2000, len(forwards)))

    def tau(taus: list[float], pick: np.ndarray) -> float:
        return sum(taus[i] * forwards[i] for i in pick) / sum(forwards[i] for i in pick)

    expected = [tau([2.2, 1.6, 2.6, 1.9], pick) - tau([2.0, 1.5, 2.5, 1.8], pick) for pick in picks]
    np.testing.assert_allclose(diffs, expected, rtol=0, atol=1e-12)

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": base + better}))
    assert script.main([str(results), "a", "b", "--rounds", "500"]) == 0
    assert "positive in 100% of 500 rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no runs of method 'c'"):
        script.main([str(results), "a", "c"])
    # bug (a user's audit): a file that is not a results.json gave a traceback
    from moaspec.errors import MoaspecError

    for text, message in (("", "not a readable JSON file"), ("[1, 2]", "not a `moaspec bench` results.json")):
        results.write_text(text)
        with pytest.raises(MoaspecError, match=message):
            script.main([str(results), "a", "b"])
