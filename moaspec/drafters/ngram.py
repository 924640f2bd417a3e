"""Model-free n-gram (prompt-lookup) drafter.

The context often repeats itself (code, quotes, lists, names). Take the last n tokens of the
context (root included), find earlier places where the same n tokens occurred, most recent first,
and propose what followed them. Several continuations are merged into a trie, so one verification
checks a few alternatives. Longer n-grams are tried first; with no match the drafter proposes
the root alone (a plain decoding step costs less than a useless tree).

Drafts are deterministic (no `draft_probs`), which the stochastic verifier handles losslessly.
An index from n-gram to the positions where it ends is updated incrementally, so a proposal
costs O(branches * depth), not a scan of the context.

With a `LookupGate` (lookup_gate.py; the machine calibration gives one to the `ngram` form), a
match is verified only while matches have paid in this generation; otherwise the root goes
alone and the match is scored in the shadow against the tokens the target writes next.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from moaspec.config import NgramConfig, SamplingConfig
from moaspec.drafters.base import AloneDraft, Context, NoContext, VerifiedUpdate
from moaspec.drafters.lookup_gate import LookupGate
from moaspec.tree import DraftTree, trie, trie_children, trie_nodes, walk

if TYPE_CHECKING:
    import torch

    from moaspec.targets.base import Target


# How often a copied continuation's next token is the target's: 79 % of the lookup's first tokens
# online (MT-bench, 80 x 2, depth 1), 83 % of its tokens drafted alone after a cut on 30 held-out
# prompts (README, Client-server split). The probability a lookup copy reports when drafting alone.
LOOKUP_PRECISION = 0.8
# Beside a model (`moa+ngram`), drafting alone, a copy's precision depends on whether the model's
# own first choice is the same token. Measured on MT-bench and HumanEval (80 prompts, offline tokens
# whose earlier ones agreed, bench/results/offline-calibration-s15/): 0.92 when it is (65 of 71),
# 0.86 when it is not (153 of 177), and the model's disputing choice was right 6 % of those times
# (11 of 177), so the copy is kept either way; only its reported probability differs.
LOOKUP_PRECISION_AGREED = 0.92
LOOKUP_PRECISION_DISPUTED = 0.86


class NgramDrafter:
    """Prompt-lookup drafter proposing a small trie of earlier continuations."""

    hidden_layers: tuple[int, ...] = ()
    context_encoder = NoContext()

    def __init__(self, config: NgramConfig | None = None, gate: LookupGate | None = None) -> None:
        self.config = config or NgramConfig()
        self.gate = gate
        self.reset()

    @classmethod
    def for_target(cls, target: Target) -> NgramDrafter:
        """The registry's factory; this drafter does not depend on the target."""
        return cls()

    def reset(self) -> None:
        self.history: list[int] = []
        # ends[n][ngram] = positions (ascending) of the last token of each occurrence
        self.ends: dict[int, defaultdict[tuple[int, ...], list[int]]] = {
            n: defaultdict(list) for n in range(self.config.min_ngram, self.config.max_ngram + 1)
        }
        # the gate's pending matches: (history index of the root, trie nodes) of a verified
        # trie; (the same, the trie's children: node -> token -> child) of a shadow one
        self._verified: tuple[int, int] | None = None
        self._shadow: tuple[int, int, dict[int, dict[int, int]]] | None = None
        if self.gate is not None:
            self.gate.reset()

    def accept(self, update: VerifiedUpdate) -> None:
        self.accept_context(update.token_ids, update.start_pos, {})

    def accept_context(self, token_ids: np.ndarray, start_pos: int, context: Context) -> None:
        self.extend(token_ids.tolist())

    def extend(self, tokens: list[int]) -> None:
        """Append verified tokens to the history and index the n-grams they end."""
        for token in tokens:
            self.history.append(token)
            end = len(self.history) - 1
            for n, index in self.ends.items():
                if end + 1 >= n:
                    index[tuple(self.history[end + 1 - n : end + 1])].append(end)
        if self.gate is not None:
            self._score_matches()

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        token_ids, parents, _ = self.propose_nodes(root_id)
        return DraftTree(token_ids, parents)

    def propose_nodes(self, root_id: int) -> tuple[list[int], list[int], list[int]]:
        """`propose`'s trie as lists (token ids, parents, depths; tree.trie_nodes): the root
        alone without a match, or while the gate is closed (the match is then scored in the shadow)."""
        nodes = trie_nodes(root_id, self.continuations(root_id), self.config.max_nodes)
        num_nodes = len(nodes[0])
        if self.gate is None or num_nodes == 1:
            return nodes
        if self.gate.is_open:
            self._verified = (len(self.history), num_nodes)
            return nodes
        if self._shadow is None:
            self._shadow = (len(self.history), num_nodes, trie_children(*nodes[:2]))
        return [root_id], [-1], [0]

    def _score_matches(self) -> None:
        """Tell the gate what the pending matches gained, once the history shows it: a verified
        trie at its accept (the root and its accepted drafts), a shadow one when the target's
        tokens leave it or reach one of its leaves."""
        if self._verified is not None:
            start, num_nodes = self._verified
            self._verified = None
            self.gate.record(len(self.history) - start - 1, num_nodes)
        if self._shadow is not None:
            start, num_nodes, children = self._shadow
            accepted, node = walk(children, self.history[start + 1 :])
            if node in children:  # right so far, and the trie goes on: wait for more tokens
                return
            self._shadow = None
            self.gate.record(accepted, num_nodes)

    def draft_alone(
        self, root_id: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> AloneDraft | None:
        """The first token of the best continuation, or None when the context has no match
        (the gate does not apply: nothing is verified)."""
        tree = trie(root_id, self.continuations(root_id), self.config.max_nodes)
        if tree.num_nodes == 1:
            return None
        self.accept_context(np.array([root_id]), len(self.history), {})
        return AloneDraft(int(tree.token_ids[1]), LOOKUP_PRECISION, "lookup")

    def continuations(self, root_id: int) -> list[list[int]]:
        """Up to max_branches distinct continuations of the context + root, longest n-gram and
        most recent match first (token lists, at most max_depth long)."""
        context = [*self.history, root_id]
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            if len(context) < n:
                continue
            for end in reversed(self.ends[n].get(tuple(context[-n:]), ())):
                continuation = context[end + 1 : end + 1 + self.config.max_depth]
                key = tuple(continuation)
                if continuation and key not in seen:
                    seen.add(key)
                    found.append(continuation)
                    if len(found) == self.config.max_branches:
                        return found
        return found
