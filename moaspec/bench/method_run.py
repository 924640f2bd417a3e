"""What one benchmarked generation returns, and what every benchmarked method provides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from moaspec.metrics import SpecStats

if TYPE_CHECKING:
    from moaspec.config import SamplingConfig


@dataclass
class MethodRun:
    """One generation. token_ids: new tokens only; wall_s: around the whole call (prefill included).

    stats: the engine's SpecStats; for other libraries' methods (hf, llama.cpp) only new_tokens, target_forwards and
    forward_tokens are filled (forwards counted around the library), so tau is defined but the time split
    is not (`has_time_split` False).
    """

    token_ids: list[int]
    wall_s: float
    stats: SpecStats
    has_time_split: bool


class Method(Protocol):
    label: str
    lossless: bool  # our engine (and hf on the same model): greedy output checked against `none`

    def run(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int, seed: int) -> MethodRun: ...
