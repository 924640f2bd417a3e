"""Speculate with prompt lookup only while it pays in the current generation.

Verifying a lookup trie of n nodes costs `extra_cost[n]` plain decoding steps more than a plain
step, what it costs the plain steps after it included (the machine calibration measures it: on
llama.cpp with 2 cores one extra node costs 0.7-1.0 of a step) and gains the drafts the target
accepts. So a trie pays exactly when its accepted
drafts outnumber its extra cost. How often that holds depends on the text: translations and
summaries copy their prompt, arithmetic repeats numbers that the next line changes.

The gate keeps an exponentially weighted mean of (accepted drafts - extra cost) over the lookup's
matches in this generation. While the mean is > 0 the lookup's tries are verified; otherwise the
drafter proposes the root alone (a plain step) and scores the trie it would have proposed in the
shadow, against the tokens the target then writes, which costs nothing; the gate opens when those
shadow scores lift the mean above 0. Every generation starts closed (mean 0): evidence first, so
text that the lookup guesses badly costs no verified node at all (on the lookup profile this
predicts 1.070x plain decoding against 1.064x starting open, llama.cpp on the AVX2 EPYC).

Only what is proposed changes, never how it is verified, so output stays exactly the target's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

GATE_DECAY = 0.6  # weight of the past in the running mean (a few matches decide)


@dataclass
class LookupGate:
    """extra_cost[n]: plain steps a trie of n nodes costs beyond one step (n >= 1; larger tries
    cost extra_cost[-1]); score: the running mean of accepted drafts minus extra cost."""

    extra_cost: tuple[float, ...]
    decay: float = GATE_DECAY
    score: float = 0.0

    @classmethod
    def from_cycle_costs(cls, cycle_s: Callable[[int], float], max_nodes: int) -> LookupGate:
        """From the measured seconds of a cycle verifying n nodes, n = 1 a plain step
        (calibration.costs.CycleCosts.tree_s: a tree's verify and its penalty on the plain
        steps after it)."""
        step = cycle_s(1)
        return cls(tuple(0.0 if n == 0 else cycle_s(n) / step - 1.0 for n in range(max_nodes + 1)))

    @property
    def is_open(self) -> bool:
        return self.score > 0.0

    def reset(self) -> None:
        self.score = 0.0

    def record(self, accepted: int, num_nodes: int) -> None:
        """One match, verified or scored in the shadow: `accepted` drafts of a `num_nodes`-node trie."""
        cost = self.extra_cost[min(num_nodes, len(self.extra_cost) - 1)]
        self.score = self.decay * self.score + (1.0 - self.decay) * (accepted - cost)
