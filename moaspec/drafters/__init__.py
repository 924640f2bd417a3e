"""Drafter registry: map a `--drafter` name to a drafter for a given target.

Kept free of heavy imports so the CLI can reject an unknown drafter before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from moaspec.drafters.base import Drafter
    from moaspec.target import HFTarget

# name -> "module:factory"; a factory takes the target and returns a Drafter.
DRAFTERS: dict[str, str] = {
    "none": "moaspec.drafters.none:NoDrafter.for_target",
    "ngram": "moaspec.drafters.ngram:NgramDrafter.for_target",
}

DEFAULT_DRAFTER = "ngram"


def check_drafter_spec(spec: str) -> None:
    """Fail fast (before any model loads) on a drafter that does not exist."""
    if spec not in DRAFTERS:
        known = ", ".join(DRAFTERS)
        raise MoaspecError(f"unknown drafter '{spec}' (known: {known})")


def make_drafter(spec: str, target: HFTarget) -> Drafter:
    """Build the drafter named `spec` for `target`; MoaspecError for an unknown name."""
    check_drafter_spec(spec)
    module_name, _, attr_path = DRAFTERS[spec].partition(":")
    factory = importlib.import_module(module_name)
    for attr in attr_path.split("."):
        factory = getattr(factory, attr)
    return factory(target)
