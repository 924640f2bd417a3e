"""Target activations a drafter is trained on, computed online for one sequence.

One frozen target forward (prefill) gives everything: per-layer keys/values (MoA memory input),
the post-norm last hidden state (feature targets, and the teacher distribution through the LM
head), and for TLI the residual stream entering layer L-k plus the last k layers' keys/values.
Online rather than cached: per-layer KV is 2*n_kv*head_dim*L values per token (11,520 for
SmolLM2, 23 KB in fp16), so a cache of a useful data set would not fit a session's disk budget,
while the forward runs at prefill speed (~420 tok/s here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moaspec.target import HFTarget


@dataclass(frozen=True)
class TargetFeatures:
    """For a sequence of T tokens.

    layer_kv:     [T, L, kv_dim] per-layer [k_h, v_h] (MoA memory input).
    final_hidden: [T, D] post-norm last hidden state (h_t: predicts token t+1).
    tli_kv:       the last k layers' keys/values, each [Hkv, T, d] (empty without TLI).
    tli_hidden:   [T, D] residual stream entering layer L-k, or None without TLI.
    """

    layer_kv: torch.Tensor
    final_hidden: torch.Tensor
    tli_kv: list[tuple[torch.Tensor, torch.Tensor]]
    tli_hidden: torch.Tensor | None


def target_features(target: HFTarget, input_ids: torch.Tensor, tli_layers: int = 0, layer_kv: bool = True) -> TargetFeatures:
    """Run the target over input_ids [T] once and collect what the drafters need.

    Not under inference mode: the returned tensors feed trainable layers, and inference tensors
    cannot be saved for backward; everything is copied out of the (inference-mode) target.
    """
    num_layers = target.num_layers
    hidden_layers = (num_layers - tli_layers, num_layers) if tli_layers else (num_layers,)
    target.reset()
    out = target.prefill(input_ids, hidden_layers)
    kv = target.layer_kv(0, input_ids.numel()).clone() if layer_kv else torch.empty(0)
    tli_kv = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in target.cache.layers[num_layers - tli_layers :]] if tli_layers else []
    features = TargetFeatures(
        layer_kv=kv,
        final_hidden=out.hidden[:, -1].clone(),
        tli_kv=tli_kv,
        tli_hidden=out.hidden[:, 0].clone() if tli_layers else None,
    )
    target.reset()
    return features
