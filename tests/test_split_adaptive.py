"""The split client's adaptive tree (moaspec/split/adaptive.py) from scripted rounds: what it
records of each round and the cap on the trees it chooses."""

from __future__ import annotations

import pytest
import torch

from moaspec.config import TreeConfig
from moaspec.split.adaptive import AdaptiveTree
from moaspec.tree import DraftTree


def chain(nodes: int) -> DraftTree:
    return DraftTree(torch.arange(nodes), torch.arange(-1, nodes - 1))


def test_a_round_records_the_link_time_without_the_servers_and_acceptance_by_depth() -> None:
    adaptive = AdaptiveTree(TreeConfig(depth=3, top_k=1, budget=3), max_tree_nodes=16)
    adaptive.observe(round_trip_s=0.100, server_s=0.030, draft_s=0.006, tree=chain(4), num_accepted=2)
    assert adaptive.rtt_s == pytest.approx(0.070) and adaptive.draft_level_s == pytest.approx(0.002)
    assert adaptive.reached[1:5] == [1, 1, 1, 0] and adaptive.accepted[1:5] == [1, 1, 0, 0]


def test_trees_chosen_on_a_slow_link_stay_within_the_servers_node_cap() -> None:
    """A 1 s round trip and every draft accepted: the deepest, largest tree wins, cut to the
    server's 8 nodes (root included)."""
    adaptive = AdaptiveTree(TreeConfig(depth=2, top_k=2, budget=4), max_tree_nodes=8)
    for _ in range(20):
        adaptive.observe(round_trip_s=1.0, server_s=0.010, draft_s=0.002, tree=chain(5), num_accepted=4)
    chosen = adaptive.choose()
    assert chosen.budget + 1 == 8 and chosen.depth >= 4
