"""The `none` drafter: no drafts, so the engine does plain target decoding (one token per forward)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from moaspec.config import SamplingConfig
from moaspec.drafters.base import AloneDraft, Context, NoContext, VerifiedUpdate
from moaspec.tree import DraftTree

if TYPE_CHECKING:
    import torch

    from moaspec.targets.base import Target


class NoDrafter:
    """Proposes the root alone; the baseline every speedup is measured against."""

    hidden_layers: tuple[int, ...] = ()
    context_encoder = NoContext()

    @classmethod
    def for_target(cls, target: Target) -> NoDrafter:
        """The registry's factory; this drafter does not depend on the target."""
        return cls()

    def reset(self) -> None:
        pass

    def accept(self, update: VerifiedUpdate) -> None:
        pass

    def accept_context(self, token_ids: np.ndarray, start_pos: int, context: Context) -> None:
        pass

    def draft_alone(
        self, root_id: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> AloneDraft | None:
        return None  # nothing to draft with: the client waits for the server

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        return DraftTree.root_only(root_id)
