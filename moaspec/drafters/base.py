"""The drafter protocol: what the engine asks of every drafter.

Lifecycle per generation:
    reset()                      a new sequence starts;
    accept(update)               tokens entered the target's verified context (the prompt after
                                 prefill, then root + accepted drafts after each verification),
                                 with the target activations the drafter asked for;
    propose(root_id, ...)        a draft tree rooted at the last emitted token, which the target
                                 has not processed yet (it sits at position target.num_cached).

A drafter never touches the target's cache and never chooses the emitted tokens: the verifier
does. Model-based drafters read target activations through `VerifiedUpdate`: hidden states at the
layers they list in `hidden_layers`, and anything else (per-layer KV, frozen target modules)
through `update.target`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from moaspec.config import SamplingConfig
from moaspec.tree import DraftTree

if TYPE_CHECKING:
    from moaspec.target import HFTarget


@dataclass(frozen=True)
class VerifiedUpdate:
    """Tokens that just entered the target's verified context.

    token_ids: [n], at absolute positions start_pos .. start_pos + n - 1.
    hidden:    [n, H, D] target hidden states at the drafter's `hidden_layers`, or None.
    """

    token_ids: torch.Tensor
    start_pos: int
    hidden: torch.Tensor | None
    target: HFTarget


class Drafter(Protocol):
    """Proposes draft trees; see the module docstring for the lifecycle."""

    hidden_layers: tuple[int, ...]

    def reset(self) -> None: ...

    def accept(self, update: VerifiedUpdate) -> None: ...

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator) -> DraftTree: ...
