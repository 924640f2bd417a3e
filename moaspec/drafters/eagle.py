"""EAGLE-2 drafter at inference: a cache around `EagleDrafterNet`, driven by the dynamic tree builder.

Positions follow moaspec/nn/eagle.py: the SA entry at position t is the pair (x_{t+1}, h_t), and
its output f_{t+1} predicts the target feature at t + 1. With n verified tokens x_0..x_{n-1}
and the root r = x_n (at position n, not yet seen by the target):
- `accept` stores the true features h_t of the new verified tokens. The pair of a verified token
  needs the *next* token, so the last feature stays unpaired until the next root is known;
- `start(r)` feeds every unpaired pair, the last being (r, h_{n-1}) at position n - 1, all with
  true features. Its output f_n is the root's predicted feature; its logits give depth 1;
- `expand` feeds a depth-d beam y with parent node feature f_parent as fc([embed(y), f_parent])
  at position n + d - 1, all beams of one level at the same position, under a tree mask. The
  beam's output becomes the feature its own children use (EAGLE drafts on its own features).

State between verifications: the SA cache's first `sa_valid` entries are final: pairs of
positions 0..sa_valid-1 whose token and feature are both verified, so computed from true features
only. `unpaired_hidden` holds the true features of positions sa_valid..len(history)-1. `start`
first drops whatever a previous proposal appended (its root pair and tree nodes), so proposing
twice in a row is safe; `accept` keeps the proposal's root pair when that root was verified
(always, under the engine) and drops the tree nodes.

Split deployment: the context is the target's last hidden state per verified token
(`HiddenStateEncoder`). Drafting alone (link down), a provisional root's feature is the drafter's
own prediction f_root, exactly as EAGLE drafts deeper tree levels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from moaspec.config import TreeConfig
from moaspec.drafters.base import Context, VerifiedUpdate
from moaspec.drafters.tree_drafter import TreeDrafter
from moaspec.nn.eagle import EagleDrafterNet
from moaspec.nn.layers import additive_mask, append_kv, crop_kv, empty_kv

if TYPE_CHECKING:
    from moaspec.targets.base import Target


class HiddenStateEncoder:
    """The target-side part of EAGLE: verified tokens -> {"hidden": [n, D]} at one target layer."""

    def __init__(self, layer: int) -> None:
        self.hidden_layers: tuple[int, ...] = (layer,)

    def encode(self, update: VerifiedUpdate) -> Context:
        if update.hidden is None:
            raise ValueError("the EAGLE drafter needs the target's last hidden state of verified tokens")
        return {"hidden": update.hidden[:, 0]}


class EagleDrafter(TreeDrafter):
    """Drafter protocol implementation for the EAGLE network."""

    net_class = EagleDrafterNet

    def __init__(self, net: EagleDrafterNet, target: Target, tree: TreeConfig | None = None) -> None:
        self.context_encoder = HiddenStateEncoder(target.num_layers)  # post-final-norm last hidden state
        self.hidden_layers = self.context_encoder.hidden_layers
        super().__init__(net, target, tree)

    def reset(self) -> None:
        self.history: list[int] = []
        self.sa_kv = empty_kv(self.net.config.num_kv_heads, self.net.config.head_dim, self.dtype, self.device)
        self.sa_valid = 0
        self.unpaired_hidden = torch.zeros(0, self.net.config.hidden_size, dtype=self.dtype, device=self.device)  # [n, D]
        self.proposal_root: int | None = None  # the root of the pairs `start` appended

    @torch.inference_mode()
    def accept_context(self, token_ids: np.ndarray, start_pos: int, context: Context) -> None:
        """New verified tokens [n] with their true features: keep them unpaired; drop the SA
        cache's tree nodes."""
        start = start_pos
        if start != len(self.history):
            raise ValueError(f"verified tokens start at {start}, expected {len(self.history)}")
        self.history.extend(token_ids.tolist())
        # the pairs start() fed up to the root are final once that root is verified
        root_verified = self.proposal_root is not None and self.history[start] == self.proposal_root
        num_valid = start if root_verified else self.sa_valid
        new_hidden = context["hidden"].to(device=self.device, dtype=self.dtype)  # [n, D]
        self.unpaired_hidden = torch.cat([self.unpaired_hidden[num_valid - self.sa_valid :], new_hidden])
        self.sa_valid, self.proposal_root = num_valid, None
        self.sa_kv = crop_kv(self.sa_kv, self.sa_valid)

    def _keep_provisional_root(self, root_id: int) -> None:
        self.accept_context(torch.tensor([root_id]), len(self.history), {"hidden": self.node_features[:1]})

    # -- the two drafting steps (also driven directly by tests with teacher-forced tokens) -------
    def start(self, root_id: int) -> torch.Tensor:
        """Feed the unpaired true features, the last paired with the root; -> log-probs of the
        depth-1 tokens, [1, Vd]."""
        root_pos = len(self.history)
        if root_pos == 0:
            raise ValueError("start() needs at least one verified token (its feature pairs with the root)")
        self.sa_kv = crop_kv(self.sa_kv, self.sa_valid)
        feed = torch.tensor([*self.history[self.sa_valid + 1 :], root_id])  # x_{t+1}, t = sa_valid..root_pos-1
        positions = torch.arange(self.sa_valid, root_pos, device=self.device)
        visible = torch.ones(feed.numel(), root_pos, dtype=torch.bool)
        visible[:, self.sa_valid :] = torch.tril(visible[:, self.sa_valid :])
        root_feature = self._decode(feed, self.unpaired_hidden, positions, visible)[-1:]  # f_{root_pos} [1, D]
        self.proposal_root = root_id
        self._begin_tree()  # drafted entry 0: the root pair
        self.node_features = root_feature  # [num_drafted, D]: each drafted entry's output feature
        return self._log_probs(root_feature)

    def expand(self, token_ids: torch.Tensor, parent: torch.Tensor, depth: int) -> torch.Tensor:
        """Beams token_ids [k] at depth `depth` (>= 1); parent [k] indexes the previous call's
        batch (-1 = the root). -> log-probs [k, Vd]."""
        root_pos = len(self.history)  # = the SA entries up to and including the root pair
        count = token_ids.numel()
        rows, parent_slots = self._add_level(parent)
        # a depth-d beam pairs with its parent's feature, which stands for the parent's position
        positions = torch.full((count,), root_pos + depth - 1, device=self.device)
        # SA sees every entry up to the root pair (drafted entry 0) and its own tree ancestors
        # (drafted entries 1.. are the SA cache's tree part).
        sa_visible = torch.cat([torch.ones(count, root_pos, dtype=torch.bool), rows[:, 1:]], 1)
        features = self._decode(token_ids, self.node_features[parent_slots.to(self.device)], positions, sa_visible)
        self.node_features = torch.cat([self.node_features, features])
        return self._log_probs(features)

    # -- internals ------------------------------------------------------------------------------
    def _decode(
        self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Pairs (token_ids [n], features [n, D]) at positions [n] through the layer, appending
        their keys/values to the SA cache; visible [n, cache + n]. -> output features [n, D].
        token_ids and visible come from the CPU bookkeeping; the rest is on the drafter's device."""
        inputs = self.net.pair_inputs(self.parts, token_ids.to(self.device), features)
        mask = additive_mask(visible.to(self.device), self.dtype)
        out, new_kv = self.net.decoder_layer(inputs, positions, mask, self.sa_kv)
        self.sa_kv = append_kv(self.sa_kv, new_kv)
        return out
