"""From logits to the distribution tokens are drawn from: temperature, then top-k, then top-p.

The order and semantics follow transformers' logits warpers, so `--temperature/--top-k/--top-p`
mean here what they mean in `generate()`. No model code lives here.
"""

from __future__ import annotations

import torch

from moaspec.config import SamplingConfig


def target_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Warped probabilities of the target.  logits: [..., V] -> probs [..., V] (rows sum to 1).

    Greedy sampling gives the point mass on the argmax (ties: lowest index), so greedy decoding
    is the temperature -> 0 limit of the same verifier.
    """
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    scores = tempered(logits, sampling.temperature)
    if sampling.top_k > 0 and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        scores = _top_p_filter(scores, sampling.top_p)
    return torch.softmax(scores, dim=-1)


def tempered(scores: torch.Tensor, temperature: float) -> torch.Tensor:
    """scores / temperature, each row shifted to a maximum of 0 first: the same softmax, and a
    temperature so small that scores / temperature overflow (1e-320: the request's range is
    [0, 2]) gives the point mass on the row's maxima instead of NaN.  scores: [..., V] -> [..., V]"""
    return (scores - scores.amax(-1, keepdim=True)) / temperature


def _top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (at least one)."""
    sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_scores, dim=-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    remove_sorted = mass_before >= top_p
    remove_sorted[..., 0] = False
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))
