"""Learning curves of drafter training runs: validation top-1 per draft depth and τ over steps.

    .venv/bin/python bench/learning_curves.py --out docs/learning_curves [--merge] [LABEL=]RUN_DIR [...]

Reads each run's `train_state.pt` history (the validation records written every --val-every
steps) and writes `<out>.png` (one panel per quantity, one line per run) and `<out>.json` (the
points, small enough to commit). `--merge` keeps the runs already in `<out>.json` (those of
earlier machines, whose run directories are gone) and adds or replaces the given ones, by name: a
run is named by its folder, or by LABEL in `LABEL=RUN_DIR` (two runs of one name are refused, as
`--merge` would replace one by the other). Draft depth follows inference: for MoA, draft depth d is the
trainer's `acc_depth{d+1}` (its `acc_depth1` is the anchor's own position, the target's bonus
token at inference); for EAGLE, `acc_depth1` is draft depth 1 (teacher-forced features).
Top-1 is against the target's argmax over the full vocabulary (runs from before 2026-11-24
compared with the data's next token; their points are not comparable).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from moaspec.atomic_files import write_files_atomically
from moaspec.bench.script_args import output_file, read_json, run_script, script_parser
from moaspec.errors import MoaspecError

DEPTHS = (1, 2, 3)


def run_curve(run_dir: Path, name: str | None = None) -> dict:
    """{"name", "method", "steps", "depth{d}": [...], "val_tau": [...]} of one run, named `name` or
    after its folder."""
    state_path = run_dir / "train_state.pt"
    if not state_path.is_file():
        raise SystemExit(f"learning_curves: {run_dir} has no train_state.pt")
    state = torch.load(state_path, weights_only=False)
    method = state["config"]["method"]
    offset = 1 if method == "moa" else 0
    points = [record for record in state["history"] if "val_loss" in record]
    curve = {"name": name or run_dir.name, "method": method, "steps": [record["step"] for record in points]}
    for depth in DEPTHS:
        curve[f"depth{depth}"] = [record.get(f"acc_depth{depth + offset}") for record in points]
    curve["val_tau"] = [record.get("val_tau") for record in points]
    curve["val_loss"] = [record["val_loss"] for record in points]
    return curve


def named_runs(runs: list[str]) -> list[tuple[str, Path]]:
    """`[LABEL=]RUN_DIR` arguments as (name, directory), names unique."""
    named = []
    for run in runs:
        label, equals, directory = run.partition("=")
        if not equals:
            label, directory = Path(run).name, run
        if not label or not directory:
            raise SystemExit(f"learning_curves: {run!r} is not RUN_DIR or LABEL=RUN_DIR")
        named.append((label, Path(directory)))
    names = [label for label, _ in named]
    repeated = sorted({label for label in names if names.count(label) > 1})
    if repeated:
        raise SystemExit(f"learning_curves: two runs named {repeated[0]!r}; name them apart with LABEL=RUN_DIR")
    return named


def plot(curves: list[dict]) -> bytes:
    """The curves' PNG: one panel per quantity, one line per run."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [f"depth{d}" for d in DEPTHS] + ["val_tau"]
    legend_rows = -(-len(curves) // 6)  # the legend below the panels, six runs a row
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4 + 0.22 * legend_rows))
    palette = plt.get_cmap("tab10" if len(curves) <= 10 else "tab20")
    markers = "os^D"  # with the colours, distinct for up to 80 runs
    colors = [palette(number % palette.N) for number in range(len(curves))]
    for axis, key in zip(axes, panels):
        for number, curve in enumerate(curves):  # one colour per run in every panel
            pairs = [(s, v) for s, v in zip(curve["steps"], curve[key]) if v is not None]
            if pairs:
                style = "--" if curve["method"] == "eagle" else "-"  # EAGLE-2 dashed, MoA solid
                marker = markers[number // palette.N % len(markers)]
                axis.plot(*zip(*pairs), style, marker=marker, label=curve["name"], color=colors[number])
        axis.set_title("τ (greedy, val prompts)" if key == "val_tau" else f"top-1, draft depth {key[5:]}")
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=6, fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, 0.22 * legend_rows / (3.4 + 0.22 * legend_rows), 1, 1))
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    plt.close(figure)
    return buffer.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--out", type=output_file, required=True, help="output path without extension (.png and .json are written)")
    parser.add_argument("--merge", action="store_true", help="keep the other runs already in <out>.json")
    parser.add_argument("runs", nargs="+", help="run directories of `moaspec train`, each RUN_DIR or LABEL=RUN_DIR")
    args = parser.parse_args(argv)
    curves = [run_curve(directory, label) for label, directory in named_runs(args.runs)]
    json_path, png_path = Path(f"{args.out}.json"), Path(f"{args.out}.png")  # --out a.v2: a.v2.json, not a.json
    if args.merge and json_path.is_file():
        names = {curve["name"] for curve in curves}
        merged = read_json(json_path)
        if not isinstance(merged, list) or not all(isinstance(curve, dict) and "name" in curve for curve in merged):
            raise MoaspecError(f"{json_path} holds no learning curves to merge with")
        kept = [curve for curve in merged if curve["name"] not in names]
        curves = kept + curves
    # both or neither: the figure is drawn before either file is written
    write_files_atomically(json_path.parent, {json_path.name: json.dumps(curves, indent=1) + "\n", png_path.name: plot(curves)})
    print(f"learning_curves: {png_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    run_script(main)
