"""The llama.cpp runtime's sequence bookkeeping (moaspec/targets/llamacpp.py, llamacpp_contexts.py)
on the real SmolLM2-135M GGUF, where test_llamacpp.py's random trees do not reach: a path whose
last accepted node has rejected children, a kept leaf sequence followed by a rollback, an
uncommitted tree followed by another, a tree that needs exactly one cell more than the cache has
free, the exactness check's two other conditions, and a next turn asking for final hidden states
past the rows held. Each test was written against a hand mutation of the runtime that every other
llama.cpp test let through (a mutation audit); the logits are compared bit for bit with one-token
decoding (test_llamacpp.py's module docstring).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from llamacpp_helpers import one_token, plain_decode, require_exact_trees

from moaspec.errors import MoaspecError
from moaspec.targets.llamacpp import MAX_LEAVES, MAX_TREE_NODES, LlamaCppTarget
from moaspec.targets.llamacpp_exactness import EXACTNESS_STEPS
from moaspec.tree import DraftTree, leaf_groups
from moaspec.verify import verify_greedy


def verify_and_commit(target, tree: DraftTree, path: list[int], expected: list[torch.Tensor]) -> None:
    """Verify `tree`, check that greedy verification accepts `path` and that its nodes' logits are
    `expected` (one-token decoding's) bit for bit, and commit it."""
    out = target.verify(tree)
    accepted = verify_greedy(tree, out.logits)
    assert accepted.path_node_idx == path
    for node, want in zip(path, expected):
        assert np.array_equal(out.logits[node], want), node
    target.commit(path)


def test_rejected_children_kept_leaf_sequences_and_uncommitted_trees_leave_no_cell_behind(
    llama_target, category_prompts
) -> None:
    """A drafter's usual miss: the target rejects every child of the last accepted node, whose
    first sequence (the one commit keeps) runs on through them. Commit must trim that sequence
    right after the path (a rejected child left in sequence 0 shares the next root's position),
    free rather than park the rejected nodes after the path in batch order, and drop the kept
    sequence once copied into sequence 0 (a rollback then leaves the forgotten token's cell in it,
    which the next tree's nodes in that sequence attend). An uncommitted tree's leaf sequences go
    with it likewise. Every accepted node's logits stay one-token decoding's."""
    require_exact_trees(llama_target)
    target = llama_target
    vocab = target.vocab_size
    prompt = category_prompts["math"][:100]
    n = len(prompt)
    tokens, logits = plain_decode(target, prompt, 8)  # logits[k + 1] follow tokens[k]
    target.reset()
    target.prefill(torch.tensor(prompt))

    def wrong(k: int, shift: int) -> int:
        return (tokens[k] + shift) % vocab

    # root, a wrong leaf (sequence 0: parked), tokens[1] whose wrong children hold sequences 1 and 2
    first = DraftTree(
        torch.tensor([tokens[0], wrong(1, 1), tokens[1], wrong(2, 1), wrong(3, 1), wrong(2, 2)]),
        torch.tensor([-1, 0, 0, 2, 3, 2]),
    )
    assert leaf_groups(first.parents)[2] == [1, 2]  # the path's last node keeps sequence 1, not 0
    verify_and_commit(target, first, [0, 2], logits[1:3])
    assert target.num_cached == n + 2 and target._parked == 1  # the wrong leaf before it parked, the rest freed
    verify_and_commit(target, one_token(tokens[2]), [0], logits[3:4])  # at the rejected children's position
    target.rollback(n + 1)  # forget tokens[1] and tokens[2]
    # tokens[2]'s node holds sequence 1 (its wrong sibling sequence 0)
    second = DraftTree(
        torch.tensor([tokens[1], wrong(2, 3), tokens[2], tokens[3]]), torch.tensor([-1, 0, 0, 2])
    )
    assert leaf_groups(second.parents)[2] == [1]
    verify_and_commit(target, second, [0, 2, 3], logits[2:5])
    assert target.num_cached == n + 4
    target.verify(DraftTree(torch.tensor([tokens[4], wrong(5, 1), tokens[5], wrong(5, 2)]), torch.tensor([-1, 0, 0, 0])))
    third = DraftTree(torch.tensor([tokens[4], wrong(5, 3), tokens[5]]), torch.tensor([-1, 0, 0]))  # the last uncommitted
    verify_and_commit(target, third, [0, 2], logits[5:7])
    assert np.array_equal(target.verify(one_token(tokens[6])).logits[0], logits[7])


def test_a_tree_one_cell_short_of_room_reclaims_the_parked_cells_first(llama_target, category_prompts) -> None:
    """At the context's end, with parked cells: a tree needing exactly one cell more than the
    cache has free makes room by reclaiming them (cells: verified + parked + nodes against the
    context's size, no off-by-one), leaves none counted as parked, and its logits are one-token
    decoding's; a tree one position deeper than the context holds is refused before any decode."""
    require_exact_trees(llama_target)
    cells = 384  # + TREE_HEADROOM = 512 cells, what llama.cpp allocates
    target = LlamaCppTarget(
        llama_target.weights, llama_target.tokenizer, llama_target.config, llama_target.name, cells=cells, threads=2,
    )
    assert target.lib.llama_n_ctx(target.ctx) == cells + MAX_TREE_NODES == 512
    text = [t for name in sorted(category_prompts) for t in category_prompts[name]]
    prompt = text[: cells - 14]
    tokens, logits = plain_decode(target, prompt, 15)
    target.reset()
    target.prefill(torch.tensor(prompt))
    for done in range(0, 10, 2):  # five trees, each with a wrong sibling before the true token: five parked cells
        tree = DraftTree(torch.tensor([tokens[done], 7, tokens[done + 1]]), torch.tensor([-1, 0, 0]))
        verify_and_commit(target, tree, [0, 2], [logits[done + 1], logits[done + 2]])
    assert target.num_cached == cells - 4 and target._parked == 5
    with pytest.raises(MoaspecError, match="does not fit"):  # its deepest node would be at position `cells`
        target.verify(DraftTree.chain(tokens[10:15]))
    # 128 nodes, 62 leaves, depth 3: the true chain tokens[11..13], then 2 wrong branches of 3 nodes and 59 of 2
    ids, parents = [tokens[10], tokens[11], tokens[12], tokens[13]], [-1, 0, 1, 2]
    for branch in range(61):
        length = 3 if branch < 2 else 2
        first_id = 100 + branch + (100 + branch >= tokens[11])  # never tokens[11]
        ids += [first_id] + [5] * (length - 1)
        parents += [0] + list(range(len(ids) - length, len(ids) - 1))
    tree = DraftTree(torch.tensor(ids), torch.tensor(parents))
    assert tree.num_nodes == MAX_TREE_NODES and len(leaf_groups(tree.parents)[0]) == MAX_LEAVES
    assert target.num_cached + target._parked + tree.num_nodes == target.lib.llama_n_ctx(target.ctx) + 1
    out = target.verify(tree)
    assert target.compactions == 1 and target._parked == 0
    for k, node in enumerate([0, 1, 2, 3]):
        assert np.array_equal(out.logits[node], logits[11 + k]), k
    target.commit([0, 1, 2, 3])
    assert target.num_cached == cells


@pytest.mark.parametrize("rounds_otherwise", ["a kept start", "the decode after a commit"])
def test_the_exactness_check_finds_kernels_that_round_otherwise_outside_the_tree(
    llama_target, monkeypatch, rounds_otherwise: str
) -> None:
    """exact_tree_nodes_here must not grant full trees where a tree's own logits are exact but
    (a) a prompt decoded after the start set_context keeps differs from a fresh prefill (a chat's
    next turn would then change its tokens), or (b) the token decoded after a committed path
    differs from one-token decoding's (cells left out of position order, say): (a) leaves the
    chains, which never keep a start, (b) leaves none."""
    from moaspec.targets import llamacpp

    require_exact_trees(llama_target)
    set_context, commit, verify = LlamaCppTarget.set_context, LlamaCppTarget.commit, LlamaCppTarget.verify
    committed = {}

    def nudged(logits: np.ndarray) -> None:
        logits[:, 0] = np.nextafter(logits[:, 0], np.float32(1e9))

    def kept_start(self, input_ids, hidden_layers=()):
        held = self.num_cached
        out = set_context(self, input_ids, hidden_layers)
        if held:
            nudged(out.logits)
        return out

    def recorded_commit(self, path_node_idx):
        committed[id(self)] = len(path_node_idx)
        commit(self, path_node_idx)

    def after_a_path(self, tree, hidden_layers=()):
        out = verify(self, tree, hidden_layers)
        if committed.pop(id(self), 0) > 1:
            nudged(out.logits)
        return out

    if rounds_otherwise == "a kept start":
        monkeypatch.setattr(LlamaCppTarget, "set_context", kept_start)
        expected = EXACTNESS_STEPS  # every chain is exact
    else:
        monkeypatch.setattr(LlamaCppTarget, "commit", recorded_commit)
        monkeypatch.setattr(LlamaCppTarget, "verify", after_a_path)
        expected = 1
    assert llamacpp.exact_tree_nodes_here(llama_target) == expected


def test_a_long_prompt_after_a_rollback_into_its_moved_cells_keeps_no_rows_of_other_tokens(
    llama_target, category_prompts
) -> None:
    """The prompt context still holds the last long prompt's whole chunks after a rollback into
    its moved cells, but the verified rows past the rollback (captured keys/values, final hidden
    states) then belong to the tokens decoded after it. A long prompt sharing the old one beyond
    the rollback may reuse the prompt context's cells only up to the rollback (the moved count
    bounds it), so what drafters read equals a fresh context's, as its logits do."""
    warm, fresh = llama_target.new_session(), llama_target.new_session()
    for target in (warm, fresh):
        target.keep_layer_kv([29])
        target.keep_final_hidden()
    text = [t for name in sorted(category_prompts) for t in category_prompts[name]]
    first = text[:700]
    warm.set_context(torch.tensor(first))
    assert warm._moved == len(first)  # through the prompt context
    warm.rollback(300)
    warm.prefill(torch.tensor(first[:250][::-1]))  # other tokens at positions 300..549
    follow_up = first[:600] + [11, 12, 13]
    got, want = warm.set_context(torch.tensor(follow_up)), fresh.set_context(torch.tensor(follow_up))
    assert np.array_equal(got.logits, want.logits)
    n = len(follow_up)
    assert torch.equal(warm.layer_kv(0, n), fresh.layer_kv(0, n))
    assert torch.equal(warm.verified_hidden(0, n), fresh.verified_hidden(0, n))


def test_a_long_prompt_past_the_first_allocation_grows_the_context_before_its_cells_move_in(
    llama_target, category_prompts, monkeypatch
) -> None:
    """A fresh session's context is allocated SESSION_CELLS_MIN positions (+ TREE_HEADROOM, as
    llama.cpp rounds it up); a long first prompt prefilled in the prompt context has more cells
    than that, so the verified context grows before they move in (else llama.cpp refuses them),
    and decoding after it equals a context made large at once."""
    import moaspec.targets.llamacpp_contexts as llamacpp_contexts

    text = [t for name in sorted(category_prompts) for t in category_prompts[name]]
    prompt = text[:600]
    large = llama_target.new_session()
    want = large.set_context(torch.tensor(prompt)).logits
    monkeypatch.setattr(llamacpp_contexts, "SESSION_CELLS_MIN", 256)
    target = llama_target.new_session()
    assert target.lib.llama_n_ctx(target.ctx) == 512 < len(prompt)
    assert np.array_equal(target.set_context(torch.tensor(prompt)).logits, want)
    assert target._moved == len(prompt) and target._allocated == 1024
    token = int(want.argmax())
    assert np.array_equal(target.verify(one_token(token)).logits, large.verify(one_token(token)).logits)


def test_hidden_states_asked_for_past_the_rows_held_come_from_a_kept_start_no_later_than_they_end(
    llama_target, category_prompts
) -> None:
    """The start set_context keeps is bounded by the final hidden states held, not only by the
    tokens: a prompt decoded with them, its answer appended without (rows 0..n-1 held of n + 2
    tokens), then a next turn that asks for them. Kept up to the shared n + 2 tokens, the rows of
    the new tokens would land past a gap and be dropped, and the turn's hidden states refused;
    from n they are all there, equal to a fresh context's, as are the logits."""
    warm, fresh = llama_target.new_session(), llama_target.new_session()
    last = (warm.num_layers,)
    prompt = category_prompts["qa"][:80]
    n = len(prompt)
    warm.set_context(torch.tensor(prompt), last)
    warm.prefill(torch.tensor([11, 12]))  # appended without hidden states
    assert warm.num_cached == n + 2 and warm._hidden.valid == n
    follow_up = prompt + [11, 12, 13, 14]
    got, want = warm.set_context(torch.tensor(follow_up), last), fresh.set_context(torch.tensor(follow_up), last)
    assert np.array_equal(got.logits, want.logits)
    assert torch.equal(got.hidden, want.hidden)
