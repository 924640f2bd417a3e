"""The split deployment's command-line entry points (`moaspec serve`, `moaspec generate --server`).

cli.py parses and validates; these functions load models and run. Keys: one per line in
--api-key-file, or MOASPEC_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from moaspec.errors import MoaspecError
from moaspec.serving.api_keys import check_api_key
from moaspec.serving.limits import ServerLimits
from moaspec.signals import Terminated, load_library_held

if TYPE_CHECKING:
    from moaspec.api import SpeculativeLM
    from moaspec.split.generator import SplitGenerator, SplitResult
    from moaspec.split.server import SplitServer
    from moaspec.targets.base import Target

API_KEY_ENV = "MOASPEC_API_KEY"


def read_api_keys(path: str | None) -> list[str]:
    """The keys in `path` (one per line, blank lines and #-comments skipped), else $MOASPEC_API_KEY."""
    if path is not None:
        try:
            lines = Path(path).expanduser().read_text().splitlines()
        except OSError as exc:
            raise MoaspecError(f"cannot read the API key file {path}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise MoaspecError(f"the API key file {path} is not text: {exc.reason}") from exc
        keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not keys:
            raise MoaspecError(f"the API key file {path} holds no key")
        return [check_api_key(key) for key in keys]
    if os.environ.get(API_KEY_ENV, "").strip():
        return [check_api_key(os.environ[API_KEY_ENV].strip())]
    raise MoaspecError(f"an API key is required: --api-key-file FILE or {API_KEY_ENV}")


def check_tls(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """A server TLS context from the certificate flags (both or neither)."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise MoaspecError("TLS needs both --ssl-certfile and --ssl-keyfile")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        detail = exc if isinstance(exc, ssl.SSLError) else exc.strerror or exc  # "No such file or directory"
        raise MoaspecError(
            f"cannot load the TLS certificate {certfile} / key {keyfile} (PEM files, the key matching the "
            f"certificate): {detail}"
        ) from exc
    return context


def serve(args: argparse.Namespace, keys: list[str], ssl_context: ssl.SSLContext | None) -> NoReturn:
    """Serve until Ctrl-C or SIGTERM, then end as the CLI does for them (130 / 143): after the
    first, requests in flight get --shutdown-timeout-s to finish; a second stops waiting."""
    import asyncio

    from moaspec.split.address import server_url

    load_library_held()
    server, described = build_server(args, keys)
    scheme = "https" if ssl_context else "http"

    def listening(port: int) -> None:  # said once it listens, with the port chosen for --port 0
        print(f"[moaspec] serving {described} on {server_url(scheme, args.host, port)}", file=sys.stderr)

    _log_to_stderr()
    signum = asyncio.run(server.site().run_until_signalled(args.host, args.port, ssl_context, listening))
    # the CLI's exit for them (status 143 / 130 and its line), without waiting for the model thread
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def _log_to_stderr() -> None:
    """The server's log (refusals, model failures, bugs: the "moaspec.serve" logger) as
    timestamped lines on stderr."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[moaspec] %(asctime)s %(levelname)s %(message)s"))
    log = logging.getLogger("moaspec.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def build_server(args: argparse.Namespace, keys: list[str]) -> tuple[SplitServer, str]:
    """`moaspec serve`'s SplitServer (not started) and a line saying what it runs.

    The split's drafter is the named form, else the target's default model drafter (split clients
    need its context encoder); the machine calibration picks its layout, tree and lookup trie.
    The OpenAI routes generate with the named drafter too, but with none named they generate as
    `moaspec generate` does: with the calibration's choice (e.g. gated prompt lookup where a model
    drafter does not pay), in a session made before the split's drafter asks the target to
    capture keys/values (llama.cpp's capture slows every decode)."""
    from moaspec.api import load_target
    from moaspec.calibration.plan import drafter_for
    from moaspec.drafters import MODEL_FREE, default_drafter, make_drafter
    from moaspec.openai_api.cli import openai_limits_from_args
    from moaspec.serving.identity import drafter_form
    from moaspec.split.serve_flags import server_limits_from_args
    from moaspec.split.server import SplitServer

    limits = server_limits_from_args(args)
    target = load_target(args.target, **args.runtime_options)
    split_form = args.drafter or default_drafter(target.name)
    decoding_target = None if args.drafter else target.new_session()
    try:
        drafter, calibration = drafter_for(target, split_form)
    except MoaspecError as exc:  # trees not exact here (calibration/plan.py): the OpenAI routes still decode
        if args.drafter or target.runtime != "llama.cpp" or target.trees_exact:
            raise
        print(f"moaspec: warning: {exc}: split clients verify one token per request", file=sys.stderr)
        drafter, calibration = make_drafter(split_form, target), None
    limits = _within_runtime(limits, target, args)
    openai, decoding = None, split_form
    if decoding_target is not None:
        decoding_drafter, calibration = drafter_for(decoding_target, None)
        openai = (decoding_target, decoding_drafter)
        decoding = calibration.chosen.drafter if calibration is not None else drafter_form(decoding_drafter)
    server = SplitServer(target, drafter, keys, limits, openai_limits_from_args(args), openai, calibration)
    encoder = "" if split_form in MODEL_FREE else " context encoder"  # n-gram clients draft alone
    return server, f"{target.name} + {split_form}{encoder} (OpenAI API: {decoding})"


def _within_runtime(limits: ServerLimits, target: Target, args: argparse.Namespace) -> ServerLimits:
    """The limits with --max-tree-nodes lowered to what the runtime verifies exactly here, when the
    flag was not given (a named larger value is refused by SplitServer)."""
    if args.max_tree_nodes is not None:
        return limits
    lowered = limits.within_runtime(target)
    if 1 < lowered.max_tree_nodes < limits.max_tree_nodes:  # 1: said with the drafter's warning
        note = f"chains of at most {lowered.max_tree_nodes} nodes verify exactly here"
        print(f"moaspec: {target.name}: {note} (--max-tree-nodes {lowered.max_tree_nodes})", file=sys.stderr)
    return lowered


def _interrupted_before_the_start(args: argparse.Namespace, client) -> dict:
    """`generate --server --json` interrupted before the generation started (importing, loading,
    reaching the server): the usual object with no tokens; `runtime` (the server's) null, and the
    `split` object where the client was made (torch and the split modules are loaded then)."""
    from moaspec.model_store import target_name

    record = {"target": target_name(args.target), "runtime": None, "drafter": args.drafter,
              "text": "", "token_ids": [], "stop_reason": "interrupted"}
    if client is not None:
        from moaspec.split.generator import SplitResult

        record["split"] = SplitResult().split_dict(client)
    return record


def generate_remote(
    args: argparse.Namespace, key: str, tree_overrides: dict | None = None, target_options: dict | None = None
) -> int:
    """`moaspec generate --server URL`: the same output and --json fields as local generation,
    plus a "split" object (server calls, bytes, provisional tokens, ...). tree_overrides: the
    --tree-* flags, for the client's drafter (it drafts the trees the server verifies);
    target_options: load_target's runtime keywords (runtime_options of the --runtime flags)."""
    client = None
    try:
        load_library_held()  # torch's first import: an interrupt half-way was swallowed or left it half-imported
        from moaspec.split.client import SplitClient
        from moaspec.split.generator import SplitResult  # before the client: an interrupt's record reads it

        client = SplitClient(args.server, key, timeout_s=args.timeout, cafile=args.cafile)
        lm, prompt_ids, generator = _split_generator(args, client, tree_overrides, target_options)
    except KeyboardInterrupt:  # importing, loading or connecting: --json says nothing was verified
        if args.json:
            print(json.dumps(_interrupted_before_the_start(args, client)))
        raise
    import torch

    from moaspec.config import GenerationConfig, SamplingConfig

    streamer = None
    if not args.json:
        from moaspec.text_stream import TextPrinter

        streamer = TextPrinter(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
        streamer.put(torch.tensor([prompt_ids]))
    result = SplitResult()
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed)
    head = {"target": lm.target.name, "runtime": generator.info.get("runtime"), "drafter": args.drafter}
    try:
        for event in generator.stream(prompt_ids, sampling, generation, lm.target.stop_ids, result):
            if streamer is not None and event.kind in ("verified", "confirm", "kept") and event.token_ids:
                streamer.put(torch.tensor(event.token_ids))
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: --json still prints the tokens verified before it
        if args.json:
            text = lm.tokenizer.decode(result.token_ids, skip_special_tokens=True)
            print(json.dumps({**head, "text": text, "token_ids": result.token_ids, "stop_reason": "interrupted",
                              "split": result.split_dict(client)}))
        raise
    finally:
        if streamer is not None:
            streamer.end()
    _report_remote(args, lm.tokenizer.decode(result.token_ids, skip_special_tokens=True), result, head, client)
    return 0


def _split_generator(
    args: argparse.Namespace, client, tree_overrides: dict | None, target_options: dict | None
) -> tuple[SpeculativeLM, list[int], SplitGenerator]:
    """The client side of a split generation: the SpeculativeLM of the target (its tokenizer and
    frozen parts) and the drafter, the prompt's ids and the generator (which waits for a server that
    is down, up to 120 s)."""
    from moaspec.api import SpeculativeLM, load_target
    from moaspec.drafters import make_drafter
    from moaspec.split.generator import SplitGenerator, SplitOptions

    options = SplitOptions(
        context_dtype=args.context_dtype, adaptive=args.adaptive, accept_offline=args.accept_offline,
        offline_min_prob=args.offline_min_prob, offline_deadline_s=args.offline_deadline_s,
        notify=lambda line: print(f"[moaspec] {line}", file=sys.stderr, flush=True),
    )
    # only its tokenizer and frozen parts (embeddings, LM head) are used; the server verifies. On
    # the runtime the flags choose (target_options: runtime_options), by default the target's: for
    # a GGUF target llama.cpp, whose parts come from the converted copy without the float32
    # model, and no llama.cpp context is ever made (README)
    target = load_target(args.target, light_tokenizer=True, **(target_options or {}))
    drafter = make_drafter(args.drafter, target, tree_overrides)
    if not hasattr(drafter, "accept_context"):
        raise MoaspecError(f"drafter '{args.drafter}' cannot run split")
    lm = SpeculativeLM(target, drafter)
    prompt_ids = lm.encode_prompt(args.prompt, args.raw)
    return lm, prompt_ids, SplitGenerator(client, drafter, options)


def _report_remote(args: argparse.Namespace, text: str, result: SplitResult, head: dict, client) -> None:
    """A finished split generation's --json object or stats lines; a MoaspecError (exit status 2,
    after the text) when it ended refused or disconnected."""
    if args.json:
        # the fields of a local generation's --json (runtime: the server's; calibration: none runs
        # here, the client drafts with the drafter as configured), then the split's own
        record = {**head, "text": text, "token_ids": result.token_ids, "stop_reason": result.stop_reason,
                  **result.stats.to_dict(), "calibration": None, "split": result.split_dict(client)}
        print(json.dumps(record))
    else:
        split = result.split_dict(client)
        print(
            f"[moaspec] {result.stats.new_tokens} tokens, tau {result.stats.tau:.2f}, {result.stats.tokens_per_s:.1f} tok/s, "
            f"{split['server_calls']} server calls, {split['bytes_per_token']} bytes/token",
            file=sys.stderr,
        )
        if result.num_unverified:
            print(
                f"[moaspec] the last {result.num_unverified} of those tokens were drafted alone and never verified "
                "(--accept-offline)", file=sys.stderr,
            )
    kept = f"{len(result.token_ids)} verified tokens kept"
    if result.stop_reason == "refused":
        raise MoaspecError(f"{result.refusal}; {kept}")
    if result.stop_reason == "disconnected":
        if args.accept_offline:
            raise MoaspecError(f"the server stayed unreachable and nothing had been drafted alone; {kept}")
        raise MoaspecError(f"the server stayed unreachable; {kept} (--accept-offline keeps drafts)")
