"""Hit rate and draft cost of larger draft vocabularies, without retraining.

    MOASPEC_NO_CALIBRATION=1 .venv/bin/python bench/draft_vocab_size.py --out bench/results/NAME \\
        --drafters eagle,moa --sizes 8192,16384,32768,0 --data data/sharegpt-tf-smollm2 data/distill-smollm2

A drafter scores the rows of the target's own LM head that its draft vocabulary names, and its
state is trained to match the target's post-norm hidden state, so the same weights can score a
larger vocabulary: the N most frequent learned tokens of `--data` (always including the
checkpoint's own), 0 = the full vocabulary. For each size: teacher-forced top-1 against the
target's argmax on all 80 MT-bench questions x 2 turns (`mtbench_top1.py`'s conversations and
feature cache; draft depths 1-5 for MoA, 1 for EAGLE), the share of the target's choices inside
the vocabulary, and the median time of the head product for 1 and 4 rows (what a tree level
pays per call) on this machine's threads.
Writes `<out>/vocab.json` and `<out>/vocab.md`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mtbench_top1  # noqa: E402

from moaspec.atomic_files import write_file_atomically
from moaspec.bench.output import write_json
from moaspec.bench.script_args import non_negative_ints, output_directory, run_script, script_parser, text_items


def head_ms(head: torch.Tensor, rows: int, repeats: int = 200) -> float:
    """Median ms of state [rows, D] @ head.T."""
    state = torch.randn(rows, head.shape[1], dtype=head.dtype)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state @ head.T
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--out", type=output_directory, required=True, help="output directory")
    parser.add_argument("--drafters", type=text_items, default="eagle,moa", help="comma-separated NAME or LABEL=DIR")
    parser.add_argument("--sizes", type=non_negative_ints, default="8192,16384,32768,0", help="vocabulary sizes, 0 = full")
    parser.add_argument("--data", nargs="+", required=True, help="training data directories (token frequencies)")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--cache", default=None, help="mtbench_top1.py's feature cache (default: its default)")
    args = parser.parse_args(argv)
    mtbench_top1.check_drafters(parser, args.drafters)
    missing = [d for d in args.data if not Path(d).is_dir()]
    if missing:
        parser.error(f"--data: no directory {', '.join(missing)}")
    from moaspec.api import load_target
    from moaspec.drafters import checkpoint_directory
    from moaspec.drafters.vocab import most_frequent_token_ids
    from moaspec.nn.checkpoint import target_fingerprint
    from moaspec.nn.eagle import EagleDrafterNet
    from moaspec.nn.moa import MoADrafterNet
    from moaspec.train.config import TrainConfig
    from moaspec.train.feature_cache import build_feature_cache
    from moaspec.train.run import load_samples
    from moaspec.train.trainer import loss_mask, validation_counts

    target = load_target(args.target, dtype=torch.float32, runtime="transformers")
    samples, _ = mtbench_top1.samples_of(target, mtbench_top1.conversations(target, 128))
    layers = tuple(range(target.num_layers))
    fingerprint = target_fingerprint(target)
    source = build_feature_cache(target, samples, mtbench_top1.feature_cache_dir(args.cache), fingerprint, tli_max=1, kv_layers=layers)
    learned = [s.learned_tokens() for s in load_samples([Path(d) for d in args.data], 100_000)]
    wanted = torch.cat([  # the target's next token at every answer position
        source.features(sample, 0, ()).target_argmax[loss_mask(sample.input_ids.numel(), sample.spans()).bool()]
        for sample in samples
    ])
    full = target.parts(0).lm_head_weight
    sizes = args.sizes
    rows = []
    for item in args.drafters:
        label, _, spec = item.partition("=") if "=" in item else (item, "", item)
        directory = checkpoint_directory(spec, target.name)
        method = json.loads((directory / "config.json").read_text())["method"]
        net_class = MoADrafterNet if method == "moa" else EagleDrafterNet
        for size in sizes:
            net, _ = net_class.from_pretrained(directory, target)
            net = net.float()
            own = net.draft_vocab_ids.clone()
            if size == 0:
                net.config = dataclasses.replace(net.config, draft_vocab_size=0)
            elif size > own.numel():
                ids = most_frequent_token_ids(learned, size, always_include=own.tolist())
                net.config = dataclasses.replace(net.config, draft_vocab_size=ids.numel())
                net.draft_vocab_ids = ids
            tli = net.config.tli_layers if method == "moa" else 0
            config = TrainConfig(method=method, tli_layers=tli)
            counts = validation_counts(net, target.parts(tli), source, samples, config, mtbench_top1.MAX_DEPTH)
            summary = counts.summary()
            offset = 1 if method == "moa" else 0
            depths = range(1, 6) if method == "moa" else range(1, 2)
            vocab = net.draft_vocab_ids if net.config.draft_vocab_size else torch.arange(full.shape[0])
            head = full[vocab]
            row = {
                "drafter": label, "size": int(vocab.numel()),
                "inside": round(float(torch.isin(wanted, vocab).float().mean()), 4),
                **{f"depth{d}": round(summary[f"acc_depth{d + offset}"], 4) for d in depths},
                "head_ms_1": round(head_ms(head, 1), 3), "head_ms_4": round(head_ms(head, 4), 3),
            }
            rows.append(row)
            print(f"draft_vocab_size: {row}", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["bench/draft_vocab_size.py", *(sys.argv[1:] if argv is None else argv)])
    record = {"command": command, "threads": torch.get_num_threads(), "rows": rows}
    write_json(out / "vocab.json", record)
    threads = torch.get_num_threads()
    lines = [
        f"Larger draft vocabularies without retraining (80 MT-bench questions x 2 turns, {threads} threads)",
        "",
        "| drafter | vocabulary | target's choice inside | top-1 depth 1 | 2 | 3 | 4 | 5 | head ms, 1 row | 4 rows |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [f"{row[f'depth{d}']:.3f}" if f"depth{d}" in row else "–" for d in range(1, 6)]
        lines.append(f"| {row['drafter']} | {row['size']} | {row['inside']:.3f} | " + " | ".join(cells)
                     + f" | {row['head_ms_1']:.2f} | {row['head_ms_4']:.2f} |")
    write_file_atomically(out / "vocab.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_script(main)
