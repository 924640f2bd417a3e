"""Server limits (kept free of heavy imports so the CLI can show and check them before torch loads)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one client can ask for."""

    max_body_bytes: int = 1 << 20
    max_tree_nodes: int = 64
    max_new_tokens: int = 2048
    max_sessions_per_key: int = 8
    max_sessions: int = 64
    idle_timeout_s: float = 300.0
    max_draft_prob_entries: int = 1 << 16  # sparse drafter probabilities per tree


@dataclass(frozen=True)
class OpenAILimits:
    """max_waiting: generations that may wait for the model while one runs (one more gets 429)."""

    max_waiting: int = 8

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
