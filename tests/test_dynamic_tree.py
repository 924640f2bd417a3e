"""EAGLE-2 dynamic tree builder with a scripted drafter: beams, global rerank, ancestor closure."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from moaspec.config import TreeConfig
from moaspec.drafters.dynamic_tree import build_dynamic_tree
from moaspec.tree import ancestor_mask, depths

VOCAB = 7


class FixedLogProbs:
    """log p(next | path) from a seeded table keyed by the whole path: the tree must equal a
    brute-force EAGLE-2 expansion computed independently below."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.batches: list[list[tuple[int, ...]]] = []

    def table(self, path: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(hash((self.seed, path)) % (2**31))
        return torch.log_softmax(3 * torch.randn(VOCAB, generator=gen, dtype=torch.float64), -1)

    def start(self) -> torch.Tensor:
        self.batches = [[()]]
        return self.table(())

    def expand(self, token_ids: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        previous = self.batches[-1]
        paths = [(previous[int(p)] if p >= 0 else ()) + (int(t),) for t, p in zip(token_ids, parent)]
        assert all(len(path) == depth for path in paths)
        self.batches.append(paths)
        return torch.stack([self.table(path) for path in paths])


def brute_force(model: FixedLogProbs, config: TreeConfig) -> set[tuple[int, ...]]:
    """Every candidate path with its score, EAGLE-2 style, then the global top `budget`."""
    pool: dict[tuple[int, ...], float] = {}
    root_lp = model.table(())
    beams = []
    for token in torch.topk(root_lp, config.top_k).indices.tolist():
        pool[(token,)] = float(root_lp[token])
        beams.append((token,))
    for _ in range(2, config.depth + 1):
        level = {}
        for beam in beams:
            lp = model.table(beam)
            for token in torch.topk(lp, config.top_k).indices.tolist():
                level[beam + (token,)] = pool[beam] + float(lp[token])
        pool.update(level)
        beams = sorted(level, key=lambda path: -level[path])[: config.top_k]
    return set(sorted(pool, key=lambda path: -pool[path])[: config.budget])


@pytest.mark.parametrize("seed, depth, top_k, budget", list(itertools.product([0, 1, 2], [1, 3, 5], [1, 2, 4], [3, 16])))
def test_tree_matches_brute_force_and_is_well_formed(seed: int, depth: int, top_k: int, budget: int) -> None:
    model = FixedLogProbs(seed)
    config = TreeConfig(depth=depth, top_k=top_k, budget=budget)
    tree = build_dynamic_tree(99, model.start, model.expand, config)
    assert tree.token_ids[0] == 99 and tree.num_nodes - 1 == min(budget, len(brute_force(model, config)))
    assert int(depths(tree.parents).max()) <= depth
    mask = ancestor_mask(tree.parents)
    paths = set()
    for node in range(1, tree.num_nodes):
        ancestors = np.flatnonzero(mask[node]).tolist()[1:]  # without the root
        paths.add(tuple(tree.token_ids[ancestors].tolist()))
    assert paths == brute_force(model, config)


def test_reduced_vocabulary_maps_to_target_ids() -> None:
    model = FixedLogProbs(3)
    vocab_map = torch.tensor([10, 20, 30, 40, 50, 60, 70])
    seen_tokens: list[int] = []

    def expand(token_ids: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        seen_tokens.extend(token_ids.tolist())
        return model.expand(token_ids // 10 - 1, parent, depth)

    tree = build_dynamic_tree(5, model.start, expand, TreeConfig(depth=3, top_k=2, budget=6), vocab_map)
    assert set(tree.token_ids[1:].tolist()) <= set(vocab_map.tolist())
    assert set(seen_tokens) <= set(vocab_map.tolist())  # the drafter is fed target ids


def test_invalid_config() -> None:
    with pytest.raises(ValueError):
        TreeConfig(depth=0)


def test_sampled_tree_shape_and_probabilities() -> None:
    """top_k chains of `depth`; each row is the law the node was drawn from (siblings removed)."""
    from moaspec.drafters.dynamic_tree import build_sampled_tree

    model = FixedLogProbs(5)
    vocab_map = torch.tensor([1, 3, 4, 6, 7, 8, 9])  # draft ids -> target ids, target vocab 10
    config = TreeConfig(depth=3, top_k=2)

    def expand(token_ids: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        draft_ids = torch.searchsorted(vocab_map, token_ids)
        return model.expand(draft_ids, parent, depth)

    tree = build_sampled_tree(0, model.start, expand, config, 10, 1.0, torch.Generator().manual_seed(0), vocab_map)
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2, 3, 4]
    probs = tree.draft_probs
    assert probs.shape == (7, 10) and torch.allclose(probs[1:].sum(-1), torch.ones(6, dtype=torch.float64))
    assert (probs[:, [0, 2, 5]] == 0).all()  # outside the draft vocabulary
    root_law = torch.softmax(model.table(()), -1)
    torch.testing.assert_close(probs[1][vocab_map], root_law)
    first = int(torch.searchsorted(vocab_map, torch.from_numpy(tree.token_ids[1:2])))
    expected_second = root_law.clone()
    expected_second[first] = 0
    torch.testing.assert_close(probs[2][vocab_map], expected_second / expected_second.sum())
    assert probs[2][tree.token_ids[1]] == 0  # drawn without replacement
    for node in range(1, 7):
        assert probs[node][tree.token_ids[node]] > 0


def test_sampled_tree_nodes_are_drawn_from_their_recorded_laws(monkeypatch) -> None:
    """Every node is drawn from exactly the row `draft_probs` records for it, at a temperature
    other than 1 too (a chain drawn at temperature 1 while its row says T would pass the shape
    test above and break losslessness)."""
    from moaspec.drafters.dynamic_tree import build_sampled_tree

    model = FixedLogProbs(5)
    vocab_map = torch.tensor([1, 3, 4, 6, 7, 8, 9])
    laws: list[torch.Tensor] = []
    real_multinomial = torch.multinomial

    def recording(probs: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        laws.extend(probs.reshape(-1, probs.shape[-1]) / probs.reshape(-1, probs.shape[-1]).sum(-1, keepdim=True))
        return real_multinomial(probs, *args, **kwargs)

    def expand(token_ids: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        return model.expand(torch.searchsorted(vocab_map, token_ids), parent, depth)

    monkeypatch.setattr(torch, "multinomial", recording)
    tree = build_sampled_tree(0, model.start, expand, TreeConfig(depth=3, top_k=2), 10, 0.5, torch.Generator().manual_seed(0), vocab_map)
    assert len(laws) == tree.num_nodes - 1  # one draw per node, in node order
    for node, law in enumerate(laws, start=1):
        torch.testing.assert_close(tree.draft_probs[node][vocab_map], law, rtol=0, atol=1e-12)
    torch.testing.assert_close(laws[0], torch.softmax(model.table(()).double() / 0.5, -1), rtol=0, atol=1e-12)


def test_a_sampled_tree_takes_as_many_first_tokens_as_the_drafter_can_draw() -> None:
    """A mutation audit (session 50): at a low temperature the drafter's softmax underflows to
    fewer non-zero tokens than top_k; the first level then holds as many as it can draw, without
    replacement (torch.multinomial refuses a row of zeros: the tree was lost)."""
    from moaspec.drafters.dynamic_tree import build_sampled_tree

    def start() -> torch.Tensor:
        return torch.tensor([0.0, 8.99, 9.0, 1.0, -3.0])  # at T = 0.005: two tokens above 0 in float64

    def expand(token_ids: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        return torch.zeros(token_ids.shape[0], 5)

    tree = build_sampled_tree(0, start, expand, TreeConfig(depth=2, top_k=4), 5, 0.005, torch.Generator().manual_seed(0))
    assert int((torch.softmax(start().double() / 0.005, -1) > 0).sum()) == 2
    assert tree.parents.tolist() == [-1, 0, 0, 1, 2] and sorted(tree.token_ids[1:3].tolist()) == [1, 2]
    for node in range(1, tree.num_nodes):
        assert tree.draft_probs[node][tree.token_ids[node]] > 0


def test_a_sampled_tree_at_a_vanishing_temperature_follows_the_drafters_argmax() -> None:
    """temperature 1e-320 (in the OpenAI API's range): the drafter's log-probabilities / 1e-320
    overflowed, every row was NaN and the draw raised. Now each law is the point mass on the
    argmax: one chain (the only first token with mass), its nodes the argmax at each depth."""
    from moaspec.drafters.dynamic_tree import build_sampled_tree

    model = FixedLogProbs(5)
    tree = build_sampled_tree(0, model.start, model.expand, TreeConfig(depth=3, top_k=2), VOCAB, 1e-320,
                              torch.Generator().manual_seed(0), None)
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    laws = tree.draft_probs[1:]
    assert torch.equal(laws.sum(-1), torch.ones(3, dtype=torch.float64)) and set(laws.flatten().tolist()) == {0.0, 1.0}
    assert tree.token_ids[1] == int(model.table(()).argmax())
