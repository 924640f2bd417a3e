"""Draft tree structure: masks, depths, paths, pruning, validation (random trees + golden cases)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moaspec.tree import (
    DraftTree,
    ancestor_mask,
    children,
    depths,
    leaf_groups,
    leaf_paths,
    path_to,
    prune_to_depth,
    tree_attention_bias,
    trie,
)


def random_parents(num_nodes: int, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, num_nodes)]
    return np.array(parents)


def naive_ancestors(parents: list[int], node: int) -> set[int]:
    found = {node}
    while parents[node] >= 0:
        node = parents[node]
        found.add(node)
    return found


@pytest.mark.parametrize("seed", range(20))
def test_mask_depth_paths_properties(seed: int) -> None:
    num_nodes = 1 + seed % 17
    parents = random_parents(num_nodes, seed)
    mask = ancestor_mask(parents)
    plist = parents.tolist()
    for i in range(num_nodes):
        expected = naive_ancestors(plist, i)
        assert {j for j in range(num_nodes) if mask[i, j]} == expected
    assert np.array_equal(depths(parents), mask.sum(-1) - 1)
    paths = leaf_paths(parents)
    on_some_path = {node for path in paths for node in path}
    assert on_some_path == set(range(num_nodes))
    node_depth = depths(parents).tolist()
    for path in paths:
        assert path[0] == 0
        assert [node_depth[n] for n in path] == list(range(len(path)))
        assert not children(parents)[path[-1]]
        assert path_to(parents, path[-1]) == path


def test_golden_chain_and_binary_tree() -> None:
    chain = DraftTree.chain([5, 6, 7, 8])
    assert np.array_equal(ancestor_mask(chain.parents), np.tril(np.ones((4, 4), dtype=bool)))
    assert depths(chain.parents).tolist() == [0, 1, 2, 3]
    # root -> (1, 2); 1 -> (3, 4); 2 -> (5, 6)
    binary = np.array([-1, 0, 0, 1, 1, 2, 2])
    expected = np.array(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0],
            [1, 0, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 0, 1],
        ],
        dtype=bool,
    )
    assert np.array_equal(ancestor_mask(binary), expected)
    assert leaf_paths(binary) == [[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]
    assert children(binary) == [[1, 2], [3, 4], [5, 6], [], [], [], []]


def test_attention_bias_layout() -> None:
    parents = np.array([-1, 0, 0, 1])
    bias = tree_attention_bias(parents, num_cached=3, dtype=torch.float32)
    assert bias.shape == (1, 1, 4, 7)
    visible = bias[0, 0] == 0
    assert visible[:, :3].all()  # the verified context is visible to every node
    assert np.array_equal(visible[:, 3:].numpy(), ancestor_mask(parents))
    assert (bias[0, 0][~visible] == torch.finfo(torch.float32).min).all()


def test_prune_to_depth_keeps_ancestor_closed_subtree() -> None:
    parents = torch.tensor([-1, 0, 1, 0, 2, 3, 1])
    probs = torch.rand(7, 5)
    tree = DraftTree(torch.arange(10, 17), parents, probs)
    pruned = prune_to_depth(tree, 1)
    assert pruned.token_ids.tolist() == [10, 11, 13]
    assert pruned.parents.tolist() == [-1, 0, 0]
    assert torch.equal(pruned.draft_probs, probs[[0, 1, 3]])
    pruned2 = prune_to_depth(tree, 2)
    assert pruned2.token_ids.tolist() == [10, 11, 12, 13, 15, 16]
    assert pruned2.parents.tolist() == [-1, 0, 1, 0, 3, 1]
    assert prune_to_depth(tree, 0).token_ids.tolist() == [10]
    assert prune_to_depth(tree, 5) is tree


@pytest.mark.parametrize(
    "token_ids, parents",
    [([1, 2], [0, -1]), ([1, 2], [-1, 1]), ([1, 2, 3], [-1, 2, 0]), ([], []), ([1, 2], [-1]), ([1], [0])],
)
def test_invalid_trees_are_rejected(token_ids: list[int], parents: list[int]) -> None:
    with pytest.raises(ValueError):
        DraftTree(torch.tensor(token_ids, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def test_token_ids_and_parents_are_int64_arrays_whatever_they_were_given_as() -> None:
    for given in ([7, 8, 9], (7, 8, 9), np.array([7, 8, 9], dtype=np.int32), torch.tensor([7, 8, 9])):
        tree = DraftTree(given, [-1, 0, 1])
        assert isinstance(tree.token_ids, np.ndarray) and tree.token_ids.dtype == np.int64
        assert tree.parents.dtype == np.int64 and tree.token_ids.tolist() == [7, 8, 9]
    assert DraftTree.chain(torch.tensor([3, 4])).parents.tolist() == [-1, 0]


def test_draft_probabilities_need_one_row_per_node() -> None:
    token_ids, parents = torch.tensor([1, 2]), torch.tensor([-1, 0])
    assert DraftTree(token_ids, parents, torch.full((2, 5), 0.2)).num_nodes == 2
    with pytest.raises(ValueError, match="one row per node"):
        DraftTree(token_ids, parents, torch.full((3, 5), 0.2))


def test_trie_merges_continuations() -> None:
    tree = trie(9, [[1, 3, 4], [2, 6], [1, 3, 5], [7, 8]], max_nodes=8)
    # shared prefixes are followed, new tokens become children, insertion stops when full
    assert tree.token_ids.tolist() == [9, 1, 3, 4, 2, 6, 5, 7]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 0, 4, 2, 0]
    assert tree.draft_probs is None
    assert trie(9, [], max_nodes=8).num_nodes == 1
    assert trie(9, [[1, 2, 3]], max_nodes=2).token_ids.tolist() == [9, 1]


def test_limit_nodes_keeps_the_longest_prefix_within_the_node_and_leaf_limits() -> None:
    import random

    from moaspec.decode_step import limit_nodes

    generator = random.Random(3)
    for _ in range(200):
        size = generator.randrange(1, 40)
        parents = np.array([-1] + [generator.randrange(i) for i in range(1, size)])
        probs = torch.arange(size * 4, dtype=torch.float64).view(size, 4)  # a row per node, told apart
        probs[0] = 0  # the root's row is empty, the others hold 1-4 non-zero entries
        probs[1:] *= torch.rand(size - 1, 4, generator=torch.Generator().manual_seed(size)) < 0.7
        probs[1:, 0] += 1
        tree = DraftTree(torch.arange(size), parents, probs)
        max_nodes = generator.choice([None, generator.randrange(1, 45)])
        max_leaves = generator.choice([None, generator.randrange(1, 20)])
        max_entries = generator.choice([None, generator.randrange(0, 60)])

        def fits(n: int) -> bool:
            leaves = len(leaf_groups(parents[:n])[0])
            entries = int((probs[:n] != 0).sum())
            return (
                (max_nodes is None or n <= max_nodes) and (max_leaves is None or leaves <= max_leaves)
                and (max_entries is None or entries <= max_entries or n == 1)
            )

        expected = max(n for n in range(1, size + 1) if fits(n))
        cut = limit_nodes(tree, max_nodes, max_leaves, max_entries)
        assert cut.num_nodes == expected and np.array_equal(cut.parents, parents[:expected])
        assert torch.equal(cut.draft_probs, probs[:expected])  # the drafter's rows go with their nodes


def test_lookup_continuations_come_most_recent_first_and_distinct() -> None:
    """The n-gram (1, 2) followed by 7, 8, then by 5, 6: the most recent continuation comes first;
    followed by 7, 8 once more, that one is proposed once, as the most recent."""
    from moaspec.config import NgramConfig
    from moaspec.drafters.ngram import NgramDrafter

    config = NgramConfig(min_ngram=2, max_ngram=2, max_depth=2, max_branches=3)
    twice, thrice = NgramDrafter(config), NgramDrafter(config)
    twice.extend([1, 2, 7, 8, 0, 1, 2, 5, 6, 0, 1])
    assert twice.continuations(2) == [[5, 6], [7, 8]]
    thrice.extend([1, 2, 7, 8, 0, 1, 2, 5, 6, 0, 1, 2, 7, 8, 0, 1])
    assert thrice.continuations(2) == [[7, 8], [5, 6]]
    alone = twice.draft_alone(2, None, None)  # offline: the most recent copy's first token, at the measured 0.8
    assert (alone.token_id, alone.probability, alone.source) == (5, 0.8, "lookup")


def test_the_lookup_gate_weighs_the_newest_match_by_one_minus_its_decay() -> None:
    from moaspec.drafters.lookup_gate import GATE_DECAY, LookupGate

    assert LookupGate((0.0, 0.0)).decay == GATE_DECAY == 0.6
    gate = LookupGate((0.0, 0.0, 0.5), decay=0.8)
    gate.record(accepted=1, num_nodes=1)
    assert gate.score == pytest.approx(0.2)
    gate.record(accepted=0, num_nodes=2)  # a 2-node trie costs half a step more, none accepted
    assert gate.score == pytest.approx(0.8 * 0.2 + 0.2 * -0.5) and gate.is_open
