"""Timing alternatives against each other on a machine whose speed drifts (turbo, other
processes): every alternative once per round, the order rotated each round, medians. The
machine calibration (calibration/costs.py) and the llama.cpp runtime's per-machine choices
(targets/llamacpp_value_cache.py, llamacpp_prefill.py) time their candidates this way."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

Key = TypeVar("Key", bound=Hashable)


def interleaved_medians(
    jobs: dict[Key, Callable[[], object]],
    rounds: int,
    warm_up_rounds: int = 1,
    clock: Callable[[], float] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[Key, float]:
    """Run every job once per round, `warm_up_rounds` uncounted rounds first, the order rotated
    by one each round; -> {key: median seconds of its counted runs}. A job that returns a float
    reports the seconds of its timed part itself (its set-up left out). progress(done, total)
    follows every job, the warm-up's included. clock: time.perf_counter unless given (looked up
    per call, so a test's patched perf_counter applies)."""
    clock = clock or time.perf_counter
    if rounds < 1:
        raise ValueError(f"need at least one counted round, got {rounds}")
    keys = list(jobs)
    samples: dict[Key, list[float]] = {key: [] for key in keys}
    done, total = 0, len(keys) * (warm_up_rounds + rounds)
    for round_index in range(warm_up_rounds + rounds):
        shift = round_index % len(keys)
        for key in keys[shift:] + keys[:shift]:
            begin = clock()
            reported = jobs[key]()
            if round_index >= warm_up_rounds:
                samples[key].append(reported if isinstance(reported, float) else clock() - begin)
            done += 1
            if progress is not None:
                progress(done, total)
    return {key: statistics.median(values) for key, values in samples.items()}
