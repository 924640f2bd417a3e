"""Helpers of the llama.cpp runtime's tests on the real GGUF (test_llamacpp.py,
test_llamacpp_float_prefill.py): plain decoding, random trees around the true continuation, and
the skip where the CPU's kernels keep no tree exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from moaspec.errors import MoaspecError
from moaspec.targets.llamacpp import MAX_TREE_NODES
from moaspec.tree import DraftTree
from moaspec.verify import verify_greedy


def require_exact_trees(target) -> None:
    """On a CPU whose llama.cpp kernels are not batch-invariant, the runtime must refuse branching
    trees (checked here) and the tree tests have nothing else to check; everywhere else they run."""
    if target.exact_tree_nodes >= MAX_TREE_NODES:
        return
    refusal = {1: "bit for bit", 2: "a tree of 3 nodes exceeds the 2"}.get(target.exact_tree_nodes, "2 leaves exceeds the 1")
    with pytest.raises(MoaspecError, match=refusal):
        target.verify(DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0])))
    pytest.skip("llama.cpp's kernels round differently by batch size on this CPU: branching trees are refused (checked)")


def one_token(token: int) -> DraftTree:
    return DraftTree(torch.tensor([token]), torch.tensor([-1]))


def plain_decode(target, prompt: list[int], count: int) -> tuple[list[int], list[torch.Tensor]]:
    """One-token greedy decoding: tokens and the logits after each (the first from the prefill)."""
    target.reset()
    logits = [target.prefill(torch.tensor(prompt)).logits[0]]
    tokens = [int(logits[0].argmax())]
    while len(tokens) < count:
        out = target.verify(one_token(tokens[-1]))
        target.commit([0])
        logits.append(out.logits[0])
        tokens.append(int(out.logits[0].argmax()))
    return tokens, logits


def oracle_tree(generator: random.Random, root: int, truth: list[int], vocab: int, decoys: int = 0) -> DraftTree:
    """A random tree around the true continuation: at each depth the true token among 1-3
    siblings (in random order, wrong ones with random subtrees), stopping at a random depth;
    `decoys` wrong children of the root come first in batch order (their cells are parked)."""
    ids, parents, node = [root, *(generator.randrange(vocab) for _ in range(decoys))], [-1] + [0] * decoys, 0
    for true_id in truth:
        siblings = [(true_id, True)] + [(generator.randrange(vocab), False) for _ in range(generator.randrange(3))]
        generator.shuffle(siblings)
        next_node = None
        for token, correct in siblings:
            ids.append(token)
            parents.append(node)
            if correct:
                next_node = len(ids) - 1
            elif generator.random() < 0.4:
                ids.append(generator.randrange(vocab))
                parents.append(len(ids) - 2)
        if generator.random() < 0.25:
            break
        node = next_node
    return DraftTree(torch.tensor(ids), torch.tensor(parents))


def check_oracle_trees(target, tokens: list[int], logits: list[torch.Tensor], decoys: int = 0, steps: int = 32) -> None:
    """Verify random trees around plain decoding's `tokens` after the prompt `target` holds
    (plain_decode's tokens and logits): every accepted node's logits equal one-token decoding's
    bit for bit."""
    generator, done = random.Random(8), 0
    while done < steps:
        tree = oracle_tree(generator, tokens[done], tokens[done + 1 : done + 5], target.vocab_size, decoys=decoys)
        out = target.verify(tree)
        accepted = verify_greedy(tree, out.logits)
        for k, node in enumerate(accepted.path_node_idx):
            assert np.array_equal(out.logits[node], logits[done + k + 1]), (done, k)
        target.commit(accepted.path_node_idx)
        done += accepted.num_accepted + 1
