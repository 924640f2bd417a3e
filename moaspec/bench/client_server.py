"""`moaspec bench --client-server`: the split deployment and server-side streaming over emulated
networks (protocol and metrics: moaspec/bench/client_server_runner.py), wired into `moaspec bench`.

    moaspec bench --client-server --out DIR [--network lan,5g,4g,3g] [--methods ngram,moa,eagle,DIR,...]
                  [--categories ...] [--limit N] [--max-new-tokens N] [--temperature T] [--seed S]
                  [--target NAME|PATH] [--adaptive] [--disconnect-after N [--offline-tokens M] [--offline-min-prob P]]
                  [--no-plots] [--no-progress]

- `--network`: profiles of moaspec/split/netem.py (default all four), measured one after another,
  the cases interleaved prompt by prompt within each;
- `--methods`: drafters (checked as for the single-device bench; default ngram plus the shipped
  drafters of the target); each gives a `split` case and a `server` (streamed) case; the plain
  streamed baseline `none` is always run; `hf`/`hf-pld` have no client-server form;
- prompts: every user turn of every item (after its fixed history, e.g. QA's document), a later
  turn (MT-bench's second) asked after the plain stream's answer; the disconnection experiment
  takes first turns only;
- `--adaptive`: split clients size their draft trees from measured costs (`generate --server
  --adaptive`, moaspec/split/adaptive.py), each case learning anew on each network;
- `--disconnect-after N`: also run the disconnection experiment (link cut after N verified tokens,
  each drafter continues alone for up to `--offline-tokens` M tokens, default 16, stopping earlier
  with `--offline-min-prob P` as `moaspec generate --server` does).
Writes results.json (`client_server` and `disconnection` rows, config, machine, command; schema
in schema.py) and results.md into DIR, all or nothing, and prints the markdown; draws
client_server.png (moaspec/bench/plots.py) unless `--no-plots`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from moaspec.bench.client_server_runner import ClientServerData
    from moaspec.bench.methods import MethodSpec
    from moaspec.config import SamplingConfig
    from moaspec.targets.base import Target

DEFAULT_OFFLINE_TOKENS = 16
MAX_STREAM_TEMPERATURE = 2.0  # the OpenAI API's range, which the streamed cases go through
MODE_NAMES = {"split": "split (client drafts)", "server": "server, streamed"}


def add_client_server_arguments(bench: argparse.ArgumentParser) -> None:
    group = bench.add_argument_group("client-server (--client-server; moaspec/bench/client_server.py)")
    group.add_argument(
        "--client-server",
        action="store_true",
        help="measure the split deployment and server-side streaming over emulated networks instead",
    )
    group.add_argument("--network", default=None, help="comma-separated profiles: lan, 5g, 4g, 3g (default all)")
    group.add_argument(
        "--disconnect-after",
        type=int,
        default=None,
        help="also run the disconnection experiment: cut the link after N verified tokens",
    )
    group.add_argument(
        "--offline-tokens",
        type=int,
        default=None,
        help=f"disconnection: most tokens each drafter produces alone (default {DEFAULT_OFFLINE_TOKENS})",
    )
    group.add_argument(
        "--adaptive",
        action="store_true",
        default=None,
        help="split cases size their draft tree from measured round trip, verify and draft times "
        "(generate --server --adaptive; default: the drafter's fixed tree)",
    )
    group.add_argument(
        "--offline-min-prob",
        type=float,
        default=None,
        help="disconnection: each drafter stops before its probability that all its offline tokens are the "
        "target's falls below P (generate's --offline-min-prob; default 0)",
    )


def check_client_server_flags(args: argparse.Namespace) -> None:
    """Flags that need --client-server or only make sense with it (before torch loads)."""
    flags = {
        "--network": args.network,
        "--disconnect-after": args.disconnect_after,
        "--offline-tokens": args.offline_tokens,
        "--offline-min-prob": args.offline_min_prob,
        "--adaptive": args.adaptive,
    }
    if not args.client_server:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise MoaspecError(f"{given[0]} needs --client-server")
        return
    parse_network(args.network)
    if args.disconnect_after is not None and args.disconnect_after < 1:
        raise MoaspecError("--disconnect-after must be >= 1")
    if args.offline_tokens is not None and args.disconnect_after is None:
        raise MoaspecError("--offline-tokens needs --disconnect-after")
    if args.offline_tokens is not None and args.offline_tokens < 1:
        raise MoaspecError("--offline-tokens must be >= 1")
    if args.offline_min_prob is not None and args.disconnect_after is None:
        raise MoaspecError("--offline-min-prob needs --disconnect-after")
    if args.offline_min_prob is not None and not 0.0 <= args.offline_min_prob <= 1.0:
        raise MoaspecError("--offline-min-prob must be in [0, 1]")
    if args.temperature > MAX_STREAM_TEMPERATURE:
        raise MoaspecError(
            f"--client-server takes --temperature in [0, {MAX_STREAM_TEMPERATURE:g}] (the OpenAI API's range)"
        )


def parse_network(value: str | None) -> tuple[str, ...]:
    """`--network a,b` -> profile names in order (default all)."""
    from moaspec.cli_support import known_items
    from moaspec.split.netem import PROFILES

    return tuple(known_items(",".join(PROFILES) if value is None else value, "--network", tuple(PROFILES), "network profile"))


def client_server_methods(value: str | None, target_name: str) -> tuple[MethodSpec, ...]:
    """`--methods` for client-server: drafters only; default ngram plus the target's shipped drafters."""
    from moaspec.bench.methods import DEFAULT_METHOD, HF_METHODS, check_available, default_methods, parse_methods

    if value is None:
        value = ",".join(m for m in default_methods(target_name).split(",") if m not in (*HF_METHODS, DEFAULT_METHOD))
    specs = parse_methods(value)
    for spec in specs:
        if spec.drafter is None or spec.drafter == DEFAULT_METHOD:
            raise MoaspecError(
                f"method '{spec.label}' has no client-server form (use drafters: ngram, moa, eagle, DIR)"
            )
    check_available(specs, target_name)
    return specs


def run_client_server_bench(
    args: argparse.Namespace, categories: tuple[str, ...], sampling: SamplingConfig, out: Path, target_name: str,
    runtime: dict,
) -> int:
    """The rest of `run_bench` for --client-server: cheap checks, load, run, write, print.
    runtime: load_target's runtime keywords from the flags (targets/options.py): the servers'
    target runs where `serve` would run it."""
    # 1. the remaining cheap checks, before torch and the target load
    from moaspec.bench.prompts import load_prompts
    from moaspec.cli_support import command_line

    profiles = parse_network(args.network)
    specs = client_server_methods(args.methods, target_name)
    items = load_prompts(categories, args.limit)

    # 2. load and run
    import functools

    import moaspec.api
    from moaspec.bench.client_server_runner import BASELINE, run_client_server, run_disconnection
    from moaspec.drafters import make_drafter

    target = moaspec.api.load_target(args.target, **runtime)
    if target.tokenizer is None:
        raise MoaspecError(f"target {args.target} has no tokenizer")
    prompts, skipped = conversations(target, items)
    from moaspec.bench.methods import drafter_tree, llama_cpp_threads
    from moaspec.tuned import tree_overrides

    overrides = tree_overrides(args)
    drafters = {
        spec.label: functools.partial(make_drafter, spec.drafter, tree_overrides=drafter_tree(spec, overrides))
        for spec in specs
        if spec.label != BASELINE
    }
    config = _config(args, target.name, target.runtime, categories, specs, profiles)
    config["dtype"] = runtime["dtype"] if target.runtime == "transformers" else None  # --dtype
    config["threads"] = llama_cpp_threads(target) if target.runtime == "llama.cpp" else None  # --threads or the default
    data = run_client_server(
        target, drafters, prompts, profiles, sampling, args.max_new_tokens, args.seed, progress=not args.no_progress,
        adaptive=bool(args.adaptive),
    )
    disconnection = []
    if args.disconnect_after is not None:
        disconnection = run_disconnection(
            target, drafters, prompts, args.disconnect_after, config["offline_tokens"], config["offline_min_prob"],
            progress=not args.no_progress,
        )

    # 3. report
    results = build_results(data, disconnection, [*skipped, *data.skipped], config, command_line(args))
    return _report(results, out, plots=not args.no_plots)


def _report(results: dict, out: Path, plots: bool) -> int:
    """Write `results` (json, markdown, and the plots where asked) to `out` and print the markdown;
    -> the exit status: EXIT_MISMATCH where a greedy output differed from the baseline's."""
    from moaspec.bench.output import write_results
    from moaspec.bench.plots import ALL_PLOT_FILES, render_client_server_plots
    from moaspec.cli_support import EXIT_MISMATCH

    markdown = render_markdown(results)
    write_results(out, results, markdown, render_client_server_plots(results) if plots else None, ALL_PLOT_FILES)
    print(markdown, end="")
    if results["mismatches"]:
        print(f"moaspec: {len(results['mismatches'])} greedy MISMATCHES (see {out / 'results.json'})", file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def conversations(target: Target, items: dict) -> tuple[list, list[str]]:
    """Every item's first user turn (after its fixed history) as token ids, with its later turns to
    follow; -> (prompts, skipped): an item that does not fit the target's context is skipped, with a
    warning."""
    from moaspec.bench.client_server_runner import NamedPrompt
    from moaspec.chat import encode_chat_messages

    prompts, skipped = [], []
    for item in (item for category in items.values() for item in category):
        name = f"{item.category}/{item.prompt_id}"
        messages = (*item.history, {"role": "user", "content": item.turns[0]})
        prompt_ids = encode_chat_messages(target.tokenizer, list(messages))
        if len(prompt_ids) >= target.max_positions - 1:
            skipped.append(name)
            print(
                f"moaspec: warning: skipping {name}: {len(prompt_ids)} prompt tokens do not fit the context",
                file=sys.stderr,
            )
        else:
            prompts.append(NamedPrompt(name, tuple(prompt_ids), item.references, messages, tuple(item.turns[1:])))
    return prompts, skipped


def _config(
    args: argparse.Namespace,
    target_name: str,
    runtime: str,
    categories: tuple[str, ...],
    specs,
    profiles: tuple[str, ...],
) -> dict:
    from moaspec.split.netem import PROFILES

    return {
        "target": target_name,
        "runtime": runtime,
        "categories": list(categories),
        "limit": args.limit,
        "methods": [spec.label for spec in specs],
        "method_sources": {spec.label: spec.described for spec in specs},
        "networks": {name: asdict(PROFILES[name]) for name in profiles},
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "disconnect_after": args.disconnect_after,
        "offline_tokens": None if args.disconnect_after is None else args.offline_tokens or DEFAULT_OFFLINE_TOKENS,
        "offline_min_prob": None if args.disconnect_after is None else args.offline_min_prob or 0.0,
        "turns": "all",  # every user turn (results written before this key: first turns only)
        "adaptive": bool(args.adaptive),  # split cases' trees sized by split/adaptive.py
    }


def _runtime_phrase(config: dict) -> str:
    """' on the <runtime> runtime' (with llama.cpp's threads), or nothing for results written
    before the runtime was recorded."""
    from moaspec.bench.report import threads_phrase

    if not config.get("runtime"):
        return ""
    threads = threads_phrase(config.get("threads"))
    return f" on the {config['runtime']} runtime" + (f" ({threads})" if threads else "")


def _turns_phrase(config: dict) -> str:
    if config.get("turns") == "all":
        return "every user turn (a later one asked after the plain stream's answer; disconnection: first turns)"
    return "first user turn"


def build_results(data: ClientServerData, disconnection: list, skipped: list[str], config: dict, command: str) -> dict:
    """The results.json document (validated against schema.CLIENT_SERVER_SCHEMA)."""
    from moaspec.bench.client_server_runner import summarize
    from moaspec.bench.machine import machine_info
    from moaspec.bench.output import timestamp
    from moaspec.bench.schema import CLIENT_SERVER_SCHEMA, CLIENT_SERVER_SCHEMA_VERSION, validate

    results = {
        "schema_version": CLIENT_SERVER_SCHEMA_VERSION,
        "kind": "client_server",
        "created": timestamp(),
        "command": command,
        "machine": machine_info(),
        "config": config,
        "client_server": [asdict(row) for row in summarize(data)],
        "disconnection": [asdict(row) for row in disconnection],
        "mismatches": [asdict(mismatch) for mismatch in data.mismatches],
        "skipped": list(skipped),
        "runs": [_run_row(record) for record in data.records],
    }
    validate(results, CLIENT_SERVER_SCHEMA)
    return results


def _run_row(record) -> dict:
    run = record.run
    return {
        "profile": record.profile,
        "prompt": record.prompt,
        "method": record.method,
        "mode": record.mode,
        "new_tokens": run.new_tokens,
        "wall_s": round(run.wall_s, 4),
        "time_to_first_token_s": round(run.first_token_s, 4),
        "num_calls": run.num_calls,
        "num_bytes": run.num_bytes,
    }


# -- markdown -------------------------------------------------------------------------------------
def render_markdown(results: dict) -> str:
    from moaspec.bench.report import decoding_phrase

    config = results["config"]
    lines = [
        "# moaspec bench --client-server",
        "",
        (
            f"Target `{config['target']}`{_runtime_phrase(config)}, {decoding_phrase(config['temperature'])}, at most {config['max_new_tokens']} "
            f"new tokens, seed {config['seed']}; {_turns_phrase(config)} of {', '.join(config['categories'])}. Per network the "
            "cases run interleaved prompt by prompt, warm-up excluded. Links are emulated on loopback "
            "(moaspec/split/netem.py); bytes are counted at the emulator, both directions, HTTP included."
            + (" Split clients size their trees from measured costs (`--adaptive`)." if config.get("adaptive") else "")
        ),
        f"Machine: {results['machine']['description']}. Command: `{results['command']}`.",
        "",
    ]
    for name, profile in config["networks"].items():
        lines += [
            f"## {name} ({_link(profile)})",
            "",
            *_case_table([r for r in results["client_server"] if r["profile"] == name]),
        ]
    if results["disconnection"]:
        lines += _disconnection_section(results["disconnection"], config)
    lines += ["## Greedy check", "", _greedy_check(results)]
    if results["skipped"]:
        lines += ["", f"Skipped (prompt longer than the context): {', '.join(results['skipped'])}"]
    return "\n".join(lines) + "\n"


def _link(profile: dict) -> str:
    bandwidth = profile["bandwidth_bps"]
    rate = "unlimited" if bandwidth is None else f"{bandwidth / 1e6:g} Mbit/s"
    return f"{1000 * profile['rtt_s']:g} ms RTT, ±{1000 * profile['jitter_s']:g} ms jitter, {rate}"


def _case_table(rows: list[dict]) -> list[str]:
    out = [
        "| method | drafting | tokens/s | vs plain stream | τ | server calls / 100 tokens | bytes / token | time to first token ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        out.append(
            f"| {row['method']} | {MODE_NAMES[row['mode']]} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}× | {row['tau']:.2f} "
            f"| {row['server_calls_per_100_tokens']:.1f} | {row['bytes_per_token']:.0f} | {1000 * row['time_to_first_token_s']:.0f} |"
        )
    return [*out, ""]


def _min_prob_phrase(config: dict) -> str:
    """', stopping below probability P' when the run set --offline-min-prob (older results: none)."""
    min_prob = config.get("offline_min_prob")
    return f", each stopping before its probability that all of them are right falls below {min_prob:g}" if min_prob else ""


def _disconnection_section(rows: list[dict], config: dict) -> list[str]:
    first = rows[0]
    out = [
        f"## Disconnection (link cut after {first['cut_after']} verified tokens, up to {first['offline_tokens']} drafted alone"
        f"{_min_prob_phrase(config)})",
        "",
        "Agreement: leading offline tokens equal to the target's own greedy continuation of the verified text; "
        "first token: share of generations whose first offline token is the target's. Task F1 (prompts with "
        "reference answers, QA): token F1 of verified + offline text taken as final, and of the target's own "
        "answer of the same length.",
        "",
        "| drafter | generations | offline tokens | agreeing | agreement | first token | scored | task F1 | target's task F1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        out.append(
            f"| {row['drafter']} | {row['num_generations']} | {row['num_offline']} | {row['num_agreeing']} "
            f"| {_optional(row['agreement'], 2)} | {row['first_token_agreement']:.2f} | {row['num_scored']} "
            f"| {_optional(row['task_f1'])} | {_optional(row['target_task_f1'])} |"
        )
    return [*out, ""]


def _optional(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _greedy_check(results: dict) -> str:
    if results["config"]["temperature"] != 0:
        return "Sampled run: outputs are not compared (only the distribution is preserved)."
    mismatches = results["mismatches"]
    if not mismatches:
        return "Every case's text equals the plain stream's (`none`, server) on every prompt and network."
    listed = "\n".join(
        f"- {m['method']} {m['mode']}: {m['profile']} {m['prompt']}, first divergence at character {m['first_divergence']}"
        for m in mismatches
    )
    return f"**{len(mismatches)} MISMATCHES** (a lossless path changed the output):\n{listed}"
