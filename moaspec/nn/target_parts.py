"""The frozen target modules a drafter borrows (every runtime provides them: targets/base.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class TargetParts:
    """Frozen target modules the drafter borrows; never part of the drafter's state dict."""

    embed_tokens: nn.Module
    lm_head_weight: torch.Tensor  # [V, D]
    final_norm: nn.Module
    tli_layers: list[nn.Module]  # the target's last k decoder layers
    rotary_emb: nn.Module | None  # None where no drafter can use it (llama.cpp: no TLI)

    def to(self, device: torch.device | str) -> TargetParts:
        """The same parts on `device` (modules moved in place; a no-op where they already are)."""
        return TargetParts(
            embed_tokens=self.embed_tokens.to(device),
            lm_head_weight=self.lm_head_weight.to(device),
            final_norm=self.final_norm.to(device),
            tli_layers=[layer.to(device) for layer in self.tli_layers],
            rotary_emb=None if self.rotary_emb is None else self.rotary_emb.to(device),
        )
