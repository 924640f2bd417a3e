"""moaspec: lossless speculative decoding with Mixture of Attentions (arXiv 2410.03804).

Public API (imported lazily, so `import moaspec` and the CLI's error paths stay fast):
    load(target="smollm2-135m", drafter=None) -> SpeculativeLM  (None: the machine calibration's choice)
    SpeculativeLM.generate(prompt, ..., streamer=None) -> GenerationOutput
    generate(prompt, target=..., drafter=..., streamer=None, ...) -> GenerationOutput (one-shot)
    Engine, SamplingConfig, GenerationConfig, DraftTree, verify_greedy, verify_stochastic, MoaspecError

Glossary (shapes in comments use B batch, T tokens, N tree nodes, V vocabulary, D hidden size):
- target: the LLM whose output must not change. drafter: the cheap model proposing tokens.
- draft tree: node 0 is the *root*, the last emitted token, not yet processed by the target;
  each other node is a drafted token; a chain is a tree.
- accepted: drafted tokens the verifier kept. recovered: a token drawn from the residual
  max(p_target - p_draft, 0) after every child of a node was rejected. bonus: a token drawn from
  the target after the last accepted node had no accepted child. Either becomes the next root.
- tau (mean_tokens_per_forward): tokens produced per target forward, bonus included; plain
  decoding gives exactly 1.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load": "moaspec.api",
    "generate": "moaspec.api",
    "load_target": "moaspec.api",
    "SpeculativeLM": "moaspec.api",
    "GenerationOutput": "moaspec.api",
    "Engine": "moaspec.engine",
    "GenerationResult": "moaspec.engine",
    "SamplingConfig": "moaspec.config",
    "GenerationConfig": "moaspec.config",
    "DraftTree": "moaspec.tree",
    "Accepted": "moaspec.verify",
    "verify_greedy": "moaspec.verify",
    "verify_stochastic": "moaspec.verify",
    "SpecStats": "moaspec.metrics",
    "HFTarget": "moaspec.targets.hf",
    "LlamaCppTarget": "moaspec.targets.llamacpp",
    "MoaspecError": "moaspec.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moaspec' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
