"""What the llama.cpp runtime's prompt context and its float prefill save on a prompt's prefill,
their moves included, by value cache and prompt length: the measurements behind
PROMPT_CONTEXT_MIN_TOKENS and FLOAT_PREFILL_MIN_TOKENS (README, *Target runtimes*, *Long prompts*
and *Prompts prefilled in float32*).

    .venv/bin/python bench/prompt_context_gain.py [--lengths 64,128,256,384,512,1000] [--rounds 3]
        [--value-caches f16,q8_0] [--out FILE.json]

Times the runtime's own `set_context` of a prompt in the verified context (the per-query kernel),
through the prompt context (f16 / f16, tiled kernel, then the move) and through float torch with
float32 and with bfloat16 products (the forward, the move, the last token decoded; the bfloat16
weights' file written in the warm-up round), on one target per value cache (2 threads), every case
interleaved per round after a warm-up round; each call gets tokens sharing no start with the one
before, so nothing is reused. Prints the medians in ms and their ratios to the verified context's
(above 1: faster than it). Run it on an idle machine.
"""

from __future__ import annotations

import random
import statistics
import time

from moaspec.bench.output import write_json
from moaspec.bench.script_args import known_names, output_file, positive_int, positive_ints, run_script, script_parser

VALUE_CACHES = ("f16", "q8_0")
PATHS = ("verified context", "prompt context", "float32 torch", "bfloat16 torch")
TORCH_COMPUTES = {"float32 torch": "float32", "bfloat16 torch": "bfloat16"}


def value_cache_list(text: str) -> list[str]:
    """--value-caches: names of VALUE_CACHES, comma-separated."""
    return known_names(text, VALUE_CACHES, "value cache")


def set_context_ms(target, length: int, path: str, generator: random.Random) -> float:
    """One `set_context` of `length` random tokens on `path` (one of PATHS), in ms."""
    import torch

    import moaspec.targets.llamacpp as llamacpp
    import moaspec.targets.llamacpp_prompt_paths as prompt_paths

    ids = torch.tensor([generator.randrange(100, 20_000) for _ in range(length)])
    thresholds = llamacpp.PROMPT_CONTEXT_MIN_TOKENS, prompt_paths.FLOAT_PREFILL_MIN_TOKENS, target._float_start
    llamacpp.PROMPT_CONTEXT_MIN_TOKENS = 1 if path == "prompt context" else length + 1
    prompt_paths.FLOAT_PREFILL_MIN_TOKENS = 2  # the float path needs a token besides the last
    target._float_start = 2 if path in TORCH_COMPUTES else prompt_paths.NEVER
    if path in TORCH_COMPUTES and target._float_compute != TORCH_COMPUTES[path]:
        target._float_compute, target._float_cache = TORCH_COMPUTES[path], None  # a cache computes one way
    try:
        started = time.perf_counter()
        target.set_context(ids)
        return (time.perf_counter() - started) * 1000
    finally:
        llamacpp.PROMPT_CONTEXT_MIN_TOKENS, prompt_paths.FLOAT_PREFILL_MIN_TOKENS, target._float_start = thresholds


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--lengths", type=positive_ints, default="64,128,256,384,512,1000")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--value-caches", type=value_cache_list, default="f16,q8_0")
    parser.add_argument("--out", type=output_file, help="also write the medians here as JSON")
    args = parser.parse_args()
    import torch

    from moaspec.api import load_target
    from moaspec.calibration.machine import cpu_description
    from moaspec.targets.llamacpp import LlamaCppTarget
    from moaspec.targets.llamacpp_value_cache import VALUE_CACHE_TYPES

    torch.set_num_threads(2)
    loaded = load_target("smollm2-135m", runtime="llama.cpp", threads=2)
    if max(args.lengths) > loaded.max_positions:
        parser.error(f"--lengths: at most {loaded.max_positions} tokens")
    targets = {
        name: LlamaCppTarget(loaded.weights, loaded.tokenizer, loaded.config, loaded.name, threads=2,
                             value_cache=VALUE_CACHE_TYPES[name], float_llama=loaded._float)
        for name in args.value_caches
    }
    generator = random.Random(0)
    times: dict[tuple[str, int, str], list[float]] = {}
    for round_index in range(args.rounds + 1):  # round 0 warms up
        for length in args.lengths:
            for name, target in targets.items():
                for path in PATHS:
                    spent = set_context_ms(target, length, path, generator)
                    if round_index:
                        times.setdefault((name, length, path), []).append(spent)
    medians = {key: statistics.median(values) for key, values in times.items()}
    print(f"CPU: {cpu_description()}; 2 threads; medians of {args.rounds} rounds, ms")
    print("| value cache | prompt tokens | verified context | prompt context | ratio | float32 torch | ratio "
          "| bfloat16 torch | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in args.value_caches:
        for length in args.lengths:
            verified, prompt, floats, bfloats = (medians[(name, length, path)] for path in PATHS)
            print(f"| {name} | {length} | {verified:.0f} | {prompt:.0f} | {verified / prompt:.2f} "
                  f"| {floats:.0f} | {verified / floats:.2f} | {bfloats:.0f} | {verified / bfloats:.2f} |")
            rows.append({"value_cache": name, "prompt_tokens": length, "verified_context_ms": round(verified, 1),
                         "prompt_context_ms": round(prompt, 1), "ratio": round(verified / prompt, 3),
                         "float_ms": round(floats, 1), "float_ratio": round(verified / floats, 3),
                         "bfloat16_ms": round(bfloats, 1), "bfloat16_ratio": round(verified / bfloats, 3)})
    if args.out is not None:
        record = {"cpu": cpu_description(), "threads": 2, "rounds": args.rounds, "rows": rows}
        write_json(args.out, record)
    return 0


if __name__ == "__main__":
    run_script(main)
