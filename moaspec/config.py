"""Frozen configuration dataclasses shared by the engine, the drafters and the CLI.

Validation lives in `__post_init__` and raises `MoaspecError`, so a bad value from any entry
point (CLI flag, library call, server request) gets the same one-line message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moaspec.errors import MoaspecError

# Bounds of a draft tree (--tree-*): far beyond what pays anywhere (the tuned trees are depth
# <= 6, budget <= 16); a larger tree only makes the calibration and every step crawl.
MAX_TREE_DEPTH = 32
MAX_TREE_TOP_K = 32
MAX_TREE_BUDGET = 256


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the target distribution.

    temperature == 0 means greedy (argmax); top_k == 0 and top_p == 1 disable those filters.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        _check_types(self, temperature=float, top_p=float, top_k=int)
        if not 0.0 <= self.temperature < math.inf:
            raise MoaspecError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise MoaspecError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise MoaspecError(f"top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_types(config: object, **expected: type) -> None:
    """MoaspecError naming the first field whose value is not of its type (bool is not a number;
    an int is a float)."""
    for name, kind in expected.items():
        value = getattr(config, name)
        allowed = (int, float) if kind is float else (kind,)
        if isinstance(value, bool) or not isinstance(value, allowed):
            shown = "a number" if kind is float else "an integer"
            raise MoaspecError(f"{name.replace('_', '-')} must be {shown}, got {value!r}")


@dataclass(frozen=True)
class GenerationConfig:
    """Limits of one generation request."""

    max_new_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        _check_types(self, max_new_tokens=int, seed=int)
        if self.max_new_tokens < 1:
            raise MoaspecError(f"max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not -(2**63) <= self.seed < 2**64:  # the range torch.Generator.manual_seed accepts
            raise MoaspecError(f"seed must fit in 64 bits, got {self.seed}")


@dataclass(frozen=True)
class TreeConfig:
    """depth: drafted levels; top_k: beams per level and children per beam; budget: drafted nodes kept.

    Defaults from costs measured on the 2-core CPU (SmolLM2-135M, sdpa, column-major weights,
    256-token context): verifying 9 nodes costs ~1.7 decode steps, 17 nodes 2.1-2.5; one drafter
    level costs ~0.1-0.15 of a step with a reduced vocabulary. So: 8 drafted nodes, 4 levels.

    sampled: when decoding with temperature > 0, draw the tree from the drafter's distribution
    instead (top_k chains of `depth` tokens, first tokens drawn without replacement; fixed shape,
    no rerank) and hand the drafter's probabilities to the verifier. Greedy decoding always
    uses the deterministic dynamic tree.
    """

    depth: int = 4
    top_k: int = 3
    budget: int = 8
    sampled: bool = False

    def __post_init__(self) -> None:
        _check_types(self, depth=int, top_k=int, budget=int)
        if not (1 <= self.depth <= MAX_TREE_DEPTH and 1 <= self.top_k <= MAX_TREE_TOP_K and 1 <= self.budget <= MAX_TREE_BUDGET):
            raise MoaspecError(
                f"tree depth must be in [1, {MAX_TREE_DEPTH}], top-k in [1, {MAX_TREE_TOP_K}] and budget in [1, {MAX_TREE_BUDGET}]"
            )


@dataclass(frozen=True)
class NgramConfig:
    """The n-gram (prompt-lookup) drafter's settings (drafters/ngram.py): min_ngram..max_ngram
    are the n-gram lengths tried (longest first); the rest bounds the tree."""

    min_ngram: int = 2
    max_ngram: int = 4
    max_depth: int = 8
    max_branches: int = 3
    max_nodes: int = 16

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise MoaspecError("need 1 <= min_ngram <= max_ngram")
        if self.max_depth < 1 or self.max_branches < 1 or self.max_nodes < 2:
            raise MoaspecError("max_depth and max_branches must be >= 1, max_nodes >= 2")
