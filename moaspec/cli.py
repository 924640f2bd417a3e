"""`moaspec` command line.

    moaspec generate --prompt TEXT [--target NAME|PATH] [--drafter NAME|PATH] [--max-new-tokens N]
                     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--json] [--raw]

Text streams to stdout as it is verified; `--json` prints one JSON object at the end instead.
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
    return parser


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


def main(argv: list[str] | None = None) -> int:
    try:
        args = _build_parser().parse_args(argv)
        return _generate(args)
    except MoaspecError as exc:
        print(f"moaspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("moaspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
