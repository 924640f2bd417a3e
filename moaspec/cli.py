"""`moaspec` command line.

    moaspec generate --prompt TEXT [--target NAME|PATH] [--drafter NAME|PATH] [--max-new-tokens N]
                     [--temperature T] [--top-p P] [--top-k K] [--seed S] [--json] [--raw]
                     [--tree-depth D] [--tree-top-k K] [--tree-budget N]
                     [--server URL --api-key-file F [--context-dtype f16|i8|f32] [--adaptive]
                      [--accept-offline] [--offline-min-prob P] [--timeout S] [--offline-deadline-s S] [--cafile F]]
    moaspec serve [--host H] [--port P] --api-key-file F [--target ...] [--drafter ...]
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
                  [--memory-hidden] [--no-layer-attention] [--no-cross-attention] [--anchor-every MIN MAX]
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
from pathlib import Path

from moaspec.cli_support import command_line, output_dir
from moaspec.errors import MoaspecError

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 1  # stdout closed by its reader, as Python itself exits on EPIPE


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise MoaspecError(message)


def _build_parser() -> argparse.ArgumentParser:
    from moaspec.drafters import DEFAULT_DRAFTER, FALLBACK_DRAFTER
    from moaspec.model_store import DEFAULT_TARGET
    from moaspec.targets.options import add_runtime_arguments
    from moaspec.tuned import add_tree_arguments

    default_drafter = (
        f"{DEFAULT_DRAFTER} for targets with a shipped MoA drafter, else {FALLBACK_DRAFTER}"
    )

    parser = _Parser(prog="moaspec", description="Lossless speculative decoding with Mixture of Attentions.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--target", default=DEFAULT_TARGET, help=f"built-in name, HF directory or .gguf (default {DEFAULT_TARGET})")
    gen.add_argument(
        "--drafter",
        default=None,
        help=f"drafter name or checkpoint (default: the fastest of none, ngram and {DEFAULT_DRAFTER} on this "
        "machine, chosen by the machine calibration; see README 'Machine calibration')",
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
    _add_serve_parser(commands, DEFAULT_TARGET, default_drafter)
    _add_data_parser(commands, DEFAULT_TARGET)
    _add_train_parser(commands, DEFAULT_TARGET)
    from moaspec.bench.cli import add_bench_parser, add_tune_parser

    add_bench_parser(commands, DEFAULT_TARGET)
    add_tune_parser(commands, DEFAULT_TARGET)
    return parser


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
    serve.add_argument("--max-tree-nodes", type=int, default=limits.max_tree_nodes, help=f"largest draft tree (default {limits.max_tree_nodes})")
    serve.add_argument("--max-new-tokens", type=int, default=limits.max_new_tokens, help=f"per session (default {limits.max_new_tokens})")
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
    from moaspec.split.commands import check_tls, read_api_keys, serve

    if not 0 <= args.port <= 65535:
        raise MoaspecError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_tree_nodes", "max_new_tokens", "max_sessions_per_key", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise MoaspecError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.idle_timeout_s > 0:
        raise MoaspecError("--idle-timeout-s must be > 0")
    from moaspec.split.serve_flags import server_limits_from_args

    server_limits_from_args(args)
    keys = read_api_keys(args.api_key_file)
    ssl_context = check_tls(args.ssl_certfile, args.ssl_keyfile)
    from moaspec.drafters import check_drafter_spec, default_drafter
    from moaspec.model_store import resolve_target

    from moaspec.targets.options import runtime_options

    if args.drafter is not None:
        check_drafter_spec(args.drafter)
    else:
        default_drafter(resolve_target(args.target)[0])  # an unknown target fails here, before loading
    args.runtime_options = runtime_options(args, args.target)
    return serve(args, keys, ssl_context)


def _add_train_parser(commands, default_target: str) -> None:
    from moaspec.config import TreeConfig
    from moaspec.train.config import TrainConfig

    defaults = TrainConfig()
    tree = TreeConfig()
    train = commands.add_parser("train", help="train a MoA or EAGLE-2 drafter on distilled data (resumable)")
    train.add_argument("--method", choices=["moa", "eagle"], required=True, help="drafter architecture")
    train.add_argument(
        "--data", required=True, nargs="+",
        help="one or more directories written by `moaspec data distill` or `moaspec data sharegpt` (read in order)",
    )
    train.add_argument("--out", required=True, help="run directory (rerun the same command to resume)")
    train.add_argument("--target", default=default_target, help=f"target the drafter serves (default {default_target})")
    train.add_argument("--tli-layers", type=int, default=0, help="MoA Target Layer Inference depth k (default 0)")
    train.add_argument(
        "--tli-raw-feature-loss", action="store_true",
        help="compare the pre-TLI state with the raw residual stream, as the reference code does "
        "(default: both divided by the stream's per-token RMS)",
    )
    train.add_argument(
        "--memory-layers", type=int, default=defaults.memory_layers,
        help="MoA memory reads the last N target layers' keys/values, 0 = all of them as in the paper "
        f"(default {defaults.memory_layers})",
    )
    train.add_argument(
        "--memory-hidden", action="store_true",
        help="MoA memory also reads the target's last hidden state (what EAGLE-2 reads; anchors then carry no loss)",
    )
    train.add_argument(
        "--ce-weight", type=float, default=defaults.ce_weight,
        help=f"weight of the soft cross-entropy with the target's distribution (default {defaults.ce_weight}, the paper's)",
    )
    train.add_argument(
        "--feature-weight", type=float, default=defaults.feature_weight,
        help=f"weight of the SmoothL1 term on the target's hidden state (default {defaults.feature_weight}, the paper's)",
    )
    train.add_argument(
        "--no-layer-attention", action="store_true",
        help="MoA memory without the Layer Self-Attention: the layers' raw keys/values pooled (an ablation)",
    )
    train.add_argument(
        "--no-cross-attention", action="store_true",
        help="MoA without the Cross-Attention's term: the drafter reads no target activations (an ablation)",
    )
    train.add_argument(
        "--anchor-every", type=int, nargs=2, metavar=("MIN", "MAX"), default=[defaults.anchor_min, defaults.anchor_max],
        help="MoA verified-block length: each sequence draws anchors every T tokens, T uniform in [MIN, MAX]; "
        f"position i - s(i) = d trains draft depth d (default {defaults.anchor_min} {defaults.anchor_max})",
    )
    train.add_argument(
        "--anchor-loss-weight", type=float, default=defaults.anchor_loss_weight,
        help="MoA loss weight at anchor positions, where the drafter sees the token's own memory, which "
        f"inference never does (0-1, default {defaults.anchor_loss_weight})",
    )
    train.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size, 0 = full (default 8192; with --init-from: the checkpoint's)")
    train.add_argument("--steps", type=int, default=defaults.steps, help=f"optimizer steps (default {defaults.steps})")
    train.add_argument("--batch-size", type=int, default=defaults.batch_size, help=f"sequences per step (default {defaults.batch_size})")
    train.add_argument(
        "--micro-batch", type=int, default=1,
        help="sequences per forward pass, padded to the longest (same gradient, more memory; raise it on a GPU, "
        "and a run resumes with any value) (default 1)",
    )
    train.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate (default {defaults.lr})")
    train.add_argument("--min-lr", type=float, default=defaults.min_lr, help=f"final learning rate (default {defaults.min_lr})")
    train.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help=f"linear warm-up steps (default {defaults.warmup_steps})")
    train.add_argument(
        "--staircase-fraction", type=float, default=defaults.staircase_fraction,
        help=f"share of the steps over which MoA's staircase SA curriculum is annealed, 0 = none "
        f"(default {defaults.staircase_fraction})",
    )
    train.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len, help=f"truncate sequences (default {defaults.max_seq_len})")
    train.add_argument("--val-conversations", type=int, default=16, help="held-out conversations (default 16)")
    train.add_argument("--val-every", type=int, default=defaults.val_every, help=f"validate every N steps (default {defaults.val_every})")
    train.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every, help=f"checkpoint every N steps (default {defaults.ckpt_every})")
    train.add_argument(
        "--feature-cache", default=None,
        help="directory of memory-mapped fp16 target features, built on first use and shared by runs on the same data "
        "reading the same features (about 2x faster training; per SmolLM2 token 1.2 KB for EAGLE-2, 4.2 KB for MoA "
        "with --memory-layers 4, 24 KB with all layers); default: run the target online",
    )
    train.add_argument("--time-limit-min", type=float, default=None, help="stop (resumably) after this many minutes")
    train.add_argument(
        "--device", default="cpu",
        help="where the target's features and the training run: cpu or cuda[:N] (bfloat16 autocast on a GPU; "
        "a run resumes on either) (default cpu)",
    )
    train.add_argument(
        "--init-from", default=None,
        help="start from the weights of a drafter checkpoint, an earlier run directory or a shipped name, "
        "with a fresh optimizer and schedule (continued training, fine-tuning)",
    )
    train.add_argument("--seed", type=int, default=defaults.seed, help=f"data order and anchors (default {defaults.seed})")
    train.add_argument("--tree-depth", type=int, default=tree.depth, help=f"default tree depth stored in the checkpoint (default {tree.depth})")
    train.add_argument("--tree-top-k", type=int, default=tree.top_k, help=f"default tree top-k (default {tree.top_k})")
    train.add_argument("--tree-budget", type=int, default=tree.budget, help=f"default drafted nodes (default {tree.budget})")


def _train(args: argparse.Namespace) -> int:
    from moaspec.config import TreeConfig
    from moaspec.train.config import TrainConfig
    from moaspec.train.distill import shard_files

    for name in ("steps", "batch_size", "micro_batch", "val_conversations", "val_every", "ckpt_every", "max_seq_len"):
        if getattr(args, name) < 1:
            raise MoaspecError(f"--{name.replace('_', '-')} must be >= 1")
    if args.draft_vocab < 0 or args.tli_layers < 0 or not args.lr > 0:
        raise MoaspecError("--draft-vocab and --tli-layers must be >= 0 and --lr > 0")
    if not 0.0 <= args.staircase_fraction <= 1.0:
        raise MoaspecError("--staircase-fraction must be within [0, 1]")
    if args.method == "eagle" and args.tli_layers:
        raise MoaspecError("--tli-layers applies to --method moa only")
    if args.method == "eagle" and (args.memory_layers or args.memory_hidden or args.no_layer_attention or args.no_cross_attention):
        raise MoaspecError("--memory-layers, --memory-hidden, --no-layer-attention and --no-cross-attention apply to --method moa only")
    if not 1 <= args.anchor_every[0] <= args.anchor_every[1]:
        raise MoaspecError("--anchor-every needs 1 <= MIN <= MAX")
    if not (args.ce_weight >= 0 and args.feature_weight >= 0 and args.ce_weight + args.feature_weight > 0):
        raise MoaspecError("--ce-weight and --feature-weight must be >= 0, not both 0")
    data = tuple(Path(directory).expanduser() for directory in args.data)
    for directory in data:
        if not directory.is_dir() or not shard_files(directory):
            raise MoaspecError(f"{directory} is not a directory with shard-*.jsonl files (see `moaspec data distill`)")
    if args.time_limit_min is not None and not args.time_limit_min > 0:
        raise MoaspecError("--time-limit-min must be > 0")
    out = output_dir(args.out)
    feature_cache = None if args.feature_cache is None else output_dir(args.feature_cache, "--feature-cache")
    try:
        config = TrainConfig(
            method=args.method, tli_layers=args.tli_layers, steps=args.steps, batch_size=args.batch_size,
            lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps, max_seq_len=args.max_seq_len,
            staircase_fraction=args.staircase_fraction, tli_rms_scaled=not args.tli_raw_feature_loss,
            val_every=args.val_every, ckpt_every=args.ckpt_every, seed=args.seed,
            memory_layers=args.memory_layers, memory_hidden=args.memory_hidden, layer_attention=not args.no_layer_attention,
            cross_attention=not args.no_cross_attention,
            ce_weight=args.ce_weight, feature_weight=args.feature_weight,
            anchor_min=args.anchor_every[0], anchor_max=args.anchor_every[1], anchor_loss_weight=args.anchor_loss_weight,
        )
        tree = TreeConfig(depth=args.tree_depth, top_k=args.tree_top_k, budget=args.tree_budget)
    except ValueError as exc:
        raise MoaspecError(str(exc)) from exc
    from moaspec.targets.options import check_device

    check_device(args.device)
    init_from = None if args.init_from is None else _initial_checkpoint(args.init_from, args.target)
    from moaspec.model_store import resolve_target

    resolve_target(args.target)
    from moaspec.train.run import RunSpec, run_training

    spec = RunSpec(
        data_dirs=data, out_dir=out, target=args.target, draft_vocab=args.draft_vocab,
        val_conversations=args.val_conversations,
        time_limit_s=None if args.time_limit_min is None else 60.0 * args.time_limit_min,
        command=command_line(args),
        feature_cache=feature_cache,
        init_from=init_from,
        device=args.device,
        micro_batch=args.micro_batch,
    )
    from moaspec.train.allocator import keep_freed_memory

    keep_freed_memory()  # training frees and reallocates large tensors every step (allocator.py)
    try:
        checkpoint = run_training(spec, config, tree)
    except ValueError as exc:  # e.g. resuming with another config
        raise MoaspecError(str(exc)) from exc
    print(f"[moaspec] drafter checkpoint: {checkpoint}", file=sys.stderr)
    return 0


def _add_data_parser(commands, default_target: str) -> None:
    data = commands.add_parser("data", help="build drafter-training data")
    actions = data.add_subparsers(
        dest="data_command", metavar="{distill,sharegpt,stats}", required=True, parser_class=_Parser
    )
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
        "--device", default="cpu", help="where the target generates: cpu or cuda[:N] (sampled rows differ by device)"
    )
    distill.add_argument(
        "--seed", type=int, default=0, help="prompt shuffle, batch modes and sampling seeds (default 0)"
    )
    distill.add_argument(
        "--skip-conversations", type=int, default=0, metavar="N",
        help="pass over the first N usable prompts of the shuffle: with the same seed, the prompts that "
        "continue where --num-conversations N stopped (default 0)",
    )
    sharegpt = actions.add_parser(
        "sharegpt", help="whole ShareGPT conversations, every assistant turn a loss span (teacher-forced, no generation)"
    )
    sharegpt.add_argument("--out", required=True, help="output directory")
    sharegpt.add_argument(
        "--target", default=default_target, help=f"target whose chat template encodes them (default {default_target})"
    )
    sharegpt.add_argument("--num-conversations", type=int, default=None, help="how many conversations (default all)")
    sharegpt.add_argument("--max-seq-len", type=int, default=768, help="cut each conversation here (default 768)")
    sharegpt.add_argument("--shard-size", type=int, default=1000, help="records per jsonl shard (default 1000)")
    sharegpt.add_argument("--seed", type=int, default=0, help="conversation shuffle (default 0)")
    sharegpt.add_argument(
        "--skip-conversations", type=int, default=0, metavar="N",
        help="pass over the first N usable conversations of the shuffle: with the same seed, the data set that "
        "continues where --num-conversations N stopped (default 0)",
    )
    stats = actions.add_parser("stats", help="summarise a training data directory")
    stats.add_argument("dir", help="a directory written by `moaspec data distill` or `moaspec data sharegpt`")


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


def _generate(args: argparse.Namespace) -> int:
    from moaspec.chat import check_prompt_text
    from moaspec.config import GenerationConfig, SamplingConfig

    # Validate everything cheap before the model loads.
    SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed)
    check_prompt_text(args.prompt)
    _check_named(args, "--drafter", "--target")
    if args.server is None:
        _refuse_split_flags(args)
    from moaspec.drafters import MODEL_FREE, check_drafter_spec, default_drafter
    from moaspec.model_store import resolve_target
    from moaspec.tuned import tree_overrides

    if args.drafter is not None:
        check_drafter_spec(args.drafter)
    overrides = tree_overrides(args)
    api_key = None
    if args.server is not None:  # before resolve_target, which may convert the target first (~30 s)
        from moaspec.split.commands import read_api_keys

        if not args.timeout > 0:
            raise MoaspecError("--timeout must be > 0")
        if not args.offline_deadline_s >= 0:
            raise MoaspecError("--offline-deadline-s must be >= 0")
        api_key = read_api_keys(args.api_key_file)[0]
    from moaspec.targets.options import runtime_options

    options = runtime_options(args, args.target)
    target_name, _ = resolve_target(args.target)  # unknown name / bad path: fail before torch loads
    named = args.drafter or default_drafter(target_name)
    if named in MODEL_FREE and any(value is not None for value in overrides.values()):
        raise MoaspecError(f"--tree-* settings apply to model drafters only, not to '{named}'")
    if args.server is not None:
        from moaspec.split.commands import generate_remote

        args.drafter = named
        return generate_remote(args, api_key, overrides)

    from moaspec.api import load

    lm = load(target=args.target, drafter=args.drafter, tree_overrides=overrides, light_tokenizer=True, **options)
    streamer = None
    if not args.json:
        from moaspec.text_stream import TextPrinter

        streamer = TextPrinter(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
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
        record = {"target": lm.target.name, "runtime": lm.target.runtime, "drafter": lm.drafter_name, **out.to_dict()}
        print(json.dumps(record))
    else:
        sys.stdout.flush()
        print(
            f"[moaspec] {out.stats.new_tokens} tokens, tau {out.stats.tau:.2f}, "
            f"{out.stats.tokens_per_s:.1f} tok/s",
            file=sys.stderr,
        )
    return 0


def _initial_checkpoint(value: str, target_name: str) -> Path:
    """--init-from: a shipped drafter name, a checkpoint directory, or a run directory (its checkpoint/)."""
    from moaspec.drafters import checkpoint_directory, split_lookup

    base, lookup = split_lookup(value)
    if lookup:
        raise MoaspecError(f"--init-from takes a checkpoint: '{base}', not '{value}' (prompt lookup has no weights)")
    directory = checkpoint_directory(value, target_name)
    if (directory / "checkpoint" / "config.json").is_file():
        directory = directory / "checkpoint"
    if not (directory / "config.json").is_file():
        raise MoaspecError(f"--init-from {value} is not a drafter checkpoint (no config.json)")
    return directory


def _data_distill(args: argparse.Namespace) -> int:
    from dataclasses import asdict

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
        skip_conversations=args.skip_conversations,
    )
    out = output_dir(args.out)
    if out.is_dir():
        check_resume(out, {"target": args.target, **asdict(config)})
    sharegpt_path()
    from moaspec.model_store import resolve_target

    resolve_target(args.target)
    from moaspec.targets.options import check_device

    check_device(args.device)
    from moaspec.train.allocator import keep_freed_memory

    keep_freed_memory()  # batched generation frees and reallocates large tensors every step (allocator.py)
    manifest = run_distill(args.target, out, config, command_line(args), device=args.device)
    totals = manifest["totals"]
    print(
        f"[moaspec] {totals['num_records']} records, {totals['response_tokens']} response tokens "
        f"in {out} ({'complete' if manifest['complete'] else 'incomplete'})",
        file=sys.stderr,
    )
    return 0


def _data_sharegpt(args: argparse.Namespace) -> int:
    from moaspec.train.distill import check_resume
    from moaspec.train.sharegpt import sharegpt_path
    from moaspec.train.teacher_forced import TeacherForcedConfig, run_teacher_forced

    config = TeacherForcedConfig(
        max_seq_len=args.max_seq_len, num_conversations=args.num_conversations,
        shard_size=args.shard_size, seed=args.seed, skip_conversations=args.skip_conversations,
    )
    out = output_dir(args.out)
    if out.is_dir():
        check_resume(out, config.settings(args.target), TeacherForcedConfig)
    sharegpt_path()
    from moaspec.model_store import resolve_target

    resolve_target(args.target)
    manifest = run_teacher_forced(args.target, out, config, command_line(args))
    totals = manifest["totals"]
    print(
        f"[moaspec] {totals['num_records']} conversations, {totals['tokens']} tokens "
        f"({totals['assistant_tokens']} in assistant turns) in {out}",
        file=sys.stderr,
    )
    return 0


def _data_stats(args: argparse.Namespace) -> int:
    from moaspec.train.distill import read_manifest, read_shards, shard_files

    root = Path(args.dir)
    if not root.is_dir() or not shard_files(root):
        raise MoaspecError(f"{root} is not a directory with shard-*.jsonl files")
    manifest = read_manifest(root)
    records = read_shards(root)
    try:
        return _print_data_stats(records, manifest)
    except (KeyError, TypeError, ValueError) as exc:
        raise MoaspecError(f"{root} holds a record that is not training data ({type(exc).__name__}: {exc})") from exc


def _print_data_stats(records: list[dict], manifest: dict) -> int:
    """`moaspec data stats`' table of distilled or teacher-forced records (KeyError, TypeError or
    ValueError on records of another shape)."""
    from moaspec.train.distill import summarize
    from moaspec.train.teacher_forced import MODE, summarize_teacher_forced

    if records and records[0].get("mode") == MODE:
        summary = summarize_teacher_forced(records)
        print(f"records          {summary['num_records']} teacher-forced conversations")
        print(f"tokens           {summary['tokens']} (mean {summary['mean_tokens']:.1f})")
        print(f"assistant tokens {summary['assistant_tokens']} in {summary['assistant_spans']} turns")
        if manifest:
            print(f"target           {manifest.get('target')}")
        return 0
    summary = summarize(records, manifest.get("eos_ids", ()))
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


def _stop_on_sigterm() -> None:
    """`kill` (SIGTERM) unwinds like Ctrl-C, so long jobs (distill, train) save their progress."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, interrupt)


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
        if args.command == "data":
            handlers = {"distill": _data_distill, "sharegpt": _data_sharegpt, "stats": _data_stats}
            return handlers[args.data_command](args), command
        if args.command == "train":
            return _train(args), command
        if args.command in ("bench", "tune"):
            from moaspec.bench.cli import run_bench, run_tune

            return (run_bench(args) if args.command == "bench" else run_tune(args)), command
        if args.command == "serve":
            return _serve(args), command
        return _generate(args), command
    except MoaspecError as exc:
        print(f"moaspec: error: {exc}", file=sys.stderr)
        return EXIT_USAGE, command
    except KeyboardInterrupt:
        print("moaspec: interrupted", file=sys.stderr)
        return 130, command
    except BrokenPipeError:  # the reader of the output went away (`| head`): what it took is out
        return EXIT_BROKEN_PIPE, command


FAST_EXIT_COMMANDS = ("generate",)  # nothing left to write once the command returns: no files, no threads


def entry() -> None:
    """The `moaspec` console script: main(), then for `generate` an exit that skips the interpreter's
    teardown of torch and llama.cpp (~0.5 s after the text is out; bench/startup.py measures it)."""
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
