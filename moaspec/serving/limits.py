"""Server limits (kept free of heavy imports so the CLI can show and check them before torch loads)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one client, one key and all clients together can hold.

    Sessions reserve prompt + max_new_tokens cached tokens (the most their KV cache can grow to)
    against `max_cached_tokens_per_key` and `max_cached_tokens`; on SmolLM2-135M with the MoA
    drafter a cached token costs ~140 KB on the transformers runtime (a 2,048-token session ~280 MB);
    on llama.cpp a session's context holds its reservation at most, allocated as it fills.
    """

    max_body_bytes: int = 1 << 20
    max_tree_nodes: int = 64
    max_new_tokens: int = 2048
    max_sessions_per_key: int = 8
    max_sessions: int = 64
    idle_timeout_s: float = 300.0
    max_draft_prob_entries: int = 1 << 16  # sparse drafter probabilities per tree
    max_cached_tokens_per_key: int = 16384
    max_cached_tokens: int = 32768
    max_connections: int = 256
    header_timeout_s: float = 10.0  # request line + headers, from the connection or the request's first byte
    body_timeout_s: float = 30.0  # the whole body, from the handler asking for it (1 MiB at 1 Mbit/s: ~8 s)
    keepalive_timeout_s: float = 75.0  # an idle keep-alive connection is closed after this
    shutdown_timeout_s: float = 10.0  # after Ctrl-C / SIGTERM, requests in flight may finish for this long

    def within_runtime(self, target: Any) -> ServerLimits:
        """These limits with max_tree_nodes lowered to what `target`'s runtime verifies in one tree
        (its `max_tree_nodes`; llama.cpp on GGUFs exact only for short chains), if that is less."""
        runtime_nodes = getattr(target, "max_tree_nodes", None)
        if runtime_nodes is None or runtime_nodes >= self.max_tree_nodes:
            return self
        return replace(self, max_tree_nodes=runtime_nodes)


@dataclass(frozen=True)
class OpenAILimits:
    """max_waiting: generations that may wait for the model while one runs (one more gets 429)."""

    max_waiting: int = 8

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
