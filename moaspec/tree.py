"""Draft trees: token ids plus parent indices, and pure functions over them.

Invariants of a `DraftTree` with N nodes:
- node 0 is the root: the last emitted token, which the target has not processed yet;
- `parents[0] == -1` and `0 <= parents[i] < i` for i >= 1 (parents come before children);
- a chain (every parent is its predecessor) is a tree like any other, with one code path.

The root sits at absolute position `pos0` (the target's cache length); node i sits at
`pos0 + depth[i]`. A node attends to the verified context and to its own ancestors.

Token ids and parents are numpy arrays, so greedy plain decoding and prompt lookup on llama.cpp
run without torch (README, *Performance notes*, Start-up); only a sampled model drafter's
`draft_probs` are torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DraftTree:
    """A tree of drafted tokens to verify in one target forward.

    token_ids:   [N] int64 numpy array, node 0 is the root.
    parents:     [N] int64 numpy array, -1 for the root.
    draft_probs: optional [N, V] torch tensor: row i is the drafter distribution node i's token was
                 drawn from, given its ancestors and its earlier siblings (row 0 unused). None
                 means the drafts are deterministic (each proposal is a point mass on its own token).
    Any 1-D integer sequence (a list, a numpy array, a torch tensor) is taken for token_ids
    and parents and stored as such an array.
    """

    token_ids: np.ndarray
    parents: np.ndarray
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ids", int_array(self.token_ids))
        object.__setattr__(self, "parents", int_array(self.parents))
        if self.token_ids.ndim != 1 or self.parents.shape != self.token_ids.shape:
            raise ValueError("token_ids and parents must be 1-D arrays of the same length")
        if self.token_ids.size == 0 or int(self.parents[0]) != -1:
            raise ValueError("a draft tree needs a root (node 0) with parent -1")
        n = self.token_ids.size
        if n > 1:
            rest = self.parents[1:]
            if bool((rest < 0).any()) or bool((rest >= np.arange(1, n)).any()):
                raise ValueError("every parent index must point to an earlier node")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError("draft_probs must have one row per node")

    @property
    def num_nodes(self) -> int:
        return self.token_ids.size

    @staticmethod
    def chain(
        token_ids: Sequence[int] | np.ndarray | torch.Tensor, draft_probs: torch.Tensor | None = None
    ) -> DraftTree:
        """A chain: root followed by drafts, each the child of the previous one."""
        ids = int_array(token_ids)
        return DraftTree(ids, np.arange(-1, ids.size - 1), draft_probs)

    @staticmethod
    def root_only(root_id: int) -> DraftTree:
        """The tree of plain decoding: the root and no drafts."""
        return DraftTree.chain([root_id])


def int_array(values: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    """Integer ids as an int64 numpy array (from a list, a numpy array or a torch tensor)."""
    if hasattr(values, "detach"):  # a torch tensor, perhaps on a GPU
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64)


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """mask[i, j] is True iff j is i or an ancestor of i.  parents: [N] -> [N, N] bool."""
    n = len(parents)
    mask = np.eye(n, dtype=bool)
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def depths(parents: np.ndarray) -> np.ndarray:
    """Depth of each node, root = 0.  parents: [N] -> [N] int64 (parents come before children)."""
    result: list[int] = []
    for parent in parents.tolist():
        result.append(0 if parent < 0 else result[parent] + 1)
    return np.array(result, dtype=np.int64)


def children(parents: np.ndarray) -> list[list[int]]:
    """children[i] = the child node indices of node i, in node order."""
    kids: list[list[int]] = [[] for _ in range(len(parents))]
    for i, parent in enumerate(parents.tolist()):
        if parent >= 0:
            kids[parent].append(i)
    return kids


def path_to(parents: np.ndarray, node: int) -> list[int]:
    """Node indices from the root down to `node`, both included."""
    path = []
    parent_list = parents.tolist()
    while node >= 0:
        path.append(node)
        node = parent_list[node]
    return path[::-1]


def leaf_paths(parents: np.ndarray) -> list[list[int]]:
    """All root-to-leaf paths (node indices), leaves in node order."""
    kids = children(parents)
    return [path_to(parents, i) for i in range(len(parents)) if not kids[i]]


def leaf_groups(parents: np.ndarray) -> list[list[int]]:
    """For every node, the numbers of the leaves below it (itself, if a leaf): leaves are numbered
    0.. in node order. The llama.cpp runtime makes them sequence ids (a node attends to the cells
    of its first sequence), so a chain (one leaf) is sequence 0 alone.

    parents: [N] (parents[0] = -1, parents[i] < i). -> N lists, each sorted, the root's [0, 1, ...].
    """
    kids = children(parents)
    parent_list = parents.tolist()
    count = len(kids)
    groups: list[list[int]] = [[] for _ in range(count)]
    leaves = [node for node in range(count) if not kids[node]]
    for number, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            groups[node].append(number)
            node = parent_list[node]
    return groups


def tree_attention_bias(
    parents: np.ndarray, num_cached: int, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """Additive attention mask for verifying a tree after `num_cached` verified tokens.

    Returns [1, 1, N, num_cached + N]: 0 where a node may attend (the whole verified context,
    its ancestors, itself), the dtype's minimum elsewhere. Additive float masks, because a bool
    mask is silently misread by transformers' eager attention. With a sliding `window`, a node at
    position q sees only keys at positions > q - window (transformers' sliding_window_overlay);
    the verified context holds positions 0.., a node sits at num_cached + its depth.
    """
    import torch  # the transformers runtime's: torch is loaded there

    n = len(parents)
    visible = np.ones((n, num_cached + n), dtype=bool)
    visible[:, num_cached:] = ancestor_mask(parents)
    if window is not None:
        node_positions = num_cached + depths(parents)
        key_positions = np.concatenate([np.arange(num_cached), node_positions])
        visible &= key_positions[None, :] > node_positions[:, None] - window
    visible = torch.from_numpy(visible)
    bias = torch.zeros(n, num_cached + n, dtype=dtype)
    bias.masked_fill_(~visible, torch.finfo(dtype).min)
    return bias[None, None]


def prune_to_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """The subtree of nodes at depth <= max_depth (node order and draft_probs rows kept)."""
    keep = depths(tree.parents) <= max_depth
    if bool(keep.all()):
        return tree
    kept_idx = np.flatnonzero(keep)  # ascending, so parents stay before children
    new_index = np.full(tree.num_nodes, -1, dtype=np.int64)
    new_index[kept_idx] = np.arange(kept_idx.size)
    old_parents = tree.parents[kept_idx]
    new_parents = np.where(old_parents >= 0, new_index[np.maximum(old_parents, 0)], -1)
    draft_probs = None if tree.draft_probs is None else tree.draft_probs[kept_idx.tolist()]
    return DraftTree(tree.token_ids[kept_idx], new_parents, draft_probs)


def trie(root_id: int, continuations: list[list[int]], max_nodes: int) -> DraftTree:
    """The trie of token continuations of `root_id`, inserted in order, at most max_nodes nodes.

    A continuation follows existing nodes while its tokens match a child, then adds a chain
    (cut where the trie is full). Deterministic drafts: no `draft_probs`.
    """
    token_ids, parents, _ = trie_nodes(root_id, continuations, max_nodes)
    return DraftTree(token_ids, parents)


def trie_nodes(root_id: int, continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int], list[int]]:
    """`trie`'s nodes as lists: (token ids, parents, depths), root first."""
    token_ids, parents, node_depths = [root_id], [-1], [0]
    child_of: dict[tuple[int, int], int] = {}
    for continuation in continuations:
        node = 0
        for token in continuation:
            existing = child_of.get((node, token))
            if existing is None:
                if len(token_ids) >= max_nodes:
                    break
                existing = len(token_ids)
                token_ids.append(token)
                parents.append(node)
                node_depths.append(node_depths[node] + 1)
                child_of[(node, token)] = existing
            node = existing
    return token_ids, parents, node_depths


def trie_children(token_ids: list[int], parents: list[int]) -> dict[int, dict[int, int]]:
    """node -> {token: child node} of a tree given as lists (tokens are unique among siblings in a trie)."""
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(token_ids, parents)):
        if parent >= 0:
            children.setdefault(parent, {}).setdefault(token, node)
    return children


def walk(children: dict[int, dict[int, int]], future: list[int]) -> tuple[int, int]:
    """Follow `future` down from the root. -> (drafts matched, the node reached, or -1 where
    `future` left the tree)."""
    node, matched = 0, 0
    for token in future:
        node = children.get(node, {}).get(token, -1)
        if node < 0:
            break
        matched += 1
    return matched, node
