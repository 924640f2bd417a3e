"""What a hand-mutation audit of the model drafters pinned (drafters/{moa,eagle,tree_drafter,vocab,
background}.py, nn/{layers,moa,eagle}.py).

The training-equals-inference tests (test_moa.py, test_eagle.py) cannot see a change to the network
that both paths share, and they draft MoA along chains only. These tests pin:
- the network against independent definitions: the decoder layer against transformers' own Llama
  layer, MoA's memory and cross-attention and EAGLE's pair input against the papers' formulas (the
  shipped checkpoints were trained with them: a change would lower their acceptance silently);
- MoA's inference paths the chain tests miss: tree nodes (SA and TLI masks) see only their own
  path, a second proposal in a row forgets the first, a token drafted alone becomes context as a
  drafted node is, a memory narrower than TLI reads its own layers, and TLI's rows at anchors are
  the target's own state;
- drafting alone with a reduced vocabulary and when sampled; the draft vocabulary's selection;
  the background drafter's reads and reset.
Tiny random targets, float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_random_drafter_net, make_tiny_target
from drafter_checks import check_beams_against_their_paths, favour_row

from moaspec.config import SamplingConfig, TreeConfig
from moaspec.drafters.base import VerifiedUpdate
from moaspec.drafters.eagle import EagleDrafter
from moaspec.drafters.moa import MoAContextEncoder, MoADrafter
from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
from moaspec.nn.layers import DecoderLayer, additive_mask, apply_rope, rope_cos_sin
from moaspec.nn.moa import H2M_SCALE, MoAConfig, MoADrafterNet
from moaspec.nn.target_config import target_norm_eps, target_rope_theta

PROMPT = torch.tensor([4, 8, 15, 16, 23, 42])
ROOT = 7


def random_moa(target, tli: int = 0, draft_vocab: torch.Tensor | None = None, **settings) -> MoADrafterNet:
    size = 0 if draft_vocab is None else draft_vocab.numel()
    config = MoAConfig.for_target(target.config, tli_layers=tli, draft_vocab_size=size, **settings)
    return make_random_drafter_net(MoADrafterNet, config, target, draft_vocab)


def moa_after_prompt(net: MoADrafterNet, target) -> MoADrafter:
    """A MoA drafter that has accepted PROMPT (the target prefilled with it)."""
    drafter = MoADrafter(net, target)
    drafter.accept(VerifiedUpdate(PROMPT, 0, None, target))
    return drafter


def eagle_after_prompt(net: EagleDrafterNet, target, hidden: torch.Tensor) -> EagleDrafter:
    drafter = EagleDrafter(net, target)
    drafter.accept(VerifiedUpdate(PROMPT, 0, hidden, target))
    return drafter


def unit_spread(weight: torch.Tensor, seed: int) -> None:
    """Norm weights ~ N(1, 0.5): distinct per norm, so a norm read in place of another shows."""
    generator = torch.Generator().manual_seed(seed)
    weight.copy_(1.0 + 0.5 * torch.randn(weight.shape, generator=generator, dtype=weight.dtype))


# -- the shared network against independent definitions -----------------------------------------


@torch.no_grad()
def test_the_decoder_layer_computes_transformers_llama_layer() -> None:
    """Kills L1 (RMSNorm without eps), L2 (RMSNorm without its weight), L3 (RoPE frequencies over
    head_dim / 2), L9 (no attention residual), L10 (the MLP reads the attention's norm), L11 (SwiGLU
    gate and up swapped), L12 (keys not rotated). MoA's SA and LSA and EAGLE's layer are this
    class; training and inference share it, so their equality tests pass whatever it computes,
    while a checkpoint trained with the Llama layer (the shipped ones) would draft worse. The input
    is small so that eps matters (4e-4 of the mean square); the norms' weights differ from 1 and
    from each other. transformers rounds its RMSNorm and RoPE to float32 (test_target.py), so the
    float64 layers agree to float32 accuracy: outputs of at most 0.2 differ by 5e-9 here (a few
    float32 ulps of 0.2 bound it by ~1e-7, on any CPU), the mildest mutant (no eps) by 2.5e-5."""
    target = make_tiny_target("llama", attn="sdpa")
    theirs = target.model.model.layers[0]
    unit_spread(theirs.input_layernorm.weight, 1)
    unit_spread(theirs.post_attention_layernorm.weight, 2)
    config = target.config
    ours = DecoderLayer(64, 4, 2, 16, 128, target_norm_eps(config), target_rope_theta(config)).double()
    ours.load_state_dict(theirs.state_dict())  # strict: the same parameter names
    x = 0.05 * torch.randn(7, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    positions = torch.arange(5, 12)
    mask = additive_mask(positions[None, :] <= positions[:, None], torch.float64)
    out, _ = ours(x, positions, mask)
    cos, sin = target.model.model.rotary_emb(x[None], positions[None])
    expected = theirs(
        x[None], attention_mask=mask[None, None], position_ids=positions[None], position_embeddings=(cos, sin)
    )
    expected = (expected[0] if isinstance(expected, tuple) else expected)[0]
    assert float((out - x).norm()) > 0.1 * float(x.norm())  # the layer does change its input
    assert float(out.abs().max()) < 0.25
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)


@torch.no_grad()
def test_moa_memory_and_cross_attention_are_the_papers_formulas() -> None:
    """Kills M2 (the memory sums the layers instead of the mean), M3 (the hidden-state map without
    H2M_SCALE), M4 (memory keys/values without the CA norm), M6 (the CA's MLP reads the CA norm, not
    its post-norm), M7 (CA queries without the CA norm): memory = Ekv2E(mean_l LSA(kv)) +
    H2M_SCALE * H2M(h); c = h + CA(norm(h) -> norm(memory)) with ALiBi, c += MLP(post_norm(c)).
    All shared by training and inference, so only a checkpoint (e.g. an old one without the layer
    mix, the config's default) would show the drop in acceptance."""
    target = make_tiny_target("llama", num_hidden_layers=3)
    net = random_moa(target, layer_mix=False, memory_hidden=True)
    unit_spread(net.ca_norm.weight, 1)
    unit_spread(net.ca_post_norm.weight, 2)
    net.h2m.weight.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(4))
    generator = torch.Generator().manual_seed(5)
    c = net.config
    layer_kv = torch.randn(5, 3, c.kv_dim, generator=generator, dtype=torch.float64)
    hidden = torch.randn(5, c.hidden_size, generator=generator, dtype=torch.float64)
    mixed, _ = net.layer_self_attention(layer_kv, torch.arange(3), None)  # [5, L, kv_dim]
    memory = net.ekv2e(mixed.mean(dim=1)) + H2M_SCALE * net.h2m(hidden)
    torch.testing.assert_close(net.memory(layer_kv, hidden), memory, rtol=0, atol=1e-12)

    h = torch.randn(3, c.hidden_size, generator=generator, dtype=torch.float64)
    positions, memory_positions = torch.tensor([5, 6, 6]), torch.arange(5)  # drafted after memory 0..4
    c_inference = net.cross_attend(h, positions, net.memory_keys_values(memory, memory_positions), None)
    attn, groups = net.cross_attention, c.num_heads // c.num_kv_heads

    def heads(states: torch.Tensor, count: int, at: torch.Tensor | None) -> torch.Tensor:  # [n, H*d] -> [H, n, d]
        split = states.unflatten(-1, (count, c.head_dim)).transpose(0, 1)
        return split if at is None else apply_rope(split, *rope_cos_sin(at, c.head_dim, c.rope_theta, torch.float64))

    normed_memory = net.ca_norm(memory)
    q = heads(attn.q_proj(net.ca_norm(h)), c.num_heads, positions)
    k = heads(attn.k_proj(normed_memory), c.num_kv_heads, memory_positions).repeat_interleave(groups, 0)
    v = heads(attn.v_proj(normed_memory), c.num_kv_heads, None).repeat_interleave(groups, 0)
    alibi = -net.ca_recency_slopes[:, None, None] * (positions[:, None] - memory_positions[None, :])
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=alibi)  # [H, 3, d]
    by_hand = h + attn.o_proj(attended.transpose(0, 1).flatten(1))
    by_hand = by_hand + net.ca_mlp(net.ca_post_norm(by_hand))
    torch.testing.assert_close(c_inference, by_hand, rtol=0, atol=1e-12)


@torch.no_grad()
def test_eagle_pairs_the_token_embedding_first_then_the_feature() -> None:
    """Kills E1 (fc over [feature, embedding]): EAGLE's fc reads cat(embedding, feature) (EAGLE's
    cnets.py `self.fc(torch.cat((inputs_embeds, hidden_states), dim=-1))`). Training and inference
    share `pair_inputs`, so only a checkpoint (the shipped EAGLE-2) would show it."""
    target = make_tiny_target("llama")
    net = make_random_drafter_net(EagleDrafterNet, EagleConfig.for_target(target.config), target)
    parts = target.parts(0)
    ids = torch.tensor([3, 9, 27])
    features = torch.randn(3, 64, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    weight = net.fc.weight  # [D, 2D]
    expected = parts.embed_tokens(ids) @ weight[:, :64].T + features @ weight[:, 64:].T
    torch.testing.assert_close(net.pair_inputs(parts, ids, features), expected, rtol=0, atol=1e-12)


# -- MoA's inference paths ----------------------------------------------------------------------


@pytest.mark.parametrize("tli", [0, 1])
@torch.no_grad()
def test_moa_tree_nodes_see_only_their_own_path(tli: int) -> None:
    """Kills D4 (SA: a beam sees every drafted entry, its siblings' too) and, with TLI, D11 (the
    target layers: the same). Several beams per level at one position: each node's log-probs equal
    a fresh drafter's chain along the node's own root-to-node path (chains equal training: test_moa).
    A user would have seen worse drafts below the first tree level, with the greedy output
    unchanged (which is why the engine tests could not tell)."""
    target = make_tiny_target("llama", num_hidden_layers=3)
    net = random_moa(target, tli)
    target.prefill(PROMPT)
    drafter = moa_after_prompt(net, target)
    drafter.start(ROOT)

    def along(path: list[int]) -> torch.Tensor:
        chain = moa_after_prompt(net, target)
        chain.start(ROOT)
        for step, token in enumerate(path, start=1):
            drafted = chain.expand(torch.tensor([token]), torch.tensor([-1 if step == 1 else 0]), step)[0]
        return drafted

    check_beams_against_their_paths(drafter, along)


@torch.no_grad()
def test_a_second_moa_proposal_in_a_row_forgets_the_first() -> None:
    """Kills D1 (`start` keeps `sa_valid` past the root): a proposal that was never verified (its
    root and tree left in the SA cache) must not change the next one, which equals a fresh
    drafter's, root step and tree step (the module's "proposing twice in a row is safe")."""
    target = make_tiny_target("llama", num_hidden_layers=3)
    net = random_moa(target, tli=1)
    target.prefill(PROMPT)
    twice, once = moa_after_prompt(net, target), moa_after_prompt(net, target)
    twice.start(ROOT + 1)
    twice.expand(torch.tensor([11, 12]), torch.tensor([-1, -1]), 1)
    torch.testing.assert_close(twice.start(ROOT), once.start(ROOT), rtol=0, atol=1e-12)
    step = (torch.tensor([13]), torch.tensor([-1]), 1)
    torch.testing.assert_close(twice.expand(*step), once.expand(*step), rtol=0, atol=1e-12)


@pytest.mark.parametrize("method, tli", [("moa", 0), ("moa", 1), ("eagle", 0)])
@torch.no_grad()
def test_a_token_drafted_alone_becomes_context_as_a_drafted_node_does(method: str, tli: int) -> None:
    """Kills D8 (MoA drops the provisional root's predicted TLI keys/values): drafting alone (split
    deployment, link down), the provisional root r1 then a proposal at r2 gives r2's depth-1
    log-probs of a tree drafted from r1 with r2 as its child (same SA/feature context, CA memory
    frozen, TLI context = true states then r1's predicted ones). A user would have seen the second
    and later tokens drafted alone (and the trees after them) drafted without r1's state."""
    target = make_tiny_target("llama", num_hidden_layers=3)
    hidden = target.prefill(PROMPT, (target.num_layers,)).hidden
    if method == "moa":
        net = random_moa(target, tli)
        alone, tree = moa_after_prompt(net, target), moa_after_prompt(net, target)
    else:
        net = make_random_drafter_net(EagleDrafterNet, EagleConfig.for_target(target.config), target)
        alone, tree = eagle_after_prompt(net, target, hidden), eagle_after_prompt(net, target, hidden)
    first = alone.draft_alone(ROOT, SamplingConfig(), None).token_id
    after = alone.start(first)
    tree.start(ROOT)
    expected = tree.expand(torch.tensor([first]), torch.tensor([-1]), 1)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-10)


@torch.no_grad()
def test_a_memory_narrower_than_tli_reads_its_own_layers() -> None:
    """Kills D10 (the encoder hands the memory the first layers it read, not the memory's): with
    memory_layers 1 < tli_layers 2 the encoder reads layers 1..2 and the memory must get layer 2
    alone. Layer 1's keys/values have the memory's shape, so nothing fails: the drafter would
    draft from another layer than it was trained on."""
    target = make_tiny_target("llama", num_hidden_layers=3)
    net = random_moa(target, tli=2, memory_layers=1)
    assert net.config.memory_layer_ids == (2,)
    prompt = torch.arange(3, 14)
    target.prefill(prompt)
    encoder = MoAContextEncoder(net, target.dtype)
    assert list(encoder.layers) == [1, 2]
    context = encoder.encode(VerifiedUpdate(prompt, 0, None, target))
    torch.testing.assert_close(context["memory"], net.memory(target.layer_kv(0, 11, [2])), rtol=0, atol=1e-12)
    assert not torch.allclose(net.memory(target.layer_kv(0, 11, [1])), context["memory"])  # the layers differ
    assert torch.equal(context["tli_kv"], target.layer_kv(0, 11, [1, 2]))


@torch.no_grad()
def test_tli_training_rows_at_anchors_are_the_targets_own_state() -> None:
    """Kills M10 (TLI training feeds the drafter's state at anchors too): at an anchor the target's
    last k layers read the true residual stream and true context, so the row is the target's own
    post-norm state (the anchor loss then has nothing of the drafter to train through TLI). The
    mutant trains the drafter on rows inference never drafts. sdpa: float64 throughout."""
    target = make_tiny_target("llama", num_hidden_layers=3, attn="sdpa")
    net = random_moa(target, tli=2)
    length = 12
    tokens = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(7))
    final_hidden = target.prefill(tokens, (target.num_layers,)).hidden[:, 0]  # [T, D]
    true_kv = [(layer.keys[0], layer.values[0]) for layer in target.cache.layers[1:]]
    true_hidden = target.model(tokens[None], output_hidden_states=True).hidden_states[1][0]
    anchors = torch.tensor([0, 1, 2, 3, 3, 3, 3, 7, 7, 7, 7, 11])  # prompt 0..3, blocks after 3 and 7
    out = net.forward_train(target.parts(2), tokens, target.layer_kv(0, length), anchors, False, true_kv, true_hidden)
    at_anchor = anchors == torch.arange(length)
    torch.testing.assert_close(out.final[at_anchor], final_hidden[at_anchor], rtol=0, atol=1e-10)
    assert not torch.allclose(out.final[~at_anchor], final_hidden[~at_anchor])  # elsewhere, the drafter's


# -- drafting alone ------------------------------------------------------------------------------


@pytest.mark.parametrize("model_agrees", [True, False])
@torch.no_grad()
def test_a_copy_drafted_alone_is_compared_with_the_models_token_not_its_row(model_agrees: bool) -> None:
    """Kills T5 (the model's choice compared as a draft-vocabulary row): with a reduced vocabulary
    (the shipped drafters have one) row r is token 2r here, so the copy 8 is row 4; the model
    favouring row 4 agrees with the copy, favouring row 8 (token 16) disputes it. A user of
    `moa+ngram` drafting alone would have got the other precision (agreed/disputed) reported."""
    from moaspec.drafters.ngram import LOOKUP_PRECISION_AGREED, LOOKUP_PRECISION_DISPUTED

    target = make_tiny_target("llama", num_hidden_layers=3)
    vocab = torch.arange(0, 97, 2)
    prompt = torch.tensor([3, 5, 6, 8, 9, 2, 5])
    target.prefill(prompt)
    drafter = MoADrafter(random_moa(target, draft_vocab=vocab), target)
    drafter.enable_lookup()
    drafter.accept(VerifiedUpdate(prompt, 0, None, target))
    root = 6  # ..., 5, 6 as at the start: the lookup copies 8
    favour_row(drafter, 4 if model_agrees else 8)
    draft = drafter.draft_alone(root, SamplingConfig(), None)
    expected = (LOOKUP_PRECISION_AGREED, "lookup+model") if model_agrees else (LOOKUP_PRECISION_DISPUTED, "lookup")
    assert draft == (8, *expected)


@torch.no_grad()
def test_a_sampled_token_drafted_alone_comes_with_its_own_probability(monkeypatch) -> None:
    """Kills T6 (the probability of the model's top token reported for any pick): the draw is
    replaced by the least likely row, whose target id and probability must be the ones returned. A
    user drafting alone at a temperature would have had every token reported as likely as the
    model's favourite (the split client's confidence in its provisional tokens)."""
    from moaspec.drafters import tree_drafter

    target = make_tiny_target("llama", num_hidden_layers=3)
    vocab = torch.arange(0, 97, 2)
    target.prefill(PROMPT)
    net = random_moa(target, draft_vocab=vocab)
    drafter, probe = moa_after_prompt(net, target), moa_after_prompt(net, target)
    log_probs = probe.start(ROOT)[0]
    least = int(log_probs.argmin())
    assert float(log_probs[least].exp()) < 0.5 * float(log_probs.max().exp())  # far from the top
    monkeypatch.setattr(tree_drafter, "pick_alone", lambda log_probs, sampling, generator: least)
    draft = drafter.draft_alone(ROOT, SamplingConfig(temperature=1.0), torch.Generator())
    assert draft.token_id == int(vocab[least]) and draft.source == "model"
    assert draft.probability == pytest.approx(float(log_probs[least].exp()), rel=1e-12)


# -- draft vocabulary and background drafter ------------------------------------------------------


def test_draft_vocabulary_breaks_ties_by_id_takes_forced_ids_once_and_keeps_its_size() -> None:
    """Kills V1 (ties at the cut go to the higher id), V2 (a forced id that is also frequent taken
    twice: `train` forces the stop tokens, which end every answer, so the vocabulary would hold a
    duplicate row and one frequent token fewer), V3 (more forced ids than `size` all kept: a
    vocabulary larger than asked). (test_vocab.py's "5 and 7 both thrice: id order" takes both
    tied tokens, so it never decides a tie.)"""
    from moaspec.drafters.vocab import most_frequent_token_ids

    assert most_frequent_token_ids([[9, 9, 4, 4, 7]], 1).tolist() == [4]
    assert most_frequent_token_ids([[2, 2, 2, 5, 5, 7]], 2, always_include=[2]).tolist() == [2, 5]
    assert most_frequent_token_ids([[1, 1]], 1, always_include=[4, 3]).tolist() == [3]


def test_a_background_moa_with_a_hidden_state_memory_reads_the_final_hidden_state() -> None:
    """Kills B4 (`reads_of` ignores `memory_hidden`): the target must keep its final hidden states
    from the prompt on, or the drafter's join fails mid-answer ("needs the target's last hidden
    state")."""
    from moaspec.drafters.background import DrafterReads, reads_of

    config = {"num_target_layers": 30, "memory_layers": 4, "tli_layers": 1, "memory_hidden": True}
    assert reads_of({"method": "moa", "config": config}) == DrafterReads((26, 27, 28, 29), True)
    assert reads_of({"method": "moa", "config": {**config, "memory_hidden": False}}).final_hidden is False


def test_a_background_drafter_reset_before_its_join_forgets_the_last_generation() -> None:
    """Kills B6 (`reset` keeps the verified tokens of a generation the drafter never joined): the
    next generation's prompt (at position 0) was refused, and the joined drafter would be told
    tokens from two generations."""
    from moaspec.drafters.background import BackgroundDrafter, DrafterReads

    class Target:
        def keep_layer_kv(self, layers) -> None:
            pass

    class Recorder:
        def __init__(self) -> None:
            self.accepted: list[tuple[list[int], int]] = []

        def reset(self) -> None:
            self.accepted.clear()

        def accept(self, update: VerifiedUpdate) -> None:
            self.accepted.append((update.token_ids.tolist(), update.start_pos))

        def propose(self, root_id, sampling, generator):
            return None

    built = Recorder()
    drafter = BackgroundDrafter(lambda: built, Target(), DrafterReads((0,), False), TreeConfig(), "checkpoint")
    drafter.reset()
    drafter.accept(VerifiedUpdate(np.array([1, 2, 3]), 0, None, None))
    drafter.reset()  # a new generation before the drafter joined
    drafter.accept(VerifiedUpdate(np.array([4, 5]), 0, None, None))
    drafter.propose(6, SamplingConfig(temperature=0.7), None)  # sampled: waits for the build, joins
    assert built.accepted == [([4, 5], 0)]
