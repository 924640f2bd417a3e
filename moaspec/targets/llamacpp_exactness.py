"""Whether tree verification stays exact on this machine's llama.cpp kernels (llamacpp.py's module
docstring: a tree's logits must equal one-token decoding's bit for bit)."""

from __future__ import annotations

import torch

from moaspec.targets.base import Target
from moaspec.tree import DraftTree

EXACTNESS_CONTEXT = 300  # tokens before the check's decodes: past 256 cells, where kernels change
EXACTNESS_STEPS = 8


@torch.inference_mode()
def tree_logits_equal_steps(probe: Target) -> bool:
    """Decode EXACTNESS_STEPS tokens one at a time after EXACTNESS_CONTEXT tokens in `probe` (a
    fresh context of its own), then verify them as the path of a branching tree (wrong siblings
    before it: parked cells) and one more token after the commit, and compare every logit bit for
    bit. Kernels chosen by batch size (an AMX or ARM matrix path, say) fail it."""
    context = torch.arange(EXACTNESS_CONTEXT) % 1000 + 1000
    tokens, logits = [], []
    token = int(probe.set_context(context).logits[0].argmax())
    for _ in range(EXACTNESS_STEPS + 1):
        tokens.append(token)
        out = probe.verify(DraftTree(torch.tensor([token]), torch.tensor([-1])))
        probe.commit([0])
        logits.append(out.logits[0])
        token = int(out.logits[0].argmax())
    probe.set_context(context)
    ids, parents = [tokens[0]], [-1]
    for depth in range(1, EXACTNESS_STEPS):  # a wrong sibling first, then the true token
        ids += [(tokens[depth] + 1) % probe.vocab_size, tokens[depth]]
        parents += [len(ids) - 3 if depth > 1 else 0] * 2
    out = probe.verify(DraftTree(torch.tensor(ids), torch.tensor(parents)))
    path = [0] + [2 * depth for depth in range(1, EXACTNESS_STEPS)]
    exact = all(torch.equal(out.logits[node], logits[k]) for k, node in enumerate(path))
    probe.commit(path)
    after = probe.verify(DraftTree(torch.tensor([tokens[EXACTNESS_STEPS]]), torch.tensor([-1])))
    return exact and torch.equal(after.logits[0], logits[EXACTNESS_STEPS])
