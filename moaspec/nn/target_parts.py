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
