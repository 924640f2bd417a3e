"""Tuned draft trees: `moaspec tune`'s choice per machine, target and drafter checkpoint.

Stored as JSON in `<cache root>/tuned/<target name>/<method>-<checkpoint key>.json` (cache root as
in model_store.py: $MOASPEC_CACHE, else $XDG_CACHE_HOME/moaspec, else ~/.cache/moaspec), and in
`...-<checkpoint key>-cuda.json` for the choice measured on a GPU (`moaspec tune --device cuda`):
a tree that pays where a verified node is nearly free would be slow on a CPU, so each kind of
device reads its own. The checkpoint key hashes the checkpoint's config.json and its weights'
size and modification time, so a retrained drafter is not served a stale choice.

Precedence of the tree a model drafter uses (highest first):
1. explicit values: `tree_overrides` of `make_drafter` / `load`, the `--tree-*` flags of
   `moaspec generate` (each given field replaces that field only; the fields left out come
   from the levels below, where the machine calibration chooses them among the trees with the
   given fields);
2. the tuned choice for this machine, target, checkpoint and kind of device (CPU or GPU), when
   one was saved (set MOASPEC_NO_TUNED=1 to ignore it), on the runtime `moaspec tune` measures
   (transformers: a llama.cpp target's verified nodes cost otherwise, so there its tree comes
   from the machine calibration, which measures that runtime);
3. the machine calibration's choice (moaspec/calibration/plan.py; applied by `load()`, `moaspec
   generate`, `bench` and `serve` to a drafter whose tree came from the checkpoint);
4. the tree recorded in the checkpoint at training time;
5. the `TreeConfig` defaults.
The tuned choice outranks the checkpoint's tree because it was measured on the machine that runs
it, while the checkpoint's was chosen wherever the drafter was trained.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.atomic_files import write_file_atomically
from moaspec.config import MAX_TREE_BUDGET, MAX_TREE_DEPTH, MAX_TREE_TOP_K, TreeConfig
from moaspec.env_flags import env_flag
from moaspec.errors import MoaspecError
from moaspec.model_store import cache_root

if TYPE_CHECKING:
    import argparse

    import torch

TREE_FIELDS = ("depth", "top_k", "budget")
DISABLE_ENV = "MOASPEC_NO_TUNED"
TUNED_RUNTIME = "transformers"  # the runtime `moaspec tune` measures, the only one its choices apply to
DEVICE_KINDS = ("cpu", "cuda")


def checkpoint_key(directory: Path) -> str:
    """'<method>-<16 hex>' identifying a checkpoint's contents (config bytes, weights size and mtime)."""
    config = (directory / "config.json").read_bytes()
    weights = directory / "model.safetensors"
    stat = weights.stat() if weights.is_file() else None
    digest = hashlib.sha256(config + (f"|{stat.st_size}|{stat.st_mtime_ns}" if stat else "").encode())
    try:
        method = str(json.loads(config).get("method", "drafter"))
    except ValueError:
        method = "drafter"
    return f"{method}-{digest.hexdigest()[:16]}"


def device_kind(device: torch.device | str) -> str:
    """"cpu" or "cuda" (a torch.device or a --device string such as "cuda:1")."""
    kind = str(getattr(device, "type", device)).partition(":")[0]
    if kind not in DEVICE_KINDS:
        raise MoaspecError(f"no tuned trees for device '{device}' (known: {', '.join(DEVICE_KINDS)})")
    return kind


def tuned_path(target_name: str, directory: Path, device: torch.device | str = "cpu") -> Path:
    """Where `moaspec tune` keeps its choice for this target, checkpoint and kind of device."""
    kind = device_kind(device)
    suffix = "" if kind == "cpu" else f"-{kind}"
    return cache_root() / "tuned" / target_name / f"{checkpoint_key(directory)}{suffix}.json"


def save_tuned_tree(
    target_name: str, directory: Path, tree: TreeConfig, details: dict, device: torch.device | str = "cpu"
) -> Path:
    """Write the choice measured on `device` atomically; -> its path."""
    path = tuned_path(target_name, directory, device)
    record = {
        "tree": asdict(tree), "target": target_name, "checkpoint": str(directory.resolve()),
        "device": device_kind(device), **details,
    }
    return write_file_atomically(path, json.dumps(record, indent=1) + "\n")


def load_tuned_tree(target_name: str, directory: Path, device: torch.device | str = "cpu") -> TreeConfig | None:
    """The choice saved for `device`'s kind, or None (none saved, disabled by MOASPEC_NO_TUNED,
    or unreadable)."""
    if env_flag(DISABLE_ENV):
        return None
    path = tuned_path(target_name, directory, device)
    if not path.is_file():
        return None
    try:
        return TreeConfig(**json.loads(path.read_text())["tree"])
    except (ValueError, KeyError, TypeError, MoaspecError):
        return None  # a damaged cache file must never break generation; `moaspec tune` rewrites it


def add_tree_arguments(parser: argparse.ArgumentParser, applies_to: str) -> None:
    """--tree-depth / --tree-top-k / --tree-budget (each None unless given; see `tree_overrides`)."""
    for name, what in (("depth", "drafted levels"), ("top-k", "beams and children per level"), ("budget", "drafted nodes")):
        parser.add_argument(
            f"--tree-{name}", type=int, default=None,
            help=f"{applies_to}: tree {what} (default: `moaspec tune`'s choice on the transformers runtime, else "
            "the machine calibration's, else the checkpoint's)",
        )


def tree_overrides(args: argparse.Namespace) -> dict:
    """The --tree-* values as `make_drafter` overrides; MoaspecError for a value < 1."""
    overrides = {"depth": args.tree_depth, "top_k": args.tree_top_k, "budget": args.tree_budget}
    bounds = {"depth": MAX_TREE_DEPTH, "top_k": MAX_TREE_TOP_K, "budget": MAX_TREE_BUDGET}
    for name, value in overrides.items():
        if value is not None and not 1 <= value <= bounds[name]:
            raise MoaspecError(f"--tree-{name.replace('_', '-')} must be in [1, {bounds[name]}], got {value}")
    return overrides


def resolve_tree(
    base: TreeConfig, target_name: str, directory: Path | None, overrides: dict | None,
    device: torch.device | str = "cpu", runtime: str = TUNED_RUNTIME,
) -> tuple[TreeConfig, str]:
    """Apply the precedence above to a drafter whose checkpoint tree is `base` and whose target
    runs on `device` and `runtime`.

    -> (tree, source) with source "explicit", "tuned" or "checkpoint".
    """
    tuned = load_tuned_tree(target_name, directory, device) if directory is not None and runtime == TUNED_RUNTIME else None
    tree, source = (tuned, "tuned") if tuned is not None else (base, "checkpoint")
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    unknown = set(given) - {f.name for f in fields(TreeConfig)}
    if unknown:
        raise MoaspecError(f"unknown tree settings: {', '.join(sorted(unknown))}")
    if given:
        tree, source = replace(tree, **given), "explicit"
    return tree, source
