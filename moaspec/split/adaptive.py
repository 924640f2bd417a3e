"""Adaptive tree size for the split client: maximise expected tokens per second.

Per round, with a tree of depth D and N nodes (root included):
    time(D, N)   = rtt + verify(N) + draft_level * D
    tokens(D)    = 1 + sum_{d=1..D} P(accepted >= d),  P(accepted >= d) = prod_{j<=d} c_j
where rtt = round trip minus the server's own time, verify(N) = a + b * N is a least-squares fit
over recent rounds, draft_level = drafting time per level, and c_j = P(accept depth j | accepted
j - 1) from counts (with a prior, and the deepest estimate reused beyond what was observed).
On a slow link rtt dominates, so deeper trees (fewer calls per token) win; on a fast link the
verify cost of extra nodes does.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from moaspec.config import TreeConfig
from moaspec.tree import DraftTree, depths

MAX_DEPTH = 16
PRIOR_RATE, PRIOR_WEIGHT = 0.6, 2.0
EMA = 0.2


class AdaptiveTree:
    """Chooses depth and budget from measurements; `base` fixes top_k and nodes per level."""

    def __init__(self, base: TreeConfig, max_tree_nodes: int) -> None:
        self.base = base
        self.max_nodes = max_tree_nodes
        self.nodes_per_level = max(1.0, base.budget / base.depth)
        self.rtt_s: float | None = None
        self.draft_level_s: float | None = None
        self.verify_samples: deque[tuple[int, float]] = deque(maxlen=32)
        self.reached = [0] * (MAX_DEPTH + 1)  # [d]: rounds whose accepted path could reach depth d
        self.accepted = [0] * (MAX_DEPTH + 1)  # [d]: rounds that accepted >= d drafts

    def observe(self, round_trip_s: float, server_s: float, draft_s: float, tree: DraftTree, num_accepted: int) -> None:
        depth = int(depths(tree.parents).max())
        self.rtt_s = _ema(self.rtt_s, max(0.0, round_trip_s - server_s))
        if depth:
            self.draft_level_s = _ema(self.draft_level_s, draft_s / depth)
        self.verify_samples.append((tree.num_nodes, server_s))
        for d in range(1, min(depth, MAX_DEPTH) + 1):
            self.reached[d] += 1
            self.accepted[d] += num_accepted >= d

    def choose(self) -> TreeConfig:
        if self.rtt_s is None or self.draft_level_s is None:
            return self.base
        verify_a, verify_b = self._verify_fit()
        best, best_rate = self.base, 0.0
        survive, tokens = 1.0, 1.0
        for depth in range(1, MAX_DEPTH + 1):
            survive *= self._conditional_rate(depth)
            tokens += survive
            budget = min(self.max_nodes - 1, max(depth, round(self.nodes_per_level * depth)))
            seconds = self.rtt_s + verify_a + verify_b * (budget + 1) + self.draft_level_s * depth
            rate = tokens / max(seconds, 1e-6)
            if rate > best_rate:
                best, best_rate = replace(self.base, depth=depth, budget=budget), rate
        return best

    def _conditional_rate(self, depth: int) -> float:
        """P(accept depth d | accepted d - 1), reusing the deepest observed estimate beyond."""
        while depth > 1 and self.reached[depth] == 0:
            depth -= 1
        previous = self.reached[depth] if depth == 1 else self.accepted[depth - 1]
        return (self.accepted[depth] + PRIOR_RATE * PRIOR_WEIGHT) / (min(previous, self.reached[depth]) + PRIOR_WEIGHT)

    def _verify_fit(self) -> tuple[float, float]:
        """server_s ~ a + b * nodes (least squares; b >= 0)."""
        n = len(self.verify_samples)
        mean_x = sum(x for x, _ in self.verify_samples) / n
        mean_y = sum(y for _, y in self.verify_samples) / n
        var = sum((x - mean_x) ** 2 for x, _ in self.verify_samples)
        slope = 0.0 if var == 0 else max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in self.verify_samples) / var)
        return max(0.0, mean_y - slope * mean_x), slope


def _ema(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - EMA) * previous + EMA * value
