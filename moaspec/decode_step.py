"""One speculative decoding cycle, shared by the in-process engine (engine.py) and the split
client (split/generator.py), which differ only in where the target verifies:

    propose a tree rooted at the last emitted token (no deeper than still useful, at most
    `max_nodes`) -> verify it (one target forward, in-process or one round trip) -> record the
    verification -> tell the drafter what was verified -> the emitted tokens.

`verify(tree)` returns a `Verdict`: the accepted path and next token, and `hand_over()`, which
gives the drafter the verified tokens (in-process `drafter.accept(update)`; split
`accept_context(ids, pos, context)` with the context the server sent). Draft time (propose and
hand-over) and verify time go into the generation's SpecStats. A `verify` that raises (the split
client's link went down) leaves the stats with the draft time only and the drafter untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moaspec.config import SamplingConfig
from moaspec.errors import MoaspecError
from moaspec.metrics import SpecStats
from moaspec.tree import DraftTree, depths, prune_to_depth

if TYPE_CHECKING:
    import torch

    from moaspec.drafters.base import Drafter


@dataclass(frozen=True)
class Verdict:
    """path_node_idx: accepted nodes, root first; next_token: the bonus or recovered token;
    hand_over: gives the drafter the verified tokens (root + accepted drafts)."""

    path_node_idx: list[int]
    next_token: int
    hand_over: Callable[[], None]


@dataclass(frozen=True)
class Step:
    """What one cycle did: its tree, verdict, emitted tokens (accepted drafts + next token) and
    the seconds it spent proposing (draft_s) and verifying (verify_s)."""

    tree: DraftTree
    verdict: Verdict
    emitted: list[int]
    draft_s: float
    verify_s: float

    @property
    def num_accepted(self) -> int:
        return len(self.verdict.path_node_idx) - 1


def decode_step(
    drafter: Drafter,
    root: int,
    remaining: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    stats: SpecStats,
    verify: Callable[[DraftTree], Verdict],
    limits: object | None = None,
    vocab_size: int | None = None,
) -> Step:
    """One cycle (module docstring). remaining: tokens still to emit (>= 1), so the tree is pruned
    to depth remaining - 1; limits: what verifies the tree (the target, or the split server's
    limits), whose `max_tree_nodes`, `max_tree_leaves` and `max_prob_entries` (each absent or
    None: no limit) keep only the tree's first nodes (limit_nodes); read only for a tree of two
    nodes or more, since a llama.cpp target measures its own on first need; vocab_size: the
    target's, which every drafted token must be in; generator: the drafter's random stream, None
    for greedy decoding (which draws nothing)."""
    tick = time.perf_counter()
    tree = check_proposal(drafter.propose(root, sampling, generator), root, vocab_size)
    tree = prune_to_depth(tree, remaining - 1)
    if limits is not None and tree.num_nodes > 1:
        tree = limit_nodes(
            tree, getattr(limits, "max_tree_nodes", None), getattr(limits, "max_tree_leaves", None),
            getattr(limits, "max_prob_entries", None),
        )
    draft_s = time.perf_counter() - tick
    stats.draft_s += draft_s

    tick = time.perf_counter()
    verdict = verify(tree)
    verify_s = time.perf_counter() - tick
    stats.verify_s += verify_s
    stats.record_verification(int(depths(tree.parents).max()), tree.num_nodes, len(verdict.path_node_idx) - 1)

    tick = time.perf_counter()
    verdict.hand_over()
    stats.draft_s += time.perf_counter() - tick
    emitted = [*tree.token_ids[verdict.path_node_idx[1:]].tolist(), verdict.next_token]
    return Step(tree, verdict, emitted, draft_s, verify_s)


def last_emitted(emitted: list[int], remaining: int, stop_ids: frozenset[int]) -> int | None:
    """Where emitting these tokens ends a generation that may emit `remaining` (>= 1) more: the
    index in `emitted` of its last token (the first stop token within the limit, else the
    limit's), or None where it goes on. The one end rule of the engine (Engine._emit), the split
    client and the split server's closing verify."""
    if remaining < 1:
        raise ValueError(f"a generation with {remaining} tokens left has ended already")
    for index, token in enumerate(emitted[:remaining]):
        if token in stop_ids:
            return index
    return remaining - 1 if len(emitted) >= remaining else None


def check_proposal(tree: DraftTree, root: int, vocab_size: int | None) -> DraftTree:
    """A drafter's tree as the verifier needs it (MoaspecError otherwise): node 0 is the root, the
    last emitted token (a tree from elsewhere would emit tokens the target never chose), and
    every token is in the target's vocabulary."""
    if int(tree.token_ids[0]) != root:
        raise MoaspecError(f"the drafter's tree starts at token {int(tree.token_ids[0])}, not at the root {root}")
    if vocab_size is not None and not bool(((tree.token_ids >= 0) & (tree.token_ids < vocab_size)).all()):
        raise MoaspecError(f"the drafter proposed a token outside the target's vocabulary [0, {vocab_size})")
    return tree


def limit_nodes(
    tree: DraftTree, max_nodes: int | None, max_leaves: int | None = None, max_prob_entries: int | None = None
) -> DraftTree:
    """The longest prefix of at most max_nodes nodes, max_leaves leaves and, for a sampled tree,
    max_prob_entries non-zero drafter probabilities in its rows (what a split server accepts;
    parents precede children, so a prefix is a tree; its leaves never decrease as it grows: a node
    adds one unless its parent was a leaf). A prefix of a sampled tree keeps each node's first
    draws, so its verification stays exact."""
    max_nodes = tree.num_nodes if max_nodes is None else min(max_nodes, tree.num_nodes)
    if max_prob_entries is not None and tree.draft_probs is not None:
        import torch  # a sampled model drafter's tree: torch is loaded

        entries = torch.cumsum((tree.draft_probs[:max_nodes] != 0).sum(dim=1), dim=0)  # [N]
        max_nodes = max(1, int((entries <= max_prob_entries).sum()))
    if max_leaves is not None:
        has_child, leaves = [False] * max_nodes, 1
        for node, parent in enumerate(tree.parents[1:max_nodes].tolist(), start=1):
            leaves += 1 if has_child[parent] else 0
            has_child[parent] = True
            if leaves > max_leaves:
                max_nodes = node
                break
    if tree.num_nodes <= max_nodes:
        return tree
    probs = None if tree.draft_probs is None else tree.draft_probs[:max_nodes]
    return DraftTree(tree.token_ids[:max_nodes], tree.parents[:max_nodes], probs)
