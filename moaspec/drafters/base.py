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

Split deployment (moaspec/split, docs/protocol.md): a drafter that can draft on another machine
than its target also provides
    context_encoder              the part that must run next to the target: it turns a
                                 `VerifiedUpdate` into a `Context`, the few per-token tensors the
                                 drafter needs (MoA: memory vectors; EAGLE: last hidden states);
    accept_context(ids, pos, c)  `accept` with the context already encoded (possibly elsewhere);
    draft_alone(root, ...)       the next token without the target (the link is down): the root
                                 becomes provisional context, the drafter's guess is returned
                                 with its probability of being the target's (`AloneDraft`).
In-process, `accept(update)` is exactly `accept_context(ids, pos, context_encoder.encode(update))`,
so the split and in-process drafters are one class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from moaspec.config import SamplingConfig
from moaspec.tree import DraftTree

if TYPE_CHECKING:
    import torch

    from moaspec.targets.base import Target


# name -> per-token tensor [n, ...] (row i belongs to the i-th verified token of the update)
Context = dict[str, "torch.Tensor"]


@dataclass(frozen=True)
class VerifiedUpdate:
    """Tokens that just entered the target's verified context.

    token_ids: [n] int64, at absolute positions start_pos .. start_pos + n - 1.
    hidden:    [n, H, D] target hidden states at the drafter's `hidden_layers`, or None.
    """

    token_ids: np.ndarray
    start_pos: int
    hidden: torch.Tensor | None
    target: Target


class AloneDraft(NamedTuple):
    """A token drafted without the target, with the drafter's probability that it is the target's
    own next token (a model's probability of it, or a prompt-lookup copy's measured precision:
    ngram.py) and where it came from: "model", "lookup" (a copy; beside a model, one the model's
    own first choice disputes) or "lookup+model" (a copy that is also the model's first choice)."""

    token_id: int
    probability: float
    source: str = "model"


class Drafter(Protocol):
    """Proposes draft trees; see the module docstring for the lifecycle."""

    hidden_layers: tuple[int, ...]

    def reset(self) -> None: ...

    def accept(self, update: VerifiedUpdate) -> None: ...

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        """generator: the drafter's random stream; None when sampling is greedy (nothing to draw)."""
        ...


class ContextEncoder(Protocol):
    """The target-side part of a drafter: verified tokens -> the per-token context it needs."""

    hidden_layers: tuple[int, ...]

    def encode(self, update: VerifiedUpdate) -> Context: ...


class SplitDrafter(Drafter, Protocol):
    """A drafter that can run on another machine than its target (see the module docstring)."""

    context_encoder: ContextEncoder

    def accept_context(self, token_ids: np.ndarray, start_pos: int, context: Context) -> None: ...

    def draft_alone(
        self, root_id: int, sampling: SamplingConfig, generator: torch.Generator | None
    ) -> AloneDraft | None: ...


class NoContext:
    """The context encoder of drafters that need nothing but the tokens (n-gram, none)."""

    hidden_layers: tuple[int, ...] = ()

    def encode(self, update: VerifiedUpdate) -> Context:
        return {}


def pick_alone(log_probs: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
    """A drafter's own choice of the next token, log_probs [V]: argmax, or a draw at the temperature."""
    if sampling.greedy:
        return int(log_probs.argmax())
    import torch  # a model drafter's: torch is loaded

    from moaspec.sampling import tempered

    return int(torch.multinomial(torch.softmax(tempered(log_probs.double(), sampling.temperature), -1), 1, generator=generator))
