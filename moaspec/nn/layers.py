"""Small Llama-style building blocks for drafters: RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Activations are [..., T, D] and heads [..., H, T, d] (leading dims optional: the Layer
Self-Attention batches over tokens and runs over layers), so one code path serves the single-pass training forward and the step-by-step inference forward.
Attention takes an additive float mask ([Tq, Tk], 0 = visible, dtype min = hidden; training
batches pass [B, 1, Tq, Tk], one mask per sequence shared by the heads) and returns the new
post-RoPE keys/values so callers can cache them.
"""

from __future__ import annotations

import torch
from torch import nn


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision tensors are upcast for reductions; float32/float64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = at_least_fp32(x)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for rotary embeddings at `positions` [T] -> two [T, head_dim] tensors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., H, T, d] by cos/sin [T, d] (the rotate-half convention of Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention. q [..., Hq, Tq, d], k/v [..., Hkv, Tk, d], mask additive, [Tq, Tk]
    or broadcastable to [..., Hq, Tq, Tk] -> [..., Tq, Hq*d]."""
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(at_least_fp32(scores), dim=-1).to(q.dtype)
    return (probs @ v).transpose(-3, -2).flatten(-2)


class Attention(nn.Module):
    """Multi-head GQA attention with RoPE; queries and keys/values may come from different streams."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, kv_dim: int | None = None) -> None:
        super().__init__()
        kv_dim = dim if kv_dim is None else kv_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kv_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(kv_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=False)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., T, D] -> rotated queries [..., H, T, d]."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(-3, -2)
        return apply_rope(q, cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, Dkv] -> rotated keys and values, each [..., Hkv, T, d]."""
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(-3, -2)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(-3, -2)
        return apply_rope(k, cos, sin), v

    def output(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attend and project back: -> [..., Tq, D]."""
        return self.o_proj(attend(q, k, v, mask))


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm self-attention + SwiGLU block, with explicit past keys/values."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float, rope_theta: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Attention(dim, num_heads, num_kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = MLP(dim, intermediate)
        self.rope_theta = rope_theta

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [..., T, D] at positions [T]; mask [T, P + T] over (past, new), or per sequence
        [B, 1, T, P + T].
        -> (out [..., T, D], new (k, v) each [..., Hkv, T, d])."""
        cos, sin = rope_cos_sin(positions, self.self_attn.head_dim, self.rope_theta, x.dtype)
        normed = self.input_layernorm(x)
        q = self.self_attn.queries(normed, cos, sin)
        k_new, v_new = self.self_attn.keys_values(normed, cos, sin)
        k, v = (k_new, v_new) if past is None else (torch.cat([past[0], k_new], -2), torch.cat([past[1], v_new], -2))
        h = x + self.self_attn.output(q, k, v, mask)
        return h + self.mlp(self.post_attention_layernorm(h)), (k_new, v_new)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool visibility [..., Tq, Tk] -> additive float mask of the same shape (0 visible, dtype
    min hidden)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)


KVCache = tuple[torch.Tensor, torch.Tensor]


def empty_kv(num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> KVCache:
    """An empty keys/values pair, each [Hkv, 0, d], on `device`."""
    return tuple(torch.zeros(num_kv_heads, 0, head_dim, dtype=dtype, device=device) for _ in range(2))  # type: ignore[return-value]


def append_kv(cache: KVCache, new: KVCache) -> KVCache:
    """Concatenate new keys/values [Hkv, n, d] after the cached ones along the sequence axis."""
    return torch.cat([cache[0], new[0]], -2), torch.cat([cache[1], new[1]], -2)


def crop_kv(cache: KVCache, length: int) -> KVCache:
    """The first `length` entries of a keys/values pair."""
    return cache[0][..., :length, :], cache[1][..., :length, :]
