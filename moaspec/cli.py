"""`moaspec` command line.

    moaspec generate --prompt TEXT [--target NAME|PATH] [--drafter NAME|PATH] [--max-new-tokens N]
                     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--json] [--raw]

    moaspec data distill --out DIR [--target NAME|PATH] [--num-conversations N] [--batch-size B]
                         [--max-new-tokens N] [--max-prompt-tokens N] [--sampled-fraction F]
                         [--shard-size N] [--seed S]
    moaspec data stats DIR

Text streams to stdout as it is verified; `--json` prints one JSON object at the end instead.
`data distill` has the target regenerate ShareGPT responses into resumable jsonl shards (rerun the
same command to resume); `data stats` summarises such a directory.
Bad input prints one line `moaspec: error: ...` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from moaspec.errors import MoaspecError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise MoaspecError(message)


def _build_parser() -> argparse.ArgumentParser:
    from moaspec.drafters import DEFAULT_DRAFTER
    from moaspec.model_store import DEFAULT_TARGET

    parser = _Parser(prog="moaspec", description="Lossless speculative decoding with Mixture of Attentions.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--target", default=DEFAULT_TARGET, help=f"built-in name, HF directory or .gguf (default {DEFAULT_TARGET})")
    gen.add_argument("--drafter", default=DEFAULT_DRAFTER, help=f"drafter name or checkpoint (default {DEFAULT_DRAFTER})")
    gen.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = all (default 0)")
    gen.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    _add_data_parser(commands, DEFAULT_TARGET)
    return parser


def _add_data_parser(commands, default_target: str) -> None:
    data = commands.add_parser("data", help="build drafter-training data")
    actions = data.add_subparsers(dest="data_command", metavar="{distill,stats}", required=True, parser_class=_Parser)
    distill = actions.add_parser("distill", help="the target regenerates ShareGPT responses (resumable)")
    distill.add_argument("--out", required=True, help="output directory (rerun the same command to resume)")
    distill.add_argument(
        "--target", default=default_target, help=f"target that writes the responses (default {default_target})"
    )
    distill.add_argument("--num-conversations", type=int, default=None, help="how many prompts (default all)")
    distill.add_argument("--batch-size", type=int, default=16, help="prompts per generate() call (default 16)")
    distill.add_argument("--max-new-tokens", type=int, default=256, help="longest response in tokens (default 256)")
    distill.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer prompts (default 512)")
    distill.add_argument(
        "--sampled-fraction",
        type=float,
        default=0.5,
        help="share of batches sampled at temperature 0.7, the rest greedy (default 0.5)",
    )
    distill.add_argument("--shard-size", type=int, default=1000, help="records per jsonl shard (default 1000)")
    distill.add_argument(
        "--seed", type=int, default=0, help="prompt shuffle, batch modes and sampling seeds (default 0)"
    )
    stats = actions.add_parser("stats", help="summarise a distilled data directory")
    stats.add_argument("dir", help="a directory written by `moaspec data distill`")


def _generate(args: argparse.Namespace) -> int:
    from moaspec.config import GenerationConfig, SamplingConfig

    # Validate everything cheap before the model loads.
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed)
    if not args.prompt.strip():
        raise MoaspecError("the prompt is empty")
    from moaspec.drafters import check_drafter_spec
    from moaspec.model_store import resolve_target

    check_drafter_spec(args.drafter)
    resolve_target(args.target)  # unknown name / bad path: fail before torch loads

    from moaspec.api import load

    lm = load(target=args.target, drafter=args.drafter)
    streamer = None
    if not args.json:
        from transformers import TextStreamer

        streamer = TextStreamer(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = lm.generate(
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        raw=args.raw,
        streamer=streamer,
    )
    if args.json:
        record = {"target": lm.target.name, "drafter": args.drafter, **out.to_dict()}
        print(json.dumps(record))
    else:
        sys.stdout.flush()
        print(
            f"[moaspec] {out.stats.new_tokens} tokens, tau {out.stats.tau:.2f}, "
            f"{out.stats.tokens_per_s:.1f} tok/s",
            file=sys.stderr,
        )
    return 0


def _data_distill(args: argparse.Namespace) -> int:
    import shlex
    from dataclasses import asdict
    from pathlib import Path

    from moaspec.train.distill import DistillConfig, check_resume, run_distill
    from moaspec.train.sharegpt import sharegpt_path

    # Validate everything cheap before torch loads.
    config = DistillConfig(
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        batch_size=args.batch_size,
        sampled_fraction=args.sampled_fraction,
        shard_size=args.shard_size,
        seed=args.seed,
        num_conversations=args.num_conversations,
    )
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise MoaspecError(f"--out {out} exists and is not a directory")
    if not out.absolute().parent.is_dir():
        raise MoaspecError(f"the parent directory of --out {out} does not exist")
    if out.is_dir():
        check_resume(out, {"target": args.target, **asdict(config)})
    sharegpt_path()
    from moaspec.model_store import resolve_target

    resolve_target(args.target)
    command = shlex.join(["moaspec", *(sys.argv[1:] if args.argv is None else args.argv)])
    manifest = run_distill(args.target, out, config, command)
    totals = manifest["totals"]
    print(
        f"[moaspec] {totals['num_records']} records, {totals['response_tokens']} response tokens "
        f"in {out} ({'complete' if manifest['complete'] else 'incomplete'})",
        file=sys.stderr,
    )
    return 0


def _data_stats(args: argparse.Namespace) -> int:
    from pathlib import Path

    from moaspec.train.distill import MANIFEST, read_shards, shard_files, summarize

    root = Path(args.dir)
    if not root.is_dir() or not shard_files(root):
        raise MoaspecError(f"{root} is not a directory with shard-*.jsonl files")
    manifest = json.loads((root / MANIFEST).read_text()) if (root / MANIFEST).is_file() else {}
    summary = summarize(read_shards(root), manifest.get("eos_ids", ()))
    n = summary["num_records"]
    print(f"records          {n} ({summary['num_greedy']} greedy, {summary['num_sampled']} sampled)")
    print(f"prompt tokens    {summary['prompt_tokens']} (mean {summary['mean_prompt_tokens']:.1f})")
    print(f"response tokens  {summary['response_tokens']} (mean {summary['mean_response_tokens']:.1f})")
    if "fraction_ended_with_eos" in summary:
        print(f"ended with eos   {summary['fraction_ended_with_eos']:.1%}")
    if manifest:
        selected = manifest.get("counts", {}).get("selected")
        print(f"target           {manifest.get('target')}; {n}/{selected} prompts done")
        print(f"wall time        {manifest.get('wall_s_total', 0.0):.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
        if args.command == "data":
            args.argv = argv
            return _data_distill(args) if args.data_command == "distill" else _data_stats(args)
        return _generate(args)
    except MoaspecError as exc:
        print(f"moaspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("moaspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
