"""The frozen target modules a drafter borrows (every runtime provides them: targets/base.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moaspec.nn.file_rows import FileRows, RowEmbedding


@dataclass
class TargetParts:
    """Frozen target modules the drafter borrows; never part of the drafter's state dict.

    Read from the target's files (a llama.cpp or reduced-precision target), the embedding and the
    LM head are `RowEmbedding` / `FileRows`: rows read on demand, never memory-mapped (file_rows.py).
    """

    embed_tokens: nn.Module
    lm_head: torch.Tensor | FileRows  # [V, D]
    final_norm: nn.Module
    tli_layers: list[nn.Module]  # the target's last k decoder layers
    rotary_emb: nn.Module | None  # None where no drafter can use it (llama.cpp: no TLI)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D]: the whole LM head (a file-backed one read whole, once)."""
        return self.lm_head.full() if isinstance(self.lm_head, FileRows) else self.lm_head

    def lm_head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, D]: those rows of the LM head, without reading the rest."""
        if isinstance(self.lm_head, FileRows):
            return self.lm_head.rows(ids)
        return self.lm_head[ids]

    def embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> [N, D]: rows of the embedding matrix as stored (not its forward, which some
        models scale), without reading the rest where file-backed."""
        if isinstance(self.embed_tokens, RowEmbedding):
            return self.embed_tokens.file_rows.rows(ids)
        weight = self.embed_tokens.weight.detach()
        return weight[ids.to(weight.device)]

    def to(self, device: torch.device | str) -> TargetParts:
        """The same parts on `device` (modules moved in place; a no-op where they already are).
        File-backed rows stay so on the CPU and are read whole onto another device."""
        on_cpu = torch.device(device).type == "cpu"
        embed_tokens = self.embed_tokens
        if isinstance(embed_tokens, RowEmbedding) and not on_cpu:
            embed_tokens = nn.Embedding.from_pretrained(embed_tokens.weight, freeze=True)
        lm_head = self.lm_head if isinstance(self.lm_head, FileRows) and on_cpu else self.lm_head_weight
        return TargetParts(
            embed_tokens=embed_tokens.to(device),
            lm_head=lm_head if isinstance(lm_head, FileRows) else lm_head.to(device),
            final_norm=self.final_norm.to(device),
            tli_layers=[layer.to(device) for layer in self.tli_layers],
            rotary_emb=None if self.rotary_emb is None else self.rotary_emb.to(device),
        )
