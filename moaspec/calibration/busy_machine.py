"""After a generation: a note when its decoding ran far slower than the machine calibration
predicts for this machine, which is what other work holding the cores does. The runtime's
threads wait for one another at every step of a forward, so with fewer idle cores than threads
a step can take tens of times longer (README, *Threads on a busy machine*). The output is not
affected; the note says how to get the speed back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moaspec.calibration.plan import Calibration
    from moaspec.metrics import SpecStats
    from moaspec.targets.base import Target

SLOWER_THAN_PREDICTED = 4.0  # decoding this many times slower than predicted: far beyond τ's misses
MIN_VERIFIED_TOKENS = 8  # fewer decoded tokens say too little about the steps' speed


def busy_machine_note(stats: SpecStats, calibration: Calibration | None, target: Target) -> str | None:
    """The note for a finished generation, or None: only where a calibration predicted its speed
    and at least MIN_VERIFIED_TOKENS tokens came from decoding steps (not the prefill's first)."""
    decoding_s = stats.draft_s + stats.verify_s
    decoded = stats.new_tokens - 1  # the first new token comes from the prefill
    if calibration is None or decoded < MIN_VERIFIED_TOKENS or decoding_s <= 0:
        return None
    measured, predicted = decoded / decoding_s, calibration.chosen.tokens_per_s
    if measured * SLOWER_THAN_PREDICTED >= predicted:
        return None
    if target.runtime == "llama.cpp":
        threads, remedy = f"the target's {target.threads} threads", "--threads N"
    else:
        threads, remedy = "torch's threads", "OMP_NUM_THREADS=N"
    return (
        f"decoding ran at {measured:.1f} tok/s, {predicted / measured:.0f}x below this machine's calibrated "
        f"{predicted:.1f}: other work is holding the cores, and {threads} wait for one another at every step. "
        f"{remedy}, with N no more than the idle cores, gets the speed back (README, Threads on a busy machine)"
    )
