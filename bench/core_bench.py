"""Core benchmark (issue 2): plain decoding through our engine vs transformers generate(),
the n-gram drafter's tau and speedup over `none`, and start-up cost of `moaspec generate`.

    .venv/bin/python bench/core_bench.py --max-new-tokens 128 --repeats 1 --out bench/results/core.json

Protocol: the same prompts for every method, methods interleaved prompt by prompt, one warm-up
generation excluded, greedy decoding, every method's tokens checked against plain decoding.
Reports medians over prompts of per-prompt tokens/s, and ratios computed per prompt then
median'd. Prints a markdown table, then one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from moaspec.api import load_target
from moaspec.config import GenerationConfig
from moaspec.drafters import make_drafter
from moaspec.engine import Engine

PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring and two doctests.",
    "Repeat the following list exactly, then sort it alphabetically: banana, cherry, apple, mango, kiwi, grape, lemon.",
    "Summarize in three sentences: The Amazon rainforest spans nine countries and holds about ten percent of "
    "all known species. Deforestation, driven by cattle ranching and agriculture, has removed roughly "
    "seventeen percent of its area over fifty years. Scientists warn that beyond a tipping point the forest "
    "could turn into savanna, releasing vast amounts of carbon.",
    "Explain what a hash table is and give a small example in Python.",
    "What are the three states of matter? Answer briefly.",
    "Translate to French: The weather is nice today, so we will walk to the market and buy fresh bread.",
]


def run_engine(target, drafter_name: str, prompt_ids: list[int], max_new: int) -> tuple[list[int], float, float]:
    engine = Engine(target, make_drafter(drafter_name, target))
    result = engine.generate(prompt_ids, generation=GenerationConfig(max_new_tokens=max_new))
    return result.token_ids, result.stats.wall_s, result.stats.tau


def run_hf(model, prompt_ids: list[int], max_new: int) -> tuple[list[int], float]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False)
    wall = time.perf_counter() - start
    return out[0, len(prompt_ids) :].tolist(), wall


def startup_cost(repeats: int) -> dict:
    """Wall time of `moaspec generate --max-new-tokens 1` (cache warm), process start included."""
    cmd = [sys.executable, "-m", "moaspec.cli", "generate", "--prompt", "Hello!", "--max-new-tokens", "1", "--json"]
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        walls.append(time.perf_counter() - start)
    return {"first_token_s_median": round(statistics.median(walls), 3), "first_token_s_all": [round(w, 3) for w in walls]}


def generate_peak_rss(max_new: int) -> float:
    """Peak RSS (MB) of a full `moaspec generate` run with the default drafter. Measured from a
    small parent process: a child forked from this big one would report the parent's pages."""
    code = (
        "import resource, subprocess, sys;"
        f"subprocess.run([sys.executable, '-m', 'moaspec.cli', 'generate', '--prompt', {PROMPTS[0]!r}, "
        f"'--max-new-tokens', '{max_new}', '--json'], check=True, capture_output=True);"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return round(int(out.stdout.strip()) / 1024, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    parser.add_argument("--startup-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 2))

    target = load_target()
    # The baseline is stock transformers: its default attention, its own weight layout.
    from transformers import AutoModelForCausalLM

    from moaspec.model_store import resolve_target

    sdpa_model = AutoModelForCausalLM.from_pretrained(resolve_target("smollm2-135m")[1], dtype=torch.float32).eval()
    tok = target.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        for p in PROMPTS[: args.prompts]
    ]
    run_engine(target, "none", prompts[0], 16)  # warm-up, excluded
    run_hf(target.model, prompts[0], 16)

    rows = []
    for i, prompt_ids in enumerate(prompts):
        none_ids, none_s, _ = run_engine(target, "none", prompt_ids, args.max_new_tokens)
        hf_ids, hf_s = run_hf(target.model, prompt_ids, args.max_new_tokens)
        hf_sdpa_ids, hf_sdpa_s = run_hf(sdpa_model, prompt_ids, args.max_new_tokens)
        ngram_ids, ngram_s, ngram_tau = run_engine(target, "ngram", prompt_ids, args.max_new_tokens)
        n = len(none_ids)
        row = {
            "prompt": i,
            "new_tokens": n,
            "none_tok_s": n / none_s,
            "hf_same_model_tok_s": len(hf_ids) / hf_s,
            "hf_sdpa_tok_s": len(hf_sdpa_ids) / hf_sdpa_s,
            "ngram_tok_s": len(ngram_ids) / ngram_s,
            "ngram_tau": ngram_tau,
            "none_vs_hf_same_model": (n / none_s) / (len(hf_ids) / hf_s),
            "none_vs_hf_sdpa": (n / none_s) / (len(hf_sdpa_ids) / hf_sdpa_s),
            "ngram_speedup": (len(ngram_ids) / ngram_s) / (n / none_s),
            "match_hf_same_model": hf_ids == none_ids,
            "match_ngram": ngram_ids == none_ids,
            "match_hf_sdpa": hf_sdpa_ids == none_ids,
        }
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), file=sys.stderr)

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rows), 3)

    summary = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}",
        "max_new_tokens": args.max_new_tokens,
        "num_prompts": len(rows),
        **{f"median_{k}": med(k) for k in ("none_tok_s", "hf_same_model_tok_s", "hf_sdpa_tok_s", "ngram_tok_s", "ngram_tau", "none_vs_hf_same_model", "none_vs_hf_sdpa", "ngram_speedup")},
        "mismatches": [r["prompt"] for r in rows if not (r["match_hf_same_model"] and r["match_ngram"])],
        "sdpa_mismatches": [r["prompt"] for r in rows if not r["match_hf_sdpa"]],
    }
    summary.update(startup_cost(args.startup_repeats))
    summary["generate_peak_rss_mb"] = generate_peak_rss(args.max_new_tokens)

    print("| method | median tok/s | median ratio |")
    print("|---|---|---|")
    print(f"| transformers generate, stock model (sdpa) | {summary['median_hf_sdpa_tok_s']} | 1 / {summary['median_none_vs_hf_sdpa']} |")
    print(f"| transformers generate, our loaded model | {summary['median_hf_same_model_tok_s']} | 1 / {summary['median_none_vs_hf_same_model']} |")
    print(f"| moaspec none | {summary['median_none_tok_s']} | 1.0 |")
    print(f"| moaspec ngram | {summary['median_ngram_tok_s']} | {summary['median_ngram_speedup']} (tau {summary['median_ngram_tau']}) |")
    line = json.dumps({"summary": summary, "rows": rows})
    print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
