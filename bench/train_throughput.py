"""Training speed by micro-batch: `moaspec train` steps at several `--micro-batch` sizes, run in
interleaved rounds, each for a few steps from the same start; medians of the per-step tokens/s
(the first step of every run, which warms up, left out). The gradient does not depend on the
size (tests/test_train.py), so the fastest one is the one to train with on this machine.

    .venv/bin/python bench/train_throughput.py --micro-batches 1,4,8 --out bench/results/train-throughput.json -- \
        --method moa --memory-layers 4 --data data/sharegpt-tf-smollm2-8400-9600 --batch-size 8 \
        --init-from moa --feature-cache /work/cache/features-tf9600-last4

Everything after `--` goes to `moaspec train` as it is (not --out, --steps, --micro-batch or
--val-every, set here). On a GPU add `--device cuda` there. Prints a markdown table.

`--profile FILE` runs every size under `torch.profiler` (CPU, and CUDA where a GPU is visible) and
writes its operator tables to FILE, sorted by device time and by CPU time: where a step's time
goes (loading the target is in it too, on the CPU side).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moaspec.atomic_files import write_file_atomically
from moaspec.bench.machine import machine_info
from moaspec.bench.output import write_json
from moaspec.bench.script_args import int_at_least, output_file, positive_int, positive_ints, run_script, script_parser
from moaspec.cli import main as moaspec_main

OWN_FLAGS = ("--out", "--steps", "--micro-batch", "--val-every")


def tokens_per_s(train_args: list[str], micro_batch: int, steps: int, out_dir: Path) -> list[float]:
    """One fresh `moaspec train` run of `steps` steps -> tokens/s of each step after the first."""
    command = ["train", *train_args, "--micro-batch", str(micro_batch), "--steps", str(steps),
               "--val-every", str(10 * steps), "--out", str(out_dir)]
    if moaspec_main(command) != 0:
        raise SystemExit(f"train_throughput: `moaspec {' '.join(command)}` failed")
    history = torch.load(out_dir / "train_state.pt", weights_only=False, map_location="cpu")["history"]
    return [record["tokens_per_s"] for record in history[1:]]


def write_profile(path: Path, profiler: profile, train_args: list[str], sizes: list[int]) -> None:
    """The profiler's operator tables -> path (text): by device time where CUDA was profiled, and by
    CPU time."""
    averages = profiler.key_averages()
    sections = [f"moaspec train {' '.join(train_args)}; --micro-batch {','.join(map(str, sizes))}"]
    if torch.cuda.is_available():
        sections.append(averages.table(sort_by="self_cuda_time_total", row_limit=40))
    sections.append(averages.table(sort_by="self_cpu_time_total", row_limit=40))
    write_file_atomically(path, "\n\n".join(sections) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__, usage="%(prog)s [options] -- TRAIN_FLAGS")
    parser.add_argument("--micro-batches", type=positive_ints, default="1,4,8", help="sizes to compare, comma-separated (default 1,4,8)")
    parser.add_argument("--steps", type=int_at_least(2), default=5, help="steps per run, the first not counted (default 5)")
    parser.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds over the sizes (default 2)")
    parser.add_argument("--out", type=output_file, default=None, help="write the results here as JSON")
    parser.add_argument("--profile", type=output_file, default=None,
                        help="profile the runs with torch.profiler and write its operator tables here")
    args, train_args = parser.parse_known_args(argv)
    train_args = [arg for arg in train_args if arg != "--"]
    sizes = args.micro_batches
    if not train_args or any(arg.split("=")[0] in OWN_FLAGS for arg in train_args):
        parser.error(f"give `moaspec train` flags after --, without {', '.join(OWN_FLAGS)}")
    per_size: dict[int, list[float]] = {size: [] for size in sizes}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities) if args.profile is not None else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as scratch, profiler:
        for round_index in range(args.rounds):
            for size in sizes:
                run_dir = Path(scratch) / f"r{round_index}-m{size}"
                per_size[size] += tokens_per_s(train_args, size, args.steps, run_dir)
    if args.profile is not None:
        write_profile(args.profile, profiler, train_args, sizes)
    results = {
        "machine": machine_info(),
        "train_flags": train_args,
        "steps_per_run": args.steps,
        "rounds": args.rounds,
        "micro_batches": {
            str(size): {"tokens_per_s": [round(v, 1) for v in values], "median": round(statistics.median(values), 1)}
            for size, values in per_size.items()
        },
    }
    baseline = results["micro_batches"][str(sizes[0])]["median"]
    print(f"| --micro-batch | tokens/s (median of {len(per_size[sizes[0]])} steps) | vs {sizes[0]} |")
    print("|---:|---:|---:|")
    for size in sizes:
        median = results["micro_batches"][str(size)]["median"]
        print(f"| {size} | {median:,.0f} | {median / baseline:.2f}× |")
    if args.out is not None:
        write_json(args.out, results, indent=2)
    return 0


if __name__ == "__main__":
    run_script(main)
