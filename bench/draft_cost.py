"""Drafting cost per verification cycle, as a ratio to one target decode step (issue 3).

    .venv/bin/python bench/draft_cost.py --rounds 15 --out bench/results/draft_cost.json

For each drafter variant (MoA TLI 0/1, EAGLE-2; full vocabulary vs a reduced one) one cycle is
what the engine pays per verification: `accept` of the newly verified tokens (3 by default:
root + 2 accepted drafts) and `propose` of a dynamic tree. Untrained (random) weights: cost does
not depend on the values. Variants and the target decode step are interleaved round by round;
medians are reported. The verify cost of the tree itself (one target forward over N nodes) is
measured too, so expected speedups can be read off: tau / (verify_ratio + draft_ratio).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from moaspec.api import load_target
from moaspec.bench.output import write_json
from moaspec.bench.script_args import non_negative_int, output_file, positive_int, run_script, script_parser
from moaspec.config import SamplingConfig, TreeConfig
from moaspec.drafters.base import VerifiedUpdate
from moaspec.tree import DraftTree

CONTEXT = 256


def build_variants(target, tree: TreeConfig, reduced_size: int) -> dict[str, object]:
    from moaspec.drafters.moa import MoADrafter
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    reduced = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(0))[:reduced_size].sort().values
    variants: dict[str, object] = {}
    for tli in (0, 1):
        for vocab in (None, reduced):
            size = 0 if vocab is None else vocab.numel()
            net = MoADrafterNet(MoAConfig.for_target(target.config, tli_layers=tli, draft_vocab_size=size))
            if vocab is not None:
                net.draft_vocab_ids.copy_(vocab)
            name = f"moa-tli{tli}-{'full' if vocab is None else f'v{size}'}"
            variants[name] = MoADrafter(net.to(target.dtype), target, tree)
    try:
        from moaspec.drafters.eagle import EagleDrafter
        from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
    except ImportError:
        return variants
    for vocab in (None, reduced):
        size = 0 if vocab is None else vocab.numel()
        net = EagleDrafterNet(EagleConfig.for_target(target.config, draft_vocab_size=size))
        if vocab is not None:
            net.draft_vocab_ids.copy_(vocab)
        variants[f"eagle-{'full' if vocab is None else f'v{size}'}"] = EagleDrafter(net.to(target.dtype), target, tree)
    return variants


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--rounds", type=positive_int, default=15)
    parser.add_argument("--depth", type=positive_int, default=TreeConfig.depth)
    parser.add_argument("--top-k", type=positive_int, default=TreeConfig.top_k)
    parser.add_argument("--budget", type=positive_int, default=TreeConfig.budget)
    parser.add_argument("--reduced-vocab", type=non_negative_int, default=8192)
    parser.add_argument("--accepted", type=positive_int, default=3, help="tokens verified per cycle (root + accepted drafts)")
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 2))
    tree = TreeConfig(depth=args.depth, top_k=args.top_k, budget=args.budget)

    target = load_target(runtime="transformers")
    context = torch.randint(100, 20000, (CONTEXT + 64,), generator=torch.Generator().manual_seed(1))
    variants = build_variants(target, tree, args.reduced_vocab)
    sampling, generator = SamplingConfig(), torch.Generator()
    samples: dict[str, list[float]] = {name: [] for name in ["target_decode_step", "target_verify_tree", *variants]}

    with torch.inference_mode():
        for round_idx in range(args.rounds + 1):  # round 0 is warm-up
            target.reset()
            hidden = target.prefill(context[:CONTEXT], (target.num_layers,)).hidden  # [CONTEXT, 1, D]
            step = timed(lambda: target.verify(DraftTree.root_only(int(context[CONTEXT]))))
            target.rollback(CONTEXT)
            proposal = None
            for name, drafter in variants.items():
                drafter.reset()
                split = CONTEXT - args.accepted
                drafter.accept(VerifiedUpdate(context[:split], 0, hidden[:split], target))
                update = VerifiedUpdate(context[split:CONTEXT], split, hidden[split:], target)
                root = int(context[CONTEXT])
                start = time.perf_counter()
                drafter.accept(update)
                proposal = drafter.propose(root, sampling, generator)
                cost = time.perf_counter() - start
                if round_idx:
                    samples[name].append(cost)
            verify = timed(lambda: target.verify(proposal))
            target.rollback(CONTEXT)
            if round_idx:
                samples["target_decode_step"].append(step)
                samples["target_verify_tree"].append(verify)

    step_ms = statistics.median(samples["target_decode_step"]) * 1000
    rows = {
        name: {"median_ms": round(statistics.median(values) * 1000, 2), "ratio_to_decode_step": round(statistics.median(values) * 1000 / step_ms, 3)}
        for name, values in samples.items()
    }
    print(f"tree {tree}, context {CONTEXT}, {args.accepted} tokens verified per cycle, {args.rounds} rounds")
    print("| variant | median ms per cycle | ratio to one decode step |")
    print("|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_ms']} | {row['ratio_to_decode_step']} |")
    record = {"tree": tree.__dict__, "context": CONTEXT, "accepted": args.accepted, "rounds": args.rounds, "results": rows}
    print(json.dumps(record))
    if args.out:
        write_json(args.out, record, indent=1)


if __name__ == "__main__":
    run_script(main)
