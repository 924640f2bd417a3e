"""argparse types for the measurement scripts under bench/: a bad value is argparse's one-line
usage error (exit status 2) before anything loads, not a traceback after minutes of work."""

from __future__ import annotations

import argparse
from pathlib import Path

from moaspec.errors import MoaspecError


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _at_least(text, 1)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _at_least(text, 0)


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 ("128,256")."""
    values = [positive_int(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError("an empty list")
    return values


def category_list(text: str) -> tuple[str, ...]:
    """Benchmark category names, as `moaspec bench --categories` takes them."""
    from moaspec.bench.prompts import parse_categories

    try:
        return parse_categories(text)
    except MoaspecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dtype_list(text: str) -> list[str]:
    """Target precisions by name, as `--dtype` takes them ("float32,bfloat16")."""
    from moaspec.targets.options import DTYPES

    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in DTYPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown precision {', '.join(unknown) or '(none)'} (known: {', '.join(DTYPES)})")
    return names


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no file {text}")
    return path


def _at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value
