"""Draft trees (depth, top-k, node budget) ranked by expected tokens/s on this machine, for
`moaspec tune` (moaspec/bench/tune.py) and the machine calibration (plan.py).

Expected tokens per cycle (acceptance model). The drafter's candidates at every tree level are
modelled as independent of depth (Sequoia's positional-acceptance model): the target's next
token is the drafter's r-th most likely token with probability h_r, r = 1..max(TOP_KS) (the
*rank rates*).

Under this model the dynamic tree builder (drafters/dynamic_tree.py, run here on log h_r as the
drafter's log-probabilities) picks the same nodes the real drafter would if its scores were
calibrated, and a node is accepted iff every token on its path is the target's, so
E[accepted] = sum over drafted nodes of the product of h along its path (siblings exclude each
other under greedy verification). tau = 1 + E[accepted].

Cost per cycle: measured on this machine (costs.py). Expected tokens/s = tau / cycle seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moaspec.calibration.costs import CycleCosts
from moaspec.config import TreeConfig
from moaspec.tree import DraftTree, depths

if TYPE_CHECKING:
    import torch

DEPTHS = tuple(range(1, 9))
TOP_KS = (1, 2, 3, 4)
BUDGETS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32)


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


def model_tree(tree: TreeConfig, rates: tuple[float, ...]) -> tuple[torch.Tensor, np.ndarray]:
    """The tree the dynamic builder picks under the rank model (rates h_1.. at least top_k long).

    -> (node acceptance probabilities [N] (root = 1), node depths [N]).
    """
    built, log_rates = _model_build(tree, rates)
    return _path_sums(built, log_rates).exp(), depths(built.parents)


def _model_build(tree: TreeConfig, rates: tuple[float, ...]) -> tuple[DraftTree, torch.Tensor]:
    """-> (the tree the builder picks when every node's log-probabilities are log h, log h [top_k])."""
    from moaspec.signals import load_library_held

    load_library_held()  # the model drafter's own builder: a tree the cached table lacks may import torch first
    import torch

    from moaspec.drafters.dynamic_tree import build_dynamic_tree

    log_rates = torch.tensor(rates[: tree.top_k], dtype=torch.float64).log()
    built = build_dynamic_tree(0, lambda: log_rates, lambda ids, parent, depth: log_rates.expand(ids.numel(), -1), tree)
    return built, log_rates


def _path_sums(built: DraftTree, log_rates: torch.Tensor) -> torch.Tensor:
    """Each node's sum of log h along its path [N] (root 0), in log_rates' dtype."""
    import torch

    sums = torch.zeros(built.num_nodes, dtype=log_rates.dtype)
    for i in range(1, built.num_nodes):  # parents precede children
        sums[i] = sums[built.parents[i]] + log_rates[built.token_ids[i]]
    return sums


def expected_tau(tree: TreeConfig, rates: tuple[float, ...]) -> tuple[float, int]:
    """-> (expected tokens per cycle under the rank model, tree nodes incl. the root)."""
    probs, _ = model_tree(tree, rates)
    return float(probs.sum()), probs.numel()  # root term 1 = the bonus token


def model_acceptance_per_depth(tree: TreeConfig, rates: tuple[float, ...]) -> list[float]:
    """P(accepted >= d) for d = 1..tree depth reached, under the rank model."""
    probs, node_depths = model_tree(tree, rates)
    return [float(probs[node_depths == d].sum()) for d in range(1, int(node_depths.max()) + 1)]


def expected_taus_by_budget(
    depth: int, top_k: int, budgets: tuple[int, ...], rates: tuple[float, ...]
) -> dict[int, tuple[float, int]]:
    """expected_tau of the trees (depth, top_k, b) for every b in `budgets`, from one build.

    The builder's candidate pool does not depend on the budget, and it keeps the `budget` best
    pool nodes (by its float32 cumulative scores, ties in pool order): every smaller tree is the
    first nodes of the largest one in that order. Each tau is summed over its nodes in tree order,
    as expected_tau sums them, so the two agree exactly.
    """
    import torch

    built, log_rates = _model_build(TreeConfig(depth=depth, top_k=top_k, budget=max(budgets)), rates)
    probs = _path_sums(built, log_rates).exp()  # [N]
    builder_scores = _path_sums(built, log_rates.float())  # [N] what the builder ranked by
    order = torch.sort(-builder_scores[1:], stable=True).indices + 1  # nodes in selection order
    taus = {}
    for budget in budgets:
        count = min(budget, built.num_nodes - 1)
        kept = torch.cat([torch.zeros(1, dtype=torch.long), torch.sort(order[:count]).values])
        taus[budget] = (float(probs[kept].sum()), count + 1)
    return taus


TauTable = dict[tuple[int, int, int], tuple[float, int]]  # (depth, top_k, budget) -> expected_tau's (tau, nodes)


def _budgets(depth: int, top_k: int) -> tuple[int, ...]:
    """The budgets ranked for a depth and top-k: fewer nodes than levels never reach the last
    level (the same tree as a shallower one, drafted at more cost, recorded with a depth it never
    drafts)."""
    return tuple(b for b in BUDGETS if b >= max(top_k, depth))


def tau_table(rates: tuple[float, ...]) -> TauTable:
    """expected_tau of every tree `candidates` ranks (DEPTHS x TOP_KS x their BUDGETS), from one
    build per depth and top-k (expected_taus_by_budget). A function of the rates alone, so the
    calibration keeps it on disk (costs_store.rank_model_taus) and a load whose costs are cached
    ranks trees without torch."""
    return {
        (depth, top_k, budget): value
        for depth in DEPTHS
        for top_k in TOP_KS
        for budget, value in expected_taus_by_budget(depth, top_k, _budgets(depth, top_k), rates).items()
    }


def candidates(costs: CycleCosts, rates: tuple[float, ...], taus: TauTable | None = None) -> list[Candidate]:
    """Every distinct (depth, top_k, budget) tree with measured costs, best expected tokens/s
    first. taus: tau_table(rates), when the caller has it (the calibration's cached copy)."""
    taus = tau_table(rates) if taus is None else taus
    found: dict[tuple[int, int, int], Candidate] = {}
    for depth in DEPTHS:
        for top_k in TOP_KS:
            if (depth, top_k) not in costs.propose_s:
                continue
            for budget in _budgets(depth, top_k):
                tau, nodes = taus[(depth, top_k, budget)]
                tree = TreeConfig(depth=depth, top_k=top_k, budget=budget)
                key = (depth, top_k, nodes)  # a budget beyond the pool gives the same tree
                # trees far beyond the largest measured size would rest on extrapolated costs
                if key not in found and nodes <= max(costs.verify_s) * 2:
                    found[key] = Candidate(tree, nodes, tau, costs.cycle_s(tree, nodes, tau))
    return sorted(found.values(), key=lambda c: (-c.tokens_per_s, c.num_nodes))
