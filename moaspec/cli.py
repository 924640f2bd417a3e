"""`moaspec` command line.

    moaspec generate --prompt TEXT [--target NAME|PATH] [--drafter NAME|PATH] [--max-new-tokens N]
                     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--json] [--raw]
                     [--tree-depth D] [--tree-top-k K] [--tree-budget N]
                     [--server URL [--api-key-file F] [--context-dtype f16|i8|f32] [--adaptive]
                      [--accept-offline] [--offline-min-prob P] [--timeout S] [--offline-deadline-s S] [--cafile F]]
    moaspec serve [--host H] [--port P] [--api-key-file F] [--target ...] [--drafter ...]
                  [--ssl-certfile F --ssl-keyfile F] [--max-tree-nodes N] [--max-new-tokens N] ...

    moaspec data distill --out DIR [--target NAME|PATH] [--num-conversations N] [--batch-size B]
                         [--max-new-tokens N] [--max-prompt-tokens N] [--sampled-fraction F]
                         [--shard-size N] [--seed S] [--skip-conversations N] [--device cpu|cuda[:N]]
    moaspec data sharegpt --out DIR [--target NAME|PATH] [--num-conversations N] [--max-seq-len N]
                          [--shard-size N] [--seed S] [--skip-conversations N]
    moaspec data stats DIR
    moaspec bench --out DIR [--categories a,b,...] [--limit N] [--methods none,hf,hf-pld,ngram,moa,...]
                  [--temperature T] [--max-new-tokens N] [--target NAME|PATH] [--seed S]
    moaspec bench --client-server --out DIR [--network lan,5g,4g,3g] [--methods ngram,moa,eagle,...]
                  [--adaptive] [--disconnect-after N [--offline-tokens M] [--offline-min-prob P]] [--categories ...] [--limit N] ...
    moaspec tune --drafters moa,eagle,DIR [--target NAME|PATH] [--repeats R] [--top1-rate P] [--device cpu|cuda[:N]] [--dry-run]
    moaspec train --method moa|eagle --data DIR [DIR ...] --out RUN [--tli-layers K] [--memory-layers N]
                  [--memory-hidden] [--no-layer-attention] [--no-cross-attention] [--intermediate-size N] [--anchor-every MIN MAX]
                  [--anchor-loss-weight W] [--draft-vocab N] [--ce-weight W] [--feature-weight W]
                  [--steps S] [--batch-size B] [--micro-batch M] [--lr LR] [--time-limit-min M] ...

Text streams to stdout as it is verified; `--json` prints one JSON object at the end instead.
`data distill` has the target regenerate ShareGPT responses into resumable jsonl shards (rerun the
same command to resume); `data sharegpt` writes whole ShareGPT conversations for teacher-forced
training (every assistant turn learned, the target's labels computed while training); `data stats`
summarises either kind.
Bad input prints one line `moaspec: error: ...` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from moaspec.calibration.busy_machine import busy_machine_note
from moaspec.errors import MoaspecError
from moaspec.signals import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 1  # stdout closed by its reader, as Python itself exits on EPIPE


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise MoaspecError(message)


def _build_parser() -> argparse.ArgumentParser:
    from moaspec.drafters import DEFAULT_DRAFTER, FALLBACK_DRAFTER
    from moaspec.model_store import DEFAULT_TARGET

    default_drafter = (
        f"{DEFAULT_DRAFTER} for targets with a shipped MoA drafter, else {FALLBACK_DRAFTER}"
    )

    parser = _Parser(prog="moaspec", description="Lossless speculative decoding with Mixture of Attentions.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate_parser(commands, DEFAULT_TARGET)
    _add_serve_parser(commands, DEFAULT_TARGET, default_drafter)
    from moaspec.train.cli import add_data_parser, add_train_parser

    add_data_parser(commands, DEFAULT_TARGET)
    add_train_parser(commands, DEFAULT_TARGET)
    from moaspec.bench.cli import add_bench_parser, add_tune_parser

    add_bench_parser(commands, DEFAULT_TARGET)
    add_tune_parser(commands, DEFAULT_TARGET)
    return parser


def _add_generate_parser(commands, default_target: str) -> None:
    from moaspec.drafters import DEFAULT_DRAFTER, MODEL_FREE, SHIPPED
    from moaspec.targets.options import add_runtime_arguments
    from moaspec.tuned import add_tree_arguments

    gen = commands.add_parser("generate", help="generate text from a prompt")
    gen.add_argument(
        "--prompt", required=True, help="the user message (or raw text with --raw); - reads it from stdin"
    )
    gen.add_argument("--target", default=default_target, help=f"built-in name, HF directory or .gguf (default {default_target})")
    gen.add_argument(
        "--drafter",
        default=None,
        help=f"{', '.join([*MODEL_FREE, *SHIPPED])}, X+ngram (a model drafter with prompt lookup first) or a "
        f"checkpoint directory (default: the fastest of none, ngram and {DEFAULT_DRAFTER} on this machine, chosen "
        "by the machine calibration; see README 'Machine calibration')",
    )
    gen.add_argument("--max-new-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1)")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = all (default 0)")
    gen.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_tree_arguments(gen, "model drafters")
    add_runtime_arguments(gen)
    split = gen.add_argument_group("client-server split (docs/protocol.md)")
    split.add_argument("--server", default=None, help="URL of a `moaspec serve` server: draft here, verify there")
    split.add_argument("--api-key-file", default=None, help="file holding the API key (default: $MOASPEC_API_KEY)")
    split.add_argument("--context-dtype", choices=["f16", "i8", "f32"], default="f16", help="how the server sends drafter context (default f16)")
    split.add_argument("--adaptive", action="store_true", help="size the draft tree from measured RTT and costs")
    split.add_argument("--accept-offline", action="store_true", help="if the server stays unreachable, keep the drafter's tokens as final")
    split.add_argument(
        "--offline-min-prob",
        type=float,
        default=0.0,
        help="while the server is unreachable, stop drafting alone before the drafter's probability that all its "
        "provisional tokens are the target's falls below P (default 0: draft up to 64 tokens)",
    )
    split.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server per request (default 10)")
    split.add_argument(
        "--offline-deadline-s", type=float, default=120.0,
        help="seconds to keep retrying a server that is down (at the start, or drafting alone after a cut) "
        "before giving up (default 120)",
    )
    split.add_argument("--cafile", default=None, help="CA bundle to verify an https server")


def _add_serve_parser(commands, default_target: str, default_drafter: str) -> None:
    from moaspec.serving.limits import ServerLimits

    limits = ServerLimits()
    serve = commands.add_parser("serve", help="serve the target side of the client-server split")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key-file", default=None, help="file with the accepted API keys, one per line (default: $MOASPEC_API_KEY)")
    serve.add_argument("--target", default=default_target, help=f"built-in name, HF directory or .gguf (default {default_target})")
    serve.add_argument("--drafter", default=None, help=f"drafter whose context encoder the server runs (default: {default_drafter})")
    serve.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM)")
    serve.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM)")
    serve.add_argument(
        "--max-tree-nodes", type=int, default=None,
        help=f"largest draft tree (default {limits.max_tree_nodes}, or what the runtime verifies exactly there if less)",
    )
    serve.add_argument("--max-new-tokens", type=int, default=limits.max_new_tokens, help=f"per split session and per OpenAI request (default {limits.max_new_tokens})")
    from moaspec.openai_api.cli import add_openai_arguments

    add_openai_arguments(serve)
    serve.add_argument("--max-sessions-per-key", type=int, default=limits.max_sessions_per_key, help=f"(default {limits.max_sessions_per_key})")
    serve.add_argument("--idle-timeout-s", type=float, default=limits.idle_timeout_s, help=f"drop idle sessions (default {limits.idle_timeout_s:g})")
    serve.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes, help=f"largest request (default {limits.max_body_bytes})")
    from moaspec.split.serve_flags import add_limit_arguments
    from moaspec.targets.options import add_runtime_arguments

    add_limit_arguments(serve)
    add_runtime_arguments(serve)


def _serve(args: argparse.Namespace) -> int:
    from moaspec.extras import SERVE_MODULES, require_modules

    require_modules("serve", SERVE_MODULES, "moaspec serve")
    from moaspec.split.commands import check_tls, read_api_keys, serve

    if not 0 <= args.port <= 65535:
        raise MoaspecError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_tree_nodes", "max_new_tokens", "max_sessions_per_key", "max_body_bytes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise MoaspecError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.idle_timeout_s > 0:
        raise MoaspecError("--idle-timeout-s must be > 0")
    from moaspec.split.serve_flags import server_limits_from_args

    server_limits_from_args(args)
    keys = read_api_keys(args.api_key_file)
    ssl_context = check_tls(args.ssl_certfile, args.ssl_keyfile)
    from moaspec.drafters import check_drafter_spec, default_drafter
    from moaspec.model_store import target_name
    from moaspec.targets.options import runtime_options

    if args.drafter is not None:
        check_drafter_spec(args.drafter)
    else:
        default_drafter(target_name(args.target))  # an unknown target fails here, before loading
    args.runtime_options = runtime_options(args, args.target)
    return serve(args, keys, ssl_context)


SPLIT_FLAGS = (  # `generate`'s flags that only the client-server split reads
    "--api-key-file", "--context-dtype", "--adaptive", "--accept-offline", "--offline-min-prob", "--timeout",
    "--offline-deadline-s", "--cafile",
)


def _refuse_split_flags(args: argparse.Namespace) -> None:
    """A split-only flag given without --server would be ignored: refused instead (a flag counts
    as given when its value is not the parser's default)."""
    defaults = _build_parser().parse_args(["generate", "--prompt", "-"])
    for flag in SPLIT_FLAGS:
        dest = flag.removeprefix("--").replace("-", "_")
        if getattr(args, dest) != getattr(defaults, dest):
            raise MoaspecError(f"{flag} applies to generate --server (the client-server split)")


def _check_named(args: argparse.Namespace, *flags: str) -> None:
    """Flags naming something (a target, a drafter) must not be given empty."""
    for flag in flags:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None and not value.strip():
            raise MoaspecError(f"{flag} is empty")


def _prompt_from_stdin() -> str:
    """`--prompt -`: standard input as UTF-8 text, its trailing newlines dropped (as `$(cat)` drops
    them), so `echo TEXT | moaspec generate --prompt -` is `--prompt TEXT`."""
    data = sys.stdin.buffer.read() if sys.stdin is not None else b""
    try:
        return data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise MoaspecError("the prompt read from stdin is not valid UTF-8 text") from None


def _generate(args: argparse.Namespace) -> int:
    overrides, options, name, api_key = _checked_generate_flags(args)
    if args.server is not None:
        from moaspec.drafters import default_drafter
        from moaspec.split.commands import generate_remote

        args.drafter = args.drafter or default_drafter(name)
        return generate_remote(args, api_key, overrides, options)

    from moaspec.api import load_for_prompt
    from moaspec.signals import load_library_held
    from moaspec.text_stream import TextPrinter, TokenCollector

    try:
        if _needs_torch(options["runtime"], args.drafter, args.temperature, name):
            load_library_held()  # torch's first import: an interrupt half-way was swallowed or left it half-imported
        lm, prompt_ids = load_for_prompt(
            args.prompt, args.raw, args.target, args.drafter, overrides, light_tokenizer=True, background_drafter=True,
            **options,
        )
    except KeyboardInterrupt:  # importing, loading, converting or calibrating: --json says nothing was verified
        if args.json:  # the drafter: null where the calibration had not chosen one yet
            head = {"target": name, "runtime": options["runtime"], "drafter": args.drafter}
            print(json.dumps({**head, "text": "", "token_ids": [], "stop_reason": "interrupted"}))
        raise
    _note_capped_budget(overrides.get("budget"), lm)
    streamer = TokenCollector() if args.json else TextPrinter(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    head = {"target": lm.target.name, "runtime": lm.target.runtime, "drafter": lm.drafter_name}
    try:
        out = lm.generate(
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            streamer=streamer,
        )
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: --json still prints the tokens verified before it
        if args.json:
            text = lm.tokenizer.decode(streamer.token_ids, skip_special_tokens=True)
            print(json.dumps({**head, "text": text, "token_ids": streamer.token_ids, "stop_reason": "interrupted"}))
        raise
    _report_generation(args, lm, out, head, len(prompt_ids))
    return 0


def _report_generation(args: argparse.Namespace, lm, out, head: dict, prompt_tokens: int) -> None:
    """A finished local generation: --json's object on stdout, else the speed line on stderr
    (the text was streamed); then the busy-machine note, if there is one."""
    if args.json:
        print(json.dumps({**head, **out.to_dict()}))
    else:
        sys.stdout.flush()
        print(
            f"[moaspec] {out.stats.new_tokens} tokens, tau {out.stats.tau:.2f}, "
            f"{out.stats.tokens_per_s:.1f} tok/s{_background_note(lm.drafter, prompt_tokens)}",
            file=sys.stderr,
        )
    busy = busy_machine_note(out.stats, lm.calibration, lm.target)
    if busy is not None:
        print(f"moaspec: note: {busy}", file=sys.stderr)


def _checked_generate_flags(args: argparse.Namespace) -> tuple[dict, dict, str, str | None]:
    """generate's flags checked before the model loads, the prompt read (`-`: stdin) ->
    (tree overrides, load_target's runtime options, the target's name, the split client's API key
    or None). --drafter is left as named (None: the calibration chooses)."""
    from moaspec.chat import check_prompt_text
    from moaspec.config import GenerationConfig, SamplingConfig
    from moaspec.drafters import check_drafter_spec, default_drafter, tree_settings_given
    from moaspec.model_store import check_target_exists, target_name
    from moaspec.targets.options import runtime_options
    from moaspec.tuned import tree_overrides

    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed)
    if args.prompt == "-":
        args.prompt = _prompt_from_stdin()
    check_prompt_text(args.prompt)
    _check_named(args, "--drafter", "--target")
    if args.server is None:
        _refuse_split_flags(args)
    if args.drafter is not None:
        check_drafter_spec(args.drafter)
    overrides = tree_overrides(args)
    # before resolve_target, which may convert the target first (~30 s)
    api_key = _split_client_key(args) if args.server is not None else None
    check_target_exists(args.target)  # before the flags, whose checks depend on the target's runtime
    options = runtime_options(args, args.target)
    name = target_name(args.target)
    _check_tree_flags(args, name, args.drafter or default_drafter(name), tree_settings_given(overrides))
    return overrides, options, name, api_key


def _split_client_key(args: argparse.Namespace) -> str:
    """`generate --server`'s flags checked (the split client's extra installed, the URL, the
    time-outs, the offline probability, --cafile only for https) -> the API key to send."""
    from moaspec.extras import SPLIT_CLIENT_MODULES, require_modules
    from moaspec.split.address import server_address
    from moaspec.split.commands import read_api_keys

    require_modules("serve", SPLIT_CLIENT_MODULES, "a split client (generate --server)")
    scheme, _, _ = server_address(args.server)
    if not args.timeout > 0:
        raise MoaspecError("--timeout must be > 0")
    if not args.offline_deadline_s >= 0:
        raise MoaspecError("--offline-deadline-s must be >= 0")
    if not 0.0 <= args.offline_min_prob <= 1.0:
        raise MoaspecError(f"--offline-min-prob must be in [0, 1], got {args.offline_min_prob:g}")
    if args.cafile is not None and scheme != "https":
        raise MoaspecError("--cafile applies to an https:// server (it verifies the server's certificate)")
    return read_api_keys(args.api_key_file)[0]


def _check_tree_flags(args: argparse.Namespace, name: str, named: str, tree_given: bool) -> None:
    """--tree-* settings shape a model drafter's tree: refused for a model-free drafter `named`
    (the default of target `name` when --drafter is not given), noted when they replace the
    calibrated default by the default model drafter."""
    from moaspec.drafters import MODEL_FREE

    if named in MODEL_FREE and tree_given:
        if args.drafter is None:  # the default is model-free: no shipped model drafter for this target
            raise MoaspecError(
                f"--tree-* settings apply to model drafters, and target '{name}' has no shipped one: "
                "name a checkpoint with --drafter DIR"
            )
        raise MoaspecError(f"--tree-* settings apply to model drafters only, not to '{named}'")
    if tree_given and args.drafter is None and args.server is None:
        print(f"moaspec: note: --tree-* name the default model drafter, {named}, rather than the calibrated default",
              file=sys.stderr)


def _background_note(drafter, prompt_length: int) -> str:
    """For the stats line: how much of the answer was decoded plainly while the drafter was built
    in the background (drafters/background.py), which its tau and tokens/s include."""
    from moaspec.drafters.background import BackgroundDrafter

    if not isinstance(drafter, BackgroundDrafter):
        return ""
    if drafter.joined_at is None:
        return " (the drafter was still loading in the background: every step plain)"
    # joined with the prompt and k new tokens verified: the (k + 1)-th was the root, the next its first draft
    return f" (the drafter loaded in the background and drafted from token {drafter.joined_at - prompt_length + 2} on)"


def _needs_torch(runtime: str, drafter: str | None, temperature: float, target_name: str) -> bool:
    """Whether a generation surely loads torch before its first token, which then imports it
    first: all but greedy `none`, `ngram`, the calibrated default and a MoA or EAGLE-2 drafter
    (shipped or a directory) on llama.cpp, which run on numpy alone (~1-2.5 s less to the first
    token: README, *Start-up*) unless the calibration measures or picks a model drafter (which
    loads it then: drafters.load_drafter); a model drafter is built in the background meanwhile
    (drafters/background.py)."""
    from moaspec.drafters import MODEL_FREE
    from moaspec.drafters.background import can_build_in_background

    if runtime != "llama.cpp" or temperature > 0:
        return True
    return drafter is not None and drafter not in MODEL_FREE and not can_build_in_background(drafter, target_name, runtime)


def _note_capped_budget(budget: int | None, lm) -> None:
    """Say on stderr when --tree-budget asks for more drafted nodes than the target verifies in one
    tree (llama.cpp: MAX_TREE_NODES, or fewer where only those are exact): the engine cuts every
    tree to that (decode_step.limit_nodes), whatever the calibration's record repeats."""
    if budget is None:
        return
    limit = getattr(lm.target, "max_tree_nodes", None)
    tree = getattr(getattr(lm, "drafter", None), "tree_config", None)
    if tree is None or limit is None or budget + 1 <= limit:
        return
    print(
        f"moaspec: note: --tree-budget {budget} is more than the {lm.target.runtime} runtime verifies in one tree "
        f"here ({limit} nodes, the root included): trees are cut to {limit - 1} drafted nodes",
        file=sys.stderr,
    )


def _stop_on_sigterm() -> None:
    """`kill` (SIGTERM) unwinds like Ctrl-C, so long jobs (distill, train) save their progress."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise Terminated

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


def check_arguments(argv: list[str]) -> int:
    """Parse a command line without running it, and check `train`'s and `tune`'s settings: 0, or 2
    after the one-line error (the scripts check the flags they pass through before their long
    first steps)."""
    try:
        args = _build_parser().parse_args(argv)
        if args.command == "train":
            from moaspec.train.cli import check_train_arguments

            check_train_arguments(args)
        elif args.command == "tune":
            from moaspec.bench.cli import check_tune_values

            check_tune_values(args)
    except MoaspecError as exc:
        print(f"moaspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one moaspec command line (argv: the arguments after `moaspec`) -> exit status."""
    return _main(argv)[0]


def _main(argv: list[str] | None) -> tuple[int, str | None]:
    """-> (exit status, the command that ran, or None when the arguments did not parse)."""
    _stop_on_sigterm()
    command = None
    try:
        args = _build_parser().parse_args(argv)
        args.argv = argv
        command = args.command
        if args.command in ("data", "train"):
            from moaspec.train.cli import run_data, run_train

            return (run_data(args) if args.command == "data" else run_train(args)), command
        if args.command in ("bench", "tune"):
            from moaspec.bench.cli import run_bench, run_tune

            return (run_bench(args) if args.command == "bench" else run_tune(args)), command
        if args.command == "serve":
            return _serve(args), command
        return _generate(args), command
    except MoaspecError as exc:
        print(f"moaspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE, command
    except KeyboardInterrupt as exc:
        terminated = isinstance(exc, Terminated)
        print(f"moaspec: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return (EXIT_TERMINATED if terminated else EXIT_INTERRUPTED), command
    except BrokenPipeError:  # the reader of the output went away (`| head`): what it took is out
        return EXIT_BROKEN_PIPE, command
    except OSError as exc:  # the machine's: a cache folder that cannot be written, a full disk, ...
        where = f": {exc.filename}" if exc.filename else ""
        print(f"moaspec: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1, command


# nothing left to write once the command returns: no files; serve's model thread may still be in
# the step of a request its shutdown cut, which the interpreter's exit would wait for
FAST_EXIT_COMMANDS = ("generate", "serve")


def usable_standard_streams() -> None:
    """Make stdout and stderr safe to write: one closed by the caller (`>&-`, which Python leaves as
    None, so that print(file=sys.stderr) fell back to stdout) writes to /dev/null, as Python's own
    print to a closed stdout does nothing; on a console whose encoding cannot show a character
    (a non-UTF-8 locale), stdout prints `?` for it instead of failing mid-answer."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115  lives as long as the process
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")


def entry() -> None:
    """The `moaspec` console script: main(), then for `generate` and `serve` (FAST_EXIT_COMMANDS)
    an exit that skips the interpreter's teardown of torch and llama.cpp (~0.5 s after the text is
    out; bench/startup.py measures it)."""
    usable_standard_streams()
    code, command = _main(None)
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # nothing more can reach the reader; keep Python's exit from trying again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = code or EXIT_BROKEN_PIPE
    if command in FAST_EXIT_COMMANDS:
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
