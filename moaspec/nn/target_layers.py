"""Run one of the target's own (frozen) decoder layers with explicit context keys/values.

Target Layer Inference feeds the drafter's output through the target's last k layers. Those
layers must attend to keys/values the target never stored together (true states of verified
tokens next to drafted states), so we compute the transformers layer by hand from its
submodules instead of through its cache API. Llama and Qwen2 layers (q/k/v biases allowed).
"""

from __future__ import annotations

import torch
from torch import nn

from moaspec.nn.layers import apply_rope, attend


def target_rope(rotary_emb: nn.Module, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own cos/sin at positions [T] -> two [T, head_dim] (bit-identical to its forward)."""
    cos, sin = rotary_emb(like[None], positions[None])
    return cos[0], sin[0]


def target_layer_forward(
    layer: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    context: tuple[torch.Tensor, torch.Tensor] | None,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One transformers decoder layer over x [..., T, D] (a training batch: [B, T, D]).

    context: keys/values [..., Hkv, P, d] placed before the new ones; mask [T, P + T] additive
    (or per sequence [B, 1, T, P + T]).
    -> (out [..., T, D], (k_new, v_new) each [..., Hkv, T, d]).
    """
    attn = layer.self_attn
    head_dim = attn.head_dim
    normed = layer.input_layernorm(x)
    q = attn.q_proj(normed).unflatten(-1, (-1, head_dim)).transpose(-3, -2)
    k_new = attn.k_proj(normed).unflatten(-1, (-1, head_dim)).transpose(-3, -2)
    v_new = attn.v_proj(normed).unflatten(-1, (-1, head_dim)).transpose(-3, -2)
    q, k_new = apply_rope(q, cos, sin), apply_rope(k_new, cos, sin)
    k, v = (k_new, v_new) if context is None else (torch.cat([context[0], k_new], -2), torch.cat([context[1], v_new], -2))
    h = x + attn.o_proj(attend(q, k, v, mask))
    return h + layer.mlp(layer.post_attention_layernorm(h)), (k_new, v_new)
