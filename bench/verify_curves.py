"""Verify-cost curves of both target runtimes: seconds to verify (and commit) a tree of N nodes
after a fixed context, relative to a plain decoding step (a one-node forward among many; one
right after a tree can cost more: llama.cpp rebuilds its compute graph), measured in
one process with the runtimes alternating block by block (calibration/costs.py's
measure_verify: binary trees, medians), and the tree penalty: what the plain steps after a tree
cost beyond steady ones, in all.

    .venv/bin/python bench/verify_curves.py --out bench/results/verify-curves.json [--dtypes float32,bfloat16]

Prints a markdown table (the one in the README's *Target runtimes* section).
"""

from __future__ import annotations

import platform
import statistics
import sys

import torch

from moaspec.bench.script_args import dtype_list, output_file, positive_int, run_script, script_parser

NODE_COUNTS = (1, 2, 4, 8, 16)


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--context", type=positive_int, default=256, help="verified tokens before the tree (default 256)")
    parser.add_argument("--blocks", type=positive_int, default=4, help="alternating blocks per runtime (default 4)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="measurements per tree size per block (default 5)")
    parser.add_argument(
        "--dtypes", type=dtype_list, default="float32",
        help="comma-separated precisions of the transformers runtime, each measured as its own row (default float32)",
    )
    parser.add_argument("--out", type=output_file, default=None, help="write the results here as JSON")
    args = parser.parse_args()

    from moaspec.api import load_target
    from moaspec.bench.output import write_json
    from moaspec.calibration.costs import measure_verify
    from moaspec.calibration.machine import cpu_description, runtime_description

    targets = {
        "transformers" if dtype == "float32" else f"transformers {dtype}": load_target(args.target, runtime="transformers", dtype=dtype)
        for dtype in args.dtypes
    }
    targets["llama.cpp"] = load_target(args.target, runtime="llama.cpp")
    samples: dict[str, dict[int | str, list[float]]] = {
        r: {"plain": [], "penalty": [], **{n: [] for n in NODE_COUNTS}} for r in targets
    }
    for block in range(args.blocks):
        for runtime, target in targets.items():
            costs = measure_verify(target, args.context, args.repeats, NODE_COUNTS)
            samples[runtime]["plain"].append(costs.plain_step_s)
            samples[runtime]["penalty"].append(costs.tree_penalty_s)
            for n, seconds in costs.verify_s.items():
                samples[runtime][n].append(seconds)
        print(f"block {block + 1}/{args.blocks} done", file=sys.stderr)
    medians = {r: {n: statistics.median(v) for n, v in per.items()} for r, per in samples.items()}
    result = {
        "command": " ".join(sys.argv),
        "cpu": cpu_description(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "context": args.context,
        "runtimes": {r: runtime_description(targets[r]) for r in targets},
        "seconds": {r: {str(n): round(s, 6) for n, s in per.items()} for r, per in medians.items()},
        "relative_to_plain_step": {
            r: {str(n): round(s / per["plain"], 3) for n, s in per.items()} for r, per in medians.items()
        },
    }
    header = (
        "| runtime | plain step | tree penalty per node | 1 node after a tree | "
        + " | ".join(f"{n} nodes" for n in NODE_COUNTS[1:]) + " |"
    )
    lines = [header, "|---|" + "---:|" * (len(NODE_COUNTS) + 2)]
    for runtime, per in medians.items():
        cells = [f"{per['plain'] * 1000:.1f} ms"] + [f"{per[n] / per['plain']:.2f}x" for n in ("penalty", *NODE_COUNTS)]
        lines.append(f"| {runtime} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    if args.out is not None:
        write_json(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    run_script(main)
