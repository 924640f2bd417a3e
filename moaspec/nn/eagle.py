"""THE EAGLE drafter network (Li et al. 2024, EAGLE §3.2; EAGLE-2 drafts with it), the baseline
of moa_reference.md §4.3, used by training and inference.

Position convention (EAGLE's shift by one; MoA has no shift, moa_reference.md §6.1). Verified
tokens x_0..x_{n-1} sit at positions 0..n-1 and h_t [D] is the target's post-norm last hidden
state at t (it produces the target's logits for x_{t+1}). The drafter's input at position t is
the pair
    in_t = fc([embed(x_{t+1}), h_t])                     (the feature of t, the token after it)
and one causal decoder layer over in_0..in_t gives
    f_{t+1} = layer(in_0..in_t)[t]                       a prediction of h_{t+1}
    logits_{t+1} = f_{t+1} @ lm_head.T                   the draft distribution of x_{t+2}
No norm is applied before the LM head: f is trained to match the target's *post-norm* state.
During drafting, a node's predicted feature stands in for the true h of its position, so a child
token y of a node at position p enters as fc([embed(y), f_p]) at position p.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from moaspec.nn.drafter_net import DrafterNet
from moaspec.nn.layers import DecoderLayer, additive_mask
from moaspec.nn.target_config import target_norm_eps, target_rope_theta
from moaspec.nn.target_parts import TargetParts


@dataclass(frozen=True)
class EagleConfig:
    """Sizes of the EAGLE drafter: one decoder layer with the target's own shape (§4.3)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    draft_vocab_size: int = 0  # 0 = the target's full vocabulary

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_kv_heads must divide num_heads")
        if self.draft_vocab_size < 0:
            raise ValueError(f"draft_vocab_size must be >= 0, got {self.draft_vocab_size}")

    @staticmethod
    def for_target(target_config: Any, draft_vocab_size: int = 0) -> EagleConfig:
        hidden = target_config.hidden_size
        heads = target_config.num_attention_heads
        return EagleConfig(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=getattr(target_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(target_config, "head_dim", None) or hidden // heads,
            intermediate_size=getattr(target_config, "intermediate_size", None) or 4 * hidden,  # GPT-2: 4 x hidden
            rope_theta=target_rope_theta(target_config),
            rms_norm_eps=target_norm_eps(target_config),
            draft_vocab_size=draft_vocab_size,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class EagleDrafterNet(DrafterNet):
    """fc over [token embedding, feature], then one decoder layer. See the module docstring."""

    method = "eagle"
    config_class = EagleConfig

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.decoder_layer = DecoderLayer(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps, c.rope_theta
        )
        self._register_draft_vocab()
        self.reset_parameters()

    def pair_inputs(self, parts: TargetParts, token_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """token_ids [..., n] (x_{t+1}) and features [..., n, D] (h_t or a predicted f_t) -> inputs
        [..., n, D]."""
        embeds = parts.embed_tokens(token_ids).to(self.fc.weight.dtype)
        return self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))

    def forward_train(self, parts: TargetParts, input_ids: torch.Tensor, target_hidden: torch.Tensor) -> torch.Tensor:
        """input_ids [T] = x_0..x_{T-1}; target_hidden [T, D] = the true h_0..h_{T-1} (post-norm).

        One causal pass over the T - 1 pairs (x_{t+1}, h_t), t = 0..T-2, all with true features
        (as in EAGLE's training). -> [T - 1, D]: row t is f_{t+1}, compared with h_{t+1}; its
        logits predict x_{t+2}. Training noise, if any, is the caller's (added to target_hidden).
        A batch padded to T: input_ids [B, T], target_hidden [B, T, D] -> [B, T - 1, D] (causal:
        the padding after a sequence's end never reaches its rows).
        """
        num_pairs = input_ids.shape[-1] - 1
        positions = torch.arange(num_pairs, device=input_ids.device)
        inputs = self.pair_inputs(parts, input_ids[..., 1:], target_hidden[..., :-1, :])
        causal = positions[None, :] <= positions[:, None]
        out, _ = self.decoder_layer(inputs, positions, additive_mask(causal, inputs.dtype))
        return out
