"""`moaspec train` and `moaspec data distill|sharegpt|stats`: flags, cheap validation before torch
loads, then the run (moaspec/train/run.py, distill.py, teacher_forced.py).

    moaspec train --method moa|eagle --data DIR [DIR ...] --out RUN [...]   (rerun to resume)
    moaspec data distill --out DIR [--target NAME|PATH] [...]               (rerun to resume)
    moaspec data sharegpt --out DIR [--target NAME|PATH] [...]
    moaspec data stats DIR

Progress goes to stderr, the result's path or totals in one last `[moaspec] ...` line.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.cli_support import command_line, output_dir
from moaspec.errors import MoaspecError
from moaspec.signals import load_library_held

if TYPE_CHECKING:
    from moaspec.config import TreeConfig
    from moaspec.train.config import TrainConfig


def add_train_parser(commands: argparse._SubParsersAction, default_target: str) -> None:
    from moaspec.train.config import TrainConfig

    defaults = TrainConfig()
    train = commands.add_parser("train", help="train a MoA or EAGLE-2 drafter on distilled data (resumable)")
    train.add_argument("--method", choices=["moa", "eagle"], required=True, help="drafter architecture")
    train.add_argument(
        "--data", required=True, nargs="+",
        help="one or more directories written by `moaspec data distill` or `moaspec data sharegpt` (read in order)",
    )
    train.add_argument("--out", required=True, help="run directory (rerun the same command to resume)")
    train.add_argument("--target", default=default_target, help=f"target the drafter serves (default {default_target})")
    _add_architecture_flags(train.add_argument_group("architecture"), defaults)
    _add_loss_flags(train.add_argument_group("loss"), defaults)
    _add_schedule_flags(train.add_argument_group("schedule and data"), defaults)
    _add_run_flags(train.add_argument_group("run"), defaults)


def _add_architecture_flags(group: argparse._ArgumentGroup, defaults: TrainConfig) -> None:
    group.add_argument(
        "--tli-layers", type=int, default=None,
        help="MoA Target Layer Inference depth k (default: --init-from's, else 0)",
    )
    group.add_argument(
        "--memory-layers", type=int, default=None,
        help="MoA memory reads the last N target layers' keys/values, 0 = all of them as in the paper "
        f"(default: --init-from's, else {defaults.memory_layers})",
    )
    group.add_argument(
        "--memory-hidden", action="store_true", default=None,
        help="MoA memory also reads the target's last hidden state (what EAGLE-2 reads; anchors then carry no loss) "
        "(default: --init-from's, else off)",
    )
    group.add_argument(
        "--intermediate-size", type=int, default=0, metavar="N",
        help="width of MoA's two feed-forward layers (default: --init-from's, else 3/2 x the target's hidden size); "
        "with --init-from, a wider N widens its layers, the new units' output weights at zero (the same function)",
    )
    group.add_argument(
        "--no-layer-attention", action="store_true", default=None,
        help="MoA memory without the Layer Self-Attention: the layers' raw keys/values pooled (an ablation; "
        "default: --init-from's, else with it)",
    )
    group.add_argument(
        "--no-cross-attention", action="store_true", default=None,
        help="MoA without the Cross-Attention's term: the drafter reads no target activations (an ablation; "
        "default: --init-from's, else with it)",
    )
    group.add_argument("--draft-vocab", type=int, default=8192, help="reduced draft vocabulary size, 0 = full (default 8192; with --init-from: the checkpoint's)")


def _add_loss_flags(group: argparse._ArgumentGroup, defaults: TrainConfig) -> None:
    group.add_argument(
        "--tli-raw-feature-loss", action="store_true",
        help="compare the pre-TLI state with the raw residual stream, as the reference code does "
        "(default: both divided by the stream's per-token RMS)",
    )
    group.add_argument(
        "--ce-weight", type=float, default=defaults.ce_weight,
        help=f"weight of the soft cross-entropy with the target's distribution (default {defaults.ce_weight}, the paper's)",
    )
    group.add_argument(
        "--feature-weight", type=float, default=defaults.feature_weight,
        help=f"weight of the SmoothL1 term on the target's hidden state (default {defaults.feature_weight}, the paper's)",
    )
    group.add_argument(
        "--anchor-every", type=int, nargs=2, metavar=("MIN", "MAX"), default=[defaults.anchor_min, defaults.anchor_max],
        help="MoA verified-block length: each sequence draws anchors every T tokens, T uniform in [MIN, MAX]; "
        f"position i - s(i) = d trains draft depth d (default {defaults.anchor_min} {defaults.anchor_max})",
    )
    group.add_argument(
        "--anchor-loss-weight", type=float, default=defaults.anchor_loss_weight,
        help="MoA loss weight at anchor positions, where the drafter sees the token's own memory, which "
        f"inference never does (0-1, default {defaults.anchor_loss_weight})",
    )


def _add_schedule_flags(group: argparse._ArgumentGroup, defaults: TrainConfig) -> None:
    group.add_argument("--steps", type=int, default=defaults.steps, help=f"optimizer steps (default {defaults.steps})")
    group.add_argument("--batch-size", type=int, default=defaults.batch_size, help=f"sequences per step (default {defaults.batch_size})")
    group.add_argument(
        "--micro-batch", type=int, default=1,
        help="sequences per forward pass, padded to the longest (same gradient, more memory; raise it on a GPU, "
        "and a run resumes with any value) (default 1)",
    )
    group.add_argument("--lr", type=float, default=defaults.lr, help=f"peak learning rate (default {defaults.lr})")
    group.add_argument("--min-lr", type=float, default=defaults.min_lr, help=f"final learning rate (default {defaults.min_lr})")
    group.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps, help=f"linear warm-up steps (default {defaults.warmup_steps})")
    group.add_argument(
        "--staircase-fraction", type=float, default=defaults.staircase_fraction,
        help=f"share of the steps over which MoA's staircase SA curriculum is annealed, 0 = none "
        f"(default {defaults.staircase_fraction})",
    )
    group.add_argument("--max-seq-len", type=int, default=defaults.max_seq_len, help=f"truncate sequences (default {defaults.max_seq_len})")
    group.add_argument("--seed", type=int, default=defaults.seed, help=f"data order and anchors (default {defaults.seed})")


def _add_run_flags(group: argparse._ArgumentGroup, defaults: TrainConfig) -> None:
    from moaspec.config import TreeConfig

    tree = TreeConfig()
    group.add_argument("--val-conversations", type=int, default=16, help="held-out conversations (default 16)")
    group.add_argument("--val-every", type=int, default=defaults.val_every, help=f"validate every N steps (default {defaults.val_every})")
    group.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every, help=f"checkpoint every N steps (default {defaults.ckpt_every})")
    group.add_argument(
        "--feature-cache", default=None,
        help="directory of memory-mapped fp16 target features, built on first use and shared by runs on the same data "
        "reading the same features (about 2x faster training; per SmolLM2 token 1.2 KB for EAGLE-2, 4.2 KB for MoA "
        "with --memory-layers 4, 25 KB with all layers); default: run the target online",
    )
    group.add_argument("--time-limit-min", type=float, default=None, help="stop (resumably) after this many minutes")
    group.add_argument(
        "--device", default="cpu",
        help="where the target's features and the training run: cpu or cuda[:N] (bfloat16 autocast on a GPU; "
        "a run resumes on either) (default cpu)",
    )
    group.add_argument(
        "--init-from", default=None,
        help="start from the weights of a drafter checkpoint, an earlier run directory or a shipped name, "
        "with a fresh optimizer and schedule (continued training, fine-tuning); MoA's architecture flags "
        "not given are the checkpoint's",
    )
    group.add_argument("--tree-depth", type=int, default=tree.depth, help=f"default tree depth stored in the checkpoint (default {tree.depth})")
    group.add_argument("--tree-top-k", type=int, default=tree.top_k, help=f"default tree top-k (default {tree.top_k})")
    group.add_argument("--tree-budget", type=int, default=tree.budget, help=f"default drafted nodes (default {tree.budget})")


def check_train_values(args: argparse.Namespace) -> tuple[TrainConfig, TreeConfig]:
    """`train`'s settings checked without data, target or output (MoaspecError naming the flag)
    -> (TrainConfig, TreeConfig). Also run by `check_arguments`, so scripts/recipe refuses them
    before its half-hour distillation."""
    from moaspec.config import TreeConfig
    from moaspec.targets.options import check_device
    from moaspec.train.config import TrainConfig

    for name in ("steps", "batch_size", "micro_batch", "val_conversations", "val_every", "ckpt_every", "max_seq_len"):
        if getattr(args, name) < 1:
            raise MoaspecError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("draft_vocab", "tli_layers", "intermediate_size"):
        if getattr(args, name) < 0:
            raise MoaspecError(f"--{name.replace('_', '-')} must be >= 0")
    if not args.lr > 0:
        raise MoaspecError(f"--lr must be > 0, got {args.lr:g}")
    if not 0 < args.min_lr <= args.lr:
        raise MoaspecError(f"--min-lr must be in (0, --lr = {args.lr:g}] (the rate decays to it), got {args.min_lr:g}")
    if args.warmup_steps < 0:
        raise MoaspecError("--warmup-steps must be >= 0")
    if not 0.0 <= args.staircase_fraction <= 1.0:
        raise MoaspecError("--staircase-fraction must be within [0, 1]")
    if args.method == "eagle" and args.tli_layers:
        raise MoaspecError("--tli-layers applies to --method moa only")
    moa_only = args.memory_layers or args.memory_hidden or args.no_layer_attention or args.no_cross_attention or args.intermediate_size
    if args.method == "eagle" and moa_only:
        raise MoaspecError(
            "--memory-layers, --memory-hidden, --no-layer-attention, --no-cross-attention and --intermediate-size "
            "apply to --method moa only"
        )
    if not 1 <= args.anchor_every[0] <= args.anchor_every[1]:
        raise MoaspecError("--anchor-every needs 1 <= MIN <= MAX")
    weights = (args.ce_weight, args.feature_weight)
    if not (all(0 <= weight < math.inf for weight in weights) and sum(weights) > 0):
        raise MoaspecError("--ce-weight and --feature-weight must be finite and >= 0, not both 0")
    if not 0.0 <= args.anchor_loss_weight <= 1.0:
        raise MoaspecError(f"--anchor-loss-weight must be within [0, 1], got {args.anchor_loss_weight:g}")
    if not 0 <= args.seed < 2**63:
        raise MoaspecError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.time_limit_min is not None and not args.time_limit_min > 0:
        raise MoaspecError("--time-limit-min must be > 0")
    try:
        config = TrainConfig(
            method=args.method, tli_layers=args.tli_layers, steps=args.steps, batch_size=args.batch_size,
            lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps, max_seq_len=args.max_seq_len,
            staircase_fraction=args.staircase_fraction, tli_rms_scaled=not args.tli_raw_feature_loss,
            val_every=args.val_every, ckpt_every=args.ckpt_every, seed=args.seed,
            memory_layers=args.memory_layers, memory_hidden=args.memory_hidden, layer_attention=not args.no_layer_attention,
            cross_attention=not args.no_cross_attention, intermediate_size=args.intermediate_size,
            ce_weight=args.ce_weight, feature_weight=args.feature_weight,
            anchor_min=args.anchor_every[0], anchor_max=args.anchor_every[1], anchor_loss_weight=args.anchor_loss_weight,
        )
    except ValueError as exc:
        raise MoaspecError(str(exc)) from exc
    try:
        tree = TreeConfig(depth=args.tree_depth, top_k=args.tree_top_k, budget=args.tree_budget)
    except ValueError as exc:
        raise MoaspecError(f"--tree-depth / --tree-top-k / --tree-budget: {exc}") from exc
    check_device(args.device)
    return config, tree


# what a run directory holds (train_state.pt, checkpoint/, runs.jsonl: moaspec/train/run.py), and a
# feature cache (feature_cache.INDEX and ARRAYS; named here so that no torch loads before the checks)
RUN_FILES = ("train_state.pt", "checkpoint", "runs.jsonl")
FEATURE_CACHE_FILES = ("index.json", "layer_kv.npy", "hidden.npy", "lse.npy", "argmax.npy")


def _checked_data(directories: list[str]) -> tuple[Path, ...]:
    """--data: directories of shards, each named once; one still being distilled is said."""
    from moaspec.train.distill import read_manifest, shard_files

    data = tuple(Path(directory).expanduser() for directory in directories)
    seen: set[Path] = set()
    for directory in data:
        if not directory.is_dir() or not shard_files(directory):
            raise MoaspecError(f"{directory} is not a directory with shard-*.jsonl files (see `moaspec data distill`)")
        if directory.resolve() in seen:
            raise MoaspecError(f"--data names {directory} twice (its records would count double)")
        seen.add(directory.resolve())
        if read_manifest(directory).get("complete") is False:
            print(f"moaspec: note: {directory} is not complete yet (`moaspec data stats {directory}`): "
                  "training on the records it holds now", file=sys.stderr)
    return data


def _own_directory(directory: Path, flag: str, own: tuple[str, ...], what: str) -> Path:
    """`directory`, unless it holds files of something else (none of `own`, hidden ones aside):
    a run or cache is not written in among another's files."""
    entries = [entry.name for entry in directory.iterdir() if not entry.name.startswith(".")] if directory.is_dir() else []
    if entries and not any(name in entries for name in own):
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise MoaspecError(f"{flag} {directory} holds other files ({shown}), not {what}; use a new or empty directory")
    return directory


def check_train_arguments(args: argparse.Namespace) -> None:
    """`check_arguments`' part for `train`: check_train_values with the architecture flags not
    given at their defaults (what --init-from's checkpoint gives is checked when the run starts)."""
    _inherit_architecture(args, None)
    check_train_values(args)


def run_train(args: argparse.Namespace) -> int:
    from moaspec.model_store import target_name

    name = target_name(args.target)  # checks the target exists, converts nothing: the cheap refusals come first
    init_from = None if args.init_from is None else _initial_checkpoint(args.init_from, name, args.method)
    _inherit_architecture(args, init_from)
    config, tree = check_train_values(args)
    data = _checked_data(args.data)
    out = _own_directory(
        output_dir(args.out, files=("train_state.pt", "runs.jsonl"), directories=("checkpoint",)), "--out", RUN_FILES,
        "a `moaspec train` run",
    )
    feature_cache = None
    if args.feature_cache is not None:
        feature_cache = _own_directory(output_dir(args.feature_cache, "--feature-cache"), "--feature-cache",
                                       FEATURE_CACHE_FILES, "a feature cache")
    from moaspec.model_store import resolve_target
    from moaspec.train.distill import check_data_target

    check_data_target(data, name)
    _check_against_target(args, resolve_target(args.target)[1])
    load_library_held()
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


def _inherit_architecture(args: argparse.Namespace, init_from: Path | None) -> None:
    """Fill MoA's architecture flags not given: those of --init-from's checkpoint when it is one of
    this --method (fine-tuning the shipped `moa` needs no --memory-layers 4), else the defaults."""
    from moaspec.train.config import TrainConfig

    defaults = TrainConfig()
    fallback = {
        "tli_layers": defaults.tli_layers, "memory_layers": defaults.memory_layers, "memory_hidden": defaults.memory_hidden,
        "no_layer_attention": not defaults.layer_attention, "no_cross_attention": not defaults.cross_attention,
    }
    recorded: dict = {}
    record = _checkpoint_record(init_from)
    if record:
        net = record.get("config") if record.get("method") == args.method else None
        if isinstance(net, dict):
            recorded = {
                "tli_layers": net.get("tli_layers"), "memory_layers": net.get("memory_layers"),
                "memory_hidden": net.get("memory_hidden"),
                "no_layer_attention": None if "layer_attention" not in net else not net["layer_attention"],
                "no_cross_attention": None if "cross_attention" not in net else not net["cross_attention"],
            }
    for name, default in fallback.items():
        if getattr(args, name) is None:
            value = recorded.get(name)
            setattr(args, name, default if value is None else value)


def _check_against_target(args: argparse.Namespace, model_dir: Path) -> None:
    """--tli-layers, --memory-layers and --max-seq-len against the target's layer count and
    context (config.json: Llama-style names, or GPT-2's), before anything loads."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    layers = config.get("num_hidden_layers", config.get("n_layer"))
    if isinstance(layers, int):
        if args.tli_layers >= layers:
            raise MoaspecError(f"--tli-layers must be below the target's {layers} layers, got {args.tli_layers}")
        if args.memory_layers > layers:
            raise MoaspecError(f"--memory-layers must be at most the target's {layers} layers (0 = all), got {args.memory_layers}")
    positions = config.get("max_position_embeddings", config.get("n_positions"))
    if isinstance(positions, int) and args.max_seq_len > positions:
        raise MoaspecError(f"--max-seq-len {args.max_seq_len} exceeds the target's context of {positions} positions")


def add_data_parser(commands: argparse._SubParsersAction, default_target: str) -> None:
    data = commands.add_parser("data", help="build drafter-training data")
    actions = data.add_subparsers(
        dest="data_command", metavar="{distill,sharegpt,stats}", required=True, parser_class=type(data)
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
        "--device", default="cpu", help="where the target generates: cpu or cuda[:N] (sampled rows differ by device; default cpu)"
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


def _checkpoint_record(directory: Path | None) -> dict:
    """--init-from's config.json as far as it reads ({} for none, or one unreadable or not an
    object: a damaged config is named when the weights load, read_checkpoint)."""
    import json

    try:
        record = json.loads((directory / "config.json").read_text()) if directory is not None else {}
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _initial_checkpoint(value: str, target_name: str, method: str) -> Path:
    """--init-from: a shipped drafter name, a checkpoint directory, or a run directory (its
    checkpoint/), of `method` where its config says (a damaged one is named when it loads)."""
    from moaspec.drafters import checkpoint_directory, split_lookup

    base, lookup = split_lookup(value)
    if lookup:
        raise MoaspecError(f"--init-from takes a checkpoint: '{base}', not '{value}' (prompt lookup has no weights)")
    directory = checkpoint_directory(value, target_name)
    if not (directory / "config.json").is_file():
        raise MoaspecError(f"--init-from {value} is not a drafter checkpoint (no config.json)")
    recorded = _checkpoint_record(directory).get("method")
    if isinstance(recorded, str) and recorded != method:
        raise MoaspecError(
            f"--init-from {directory} holds a drafter of method '{recorded}', not '{method}': "
            f"pass --method {recorded} to continue it, or --init-from a {method} checkpoint"
        )
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
    load_library_held()
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
    load_library_held()
    manifest = run_teacher_forced(args.target, out, config, command_line(args))
    totals = manifest["totals"]
    print(
        f"[moaspec] {totals['num_records']} conversations, {totals['tokens']} tokens "
        f"({totals['assistant_tokens']} in assistant turns) in {out}",
        file=sys.stderr,
    )
    return 0


def _data_stats(args: argparse.Namespace) -> int:
    from moaspec.train.distill import read_manifest, read_shards, record_fields, shard_files

    root = Path(args.dir)
    if not root.is_dir() or not shard_files(root):
        raise MoaspecError(f"{root} is not a directory with shard-*.jsonl files")
    manifest = read_manifest(root)
    records = read_shards(root, record_fields)
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
        n = summary["num_records"]
        print(f"records          {n} teacher-forced conversations")
        print(f"tokens           {summary['tokens']} (mean {summary['mean_tokens']:.1f})")
        print(f"assistant tokens {summary['assistant_tokens']} in {summary['assistant_spans']} turns")
        done = "conversations"
    else:
        summary = summarize(records, manifest.get("eos_ids", ()))
        n = summary["num_records"]
        print(f"records          {n} ({summary['num_greedy']} greedy, {summary['num_sampled']} sampled)")
        print(f"prompt tokens    {summary['prompt_tokens']} (mean {summary['mean_prompt_tokens']:.1f})")
        print(f"response tokens  {summary['response_tokens']} (mean {summary['mean_response_tokens']:.1f})")
        if "fraction_ended_with_eos" in summary:
            print(f"ended with eos   {summary['fraction_ended_with_eos']:.1%}")
        done = "prompts"
    if manifest:  # read_manifest checked the types of what is read here
        selected = manifest.get("counts", {}).get("selected")
        progress = f"; {n}/{selected} {done} done" if selected is not None else ""
        print(f"target           {manifest.get('target')}{progress}")
        print(f"wall time        {manifest.get('wall_s_total', 0.0):.0f} s")
    if manifest.get("complete") is False:
        how = f"`{manifest['command']}`" if "command" in manifest else "the command that wrote it"
        print(f"incomplete       rerun {how} to finish it")
    return 0


def run_data(args: argparse.Namespace) -> int:
    """`moaspec data <distill|sharegpt|stats>` -> exit status."""
    handlers = {"distill": _data_distill, "sharegpt": _data_sharegpt, "stats": _data_stats}
    return handlers[args.data_command](args)
