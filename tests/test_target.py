"""Target adapter: tree-masked verification, KV commit, rollback, activation taps (float64)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_target

from moaspec.target import HFTarget
from moaspec.tree import DraftTree, path_to

PREFIX = torch.tensor([3, 14, 15, 92, 65, 35, 89])
# root -> (1, 2); 1 -> (3, 4); 3 -> 5; 2 -> 6; 6 -> 7
TREE_PARENTS = torch.tensor([-1, 0, 0, 1, 1, 3, 2, 6])
TREE_TOKENS = torch.tensor([7, 11, 12, 13, 14, 15, 16, 17])


def causal_logits(target: HFTarget, token_ids: torch.Tensor, hidden_layers: tuple[int, ...] = ()):
    """Logits (and hidden) after the last token, from a fresh causal prefill."""
    target.reset()
    out = target.prefill(token_ids, hidden_layers)
    return out.logits[-1], None if out.hidden is None else out.hidden[-1]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tree_forward_equals_causal_forward_of_each_path(family: str, attn: str) -> None:
    target = make_tiny_target(family, attn=attn)
    reference = make_tiny_target(family, attn=attn)
    layers = (0, 1, 2)
    target.prefill(PREFIX)
    tree = DraftTree(TREE_TOKENS, TREE_PARENTS)
    out = target.verify(tree, layers)
    assert out.logits.shape == (8, target.vocab_size)
    assert out.hidden.shape == (8, 3, target.hidden_size)
    for node in range(tree.num_nodes):
        path_tokens = TREE_TOKENS[path_to(TREE_PARENTS, node)]
        logits, hidden = causal_logits(reference, torch.cat([PREFIX, path_tokens]), layers)
        torch.testing.assert_close(out.logits[node], logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(out.hidden[node], hidden, rtol=0, atol=1e-10)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("path", [[0], [0, 1], [0, 1, 3, 5], [0, 2, 6, 7], [0, 1, 4]])
def test_commit_equals_feeding_accepted_tokens_one_by_one(family: str, path: list[int], attn: str) -> None:
    target = make_tiny_target(family, attn=attn)
    target.prefill(PREFIX)
    target.verify(DraftTree(TREE_TOKENS, TREE_PARENTS))
    target.commit(path)
    assert target.num_cached == PREFIX.numel() + len(path)
    assert target.cache.get_seq_length() == target.num_cached
    next_token = torch.tensor([42])
    after_commit = target.verify(DraftTree.chain(next_token)).logits[-1]

    reference = make_tiny_target(family, attn=attn)
    reference.prefill(PREFIX)
    for token in TREE_TOKENS[path]:
        reference.verify(DraftTree.chain(token.view(1)))
        reference.commit([0])
    expected = reference.verify(DraftTree.chain(next_token)).logits[-1]
    torch.testing.assert_close(after_commit, expected, rtol=0, atol=1e-10)
    for layer, ref_layer in zip(target.cache.layers, reference.cache.layers):
        torch.testing.assert_close(layer.keys, ref_layer.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(layer.values, ref_layer.values, rtol=0, atol=1e-10)


def test_rollback_restores_earlier_state(tiny_llama: HFTarget) -> None:
    tiny_llama.prefill(PREFIX)
    before = tiny_llama.verify(DraftTree.chain([1])).logits[-1]
    tiny_llama.rollback(PREFIX.numel())
    tiny_llama.prefill(torch.tensor([5, 6, 7]))
    tiny_llama.rollback(PREFIX.numel())
    again = tiny_llama.verify(DraftTree.chain([1])).logits[-1]
    torch.testing.assert_close(before, again, rtol=0, atol=1e-12)
    with pytest.raises(ValueError):
        tiny_llama.rollback(PREFIX.numel() + 5)


def test_layer_kv_layout_is_per_head_key_then_value(tiny_llama: HFTarget) -> None:
    tiny_llama.prefill(PREFIX)
    kv = tiny_llama.layer_kv(2, 5)
    n_kv, head_dim = 2, 16
    assert kv.shape == (3, tiny_llama.num_layers, 2 * n_kv * head_dim)
    for layer_idx, layer in enumerate(tiny_llama.cache.layers):
        for head in range(n_kv):
            key = kv[:, layer_idx, head * 2 * head_dim : head * 2 * head_dim + head_dim]
            value = kv[:, layer_idx, head * 2 * head_dim + head_dim : (head + 1) * 2 * head_dim]
            assert torch.equal(key, layer.keys[0, head, 2:5])
            assert torch.equal(value, layer.values[0, head, 2:5])
    with pytest.raises(ValueError):
        tiny_llama.layer_kv(0, PREFIX.numel() + 1)


def test_prefill_beyond_context_is_a_clear_error() -> None:
    from moaspec.errors import MoaspecError

    target = make_tiny_target("llama", max_position_embeddings=16)
    with pytest.raises(MoaspecError, match="context"):
        target.prefill(torch.arange(17))
