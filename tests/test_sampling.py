"""`target_probs`: greedy, temperature, top-k and top-p, checked by hand and against transformers.

The reference for the warpers is transformers' own `TemperatureLogitsWarper`,
`TopKLogitsWarper` and `TopPLogitsWarper`, applied in `generate()`'s order.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from moaspec.config import SamplingConfig
from moaspec.sampling import target_probs


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(rows, vocab, generator=gen, dtype=torch.float64)


def test_greedy_gives_one_hot_argmax() -> None:
    logits = random_logits(8, 11, seed=0)
    probs = target_probs(logits, SamplingConfig(temperature=0.0))
    assert probs.dtype == logits.dtype
    expected = torch.zeros_like(logits)
    expected[torch.arange(8), logits.argmax(-1)] = 1.0
    assert torch.equal(probs, expected)


def test_greedy_ties_go_to_lowest_index_and_ignore_filters() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    probs = target_probs(logits, SamplingConfig(temperature=0.0, top_k=2, top_p=0.5))
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_divides_log_odds(temperature: float) -> None:
    logits = random_logits(4, 9, seed=1)
    probs = target_probs(logits, SamplingConfig(temperature=temperature))
    assert torch.allclose(probs.sum(-1), torch.ones(4, dtype=torch.float64), atol=1e-12)
    log_odds = probs.log() - probs[:, :1].log()
    assert torch.allclose(log_odds, (logits - logits[:, :1]) / temperature, atol=1e-9)


@pytest.mark.parametrize("temperature", [1e-320, 1e-300, 1e-40])
def test_a_temperature_too_small_for_the_division_gives_the_point_mass_on_the_maxima(temperature: float) -> None:
    """Bug (an audit of the OpenAI API): `temperature` 1e-320 is in the request's range [0, 2],
    but logits / 1e-320 overflow to +-inf in float64, softmax made NaN, and the draw raised: a 500.
    Each row is shifted to a maximum of 0 before the division (the same softmax): the limit, the
    point mass on the row's maximum (shared among equal maxima), as greedy is. The draft paths
    (a drafter's own pick, the sampled tree) divide the same way."""
    from moaspec.drafters.base import pick_alone

    logits = torch.tensor([[1.0, 3.0, 3.0 - 1e-3, -math.inf], [2.0, 2.0, -1.0, 0.0]], dtype=torch.float64)
    probs = target_probs(logits, SamplingConfig(temperature=temperature))
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    assert torch.equal(probs, expected)
    log_probs = torch.log_softmax(logits[0], -1)  # a drafter's, its maximum below 0
    assert pick_alone(log_probs, SamplingConfig(temperature=temperature), torch.Generator().manual_seed(0)) == 1


def test_the_shift_before_the_temperature_leaves_ordinary_temperatures_as_they_were() -> None:
    logits = random_logits(6, 50, seed=4, scale=8.0)
    for temperature in (0.01, 0.7, 2.0):
        probs = target_probs(logits, SamplingConfig(temperature=temperature))
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, -1), rtol=1e-12, atol=1e-300)


def test_temperature_one_is_plain_softmax() -> None:
    logits = random_logits(3, 7, seed=2)
    probs = target_probs(logits, SamplingConfig(temperature=1.0))
    assert torch.allclose(probs, torch.softmax(logits, -1), atol=1e-15)


@pytest.mark.parametrize("top_k", [1, 2, 5, 10])
def test_top_k_keeps_exactly_the_k_largest(top_k: int) -> None:
    logits = random_logits(6, 13, seed=3)
    probs = target_probs(logits, SamplingConfig(temperature=0.9, top_k=top_k))
    for row_logits, row in zip(logits, probs):
        kept = set(torch.nonzero(row).flatten().tolist())
        assert kept == set(torch.topk(row_logits, top_k).indices.tolist())
        idx = torch.tensor(sorted(kept))
        assert torch.allclose(row[idx], torch.softmax(row_logits[idx] / 0.9, -1), atol=1e-12)


def test_top_k_at_least_vocab_size_is_a_no_op() -> None:
    logits = random_logits(2, 5, seed=4)
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_k=5))
    assert torch.allclose(probs, torch.softmax(logits, -1), atol=1e-15)


def test_top_p_handcrafted_boundaries() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64).log()
    for top_p, support in [(0.45, [0]), (0.75, [0, 1]), (0.9, [0, 1, 2]), (0.99, [0, 1, 2, 3])]:
        probs = target_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))[0]
        assert torch.nonzero(probs).flatten().tolist() == support
        kept = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)[support]
        assert torch.allclose(probs[support], kept / kept.sum(), atol=1e-12)


@pytest.mark.parametrize(("top_p", "support"), [(0.5, [1]), (0.75, [1, 3])])
def test_top_p_stops_when_the_mass_is_reached_exactly(top_p: float, support: list[int]) -> None:
    # Binary fractions make the masses of the most likely tokens exact, so the kept set must end
    # exactly at top_p. (transformers sums the other way round, from the least likely token, and
    # its rounding can keep one more token at such an exact boundary; no comparison here.)
    logits = torch.tensor([[0.125, 0.5, 0.125, 0.25]], dtype=torch.float64).log()
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))[0]
    assert torch.nonzero(probs).flatten().tolist() == support


def test_top_p_keeps_at_least_one_token() -> None:
    logits = random_logits(5, 9, seed=5, scale=0.1)  # near-uniform: top token far below top_p
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_p=1e-6))
    assert torch.equal((probs > 0).sum(-1), torch.ones(5, dtype=torch.long))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.max(-1).values, torch.ones(5, dtype=torch.float64))


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.8, 0.95])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass(top_p: float) -> None:
    logits = random_logits(20, 10, seed=6)
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
    full = torch.softmax(logits, -1).numpy()
    for row_full, row in zip(full, probs.numpy()):
        order = np.argsort(-row_full)
        cumulative = np.cumsum(row_full[order])
        size = int(np.searchsorted(cumulative, top_p)) + 1  # first prefix with mass >= top_p
        assert set(np.nonzero(row)[0]) == set(order[:size].tolist())
        kept = order[:size]
        np.testing.assert_allclose(row[kept], row_full[kept] / row_full[kept].sum(), atol=1e-12)


def hf_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """transformers' warpers in generate()'s order: temperature, top-k, top-p; then softmax."""
    scores = logits.clone()
    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    if sampling.temperature != 1.0:
        scores = TemperatureLogitsWarper(sampling.temperature)(input_ids, scores)
    if sampling.top_k > 0:
        scores = TopKLogitsWarper(sampling.top_k)(input_ids, scores)
    if sampling.top_p < 1.0:
        scores = TopPLogitsWarper(sampling.top_p)(input_ids, scores)
    return torch.softmax(scores, -1)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, top_k=5),
        SamplingConfig(temperature=0.7, top_k=1),
        SamplingConfig(temperature=1.3, top_k=40),
        SamplingConfig(temperature=1.0, top_p=0.9),
        SamplingConfig(temperature=0.6, top_p=0.5),
        SamplingConfig(temperature=1.5, top_p=0.05),
        SamplingConfig(temperature=0.8, top_k=8, top_p=0.7),
        SamplingConfig(temperature=1.0, top_k=3, top_p=0.99),
    ],
)
def test_matches_transformers_warpers(sampling: SamplingConfig) -> None:
    logits = random_logits(64, 50, seed=7)
    ours = target_probs(logits, sampling)
    reference = hf_probs(logits, sampling)
    assert torch.equal(ours > 0, reference > 0)
    assert torch.allclose(ours, reference, rtol=0.0, atol=1e-12)
    if sampling.top_k > 0:
        assert bool(((ours > 0).sum(-1) <= sampling.top_k).all())
    if sampling.top_p < 1.0:
        assert bool(((ours > 0).sum(-1) < 50).any()), "the case must actually filter something"


def test_warped_rows_are_distributions() -> None:
    logits = random_logits(10, 30, seed=8)
    probs = target_probs(logits, SamplingConfig(temperature=0.9, top_k=7, top_p=0.8))
    assert bool((probs >= 0).all())
    assert all(math.isclose(s, 1.0, abs_tol=1e-12) for s in probs.sum(-1).tolist())
