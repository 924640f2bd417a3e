"""The decode loop: prefill -> (propose -> verify -> accept -> commit)*.

Invariants between steps:
- the target's cache holds exactly the verified tokens (prompt + emitted tokens except the last);
- the last emitted token is the root of the next draft tree (position target.num_cached);
- the drafter has been told (`accept`) about every verified token, in order.

Greedy decoding emits exactly the target's argmax sequence; sampling emits exactly the target's
warped distribution (verify.py). Each step is `decode_step` (decode_step.py, shared with the
split client); its target side is a `TargetSession` (session.py), which the split server
(moaspec/split) also runs, one per client; the drafter and the verifier draw from separate seeded
streams so the two halves can live on different machines. No I/O here: tokens are yielded as
they are decided.

One engine holds one target context and one drafter state, so it runs one generation at a time
(exclusive.py: a newer generation supersedes an unfinished one, whose next step raises).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.decode_step import Verdict, decode_step, last_emitted
from moaspec.drafters.base import Drafter
from moaspec.errors import MoaspecError
from moaspec.exclusive import OneAtATime
from moaspec.metrics import SpecStats
from moaspec.session import TargetSession, draft_generator
from moaspec.targets.base import Target
from moaspec.tree import DraftTree, int_array

if TYPE_CHECKING:
    import torch


@dataclass
class GenerationResult:
    """token_ids: new tokens only (a stop token, when hit, is the last one)."""

    token_ids: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    stop_reason: str = "length"  # "stop_token" | "length" | "context"


def check_prompt_length(num_tokens: int, target: Target) -> None:
    """MoaspecError unless a prompt of num_tokens leaves the target's context room for the answer's
    first token (checked before a generation starts: nothing is streamed for a refused prompt)."""
    if num_tokens == 0:
        raise MoaspecError("the prompt is empty")
    if num_tokens >= target.max_positions:
        raise MoaspecError(
            f"the prompt has {num_tokens} tokens but the target's context holds "
            f"{target.max_positions}, the answer's first token included: at most {target.max_positions - 1}"
        )


class Engine:
    """Speculative generation with one target and one drafter (batch size 1), one generation at
    a time (module docstring)."""

    def __init__(self, target: Target, drafter: Drafter) -> None:
        self.target = target
        self.drafter = drafter
        self._one_at_a_time = OneAtATime("engine")

    def generate(
        self,
        prompt_ids: list[int] | np.ndarray | torch.Tensor,
        sampling: SamplingConfig = SamplingConfig(),
        generation: GenerationConfig = GenerationConfig(),
        stop_ids: frozenset[int] | None = None,
    ) -> GenerationResult:
        """Run to completion; see `stream` for the arguments."""
        result = GenerationResult()
        for _ in self.stream(prompt_ids, sampling, generation, stop_ids, result):
            pass
        return result

    def stream(
        self,
        prompt_ids: list[int] | np.ndarray | torch.Tensor,
        sampling: SamplingConfig = SamplingConfig(),
        generation: GenerationConfig = GenerationConfig(),
        stop_ids: frozenset[int] | None = None,
        result: GenerationResult | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[list[int]]:
        """Yield the new tokens of each step; fill `result` (token ids, stats) as it goes.

        prompt_ids: [T] token ids, T >= 1. stop_ids: default = the target's end-of-sequence ids.
        The prompt is checked here, eagerly, so a bad request fails before anything is streamed.
        cancel: setting it stops the prompt's prefill part-way (PrefillCancelled raised from the
        first step; Target.cancellable); between steps the caller simply stops iterating.
        """
        prompt = int_array(prompt_ids).reshape(-1)
        check_prompt_length(prompt.size, self.target)
        result = result if result is not None else GenerationResult()
        stop_ids = self.target.stop_ids if stop_ids is None else stop_ids
        return self._one_at_a_time.run(self._run(prompt, sampling, generation, stop_ids, result, cancel))

    def _run(
        self,
        prompt: np.ndarray,
        sampling: SamplingConfig,
        generation: GenerationConfig,
        stop_ids: frozenset[int],
        result: GenerationResult,
        cancel: threading.Event | None,
    ) -> Iterator[list[int]]:
        stats = result.stats
        emitted_before = len(result.token_ids)  # a caller's result may hold earlier tokens
        room = self.target.max_positions - prompt.size
        max_new = min(generation.max_new_tokens, room)
        limit = emitted_before + max_new  # len(result.token_ids) at which this generation ends
        session = TargetSession(self.target, self.drafter.hidden_layers, sampling, generation.seed)
        # greedy drafters draw nothing: no generator (nor torch) for greedy plain decoding or prompt lookup
        generator = None if sampling.greedy else draft_generator(generation.seed)
        started = time.perf_counter() - stats.wall_s  # a caller's result: its stats add up, wall time too

        # 0. prefill: the prompt becomes verified context; its last logits give the first token.
        tick = time.perf_counter()
        with self.target.cancellable(cancel) if cancel is not None else nullcontext():
            root, update = session.prefill(prompt)
        stats.record_prefill(time.perf_counter() - tick)
        tick = time.perf_counter()
        self.drafter.reset()
        self.drafter.accept(update)
        stats.draft_s += time.perf_counter() - tick

        def verify(tree: DraftTree) -> Verdict:
            verified = session.verify(tree)
            accepted = verified.accepted
            return Verdict(accepted.path_node_idx, accepted.next_token, lambda: self.drafter.accept(verified.update))

        emitted = [root]
        while True:
            num_before = len(result.token_ids)
            done = self._emit(emitted, result, stop_ids, limit)
            stats.wall_s = time.perf_counter() - started
            yield result.token_ids[num_before:]
            stats.wall_s = time.perf_counter() - started
            if done:
                if result.stop_reason == "length" and generation.max_new_tokens > room:
                    result.stop_reason = "context"
                # the context plain decoding would hold (the accepted path may run past a stop token
                # or the limit): the next generation on this target then starts from the same state
                # whatever drafted this one (a chat's next turn keeps what it shares with it)
                held = prompt.size + len(result.token_ids) - emitted_before - 1
                if self.target.num_cached > held:
                    self.target.rollback(held)
                return
            # propose, verify in one target forward (the verifier picks the path, the target
            # commits it), tell the drafter (decode_step.py: shared with the split client)
            step = decode_step(
                self.drafter, root, limit - len(result.token_ids), sampling, generator, stats, verify,
                limits=self.target, vocab_size=self.target.vocab_size,
            )
            emitted, root = step.emitted, step.verdict.next_token

    @staticmethod
    def _emit(emitted: list[int], result: GenerationResult, stop_ids: frozenset[int], limit: int) -> bool:
        """Append emitted tokens up to a stop token or until result holds `limit` tokens (a caller's
        earlier ones included); True when generation is over."""
        last = last_emitted(emitted, limit - len(result.token_ids), stop_ids)
        kept = emitted if last is None else emitted[: last + 1]
        result.token_ids.extend(kept)
        result.stats.new_tokens += len(kept)
        if last is not None:
            result.stop_reason = "stop_token" if kept[-1] in stop_ids else "length"
        return last is not None

