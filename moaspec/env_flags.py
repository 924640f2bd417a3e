"""On/off switches read from the environment: MOASPEC_NO_CALIBRATION and
MOASPEC_NO_BACKGROUND_DRAFTER (named here), MOASPEC_NO_TUNED (named in tuned.py)."""

from __future__ import annotations

import os

OFF_VALUES = ("", "0", "false", "no", "off")
NO_CALIBRATION_ENV = "MOASPEC_NO_CALIBRATION"  # the machine calibration (calibration/plan.py) off
NO_BACKGROUND_DRAFTER_ENV = "MOASPEC_NO_BACKGROUND_DRAFTER"  # `generate` builds its drafter first (drafters/background.py)


def env_flag(name: str) -> bool:
    """Whether the variable `name` is set to anything but empty, 0, false, no or off (any case)."""
    return os.environ.get(name, "").strip().lower() not in OFF_VALUES
