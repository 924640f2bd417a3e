"""Drafter registry: map a `--drafter` value (a name or a checkpoint directory) to a drafter.

- `none`, `ngram`: model-free, for any target;
- `moa`, `eagle`, `moa-tli1`: the shipped checkpoints for the target, in
  `moaspec/checkpoints/<target name>/<drafter name>/`;
- anything else that is a directory: a drafter checkpoint (config.json says which method);
- any model drafter followed by `+ngram` (`moa+ngram`, `DIR+ngram`): the n-gram drafter's
  prompt-lookup trie where the context has a match, else the model's tree (drafters/tree_drafter.py).

Kept free of heavy imports so the CLI can reject an unknown drafter before torch loads.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from moaspec.drafters.base import Drafter
    from moaspec.targets.base import Target

# model-free drafters: name -> "module:factory(target)"
MODEL_FREE: dict[str, str] = {
    "none": "moaspec.drafters.none:NoDrafter.for_target",
    "ngram": "moaspec.drafters.ngram:NgramDrafter.for_target",
}
# checkpoint methods: config.json "method" -> "module:Class" (inference drafter around a trained net)
METHODS: dict[str, str] = {
    "moa": "moaspec.drafters.moa:MoADrafter",
    "eagle": "moaspec.drafters.eagle:EagleDrafter",
}
SHIPPED = ("moa", "moa-tli1", "eagle")
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "checkpoints"

LOOKUP_SUFFIX = "+ngram"
DEFAULT_DRAFTER = "moa+ngram"  # when no drafter is named, for targets with a shipped MoA drafter
FALLBACK_DRAFTER = "ngram"  # ... and for any other target


def default_drafter(target_name: str) -> str:
    """The drafter used when none is named, on any device: the shipped MoA drafter with prompt
    lookup, or the model-free `ngram` for a target without a shipped MoA drafter. (Until session
    29 a GPU target defaulted to `ngram`; two H200 benches then measured `moa+ngram` faster in
    every category: README, *Target runtimes*.)"""
    if (SHIPPED_DIR / target_name / "moa").is_dir():
        return DEFAULT_DRAFTER
    return FALLBACK_DRAFTER


def tree_settings_given(tree_overrides: dict | None) -> bool:
    """Whether tree overrides ({"depth", "top_k", "budget"}, each None unless given) fix anything."""
    return any(value is not None for value in (tree_overrides or {}).values())


def default_for_tree_settings(target_name: str) -> str:
    """The drafter that tree settings apply to when no drafter is named: the default model
    drafter's form; MoaspecError for a target without a shipped model drafter (its default is
    model-free)."""
    spec = default_drafter(target_name)
    if spec in MODEL_FREE:
        raise MoaspecError(
            f"tree settings apply to model drafters, and target '{target_name}' has no shipped one: "
            "name a checkpoint as the drafter"
        )
    return spec


def split_lookup(spec: str) -> tuple[str, bool]:
    """`moa+ngram` -> ("moa", True); `moa` -> ("moa", False); an existing directory is taken as
    it is, even when its name ends in `+ngram`."""
    if spec.endswith(LOOKUP_SUFFIX) and len(spec) > len(LOOKUP_SUFFIX) and not Path(spec).expanduser().is_dir():
        return spec[: -len(LOOKUP_SUFFIX)], True
    return spec, False


def check_drafter_spec(spec: str) -> None:
    """Fail fast (before any model loads) on a drafter that does not exist."""
    if not isinstance(spec, str) or not spec.strip():
        raise MoaspecError(f"the drafter must be a name or a checkpoint directory, got {spec!r}")
    if Path(spec).expanduser().is_dir() or spec in MODEL_FREE or spec in SHIPPED:
        return
    base, lookup = split_lookup(spec)
    if lookup and base in MODEL_FREE:
        raise MoaspecError(f"'{LOOKUP_SUFFIX}' adds prompt lookup to a model drafter, not to '{base}'")
    if lookup and (base in SHIPPED or Path(base).expanduser().is_dir()):
        return
    known = ", ".join([*MODEL_FREE, *SHIPPED])
    raise MoaspecError(
        f"unknown drafter '{spec}' (known: {known}, a checkpoint directory, or a model drafter + '{LOOKUP_SUFFIX}')"
    )


def make_drafter(spec: str, target: Target, tree_overrides: dict | None = None) -> Drafter:
    """Build the drafter `spec` names for `target`; MoaspecError when it cannot.

    Model drafters get their tree by the precedence in moaspec/tuned.py: `tree_overrides`
    (explicit depth / top_k / budget), then `moaspec tune`'s saved choice for the target's kind
    of device, then the checkpoint's.
    """
    check_drafter_spec(spec)
    if spec in MODEL_FREE:
        if tree_settings_given(tree_overrides):
            raise MoaspecError(f"tree settings apply to model drafters only, not to '{spec}'")
        return _resolve(MODEL_FREE[spec])(target)
    from moaspec.tuned import resolve_tree

    directory = checkpoint_directory(spec, target.name)
    drafter = load_drafter(directory, target)
    drafter.tree_config, drafter.tree_source = resolve_tree(
        drafter.tree_config, target.name, directory, tree_overrides, target.device, target.runtime
    )
    if split_lookup(spec)[1]:
        drafter.enable_lookup()
    return drafter


def checkpoint_directory(spec: str, target_name: str) -> Path:
    """The checkpoint directory of a shipped drafter name, a checkpoint directory or a `moaspec
    train` run directory (its checkpoint/), any of them ending in `+ngram` or not; MoaspecError
    for a shipped name the target lacks."""
    spec = split_lookup(spec)[0]
    if spec in SHIPPED:
        directory = SHIPPED_DIR / target_name / spec
        if not directory.is_dir():
            raise MoaspecError(f"no shipped '{spec}' drafter for target '{target_name}'; pass a checkpoint directory")
        return directory
    directory = Path(spec).expanduser()
    if not (directory / "config.json").is_file() and (directory / "checkpoint" / "config.json").is_file():
        return directory / "checkpoint"  # a training run: the drafter it wrote
    return directory


def load_drafter(directory: Path, target: Target) -> Drafter:
    """Load a drafter checkpoint directory, dispatching on its recorded method."""
    try:
        record = json.loads((directory / "config.json").read_text())
        method = record["method"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MoaspecError(f"{directory} is not a drafter checkpoint (no readable config.json with a method)") from exc
    if method not in METHODS:
        raise MoaspecError(f"{directory}: unknown drafter method '{method}' (known: {', '.join(METHODS)})")
    from moaspec.signals import load_library_held

    load_library_held()  # a model drafter is torch's: its first import, whole or not at all
    return drafter_class(method).from_pretrained(directory, target)


def drafter_class(method: str) -> type:
    """The inference drafter class of a checkpoint method (`moa`, `eagle`); KeyError when unknown."""
    return _resolve(METHODS[method])


def _resolve(reference: str):
    module_name, _, attr_path = reference.partition(":")
    found = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        found = getattr(found, attr)
    return found
