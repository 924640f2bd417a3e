"""SpecStats: what one generation did, in the conventions the docs promise.

- tau (`mean_tokens_per_forward`): tokens produced per target forward, bonus/recovered token
  included, prefill forward included (it produces the first token). Plain decoding gives 1.0.
  A verification truncated by a stop token or the token limit still counts what it accepted.
- acceptance per depth d: among verifications whose tree reached depth d, the fraction that
  accepted at least d drafted tokens.
- time split: prefill, draft (propose + drafter updates), verify (target forward, verifier,
  cache commit), other (streaming, bookkeeping); they sum to wall_s.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    new_tokens: int = 0
    target_forwards: int = 0
    forward_tokens: int = 0
    num_verifications: int = 0
    drafted_nodes: int = 0
    reached_depth: list[int] = field(default_factory=list)  # [d-1]: trees with depth >= d
    accepted_depth: list[int] = field(default_factory=list)  # [d-1]: verifications accepting >= d
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    def record_prefill(self, seconds: float) -> None:
        self.target_forwards += 1
        self.forward_tokens += 1
        self.prefill_s += seconds

    def record_verification(self, tree_depth: int, num_nodes: int, num_accepted: int) -> None:
        self.target_forwards += 1
        self.num_verifications += 1
        self.forward_tokens += num_accepted + 1
        self.drafted_nodes += num_nodes - 1
        _bump(self.reached_depth, tree_depth)
        _bump(self.accepted_depth, num_accepted)

    @property
    def tau(self) -> float:
        return self.forward_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_per_depth(self) -> list[float]:
        return [
            self.accepted_depth[d] / reached if d < len(self.accepted_depth) else 0.0
            for d, reached in enumerate(self.reached_depth)
        ]

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.prefill_s - self.draft_s - self.verify_s)

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "tau": round(self.tau, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "wall_s": round(self.wall_s, 4),
            "num_verifications": self.num_verifications,
            "mean_drafted_nodes": round(self.drafted_nodes / self.num_verifications, 3)
            if self.num_verifications
            else 0.0,
            "acceptance_per_depth": [round(a, 4) for a in self.acceptance_per_depth],
            "time_s": {
                "prefill": round(self.prefill_s, 4),
                "draft": round(self.draft_s, 4),
                "verify": round(self.verify_s, 4),
                "other": round(self.other_s, 4),
            },
        }


def _bump(counts: list[int], depth: int) -> None:
    """counts[d-1] += 1 for d = 1..depth."""
    while len(counts) < depth:
        counts.append(0)
    for d in range(depth):
        counts[d] += 1
