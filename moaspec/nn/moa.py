"""THE Mixture-of-Attentions drafter network (Zimmer et al. 2024, §3), used by training and inference.

Per verified token t (once, when the target verifies it):
    memory_t = Ekv2E(mean_l LSA([k_h, v_h] of t at every target layer l)),   LSA non-causal over
    layers with RoPE over the layer index (moa_reference.md §1.3);
    with `memory_hidden` (not in the paper): memory_t += H2M_SCALE * H2M(target's post-norm last
    hidden state of t), the state EAGLE reads (see `MoADrafterNet.memory`);
    without `layer_attention` (an ablation): memory_t = Ekv2E(pool_l [k_h, v_h]), no LSA.
Per drafted position i (root or tree node):
    h_i = SA(embed(x_0..x_i))                  causal self-attention over the target's embeddings
    c_i = h_i + CA(norm(h_i) -> norm(memory_j), j <= s(i)) ; c_i += MLP(norm(c_i))
          s(i) = the last verified position before the root: the CA never sees the root's memory
          without `cross_attention` (an ablation): c_i = h_i + MLP(norm(h_i)), the target unread
    TLI k = 0:  logits_i = lm_head(c_i)        (c_i is trained to match the post-norm target state)
    TLI k > 0:  c_i stands for the residual stream entering target layer L-k; the target's own last
                k layers, its final norm and lm_head finish (target_layers.py).

TLI attention context (a deliberate, tested deviation from the reference training code, which
let earlier blocks' non-anchor positions use predicted states): query i sees the *true* target
keys/values of positions j <= s(i) and the *predicted* ones of s(i) < j <= i. This is exactly
what inference has (verified context = true cache, root + drafts = predictions), so training and
inference compute the same function.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from moaspec.nn.drafter_net import DrafterNet
from moaspec.nn.layers import MLP, Attention, DecoderLayer, RMSNorm, additive_mask, rope_cos_sin
from moaspec.nn.moa_layers import memory_layer_ids
from moaspec.nn.target_config import target_norm_eps, target_rope_theta
from moaspec.nn.target_layers import target_layer_forward, target_rope
from moaspec.nn.target_parts import TargetParts

LSA_HEAD_DIM = 64
# The learned layer mix's logits are LAYER_MIX_SCALE * raw parameters: Adam moves a parameter by
# about lr per step, so unscaled logits could shift by only ~0.3 over a 400-step CPU budget.
LAYER_MIX_SCALE = 10.0
# The memory's hidden-state map is H2M_SCALE * h2m(hidden), h2m starting at zero, for the same
# reason: fine-tuning at lr 3e-4 left an unscaled map too small to change the drafts (validation
# at draft depth 1 after 100 steps: 0.366 against 0.365 without it). Scaled, it did not help in
# 150 steps either (README, "Ablations of 2026-11-24"); the paper's memory stays the default.
H2M_SCALE = 10.0


@dataclass(frozen=True)
class MoAConfig:
    """Sizes of the MoA drafter. `for_target` scales them with the target (moa_reference.md §1.1)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    kv_dim: int  # 2 * target kv heads * target head_dim: one token's [k_h, v_h] at one layer
    num_target_layers: int
    lsa_num_heads: int
    lsa_num_kv_heads: int
    lsa_intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    tli_layers: int = 0
    draft_vocab_size: int = 0  # 0 = the target's full vocabulary
    ca_recency_bias: bool = False  # learned per-head distance penalty in the CA (see cross_attend)
    layer_mix: bool = False  # learned softmax weights over layers instead of the plain mean (see memory)
    memory_layers: int = 0  # the memory reads the last N target layers; 0 = all (the paper's form)
    memory_hidden: bool = False  # the memory also reads the target's post-norm last hidden state
    layer_attention: bool = True  # the LSA over layers (the paper's); False pools the raw keys/values (ablation)
    cross_attention: bool = True  # the CA over the memory (the paper's); False drops its term: the target unread (ablation)

    def __post_init__(self) -> None:
        if not 0 <= self.tli_layers < self.num_target_layers:
            raise ValueError(f"tli_layers must be in [0, {self.num_target_layers}), got {self.tli_layers}")
        if self.kv_dim % self.lsa_num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("head counts must divide the dimensions")
        if not 0 <= self.memory_layers <= self.num_target_layers:
            raise ValueError(f"memory_layers must be in [0, {self.num_target_layers}], got {self.memory_layers}")

    @property
    def memory_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose keys/values feed the memory, in order."""
        return memory_layer_ids(self.num_target_layers, self.memory_layers)

    @staticmethod
    def for_target(
        target_config: Any,
        tli_layers: int = 0,
        draft_vocab_size: int = 0,
        ca_recency_bias: bool = True,
        layer_mix: bool = True,
        memory_layers: int = 0,
        memory_hidden: bool = False,
        layer_attention: bool = True,
        cross_attention: bool = True,
        intermediate_size: int = 0,
    ) -> MoAConfig:
        """`intermediate_size` 0: the feed-forward width 3/2 x the target's hidden size."""
        hidden = target_config.hidden_size
        heads = target_config.num_attention_heads
        kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
        head_dim = getattr(target_config, "head_dim", None) or hidden // heads
        kv_dim = 2 * kv_heads * head_dim
        lsa_heads = max(1, kv_dim // LSA_HEAD_DIM)
        lsa_kv_heads = next(h for h in (lsa_heads // 4, lsa_heads // 3, lsa_heads // 2, lsa_heads) if h and lsa_heads % h == 0)
        return MoAConfig(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size or 3 * hidden // 2,
            kv_dim=kv_dim,
            num_target_layers=target_config.num_hidden_layers,
            lsa_num_heads=lsa_heads,
            lsa_num_kv_heads=lsa_kv_heads,
            lsa_intermediate_size=3 * kv_dim // 2,
            rope_theta=target_rope_theta(target_config),
            rms_norm_eps=target_norm_eps(target_config),
            tli_layers=tli_layers,
            draft_vocab_size=draft_vocab_size,
            ca_recency_bias=ca_recency_bias,
            layer_mix=layer_mix,
            memory_layers=memory_layers,
            memory_hidden=memory_hidden,
            layer_attention=layer_attention,
            cross_attention=cross_attention,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def encode_memory(
    lsa: DecoderLayer | None,
    ekv2e: nn.Linear,
    layer_mix_raw: torch.Tensor | None,
    layer_ids: tuple[int, ...],
    h2m: nn.Linear | None,
    layer_kv: torch.Tensor,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """The memory path: layer_kv [..., n, Lm, kv_dim] of the target layers `layer_ids` [Lm] -> LSA
    over them (RoPE at the layer indices; with `lsa` None the raw keys/values go on) -> pooled
    over layers (learned softmax weights from layer_mix_raw [Lm], or the mean when None) -> Ekv2E
    -> [..., n, D]; with `h2m`, plus h2m(hidden [..., n, D]), the target's post-norm last hidden
    states of the same tokens."""
    if layer_kv.shape[-2] != len(layer_ids):
        raise ValueError(f"the memory reads {len(layer_ids)} target layers, got keys/values of {layer_kv.shape[-2]}")
    if (h2m is None) != (hidden is None):
        wanted = "reads the target's last hidden state" if hidden is None else "reads no hidden state"
        raise ValueError(f"this memory {wanted}")
    mixed = layer_kv if lsa is None else lsa(layer_kv, torch.tensor(layer_ids, device=layer_kv.device), None)[0]
    if layer_mix_raw is None:
        memory = ekv2e(mixed.mean(dim=-2))
    else:
        weights = torch.softmax(LAYER_MIX_SCALE * layer_mix_raw.float(), dim=0).to(mixed.dtype)  # [L]
        memory = ekv2e(torch.einsum("...ld,l->...d", mixed, weights))
    return memory if h2m is None else memory + H2M_SCALE * h2m(hidden.to(memory.dtype))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's geometric head slopes 2^(-8 (h + 1) / H), h = 0..H-1 -> [H] float32."""
    return torch.pow(2.0, -8.0 * torch.arange(1, num_heads + 1, dtype=torch.float32) / num_heads)


@dataclass(frozen=True)
class MoATrainOutput:
    """final: [T, D] the state the LM head reads (post-norm with TLI). pre_tli: [T, D] or None."""

    final: torch.Tensor
    pre_tli: torch.Tensor | None


class MoADrafterNet(DrafterNet):
    """LSA + Ekv2E (memory encoder), SA, CA + MLP. See the module docstring."""

    method = "moa"
    config_class = MoAConfig

    def __init__(self, config: MoAConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.self_attention = DecoderLayer(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.rms_norm_eps, c.rope_theta)
        self.ca_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # shared by the query and memory sides
        self.cross_attention = Attention(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim)
        self.ca_post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ca_mlp = MLP(c.hidden_size, c.intermediate_size)
        self.layer_self_attention = (
            DecoderLayer(
                c.kv_dim, c.lsa_num_heads, c.lsa_num_kv_heads, c.kv_dim // c.lsa_num_heads, c.lsa_intermediate_size, c.rms_norm_eps, c.rope_theta
            )
            if c.layer_attention
            else None
        )
        self.ekv2e = nn.Linear(c.kv_dim, c.hidden_size, bias=True)
        if c.ca_recency_bias:
            self.ca_recency_slopes = nn.Parameter(alibi_slopes(c.num_heads))  # [H]
        if c.layer_mix:
            self.layer_mix_raw = nn.Parameter(torch.zeros(len(c.memory_layer_ids)))  # [Lm]: uniform = the mean
        if c.memory_hidden:
            self.h2m = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self._register_draft_vocab()
        self.reset_parameters()
        if c.memory_hidden:  # starts as the keys/values-only memory (a checkpoint without it continues unchanged)
            nn.init.zeros_(self.h2m.weight)

    # -- memory of verified tokens -------------------------------------------------------------
    def memory(self, layer_kv: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """layer_kv [n, Lm, kv_dim] (per-head [k_h, v_h], post-RoPE keys) of the target layers
        `config.memory_layer_ids` (+ with `memory_hidden`: hidden [n, D], the target's post-norm
        last hidden states of the same tokens) -> memory [n, D].

        `memory_layers` N > 0 reads only the last N layers: a ridge probe on the last 4 layers'
        keys/values predicts the target's next token far better than one on the 30-layer mean
        (MT-bench top-1 0.69 vs 0.26, acceptance_notes.md), and the LSA costs N/L as much.

        With `layer_mix` the LSA outputs are pooled with learned softmax weights over the layers
        (starting uniform, i.e. at the reference's mean) so training can favour the layers that
        predict the next token. Measured on SmolLM2 (same data and 400-step schedule as the
        mean): validation loss 0.796 -> 0.786, top-1 at the anchor 0.392 -> 0.417 and at draft
        depths 1-5 within noise (0.378 0.351 0.397 0.371 0.333 -> 0.374 0.353 0.403 0.383 0.340);
        the weights moved to the last layers (layer 27: 0.096 against 0.033 uniform).

        `memory_hidden` adds a linear map of the target's last hidden state (zero at the start):
        the keys/values of a token are the *inputs* of each target layer, so the memory never saw
        the last layer's output, the state that predicts the next token (and all EAGLE reads).
        """
        layer_mix_raw = self.layer_mix_raw if self.config.layer_mix else None
        layer_ids = self.config.memory_layer_ids
        h2m = self.h2m if self.config.memory_hidden else None
        return encode_memory(self.layer_self_attention, self.ekv2e, layer_mix_raw, layer_ids, h2m, layer_kv, hidden)

    def memory_encoder(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """`memory` computed in `dtype` by copies of its modules (e.g. bfloat16 for a float32
        net, see encoder_dtype.py); this net's own dtype uses the net itself."""
        if dtype == self.ekv2e.weight.dtype:
            return self.memory
        lsa = copy.deepcopy(self.layer_self_attention).to(dtype) if self.config.layer_attention else None
        ekv2e = copy.deepcopy(self.ekv2e).to(dtype)
        layer_mix_raw = self.layer_mix_raw.detach().clone() if self.config.layer_mix else None
        h2m = copy.deepcopy(self.h2m).to(dtype) if self.config.memory_hidden else None
        return functools.partial(encode_memory, lsa, ekv2e, layer_mix_raw, self.config.memory_layer_ids, h2m)

    def memory_keys_values(self, memory: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """memory [n, D] of tokens at positions [n] -> CA keys/values [Hkv, n, d] (cacheable)."""
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, memory.dtype)
        return self.cross_attention.keys_values(self.ca_norm(memory), cos, sin)

    # -- drafting path ---------------------------------------------------------------------------
    def cross_attend(
        self, h: torch.Tensor, positions: torch.Tensor, memory_kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        """SA outputs h [T, D] at positions [T] attend to memory keys/values [Hkv, n, d] of the
        tokens at positions 0..n-1 -> c [T, D]. mask: additive [T, n] or None (all visible).

        With `ca_recency_bias`, head h adds -slope_h * (i - j) to the score of query position i
        for memory position j (ALiBi, Press et al. 2022, slopes learned from the ALiBi values), so
        some heads read the last verified tokens from the first step on. Measured reason, on
        SmolLM2 with 50-400 steps of training: without it the CA stayed near uniform over the
        whole context (7 % of its mass on the last verified token) and shuffling the memory
        across positions did not change a single prediction.

        Without `cross_attention` (an ablation) c = h + MLP(norm(h)): the memory is ignored, so
        the drafter is a small model over the token embeddings (its memory modules stay, unused).
        """
        if not self.config.cross_attention:  # the ablation: a token model with the same MLP
            return h + self.ca_mlp(self.ca_post_norm(h))
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, h.dtype)
        q = self.cross_attention.queries(self.ca_norm(h), cos, sin)
        if self.config.ca_recency_bias:
            memory_positions = torch.arange(memory_kv[0].shape[-2], device=positions.device)
            distance = (positions[:, None] - memory_positions[None, :]).clamp(min=0).to(h.dtype)
            bias = -self.ca_recency_slopes.to(h.dtype)[:, None, None] * distance  # [H, T, n]
            mask = bias if mask is None else (mask + bias).clamp(min=torch.finfo(h.dtype).min)
        c = h + self.cross_attention.output(q, memory_kv[0], memory_kv[1], mask)
        return c + self.ca_mlp(self.ca_post_norm(c))

    # -- training: one parallel pass simulating drafting from anchors (moa_reference.md §2.2) ---
    def forward_train(
        self,
        parts: TargetParts,
        input_ids: torch.Tensor,
        layer_kv: torch.Tensor,
        last_anchor: torch.Tensor,
        staircase: bool | torch.Tensor = False,
        tli_true_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        tli_true_hidden: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
    ) -> MoATrainOutput:
        """input_ids [T]; layer_kv [T, Lm, kv_dim] of the memory layers (`config.memory_layer_ids`);
        last_anchor [T] = s(i), the last anchor <= i; target_hidden [T, D]: the target's post-norm
        last hidden states (read by the memory with `memory_hidden`, else ignored).

        staircase: SA query i sees only (s(i), i] (curriculum); otherwise plain causal.
        TLI (k > 0): tli_true_kv = the target's cached keys/values [Hkv, T, d] of its last k
        layers, tli_true_hidden [T, D] = the residual stream entering layer L-k.

        A batch of B sequences padded to T takes the same arguments with a leading [B] (input_ids
        [B, T], layer_kv [B, T, Lm, kv_dim], keys/values [B, Hkv, T, d], ...) and staircase a [B]
        bool tensor; every sequence starts at position 0 and sees only its own tokens, so row b
        equals the sequence's own pass (padding after its end is never visible to its tokens).
        """
        batched = input_ids.dim() == 2
        n = input_ids.shape[-1]
        positions = torch.arange(n, device=input_ids.device)
        dtype = self.ekv2e.weight.dtype

        def shared_by_heads(visible: torch.Tensor) -> torch.Tensor:  # [..., T, K] -> additive, per sequence
            return additive_mask(visible.unsqueeze(-3) if batched else visible, dtype)

        embeds = parts.embed_tokens(input_ids).to(dtype)
        anchor = last_anchor[..., :, None]  # [..., T, 1]
        causal = positions[None, :] <= positions[:, None]  # [T, T]
        since_anchor = causal & (positions[None, :] > anchor)  # [..., T, T]: the drafted tokens in (s(i), i]
        own = torch.eye(n, dtype=torch.bool, device=input_ids.device)
        stairs = torch.as_tensor(staircase, dtype=torch.bool, device=input_ids.device)
        stairs = stairs.reshape(-1, 1, 1) if batched else stairs  # one flag per sequence
        sa_visible = torch.where(stairs, since_anchor | own, causal) if bool(stairs.any()) else causal
        h, _ = self.self_attention(embeds, positions, shared_by_heads(sa_visible))
        memory_hidden = target_hidden.to(dtype) if self.config.memory_hidden and target_hidden is not None else None
        memory_kv = self.memory_keys_values(self.memory(layer_kv.to(dtype), memory_hidden), positions)
        ca_visible = positions[None, :] <= anchor  # [..., T, T]
        c = self.cross_attend(h, positions, memory_kv, shared_by_heads(ca_visible))
        if self.config.tli_layers == 0:
            return MoATrainOutput(c, None)
        if tli_true_kv is None or tli_true_hidden is None:
            raise ValueError("TLI training needs the target's true keys/values and hidden state")
        is_anchor = last_anchor == positions
        x = torch.where(is_anchor[..., None], tli_true_hidden.to(dtype), c)
        # keys: [true states of all positions ; predicted states of all positions in (s(i), i]]
        mask = shared_by_heads(torch.cat([ca_visible, since_anchor], dim=-1))
        cos, sin = target_rope(parts.rotary_emb, positions, x)
        for layer, (true_k, true_v) in zip(parts.tli_layers, tli_true_kv):
            x, _ = target_layer_forward(layer, x, cos, sin, (true_k.to(dtype), true_v.to(dtype)), mask)
        return MoATrainOutput(parts.final_norm(x), c)
