"""MoA drafter at inference: caches around `MoADrafterNet`, driven by the dynamic tree builder.

State between verifications (moa_reference.md §3):
- memory keys/values of every verified token (LSA -> mean -> Ekv2E -> CA norm -> k/v proj ->
  RoPE), appended once per verified token in `accept`; the CA never holds the current root;
- the SA cache: its first `sa_valid` entries are causal states of verified tokens and the root;
  tree nodes appended while drafting are dropped when the next proposal starts, and verified
  tokens not yet in it (accepted drafts) are fed again with the next root;
- with TLI, per target layer L-k..L-1: the target's own keys/values of the verified context (a
  copy received as context, so the drafter can run away from the target) followed by the drafted
  states (root and tree nodes) of the current proposal only.

Split deployment: `MoAContextEncoder` (LSA + mean + Ekv2E, and the TLI keys/values) runs next to
the target; everything else runs wherever the drafter does. Drafting alone (link down), the CA
stays frozen on the last verified memory and provisional tokens enter the SA (and, with TLI, the
target-layer context with their predicted keys/values).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from moaspec.config import TreeConfig
from moaspec.drafters.base import Context, VerifiedUpdate
from moaspec.drafters.tree_drafter import TreeDrafter
from moaspec.nn.encoder_dtype import encoder_dtype
from moaspec.nn.layers import additive_mask, append_kv, crop_kv, empty_kv
from moaspec.nn.moa import MoADrafterNet
from moaspec.nn.moa_layers import context_layers
from moaspec.nn.target_layers import target_layer_forward, target_rope

if TYPE_CHECKING:
    from moaspec.targets.base import Target


ENCODE_CHUNK = 64  # verified tokens per LSA pass (bounds the transient memory of a long prompt)


class MoAContextEncoder:
    """The target-side part of MoA: verified tokens -> context
    {"memory": [n, D]} (+ {"tli_kv": [n, k, kv_dim]}, the target's own last-k-layer keys/values).
    With `memory_hidden` it asks the target for its last hidden state too (`hidden_layers`)."""

    def __init__(self, net: MoADrafterNet, dtype: torch.dtype) -> None:
        self.net, self.dtype = net, dtype
        self.compute_dtype = encoder_dtype(dtype, net.ekv2e.weight.device)  # bfloat16 where native (encoder_dtype.py)
        self.memory = net.memory_encoder(self.compute_dtype)
        config = net.config
        self.hidden_layers: tuple[int, ...] = (config.num_target_layers,) if config.memory_hidden else ()
        # the memory layers and the TLI layers: both at the top of the target
        self.layers = context_layers(config.num_target_layers, config.memory_layers, config.tli_layers)
        self.first_layer = self.layers.start

    @torch.inference_mode()
    def encode(self, update: VerifiedUpdate) -> Context:
        """Per token independent, so a long prompt is encoded ENCODE_CHUNK tokens at a time: the
        LSA's activations ([n, L, ...] per tensor) then stay small whatever the prompt length."""
        start, end = update.start_pos, update.start_pos + len(update.token_ids)
        config = self.net.config
        memory_first, tli_layers, first = config.memory_layer_ids[0], config.tli_layers, self.first_layer
        if self.hidden_layers and update.hidden is None:
            raise ValueError("this MoA drafter needs the target's last hidden state of verified tokens")
        memory, tli_kv = [], []
        for chunk_start in range(start, max(end, start + 1), ENCODE_CHUNK):  # one (empty) pass when n = 0
            chunk_end = min(end, chunk_start + ENCODE_CHUNK)
            layer_kv = update.target.layer_kv(chunk_start, chunk_end, self.layers)
            memory_kv = layer_kv[:, memory_first - first :].to(self.compute_dtype)  # [c, Lm, kv_dim]
            if self.hidden_layers:
                hidden = update.hidden[chunk_start - start : chunk_end - start, 0].to(self.compute_dtype)  # [c, D]
                memory.append(self.memory(memory_kv, hidden).to(self.dtype))
            else:
                memory.append(self.memory(memory_kv).to(self.dtype))
            if tli_layers:
                tli_kv.append(layer_kv[:, layer_kv.shape[1] - tli_layers :].to(self.dtype))
        context = {"memory": torch.cat(memory)}
        if tli_kv:
            context["tli_kv"] = torch.cat(tli_kv)
        return context


class MoADrafter(TreeDrafter):
    """Drafter protocol implementation for the MoA network."""

    net_class = MoADrafterNet

    def __init__(self, net: MoADrafterNet, target: Target, tree: TreeConfig | None = None) -> None:
        super().__init__(net, target, tree, net.config.tli_layers)
        self.context_encoder = MoAContextEncoder(self.net, self.dtype)
        self.hidden_layers = self.context_encoder.hidden_layers
        target.keep_layer_kv(self.context_encoder.layers)

    def reset(self) -> None:
        self.history: list[int] = []
        config = self.net.config
        self.memory_kv = empty_kv(config.num_kv_heads, config.head_dim, self.dtype, self.device)
        self.sa_kv = empty_kv(config.num_kv_heads, config.head_dim, self.dtype, self.device)
        self.sa_valid = 0
        self.tli_cache = [empty_kv(config.num_kv_heads, config.head_dim, self.dtype, self.device) for _ in range(config.tli_layers)]

    @torch.inference_mode()
    def accept_context(self, token_ids: np.ndarray, start_pos: int, context: Context) -> None:
        """New verified tokens [n] at start_pos..: append their memory (and TLI keys/values);
        the SA cache is tidied by the next `start`."""
        count = len(token_ids)
        if start_pos != len(self.history):
            raise ValueError(f"verified tokens start at {start_pos}, expected {len(self.history)}")
        self.history.extend(token_ids.tolist())
        positions = torch.arange(start_pos, start_pos + count, device=self.device)
        memory = context["memory"].to(device=self.device, dtype=self.dtype)  # [n, D]
        self.memory_kv = append_kv(self.memory_kv, self.net.memory_keys_values(memory, positions))
        if self.tli_cache:
            config = self.net.config
            per_head = context["tli_kv"].to(device=self.device, dtype=self.dtype).reshape(count, len(self.tli_cache), config.num_kv_heads, 2, config.head_dim)
            for i, cached in enumerate(self.tli_cache):
                new_kv = (per_head[:, i, :, 0].transpose(0, 1), per_head[:, i, :, 1].transpose(0, 1))  # [Hkv, n, d]
                self.tli_cache[i] = append_kv(cached, new_kv)

    def _keep_provisional_root(self, root_id: int) -> None:
        root_pos = len(self.history)
        self.history.append(root_id)  # the SA already holds it (start); the CA memory stays frozen
        self.tli_cache = [crop_kv(kv, root_pos + 1) for kv in self.tli_kv]  # + the root's predicted keys/values

    # -- the two drafting steps (also driven directly by tests with teacher-forced tokens) -------
    def start(self, root_id: int) -> torch.Tensor:
        """Feed pending verified tokens + the root; -> log-probs after the root, [1, Vd].

        First drops the SA entries of the previous proposal's tree nodes (and of its root, when
        that root was not verified), so proposing twice in a row is safe.
        """
        root_pos = len(self.history)
        self.sa_valid = min(self.sa_valid, root_pos)
        self.sa_kv = crop_kv(self.sa_kv, self.sa_valid)
        feed = torch.tensor([*self.history[self.sa_valid :], root_id])
        positions = torch.arange(self.sa_valid, root_pos + 1, device=self.device)
        visible = torch.ones(feed.numel(), self.sa_valid + feed.numel(), dtype=torch.bool)
        visible[:, self.sa_valid :] = torch.tril(visible[:, self.sa_valid :])
        h = self._self_attend(feed, positions, visible)[-1:]
        self.sa_valid = root_pos + 1
        self._begin_tree()
        self.tli_kv = list(self.tli_cache)  # the context; this proposal appends its drafted states
        return self._finish(h, torch.tensor([root_pos], device=self.device), self.tree_rows)

    def expand(self, token_ids: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        """Beams token_ids [k] at depth `depth` (>= 1); parent [k] indexes the previous call's
        batch (-1 = the root). -> log-probs [k, Vd]."""
        rows, _ = self._add_level(parent)
        positions = torch.full((token_ids.numel(),), self.sa_valid - 1 + depth, device=self.device)
        # SA sees all valid entries (verified + root) and its own tree ancestors (drafted entries
        # 1.. are the SA cache's tree part; entry 0, the root, is already in the valid prefix).
        sa_visible = torch.cat([torch.ones(token_ids.numel(), self.sa_valid, dtype=torch.bool), rows[:, 1:]], 1)
        h = self._self_attend(token_ids, positions, sa_visible)
        return self._finish(h, positions, rows)

    # -- internals ------------------------------------------------------------------------------
    def _self_attend(self, token_ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """token_ids [n] and visible [n, cache + n] from the CPU bookkeeping, positions [n] on the
        drafter's device -> SA outputs [n, D] there."""
        embeds = self.parts.embed_tokens(token_ids.to(self.device)).to(self.dtype)
        mask = additive_mask(visible.to(self.device), self.dtype)
        h, new_kv = self.net.self_attention(embeds, positions, mask, self.sa_kv)
        self.sa_kv = append_kv(self.sa_kv, new_kv)
        return h

    def _finish(self, h: torch.Tensor, positions: torch.Tensor, drafted_visible: torch.Tensor) -> torch.Tensor:
        """CA over all verified memory, then TLI and the (reduced) LM head -> log-probs [n, Vd]."""
        final = self.net.cross_attend(h, positions, self.memory_kv, None)
        if self.tli_kv:
            final = self._target_layers(final, positions, drafted_visible)
        return self._log_probs(final)

    def _target_layers(self, x: torch.Tensor, positions: torch.Tensor, drafted_visible: torch.Tensor) -> torch.Tensor:
        """Drafted states through the target's last k layers; their keys/values join the context."""
        root_pos = self.sa_valid - 1
        visible = torch.cat([torch.ones(x.shape[0], root_pos, dtype=torch.bool), drafted_visible], 1)
        mask = additive_mask(visible.to(self.device), self.dtype)
        cos, sin = target_rope(self.parts.rotary_emb, positions, x)
        for i, layer in enumerate(self.parts.tli_layers):
            x, new_kv = target_layer_forward(layer, x, cos, sin, self.tli_kv[i], mask)
            self.tli_kv[i] = append_kv(self.tli_kv[i], new_kv)
        return self.parts.final_norm(x)
