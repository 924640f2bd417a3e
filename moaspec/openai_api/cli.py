"""`moaspec serve` flags of the OpenAI-compatible API, kept here so the serve command (issue 6,
moaspec/cli.py and moaspec/split/commands.py) needs two lines to expose them:

    add_openai_arguments(serve_parser)                                    # in _add_serve_parser
    SplitServer(target, drafter, keys, limits, openai_limits_from_args(args))  # in serve()
"""

from __future__ import annotations

import argparse

from moaspec.errors import MoaspecError
from moaspec.serving.limits import OpenAILimits


def add_openai_arguments(parser: argparse.ArgumentParser) -> None:
    default = OpenAILimits()
    group = parser.add_argument_group("OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions, /health, /metrics)")
    group.add_argument(
        "--max-queue", type=int, default=default.max_waiting,
        help=f"generations that may wait while one runs; one more gets 429 (default {default.max_waiting})",
    )


def openai_limits_from_args(args: argparse.Namespace) -> OpenAILimits:
    if args.max_queue < 0:
        raise MoaspecError(f"--max-queue must be >= 0, got {args.max_queue}")
    return OpenAILimits(max_waiting=args.max_queue)
