"""How well a drafter's reported probability predicts its offline tokens (split deployment, link down).

In-process equivalent of the disconnection experiment (`moaspec bench --client-server
--disconnect-after N`): generate N tokens with the drafter (greedy, lossless: the target's own),
then let it draft M tokens alone (`draft_alone`, exactly what the split client calls) and compare
them with the target's own greedy continuation. For every stopping threshold P it reports what
`--offline-min-prob P` would write: tokens written, leading tokens agreeing with the target, and
their ratio; and, per drafter, how often a token whose prefix agreed is right (conditional
precision), in all and by where the token came from (`AloneDraft.source`: the model, a lookup
copy, or a copy the model's first choice agrees with): the measurements behind the copy
precisions in moaspec/drafters/ngram.py.

    .venv/bin/python bench/offline_confidence.py --out DIR [--categories mt_bench,humaneval]
        [--limit 25] [--skip 10] [--drafters ngram,moa,moa+ngram] [--cut-after 16] [--offline-tokens 24]

`--skip K` leaves out each category's first K items (per --limit's even draw): the disconnection
experiment of the README uses the first 10 of qa and mt_bench, so the defaults calibrate on others.
Writes DIR/results.json (every offline token) and DIR/results.md, which ends with every drafter's
agreeing tokens at equal output (drafters' probabilities differ in scale, so one P makes them
write different amounts); `--report-only` rewrites results.md from results.json. One torch thread.
"""

from __future__ import annotations

import json
from pathlib import Path

from moaspec.atomic_files import write_file_atomically
from moaspec.bench.output import write_json
from moaspec.bench.script_args import (
    category_list,
    non_negative_int,
    output_directory,
    positive_int,
    run_script,
    script_parser,
    text_items,
)

THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
FINE_THRESHOLDS = tuple(i / 200 for i in range(201))  # agreeing_at's sweep
EQUAL_OUTPUT_AT = (0.3, 0.4, 0.5, 0.6)  # the first drafter's totals at these P set the equal-output table


def offline_tokens(target, spec: str, prompt_ids: list[int], cut_after: int, count: int) -> list[dict] | None:
    """Draft `count` tokens alone after `cut_after` verified ones; -> [{token, probability, right}]
    (right: equal to the target's own token at that place), or None when the answer ends first."""
    import torch

    from moaspec.config import GenerationConfig, SamplingConfig
    from moaspec.drafters import make_drafter
    from moaspec.drafters.none import NoDrafter
    from moaspec.engine import Engine

    drafter = make_drafter(spec, target)
    verified = Engine(target, drafter).generate(prompt_ids, generation=GenerationConfig(max_new_tokens=cut_after)).token_ids
    if len(verified) < cut_after or verified[-1] in target.stop_ids:
        return None
    expected = Engine(target, NoDrafter()).generate([*prompt_ids, *verified], generation=GenerationConfig(max_new_tokens=count)).token_ids
    rows, root, generator = [], verified[-1], torch.Generator().manual_seed(0)
    for index in range(count):
        draft = drafter.draft_alone(root, SamplingConfig(), generator)
        if draft is None:  # n-gram without a match: it would wait for the server
            break
        rows.append({"token": draft.token_id, "probability": draft.probability, "source": draft.source,
                     "right": index < len(expected) and draft.token_id == expected[index]})
        root = draft.token_id
    return rows


def stopping_table(generations: list[list[dict]], thresholds: tuple[float, ...] = THRESHOLDS) -> list[dict]:
    """What `--offline-min-prob P` would write, for each P in `thresholds` (pooled over generations)."""
    table = []
    for threshold in thresholds:
        written = agreeing = 0
        for rows in generations:
            probability, prefix_right = 1.0, True
            for row in rows:
                probability *= row["probability"]
                if probability < threshold:
                    break
                written += 1
                prefix_right = prefix_right and row["right"]
                agreeing += prefix_right
        table.append({"min_prob": threshold, "written": written, "agreeing": agreeing,
                      "agreement": round(agreeing / written, 4) if written else None})  # None: nothing written
    return table


def agreeing_at(generations: list[list[dict]], written: int) -> float | None:
    """Agreeing tokens (from the first) when the drafter writes `written` offline tokens in all:
    P swept over FINE_THRESHOLDS, linear between the two nearest totals it writes; None outside
    them. Drafters report probabilities on different scales, so the same P makes them write
    different amounts: this compares them at equal output."""
    best: dict[int, int] = {}
    for row in stopping_table(generations, FINE_THRESHOLDS):
        best[row["written"]] = max(best.get(row["written"], 0), row["agreeing"])
    totals = sorted(best)
    if not totals or not totals[0] <= written <= totals[-1]:
        return None
    above = next(total for total in totals if total >= written)
    below = max(total for total in totals if total <= written)
    if above == below:
        return float(best[above])
    return best[below] + (best[above] - best[below]) * (written - below) / (above - below)


def conditional_precision(generations: list[list[dict]]) -> dict[str, list[int]]:
    """{source: [right, drafted]} over tokens whose earlier offline tokens all agreed with the
    target, per AloneDraft.source and in "all"."""
    counts: dict[str, list[int]] = {"all": [0, 0]}
    for rows in generations:
        for row in rows:
            for key in ("all", row["source"]):
                counts.setdefault(key, [0, 0])
                counts[key][0] += row["right"]
                counts[key][1] += 1
            if not row["right"]:
                break
    return counts


def main() -> None:
    parser = script_parser(__doc__)
    parser.add_argument("--out", type=output_directory, required=True)
    parser.add_argument("--categories", type=category_list, default="mt_bench,humaneval")
    parser.add_argument("--limit", type=positive_int, default=25)
    parser.add_argument("--skip", type=non_negative_int, default=10)
    parser.add_argument("--drafters", type=text_items, default="ngram,moa,moa+ngram")
    parser.add_argument("--cut-after", type=positive_int, default=16)
    parser.add_argument("--offline-tokens", type=positive_int, default=24)
    parser.add_argument("--report-only", action="store_true", help="rewrite DIR/results.md from DIR/results.json")
    args = parser.parse_args()
    out = Path(args.out)
    if args.report_only and not (out / "results.json").is_file():
        parser.error(f"--report-only rewrites {out / 'results.md'} from {out / 'results.json'}, which is missing")
    if not args.report_only and args.skip >= args.limit:
        parser.error(f"--skip {args.skip} leaves none of the --limit {args.limit} prompts of each category")
    if args.report_only:
        results = json.loads((out / "results.json").read_text())
        write_file_atomically(out / "results.md", "\n".join(report(results)) + "\n")
        return

    import torch

    import moaspec.api
    from moaspec.bench.prompts import load_prompts
    from moaspec.chat import encode_chat_messages

    torch.set_num_threads(1)
    target = moaspec.api.load_target("smollm2-135m", runtime="transformers")
    items = [item for group in load_prompts(args.categories, args.limit).values() for item in group[args.skip:]]
    results = {"command": " ".join(["bench/offline_confidence.py", *__import__("sys").argv[1:]]), "drafters": {}}
    for spec in args.drafters:
        generations = {}
        for item in items:
            prompt_ids = encode_chat_messages(target.tokenizer, [*item.history, {"role": "user", "content": item.turns[0]}])
            rows = offline_tokens(target, spec, prompt_ids, args.cut_after, args.offline_tokens)
            if rows is not None:
                generations[f"{item.category}/{item.prompt_id}"] = rows
        table = stopping_table(list(generations.values()))
        precision = conditional_precision(list(generations.values()))
        results["drafters"][spec] = {"generations": generations, "stopping": table, "conditional_precision": precision}
        print(f"{spec}: {len(generations)} generations", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "results.json", results, indent=None)
    lines = report(results)
    write_file_atomically(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def report(results: dict) -> list[str]:
    """results.md's lines: each drafter's stopping table and precision by source, then every
    drafter's agreeing tokens at the first drafter's totals for EQUAL_OUTPUT_AT."""
    lines = ["# Offline confidence (drafting alone after a cut)", "", f"`{results['command']}`", ""]
    drafters = results["drafters"]
    for spec, measured in drafters.items():
        precision = measured["conditional_precision"]
        if isinstance(precision, list):  # results written before session 15: [right, drafted] in all
            precision = {"all": precision}
        by_source = "; ".join(f"{key} {right} of {drafted}" for key, (right, drafted) in precision.items() if key != "all")
        right, drafted = precision["all"]
        by_source = f": {by_source}" if by_source else ""
        lines += [f"## {spec} ({len(measured['generations'])} generations; right when the prefix agreed: {right} of {drafted}{by_source})", "",
                  "| min prob | written | agreeing | agreement |", "|---:|---:|---:|---:|"]
        lines += [
            f"| {r['min_prob']:g} | {r['written']} | {r['agreeing']} | "
            f"{'n/a' if r['agreement'] is None else format(r['agreement'], '.2f')} |"
            for r in measured["stopping"]
        ]
        lines.append("")
    first = next(iter(drafters))
    totals = list(dict.fromkeys(row["written"] for row in drafters[first]["stopping"] if row["min_prob"] in EQUAL_OUTPUT_AT and row["written"]))
    if len(drafters) > 1 and totals:
        lines += [f"## At equal output: agreeing tokens when each drafter writes as many as `{first}` at P = "
                  + ", ".join(f"{p:g}" for p in EQUAL_OUTPUT_AT), "",
                  "P is swept in steps of 0.005 and the totals interpolated (`agreeing_at`); – where a drafter never writes that many.", "",
                  "| drafter | " + " | ".join(f"{total} written" for total in totals) + " |", "|---|" + "---:|" * len(totals)]
        for spec, measured in drafters.items():
            generations = list(measured["generations"].values())
            cells = []
            for total in totals:
                agreeing = agreeing_at(generations, total)
                cells.append("–" if agreeing is None else f"{agreeing:.1f} ({agreeing / total:.2f})")
            lines.append(f"| {spec} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


if __name__ == "__main__":
    run_script(main)
