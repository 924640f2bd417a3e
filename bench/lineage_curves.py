"""Learning curves across training passes: the shipped drafters' MT-bench top-1 per draft depth
against the sequences they were trained on, both methods, every pass (CPU and GPU) on one axis.

    .venv/bin/python bench/lineage_curves.py --top1 bench/results/NAME/top1.json \\
        --out docs/issue20-lineage

`--top1` is `bench/mtbench_top1.py`'s output for a list of checkpoints (`--drafters LABEL=DIR,...`,
e.g. each shipped `moa` and `eagle` taken out of git history); the checkpoints are read from the
directories it names. A checkpoint's `config.json` records its own run and, nested under
`init_from`, every run it continued: the sequences seen are the sum of steps × batch over that
chain (the batch from each run's command, `--batch-size`, else the default 8), and the wall time
is summed per device (`--device cuda` in a run's command: GPU, else CPU). Unlike
`bench/learning_curves.py` (one run's own validation set), every point here is scored on the same
80 MT-bench questions × 2 turns, teacher-forced against the target's argmax.

Writes `<out>.json` (the points) and `<out>.png` (top-1 at draft depths 1-3 over sequences seen,
log scale; MoA solid, EAGLE-2 dashed; EAGLE-2 is scored at depth 1 only).
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from moaspec.atomic_files import write_files_atomically
from moaspec.bench.plots import figure_png
from moaspec.bench.script_args import existing_file, output_file, read_json, run_script, script_parser
from moaspec.errors import MoaspecError

DEPTHS = (1, 2, 3)
DEFAULT_BATCH = 8  # moaspec train's --batch-size default, for commands that do not give it


def command_option(command: str, flag: str) -> str | None:
    """The value given to `flag` in a recorded command line (the last one given), or None."""
    words = shlex.split(command)
    values = [words[i + 1] for i, word in enumerate(words[:-1]) if word == flag]
    return values[-1] if values else None


def lineage(training: dict) -> list[dict]:
    """The runs behind a checkpoint, first run first: [{"steps", "batch", "device", "wall_s"}].

    training: a checkpoint's `config.json` "training" record (its own run, with the runs it
    continued nested under "init_from")."""
    runs = []
    record: dict | None = training
    while record is not None:
        command = record.get("command", "")
        if "step" not in record or not command:
            raise MoaspecError("a training record without its steps or command: the lineage cannot be summed")
        batch = command_option(command, "--batch-size")
        device = command_option(command, "--device") or "cpu"
        runs.append({
            "steps": int(record["step"]),
            "batch": int(batch) if batch is not None else DEFAULT_BATCH,
            "device": "gpu" if device.startswith("cuda") else "cpu",
            "wall_s": float(record.get("train_wall_s", 0.0)),
        })
        record = record.get("init_from")
    return runs[::-1]


def lineage_totals(training: dict) -> dict:
    """{"sequences", "runs", "cpu_wall_s", "gpu_wall_s"} summed over a checkpoint's lineage."""
    runs = lineage(training)
    return {
        "sequences": sum(run["steps"] * run["batch"] for run in runs),
        "runs": len(runs),
        "cpu_wall_s": round(sum(run["wall_s"] for run in runs if run["device"] == "cpu"), 1),
        "gpu_wall_s": round(sum(run["wall_s"] for run in runs if run["device"] == "gpu"), 1),
    }


def points(top1: dict) -> list[dict]:
    """One point per drafter of a `mtbench_top1.py` result: label, method, lineage totals and
    top-1 per draft depth over all of MT-bench."""
    result = []
    for drafter in top1.get("drafters", []):
        try:
            label, source, overall = drafter["label"], drafter["source"], drafter["by_category"]["all"]
        except (KeyError, TypeError):
            raise MoaspecError(f"a drafter entry of the top-1 file lacks its label, source or overall top-1: {drafter!r:.120}") from None
        config_path = Path(source) / "config.json"
        if not config_path.is_file():
            raise MoaspecError(f"{label}: no checkpoint at {source} (its config.json is missing)")
        record = read_json(config_path)
        training = record.get("training") if isinstance(record, dict) else None
        if not isinstance(training, dict) or not training:
            raise MoaspecError(f"{config_path} records no training")
        result.append({
            "label": label, "method": drafter.get("method"), **lineage_totals(training),
            **{f"depth{d}": overall.get(f"depth{d}") for d in DEPTHS},
        })
    return sorted(result, key=lambda point: (str(point["method"]), point["sequences"]))


def plot(curve_points: list[dict]) -> bytes:
    """The PNG: one panel per draft depth, top-1 over sequences seen, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(DEPTHS), figsize=(4.2 * len(DEPTHS), 3.6))
    for axis, depth in zip(axes, DEPTHS):
        for method, style, name in (("moa", "-", "MoA"), ("eagle", "--", "EAGLE-2")):
            pairs = [(p["sequences"], p[f"depth{depth}"]) for p in curve_points
                     if p["method"] == method and p[f"depth{depth}"] is not None]
            if pairs:
                axis.plot(*zip(*pairs), style, marker="o", label=name)
        axis.set_xscale("log")
        axis.set_title(f"MT-bench top-1, draft depth {depth}")
        axis.set_xlabel("training sequences seen (steps × batch)")
        axis.grid(alpha=0.3, which="both")
    axes[0].legend(loc="upper left", fontsize=8)
    return figure_png(plt, figure)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--top1", type=existing_file, required=True, help="bench/mtbench_top1.py's top1.json")
    parser.add_argument("--out", type=output_file, required=True, help="output path without extension (.png and .json are written)")
    args = parser.parse_args(argv)
    top1 = read_json(args.top1)
    if not isinstance(top1, dict) or not top1.get("drafters"):
        raise MoaspecError(f"{args.top1} holds no drafters' top-1 (bench/mtbench_top1.py's top1.json)")
    curve_points = points(top1)
    json_path, png_path = Path(f"{args.out}.json"), Path(f"{args.out}.png")
    document = {"top1": str(args.top1), "command": top1.get("command"), "points": curve_points}
    write_files_atomically(json_path.parent, {json_path.name: json.dumps(document, indent=1) + "\n", png_path.name: plot(curve_points)})
    print(f"lineage_curves: {png_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script(main)
