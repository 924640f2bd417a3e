"""Paired bootstrap of the τ difference between methods of one `moaspec bench` run.

    .venv/bin/python bench/paired_tau.py RESULTS_JSON BASELINE METHOD [METHOD ...] [--rounds 10000]

τ of a method is its tokens per target forward (the bench's per-run τ × forwards, summed over the
run's generations, over their forwards summed). The
methods of one run decode the same prompts (greedy: the same target text), so each bootstrap
round resamples the generations (category, prompt, turn) once and recomputes every method's τ
on that sample; the difference METHOD - BASELINE is reported as mean ± standard deviation over
the rounds, with the share of rounds in which it is positive.
"""

from __future__ import annotations

import numpy as np

from moaspec.bench.script_args import existing_file, positive_int, read_json, run_script, script_parser
from moaspec.errors import MoaspecError


def per_generation(runs: list[dict], method: str) -> dict[tuple, tuple[int, int]]:
    """{(category, prompt_id, turn): (forward_tokens, target_forwards)} of one method."""
    rows = {
        (r["category"], r["prompt_id"], r["turn"]): (r["tau"] * r["target_forwards"], r["target_forwards"])
        for r in runs if r["method"] == method
    }
    if not rows:
        raise SystemExit(f"paired_tau: no runs of method {method!r}")
    return rows


def paired_differences(baseline: dict, other: dict, rounds: int, seed: int = 0) -> np.ndarray:
    """τ(other) - τ(baseline) on `rounds` bootstrap samples of the generations both decoded."""
    keys = sorted(set(baseline) & set(other))
    base = np.array([baseline[k] for k in keys], dtype=np.float64)  # [G, 2]
    new = np.array([other[k] for k in keys], dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(keys), size=(rounds, len(keys)))
    tau = lambda rows: rows[picks, 0].sum(axis=1) / rows[picks, 1].sum(axis=1)  # noqa: E731
    return tau(new) - tau(base)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("results", type=existing_file, help="a moaspec bench results.json")
    parser.add_argument("baseline")
    parser.add_argument("methods", nargs="+")
    parser.add_argument("--rounds", type=positive_int, default=10000)
    args = parser.parse_args(argv)
    results = read_json(args.results)
    if not isinstance(results, dict) or not isinstance(results.get("runs"), list):
        raise MoaspecError(f"{args.results} is not a `moaspec bench` results.json (no list of runs)")
    runs = results["runs"]
    baseline = per_generation(runs, args.baseline)
    base_tau = sum(n for n, _ in baseline.values()) / sum(f for _, f in baseline.values())
    print(f"{args.baseline}: tau {base_tau:.3f} over {len(baseline)} generations")
    for method in args.methods:
        other = per_generation(runs, method)
        diffs = paired_differences(baseline, other, args.rounds)
        tau = sum(n for n, _ in other.values()) / sum(f for _, f in other.values())
        print(f"{method}: tau {tau:.3f}, minus {args.baseline}: {diffs.mean():+.3f} ± {diffs.std():.3f} "
              f"(positive in {np.mean(diffs > 0):.0%} of {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    run_script(main)
