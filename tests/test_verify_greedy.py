"""Greedy verification on handcrafted +/-100 logits (house style 7.6 item 3).

Each target row has +100 at the token the target predicts after that node and -100 elsewhere,
so the expected accepted path and next token can be read off the test by hand.
"""

from __future__ import annotations

import pytest
import torch

from moaspec.tree import DraftTree
from moaspec.verify import Accepted, verify_greedy

V = 16


def peaked_logits(next_tokens: list[int], vocab: int = V) -> torch.Tensor:
    """[N, V] logits: row i is +100 at next_tokens[i] and -100 everywhere else."""
    logits = torch.full((len(next_tokens), vocab), -100.0)
    logits[torch.arange(len(next_tokens)), torch.tensor(next_tokens)] = 100.0
    return logits


def tree_of(token_ids: list[int], parents: list[int]) -> DraftTree:
    return DraftTree(torch.tensor(token_ids), torch.tensor(parents))


def assert_accepted(result: Accepted, path: list[int], accepted: list[int], next_token: int) -> None:
    assert result.path_node_idx == path
    assert result.accepted_ids == accepted
    assert result.next_token == next_token
    assert result.num_accepted == len(accepted)
    assert result.emitted_ids == [*accepted, next_token]


def test_chain_perfect_match_accepts_all_and_adds_bonus() -> None:
    tree = DraftTree.chain([3, 5, 7, 9])
    result = verify_greedy(tree, peaked_logits([5, 7, 9, 11]))
    assert_accepted(result, [0, 1, 2, 3], [5, 7, 9], 11)


def test_chain_mismatch_at_first_draft_emits_the_target_token() -> None:
    tree = DraftTree.chain([3, 5, 7, 9])
    result = verify_greedy(tree, peaked_logits([4, 7, 9, 11]))
    assert_accepted(result, [0], [], 4)


def test_chain_early_mismatch_stops_even_if_later_drafts_match_their_parent() -> None:
    # Node 2 (token 7) is wrong; node 3 (token 9) matches the target after node 2, but a node is
    # only accepted when its whole root path matches.
    tree = DraftTree.chain([3, 5, 7, 9])
    result = verify_greedy(tree, peaked_logits([5, 8, 9, 11]))
    assert_accepted(result, [0, 1], [5], 8)


def test_root_only_tree_emits_the_argmax_as_bonus() -> None:
    tree = DraftTree.root_only(3)
    result = verify_greedy(tree, peaked_logits([12]))
    assert_accepted(result, [0], [], 12)


def test_root_only_tree_bonus_is_argmax_of_general_logits() -> None:
    logits = torch.tensor([[0.1, 2.5, -1.0, 2.4, 0.0]])
    result = verify_greedy(DraftTree.root_only(0), logits)
    assert_accepted(result, [0], [], 1)


def test_tree_accepts_the_longest_matching_root_path() -> None:
    # Root children 1 and 2 are both token 5 and both match. Under node 1 nothing matches
    # (nodes 3 and 6), under node 2 the path 2 -> 4 -> 5 matches: depth 3 beats depth 1.
    tokens = [3, 5, 5, 1, 8, 10, 2]
    parents = [-1, 0, 0, 1, 2, 4, 1]
    next_after = [5, 9, 8, 0, 10, 13, 0]
    result = verify_greedy(tree_of(tokens, parents), peaked_logits(next_after))
    assert_accepted(result, [0, 2, 4, 5], [5, 8, 10], 13)


def test_tree_descends_through_a_later_grandchild() -> None:
    # 0 -> 1 matches; node 1's first child (node 2) is wrong, its second (node 3) is right and
    # continues with node 4. Node 5 is a deeper child of wrong node 2 that matches its parent.
    tokens = [3, 5, 9, 7, 8, 6]
    parents = [-1, 0, 1, 1, 3, 2]
    next_after = [5, 7, 6, 8, 12, 0]
    result = verify_greedy(tree_of(tokens, parents), peaked_logits(next_after))
    assert_accepted(result, [0, 1, 3, 4], [5, 7, 8], 12)


def test_tree_matching_branch_that_is_not_the_first_child() -> None:
    # Root children: node 1 (token 4, wrong), node 2 (token 6, wrong), node 3 (token 7, right).
    # Node 4 is a child of wrong node 1 that matches the target after node 1: not reachable.
    tokens = [3, 4, 6, 7, 9]
    parents = [-1, 0, 0, 0, 1]
    next_after = [7, 9, 0, 12, 0]
    result = verify_greedy(tree_of(tokens, parents), peaked_logits(next_after))
    assert_accepted(result, [0, 3], [7], 12)


def test_tree_tie_between_equally_deep_nodes_goes_to_lowest_index() -> None:
    # Duplicate root children 1 and 2 (token 5) both match; node 3 (child of 2) and node 4
    # (child of 1) both match at depth 2. Lowest node index wins: node 3, via node 2.
    tokens = [3, 5, 5, 8, 7]
    parents = [-1, 0, 0, 2, 1]
    next_after = [5, 7, 8, 11, 12]
    result = verify_greedy(tree_of(tokens, parents), peaked_logits(next_after))
    assert_accepted(result, [0, 2, 3], [5, 8], 11)


def test_tree_tie_prefers_lowest_index_in_the_first_branch_too() -> None:
    # Same tree with the grandchildren swapped: now node 3 hangs under node 1.
    tokens = [3, 5, 5, 7, 8]
    parents = [-1, 0, 0, 1, 2]
    next_after = [5, 7, 8, 11, 12]
    result = verify_greedy(tree_of(tokens, parents), peaked_logits(next_after))
    assert_accepted(result, [0, 1, 3], [5, 7], 11)


def test_duplicate_sibling_tokens_follow_the_branch_that_continues() -> None:
    # Nodes 1 and 2 are both token 5 and both match; only node 2's child (node 4) matches.
    tokens = [3, 5, 5, 1, 9]
    parents = [-1, 0, 0, 1, 2]
    next_after = [5, 2, 9, 0, 14]
    result = verify_greedy(tree_of(tokens, parents), peaked_logits(next_after))
    assert_accepted(result, [0, 2, 4], [5, 9], 14)


def test_duplicate_sibling_tokens_with_no_deeper_match_take_the_first() -> None:
    tokens = [3, 5, 5, 1, 2]
    parents = [-1, 0, 0, 1, 2]
    next_after = [5, 9, 10, 0, 0]
    result = verify_greedy(tree_of(tokens, parents), peaked_logits(next_after))
    assert_accepted(result, [0, 1], [5], 9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_result_does_not_depend_on_logit_dtype(dtype: torch.dtype) -> None:
    tree = DraftTree.chain([3, 5, 7, 9])
    result = verify_greedy(tree, peaked_logits([5, 7, 2, 11]).to(dtype))
    assert_accepted(result, [0, 1, 2], [5, 7], 2)
