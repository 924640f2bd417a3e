"""The weight layouts by name (nn/fast_linear.py re-lays weights out), read without torch: the
machine calibration checks and records them before any model loads."""

from __future__ import annotations

import os

from moaspec.errors import MoaspecError

LAYOUT_ENV = "MOASPEC_WEIGHT_LAYOUT"
LAYOUTS = ("row", "column")


def requested_layout() -> str | None:
    """The layout MOASPEC_WEIGHT_LAYOUT fixes, or None when unset (the calibration chooses)."""
    layout = os.environ.get(LAYOUT_ENV, "").strip().lower()
    if not layout:
        return None
    if layout not in LAYOUTS:
        raise MoaspecError(f"{LAYOUT_ENV} must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    return layout


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise MoaspecError(f"weight layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
