"""Run one of the target's own (frozen) decoder layers with explicit context keys/values.

Target Layer Inference feeds the drafter's output through the target's last k layers. Those
layers must attend to keys/values the target never stored together (true states of verified
tokens next to drafted states), so we compute the transformers layer by hand from its
submodules instead of through its cache API. Llama, Mistral, Qwen2 and Qwen3 layers (q/k/v
biases and per-head q/k norms allowed); `check_tli_layers` refuses layers that compute something
else (Gemma's extra norms and scalings, Granite's multipliers, Phi-3's fused projections).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from moaspec.errors import MoaspecError, first_line
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
    q = _head_norm(attn, "q_norm", attn.q_proj(normed).unflatten(-1, (-1, head_dim))).transpose(-3, -2)
    k_new = _head_norm(attn, "k_norm", attn.k_proj(normed).unflatten(-1, (-1, head_dim))).transpose(-3, -2)
    v_new = attn.v_proj(normed).unflatten(-1, (-1, head_dim)).transpose(-3, -2)
    q, k_new = apply_rope(q, cos, sin), apply_rope(k_new, cos, sin)
    k, v = (k_new, v_new) if context is None else (torch.cat([context[0], k_new], -2), torch.cat([context[1], v_new], -2))
    h = x + attn.o_proj(attend(q, k, v, mask))
    return h + layer.mlp(layer.post_attention_layernorm(h)), (k_new, v_new)


def _head_norm(attn: nn.Module, name: str, states: torch.Tensor) -> torch.Tensor:
    """Qwen3's per-head RMSNorm of queries / keys [..., T, H, d] before RoPE; other layers have none."""
    norm = getattr(attn, name, None)
    return states if norm is None else norm(states)


CHECK_TOKENS = 6  # positions of the input check_tli_layers runs each layer on
# in float64: rounding ~1e-9 (eager attention's float32 softmax), another computation 5e-5 and
# more even with tiny random weights (SmolLM3's layers without RoPE 6e-5, Granite's multipliers 7e-4)
CHECK_RELATIVE_ERROR = 1e-6


def check_tli_layers(layers: list[nn.Module], rotary_emb: nn.Module | None) -> None:
    """MoaspecError unless target_layer_forward computes what each layer's own forward does, on
    a random input, with float64 copies on the CPU (milliseconds per layer on small targets):
    Target Layer Inference would otherwise train and draft through a function the target does
    not compute."""
    for layer in layers:
        try:
            error = _relative_error(layer, rotary_emb)
        except Exception as exc:  # noqa: BLE001  a layer of another shape fails anywhere in the hand computation
            error, detail = float("inf"), f" ({type(exc).__name__}: {first_line(exc, empty='')})"
        else:
            detail = f" (relative difference {error:.2g})"
        if not error <= CHECK_RELATIVE_ERROR:
            raise MoaspecError(
                f"Target Layer Inference runs Llama-style decoder layers by hand; the target's {type(layer).__name__} "
                f"computes something else{detail}: use a drafter without TLI (--tli-layers 0)"
            )


def _relative_error(layer: nn.Module, rotary_emb: nn.Module | None) -> float:
    """|hand - own| / |own| of a float64 CPU copy of one layer over a random input
    [1, CHECK_TOKENS, D], causal."""
    if rotary_emb is None:
        raise ValueError("no rotary embedding")
    layer = copy.deepcopy(layer).to(device="cpu", dtype=torch.float64)
    rotary_emb = copy.deepcopy(rotary_emb).to("cpu")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, CHECK_TOKENS, layer.self_attn.o_proj.weight.shape[0], generator=generator, dtype=torch.float64)
    positions = torch.arange(CHECK_TOKENS)
    cos, sin = target_rope(rotary_emb, positions, x[0])
    mask = torch.full((CHECK_TOKENS, CHECK_TOKENS), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
    with torch.no_grad():
        hand, _ = target_layer_forward(layer, x[0], cos, sin, None, mask)
        own = layer(x, attention_mask=mask[None, None], position_ids=positions[None], position_embeddings=(cos[None], sin[None]))
    own = (own[0] if isinstance(own, tuple) else own)[0]
    return float((hand - own).norm() / own.norm())
