"""The interleaved timing every per-machine measurement uses (moaspec/timing.py), on a fake clock."""

from __future__ import annotations

import pytest

from moaspec.timing import interleaved_medians


def test_interleaved_rounds_leave_the_warm_up_out_and_rotate_the_order() -> None:
    clock = {"now": 0.0}
    calls: list[str] = []

    def job(name: str, seconds: float, first_seconds: float):
        def run() -> None:
            clock["now"] += first_seconds if name not in calls else seconds
            calls.append(name)
        return run

    measured = interleaved_medians(
        {"a": job("a", 1.0, 100.0), "b": job("b", 2.0, 2.0)}, rounds=1, clock=lambda: clock["now"]
    )
    assert measured == {"a": 1.0, "b": 2.0}  # the 100 s first call was the warm-up
    calls.clear()
    interleaved_medians({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=2)
    assert calls == ["a", "b", "b", "a", "a", "b"]


def test_reported_seconds_replace_the_clock_and_no_warm_up_counts_every_round() -> None:
    """A job returning a float reports its own timed part; with warm_up_rounds=0 the first round
    counts; medians per key."""
    reports = iter([5.0, 1.0, 3.0])
    clock = {"now": 0.0}

    def slow_set_up() -> float:
        clock["now"] += 100.0  # set-up the job leaves out of what it reports
        return next(reports)

    def plain() -> None:
        clock["now"] += 2.0

    measured = interleaved_medians({"a": slow_set_up, "b": plain}, rounds=3, warm_up_rounds=0, clock=lambda: clock["now"])
    assert measured == {"a": 3.0, "b": 2.0}


def test_progress_counts_every_run_and_zero_rounds_are_refused() -> None:
    seen: list[tuple[int, int]] = []
    interleaved_medians({"a": lambda: None, "b": lambda: None}, rounds=2, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(n, 6) for n in range(1, 7)]
    with pytest.raises(ValueError, match="at least one counted round"):
        interleaved_medians({"a": lambda: None}, rounds=0)
