"""EAGLE drafter: training/inference equivalence at the root step, drafting on predicted features
(chains and trees), SA cache invariants, greedy losslessness (full and reduced vocabulary).
Tiny random targets, float64."""

from __future__ import annotations

import pytest
import torch
from conftest import make_random_drafter_net, make_tiny_target
from drafter_checks import check_beams_against_their_paths

from moaspec.config import GenerationConfig, SamplingConfig, TreeConfig
from moaspec.drafters import make_drafter
from moaspec.drafters.base import VerifiedUpdate
from moaspec.drafters.eagle import EagleDrafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError
from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
from moaspec.nn.layers import additive_mask
from moaspec.nn.target_parts import TargetParts
from moaspec.targets.hf import HFTarget
from moaspec.tree import DraftTree, depths

NO_STOP: frozenset[int] = frozenset()
PROMPT = [5, 17, 33, 2, 71, 5, 17]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny float64 ops on 2 shared cores: extra intra-op threads only contend (orders of
    magnitude slower under load), so this module runs single-threaded."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def random_eagle(target: HFTarget, draft_vocab: torch.Tensor | None = None, seed: int = 0) -> EagleDrafterNet:
    size = 0 if draft_vocab is None else draft_vocab.numel()
    config = EagleConfig.for_target(target.config, draft_vocab_size=size)
    return make_random_drafter_net(EagleDrafterNet, config, target, draft_vocab, seed)


def causal_pass(net: EagleDrafterNet, inputs: torch.Tensor) -> torch.Tensor:
    """The decoder layer over inputs [n, D] at positions 0..n-1, causal, no cache -> [n, D]."""
    positions = torch.arange(inputs.shape[0])
    out, _ = net.decoder_layer(inputs, positions, additive_mask(positions[None, :] <= positions[:, None], inputs.dtype))
    return out


def drafted_by_hand(
    net: EagleDrafterNet, parts: TargetParts, tokens: torch.Tensor, hidden: torch.Tensor, root: int, path: list[int]
) -> list[torch.Tensor]:
    """Log-probs [Vd] after the root and after each token of a root-to-node path, recomputed from
    scratch: pairs (tokens[t+1], hidden[t]) for t < root (true features; tokens[root] is the root),
    then each path token paired with the feature predicted for its parent."""
    head = net.head_weight(parts)
    inputs = net.pair_inputs(parts, tokens[1 : root + 1], hidden[:root])
    feature = causal_pass(net, inputs)[-1]
    log_probs = [torch.log_softmax(feature @ head.T, dim=-1)]
    for token in path:
        inputs = torch.cat([inputs, net.pair_inputs(parts, torch.tensor([token]), feature[None])])
        feature = causal_pass(net, inputs)[-1]
        log_probs.append(torch.log_softmax(feature @ head.T, dim=-1))
    return log_probs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_root_step_equals_training_forward_and_deeper_steps_use_predicted_features(family: str) -> None:
    """Drafting cycles through the real inference path (features from the target's incremental
    prefill/verify, SA cache cropped and re-fed): the root step equals the training forward at
    the same pair; each teacher-forced deeper step equals a by-hand recomputation on the
    drafter's own predicted features. The last drafted token of each cycle is never accepted,
    some cycles accept only the root, and some propose twice: a discarded proposal with a wrong
    root before the real one, or after it (then accept must not keep the wrong root's pair)."""
    target = make_tiny_target(family)
    net = random_eagle(target)
    parts = target.parts(0)
    length, prompt_len, boundaries = 26, 6, [5, 9, 14, 15, 16, 22, 25]
    tokens = torch.randint(0, target.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    layers = (target.num_layers,)

    drafter = EagleDrafter(net, target)
    out = target.prefill(tokens[:prompt_len], layers)
    drafter.accept(VerifiedUpdate(tokens[:prompt_len], 0, out.hidden, target))
    hidden_chunks = [out.hidden[:, 0]]
    root_steps: dict[int, torch.Tensor] = {}
    chains: dict[int, list[torch.Tensor]] = {}

    def discarded_proposal(root: int) -> None:
        drafter.start((int(tokens[root]) + 1) % target.vocab_size)
        drafter.expand(tokens[:2], torch.tensor([-1, -1]), 1)

    for cycle, (block_start, block_end) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        root = block_start + 1
        if cycle % 3 == 1:
            discarded_proposal(root)
        root_steps[root] = drafter.start(int(tokens[root]))[0]
        chains[root], parent = [], torch.tensor([-1])
        for depth in range(1, min(block_end - root + 1, length - 1 - root) + 1):
            chains[root].append(drafter.expand(tokens[root + depth : root + depth + 1], parent, depth)[0])
            parent = torch.tensor([0])
        if cycle % 3 == 2:
            discarded_proposal(root)
        committed = tokens[root : block_end + 1]
        start = target.num_cached
        out = target.verify(DraftTree.chain(committed), layers)
        target.commit(list(range(committed.numel())))
        drafter.accept(VerifiedUpdate(committed, start, out.hidden, target))
        hidden_chunks.append(out.hidden[:, 0])
        # only pairs with true features (and verified tokens) stay cached; the rest wait unpaired
        assert drafter.sa_kv[0].shape[1] == drafter.sa_valid
        assert drafter.sa_valid == (start if cycle % 3 != 2 else start - len(hidden_chunks[-2]))
        assert drafter.unpaired_hidden.shape[0] == len(drafter.history) - drafter.sa_valid

    hidden = torch.cat(hidden_chunks)  # [length, D]: the features inference saw
    training = torch.log_softmax(net.forward_train(parts, tokens, hidden) @ net.head_weight(parts).T, dim=-1)
    assert training.shape[0] == length - 1
    for root, log_probs in root_steps.items():
        torch.testing.assert_close(log_probs, training[root - 1], rtol=0, atol=1e-10)
        path = tokens[root + 1 : root + 1 + len(chains[root])].tolist()
        by_hand = drafted_by_hand(net, parts, tokens, hidden, root, path)
        for step, log_probs_drafted in zip(by_hand, [log_probs, *chains[root]]):
            torch.testing.assert_close(log_probs_drafted, step, rtol=0, atol=1e-10)


@torch.no_grad()
def test_tree_nodes_see_only_their_own_path() -> None:
    """Several beams per level at one position: each node's log-probs equal the chain
    recomputation along its own root-to-node path (tree mask and parent-feature indexing)."""
    target = make_tiny_target("llama")
    net = random_eagle(target, seed=3)
    parts = target.parts(0)
    prompt = torch.tensor([4, 8, 15, 16, 23, 42])
    out = target.prefill(prompt, (target.num_layers,))
    drafter = EagleDrafter(net, target)
    drafter.accept(VerifiedUpdate(prompt, 0, out.hidden, target))
    root = 7
    tokens = torch.cat([prompt, torch.tensor([root])])
    hidden = out.hidden[:, 0]
    drafter.start(root)
    check_beams_against_their_paths(drafter, lambda path: drafted_by_hand(net, parts, tokens, hidden, 6, path)[-1])
    assert drafter.sa_kv[0].shape[1] == len(prompt) + 6  # true pairs + one entry per drafted node


class CheckedEagleDrafter(EagleDrafter):
    """Checks the cache invariant after every accept and records every proposal."""

    def reset(self) -> None:
        super().reset()
        self.proposals: list[DraftTree] = []
        self.num_accepts = 0

    def accept(self, update: VerifiedUpdate) -> None:
        super().accept(update)
        self.num_accepts += 1
        assert self.sa_kv[0].shape[1] == self.sa_valid == update.start_pos  # no tree node left
        assert self.unpaired_hidden.shape[0] == len(self.history) - self.sa_valid == len(update.token_ids)

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree:
        self.proposals.append(super().propose(root_id, sampling, generator))
        return self.proposals[-1]


def greedy_reference(target: HFTarget, max_new: int) -> list[int]:
    out = target.model.generate(
        torch.tensor([PROMPT]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(PROMPT) :].tolist()


def overfit(net: EagleDrafterNet, target: HFTarget, token_ids: list[int], steps: int = 60) -> None:
    """Fit the net's features to one sequence (feature loss only), so that real drafts get
    accepted and the engine exercises partial and full acceptance."""
    tokens = torch.tensor(token_ids)
    target.reset()
    with torch.no_grad():
        hidden = target.prefill(tokens, (target.num_layers,)).hidden[:, 0].to(next(net.parameters()).dtype, copy=True)  # [T, D]
    target.reset()
    parts = target.parts(0)
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = torch.nn.functional.smooth_l1_loss(net.forward_train(parts, tokens, hidden), hidden[1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    net.zero_grad(set_to_none=True)
    target.model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
def test_greedy_output_identical_with_eagle(family: str, reduced: bool) -> None:
    target = make_tiny_target(family)
    expected = greedy_reference(target, 40)
    draft_vocab = None
    if reduced:  # 40 ids: every other token the target emits, the rest random
        emitted = sorted(set(expected[::2]))
        shuffled = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(2)).tolist()
        others = [i for i in shuffled if i not in emitted]
        draft_vocab = torch.tensor(sorted(emitted + others[: 40 - len(emitted)]))
    net = random_eagle(target, draft_vocab)
    overfit(net, target, PROMPT + expected)
    tree = TreeConfig(depth=4, top_k=3, budget=8)
    drafter = CheckedEagleDrafter(net, target, tree)
    result = Engine(target, drafter).generate(PROMPT, generation=GenerationConfig(max_new_tokens=40), stop_ids=NO_STOP)
    assert result.token_ids == expected
    assert drafter.num_accepts == result.stats.num_verifications + 1  # prompt, then every verification
    assert sum(result.stats.accepted_depth[1:]) > 0  # drafts were really accepted, at depth >= 2 too
    pool = tree.top_k + (tree.depth - 1) * tree.top_k**2
    for proposal in drafter.proposals:
        assert proposal.num_nodes - 1 == min(tree.budget, pool)
        assert int(depths(proposal.parents).max()) <= tree.depth
        if draft_vocab is not None:
            assert set(proposal.token_ids[1:].tolist()) <= set(draft_vocab.tolist())


def test_config_follows_target_and_misuse_is_rejected() -> None:
    target = make_tiny_target("qwen2")
    config = EagleConfig.for_target(target.config, draft_vocab_size=10)
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (64, 4, 2, 16)
    assert config.intermediate_size == target.config.intermediate_size
    assert EagleConfig(**config.to_dict()) == config
    net = EagleDrafterNet(config)
    assert net.draft_vocab_ids.shape == (10,) and net.fc.in_features == 2 * net.fc.out_features
    drafter = EagleDrafter(random_eagle(target), target)
    assert drafter.hidden_layers == (target.num_layers,)
    with pytest.raises(ValueError, match="at least one verified token"):
        drafter.start(3)
    with pytest.raises(ValueError, match="last hidden state"):
        drafter.accept(VerifiedUpdate(torch.tensor([1, 2]), 0, None, target))
    with pytest.raises(ValueError, match="num_kv_heads"):
        EagleConfig(**{**config.to_dict(), "num_kv_heads": 3})


def test_checkpoint_round_trip_and_wrong_target(tmp_path) -> None:
    target = make_tiny_target("llama")
    net = random_eagle(target, draft_vocab=torch.arange(0, 97, 2))
    tree = TreeConfig(depth=3, top_k=2, budget=6)
    path = net.save_pretrained(tmp_path / "eagle", target, tree=tree.__dict__, dtype=torch.float64)
    loaded = make_drafter(str(path), target)
    assert isinstance(loaded, EagleDrafter) and loaded.tree_config == tree
    assert loaded.net.config == net.config and torch.equal(loaded.net.draft_vocab_ids, net.draft_vocab_ids)
    prompt = torch.tensor([4, 8, 15, 16, 23])
    update = VerifiedUpdate(prompt, 0, target.prefill(prompt, (target.num_layers,)).hidden, target)
    original = EagleDrafter(net, target, tree)
    for drafter in (original, loaded):
        drafter.accept(update)
    torch.testing.assert_close(loaded.start(42), original.start(42), rtol=0, atol=0)

    other = make_tiny_target("llama", seed=1)
    with pytest.raises(MoaspecError, match="trained for target"):
        make_drafter(str(path), other)


def test_a_training_run_directory_is_taken_as_its_checkpoint(tmp_path) -> None:
    """`--drafter RUN` (a `moaspec train` run, not RUN/checkpoint) loads the run's drafter, as
    `train --init-from RUN` does (an audit found the one accepted and the other refused)."""
    from moaspec.drafters import checkpoint_directory

    target = make_tiny_target("llama")
    net = random_eagle(target, draft_vocab=torch.arange(0, 97, 2))
    net.save_pretrained(tmp_path / "run" / "checkpoint", target, tree=TreeConfig(depth=2, top_k=1, budget=2).__dict__)
    run = tmp_path / "run"
    assert checkpoint_directory(str(run), target.name) == run / "checkpoint"
    assert checkpoint_directory(f"{run}+ngram", target.name) == run / "checkpoint"
    for spec in (str(run), f"{run}+ngram"):
        drafter = make_drafter(spec, target)
        assert isinstance(drafter, EagleDrafter) and drafter.tree_config == TreeConfig(depth=2, top_k=1, budget=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MoaspecError, match="is not a drafter checkpoint"):
        make_drafter(str(tmp_path / "empty"), target)
