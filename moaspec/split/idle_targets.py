"""The split server's target sessions kept after their split session ends (`IdleTargets`), for
the next sessions to reuse."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moaspec.targets.base import Target


class IdleTargets:
    """Target sessions whose split session ended, kept for the next ones, most recent first.

    Only targets that keep what a new prompt shares with their context (`keeps_shared_start`,
    llama.cpp) are kept: a llama.cpp context costs ~100 ms to create, and one holding a key's
    previous turn lets the next turn's prefill skip what the two share (where that is bit for bit:
    not on GGUFs whose products change with the batch size, which prefill afresh). Of those large enough for
    the new session (a session's context is sized to its reservation), a key gets back its own
    most recent one as it is; otherwise the oldest one, emptied first (`reset` on the worker), so
    no cache content ever crosses keys. At most `capacity` are kept; the reaper drops stale ones.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: list[tuple[int, Target, float]] = []  # (key index, target, released at)

    def put(self, key_index: int, target: Target) -> None:
        if target.keeps_shared_start and self.capacity > 0:
            self.entries.insert(0, (key_index, target, time.monotonic()))
            del self.entries[self.capacity :]

    def take(self, key_index: int, positions: int) -> tuple[Target, bool] | None:
        """A kept target holding `positions` or more -> (it, whether it must be reset before use),
        or None when none is kept."""
        fitting = [index for index, (_, target, _) in enumerate(self.entries) if target.max_positions >= positions]
        for index in fitting:
            if self.entries[index][0] == key_index:
                return self.entries.pop(index)[1], False
        if fitting:
            return self.entries.pop(fitting[-1])[1], True
        return None

    def expire(self, released_before: float) -> None:
        self.entries = [entry for entry in self.entries if entry[2] >= released_before]

    def clear(self) -> None:
        self.entries.clear()
