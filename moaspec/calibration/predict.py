"""Predicted tokens/s of each drafter form, from measured costs and stored acceptance.

Forms (what `--drafter` would name):
- `none`: one token per plain step (costs.py: a one-node forward among many): 1 / plain.
- `ngram` with lookup configuration c: replaying greedy lookup decoding over the profile's
  sequences (profile.simulate_lookup) gives M matched cycles emitting T_m tokens over N_m tree
  nodes in all, and U unmatched cycles (plain steps). Seconds = M * (lookup + tree(N_m / M))
  + U * (lookup + plain); tokens = T_m + U (tree: verify and penalty, costs.tree_s).
- `X+ngram` (lookup first, model drafter X otherwise) with lookup c and tree t: the matched
  cycles as above (plus the drafter's accept of their tokens); the U tokens the lookup could not
  cover are drafted by X at tau_t tokens per cycle (rank model, tree_ranking.py), U / tau_t cycles
  of cycle_s(t) + lookup seconds each.
- `X` alone (when named explicitly): tau_t / cycle_s(t).
Every form is evaluated in each measured weight layout; the best expected tokens/s wins, and a
speculative form must beat `none` by MIN_GAIN to be chosen (the prediction's error margin: a
default that is slower than plain decoding is the one outcome this calibration exists to rule
out).
"""

from __future__ import annotations

from dataclasses import dataclass

from moaspec.calibration.costs import CycleCosts
from moaspec.calibration.profile import LookupStats
from moaspec.calibration.tree_ranking import Candidate
from moaspec.config import NgramConfig, TreeConfig

MIN_GAIN = 1.05
LOOKUP_DEPTHS = (1, 2, 3, 4, 6, 8)
LOOKUP_BRANCHES = (1, 3)
LOOKUP_MAX_NODES = 16
# The shortest n-gram a lookup matches on: longer matches draft less often and are right more
# often, which pays where every verified node costs much of a step (llama.cpp on 2 cores).
LOOKUP_MIN_NGRAMS = (2, 3, 4)


def lookup_configs() -> list[NgramConfig]:
    """The lookup tries the calibration chooses among (shortest match x depth x branches, at
    most 16 nodes; n-grams of up to max(4, shortest) tokens are tried, longest first)."""
    longest = NgramConfig().max_ngram
    return [
        NgramConfig(
            min_ngram=shortest,
            max_ngram=max(longest, shortest),
            max_depth=depth,
            max_branches=branches,
            max_nodes=min(LOOKUP_MAX_NODES, 1 + depth * branches),
        )
        for shortest in LOOKUP_MIN_NGRAMS
        for depth in LOOKUP_DEPTHS
        for branches in LOOKUP_BRANCHES
    ]


@dataclass(frozen=True)
class Option:
    """One way to decode: drafter form, layout, tree and lookup, with its prediction."""

    drafter: str  # "none" | "ngram" | "<X>" | "<X>+ngram"
    layout: str
    tokens_per_s: float
    tree: TreeConfig | None = None
    lookup: NgramConfig | None = None
    expected_tau: float = 1.0

    def to_dict(self) -> dict:
        record = {
            "drafter": self.drafter,
            "layout": self.layout,
            "predicted_tokens_per_s": round(self.tokens_per_s, 3),
            "expected_tau": round(self.expected_tau, 4),
        }
        record["tree"] = None  # null for the model-free forms
        if self.tree is not None:
            record["tree"] = {"depth": self.tree.depth, "top_k": self.tree.top_k, "budget": self.tree.budget}
        record["lookup"] = None  # null for a form without prompt lookup
        if self.lookup is not None:
            record["lookup"] = {
                "min_ngram": self.lookup.min_ngram,
                "max_depth": self.lookup.max_depth,
                "max_branches": self.lookup.max_branches,
            }
        return record


def plain_option(layout: str, verify: CycleCosts) -> Option:
    return Option("none", layout, 1.0 / verify.plain_step())


def lookup_option(layout: str, verify: CycleCosts, config: NgramConfig, stats: LookupStats, lookup_s: float) -> Option:
    """`ngram` with lookup `config` (stats: its replay on the profile; lookup_s: its seconds per cycle)."""
    seconds = stats.unmatched_cycles * (lookup_s + verify.plain_step())
    if stats.matched_cycles:
        seconds += stats.matched_cycles * (lookup_s + verify.tree_s(stats.matched_nodes / stats.matched_cycles))
    tau = stats.tokens / stats.cycles if stats.cycles else 1.0
    return Option("ngram", layout, stats.tokens / seconds if seconds > 0 else 0.0, lookup=config, expected_tau=tau)


def lookup_first_option(
    name: str,
    layout: str,
    costs: CycleCosts,
    candidate: Candidate,
    config: NgramConfig,
    stats: LookupStats,
    lookup_s: float,
) -> Option:
    """`name+ngram`: lookup trie `config` when it matches, else the model's tree `candidate`."""
    fixed, per_token = costs.accept_s
    seconds = 0.0
    if stats.matched_cycles:
        seconds += stats.matched_cycles * (lookup_s + costs.tree_s(stats.matched_nodes / stats.matched_cycles) + fixed)
        seconds += per_token * stats.matched_tokens
    model_cycles = stats.unmatched_cycles / candidate.expected_tau
    seconds += model_cycles * (lookup_s + candidate.cycle_s)
    cycles = stats.matched_cycles + model_cycles
    tau = stats.tokens / cycles if cycles else 1.0
    return Option(
        f"{name}+ngram",
        layout,
        stats.tokens / seconds if seconds > 0 else 0.0,
        tree=candidate.tree,
        lookup=config,
        expected_tau=tau,
    )


def model_option(name: str, layout: str, candidate: Candidate) -> Option:
    """Model drafter `name` alone with the tree of `candidate`."""
    return Option(name, layout, candidate.tokens_per_s, tree=candidate.tree, expected_tau=candidate.expected_tau)


def choose(options: list[Option]) -> Option:
    """The fastest option; a speculative one only when it beats the fastest `none` by MIN_GAIN."""
    plain = max((o for o in options if o.drafter == "none"), key=lambda o: o.tokens_per_s, default=None)
    best = max(options, key=lambda o: o.tokens_per_s)
    if plain is not None and best.drafter != "none" and best.tokens_per_s < MIN_GAIN * plain.tokens_per_s:
        return plain
    return best
