"""Verification of a draft tree against the target: pure, model-free functions.

Both verifiers return an `Accepted`: the path of accepted nodes (root first) and the next token,
which is either the *bonus* (drawn from the target after the last accepted node, when no child
of it was accepted) or the *recovered* token (drawn from the residual after all children of the
last accepted node were rejected). Either way it becomes the root of the next draft tree.

Stochastic verification is recursive rejection sampling over siblings (SpecInfer, Miao et al.
2024, Alg. 2; "Recursive Speculative Decoding", Jeon et al. 2024). At node u with target
distribution p and children c_1..c_m, child c_j drawn from q_j (its row of `draft_probs`: the
drafter distribution given its ancestors and its earlier siblings):
    accept c_j with probability min(1, p(x_j) / q_j(x_j)); on acceptance descend into c_j;
    on rejection p <- normalise(max(p - q_j, 0)) and try the next sibling;
    if every child is rejected, draw the recovered token from the final p.
By induction over siblings the emitted token at u follows the target's p exactly, for any
proposals q_j that do not look at the target's random draws. Deterministic drafts
(`draft_probs is None`) use q_j = point mass on x_j, so the residual is p with x_j removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from moaspec.tree import DraftTree, ancestor_mask, children, path_to

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Accepted:
    """Outcome of verifying one draft tree.

    path_node_idx: node indices of the accepted path, root first (always starts with 0).
    next_token:    the bonus or recovered token, emitted now and the root of the next tree.
    """

    path_node_idx: list[int]
    accepted_ids: list[int]
    next_token: int

    @property
    def num_accepted(self) -> int:
        """Drafted tokens accepted (root excluded)."""
        return len(self.path_node_idx) - 1

    @property
    def emitted_ids(self) -> list[int]:
        """Tokens this verification emits: accepted drafts, then the next token."""
        return [*self.accepted_ids, self.next_token]


class RandomSource(Protocol):
    """The only randomness a verifier uses; tests substitute an enumerating source."""

    def coin(self, prob: float) -> bool:
        """True with probability `prob`."""
        ...

    def draw(self, probs: torch.Tensor) -> int:
        """An index drawn from probs [V]."""
        ...


class TorchRandom:
    """RandomSource over an explicit `torch.Generator` (no global seeding)."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    def coin(self, prob: float) -> bool:
        import torch  # sampled verification only: greedy decoding runs without torch

        return float(torch.rand((), generator=self.generator, dtype=torch.float64)) < prob

    def draw(self, probs: torch.Tensor) -> int:
        import torch

        return int(torch.multinomial(probs.to(torch.float64), 1, generator=self.generator))


def _accepted_from_path(tree: DraftTree, path: list[int], next_token: int) -> Accepted:
    ids = tree.token_ids.tolist()
    return Accepted(path, [ids[i] for i in path[1:]], next_token)


def logits_array(logits: Any) -> np.ndarray:
    """A runtime's logits as a CPU numpy array: llama.cpp gives one already; a torch tensor (the
    transformers runtime, perhaps on a GPU) is copied to the CPU, half precisions as float32 (exact:
    the same order, the same first maximum)."""
    if isinstance(logits, np.ndarray):
        return logits
    import torch  # a torch tensor: torch is loaded

    logits = logits.detach().cpu()
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return logits.numpy()


def verify_greedy(tree: DraftTree, target_logits: Any) -> Accepted:
    """Longest root path whose every draft equals the target's argmax, plus the bonus token.

    target_logits: [N, V] (numpy or torch), row i = target logits after node i. Ties between
    equally deep accepted nodes go to the lowest node index.
    """
    # numpy's argmax (the first maximum, as torch's) is ~7x faster on one 49k-wide row: per token
    target_next = logits_array(target_logits).argmax(-1)  # [N]
    if tree.num_nodes == 1:  # plain decoding: the root alone (no masks to build)
        return Accepted([0], [], int(target_next[0]))
    matches = np.ones(tree.num_nodes, dtype=bool)
    matches[1:] = tree.token_ids[1:] == target_next[tree.parents[1:]]
    mask = ancestor_mask(tree.parents)  # [N, N]
    reachable = ~(mask & ~matches[None, :]).any(-1)  # every node on the path matches
    depth = mask.sum(-1) - 1
    best = int(np.where(reachable, depth, -1).argmax())
    return _accepted_from_path(tree, path_to(tree.parents, best), int(target_next[best]))


def _residual(p_target: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """normalise(max(p - q, 0)): the distribution to draw from after a rejection.  [V] -> [V]."""
    residual = (p_target - q_draft).clamp_min(0.0)
    total = residual.sum()
    # total == 0 only when p <= q everywhere, i.e. p == q, where rejection has probability 0;
    # keeping p there is a guard against rounding, not a change of distribution.
    return residual / total if total > 0 else p_target


def verify_stochastic(
    tree: DraftTree,
    p_target: torch.Tensor,
    rng: RandomSource | torch.Generator | None,
) -> Accepted:
    """Lossless stochastic verification (recursive rejection sampling, see module docstring).

    p_target: [N, V] warped target probabilities, row i = distribution after node i.
    rng: a torch.Generator (or None for torch's default) or a RandomSource.
    """
    import torch  # sampled verification only: greedy decoding runs without torch

    source = rng if hasattr(rng, "coin") else TorchRandom(rng)  # type: ignore[arg-type]
    kids = children(tree.parents)
    token_ids = tree.token_ids.tolist()
    node = 0
    while True:
        p = p_target[node]
        descended = False
        for child in kids[node]:
            token = token_ids[child]
            if tree.draft_probs is None:
                q_token = 1.0
                q = torch.nn.functional.one_hot(torch.tensor(token), p.shape[-1]).to(p.dtype)
            else:
                q = tree.draft_probs[child].to(p.dtype)
                q_token = float(q[token])
            if q_token <= 0.0:
                continue  # the drafter could not have drawn this token: ignore the node
            accept_prob = min(1.0, float(p[token]) / q_token)
            if source.coin(accept_prob):
                node = child
                descended = True
                break
            p = _residual(p, q)
        if not descended:
            return _accepted_from_path(tree, path_to(tree.parents, node), source.draw(p))
