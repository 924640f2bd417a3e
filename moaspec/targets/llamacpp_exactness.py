"""How large a verified tree stays exact on this machine's llama.cpp kernels (llamacpp.py's module
docstring: a tree's logits must equal one-token decoding's bit for bit)."""

from __future__ import annotations

import torch

from moaspec.targets.base import Target
from moaspec.tree import DraftTree

EXACTNESS_CONTEXT = 300  # tokens before the check's decodes: past 256 cells, where kernels change
EXACTNESS_STEPS = 8
# the branching trees checked: (wrong branches per depth, their length) -> 15, 64 and 120 nodes
# (the last with 57 leaves: llama.cpp's sequences bound a tree's leaves to 62)
DECOYS = ((1, 1), (8, 1), (8, 2))


@torch.inference_mode()
def exact_tree_nodes(probe: Target, max_nodes: int) -> int:
    """The most nodes a tree verified in `probe` (a fresh context of its own) may have and still
    give one-token decoding's logits bit for bit: `max_nodes` where branching trees of 15, 64
    and 120 nodes are exact and a prompt's start kept by `set_context` gives a fresh prefill's logits
    (kernels that do not change with the batch size), else the longest chain k such that chains
    of 2..k tokens all are (up to EXACTNESS_STEPS; 1: none). Every tree is verified after a fresh
    prefill, as a generation's are. Kernels chosen by batch size fail a tree or the kept start:
    llama.cpp's repacked K-quant products from 4 rows on (AVX-512 EPYC), K-quant mixes whose
    300-row prompt batch rounds otherwise than one row, an AMX or ARM matrix path, say."""
    context = torch.arange(EXACTNESS_CONTEXT) % 1000 + 1000
    first, tokens, logits = _one_token_decoding(probe, context)
    kept_start_exact = torch.equal(probe.set_context(context).logits[0], first)  # holding context + steps
    trees_exact = all(_branching_tree_exact(probe, context, tokens, logits, *decoys) for decoys in DECOYS)
    if kept_start_exact and trees_exact:
        return max_nodes
    for length in range(2, EXACTNESS_STEPS + 1):
        if not _chain_exact(probe, context, tokens, logits, length):
            return length - 1
    return EXACTNESS_STEPS


def _one_token_decoding(
    probe: Target, context: torch.Tensor
) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """The prefill's logits after `context`, then EXACTNESS_STEPS + 1 greedy tokens decoded one
    at a time, and their logits (logits[k]: after tokens[k])."""
    tokens, logits = [], []
    first = probe.set_context(context).logits[0]
    token = int(first.argmax())
    for _ in range(EXACTNESS_STEPS + 1):
        tokens.append(token)
        out = probe.verify(DraftTree.root_only(token))
        probe.commit([0])
        logits.append(out.logits[0])
        token = int(out.logits[0].argmax())
    return first, tokens, logits


def _fresh_prefill(probe: Target, context: torch.Tensor) -> None:
    """`context` prefilled in an emptied context, as a generation's prompt is the first time."""
    probe.reset()
    probe.set_context(context)


def _branching_tree_exact(
    probe: Target, context: torch.Tensor, tokens: list[int], logits: list[torch.Tensor], decoys: int, length: int
) -> bool:
    """The steps verified as the path of a branching tree (`decoys` wrong branches of `length`
    nodes before each true token: parked cells), then one more token after the commit, equal to
    one-token decoding."""
    _fresh_prefill(probe, context)
    ids, parents, path = [tokens[0]], [-1], [0]
    for depth in range(1, EXACTNESS_STEPS):  # the wrong branches first, then the true token
        for k in range(1, decoys + 1):
            wrong = (tokens[depth] + k) % probe.vocab_size
            ids += [wrong] * length
            parents += [path[-1]] + list(range(len(ids) - length, len(ids) - 1))
        ids.append(tokens[depth])
        parents.append(path[-1])
        path.append(len(ids) - 1)
    return _verified_as_decoded(probe, DraftTree(torch.tensor(ids), torch.tensor(parents)), path, tokens, logits)


def _chain_exact(
    probe: Target, context: torch.Tensor, tokens: list[int], logits: list[torch.Tensor], length: int
) -> bool:
    """The first `length` steps verified as one chain, then one more token after the commit."""
    _fresh_prefill(probe, context)
    chain = DraftTree.chain(tokens[:length])
    return _verified_as_decoded(probe, chain, list(range(length)), tokens, logits)


def _verified_as_decoded(
    probe: Target, tree: DraftTree, path: list[int], tokens: list[int], logits: list[torch.Tensor]
) -> bool:
    """Verify `tree`, commit `path` (one-token decoding's first tokens), verify the next token:
    every logit on the path and after it equal to one-token decoding's."""
    out = probe.verify(tree)
    exact = all(torch.equal(out.logits[node], logits[k]) for k, node in enumerate(path))
    probe.commit(path)
    after = probe.verify(DraftTree.root_only(tokens[len(path)]))
    return exact and torch.equal(after.logits[0], logits[len(path)])
