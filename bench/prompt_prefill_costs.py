"""Prompt prefill cost by key/value cache and chunk size: the measurements behind the llama.cpp
runtime's prompt context (README, *Target runtimes*, *Long prompts*). Raw `llama_decode` loops on
the target's GGUF, 2 threads, one fresh context per measurement, every case interleaved per round.

    .venv/bin/python bench/prompt_prefill_costs.py [--lengths 128,256,512,1000] [--rounds 3]

Prints ms per prompt token (medians over rounds) for the runtime's exact q8_0 / f16 cache in
chunks of 512 (the per-query kernel) and for f16 / f16 and f32 / f16 (llama.cpp casts f32 to f16
before attending: its tiled kernel) in chunks of 64-512. Run it on an idle machine.
"""

from __future__ import annotations

import statistics
import time

from llamacpp_probes import CONTEXT, PROBE_CELLS, _context

from moaspec.bench.script_args import positive_int, positive_ints, run_script, script_parser

CASES = {  # label -> (ggml key type, ggml value type, tokens per llama_decode)
    "q8_0/f16, 512": (8, 1, 512),
    "f16/f16, 256": (1, 1, 256),
    "f32/f16, 512": (0, 1, 512),
    "f32/f16, 256": (0, 1, 256),
    "f32/f16, 128": (0, 1, 128),
    "f32/f16, 64": (0, 1, 64),
}


def prefill_ms(weights, key_type: int, value_type: int, length: int, chunk: int) -> float:
    lib = weights.lib
    tokens = (CONTEXT * (length // len(CONTEXT) + 1))[:length]
    ctx = _context(weights, key_type, value_type)
    try:
        started = time.perf_counter()
        for start in range(0, length, chunk):
            part = tokens[start : start + chunk]
            array = (lib.llama_token * len(part))(*part)  # alive until llama_decode has read it
            if lib.llama_decode(ctx, lib.llama_batch_get_one(array, len(part))) != 0:
                raise RuntimeError("llama_decode failed")
        return (time.perf_counter() - started) * 1000
    finally:
        lib.llama_free(ctx)


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--lengths", type=positive_ints, default="128,256,512,1000")
    parser.add_argument("--rounds", type=positive_int, default=3)
    args = parser.parse_args()
    if max(args.lengths) > PROBE_CELLS:
        parser.error(f"--lengths: at most {PROBE_CELLS} tokens (the probe context's cells)")
    import torch

    from moaspec.api import load_target

    torch.set_num_threads(2)
    weights = load_target("smollm2-135m", runtime="llama.cpp", threads=2).weights
    lengths = args.lengths
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for length in lengths:
            for label, (key_type, value_type, chunk) in CASES.items():
                times.setdefault((length, label), []).append(prefill_ms(weights, key_type, value_type, length, chunk))
    print("| prompt tokens | " + " | ".join(CASES) + " |")
    print("|---:|" + "---:|" * len(CASES))
    for length in lengths:
        cells = [f"{statistics.median(times[(length, label)]) / length:.2f}" for label in CASES]
        print(f"| {length} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    run_script(main)
