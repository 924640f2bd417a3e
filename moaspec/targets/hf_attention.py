"""Which attention each decoder layer of a transformers target uses, and the tree masks they take.

Targets with sliding-window layers (Mistral with `sliding_window`, Gemma 2 / 3, Qwen2 with
`use_sliding_window`, ...) keep every layer's keys/values in a full cache (a sliding cache drops
the oldest entries, which the commit's compaction and `layer_kv` index by position) and apply the
window through the mask: transformers builds it for a prefill or a chain, and a tree gets
`tree_attention_bias` with the window for the sliding layers. Models mixing both kinds take a mask
per layer type (a dict), as transformers' own mask creation gives them; models that build one
mask for every layer are read from their forward (`mask_building`), not from `layer_types`.
Other layer kinds (chunked, linear or compressed attention, shared caches) are refused: trees
could not be verified exactly on them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from moaspec.errors import MoaspecError
from moaspec.tree import tree_attention_bias

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class AttentionLayout:
    """The decoder layers' attention kinds (FULL or SLIDING) and the sliding layers' window."""

    kinds: tuple[str, ...]
    window: int | None  # None when no layer slides

    @classmethod
    def of(cls, config: Any, name: str, model: PreTrainedModel | None = None) -> AttentionLayout:
        """From a transformers config (and the model: how it builds its masks); MoaspecError for
        layers whose trees cannot be verified."""
        text_config = config.get_text_config(decoder=True)
        masks = None if model is None else mask_building(model)
        if masks in (FULL, SLIDING):
            window = getattr(text_config, "sliding_window", None) if masks == SLIDING else None
            kind = FULL if window is None else SLIDING
            return cls((kind,) * text_config.num_hidden_layers, None if window is None else int(window))
        kinds, settings = _layer_kinds(text_config)
        unsupported = sorted(set(kinds) - {FULL, SLIDING})
        if unsupported:
            raise MoaspecError(
                f"target {name} has {', '.join(unsupported)} layers: the transformers runtime verifies trees on "
                "full and sliding-window attention only"
            )
        windows = {int(setting["sliding_window"]) for kind, setting in zip(kinds, settings) if kind == SLIDING}
        if len(windows) > 1:
            raise MoaspecError(f"target {name} has sliding windows of several sizes ({sorted(windows)}): not supported")
        return cls(tuple(kinds), windows.pop() if windows else None)

    def tree_mask(
        self, parents: np.ndarray, num_cached: int, dtype: torch.dtype
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive mask [1, 1, N, num_cached + N] verifying a tree after `num_cached` tokens
        takes in every layer, or per layer kind ({FULL: ..., SLIDING: ...}) where they differ."""
        if self.window is None:
            return tree_attention_bias(parents, num_cached, dtype)
        sliding = tree_attention_bias(parents, num_cached, dtype, self.window)
        if SLIDING in self.kinds and FULL not in self.kinds:
            return sliding
        return {FULL: tree_attention_bias(parents, num_cached, dtype), SLIDING: sliding}


PER_KIND = "per_kind"


def mask_building(model: PreTrainedModel) -> str | None:
    """How the model's forward masks its layers: PER_KIND (a mask per layer kind,
    `causal_mask_mapping`: Qwen2, Gemma 2 / 3, Cohere 2, ...; the config's `layer_types` say which
    layer takes which), SLIDING (one mask for every layer, windowed when `config.sliding_window`
    is set, whatever `layer_types` says: Mistral, Mixtral, Phi-3, Starcoder2), FULL (one causal
    mask: Llama, GPT-2), or None when its source cannot be read (the config's layer kinds)."""
    return _mask_building_of(type(model.base_model))


@functools.cache
def _mask_building_of(model_class: type) -> str | None:
    """mask_building for a model class (reading its source takes most of a millisecond, and every
    session of a target is a new HFTarget on the same model)."""
    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return None
    if "causal_mask_mapping" in source:
        return PER_KIND
    return SLIDING if "create_sliding_window_causal_mask" in source else FULL


def _layer_kinds(config) -> tuple[list[str], list[dict]]:
    """Every decoder layer's kind and settings, as transformers' caches see them
    (`get_layer_types_and_kwargs`, in transformers 5.16 and later; before, from `layer_types` or
    the config's one `sliding_window`)."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        window = getattr(config, "sliding_window", None)
        kinds = list(getattr(config, "layer_types", None) or [SLIDING if window is not None else FULL] * config.num_hidden_layers)
        return kinds, [{"sliding_window": window} if kind == SLIDING else {} for kind in kinds]
    return get_layer_types_and_kwargs(config)
