"""What `--dtype bfloat16` (or float16) does on the transformers runtime: speed and exactness
against float32, every method interleaved prompt by prompt in one process.

For each prompt (first turns, `--limit` per category), each precision and each method: tokens/s,
τ, whether the greedy tokens equal plain decoding (`none`) in the same precision (the lossless
promise holds in float32; in reduced precision a forward's output depends on how many tokens it
holds, so speculation may change the output), and how many leading tokens agree with float32's
plain decoding.

    .venv/bin/python bench/reduced_precision.py --out bench/results/reduced-precision.json \
        [--dtypes float32,bfloat16] [--methods none,eagle,moa,moa+ngram] [--categories mt_bench] [--limit 8]
"""

from __future__ import annotations

import statistics
import sys

import torch

from moaspec.bench.runner import first_divergence
from moaspec.bench.script_args import (
    category_list,
    dtype_list,
    output_file,
    positive_int,
    run_script,
    script_parser,
    text_items,
)


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument(
        "--dtypes", type=dtype_list, default="float32,bfloat16", help="comma-separated; float32 first (the reference)"
    )
    parser.add_argument("--methods", type=text_items, default="none,eagle,moa,moa+ngram", help="drafters; `none` first (the reference)")
    parser.add_argument("--categories", type=category_list, default="mt_bench")
    parser.add_argument("--limit", type=positive_int, default=8, help="prompts per category (default 8)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=output_file, required=True, help="results JSON")
    args = parser.parse_args()
    dtypes, methods = args.dtypes, args.methods
    if dtypes[0] != "float32" or methods[0] != "none":
        parser.error("--dtypes must start with float32 and --methods with none (the references)")

    from moaspec.api import SpeculativeLM, load_target
    from moaspec.bench.output import write_json
    from moaspec.bench.prompts import load_prompts
    from moaspec.calibration.machine import cpu_description, runtime_description
    from moaspec.drafters import make_drafter

    targets = {dtype: load_target(args.target, runtime="transformers", dtype=dtype, device=args.device) for dtype in dtypes}
    lms = {
        (dtype, method): SpeculativeLM(target, make_drafter(method, target), method)
        for dtype, target in targets.items()
        for method in methods
    }
    prompts = [item.turns[0] for items in load_prompts(args.categories, args.limit).values() for item in items]
    runs = []
    for index, prompt in enumerate(prompts):
        plain: dict[str, list[int]] = {}
        for (dtype, method), lm in lms.items():
            out = lm.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=0.0)
            tokens = out.token_ids
            if method == "none":
                plain[dtype] = tokens
            reference = plain["float32"]
            runs.append({
                "prompt": index, "dtype": dtype, "method": method, "new_tokens": len(tokens),
                "tokens_per_s": out.stats.tokens_per_s, "tau": out.stats.tau,
                "equals_plain_same_dtype": tokens == plain[dtype],
                "prefix_agreeing_with_float32_plain": first_divergence(reference, tokens),
            })
        print(f"prompt {index + 1}/{len(prompts)} done", file=sys.stderr)
    summary = []
    for dtype, method in lms:
        rows = [r for r in runs if r["dtype"] == dtype and r["method"] == method]
        summary.append({
            "dtype": dtype, "method": method,
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in rows), 2),
            "mean_tau": round(statistics.mean(r["tau"] for r in rows), 3),
            "generations_equal_to_plain_same_dtype": sum(r["equals_plain_same_dtype"] for r in rows),
            "generations": len(rows),
            "tokens_before_first_difference_from_float32_plain": sum(r["prefix_agreeing_with_float32_plain"] for r in rows),
            "tokens": sum(r["new_tokens"] for r in rows),
        })
    result = {
        "command": " ".join(sys.argv), "cpu": cpu_description(), "threads": torch.get_num_threads(),
        "runtimes": {dtype: runtime_description(target) for dtype, target in targets.items()},
        "summary": summary, "runs": runs,
    }
    write_json(args.out, result)
    print("| precision | method | tokens/s (median) | τ | equal to plain decoding, same precision | tokens agreeing with float32 plain (from the first) |")
    print("|---|---|---:|---:|---:|---:|")
    for row in summary:
        print(f"| {row['dtype']} | `{row['method']}` | {row['median_tokens_per_s']} | {row['mean_tau']} | "
              f"{row['generations_equal_to_plain_same_dtype']} of {row['generations']} | "
              f"{row['tokens_before_first_difference_from_float32_plain']} of {row['tokens']} |")
    return 0


if __name__ == "__main__":
    run_script(main)
