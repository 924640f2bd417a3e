"""What a target's transformers config says about its rotary embedding and normalization, read
the same way by the drafters (which copy both) and the runtimes that run the target's layers."""

from __future__ import annotations

from typing import Any


def target_rope_theta(target_config: Any) -> float:
    """rope theta of a transformers config (5.x keeps it in rope_parameters)."""
    params = getattr(target_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(target_config, "rope_theta", 10000.0)))


def target_norm_eps(target_config: Any) -> float:
    """The target's normalization epsilon (RMSNorm's, else LayerNorm's: GPT-2), which the
    drafter's own RMSNorms take."""
    for name in ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps"):
        value = getattr(target_config, name, None)
        if value is not None:
            return float(value)
    return 1e-6
