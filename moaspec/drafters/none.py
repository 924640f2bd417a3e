"""The `none` drafter: no drafts, so the engine does plain target decoding (one token per forward)."""

from __future__ import annotations

import torch

from moaspec.config import SamplingConfig
from moaspec.drafters.base import VerifiedUpdate
from moaspec.tree import DraftTree


class NoDrafter:
    """Proposes the root alone; the baseline every speedup is measured against."""

    hidden_layers: tuple[int, ...] = ()

    def reset(self) -> None:
        pass

    def accept(self, update: VerifiedUpdate) -> None:
        pass

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree:
        return DraftTree.root_only(root_id)
