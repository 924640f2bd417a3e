"""EAGLE-2 dynamic draft tree (Li et al. 2024, §4), shared by every model-based drafter.

Level 1: the top-k tokens after the root. Level d > 1: the k beams with the best cumulative
log-probability are expanded (one drafter call over all k beams), each proposing its top-k
children; all k*k children enter the candidate pool. Finally the `budget` best candidates of the
whole pool by cumulative log-probability become the tree. A child's cumulative score is never
above its parent's, and ties are broken by pool order (parents first), so the selection is
ancestor-closed. Sorting the chosen pool indices keeps parents before children.

The drafter supplies two callables over *draft-vocabulary* log-probabilities:
    start()                                   -> [Vd]     after the root
    expand(token_ids [k], parent [k], d)      -> [k, Vd]  for the beams at depth d (target ids);
                                                          parent = index in the previous expand
                                                          call's batch, -1 for the root
Selection is deterministic given the drafter, so the verifier treats drafts as point masses
(lossless for sampling too; see verify.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moaspec.config import TreeConfig
from moaspec.drafters.vocab import target_token_ids
from moaspec.sampling import tempered
from moaspec.tree import DraftTree


def build_dynamic_tree(
    root_id: int,
    start: Callable[[], torch.Tensor],
    expand: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    config: TreeConfig,
    draft_vocab_ids: torch.Tensor | None = None,
) -> DraftTree:
    """Build the tree; token ids are mapped from the draft vocabulary to target ids."""
    to_target = functools.partial(target_token_ids, draft_vocab_ids=draft_vocab_ids)
    log_probs = start()  # [Vd]
    k = min(config.top_k, log_probs.shape[-1])
    scores, draft_ids = torch.topk(log_probs.float(), k)
    pool_tokens = [to_target(draft_ids)]  # per level: [n_level]
    pool_parents = [torch.full((k,), 0, dtype=torch.long)]  # tree-node index of the parent (root = 0)
    pool_scores = [scores]
    beam_nodes = torch.arange(1, k + 1)  # pool node indices of the current beams (root = node 0)
    beam_scores, beam_tokens = scores, to_target(draft_ids)
    beam_parent = torch.full((k,), -1, dtype=torch.long)  # depth-1 beams hang off the root
    next_node = k + 1
    for depth in range(2, config.depth + 1):
        log_probs = expand(beam_tokens, beam_parent, depth - 1)  # [k_beams, Vd]
        child_scores, child_ids = torch.topk(log_probs.float(), k, dim=-1)  # [k_beams, k]
        cumulative = (beam_scores[:, None] + child_scores).flatten()
        tokens = to_target(child_ids.flatten())
        pool_tokens.append(tokens)
        pool_parents.append(beam_nodes[:, None].expand(-1, k).flatten())
        pool_scores.append(cumulative)
        level_nodes = torch.arange(next_node, next_node + cumulative.numel())
        next_node += cumulative.numel()
        best = torch.topk(cumulative, min(k, cumulative.numel())).indices
        beam_nodes, beam_scores, beam_tokens = level_nodes[best], cumulative[best], tokens[best]
        beam_parent = best // k  # index of each new beam's parent in the batch just expanded
    return _select(root_id, pool_tokens, pool_parents, pool_scores, config.budget)


def _select(
    root_id: int,
    pool_tokens: list[torch.Tensor],
    pool_parents: list[torch.Tensor],
    pool_scores: list[torch.Tensor],
    budget: int,
) -> DraftTree:
    tokens = torch.cat(pool_tokens)
    parents = torch.cat(pool_parents)  # pool node numbering: root = 0, candidates 1..
    scores = torch.cat(pool_scores)
    count = min(budget, scores.numel())
    # stable sort: equal scores keep pool order, so a parent precedes its equally-scored child
    order = torch.sort(-scores, stable=True).indices[:count]
    chosen = torch.sort(order).values  # candidate indices (pool node = index + 1)
    new_index = torch.full((scores.numel() + 1,), -1, dtype=torch.long)
    new_index[0] = 0
    new_index[chosen + 1] = torch.arange(1, count + 1)
    tree_parents = new_index[parents[chosen]]
    if bool((tree_parents < 0).any()):
        raise AssertionError("dynamic tree selection was not ancestor-closed")
    return DraftTree(
        torch.cat([torch.tensor([root_id]), tokens[chosen]]),
        torch.cat([torch.tensor([-1]), tree_parents]),
    )


def build_sampled_tree(
    root_id: int,
    start: Callable[[], torch.Tensor],
    expand: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    config: TreeConfig,
    vocab_size: int,
    temperature: float,
    generator: torch.Generator,
    draft_vocab_ids: torch.Tensor | None = None,
) -> DraftTree:
    """A fixed-shape tree drawn from the drafter, with the probabilities the verifier needs.

    top_k first tokens are drawn without replacement from q(. | root); under each, a chain of
    depth - 1 further tokens, each drawn from q(. | its path). The shape does not depend on the
    drawn values (a value-dependent rerank would bias the draws and break losslessness), and
    `draft_probs[i]` is exactly the distribution node i was drawn from: q for a chain node, q with
    the earlier siblings removed and renormalised for the k-th first-level node. Rows are over
    the target vocabulary (zero outside a reduced draft vocabulary).
    """
    to_target = functools.partial(target_token_ids, draft_vocab_ids=draft_vocab_ids)

    def full_rows(draft_probs: torch.Tensor) -> torch.Tensor:  # [n, Vd] -> [n, V]
        if draft_vocab_ids is None:
            return draft_probs
        return torch.zeros(draft_probs.shape[0], vocab_size, dtype=draft_probs.dtype).index_copy_(1, draft_vocab_ids, draft_probs)

    q_root = torch.softmax(tempered(start().double(), temperature), dim=-1)  # [Vd]
    k = min(config.top_k, int((q_root > 0).sum()))
    remaining, firsts, rows = q_root.clone(), [], []
    for _ in range(k):  # sequential draws without replacement, recording each conditional law
        rows.append(remaining / remaining.sum())
        firsts.append(int(torch.multinomial(rows[-1], 1, generator=generator)))
        remaining[firsts[-1]] = 0.0
    level_ids = torch.tensor(firsts)
    token_ids, parents, prob_rows = [to_target(level_ids)], [torch.zeros(k, dtype=torch.long)], [full_rows(torch.stack(rows))]
    parent = torch.full((k,), -1, dtype=torch.long)
    for depth in range(2, config.depth + 1):
        q = torch.softmax(tempered(expand(to_target(level_ids), parent, depth - 1).double(), temperature), dim=-1)  # [k, Vd]
        level_ids = torch.multinomial(q, 1, generator=generator).flatten()
        parents.append(torch.arange(1 + (depth - 2) * k, 1 + (depth - 1) * k))
        token_ids.append(to_target(level_ids))
        prob_rows.append(full_rows(q))
        parent = torch.arange(k)
    probs = torch.cat([torch.zeros(1, prob_rows[0].shape[1], dtype=torch.float64), *prob_rows])
    return DraftTree(torch.cat([torch.tensor([root_id]), *token_ids]), torch.cat([torch.tensor([-1]), *parents]), probs)
