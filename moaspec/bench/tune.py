"""`moaspec tune`: pick the draft tree (depth, top-k, node budget) that maximises expected tokens/s.

The acceptance model (rank rates h_r, r = 1..max(TOP_KS)) and the ranking of trees by expected
tokens/s are in moaspec/calibration/tree_ranking.py; this module settles the rates and measures.

The rank rates come, in order: from `--top1-rate` (geometric over ranks,
h_r = top1 * (1 - top1) ** (r - 1)); else from a short calibration run: the drafter generates
greedily from CALIBRATION_PROMPTS (calibration_prompts.py) with a one-level tree of top-k k for
each k in TOP_KS, the measured acceptance of each is the hit rate of its top k, and h_r are their
differences; else a geometric guess from DEFAULT_TOP1. Measured rates are not geometric: for the
shipped SmolLM2 drafters the top-1 hit rate is about 0.25 and the top-4 one about 0.44, and a
one-parameter geometric fit to the top-4 tree (top1 0.13) undervalued chains.

Cost per cycle: measured on this machine (moaspec/calibration/costs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from moaspec.calibration.costs import CycleCosts, Progress, VerifyCosts
from moaspec.calibration.tree_ranking import (
    DEPTHS,
    TOP_KS,
    Candidate,
    candidates,
    geometric_rates,
    rates_from_hit_rates,
)
from moaspec.config import TreeConfig

if TYPE_CHECKING:
    from moaspec.drafters.tree_drafter import TreeDrafter
    from moaspec.targets.base import Target

DEFAULT_TOP1 = 0.6  # a middling EAGLE-2-style top-1 acceptance on chat; used only without calibration


def plain_tokens_per_s(costs: CycleCosts) -> float:
    """Plain decoding: one token per plain step (calibration/costs.py)."""
    return 1.0 / costs.plain_step()


# -- the measurement run ------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneResult:
    best: Candidate
    ranked: list[Candidate]
    costs: CycleCosts
    rates: tuple[float, ...]  # h_r, r = 1..max(TOP_KS)
    rates_source: str  # "given" | "calibrated" | "default"
    calibration: dict | None  # the calibration runs' hit rates per top-k
    plain_tokens_per_s: float

    def details(self) -> dict:
        """What the tune cache file records besides the tree."""
        return {
            "expected_tau": round(self.best.expected_tau, 4),
            "predicted_tokens_per_s": round(self.best.tokens_per_s, 3),
            "predicted_speedup": round(self.best.tokens_per_s / self.plain_tokens_per_s, 4),
            "rank_rates": [round(r, 4) for r in self.rates],
            "rates_source": self.rates_source,
            "calibration": self.calibration,
            "costs": self.costs.to_dict(),
            "runners_up": [c.to_dict() for c in self.ranked[1:6]],
        }


def calibrate(
    drafter: TreeDrafter, target: Target, prompts: list[list[int]], max_new_tokens: int, progress: Progress | None = None
) -> dict:
    """Greedy generation with a one-level tree of each top-k in TOP_KS.

    -> {"hit_rate_by_top_k": [P(target token among the drafter's top k) for k in TOP_KS]
    (empty when a run verified nothing), "tau_by_top_k": [...]}. The drafter's tree is restored.
    progress(done, total) follows every generation.
    """
    from moaspec.bench.report import merge_stats
    from moaspec.config import GenerationConfig
    from moaspec.engine import Engine

    engine = Engine(target, drafter)
    kept_tree = drafter.tree_config
    generation = GenerationConfig(max_new_tokens=max_new_tokens)
    hits, taus = [], []
    done, total = 0, len(TOP_KS) * len(prompts)
    try:
        for top_k in TOP_KS:
            drafter.tree_config = TreeConfig(depth=1, top_k=top_k, budget=top_k)
            runs = []
            for ids in prompts:
                runs.append(engine.generate(ids, generation=generation).stats)
                done += 1
                if progress is not None:
                    progress(done, total)
            stats = merge_stats(runs)
            hits.append(round(stats.acceptance_per_depth[0], 4) if stats.acceptance_per_depth else None)
            taus.append(round(stats.tau, 4))
    finally:
        drafter.tree_config = kept_tree
    return {"hit_rate_by_top_k": [] if None in hits else hits, "tau_by_top_k": taus}


def tune_drafter(
    drafter: TreeDrafter,
    target: Target,
    verify: VerifyCosts,
    context_len: int,
    repeats: int,
    top1: float | None,
    calibration_prompts: list[list[int]],
    calibration_tokens: int,
    progress: Callable[[str, int, int], None] | None = None,
) -> TuneResult:
    """Measure the drafter's costs, settle its acceptance model, rank the trees.
    progress(what, done, total) follows every measured job of each part ("draft costs", "calibration")."""
    from moaspec.calibration.costs import measure_drafter

    def part(what: str) -> Progress | None:
        return None if progress is None else partial(progress, what)

    shapes = [(depth, top_k) for depth in DEPTHS for top_k in TOP_KS]
    propose_s, accept_s = measure_drafter(drafter, target, context_len, repeats, shapes, part("draft costs"))
    costs = CycleCosts(verify.verify_s, propose_s, accept_s, verify.plain_step_s, verify.tree_penalty_s)
    calibration = None
    if top1 is not None:
        rates, source = geometric_rates(top1), "given"
    elif calibration_prompts:
        calibration = calibrate(drafter, target, calibration_prompts, calibration_tokens, part("calibration"))
        measured = calibration["hit_rate_by_top_k"]
        rates, source = (
            (rates_from_hit_rates(measured), "calibrated") if measured else (geometric_rates(DEFAULT_TOP1), "default")
        )
    else:
        rates, source = geometric_rates(DEFAULT_TOP1), "default"
    ranked = candidates(costs, rates)
    return TuneResult(ranked[0], ranked, costs, rates, source, calibration, plain_tokens_per_s(costs))
