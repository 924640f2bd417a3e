"""Checks several drafter test modules share: a tree expanded level by level against its paths
drafted alone, and a drafter whose first distribution is made to favour one row."""

from __future__ import annotations

from collections.abc import Callable

import torch

# level 1: a, b under the root; level 2: c under b, d under a, e under b; level 3: f under e
TREE_LEVELS = [([11, 12], [-1, -1]), ([13, 14, 15], [1, 0, 1]), ([16], [2])]


def check_beams_against_their_paths(drafter, along: Callable[[list[int]], torch.Tensor]) -> None:
    """Expand `drafter` (started at its root) through TREE_LEVELS, several beams per level at one
    position: each beam's log-probs equal `along(path)`, what drafting that beam's root-to-node
    path alone gives."""
    paths: list[list[int]] = [[]]  # per beam of the previous level
    for depth, (level_tokens, parents) in enumerate(TREE_LEVELS, start=1):
        log_probs = drafter.expand(torch.tensor(level_tokens), torch.tensor(parents), depth)
        paths = [paths[max(p, 0)] + [t] for t, p in zip(level_tokens, parents)]
        for beam, path in enumerate(paths):
            torch.testing.assert_close(log_probs[beam], along(path), rtol=0, atol=1e-10)


def favour_row(drafter, row: int) -> None:
    """Make `drafter.start`'s distribution put its top on `row` (5 nats above the rest's best)."""
    model_start = drafter.start

    def forced_start(root_id: int) -> torch.Tensor:
        log_probs = model_start(root_id).clone()
        log_probs[0, row] = log_probs[0].max() + 5.0
        return torch.log_softmax(log_probs, dim=-1)

    drafter.start = forced_start
