"""Target activations a drafter is trained on, computed online for one sequence (or for a
micro-batch of them in one padded forward).

One frozen target forward (prefill) gives everything: per-layer keys/values (MoA memory input),
the post-norm last hidden state (feature targets, and the target's distribution through the LM
head), and for TLI the residual stream entering layer L-k plus the last k layers' keys/values.
`OnlineFeatures` runs that forward at every step; `feature_cache.FeatureCache` stores it once on
disk for every epoch and every run (the measured trade-off is in feature_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from moaspec.targets.hf import HFTarget, per_head_kv


@dataclass(frozen=True)
class TrainSample:
    """input_ids [T]: prompt then response; response_start: index of the first response token;
    index: the record's position in the data set (the feature cache's key), -1 when not from one;
    loss_spans: the [start, end) token ranges to learn (assistant turns of a whole conversation),
    None for one response from response_start to the end."""

    input_ids: torch.Tensor
    response_start: int
    index: int = -1
    loss_spans: tuple[tuple[int, int], ...] | None = None

    def spans(self) -> tuple[tuple[int, int], ...]:
        """The [start, end) ranges of tokens to learn, in order."""
        return self.loss_spans if self.loss_spans is not None else ((self.response_start, self.input_ids.numel()),)

    def learned_tokens(self) -> list[int]:
        """The token ids inside the spans (what the draft vocabulary is chosen from)."""
        ids = self.input_ids.tolist()
        return [token for start, end in self.spans() for token in ids[start:end]]


@dataclass(frozen=True)
class TargetFeatures:
    """For a sequence of T tokens.

    layer_kv:          [T, Lk, kv_dim] per-layer [k_h, v_h] of the requested layers (MoA memory
                       input; empty for EAGLE).
    final_hidden:      [T, D] post-norm last hidden state (h_t: predicts token t+1).
    target_logsumexp: [T] log-sum-exp of the target's full-vocabulary logits final_hidden @ W.T,
                       so the target's probabilities of any vocabulary subset are exp(logit - lse).
    target_argmax:    [T] long, the target's most likely next token (full vocabulary) after t.
    tli_kv:            the last k layers' keys/values, each [Hkv, T, d] (empty without TLI).
    tli_hidden:        [T, D] residual stream entering layer L-k, or None without TLI.
    """

    layer_kv: torch.Tensor
    final_hidden: torch.Tensor
    target_logsumexp: torch.Tensor
    target_argmax: torch.Tensor
    tli_kv: list[tuple[torch.Tensor, torch.Tensor]]
    tli_hidden: torch.Tensor | None


class FeatureSource(Protocol):
    """Where the trainer gets a sample's target features from."""

    def features(self, sample: TrainSample, tli_layers: int, kv_layers: tuple[int, ...]) -> TargetFeatures:
        """kv_layers: the target layers whose keys/values `layer_kv` holds (in that order)."""
        ...

    def batch_features(self, samples: list[TrainSample], tli_layers: int, kv_layers: tuple[int, ...]) -> list[TargetFeatures]:
        """`features` of each sample, in order (a source may compute them together)."""
        ...


def target_summary(
    hidden: torch.Tensor, lm_head_weight: torch.Tensor, chunk: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, D], lm_head_weight [V, D] -> ([T] float32 log-sum-exp, [T] long argmax) of the
    logits hidden @ W.T, computed in chunks of rows."""
    lse, argmax = [], []
    for part in hidden.split(chunk):
        logits = (part @ lm_head_weight.T).float()
        lse.append(torch.logsumexp(logits, dim=-1))
        argmax.append(logits.argmax(-1))
    if not lse:
        return torch.zeros(0), torch.zeros(0, dtype=torch.long)
    return torch.cat(lse), torch.cat(argmax)


def collected_features(
    target: HFTarget,
    final_hidden: torch.Tensor,
    tli_hidden: torch.Tensor | None,
    layer_caches: list[tuple[torch.Tensor, torch.Tensor]],
    tli_layers: int,
    kv_layers: tuple[int, ...],
) -> TargetFeatures:
    """One sequence's features from its target pass: final_hidden [T, D] (post-norm), tli_hidden
    [T, D] (the stream entering layer L-k) or None, layer_caches: every layer's keys/values
    [Hkv, T, d]. Everything is copied, so the tensors can feed trainable layers (inference
    tensors cannot be saved for backward)."""
    final_hidden = final_hidden.clone()
    lse, argmax = target_summary(final_hidden, target.lm_head.weight)
    kv = torch.stack([per_head_kv(*layer_caches[i]) for i in kv_layers], dim=1) if kv_layers else torch.empty(0)
    return TargetFeatures(
        layer_kv=kv,
        final_hidden=final_hidden,
        target_logsumexp=lse,
        target_argmax=argmax,
        tli_kv=[(k.clone(), v.clone()) for k, v in layer_caches[target.num_layers - tli_layers :]] if tli_layers else [],
        tli_hidden=tli_hidden.clone() if tli_layers else None,
    )


@torch.no_grad()
def target_features(
    target: HFTarget, input_ids: torch.Tensor, tli_layers: int = 0, kv_layers: tuple[int, ...] = ()
) -> TargetFeatures:
    """Run the target over input_ids [T] once (a prefill of an empty context) and collect what
    the drafters need."""
    num_layers = target.num_layers
    hidden_layers = (num_layers - tli_layers, num_layers) if tli_layers else (num_layers,)
    target.reset()
    out = target.prefill(input_ids, hidden_layers)
    layer_caches = [(layer.keys[0], layer.values[0]) for layer in target.cache.layers]
    features = collected_features(target, out.hidden[:, -1], out.hidden[:, 0], layer_caches, tli_layers, kv_layers)
    target.reset()
    return features


@torch.no_grad()
def batch_target_features(
    target: HFTarget, sequences: list[torch.Tensor], tli_layers: int = 0, kv_layers: tuple[int, ...] = ()
) -> list[TargetFeatures]:
    """`target_features` of several sequences [T_b] in one forward, right-padded to the longest
    (causal attention keeps the padding after a sequence's end out of its rows; equal to one at a
    time up to rounding, tested): the target's share of a `--micro-batch` step on a GPU. One
    sequence takes target_features."""
    if len(sequences) == 1:
        return [target_features(target, sequences[0], tli_layers, kv_layers)]
    lengths = [sequence.numel() for sequence in sequences]
    length = max(lengths)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : lengths[row]] = sequence
    device = target.device
    with torch.inference_mode():
        cache = DynamicCache()  # full layers, as HFTarget keeps (targets/hf_attention.py)
        out = target.model(
            input_ids=ids.to(device), position_ids=torch.arange(length)[None].expand(len(sequences), -1).to(device),
            **{target.cache_argument: cache}, use_cache=True, output_hidden_states=True, logits_to_keep=1,
        )
    final, stream = out.hidden_states[target.num_layers], out.hidden_states[target.num_layers - tli_layers]
    return [
        collected_features(
            target, final[row, :n], stream[row, :n],
            [(layer.keys[row, :, :n], layer.values[row, :, :n]) for layer in cache.layers], tli_layers, kv_layers,
        )
        for row, n in enumerate(lengths)
    ]


class OnlineFeatures:
    """A FeatureSource that runs the target for every request (no disk, ~2x slower training)."""

    def __init__(self, target: HFTarget) -> None:
        self.target = target

    def features(self, sample: TrainSample, tli_layers: int, kv_layers: tuple[int, ...]) -> TargetFeatures:
        return target_features(self.target, sample.input_ids, tli_layers, kv_layers)

    def batch_features(self, samples: list[TrainSample], tli_layers: int, kv_layers: tuple[int, ...]) -> list[TargetFeatures]:
        return batch_target_features(self.target, [sample.input_ids for sample in samples], tli_layers, kv_layers)
