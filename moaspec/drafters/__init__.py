"""Drafter registry: map a `--drafter` name to a drafter for a given target."""

from __future__ import annotations

from collections.abc import Callable

from moaspec.drafters.base import Drafter, VerifiedUpdate
from moaspec.drafters.ngram import NgramConfig, NgramDrafter
from moaspec.drafters.none import NoDrafter
from moaspec.errors import MoaspecError
from moaspec.target import HFTarget

DRAFTERS: dict[str, Callable[[HFTarget], Drafter]] = {
    "none": lambda target: NoDrafter(),
    "ngram": lambda target: NgramDrafter(),
}

DEFAULT_DRAFTER = "ngram"


def make_drafter(spec: str, target: HFTarget) -> Drafter:
    """Build the drafter named `spec` for `target`; MoaspecError for an unknown name."""
    factory = DRAFTERS.get(spec)
    if factory is None:
        known = ", ".join(DRAFTERS)
        raise MoaspecError(f"unknown drafter '{spec}' (known: {known})")
    return factory(target)


__all__ = ["DEFAULT_DRAFTER", "DRAFTERS", "Drafter", "NgramConfig", "NgramDrafter", "NoDrafter", "VerifiedUpdate", "make_drafter"]
