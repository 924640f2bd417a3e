"""What every drafter network shares: the target modules it borrows, the reduced-vocabulary LM
head, the reference initialisation, and `save_pretrained` / `from_pretrained`.

Subclasses (`MoADrafterNet`, `EagleDrafterNet`) set `method` (the checkpoint's method name) and
`config_class` (a frozen dataclass with `draft_vocab_size` and `to_dict`), keep it in
`self.config`, and call `_register_draft_vocab()` in their constructor.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moaspec.errors import MoaspecError, first_line
from moaspec.nn.checkpoint import read_checkpoint, save_checkpoint
from moaspec.nn.layers import RMSNorm
from moaspec.nn.target_parts import TargetParts

if TYPE_CHECKING:
    from moaspec.targets.base import Target


class DrafterNet(nn.Module):
    """Base class of drafter networks (see the module docstring)."""

    method: str
    config_class: type

    def _register_draft_vocab(self) -> None:
        """`draft_vocab_ids` [Vd]: target ids of the draft vocabulary (empty = full vocabulary)."""
        self.register_buffer("draft_vocab_ids", torch.zeros(self.config.draft_vocab_size, dtype=torch.long))

    def reset_parameters(self, std: float = 0.02) -> None:
        """Linear weights ~ N(0, std), biases 0, RMSNorm weights 1.

        A measured deviation from the reference, which draws RMSNorm weights ~ N(0, 0.02) too
        (moa_reference.md §1.1): every norm then scales its branch by ~0.02, so CA keys, queries
        and values start near zero and Adam needs ~1/lr steps to grow them. On SmolLM2 with the
        same data and schedule, MoA's validation top-1 after 50 steps was 0.044 with the
        reference init and 0.156 with unit norms (more than the reference init reached in 300).
        """
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def head_weight(self, parts: TargetParts) -> torch.Tensor:
        """Rows of the target's LM head the drafter scores: [Vd, D] (all rows without reduction)."""
        if self.config.draft_vocab_size:
            return parts.lm_head_rows(self.draft_vocab_ids)
        return parts.lm_head_weight

    def save_pretrained(
        self,
        directory: str | Path,
        target: Target,
        tree: dict[str, Any] | None = None,
        training: dict[str, Any] | None = None,
        dtype: torch.dtype = torch.float16,
    ) -> Path:
        """Write `directory` (config.json + model.safetensors, float16 by default), atomically."""
        return save_checkpoint(directory, self.method, self, target, tree or {}, training, dtype)  # type: ignore[arg-type]

    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Target) -> tuple[Any, dict[str, Any]]:
        """-> (net in the target's dtype, the checkpoint's config record)."""
        record, state = read_checkpoint(directory, target)
        if record["method"] != cls.method:
            raise MoaspecError(f"{directory} holds a '{record['method']}' drafter, not '{cls.method}'")
        try:
            with warnings.catch_warnings():  # e.g. zero-element tensors of a damaged config: its error says enough
                warnings.simplefilter("ignore")
                net = cls(cls.config_class(**record["config"]))  # type: ignore[call-arg]
            net.load_state_dict(state)  # type: ignore[attr-defined]
        except (TypeError, ValueError, RuntimeError, ZeroDivisionError) as exc:
            raise MoaspecError(f"{directory}: weights do not match the recorded config ({first_line(exc)})") from exc
        return net.to(target.dtype), record  # type: ignore[attr-defined]
