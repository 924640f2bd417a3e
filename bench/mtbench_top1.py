"""Teacher-forced top-1 of drafters on all 80 MT-bench questions (both turns), per sub-category.

    MOASPEC_NO_CALIBRATION=1 .venv/bin/python bench/mtbench_top1.py --out bench/results/NAME \\
        --drafters moa,eagle,LABEL=DIR,... [--max-new-tokens 128] [--shuffle-memory]

1. The target's greedy answers to both turns (the second asked after its own first answer), made
   once with batched `generate` and kept in `bench/results/mtbench-greedy-<target>.jsonl`
   (reused when present; the text the drafters read, committed).
2. The target's features over those conversations, once (a feature cache in `--cache`, all
   layers' keys/values and TLI depth 1, so every drafter reads it).
3. Each drafter reads the conversations teacher-forced, every answer token a position
   (`trainer.validate`): its top-1 against the target's argmax over the full vocabulary per draft
   depth. For MoA, draft depth d = the trainer's acc_depth{d+1} (positions d steps after the last
   verified token, on a fixed anchor grid); for EAGLE, depth 1 only (the target's true features).
   Greedy decoding follows exactly this text, so depth-1 top-1 is the chance that the drafter's
   first guess is accepted. Depth 1 is also reported per turn (`depth1_by_turn`): the second
   turn's answers follow the target's own first answer, a context the first-turn training data lacks.
A drafter named `X+ngram` (the default drafter form, `moa+ngram`) is scored at draft depth 1 as
the engine drafts with prompt lookup: where the n-gram lookup has a continuation of the context
and root, its first token is the guess, elsewhere X's (`lookup` in top1.json: how often it
answered and how often it was right then).
With `--shuffle-memory`, every conversation's target features that a drafter reads as input
(MoA: the memory's keys/values and hidden states; EAGLE: its hidden states) are permuted across
positions first (the target's argmax, which top-1 is scored against, is not): what top-1 loses
then is what the drafter takes from the target's activations rather than from the tokens.
Writes `<out>/top1.json` and `<out>/top1.md` (per sub-category and overall).
"""

from __future__ import annotations

import argparse
import functools
import json
import operator
import sys
from pathlib import Path

import torch

from moaspec.atomic_files import write_file_atomically
from moaspec.bench.output import write_json
from moaspec.bench.script_args import output_directory, positive_int, run_script, script_parser, text_items
from moaspec.errors import MoaspecError

ROOT = Path(__file__).resolve().parent.parent
MAX_DEPTH = 6  # validate's anchor grid: MoA draft depths 1..5


def greedy_answers(target, prompts, max_new_tokens: int, batch_size: int = 16) -> list[list[str]]:
    """[[answer to turn 1, answer to turn 2]] per prompt: batched greedy generate, left padded."""
    from moaspec.chat import encode_chat_messages

    tokenizer, model = target.tokenizer, target.model
    stop = sorted(target.stop_ids)
    answers: list[list[str]] = [[] for _ in prompts]
    for turn in range(2):
        messages = []
        for prompt, done in zip(prompts, answers):
            history = [m for t in range(turn) for m in ({"role": "user", "content": prompt.turns[t]},
                                                        {"role": "assistant", "content": done[t]})]
            messages.append(history + [{"role": "user", "content": prompt.turns[turn]}])
        encoded = [encode_chat_messages(tokenizer, m) for m in messages]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            width = max(len(encoded[i]) for i in rows)
            ids = torch.tensor([[stop[0]] * (width - len(encoded[i])) + encoded[i] for i in rows])
            mask = torch.tensor([[0] * (width - len(encoded[i])) + [1] * len(encoded[i]) for i in rows])
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=stop, pad_token_id=stop[0])
            for row, i in enumerate(rows):
                new = out[row, width:].tolist()
                cut = next((k + 1 for k, token in enumerate(new) if token in stop), len(new))
                answers[i].append(tokenizer.decode(new[:cut], skip_special_tokens=True))
            print(f"mtbench_top1: turn {turn + 1}, {min(start + batch_size, len(order))}/{len(order)}", file=sys.stderr)
    return answers


def conversations(target, max_new_tokens: int) -> list[dict]:
    """The committed greedy conversations, made first when missing."""
    from moaspec.bench.prompts import load_mt_bench

    path = ROOT / "bench" / "results" / f"mtbench-greedy-{target.name}.jsonl"
    if path.is_file():
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        stored = {record.get("max_new_tokens") for record in records}
        if stored != {max_new_tokens}:
            raise MoaspecError(
                f"{path} holds answers of up to {', '.join(map(str, sorted(stored, key=str)))} tokens, not "
                f"{max_new_tokens}: pass that --max-new-tokens, or move the file to make new ones"
            )
        return records
    prompts = load_mt_bench()
    answers = greedy_answers(target, prompts, max_new_tokens)
    records = [
        {"question_id": p.prompt_id, "category": p.subcategory, "turns": list(p.turns), "answers": a,
         "max_new_tokens": max_new_tokens}
        for p, a in zip(prompts, answers)
    ]
    write_file_atomically(path, "".join(json.dumps(r) + "\n" for r in records))  # read back by later runs
    return records


def samples_of(target, records: list[dict]):
    """TrainSamples: each conversation through the chat template, both answers learned."""
    from moaspec.train.features import TrainSample
    from moaspec.train.teacher_forced import encode_conversation

    samples, categories = [], []
    for record in records:
        turns = []
        for question, answer in zip(record["turns"], record["answers"]):
            turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        encoded = encode_conversation(target.tokenizer, turns, 4096, target.tokenizer.eos_token_id)
        if encoded is None:
            raise SystemExit(f"mtbench_top1: question {record['question_id']} does not encode")
        ids, spans = encoded
        samples.append(TrainSample(torch.tensor(ids), spans[0][0], len(samples), tuple(spans)))
        categories.append(record["category"])
    return samples, categories


class ShuffledInputs:
    """A FeatureSource whose keys/values and hidden states are permuted across each sequence's
    positions (a fixed permutation per sequence); the teacher's argmax and log-sum-exp stay."""

    def __init__(self, source, seed: int = 0) -> None:
        self.source, self.seed = source, seed

    def features(self, sample, tli_layers: int, kv_layers: tuple[int, ...]):
        import dataclasses

        features = self.source.features(sample, tli_layers, kv_layers)
        length = features.final_hidden.shape[0]
        order = torch.randperm(length, generator=torch.Generator().manual_seed(self.seed + sample.index))
        layer_kv = features.layer_kv[order] if features.layer_kv.numel() else features.layer_kv
        return dataclasses.replace(features, layer_kv=layer_kv, final_hidden=features.final_hidden[order])


LOOKUP_SUFFIX = "+ngram"


def lookup_guesses(token_ids: list[int]) -> list[int | None]:
    """For every root position r: the n-gram drafter's first token after token_ids[: r + 1]
    (its best continuation of the context and root, as `draft_alone` takes it), None without a match."""
    from moaspec.drafters.ngram import NgramDrafter

    lookup, guesses = NgramDrafter(), []
    for root in token_ids:
        found = lookup.continuations(root)
        guesses.append(found[0][0] if found else None)
        lookup.accept_context(torch.tensor([root]), len(lookup.history), {})
    return guesses


def turn_of(root: int, spans: tuple[tuple[int, int], ...]) -> int:
    """Which answer (0: the first turn's) holds root position `root` and the token after it (a
    scored root lies in start <= root <= end - 2 of its span: `trainer.loss_mask`)."""
    return next(k for k, (start, end) in enumerate(spans) if start <= root < end - 1)


def depth_one_counts(net, parts, source, samples, config, with_lookup: bool) -> list[dict]:
    """Depth-1 top-1 counts of the drafter over `samples`, one dict per answer turn; with_lookup:
    the n-gram lookup's first token where it has one, the drafter's elsewhere."""
    from moaspec.train.trainer import first_guesses, kv_layers_read

    turns: list[dict] = []
    net.eval()
    for sample in samples:
        features = source.features(sample, config.tli_layers, kv_layers_read(net, config))
        with torch.inference_mode():
            roots, model_guesses = first_guesses(net, parts, sample, features, config, MAX_DEPTH)
        count_by_turn(turns, sample, roots, model_guesses, features.target_argmax.cpu(), with_lookup)
    return turns


def count_by_turn(turns: list[dict], sample, roots, model_guesses, target_next, with_lookup: bool = False) -> None:
    """Add one sample's depth-1 guesses (roots [R], model_guesses [R], target_next [T]) to the
    per-turn counts `turns` (grown to the sample's turns); with_lookup as `depth_one_counts`."""
    lookup = lookup_guesses(sample.input_ids.tolist()) if with_lookup else None
    spans = sample.spans()
    while len(turns) < len(spans):
        turns.append({"hits": 0, "positions": 0, "lookup_answered": 0, "lookup_hits": 0})
    for root, model_guess in zip(roots.tolist(), model_guesses.tolist()):
        counts, wanted = turns[turn_of(root, spans)], int(target_next[root])
        guess = None if lookup is None else lookup[root]
        if guess is not None:
            counts["lookup_answered"] += 1
            counts["lookup_hits"] += guess == wanted
        else:
            guess = model_guess
        counts["hits"] += guess == wanted
        counts["positions"] += 1


def turn_rates(turns: list[dict]) -> dict:
    """{"turn1": top-1, "turn2": top-1, ...} of `depth_one_counts`' per-turn counts."""
    return {f"turn{k + 1}": counts["hits"] / max(counts["positions"], 1) for k, counts in enumerate(turns)}


def summed(turns: list[dict]) -> dict:
    return {key: sum(counts[key] for counts in turns) for key in ("hits", "positions", "lookup_answered", "lookup_hits")}


def evaluate(label: str, spec: str, target, source, samples, categories) -> dict:
    from moaspec.drafters import checkpoint_directory
    from moaspec.nn.eagle import EagleDrafterNet
    from moaspec.nn.moa import MoADrafterNet
    from moaspec.train.config import TrainConfig
    from moaspec.train.trainer import validation_counts

    with_lookup = spec.endswith(LOOKUP_SUFFIX)
    directory = checkpoint_directory(spec.removesuffix(LOOKUP_SUFFIX), target.name)
    method = json.loads((directory / "config.json").read_text())["method"]
    net, _ = (MoADrafterNet if method == "moa" else EagleDrafterNet).from_pretrained(directory, target)
    net = net.float()
    tli = net.config.tli_layers if method == "moa" else 0
    config = TrainConfig(method=method, tli_layers=tli)
    parts = target.parts(tli)
    offset = 1 if method == "moa" else 0
    depths = range(1, MAX_DEPTH - offset + 1) if method == "moa" else range(1, 2)
    if with_lookup:
        return evaluate_with_lookup(label, spec, method, net, parts, source, samples, categories, config)
    by_category, turns = {}, []
    for category in sorted(set(categories)):
        chosen = [s for s, c in zip(samples, categories) if c == category]
        by_category[category] = validation_counts(
            net, parts, source, chosen, config, MAX_DEPTH, on_first_guesses=functools.partial(count_by_turn, turns)
        )
    by_category["all"] = functools.reduce(operator.add, by_category.values())  # the categories are disjoint
    rows = {}
    for category, counts in by_category.items():
        accuracy = counts.summary()
        rows[category] = {f"depth{d}": accuracy.get(f"acc_depth{d + offset}") for d in depths}
        print(f"mtbench_top1: {label} {category} {rows[category]}", file=sys.stderr)
    by_turn = turn_rates(turns)
    return {"label": label, "source": spec, "method": method, "by_category": rows, "depth1_by_turn": by_turn}


def evaluate_with_lookup(label, spec, method, net, parts, source, samples, categories, config) -> dict:
    """`evaluate` for `X+ngram`: depth 1 only, per category, with the lookup's share."""
    rows, lookup = {}, {}
    per_category = []
    for category in sorted(set(categories)):
        chosen = [s for s, c in zip(samples, categories) if c == category]
        per_category.append(depth_one_counts(net, parts, source, chosen, config, with_lookup=True))
        rows[category], lookup[category] = _lookup_summary(summed(per_category[-1]))
    rows["all"], lookup["all"] = _lookup_summary(summed([counts for turns in per_category for counts in turns]))
    for category, row in rows.items():
        print(f"mtbench_top1: {label} {category} {row} {lookup[category]}", file=sys.stderr)
    turn_count = max(len(turns) for turns in per_category)
    by_turn = turn_rates([summed([turns[k] for turns in per_category if k < len(turns)]) for k in range(turn_count)])
    return {"label": label, "source": spec, "method": method, "by_category": rows, "lookup": lookup, "depth1_by_turn": by_turn}


def _lookup_summary(counts: dict) -> tuple[dict, dict]:
    positions, answered = max(counts["positions"], 1), counts["lookup_answered"]
    lookup = {"answered": answered / positions, "hit_rate_when_answered": counts["lookup_hits"] / answered if answered else None}
    return {"depth1": counts["hits"] / positions}, lookup


def check_drafters(parser: argparse.ArgumentParser, drafters: list[str]) -> None:
    """Every NAME or LABEL=DIR of --drafters names a drafter (argparse's error otherwise), before
    the features are computed (minutes)."""
    from moaspec.drafters import MODEL_FREE, check_drafter_spec

    for item in drafters:
        spec = item.partition("=")[2] if "=" in item else item
        try:
            check_drafter_spec(spec)
        except MoaspecError as exc:
            parser.error(str(exc))
        if spec in MODEL_FREE:  # no net to score (`moa+ngram` scores the lookup beside one)
            parser.error(f"--drafters: '{spec}' is not a model drafter (moa, eagle, X+ngram or a checkpoint)")


def feature_cache_dir(given: str | None) -> Path:
    """--cache, else features/mtbench in moaspec's cache directory (model_store.cache_root)."""
    from moaspec.model_store import cache_root

    return Path(given) if given else cache_root() / "features" / "mtbench"


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--out", type=output_directory, required=True, help="output directory")
    parser.add_argument("--drafters", type=text_items, required=True, help="comma-separated NAME or LABEL=DIR")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128, help="greedy tokens per answer (default 128)")
    parser.add_argument(
        "--cache", default=None, help="feature cache directory (default: features/mtbench in moaspec's cache, ~700 MB)"
    )
    parser.add_argument(
        "--shuffle-memory", action="store_true",
        help="permute the target features the drafters read across positions (see the module docstring)",
    )
    args = parser.parse_args(argv)
    check_drafters(parser, args.drafters)
    from moaspec.api import load_target
    from moaspec.nn.checkpoint import target_fingerprint
    from moaspec.train.feature_cache import build_feature_cache

    target = load_target(args.target, dtype=torch.float32, runtime="transformers")
    records = conversations(target, args.max_new_tokens)
    samples, categories = samples_of(target, records)
    fingerprint = target_fingerprint(target)
    layers = tuple(range(target.num_layers))
    source = build_feature_cache(target, samples, feature_cache_dir(args.cache), fingerprint, tli_max=1, kv_layers=layers)
    source.check(samples, fingerprint, 1, layers)
    if args.shuffle_memory:
        source = ShuffledInputs(source)
    results = []
    for item in args.drafters:
        label, _, spec = item.partition("=") if "=" in item else (item, "", item)
        results.append(evaluate(label, spec, target, source, samples, categories))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    learned = sum(end - start for s in samples for start, end in s.spans())
    command = " ".join(["bench/mtbench_top1.py", *(sys.argv[1:] if argv is None else argv)])
    write_json(out / "top1.json", {"target": target.name, "command": command, "answer_tokens": learned,
                                   "conversations": len(samples), "drafters": results})
    shuffled = ", drafters' input features shuffled across positions" if args.shuffle_memory else ""
    title = f"Teacher-forced top-1 vs the target's argmax, 80 MT-bench questions x 2 turns ({learned} answer tokens)"
    lines = [title + shuffled,
             "", "| drafter | category | depth 1 | 2 | 3 | 4 | 5 |", "|---|---|---:|---:|---:|---:|---:|"]
    for result in results:
        for category, row in result["by_category"].items():
            cells = [f"{row.get(f'depth{d}'):.3f}" if row.get(f"depth{d}") is not None else "–" for d in range(1, 6)]
            lines.append(f"| {result['label']} | {category} | " + " | ".join(cells) + " |")
    lines += ["", "Depth 1 by turn (the second asked after the target's own first answer):", "",
              "| drafter | turn 1 | turn 2 |", "|---|---:|---:|"]
    for result in results:
        by_turn = result["depth1_by_turn"]
        lines.append(f"| {result['label']} | {by_turn['turn1']:.3f} | {by_turn['turn2']:.3f} |")
    for result in results:
        if "lookup" in result:
            share = result["lookup"]["all"]
            rate = share["hit_rate_when_answered"]
            lines.append(f"\n`{result['label']}`: the lookup guessed at {share['answered']:.3f} of the depth-1 positions"
                         + (f", right {rate:.3f} of those times" if rate is not None else ""))
    write_file_atomically(out / "top1.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    run_script(main)
