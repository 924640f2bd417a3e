"""Whether a bench run's speedups can be trusted: the baseline's decoding steps should cost about
the same in every generation.

Every speedup divides by the baseline's (`none`) tokens/s, and a plain decoding step of one model
costs nearly the same at any prompt of a run (the context's length moves it by tens of percent,
not by multiples). A generation whose mean step took over IRREGULAR_STEP_RATIO times the run's
median step (or under its inverse) ran while something else used the CPU: the speedups of its
category then say more about the machine than about the methods (an audit saw 173x).
"""

from __future__ import annotations

from statistics import median
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moaspec.bench.runner import RunRecord

IRREGULAR_STEP_RATIO = 3.0
MIN_STEPS = 4  # a generation of fewer decoding steps is not judged (one slow step would dominate)


def mean_step_s(record: RunRecord) -> float | None:
    """Seconds per decoding step of one generation (prefill left out); None where the method has
    no time split or took fewer than MIN_STEPS steps."""
    stats = record.run.stats
    if not record.run.has_time_split or stats.num_verifications < MIN_STEPS:
        return None
    return (stats.draft_s + stats.verify_s) / stats.num_verifications


def irregular_steps(records: list[RunRecord], method: str) -> list[dict]:
    """The generations of `method` whose mean step is over IRREGULAR_STEP_RATIO times the median
    of its generations' mean steps, or under its inverse:
    [{category, prompt_id, turn, step_ms, median_step_ms}] in run order."""
    timed = [(record, step) for record in records if record.method == method and (step := mean_step_s(record)) is not None]
    if len(timed) < 2:
        return []
    typical = median(step for _, step in timed)
    if typical <= 0:
        return []
    return [
        {
            "category": record.category,
            "prompt_id": record.prompt_id,
            "turn": record.turn,
            "step_ms": round(step * 1000, 3),
            "median_step_ms": round(typical * 1000, 3),
        }
        for record, step in timed
        if not 1 / IRREGULAR_STEP_RATIO <= step / typical <= IRREGULAR_STEP_RATIO
    ]


def irregular_timing_line(irregular: list[dict], method: str) -> str | None:
    """One sentence for results.md and stderr, or None when the timings were regular."""
    if not irregular:
        return None

    def off_by(item: dict) -> float:
        step, typical = max(item["step_ms"], 1e-9), max(item["median_step_ms"], 1e-9)  # rounded, so possibly 0
        return max(step / typical, typical / step)

    worst = max(irregular, key=off_by)
    where = f"{worst['category']}/{worst['prompt_id']} turn {worst['turn']}"
    return (
        f"{len(irregular)} `{method}` generation{'s' * (len(irregular) != 1)} ran steps over "
        f"{IRREGULAR_STEP_RATIO:g}x off the run's median step (worst {where}: {worst['step_ms']:.1f} ms "
        f"against {worst['median_step_ms']:.1f} ms): something else was using the CPU, so the speedups of "
        "those categories are not reliable; rerun on an idle machine."
    )
