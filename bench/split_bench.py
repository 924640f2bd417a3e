"""Client-server split benchmark: tokens/s, server calls per 100 tokens, bytes per token and time
to first token per network profile and drafter, then the disconnection experiment.

    python bench/split_bench.py --target smollm2-135m --drafters moa,eagle,ngram --profiles lan,4g,3g
    python bench/split_bench.py --tiny            # random tiny target, seconds, for a smoke run

Prints a table per experiment and a final JSON line. To be wired into `moaspec bench --client-server`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moaspec.split.bench import format_rows, run_disconnection, run_split_bench  # noqa: E402

PROMPTS = [
    "Name three colours and say one thing about each.",
    "Write a short Python function that reverses a string.",
    "Explain in two sentences why the sky is blue.",
]


def _real(target_name: str, drafters: list[str]):
    from moaspec.api import load_target
    from moaspec.chat import encode_chat_prompt
    from moaspec.drafters import make_drafter

    target_factory = lambda: load_target(target_name)  # noqa: E731
    tokenizer = target_factory().tokenizer
    prompts = [encode_chat_prompt(tokenizer, p) for p in PROMPTS]
    return target_factory, {name: (lambda t, name=name: make_drafter(name, t)) for name in drafters}, prompts


def _tiny(drafters: list[str]):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_split import make_drafter  # the random tiny drafters of the test suite
    from conftest import make_tiny_target

    target_factory = lambda: make_tiny_target("llama", num_hidden_layers=3)  # noqa: E731
    prompts = [[5, 17, 33, 2, 71, 5, 17, 33, 2], [3, 1, 4, 1, 5, 9, 2, 6]]
    return target_factory, {name: (lambda t, name=name: make_drafter(name, t)) for name in drafters}, prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--drafters", default="moa,eagle,ngram", help="comma-separated split drafters")
    parser.add_argument("--profiles", default="lan,5g,4g,3g")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--cut-after", type=int, default=16, help="disconnection: verified tokens before the cut")
    parser.add_argument("--offline-tokens", type=int, default=16, help="disconnection: tokens drafted alone")
    parser.add_argument("--tiny", action="store_true", help="random tiny target and drafters (smoke run)")
    args = parser.parse_args()
    drafters = [d for d in args.drafters.split(",") if d]
    target_factory, drafter_factories, prompts = _tiny(drafters) if args.tiny else _real(args.target, drafters)
    rows = run_split_bench(target_factory, drafter_factories, prompts, tuple(args.profiles.split(",")), args.max_new_tokens)
    print(format_rows(rows))
    disconnection = run_disconnection(target_factory, drafter_factories, prompts, args.cut_after, args.offline_tokens)
    print(format_rows(disconnection))
    print(json.dumps({"split": [asdict(r) for r in rows], "disconnection": [asdict(r) for r in disconnection]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
