"""Admission of split sessions: how many each key and the server may hold, and how many tokens
their KV caches may reach.

A session reserves prompt + max_new_tokens cached tokens (the most its cache can grow to) when it
opens, before its prefill runs, so concurrent opens cannot overshoot; the reservation is released
when the session closes, expires, fails, or its open fails. A key over its own share gets 429 (it
can close sessions); the server over its total gets 503 (another key holds the room); a session
that could never fit, 413. Used only
from the server's event loop: no locks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from moaspec.serving.errors import APIError
from moaspec.serving.limits import ServerLimits


@dataclass(frozen=True)
class Reservation:
    key_index: int
    num_tokens: int


class SessionBudget:
    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.sessions_per_key: Counter[int] = Counter()
        self.tokens_per_key: Counter[int] = Counter()

    @property
    def num_sessions(self) -> int:
        return sum(self.sessions_per_key.values())

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_key.values())

    def reserve(self, key_index: int, num_tokens: int) -> Reservation:
        """Take room for one session of up to `num_tokens` cached tokens, or refuse (APIError)."""
        limit = self.limits
        if num_tokens > min(limit.max_cached_tokens_per_key, limit.max_cached_tokens):  # would never fit: no retry helps
            raise APIError(
                413, f"a session of {num_tokens} cached tokens (prompt + max_new_tokens) is more than this server lets one "
                f"key cache ({min(limit.max_cached_tokens_per_key, limit.max_cached_tokens)}); ask for fewer tokens", None, "token_budget",
            )
        if self.sessions_per_key[key_index] >= limit.max_sessions_per_key:
            raise APIError(429, f"this key already has {limit.max_sessions_per_key} open sessions", None, "too_many_sessions")
        if self.tokens_per_key[key_index] + num_tokens > limit.max_cached_tokens_per_key:
            raise APIError(
                429, f"this key's sessions would cache more than {limit.max_cached_tokens_per_key} tokens "
                f"(prompt + max_new_tokens each); close a session or ask for fewer tokens", None, "token_budget",
            )
        if self.num_sessions >= limit.max_sessions:
            raise APIError(503, "the server has no free session slot; retry later", None, "busy")
        if self.num_tokens + num_tokens > limit.max_cached_tokens:
            raise APIError(503, f"the server's sessions would cache more than {limit.max_cached_tokens} tokens; retry later", None, "busy")
        self.sessions_per_key[key_index] += 1
        self.tokens_per_key[key_index] += num_tokens
        return Reservation(key_index, num_tokens)

    def release(self, reservation: Reservation) -> None:
        self.sessions_per_key[reservation.key_index] -= 1
        self.tokens_per_key[reservation.key_index] -= reservation.num_tokens

    def clear(self) -> None:
        self.sessions_per_key.clear()
        self.tokens_per_key.clear()
