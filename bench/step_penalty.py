"""What slows a target's plain decoding steps after something else ran in between.

On the llama.cpp runtime the plain steps after a tree cost more than steady ones for ~10 steps
(the calibration's tree penalty, calibration/costs.py). This script tells the candidate causes
apart: each interruption below runs between SETTLED plain steps (timed, after as many untimed)
and SETTLED more (timed) at the same positions (the context rolled back to where the timed steps
before began); its penalty is what those after cost beyond the median step before, in all and at
each position. Interruptions take turns within every round; medians over rounds.

- `tree N`: a binary tree of N nodes verified in the target's context (its nodes rolled back), as
  the engine's gated lookup does between plain steps;
- `tree N elsewhere`: the same tree in a second context on the same weights (the first context's
  cache, graph and cells untouched);
- `plain K elsewhere`: K plain steps in that second context (the same kernels as the timed ones);
- `busy T ms`: a Python loop on one core; `sleep T ms`: both cores idle;
- `write M MB`: a pass over M MB of fresh memory (the caches' contents replaced).

    .venv/bin/python bench/step_penalty.py --out bench/results/step-penalty.json [--rounds 20]

Prints a markdown table: each interruption's own time, its penalty, the penalty per second of
interruption, and the penalty at each of the first steps after it.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from moaspec.bench.script_args import output_file, positive_int, run_script, script_parser

SETTLED = 10  # plain steps timed before and after each interruption
SHOWN_STEPS = 5  # per-position penalties printed


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--runtime", default="llama.cpp", choices=("llama.cpp", "transformers"))
    parser.add_argument("--context", type=positive_int, default=128, help="verified tokens before the steps (default 128)")
    parser.add_argument("--rounds", type=positive_int, default=20, help="rounds of every interruption (default 20)")
    parser.add_argument("--out", type=output_file, default=None, help="write the results here as JSON")
    args = parser.parse_args()

    from moaspec.api import load_target
    from moaspec.bench.output import write_json
    from moaspec.calibration.costs import binary_tree, chain_tree
    from moaspec.calibration.machine import cpu_description, runtime_description

    target = load_target(args.target, runtime=args.runtime)
    other = target.new_session()  # a second context on the same weights
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.vocab_size, (args.context,), generator=generator)
    one = chain_tree(1, target.vocab_size, generator)
    for t in (target, other):
        t.reset()
        t.prefill(context)

    def step(t) -> None:
        t.verify(one)
        t.commit([0])

    def verify_tree(t, tree) -> None:
        length = t.num_cached
        t.verify(tree)
        t.commit([0])
        t.rollback(length)

    def plain_elsewhere(count: int) -> None:
        for _ in range(count):
            step(other)
        other.rollback(args.context)

    def busy(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    memory = np.zeros(64 << 20, dtype=np.uint8)
    trees = {n: binary_tree(n, target.vocab_size, generator) for n in (2, 4, 8)}
    interruptions: dict[str, Callable[[], object]] = {
        "none": lambda: None,
        **{f"tree {n}": (lambda tree=tree: verify_tree(target, tree)) for n, tree in trees.items()},
        "tree 8 elsewhere": lambda: verify_tree(other, trees[8]),
        "plain 3 elsewhere": lambda: plain_elsewhere(3),
        "busy 5 ms": lambda: busy(0.005),
        "busy 25 ms": lambda: busy(0.025),
        "sleep 1 ms": lambda: time.sleep(0.001),
        "sleep 10 ms": lambda: time.sleep(0.01),
        "write 64 MB": lambda: memory.__iadd__(1),
    }
    own: dict[str, list[float]] = {name: [] for name in interruptions}
    totals: dict[str, list[float]] = {name: [] for name in interruptions}
    positions: dict[str, list[list[float]]] = {name: [[] for _ in range(SETTLED)] for name in interruptions}
    steady: list[float] = []

    def timed_step() -> float:
        started = time.perf_counter()
        step(target)
        return time.perf_counter() - started

    for round_index in range(args.rounds):
        names = list(interruptions)
        if round_index % 2:
            names.reverse()
        for name in names:
            before = [timed_step() for _ in range(2 * SETTLED)][SETTLED:]
            started = time.perf_counter()
            interruptions[name]()
            own[name].append(time.perf_counter() - started)
            target.rollback(args.context + SETTLED)  # the steps after run where those before ran
            after = [timed_step() for _ in range(SETTLED)]
            target.rollback(args.context)
            level = statistics.median(before)
            steady.extend(before)
            totals[name].append(sum(after) - SETTLED * level)
            for position, seconds in enumerate(after):
                positions[name][position].append(seconds - level)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)

    plain_s = statistics.median(steady)
    rows = {}
    for name in interruptions:
        seconds, penalty = statistics.median(own[name]), statistics.median(totals[name])
        rows[name] = {
            "own_s": round(seconds, 6),
            "penalty_s": round(penalty, 6),
            "penalty_per_second": round(penalty / seconds, 3) if seconds > 1e-4 else None,
            "penalty_per_step_s": [round(statistics.median(p), 6) for p in positions[name]],
        }
    result = {
        "command": " ".join(sys.argv),
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "runtime": runtime_description(target),
        "context": args.context,
        "rounds": args.rounds,
        "settled_steps": SETTLED,
        "plain_step_s": round(plain_s, 6),
        "interruptions": rows,
    }
    print(f"plain step {plain_s * 1000:.2f} ms ({result['cpu']})")
    print(
        "| interruption | its time | penalty | per second of it | "
        + " | ".join(f"step {i + 1}" for i in range(SHOWN_STEPS)) + " |"
    )
    print("|---|" + "---:|" * (3 + SHOWN_STEPS))
    for name, row in rows.items():
        per_second = "" if row["penalty_per_second"] is None else f"{row['penalty_per_second']:.2f}"
        steps = " | ".join(f"{s * 1000:.2f}" for s in row["penalty_per_step_s"][:SHOWN_STEPS])
        print(f"| {name} | {row['own_s'] * 1000:.1f} ms | {row['penalty_s'] * 1000:.2f} ms | {per_second} | {steps} |")
    if args.out is not None:
        write_json(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    run_script(main)
