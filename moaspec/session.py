"""The target side of one generation: prefill, then verify + commit one draft tree per step.

Used in-process by the engine and, one per client, by the split server (moaspec/split). It owns
the verifier's random stream: the drafter draws from its own generator, so the two halves can run
on different machines and a seeded split run reproduces the in-process run exactly.

Invariant (as in engine.py): the target's cache holds exactly the verified tokens; the last
emitted token (the root of the next tree) is not in it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from moaspec.config import SamplingConfig
from moaspec.drafters.base import VerifiedUpdate
from moaspec.sampling import sample, target_probs
from moaspec.targets.base import Target
from moaspec.tree import DraftTree
from moaspec.verify import Accepted, verify_greedy, verify_stochastic

# The drafter's stream is seeded at a fixed odd offset from the verifier's (both stay in 64 bits).
DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15


def resumed_seed(seed: int, verified_length: int) -> int:
    """The verifier's seed for a session resumed over `verified_length` verified tokens (a split
    client reconnecting): a stream of its own, not `seed`'s again, whose first draws already
    decided the tokens before the cut (reusing them would tie the text after a cut to the text
    before it). The same for every retry of that resumption."""
    digest = hashlib.sha256(f"moaspec-resume:{seed % 2**64}:{verified_length}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def draft_generator(seed: int) -> torch.Generator:
    """The drafter's random stream for a generation seeded with `seed`."""
    return torch.Generator().manual_seed((seed + DRAFT_SEED_OFFSET) % 2**64)


@dataclass(frozen=True)
class Verified:
    """One verification: the verifier's decision and the tokens that entered the target's cache
    (root + accepted drafts, with the hidden states the drafter asked for)."""

    accepted: Accepted
    update: VerifiedUpdate


class TargetSession:
    """Prefill / verify / commit on one target for one sequence (batch size 1)."""

    def __init__(self, target: Target, hidden_layers: tuple[int, ...], sampling: SamplingConfig, seed: int) -> None:
        self.target = target
        self.hidden_layers = hidden_layers
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(seed)

    def prefill(self, prompt_ids: torch.Tensor) -> tuple[int, VerifiedUpdate]:
        """A new sequence: prompt_ids [T] become verified context. -> (first token, update)."""
        update, logits = self._prefill(prompt_ids)
        if self.sampling.greedy:
            return int(logits.argmax()), update
        return sample(target_probs(logits.double(), self.sampling), self.generator), update

    def resume(self, context_ids: torch.Tensor, prompt_len: int | None = None) -> VerifiedUpdate:
        """Rebuild the verified context context_ids [T] without choosing a token (the caller
        already knows the root: resynchronisation after a disconnection). prompt_len: its first
        tokens were the prompt: prefilled as one, the rest appended as verification decoded them
        (`Target.prefill`), so that a runtime whose batched kernels round otherwise (llama.cpp)
        holds the uninterrupted context bit for bit; None: all prefilled as one prompt."""
        if prompt_len is None or prompt_len >= context_ids.numel():
            return self._prefill(context_ids)[0]
        prompt, _ = self._prefill(context_ids[:prompt_len])
        out = self.target.prefill(context_ids[prompt_len:], self.hidden_layers)
        hidden = None if out.hidden is None else torch.cat([prompt.hidden, out.hidden])
        return VerifiedUpdate(context_ids, 0, hidden, self.target)

    def verify(self, tree: DraftTree) -> Verified:
        """Score the tree in one forward, pick the accepted path and next token, commit the path."""
        start_pos = self.target.num_cached
        out = self.target.verify(tree, self.hidden_layers)
        logits = out.logits.cpu()  # the verifiers run on the CPU, whatever device the target is on
        if self.sampling.greedy:
            accepted = verify_greedy(tree, logits)
        else:
            accepted = verify_stochastic(tree, target_probs(logits.double(), self.sampling), self.generator)
        self.target.commit(accepted.path_node_idx)
        path = torch.tensor(accepted.path_node_idx)
        hidden = None if out.hidden is None else out.hidden[path]
        return Verified(accepted, VerifiedUpdate(tree.token_ids[path], start_pos, hidden, self.target))

    def _prefill(self, ids: torch.Tensor) -> tuple[VerifiedUpdate, torch.Tensor]:
        out = self.target.set_context(ids, self.hidden_layers)
        return VerifiedUpdate(ids, 0, out.hidden, self.target), out.logits[-1].cpu()
