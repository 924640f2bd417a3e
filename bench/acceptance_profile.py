"""Write the shipped acceptance profiles the machine calibration reads (moaspec/calibration/profile.py).

    MOASPEC_NO_CALIBRATION=1 .venv/bin/python bench/acceptance_profile.py [--target smollm2-135m]
        [--max-new-tokens 128]

- `moaspec/checkpoints/<target>/acceptance.json`: the target's greedy continuations of
  bench/tune.py's CALIBRATION_PROMPTS (chat template applied), generated through the engine with
  the n-gram drafter (lossless, so these are the target's own greedy tokens);
- `moaspec/checkpoints/<target>/<drafter>/acceptance.json` for each shipped drafter: `moaspec
  tune`'s calibration (greedy generation with one-level trees of top-k 1..4 on the same prompts)
  and the digest of the weights it measured.
Acceptance does not depend on the machine, so these are measured once and committed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moaspec.api import load_target
from moaspec.bench.tune import CALIBRATION_PROMPTS, calibrate
from moaspec.calibration.profile import PROFILE_FILE, LookupSequence, sequences_to_json, weights_digest
from moaspec.chat import encode_chat_prompt
from moaspec.config import GenerationConfig
from moaspec.drafters import SHIPPED, SHIPPED_DIR, make_drafter
from moaspec.engine import Engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    command = " ".join(["bench/acceptance_profile.py", *sys.argv[1:]])
    target = load_target(args.target)
    prompts = [encode_chat_prompt(target.tokenizer, prompt) for prompt in CALIBRATION_PROMPTS]

    engine = Engine(target, make_drafter("ngram", target))
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
    sequences = [LookupSequence(ids, engine.generate(ids, generation=generation).token_ids) for ids in prompts]
    directory = SHIPPED_DIR / target.name
    _write(directory / PROFILE_FILE, {
        "target": target.name, "command": command, "prompts": "moaspec/bench/tune.py CALIBRATION_PROMPTS",
        "max_new_tokens": args.max_new_tokens, "lookup_sequences": sequences_to_json(sequences),
    })
    for name in SHIPPED:
        checkpoint = directory / name
        if not checkpoint.is_dir():
            continue
        result = calibrate(make_drafter(name, target), target, prompts, args.max_new_tokens)
        print(f"{name}: {result}", flush=True)
        _write(checkpoint / PROFILE_FILE, {
            "drafter": name, "command": command, "prompts": "moaspec/bench/tune.py CALIBRATION_PROMPTS",
            "max_new_tokens": args.max_new_tokens, "weights_sha256": weights_digest(checkpoint), **result,
        })
    return 0


def _write(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
