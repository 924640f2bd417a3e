"""Write the shipped acceptance profiles the machine calibration reads (moaspec/calibration/profile.py).

    MOASPEC_NO_CALIBRATION=1 .venv/bin/python bench/acceptance_profile.py [--target smollm2-135m]
        [--max-new-tokens 128] [--sharegpt-prompts 36] [--lookup-only | --drafters eagle,...]

- `moaspec/checkpoints/<target>/acceptance.json`: the target's greedy continuations of
  bench/tune.py's CALIBRATION_PROMPTS, of CONTEXT_PROMPTS below and of the first user turns of the
  last `--sharegpt-prompts` ShareGPT conversations (benchmark prompts removed, as for training;
  chat template applied), generated through the engine with the n-gram drafter (lossless, so
  these are the target's own greedy tokens). Open-ended chat alone repeats little, so it
  undervalues prompt lookup for the requests where users feed text in (summaries, edits,
  questions about a document); the context prompts, written for this file and taken from no
  benchmark, and real users' requests from ShareGPT stand for those. The calibration chooses
  among dozens of lookup tries on this text, so it needs thousands of tokens, not a few hundred;
- `moaspec/checkpoints/<target>/<drafter>/acceptance.json` for each shipped drafter: `moaspec
  tune`'s calibration (greedy generation with one-level trees of top-k 1..4 on the same prompts)
  and the digest of the weights it measured.
Acceptance does not depend on the machine, so these are measured once and committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tqdm import tqdm

from moaspec.api import load_target
from moaspec.bench.calibration_prompts import CALIBRATION_PROMPTS
from moaspec.bench.output import write_json
from moaspec.bench.script_args import known_names, positive_int, run_script, script_parser
from moaspec.bench.tune import calibrate
from moaspec.calibration.profile import PROFILE_FILE, LookupSequence, sequences_to_json, weights_digest
from moaspec.chat import encode_chat_prompt
from moaspec.config import GenerationConfig
from moaspec.drafters import SHIPPED, SHIPPED_DIR, make_drafter
from moaspec.engine import Engine
from moaspec.train.sharegpt import load_training_conversations

CONTEXT_PROMPTS = (  # written for the lookup profile; not from any benchmark set
    "Summarize this note in two sentences:\n\nThe garden club met on Tuesday evening. Members agreed to "
    "plant tulips along the north fence in October, to buy two new watering cans, and to hold the spring "
    "sale on the first Saturday of May. Maria will ask the library for a room for the sale.",
    "Fix the bug in this function and return the corrected function:\n\ndef average(values):\n"
    "    total = 0\n    for value in values:\n        total += value\n    return total / len(value)\n",
    "Rewrite this message so it sounds more polite:\n\nSend me the report today. I asked for it last week "
    "and I still do not have it. I need the numbers for the meeting on Friday.",
    "Using only the text below, answer: when does the shop open on Sundays?\n\nThe shop on Green Street "
    "opens at 8 am from Monday to Friday and at 9 am on Saturdays. On Sundays it opens at 10 am and closes "
    "at 4 pm. It is closed on public holidays.",
    "Translate into French: The train to the coast leaves at seven. Please buy two tickets and wait for me "
    "at the station entrance.",
    "Add a docstring and type hints to this function and return the whole function:\n\n"
    "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n        return high\n"
    "    return x\n",
)
SHAREGPT_PROMPT_TOKENS = (16, 400)  # first user turns of this length (chat template included)


def sharegpt_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first user turns of the last `count` ShareGPT conversations whose turn encodes to
    SHAREGPT_PROMPT_TOKENS tokens (the end of the file: the training campaign reads from its start)."""
    low, high = SHAREGPT_PROMPT_TOKENS
    prompts: list[list[int]] = []
    conversations, _ = load_training_conversations() if count else ([], {})
    for conversation in reversed(conversations):
        if len(prompts) == count:
            break
        ids = encode_chat_prompt(tokenizer, conversation.first_prompt)
        if low <= len(ids) <= high:
            prompts.append(ids)
    return prompts


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--sharegpt-prompts", type=int, default=36,
        help="ShareGPT first turns added to the lookup profile's prompts (default 36)",
    )
    parser.add_argument("--lookup-only", action="store_true", help="write the target's lookup profile only")
    parser.add_argument(
        "--drafters", type=lambda text: known_names(text, SHIPPED, "shipped drafter"), default=None,
        help="comma-separated shipped drafters to recalibrate, nothing else (default all + the lookup profile)",
    )
    args = parser.parse_args()
    chosen = SHIPPED if args.drafters is None else tuple(args.drafters)
    if args.lookup_only and args.drafters is not None:
        parser.error("--lookup-only writes the lookup profile alone: leave out --drafters")
    if args.sharegpt_prompts < 0:
        parser.error("--sharegpt-prompts must be >= 0")
    command = " ".join(["bench/acceptance_profile.py", *sys.argv[1:]])
    target = load_target(args.target, runtime="transformers")
    prompts = [encode_chat_prompt(target.tokenizer, prompt) for prompt in CALIBRATION_PROMPTS]

    directory = SHIPPED_DIR / target.name
    if args.drafters is None:
        lookup_prompts = [
            *prompts,
            *(encode_chat_prompt(target.tokenizer, prompt) for prompt in CONTEXT_PROMPTS),
            *sharegpt_prompts(target.tokenizer, args.sharegpt_prompts),
        ]
        engine = Engine(target, make_drafter("ngram", target))
        generation = GenerationConfig(max_new_tokens=args.max_new_tokens)
        sequences = [
            LookupSequence(ids, engine.generate(ids, generation=generation).token_ids)
            for ids in tqdm(lookup_prompts, desc="lookup profile", unit="prompt")
        ]
        _write(directory / PROFILE_FILE, {
            "target": target.name, "command": command,
            "prompts": "moaspec/bench/tune.py CALIBRATION_PROMPTS + bench/acceptance_profile.py CONTEXT_PROMPTS"
            f" + the first turns of the last {args.sharegpt_prompts} ShareGPT conversations"
            f" of {SHAREGPT_PROMPT_TOKENS[0]}-{SHAREGPT_PROMPT_TOKENS[1]} prompt tokens",
            "max_new_tokens": args.max_new_tokens, "lookup_sequences": sequences_to_json(sequences),
        })
    for name in () if args.lookup_only else chosen:
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
    write_json(path, record)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    run_script(main)
