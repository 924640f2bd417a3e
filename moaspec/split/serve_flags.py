"""`moaspec serve` flags for connection and memory limits (issue 19), kept here so moaspec/cli.py
needs two lines to expose them:

    add_limit_arguments(serve_parser)      # in _add_serve_parser
    server_limits_from_args(args)          # in _serve (checks them before any model loads)

`server_limits_from_args` also gathers the older limit flags defined in cli.py into one
`ServerLimits`.
"""

from __future__ import annotations

import argparse

from moaspec.errors import MoaspecError
from moaspec.serving.limits import ServerLimits

# flag -> (ServerLimits field, type, help); every value must be > 0
_FLAGS: dict[str, tuple[str, type, str]] = {
    "--max-connections": ("max_connections", int, "open connections served at once; more get 503"),
    "--header-timeout-s": ("header_timeout_s", float, "seconds a request's line and headers may take to arrive (else 408, closed)"),
    "--body-timeout-s": ("body_timeout_s", float, "seconds a request body may take to arrive (else 408, closed)"),
    "--keepalive-timeout-s": ("keepalive_timeout_s", float, "seconds an idle keep-alive connection stays open"),
    "--max-sessions": ("max_sessions", int, "split sessions open on the server; more get 503"),
    "--max-cached-tokens-per-key": (
        "max_cached_tokens_per_key", int, "tokens one key's split sessions may cache (prompt + max_new_tokens each); more get 429",
    ),
    "--max-cached-tokens": ("max_cached_tokens", int, "tokens all split sessions may cache; more get 503 (~140 KB each on SmolLM2-135M + MoA, transformers runtime)"),
    "--shutdown-timeout-s": (
        "shutdown_timeout_s", float,
        "seconds requests in flight may take to finish after Ctrl-C or SIGTERM (waiting ones get 503 at once, "
        "the rest are cut then; a second signal stops waiting)",
    ),
}


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    default = ServerLimits()
    group = parser.add_argument_group("connection and memory limits")
    for flag, (field, kind, help_text) in _FLAGS.items():
        value = getattr(default, field)
        group.add_argument(flag, type=kind, default=value, help=f"{help_text} (default {value:g})")


def server_limits_from_args(args: argparse.Namespace) -> ServerLimits:
    """All limit flags of `moaspec serve` as one ServerLimits; MoaspecError naming a bad flag."""
    for flag, (field, _, _) in _FLAGS.items():
        if not getattr(args, field) > 0:
            raise MoaspecError(f"{flag} must be > 0, got {getattr(args, field)}")
    return ServerLimits(
        max_body_bytes=args.max_body_bytes, max_new_tokens=args.max_new_tokens,
        max_tree_nodes=ServerLimits().max_tree_nodes if args.max_tree_nodes is None else args.max_tree_nodes,
        max_sessions_per_key=args.max_sessions_per_key, idle_timeout_s=args.idle_timeout_s,
        **{field: getattr(args, field) for field, _, _ in _FLAGS.values()},
    )
