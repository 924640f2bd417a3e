"""`moaspec bench`: flags, cheap validation before torch loads, then run -> report -> files.

    moaspec bench --out DIR [--categories mt_bench,humaneval,qa,translation,summarization,math]
                  [--limit N] [--methods none,hf,hf-pld,ngram,eagle,moa,moa-tli1,DIR,LABEL=DIR]
                  [--temperature T] [--max-new-tokens N] [--target NAME|PATH] [--seed S]
                  [--no-plots] [--no-progress]
    moaspec bench --client-server --out DIR [--network lan,5g,4g,3g] [--methods ngram,moa,eagle,...]
                  [--adaptive] [--disconnect-after N [--offline-tokens M] [--offline-min-prob P]] [the flags above]

Writes results.json, results.md, speedup.png and tau.png into DIR (all or nothing; client-server:
results.json, results.md and client_server.png, see moaspec/bench/client_server.py), prints the
markdown to stdout.
Exit status: 0; 1 when a greedy run found a mismatch (results still written); 2 for bad flags or
inputs (one line `moaspec: error: ...`).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from itertools import accumulate
from typing import TYPE_CHECKING

from moaspec.bench.machine import machine_info
from moaspec.bench.prompts import CATEGORIES
from moaspec.cli_support import EXIT_MISMATCH, comma_items, command_line, output_dir
from moaspec.errors import MoaspecError
from moaspec.signals import load_library_held

if TYPE_CHECKING:
    from pathlib import Path

    from moaspec.bench.runner import BenchData
    from moaspec.config import SamplingConfig


def add_bench_parser(commands: argparse._SubParsersAction, default_target: str) -> None:
    bench = commands.add_parser("bench", help="benchmark decoding methods side by side (tokens/s, speedup, tau)")
    bench.add_argument("--out", required=True, help="output directory for results.json, results.md and plots")
    bench.add_argument(
        "--categories", default=",".join(CATEGORIES), help=f"comma-separated (default all: {','.join(CATEGORIES)})"
    )
    bench.add_argument(
        "--limit", type=int, default=None,
        help="N prompts of each category, spread evenly over it (MT-bench: over its sub-categories; default all)",
    )
    bench.add_argument(
        "--methods",
        default=None,
        help="comma-separated: none, hf, hf-pld (transformers runtime), llama.cpp, llama.cpp-pld (GGUF targets), "
        "ngram, eagle, moa, moa-tli1, a checkpoint DIR or LABEL=DIR, a model drafter + '+ngram' (prompt lookup "
        "first), default (the calibrated default generate runs); a model drafter ending in @ref drafts with "
        "the reference tree (depth 6, top-k 4, 16 nodes) (default: none, the runtime's own generation, ngram, "
        "the target's shipped drafters, the default drafter and default); none is always included",
    )
    bench.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy, outputs checked against none (default 0)"
    )
    bench.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    bench.add_argument(
        "--ignore-eos", action="store_true",
        help="stop tokens do not end an answer: every method writes --max-new-tokens tokens (speed across "
        "runtimes whose answers differ in length; a chat's next turn still keeps the answer up to its stop token)",
    )
    bench.add_argument(
        "--target", default=default_target, help=f"built-in name, HF directory or .gguf (default {default_target})"
    )
    bench.add_argument("--seed", type=int, default=0, help="prompt i uses seed + i for every method (default 0)")
    bench.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    from moaspec.tuned import add_tree_arguments

    add_tree_arguments(bench, "model-drafter methods except `default` (e.g. the reference tree: 6 / 4 / 16)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    from moaspec.bench.client_server import add_client_server_arguments
    from moaspec.targets.options import add_runtime_arguments

    add_runtime_arguments(bench)

    add_client_server_arguments(bench)


def run_bench(args: argparse.Namespace) -> int:
    from moaspec.bench.client_server import run_client_server_bench
    from moaspec.bench.methods import check_available, check_tree_flags, default_methods, parse_methods
    from moaspec.bench.prompts import load_prompts
    from moaspec.bench.report import render_markdown, timing_warning

    # 1. everything cheap, before torch and the target load (or its first conversion)
    categories, sampling, overrides, out, target_name, options = _checked_flags(args)
    if args.client_server:
        if args.ignore_eos:
            raise MoaspecError("--ignore-eos applies to the single-device bench, not --client-server")
        return run_client_server_bench(args, categories, sampling, out, target_name, options)
    runtime = options["runtime"]
    specs = parse_methods(args.methods if args.methods is not None else default_methods(target_name, runtime))
    check_tree_flags(specs, overrides)
    check_available(specs, target_name)
    prompts = load_prompts(categories, args.limit)

    # 2. load and run
    load_library_held()
    import moaspec.api
    from moaspec.bench.methods import build_method, needs_hf_copy
    from moaspec.bench.runner import run_benchmark

    target = moaspec.api.load_target(args.target, **options)
    if target.tokenizer is None:
        raise MoaspecError(f"target {args.target} has no tokenizer")
    # The calibration first: it lays out the target (every method then runs on the layout a user
    # of this machine gets) and gives the `default` method its drafter.
    default_drafter, calibration = _calibrated_default(target)
    if args.methods is None:
        specs = _without_trees_where_inexact(specs, target)
    # hf / hf-pld on a llama.cpp run: the same target on transformers (float32) beside it, once
    hf_target = moaspec.api.load_target(args.target, runtime="transformers") if needs_hf_copy(specs, runtime) else None
    methods = [build_method(spec, target, default_drafter, overrides, args.ignore_eos, hf_target) for spec in specs]
    data = run_benchmark(
        target, methods, prompts, sampling, args.max_new_tokens, args.seed, progress=not args.no_progress
    )

    # 3. report
    config = _run_config(args, target, options, categories, specs, methods, calibration)
    results = write_report(data, config, out, command_line(args), plots=not args.no_plots)
    print(render_markdown(results), end="")
    irregular = timing_warning(results)
    if irregular:
        print(f"moaspec: warning: {irregular}", file=sys.stderr)
    if results["mismatches"]:
        print(f"moaspec: {len(results['mismatches'])} greedy MISMATCHES (see {out / 'results.json'})", file=sys.stderr)
        return EXIT_MISMATCH
    return 0


def _checked_flags(args: argparse.Namespace) -> tuple[tuple[str, ...], SamplingConfig, dict, Path, str, dict]:
    """bench's flags checked, and what the run reads from them: (categories, SamplingConfig, tree
    overrides, the output directory, the target's name, load_target's runtime options). A missing
    extra, a bad value or an unwritable --out is a MoaspecError here, before anything loads."""
    from moaspec import model_store
    from moaspec.bench.client_server import check_client_server_flags
    from moaspec.bench.plots import ALL_PLOT_FILES, check_plotting
    from moaspec.bench.prompts import parse_categories
    from moaspec.bench.schema import check_validation
    from moaspec.config import GenerationConfig, SamplingConfig
    from moaspec.targets.options import runtime_options
    from moaspec.tuned import tree_overrides

    check_validation()
    if not args.no_plots:
        check_plotting()
    if args.client_server:  # it runs split servers and clients
        from moaspec.extras import SERVE_MODULES, require_modules

        require_modules("serve", SERVE_MODULES, "bench --client-server")
    check_client_server_flags(args)
    categories = parse_categories(args.categories)
    if args.limit is not None and args.limit < 1:
        raise MoaspecError("--limit must be >= 1")
    sampling = SamplingConfig(temperature=args.temperature)
    GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed)
    overrides = tree_overrides(args)
    out = output_dir(args.out, files=("results.json", "results.md", *ALL_PLOT_FILES))
    return categories, sampling, overrides, out, model_store.target_name(args.target), runtime_options(args, args.target)


def _run_config(
    args: argparse.Namespace, target, options: dict, categories: tuple[str, ...], specs: list, methods: list,
    calibration: dict | None,
) -> dict:
    """results.json's `config`: what the run compared, on which target, runtime and trees."""
    from moaspec.bench.methods import llama_cpp_threads

    return {
        "target": target.name,
        "runtime": target.runtime,
        "dtype": options["dtype"] if target.runtime == "transformers" else None,  # --dtype
        "threads": llama_cpp_threads(target) if target.runtime == "llama.cpp" else None,  # --threads or the default
        "categories": list(categories),
        "limit": args.limit,
        "methods": [spec.label for spec in specs],
        "method_sources": {spec.label: spec.described for spec in specs},
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos,
        "seed": args.seed,
        "method_trees": {method.label: _tree_record(method) for method in methods},
        "calibration": calibration,
        "weight_layout": target.weight_layout,
        "tree_limit": _tree_limit(target),
    }


def _calibrated_default(target):
    """-> (the drafter `moaspec generate` would use by default, its Calibration.to_dict() or None
    when the calibration is off)."""
    from moaspec.calibration.plan import drafter_for

    drafter, calibration = drafter_for(target, None)
    return drafter, calibration.to_dict() if calibration is not None else None


def _tree_limit(target) -> dict:
    """The trees the target verifies here (calibration.plan.TreeLimit): {max_nodes, chains_only};
    llama.cpp takes fewer nodes, in chains, where its batched kernels are exact only for those."""
    from dataclasses import asdict

    from moaspec.calibration.plan import TreeLimit

    return asdict(TreeLimit.of(target))


def _without_trees_where_inexact(specs, target):
    """The default methods less those verifying trees, where llama.cpp's trees are not exact for
    this target here (calibration/plan.py: the default decodes plainly there); named methods are
    kept, so that such a method gets its one-line error."""
    from moaspec.bench.methods import DEFAULT_METHOD

    if target.runtime != "llama.cpp" or target.trees_exact:
        return specs
    kept = tuple(spec for spec in specs if spec.drafter in (None, "none", DEFAULT_METHOD))
    left_out = ", ".join(spec.label for spec in specs if spec not in kept)
    print(f"moaspec: methods {left_out} left out: llama.cpp's trees are not exact for {target.name} here", file=sys.stderr)
    return kept


def _tree_record(method) -> dict | None:
    """The draft tree an engine method's model drafter used and where it came from (tuned.py),
    with its prompt lookup's settings where it looks up first (`+ngram`)."""
    from dataclasses import asdict

    drafter = getattr(getattr(method, "engine", None), "drafter", None)
    tree = getattr(drafter, "tree_config", None)
    if tree is None:
        return None
    record = {**asdict(tree), "source": drafter.tree_source}
    lookup = getattr(drafter, "lookup", None)
    return record if lookup is None else {**record, "lookup": asdict(lookup.config)}


def write_report(data: BenchData, config: dict, out: Path, command: str, plots: bool = True) -> dict:
    """Build, validate and write results.json, results.md (and plots); -> the results dict."""
    from moaspec.bench.output import timestamp, write_results
    from moaspec.bench.plots import ALL_PLOT_FILES, render_plots
    from moaspec.bench.report import build_results, render_markdown
    from moaspec.bench.schema import validate

    results = build_results(data, config["methods"], config, machine_info(), command, timestamp())
    validate(results)
    write_results(out, results, render_markdown(results), render_plots(results) if plots else None, ALL_PLOT_FILES)
    return results


# -- moaspec tune -------------------------------------------------------------------------------
TUNE_CALIBRATION_PROMPTS, TUNE_CALIBRATION_TOKENS = 4, 64  # the calibration's defaults (not with --top1-rate)


def add_tune_parser(commands: argparse._SubParsersAction, default_target: str) -> None:
    tune = commands.add_parser("tune", help="measure this machine and save the best draft tree per drafter")
    tune.add_argument(
        "--drafters", required=True, help="comma-separated model drafters: eagle, moa, moa-tli1 or checkpoint DIRs"
    )
    tune.add_argument(
        "--target", default=default_target, help=f"built-in name, HF directory or .gguf (default {default_target})"
    )
    tune.add_argument(
        "--repeats", type=int, default=5, help="timing rounds per configuration, medians kept (default 5)"
    )
    tune.add_argument("--context", type=int, default=256, help="context length the costs are measured at (default 256)")
    tune.add_argument(
        "--top1-rate",
        type=float,
        default=None,
        help="assume this top-1 acceptance, geometric over ranks, instead of calibrating "
        "(not with --calibration-prompts / --calibration-tokens)",
    )
    tune.add_argument(
        "--calibration-prompts", type=int, default=None,
        help=f"greedy calibration generations, 0 = none (default {TUNE_CALIBRATION_PROMPTS})",
    )
    tune.add_argument(
        "--calibration-tokens", type=int, default=None,
        help=f"tokens per calibration generation (default {TUNE_CALIBRATION_TOKENS})",
    )
    tune.add_argument(
        "--device", default="cpu",
        help="cpu, cuda or cuda:N: where the target (transformers runtime) and the drafters are measured; "
        "the choice serves that kind of device only (default cpu)",
    )
    tune.add_argument("--dry-run", action="store_true", help="print the ranking, save nothing")


def check_tune_values(args: argparse.Namespace) -> None:
    """`tune`'s settings checked without the target or drafters (MoaspecError naming the flag);
    also run by `check_arguments` (scripts/recipe, before its distillation). The calibration's
    flags not given take their defaults here; given beside --top1-rate, which replaces the
    calibration, they are refused."""
    from moaspec.bench.calibration_prompts import CALIBRATION_PROMPTS
    from moaspec.targets.options import check_device

    calibration = {"--calibration-prompts": args.calibration_prompts, "--calibration-tokens": args.calibration_tokens}
    if args.top1_rate is not None and any(value is not None for value in calibration.values()):
        given = " and ".join(flag for flag, value in calibration.items() if value is not None)
        raise MoaspecError(f"--top1-rate replaces the calibration: {given} cannot be given with it")
    if args.calibration_prompts is None:
        args.calibration_prompts = TUNE_CALIBRATION_PROMPTS
    if args.calibration_tokens is None:
        args.calibration_tokens = TUNE_CALIBRATION_TOKENS

    for flag, value, least in (("--repeats", args.repeats, 1), ("--context", args.context, 8),
                               ("--calibration-prompts", args.calibration_prompts, 0),
                               ("--calibration-tokens", args.calibration_tokens, 1)):
        if value < least:
            raise MoaspecError(f"{flag} must be >= {least}, got {value}")
    if args.top1_rate is not None and not 0.0 < args.top1_rate < 1.0:
        raise MoaspecError("--top1-rate must be in (0, 1)")
    if args.calibration_prompts > len(CALIBRATION_PROMPTS):
        raise MoaspecError(f"--calibration-prompts is at most {len(CALIBRATION_PROMPTS)}")
    check_device(args.device)


def _tune_specs(args: argparse.Namespace) -> list[str]:
    """`tune`'s flags and drafters checked before torch loads: the model drafters named by
    --drafters, each once, each a checkpoint (MoaspecError naming what is wrong)."""
    from moaspec import model_store
    from moaspec.drafters import MODEL_FREE, check_drafter_spec, checkpoint_directory, split_lookup

    check_tune_values(args)
    specs = list(dict.fromkeys(comma_items(args.drafters, "--drafters")))
    target_name = model_store.target_name(args.target)
    for spec in specs:
        check_drafter_spec(spec)
        if spec in MODEL_FREE:
            raise MoaspecError(f"'{spec}' has no draft tree to tune (model drafters only)")
        base, lookup = split_lookup(spec)
        if lookup:
            raise MoaspecError(f"tune measures model drafters alone: pass '{base}', not '{spec}'")
        directory = checkpoint_directory(spec, target_name)
        if not (directory / "config.json").is_file():
            raise MoaspecError(f"{spec} is not a drafter checkpoint (no config.json)")
    return specs


def run_tune(args: argparse.Namespace) -> int:
    specs = _tune_specs(args)  # cheap checks before torch loads
    load_library_held()
    import moaspec.api
    from moaspec.bench.calibration_prompts import CALIBRATION_PROMPTS
    from moaspec.bench.output import timestamp
    from moaspec.bench.tune import tune_drafter
    from moaspec.calibration.costs import measure_verify
    from moaspec.chat import encode_chat_prompt
    from moaspec.drafters import checkpoint_directory, make_drafter
    from moaspec.tuned import device_kind, save_tuned_tree

    # tuned trees are per target and kind of device, measured there
    target = moaspec.api.load_target(args.target, runtime="transformers", device=args.device)
    context_len = min(args.context, target.max_positions // 2)
    prompts = [encode_chat_prompt(target.tokenizer, text) for text in CALIBRATION_PROMPTS[: args.calibration_prompts]]
    drafters = {spec: make_drafter(spec, target) for spec in specs}  # a drafter of another target fails here
    capped = f" (--context {args.context}: at most half the target's {target.max_positions})" if context_len < args.context else ""
    print(
        f"[moaspec] measuring target verify costs ({target.name} on {args.device}, context {context_len}{capped})...",
        file=sys.stderr,
    )
    bars = _PartBars()
    try:
        verify = measure_verify(target, context_len, args.repeats, progress=partial(bars, "verify costs"))
    finally:
        bars.close()
    irregular = verify.irregularity()
    if irregular is not None:
        print(f"moaspec: warning: {irregular}", file=sys.stderr)
    for spec in specs:
        print(f"[moaspec] measuring drafter {spec}...", file=sys.stderr)
        try:
            result = tune_drafter(
                drafters[spec], target, verify, context_len, args.repeats, args.top1_rate, prompts,
                args.calibration_tokens, bars,
            )
        finally:
            bars.close()
        print(_tune_table(spec, result))
        if result.best.tokens_per_s < result.plain_tokens_per_s:
            print(
                f"moaspec: warning: with {spec} every tree is expected to be slower than plain decoding on this machine "
                f"({result.best.tokens_per_s / result.plain_tokens_per_s:.2f}x)"
                + ("" if args.dry_run else "; the best of them is saved anyway"),
                file=sys.stderr,
            )
        if not args.dry_run:
            details = {
                "created": timestamp(),
                "machine": machine_info()["description"],
                "context_len": context_len,
                **result.details(),
            }
            path = save_tuned_tree(
                target.name, checkpoint_directory(spec, target.name), result.best.tree, details, args.device
            )
            where = "GPU" if device_kind(args.device) == "cuda" else "CPU"
            print(f"saved: {path} (used by default for this drafter and target on a {where}; see moaspec/tuned.py)\n")
    return 0


class _PartBars:
    """tune's progress on stderr: a tqdm bar per measured part, `bars(what, done, total)` after
    each of its jobs; a part's bar closes when it completes (or at `close`, when it stopped early)."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, what: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, desc=what, unit="run", file=sys.stderr, dynamic_ncols=True)
        self.bar.update(done - self.bar.n)
        if done == total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _tune_table(spec: str, result) -> str:
    hits = [f"{hit:.2f}" for hit in accumulate(result.rates)]  # the top-k hit rates the rates model
    lines = [
        f"## {spec}: target token among the drafter's top {'/'.join(str(k) for k in range(1, len(hits) + 1))}: "
        f"{' / '.join(hits)} ({result.rates_source})",
        f"plain decoding {result.plain_tokens_per_s:.2f} tok/s (one-node forward {1000 * result.costs.plain_step():.1f} ms)",
        "",
        "| depth | top-k | budget | nodes | expected τ | cycle ms | expected tok/s | vs plain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result.ranked[:8]:
        lines.append(
            f"| {c.tree.depth} | {c.tree.top_k} | {c.tree.budget} | {c.num_nodes} | {c.expected_tau:.2f} | {1000 * c.cycle_s:.1f} "
            f"| {c.tokens_per_s:.2f} | {c.tokens_per_s / result.plain_tokens_per_s:.2f}× |"
        )
    return "\n".join(lines)
