"""MoA drafter: training/inference equivalence (TLI 0..2), memory invariants, greedy losslessness
(full and reduced vocabulary), checkpoints. Tiny random targets, float64."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from conftest import _tiny_config, make_random_drafter_net, make_tiny_target

from moaspec.config import GenerationConfig, TreeConfig
from moaspec.drafters import make_drafter
from moaspec.drafters.base import VerifiedUpdate
from moaspec.drafters.moa import MoADrafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.nn.layers import additive_mask
from moaspec.nn.moa import MoAConfig, MoADrafterNet
from moaspec.targets.hf import HFTarget
from moaspec.tree import DraftTree, depths

NO_STOP: frozenset[int] = frozenset()


def random_moa(
    target: HFTarget, tli: int = 0, draft_vocab: torch.Tensor | None = None, seed: int = 0, memory_hidden: bool = False
) -> MoADrafterNet:
    size = 0 if draft_vocab is None else draft_vocab.numel()
    config = MoAConfig.for_target(target.config, tli_layers=tli, draft_vocab_size=size, memory_hidden=memory_hidden)
    return make_random_drafter_net(MoADrafterNet, config, target, draft_vocab, seed)


def anchors_for(length: int, prompt_len: int, boundaries: list[int]) -> torch.Tensor:
    """s(i): the last anchor <= i, anchors = every prompt position and each block boundary."""
    anchor_set = set(range(prompt_len)) | set(boundaries)
    last, current = torch.zeros(length, dtype=torch.long), 0
    for i in range(length):
        current = i if i in anchor_set else current
        last[i] = current
    return last


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tli, memory_hidden", [(0, False), (1, False), (2, False), (0, True), (1, True)])
def test_training_forward_equals_step_by_step_drafting(family: str, tli: int, memory_hidden: bool) -> None:
    """Drafting cycles through the real inference path (memory appended per verification, SA
    cache cropped and re-fed, TLI caches rebuilt) give the same log-probs, position by position,
    as the single-pass training forward with anchors at the verified boundaries."""
    target = make_tiny_target(family, num_hidden_layers=3)
    net = random_moa(target, tli, memory_hidden=memory_hidden)
    length, prompt_len, boundaries = 26, 6, [5, 9, 14, 16, 22, 25]
    tokens = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(1))

    drafter = MoADrafter(net, target)
    assert drafter.hidden_layers == ((target.num_layers,) if memory_hidden else ())
    out = target.prefill(tokens[:prompt_len], drafter.hidden_layers)
    verified_hidden = [out.hidden]  # the target's last hidden states the memory reads (or None)
    drafter.accept(VerifiedUpdate(tokens[:prompt_len], 0, out.hidden, target))
    inference: dict[int, torch.Tensor] = {}
    for block_start, block_end in zip(boundaries[:-1], boundaries[1:]):
        root = block_start + 1
        inference[root] = drafter.start(int(tokens[root]))[0]
        parent = torch.tensor([-1])
        for depth in range(1, block_end - root):
            inference[root + depth] = drafter.expand(tokens[root + depth : root + depth + 1], parent, depth)[0]
            parent = torch.tensor([0])
        committed = tokens[root : block_end + 1]
        start = target.num_cached
        out = target.verify(DraftTree.chain(committed), drafter.hidden_layers)
        target.commit(list(range(committed.numel())))
        verified_hidden.append(out.hidden)
        drafter.accept(VerifiedUpdate(committed, start, out.hidden, target))
        assert drafter.memory_kv[0].shape[1] == target.num_cached  # memory: once per verified token

    # The training pass reads the same target activations (the target's incremental cache).
    true_kv = [(layer.keys[0], layer.values[0]) for layer in target.cache.layers[target.num_layers - tli :]] if tli else None
    true_hidden = None
    if tli:
        full = target.model(tokens[None], output_hidden_states=True)
        true_hidden = full.hidden_states[target.num_layers - tli][0]
    parts = target.parts(tli)
    last_hidden = torch.cat(verified_hidden)[:, 0] if memory_hidden else None
    out = net.forward_train(
        parts, tokens, target.layer_kv(0, length), anchors_for(length, prompt_len, boundaries), False, true_kv,
        true_hidden, last_hidden,
    )
    training = torch.log_softmax(out.final @ net.head_weight(parts).T, dim=-1)
    for position, log_probs in inference.items():
        torch.testing.assert_close(log_probs, training[position], rtol=0, atol=1e-9)


class MemorySpy(MoADrafter):
    """Records, at every proposal, how many memory entries the CA can see and the root position."""

    def start(self, root_id: int) -> torch.Tensor:
        self.seen.append((self.memory_kv[0].shape[1], len(self.history), self.target.num_cached))
        return super().start(root_id)


def test_cross_attention_never_sees_the_root() -> None:
    target = make_tiny_target("llama")
    spy = MemorySpy(random_moa(target), target, TreeConfig(depth=3, top_k=2, budget=5))
    spy.seen = []
    Engine(target, spy).generate([1, 2, 3, 4], generation=GenerationConfig(max_new_tokens=20), stop_ids=NO_STOP)
    assert spy.seen
    for memory_len, root_pos, verified in spy.seen:
        assert memory_len == root_pos == verified  # positions 0..root_pos-1 only


@pytest.mark.parametrize("tli, memory_hidden", [(0, False), (1, False), (0, True)])
def test_context_encoder_in_chunks_equals_one_pass(monkeypatch, tli: int, memory_hidden: bool) -> None:
    import moaspec.drafters.moa as moa_drafter

    target = make_tiny_target("llama")
    net = random_moa(target, tli=tli, memory_hidden=memory_hidden)
    out = target.prefill(torch.arange(3, 14), (target.num_layers,))
    hidden = out.hidden[:10] if memory_hidden else None  # [10, 1, D]
    update = VerifiedUpdate(token_ids=torch.arange(3, 13), start_pos=0, hidden=hidden, target=target)
    monkeypatch.setattr(moa_drafter, "ENCODE_CHUNK", 3)  # 10 tokens: chunks of 3, 3, 3, 1
    layer_kv = target.layer_kv(0, 10)
    sizes, memory = [], net.memory
    net.memory = lambda kv, *rest: sizes.append(kv.shape[0]) or memory(kv, *rest)
    chunked = moa_drafter.MoAContextEncoder(net, target.dtype).encode(update)
    del net.memory
    assert sizes == [3, 3, 3, 1]
    with torch.no_grad():
        one_pass = net.memory(layer_kv, hidden[:, 0] if memory_hidden else None)
    torch.testing.assert_close(chunked["memory"], one_pass, rtol=0, atol=1e-12)
    if tli:
        assert torch.equal(chunked["tli_kv"], layer_kv[:, -1:])
    no_tokens = out.hidden[:0] if memory_hidden else None
    nothing_new = VerifiedUpdate(torch.arange(0), 10, no_tokens, target)
    empty = moa_drafter.MoAContextEncoder(net, target.dtype).encode(nothing_new)
    assert empty["memory"].shape == (0, net.config.hidden_size)


def test_memory_hidden_starts_as_the_keys_values_memory_and_needs_the_hidden_state() -> None:
    """A fresh memory_hidden net's hidden-state map is zero (a checkpoint without it continues
    as the same function); once it is not, the hidden state changes the memory; the encoder
    refuses an update without hidden states."""
    target = make_tiny_target("llama")
    plain = random_moa(target)
    config = dataclasses.replace(plain.config, memory_hidden=True)
    with_hidden = MoADrafterNet(config).to(target.dtype)
    assert torch.count_nonzero(with_hidden.h2m.weight) == 0
    missing, unexpected = with_hidden.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["h2m.weight"] and not unexpected
    out = target.prefill(torch.arange(3, 14), (target.num_layers,))
    layer_kv, hidden = target.layer_kv(0, 11), out.hidden[:, 0].clone()
    assert torch.equal(with_hidden.memory(layer_kv, hidden), plain.memory(layer_kv))
    with pytest.raises(ValueError, match="reads the target's last hidden state"):
        with_hidden.memory(layer_kv)
    with pytest.raises(ValueError, match="reads no hidden state"):
        plain.memory(layer_kv, hidden)
    with torch.no_grad():
        with_hidden.h2m.weight.normal_(0.0, 0.2)
    assert not torch.allclose(with_hidden.memory(layer_kv, hidden), plain.memory(layer_kv))
    update = VerifiedUpdate(torch.arange(3, 14), 0, None, target)
    with pytest.raises(ValueError, match="needs the target's last hidden state"):
        MoADrafter(with_hidden, target).accept(update)


def test_fresh_net_has_unit_norms_and_small_linear_weights() -> None:
    """The init of DrafterNet.reset_parameters: RMSNorm weights 1 (not the reference's
    N(0, 0.02)), Linear weights ~ N(0, 0.02), biases 0."""
    from moaspec.nn.layers import RMSNorm

    target = make_tiny_target("llama")
    torch.manual_seed(0)
    net = MoADrafterNet(MoAConfig.for_target(target.config))
    norms = [m for m in net.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 6  # SA (2), CA, CA post, LSA (2)
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    linear_std = torch.cat([m.weight.detach().flatten() for m in net.modules() if isinstance(m, torch.nn.Linear)]).std()
    assert 0.018 < float(linear_std) < 0.022
    assert torch.count_nonzero(net.ekv2e.bias) == 0


def test_recency_bias_with_steep_slopes_reads_the_nearest_memory() -> None:
    """ALiBi slopes of 1e4 per position leave (in float64) only the nearest visible memory entry."""
    from moaspec.nn.layers import additive_mask

    target = make_tiny_target("llama", dtype=torch.float64)
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config), target)
    assert net.config.ca_recency_bias
    with torch.no_grad():
        net.ca_recency_slopes.fill_(1e4)
    torch.manual_seed(1)
    memory = torch.randn(5, net.config.hidden_size, dtype=torch.float64)
    memory_kv = net.memory_keys_values(memory, torch.arange(5))
    h = torch.randn(3, net.config.hidden_size, dtype=torch.float64)
    positions = torch.tensor([2, 5, 6])  # as in training: 2 sees memory 0..2, 5 and 6 see 0..4
    visible = torch.arange(5)[None, :] <= torch.tensor([2, 4, 4])[:, None]
    nearest = torch.zeros(3, 5, dtype=torch.bool)
    nearest[0, 2] = nearest[1, 4] = nearest[2, 4] = True
    biased = net.cross_attend(h, positions, memory_kv, additive_mask(visible, torch.float64))
    net.config = dataclasses.replace(net.config, ca_recency_bias=False)
    only_nearest = net.cross_attend(h, positions, memory_kv, additive_mask(nearest, torch.float64))
    torch.testing.assert_close(biased, only_nearest, rtol=0, atol=1e-9)


def test_configs_without_the_recency_bias_field_load_as_before() -> None:
    """Checkpoints written before the CA recency bias existed have no such field: no bias."""
    target = make_tiny_target("llama")
    record = MoAConfig.for_target(target.config).to_dict()
    del record["ca_recency_bias"]
    net = MoADrafterNet(MoAConfig(**record))
    assert not net.config.ca_recency_bias and not hasattr(net, "ca_recency_slopes")


def test_layer_mix_starts_at_the_mean_and_learns_a_weighted_mean() -> None:
    """The memory pools the LSA's per-layer outputs with softmax(LAYER_MIX_SCALE * raw) weights:
    a fresh net (raw = 0) pools with the reference's plain mean; checkpoints written before the
    field existed load with the mean."""
    from moaspec.nn.moa import LAYER_MIX_SCALE

    target = make_tiny_target("llama", num_hidden_layers=4, dtype=torch.float64)
    torch.manual_seed(0)
    net = MoADrafterNet(MoAConfig.for_target(target.config)).double()
    layer_kv = torch.randn(5, 4, net.config.kv_dim, dtype=torch.float64)
    mixed, _ = net.layer_self_attention(layer_kv, torch.arange(4), None)  # [5, L, kv_dim]
    assert net.config.layer_mix and torch.equal(net.layer_mix_raw, torch.zeros(4, dtype=torch.float64))
    torch.testing.assert_close(net.memory(layer_kv), net.ekv2e(mixed.mean(dim=1)), rtol=0, atol=1e-12)
    with torch.no_grad():
        net.layer_mix_raw.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    # the net takes this softmax in float32 (nn/moa.py encode_memory); in float64 the weights
    # would differ by ~1e-8 relative, which only torch.allclose's default rtol (1e-5) used to hide
    weights = torch.softmax(LAYER_MIX_SCALE * net.layer_mix_raw.float(), 0).double()
    assert weights.max() > 5 * weights.min()  # far from the mean
    expected = net.ekv2e((mixed * weights[:, None]).sum(dim=1))
    torch.testing.assert_close(net.memory(layer_kv), expected, rtol=0, atol=1e-12)
    record = net.config.to_dict()
    del record["layer_mix"]
    old = MoADrafterNet(MoAConfig(**record))
    assert not old.config.layer_mix and not hasattr(old, "layer_mix_raw")


def test_memory_without_layer_attention_pools_the_raw_keys_values() -> None:
    """The ablation `layer_attention=False` has no LSA: the memory is Ekv2E of the layer mix of
    the raw keys/values, in training and in the bfloat16 encoder copy; old checkpoints keep the LSA."""
    target = make_tiny_target("llama", num_hidden_layers=4, dtype=torch.float64)
    torch.manual_seed(0)
    net = MoADrafterNet(MoAConfig.for_target(target.config, memory_layers=2, layer_attention=False)).double()
    assert net.layer_self_attention is None
    assert not any(name.startswith("layer_self_attention.") for name in net.state_dict())
    layer_kv = torch.randn(5, 2, net.config.kv_dim, dtype=torch.float64)
    with torch.no_grad():
        net.layer_mix_raw.copy_(torch.tensor([0.2, -0.1]))
    weights = torch.softmax(10.0 * net.layer_mix_raw.float(), 0).double()
    expected = net.ekv2e((layer_kv * weights[:, None]).sum(dim=1))
    torch.testing.assert_close(net.memory(layer_kv), expected, rtol=0, atol=1e-12)
    encoder = net.memory_encoder(torch.float32)
    torch.testing.assert_close(encoder(layer_kv.float()).double(), expected, rtol=1e-5, atol=1e-5)
    record = net.config.to_dict()
    del record["layer_attention"]
    assert MoAConfig(**record).layer_attention


def test_without_cross_attention_the_drafter_reads_no_target_activations() -> None:
    """The ablation `cross_attention=False`: c = h + MLP(norm(h)) whatever the target's keys/values
    hold, in training and in drafting alike; old checkpoints keep the CA."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float64)
    config = MoAConfig.for_target(target.config, cross_attention=False)
    net = make_random_drafter_net(MoADrafterNet, config, target, None, 0)
    length, prompt_len = 12, 4
    tokens = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    anchors = anchors_for(length, prompt_len, [7, 11])
    parts = target.parts(0)
    layer_kv = torch.randn(length, target.num_layers, config.kv_dim, dtype=torch.float64)
    out = net.forward_train(parts, tokens, layer_kv, anchors).final
    torch.testing.assert_close(net.forward_train(parts, tokens, torch.randn_like(layer_kv), anchors).final, out, rtol=0, atol=0)
    positions = torch.arange(length)
    causal = additive_mask(positions[None, :] <= positions[:, None], torch.float64)
    h, _ = net.self_attention(parts.embed_tokens(tokens).double(), positions, causal)
    torch.testing.assert_close(out, h + net.ca_mlp(net.ca_post_norm(h)), rtol=0, atol=1e-12)

    drafter = MoADrafter(net, target)
    prefilled = target.prefill(tokens[:prompt_len])
    drafter.accept(VerifiedUpdate(tokens[:prompt_len], 0, prefilled.hidden, target))
    training = torch.log_softmax(out @ net.head_weight(parts).T, dim=-1)
    torch.testing.assert_close(drafter.start(int(tokens[prompt_len]))[0], training[prompt_len], rtol=0, atol=1e-9)

    with_ca = MoADrafterNet(dataclasses.replace(config, cross_attention=True)).double()
    with_ca.load_state_dict(net.state_dict())
    assert not torch.allclose(with_ca.forward_train(parts, tokens, layer_kv, anchors).final, out)
    record = config.to_dict()
    del record["cross_attention"]
    assert MoAConfig(**record).cross_attention


def overfit_moa(net: MoADrafterNet, target: HFTarget, token_ids: list[int], prompt_len: int, steps: int = 30) -> None:
    """Fit `net` to one sequence (cross-entropy with its next tokens, anchors drawn afresh each
    step after the prompt), so that real drafts get accepted and the engine exercises partial and
    full acceptance. The target's activations are read as training reads them."""
    tokens = torch.tensor(token_ids)
    length, tli = tokens.numel(), net.config.tli_layers
    target.reset()
    with torch.no_grad():
        hidden = target.prefill(tokens, (target.num_layers,)).hidden[:, 0].clone()  # [T, D]
        layer_kv = target.layer_kv(0, length)
        true_kv = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in target.cache.layers[target.num_layers - tli :]]
        true_hidden = target.model(tokens[None], output_hidden_states=True).hidden_states[target.num_layers - tli][0] if tli else None
    target.reset()
    parts = target.parts(tli)
    vocab = net.draft_vocab_ids if net.config.draft_vocab_size else torch.arange(target.vocab_size)
    rows = torch.full((target.vocab_size,), -1, dtype=torch.long)
    rows[vocab] = torch.arange(vocab.numel())
    wanted = rows[tokens[1:]]  # [T - 1]: the next token's row in the draft vocabulary, -1 where it has none
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(steps):
        cuts = torch.randperm(length - prompt_len, generator=generator)[: (length - prompt_len) // 4] + prompt_len
        anchors = anchors_for(length, prompt_len, sorted(cuts.tolist()))
        out = net.forward_train(parts, tokens, layer_kv, anchors, False, true_kv if tli else None, true_hidden, hidden)
        logits = out.final[:-1] @ net.head_weight(parts).T
        loss = torch.nn.functional.cross_entropy(logits[wanted >= 0], wanted[wanted >= 0])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    net.zero_grad(set_to_none=True)
    target.model.zero_grad(set_to_none=True)


def greedy_reference(target: HFTarget, prompt: list[int], max_new: int) -> list[int]:
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "tli, reduced, memory_hidden",
    [(0, False, False), (1, False, False), (0, True, False), (2, True, False), (1, True, True)],
)
def test_greedy_output_identical_with_moa(family: str, tli: int, reduced: bool, memory_hidden: bool) -> None:
    target = make_tiny_target(family, num_hidden_layers=3)
    prompt = [5, 17, 33, 2, 71, 5, 17]
    expected = greedy_reference(target, prompt, 40)
    draft_vocab = None
    if reduced:  # half of the tokens the target emits, plus others: some drafts are impossible
        draft_vocab = torch.tensor(sorted(set(expected[::2]) | set(range(0, 97, 3))))
    net = random_moa(target, tli, draft_vocab, memory_hidden=memory_hidden)
    overfit_moa(net, target, prompt + expected, len(prompt))
    tree = TreeConfig(depth=4, top_k=3, budget=8)
    drafter = MoADrafter(net, target, tree)
    proposals: list[DraftTree] = []
    original_propose = drafter.propose

    def recording_propose(*args):
        proposals.append(original_propose(*args))
        return proposals[-1]

    drafter.propose = recording_propose  # type: ignore[method-assign]
    result = Engine(target, drafter).generate(prompt, generation=GenerationConfig(max_new_tokens=40), stop_ids=NO_STOP)
    assert result.token_ids == expected
    # drafts were really accepted, at depth >= 2 too (an audit's: with the random net 6 of the 15
    # cases accepted none, where any engine gives plain decoding's output)
    assert sum(result.stats.accepted_depth[1:]) > 0
    for tree_proposed in proposals:
        assert tree_proposed.num_nodes - 1 <= tree.budget
        assert int(depths(tree_proposed.parents).max()) <= tree.depth
        if draft_vocab is not None:
            assert set(tree_proposed.token_ids[1:].tolist()) <= set(draft_vocab.tolist())


def test_memory_encoder_dtype_follows_the_setting(monkeypatch) -> None:
    """bfloat16 where asked (or native, for a float32 drafter): the memory stays close to float32
    and comes back in the drafter's dtype; float32 is the net's own path; bad values are refused."""
    import moaspec.nn.encoder_dtype as encoder_dtype
    from moaspec.drafters.moa import MoAContextEncoder

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    net = random_moa(target)
    target.prefill(torch.arange(3, 40))
    update = VerifiedUpdate(torch.arange(3, 40), 0, None, target)
    with torch.no_grad():
        exact = net.memory(target.layer_kv(0, 37))
    monkeypatch.setenv("MOASPEC_ENCODER_DTYPE", "bfloat16")
    encoder = MoAContextEncoder(net, torch.float32)
    memory = encoder.encode(update)["memory"]
    assert encoder.compute_dtype == torch.bfloat16 and memory.dtype == torch.float32
    assert 0 < float((memory - exact).norm() / exact.norm()) < 2e-2
    monkeypatch.setenv("MOASPEC_ENCODER_DTYPE", "float32")
    assert torch.equal(MoAContextEncoder(net, torch.float32).encode(update)["memory"], exact)
    monkeypatch.setenv("MOASPEC_ENCODER_DTYPE", "auto")
    cases = [(True, torch.float32, torch.bfloat16), (False, torch.float32, torch.float32), (True, torch.float64, torch.float64)]
    for native, dtype, expected in cases:
        monkeypatch.setattr(encoder_dtype, "native_bfloat16_cpu", lambda native=native: native)
        assert encoder_dtype.encoder_dtype(dtype, torch.device("cpu")) == expected
    monkeypatch.setenv("MOASPEC_ENCODER_DTYPE", "half")
    with pytest.raises(MoaspecError, match="MOASPEC_ENCODER_DTYPE must be one of"):
        MoAContextEncoder(net, torch.float32)


def test_greedy_output_identical_with_a_bfloat16_memory_encoder(monkeypatch) -> None:
    monkeypatch.setenv("MOASPEC_ENCODER_DTYPE", "bfloat16")
    target = make_tiny_target("qwen2", num_hidden_layers=3, dtype=torch.float32)
    prompt = [5, 17, 33, 2, 71, 5, 17]
    expected = greedy_reference(target, prompt, 40)
    net = random_moa(target, tli=1)
    overfit_moa(net, target, prompt + expected, len(prompt))
    drafter = MoADrafter(net, target, TreeConfig(depth=3, top_k=2, budget=5))
    assert drafter.context_encoder.compute_dtype == torch.bfloat16
    result = Engine(target, drafter).generate(prompt, generation=GenerationConfig(max_new_tokens=40), stop_ids=NO_STOP)
    assert result.token_ids == expected and sum(result.stats.accepted_depth[1:]) > 0


def test_checkpoint_round_trip_and_wrong_target(tmp_path) -> None:
    target = make_tiny_target("llama", num_hidden_layers=3)
    net = random_moa(target, tli=1, draft_vocab=torch.arange(0, 97, 2))
    tree = TreeConfig(depth=3, top_k=2, budget=6)
    path = net.save_pretrained(tmp_path / "moa", target, tree=tree.__dict__, dtype=torch.float64)
    loaded = make_drafter(str(path), target)
    assert isinstance(loaded, MoADrafter) and loaded.tree_config == tree and loaded.lookup is None
    assert make_drafter(f"{path}+ngram", target).lookup is not None
    assert torch.equal(loaded.net.draft_vocab_ids, net.draft_vocab_ids)
    original = MoADrafter(net, target, tree)
    target.prefill(torch.tensor([4, 8, 15, 16, 23]))
    update = VerifiedUpdate(torch.tensor([4, 8, 15, 16, 23]), 0, None, target)
    for drafter in (original, loaded):
        drafter.accept(update)
    torch.testing.assert_close(loaded.start(42), original.start(42), rtol=0, atol=0)

    half = net.save_pretrained(tmp_path / "half", target)  # default: float16 on disk
    assert (half / "model.safetensors").stat().st_size < (path / "model.safetensors").stat().st_size / 3

    other = make_tiny_target("llama", seed=1, num_hidden_layers=3)
    with pytest.raises(MoaspecError, match="trained for target"):
        make_drafter(str(path), other)
    with pytest.raises(MoaspecError, match="not a drafter checkpoint"):
        make_drafter(str(tmp_path), target)

    # damaged checkpoints are one-line errors, not tracebacks (SafetensorError, TypeError, AttributeError)
    import json
    import shutil

    damaged = shutil.copytree(path, tmp_path / "damaged")
    (damaged / "model.safetensors").write_bytes(b"\x07" * 1000)
    with pytest.raises(MoaspecError, match="not readable safetensors"):
        make_drafter(str(damaged), target)
    shutil.copy(path / "model.safetensors", damaged / "model.safetensors")
    record = json.loads((damaged / "config.json").read_text())
    for tree in ("abc", {"depth": 0, "top_k": 1, "budget": 1}):
        (damaged / "config.json").write_text(json.dumps({**record, "tree": tree}))
        with pytest.raises(MoaspecError, match="config.json: its default tree is not valid"):
            make_drafter(str(damaged), target)
    # an audit's: no "config", or a format_version that is not a number, ended in a KeyError / TypeError
    for broken in ({key: value for key, value in record.items() if key != "config"}, {**record, "format_version": "x"}):
        (damaged / "config.json").write_text(json.dumps(broken))
        with pytest.raises(MoaspecError, match="is not a valid drafter config"):
            make_drafter(str(damaged), target)
    (damaged / "config.json").write_text(json.dumps({**record, "config": {**record["config"], "num_heads": 0}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and torch's warning about zero-element tensors is not printed on the way
        with pytest.raises(MoaspecError, match="weights do not match the recorded config"):
            make_drafter(str(damaged), target)
    (damaged / "config.json").write_text("[1, 2]")
    from moaspec.calibration.plan import LazyModelDrafter

    for load in (make_drafter, lambda spec, target: LazyModelDrafter(spec, target, None)):  # the calibration's way too
        with pytest.raises(MoaspecError, match="not a drafter checkpoint"):
            load(str(damaged), target)


@pytest.mark.parametrize("family, config_class, settings", [
    ("granite", "GraniteConfig", {}),  # attention and residual multipliers (a 7e-4 difference with random weights)
    ("gemma2", "Gemma2Config", {"head_dim": 16}),  # extra norms, scaled embeddings and queries
    ("phi3", "Phi3Config", {}),  # fused q/k/v projection
])
def test_target_layer_inference_refuses_layers_it_does_not_compute(
    family: str, config_class: str, settings: dict, tmp_path
) -> None:
    """Bug: TLI runs the target's last layers by hand, as Llama layers; on another layer kind it
    drafted (and trained) through a function the target does not compute, silently."""
    import transformers

    from moaspec.train.config import TrainConfig
    from moaspec.train.trainer import train

    config = _tiny_config(getattr(transformers, config_class), **settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    target = HFTarget(model, None, f"tiny-{family}")
    with pytest.raises(MoaspecError, match=f"the target's {type(model.model.layers[0]).__name__} computes something else"):
        MoADrafter(random_moa(target, tli=1), target, TreeConfig(depth=2, top_k=2, budget=3))
    MoADrafter(random_moa(target, tli=0), target, TreeConfig(depth=2, top_k=2, budget=3))  # no TLI: any layers
    with pytest.raises(MoaspecError, match="computes something else"):
        train(random_moa(target, tli=1), target, [], [], TrainConfig(method="moa", tli_layers=1, steps=1), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_tli_check_refuses_a_layer_without_rope() -> None:
    """SmolLM3's every 4th layer (its last one too) has no RoPE; target_layer_forward rotates
    anyway. With the tiny model's weights the difference (6e-5) is under the threshold (1e-4)."""
    import transformers

    from moaspec.nn.target_layers import check_tli_layers

    torch.manual_seed(0)
    model = transformers.SmolLM3ForCausalLM(_tiny_config(transformers.SmolLM3Config, num_hidden_layers=4)).eval()
    model.config._attn_implementation = "sdpa"
    layer = model.model.layers[-1]
    assert not layer.self_attn.use_rope
    with pytest.raises(MoaspecError, match="computes something else"):
        check_tli_layers([layer], model.model.rotary_emb)


@pytest.mark.parametrize(
    ("message", "said"),
    [("size mismatch for head.weight\n  copying a param of shape...", "size mismatch for head.weight"), ("", "RuntimeError")],
)
def test_weights_that_do_not_load_give_one_line(tmp_path, monkeypatch, message: str, said: str) -> None:
    """A checkpoint whose weights the net refuses is a MoaspecError naming the library's first
    line, also when the library's error says nothing (it was an IndexError)."""
    from moaspec.nn.checkpoint import save_checkpoint

    target = make_tiny_target("llama")
    net = random_moa(target)
    directory = save_checkpoint(tmp_path / "moa", "moa", net, target, {"depth": 1, "top_k": 2, "budget": 2})

    def refuse(self, state, *args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(MoADrafterNet, "load_state_dict", refuse)
    with pytest.raises(MoaspecError) as raised:
        MoADrafterNet.from_pretrained(directory, target)
    assert str(raised.value).endswith(f"weights do not match the recorded config ({said})")
