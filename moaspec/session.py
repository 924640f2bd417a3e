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
from typing import TYPE_CHECKING, Any

import numpy as np

from moaspec.config import SamplingConfig
from moaspec.drafters.base import VerifiedUpdate
from moaspec.targets.base import Target
from moaspec.tree import DraftTree
from moaspec.verify import Accepted, logits_array, verify_greedy, verify_stochastic

if TYPE_CHECKING:
    import torch

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
    """The drafter's random stream for a generation seeded with `seed` (made only where something
    draws: greedy decoding with a model-free drafter runs without torch, so a sampled generation
    may import it first here, with signals held)."""
    from moaspec.signals import load_library_held

    load_library_held()
    import torch

    return torch.Generator().manual_seed((seed + DRAFT_SEED_OFFSET) % 2**64)


def _torch_logits(logits: Any) -> torch.Tensor:
    """A runtime's logits (numpy or torch, any device) as a CPU torch tensor, for sampling."""
    import torch

    return torch.as_tensor(logits).cpu()


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
        self.seed = seed
        self._generator: torch.Generator | None = None

    @property
    def generator(self) -> torch.Generator:
        """The verifier's random stream, seeded with `seed` (made on first use: greedy decoding
        draws nothing)."""
        if self._generator is None:
            import torch

            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator

    def prefill(self, prompt_ids: np.ndarray) -> tuple[int, VerifiedUpdate]:
        """A new sequence: prompt_ids [T] (int64) become verified context. -> (first token, update)."""
        update, logits = self._prefill(prompt_ids)
        if self.sampling.greedy:
            return int(logits_array(logits).argmax()), update
        from moaspec.sampling import sample, target_probs

        return sample(target_probs(_torch_logits(logits).double(), self.sampling), self.generator), update

    def resume(self, context_ids: np.ndarray, prompt_len: int | None = None) -> VerifiedUpdate:
        """Rebuild the verified context context_ids [T] without choosing a token (the caller
        already knows the root: resynchronisation after a disconnection). prompt_len: its first
        tokens were the prompt: prefilled as one, the rest appended as verification decoded them
        (`Target.prefill`), so that a runtime whose batched kernels round otherwise (llama.cpp)
        holds the uninterrupted context bit for bit; None: all prefilled as one prompt."""
        context_ids = np.asarray(context_ids, dtype=np.int64)
        if prompt_len is None or prompt_len >= context_ids.size:
            return self._prefill(context_ids)[0]
        prompt, _ = self._prefill(context_ids[:prompt_len])
        out = self.target.prefill(context_ids[prompt_len:], self.hidden_layers)
        if out.hidden is None:
            return VerifiedUpdate(context_ids, 0, None, self.target)
        import torch  # hidden states: a model drafter's, torch is loaded

        return VerifiedUpdate(context_ids, 0, torch.cat([prompt.hidden, out.hidden]), self.target)

    def verify(self, tree: DraftTree) -> Verified:
        """Score the tree in one forward, pick the accepted path and next token, commit the path."""
        start_pos = self.target.num_cached
        out = self.target.verify(tree, self.hidden_layers)
        # the verifiers run on the CPU, whatever device the target is on
        if self.sampling.greedy:
            accepted = verify_greedy(tree, out.logits)
        else:
            from moaspec.sampling import target_probs

            probs = target_probs(_torch_logits(out.logits).double(), self.sampling)
            accepted = verify_stochastic(tree, probs, self.generator)
        self.target.commit(accepted.path_node_idx)
        path = accepted.path_node_idx
        hidden = None if out.hidden is None else out.hidden[path]
        return Verified(accepted, VerifiedUpdate(tree.token_ids[path], start_pos, hidden, self.target))

    def _prefill(self, ids: np.ndarray) -> tuple[VerifiedUpdate, Any]:
        """-> (the update, the logits [V] after the last token: numpy or torch, as the runtime gives them)."""
        ids = np.asarray(ids, dtype=np.int64)
        out = self.target.set_context(ids, self.hidden_layers)
        return VerifiedUpdate(ids, 0, out.hidden, self.target), out.logits[-1]
