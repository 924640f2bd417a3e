"""After a generation: a note when the target's forwards ran far slower than the machine
calibration predicts for this machine, which is what other work holding the cores does. The
runtime's threads wait for one another at every step of a forward, so with fewer idle cores than
threads a step can take tens of times longer (README, *Threads on a busy machine*). The output
is not affected; the note says how to get the speed back.

Only the target's forwards are compared (`verify_s` per verification against the predicted
cycle, which also holds the drafter's share): a drafter's one-off costs (its accept of a long
prompt, a build in the background) never count, and CPU targets only (a GPU's threads are not
the cause there).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moaspec.calibration.plan import Calibration
    from moaspec.metrics import SpecStats
    from moaspec.targets.base import Target

SLOWER_THAN_PREDICTED = 10.0  # seen: 244x (llama.cpp), 28x (transformers) beside a busy process
MIN_VERIFICATIONS = 8  # fewer forwards say too little about their speed


def busy_machine_note(stats: SpecStats, calibration: Calibration | None, target: Target) -> str | None:
    """The note for a finished generation, or None: only on a CPU target whose calibration
    predicted the cycle, after at least MIN_VERIFICATIONS verifications."""
    if calibration is None or stats.num_verifications < MIN_VERIFICATIONS or stats.verify_s <= 0 or _on_a_gpu(target):
        return None
    forward_s = stats.verify_s / stats.num_verifications
    predicted_cycle_s = calibration.chosen.expected_tau / calibration.chosen.tokens_per_s  # verify + draft
    if forward_s <= SLOWER_THAN_PREDICTED * predicted_cycle_s:
        return None
    if target.runtime == "llama.cpp":
        threads, remedy = f"the target's {target.threads} threads", "--threads N"
    else:
        threads, remedy = f"torch's {sys.modules['torch'].get_num_threads()} threads", "OMP_NUM_THREADS=N"
    return (
        f"the target's steps took {forward_s * 1000:.0f} ms, {forward_s / predicted_cycle_s:.0f}x what this machine's "
        f"calibration predicts ({predicted_cycle_s * 1000:.0f} ms): other work is holding the cores, and {threads} wait "
        f"for one another at every step. {remedy}, with N no more than the idle cores, gets the speed back "
        "(README, Threads on a busy machine)"
    )


def _on_a_gpu(target: Target) -> bool:
    if target.runtime == "llama.cpp":
        return bool(target.weights.gpu_layers)
    return target.device.type != "cpu"
