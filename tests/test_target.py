"""Target adapter: tree-masked verification, KV commit, rollback, activation taps (float64)."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_tiny_target

from moaspec.targets.hf import HFTarget, cache_keyword
from moaspec.tree import DraftTree, path_to

PREFIX = torch.tensor([3, 14, 15, 92, 65, 35, 89])
# root -> (1, 2); 1 -> (3, 4); 3 -> 5; 2 -> 6; 6 -> 7
TREE_PARENTS = torch.tensor([-1, 0, 0, 1, 1, 3, 2, 6])
TREE_TOKENS = torch.tensor([7, 11, 12, 13, 14, 15, 16, 17])

# sdpa runs the float64 model in float64 throughout (transformers' RMSNorm and RoPE round to
# float32, but per row, so identical rows stay identical): a tree forward and the causal forward
# of its path differ by ~1e-14 (summation order only), on any CPU.
FLOAT64_ATOL = 1e-10
# transformers' eager attention takes its softmax in float32
# (`softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)`), so on that path a float64
# model is only float32-accurate, and how accurate depends on the CPU: the sum over a row of
# n <= 15 keys is rounded in an order set by the row length (tree vs causal) and the vector width
# (ATen's avx512 kernel sums it in one 16-lane vector, avx2 in 8-lane pieces, default scalar).
# Two such orders give one attention weight relative errors differing by up to (n - 1) eps32,
# plus ~3 eps32 from exp, the division and the cast: ~17 eps32. Perturbing every weight
# independently by a relative +-eps32 moves logits and hidden states by at most 1.3 eps32 x their
# max |value| (20 random trials per family). So 17 x 1.3 ~ 22 eps32, rounded up to 32 eps32 of
# the max |value| (~4e-5 on these logits). Observed: <= 0.93 eps32 with ATen's avx2 and default
# kernels, ~1e-9 eps32 with avx512. A wrong tree mask moves logits by ~1e4 times the tolerance
# (test_eager_tolerance_still_catches_a_wrong_tree_mask).
EAGER_TOLERANCE = 32 * torch.finfo(torch.float32).eps


def assert_same_forward(actual: torch.Tensor, expected: torch.Tensor, attn: str) -> None:
    """actual == expected up to the attention implementation's precision (see the constants above)."""
    atol = FLOAT64_ATOL if attn == "sdpa" else EAGER_TOLERANCE * float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


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
        assert_same_forward(out.logits[node], logits, attn)
        assert_same_forward(out.hidden[node], hidden, attn)


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
    assert_same_forward(after_commit, expected, attn)
    for layer, ref_layer in zip(target.cache.layers, reference.cache.layers):
        assert_same_forward(layer.keys, ref_layer.keys, attn)
        assert_same_forward(layer.values, ref_layer.values, attn)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eager_tolerance_still_catches_a_wrong_tree_mask(family: str) -> None:
    """Power check of EAGER_TOLERANCE: hang the last node under the wrong parent (5, not 6) and
    its logits miss the causal forward of its true path by over 1000x the tolerance."""
    target = make_tiny_target(family, attn="eager")
    target.prefill(PREFIX)
    wrong_parents = TREE_PARENTS.clone()
    wrong_parents[7] = 5
    logits = target.verify(DraftTree(TREE_TOKENS, wrong_parents)).logits[7]
    expected, _ = causal_logits(make_tiny_target(family, attn="eager"), torch.cat([PREFIX, TREE_TOKENS[[0, 2, 6, 7]]]))
    tolerance = EAGER_TOLERANCE * float(expected.abs().max())
    assert float((logits - expected).abs().max()) > 1000 * tolerance


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
    last = tiny_llama.num_layers - 1
    assert torch.equal(tiny_llama.layer_kv(2, 5, [last, 0]), kv[:, [last, 0]])  # chosen layers, in that order
    with pytest.raises(ValueError):
        tiny_llama.layer_kv(0, PREFIX.numel() + 1)


def test_prefill_beyond_context_is_a_clear_error() -> None:
    from moaspec.errors import MoaspecError

    target = make_tiny_target("llama", max_position_embeddings=16)
    with pytest.raises(MoaspecError, match="the prompt has 17 tokens but the target's context holds 16"):
        target.prefill(torch.arange(17))
    target.prefill(torch.arange(10))  # a later turn after a verified context counts both
    with pytest.raises(MoaspecError, match="7 more tokens after the 10 verified make 17, but the target's context holds 16"):
        target.prefill(torch.arange(7))
    assert target.num_cached == 10


def test_the_cache_goes_by_the_name_this_transformers_takes() -> None:
    class EarlierModel(torch.nn.Module):  # transformers 5.x before `cache` replaced `past_key_values`
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return None

    assert cache_keyword(EarlierModel()) == "past_key_values"
    target = make_tiny_target("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the installed release's deprecations included
        target.prefill(torch.tensor([1, 2, 3]))
        target.verify(DraftTree(torch.tensor([4, 5]), torch.tensor([-1, 0])))


def test_a_cancelled_prefill_stops_between_layers_and_resets(tiny_llama: HFTarget) -> None:
    """Target.cancellable on transformers: the event set while layer 0 runs stops the forward
    before layer 1 (PrefillCancelled), the half-written cache is reset, and the next prefill gives
    the logits of an uncancelled one."""
    import threading

    from moaspec.targets.base import PrefillCancelled

    expected = tiny_llama.set_context(PREFIX).logits
    cancel = threading.Event()
    ran = []
    hook = tiny_llama.decoder_layers[0].register_forward_pre_hook(lambda module, args: ran.append(0) or cancel.set())
    try:
        with tiny_llama.cancellable(cancel), pytest.raises(PrefillCancelled):
            tiny_llama.set_context(PREFIX)
    finally:
        hook.remove()
    assert ran == [0] and tiny_llama.num_cached == 0 and tiny_llama.cache.get_seq_length() == 0
    assert torch.equal(tiny_llama.set_context(PREFIX).logits, expected)
    assert all(not layer._forward_pre_hooks for layer in tiny_llama.decoder_layers)  # the hooks are gone
