"""`moaspec tune`: pick the draft tree (depth, top-k, node budget) that maximises expected tokens/s.

Expected tokens per cycle (acceptance model). The drafter's candidates at every tree level are
modelled as independent of depth (Sequoia's positional-acceptance model): the target's next
token is the drafter's r-th most likely token with probability h_r, r = 1..max(TOP_KS) (the
*rank rates*).

Under this model the dynamic tree builder (drafters/dynamic_tree.py, run here on log h_r as the
drafter's log-probabilities) picks the same nodes the real drafter would if its scores were
calibrated, and a node is accepted iff every token on its path is the target's, so
E[accepted] = sum over drafted nodes of the product of h along its path (siblings exclude each
other under greedy verification). tau = 1 + E[accepted].

The rank rates come, in order: from `--top1-rate` (geometric over ranks,
h_r = top1 * (1 - top1) ** (r - 1)); else from a short calibration run: the drafter generates
greedily from CALIBRATION_PROMPTS with a one-level tree of top-k k for each k in TOP_KS, the
measured acceptance of each is the hit rate of its top k, and h_r are their differences; else a
geometric guess from DEFAULT_TOP1. Measured rates are not geometric: for the shipped SmolLM2
drafters the top-1 hit rate is about 0.25 and the top-4 one about 0.44, and a one-parameter
geometric fit to the top-4 tree (top1 0.13) undervalued chains.

Cost per cycle: measured on this machine (costs.py). Expected tokens/s = tau / cycle seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moaspec.bench.costs import CycleCosts
from moaspec.config import TreeConfig
from moaspec.drafters.dynamic_tree import build_dynamic_tree
from moaspec.tree import depths

DEFAULT_TOP1 = 0.6  # a middling EAGLE-2-style top-1 acceptance on chat; used only without calibration
DEPTHS = tuple(range(1, 9))
TOP_KS = (1, 2, 3, 4)
BUDGETS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32)
CALIBRATION_PROMPTS = (  # written for calibration; not from any benchmark set
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short Python function that counts the vowels in a string, with a docstring.",
    "Give me three tips for learning a new language as an adult.",
    "Describe a quiet morning in a small coastal town in one paragraph.",
    "What is the difference between weather and climate?",
    "List five healthy snacks and say why each one is good for you.",
)


@dataclass(frozen=True)
class Candidate:
    tree: TreeConfig
    num_nodes: int  # root included
    expected_tau: float
    cycle_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.expected_tau / self.cycle_s if self.cycle_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "depth": self.tree.depth,
            "top_k": self.tree.top_k,
            "budget": self.tree.budget,
            "num_nodes": self.num_nodes,
            "expected_tau": round(self.expected_tau, 4),
            "cycle_s": round(self.cycle_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }


def geometric_rates(top1: float, count: int = max(TOP_KS)) -> tuple[float, ...]:
    """h_r = top1 * (1 - top1) ** (r - 1) for r = 1..count."""
    return tuple(top1 * (1 - top1) ** r for r in range(count))


def rates_from_hit_rates(hit_rates: list[float]) -> tuple[float, ...]:
    """Rank rates h_r from the hit rates of the top 1, 2, ... candidates (made non-decreasing).

    A rank never seen to hit keeps a small rate (1e-4) so every tree stays comparable.
    """
    rates, covered = [], 0.0
    for hit in hit_rates:
        top = min(max(hit, covered), 1 - 1e-6)
        rates.append(max(top - covered, 1e-4))
        covered = top
    return tuple(rates)


def model_tree(tree: TreeConfig, rates: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tree the dynamic builder picks under the rank model (rates h_1.. at least top_k long).

    -> (node acceptance probabilities [N] (root = 1), node depths [N]).
    """
    log_rates = torch.tensor(rates[: tree.top_k], dtype=torch.float64).log()
    built = build_dynamic_tree(0, lambda: log_rates, lambda ids, parent, depth: log_rates.expand(ids.numel(), -1), tree)
    log_p = torch.zeros(built.num_nodes, dtype=torch.float64)
    for i in range(1, built.num_nodes):  # parents precede children
        log_p[i] = log_p[built.parents[i]] + log_rates[built.token_ids[i]]
    return log_p.exp(), depths(built.parents)


def expected_tau(tree: TreeConfig, rates: tuple[float, ...]) -> tuple[float, int]:
    """-> (expected tokens per cycle under the rank model, tree nodes incl. the root)."""
    probs, _ = model_tree(tree, rates)
    return float(probs.sum()), probs.numel()  # root term 1 = the bonus token


def model_acceptance_per_depth(tree: TreeConfig, rates: tuple[float, ...]) -> list[float]:
    """P(accepted >= d) for d = 1..tree depth reached, under the rank model."""
    probs, node_depths = model_tree(tree, rates)
    return [float(probs[node_depths == d].sum()) for d in range(1, int(node_depths.max()) + 1)]


def candidates(costs: CycleCosts, rates: tuple[float, ...]) -> list[Candidate]:
    """Every distinct (depth, top_k, budget) tree with measured costs, best expected tokens/s first."""
    found: dict[tuple[int, int, int], Candidate] = {}
    for depth in DEPTHS:
        for top_k in TOP_KS:
            if (depth, top_k) not in costs.propose_s:
                continue
            for budget in BUDGETS:
                if budget < top_k:
                    continue
                tree = TreeConfig(depth=depth, top_k=top_k, budget=budget)
                tau, nodes = expected_tau(tree, rates)
                key = (depth, top_k, nodes)  # a budget beyond the pool gives the same tree
                # trees far beyond the largest measured size would rest on extrapolated costs
                if key not in found and nodes <= max(costs.verify_s) * 2:
                    found[key] = Candidate(tree, nodes, tau, costs.cycle_s(tree, nodes, tau))
    return sorted(found.values(), key=lambda c: (-c.tokens_per_s, c.num_nodes))


def plain_tokens_per_s(costs: CycleCosts) -> float:
    """Plain decoding: one token per one-node forward."""
    return 1.0 / costs.verify(1)


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


def calibrate(drafter, target, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy generation with a one-level tree of each top-k in TOP_KS.

    -> {"hit_rate_by_top_k": [P(target token among the drafter's top k) for k in TOP_KS]
    (empty when a run verified nothing), "tau_by_top_k": [...]}. The drafter's tree is restored.
    """
    from moaspec.bench.report import merge_stats
    from moaspec.config import GenerationConfig
    from moaspec.engine import Engine

    engine = Engine(target, drafter)
    kept_tree = drafter.tree_config
    generation = GenerationConfig(max_new_tokens=max_new_tokens)
    hits, taus = [], []
    try:
        for top_k in TOP_KS:
            drafter.tree_config = TreeConfig(depth=1, top_k=top_k, budget=top_k)
            stats = merge_stats([engine.generate(ids, generation=generation).stats for ids in prompts])
            hits.append(round(stats.acceptance_per_depth[0], 4) if stats.acceptance_per_depth else None)
            taus.append(round(stats.tau, 4))
    finally:
        drafter.tree_config = kept_tree
    return {"hit_rate_by_top_k": [] if None in hits else hits, "tau_by_top_k": taus}


def tune_drafter(
    drafter,
    target,
    verify_s: dict[int, float],
    context_len: int,
    repeats: int,
    top1: float | None,
    calibration_prompts: list[list[int]],
    calibration_tokens: int,
) -> TuneResult:
    """Measure the drafter's costs, settle its acceptance model, rank the trees."""
    from moaspec.bench.costs import measure_drafter

    shapes = [(depth, top_k) for depth in DEPTHS for top_k in TOP_KS]
    propose_s, accept_s = measure_drafter(drafter, target, context_len, repeats, shapes)
    costs = CycleCosts(verify_s, propose_s, accept_s)
    calibration = None
    if top1 is not None:
        rates, source = geometric_rates(top1), "given"
    elif calibration_prompts:
        calibration = calibrate(drafter, target, calibration_prompts, calibration_tokens)
        measured = calibration["hit_rate_by_top_k"]
        rates, source = (
            (rates_from_hit_rates(measured), "calibrated") if measured else (geometric_rates(DEFAULT_TOP1), "default")
        )
    else:
        rates, source = geometric_rates(DEFAULT_TOP1), "default"
    ranked = candidates(costs, rates)
    return TuneResult(ranked[0], ranked, costs, rates, source, calibration, plain_tokens_per_s(costs))
