"""Rows of a frozen target matrix read from its safetensors file on demand, never mapped.

A model drafter on llama.cpp borrows the target's token embedding (its LM head when tied): 49,152
× 576 float32 for SmolLM2, 113 MB. Memory-mapped, every row a drafter touches maps the pages
around it (the kernel's fault-around), so the 8,192 rows of a draft vocabulary, spread over the
vocabulary, mapped nearly the whole file into the process (peak RSS +106 MB for 19 MB of rows).
`FileRows` reads the rows asked for with `os.preadv` into the process's own memory, and the whole
matrix only when a caller needs all of it (`full`: a full-vocabulary head, training).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moaspec.safetensors_rows import TensorRows

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
}


class FileRows:
    """One 2-D tensor of a safetensors file, rows read on demand (safetensors_rows.py) and
    returned as `dtype`."""

    def __init__(self, path: str | Path, name: str, dtype: torch.dtype = torch.float32) -> None:
        self.path = Path(path)
        self.name = name
        self.dtype = dtype
        self.tensor = TensorRows(self.path, name)
        self.stored_dtype = SAFETENSORS_DTYPES[self.tensor.stored]
        self.shape = self.tensor.shape
        self.row_bytes = self.tensor.row_bytes
        self._full: torch.Tensor | None = None

    def __getstate__(self) -> dict:  # a copy opens the file again (an fd number is this object's own)
        return {"path": self.path, "name": self.name, "dtype": self.dtype}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["name"], state["dtype"])

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., D] in `dtype` on the CPU: the rows at those indices (0..V-1), as
        indexing the whole matrix gives them. Ids that follow each other are read in one call."""
        wanted = ids.detach().reshape(-1).tolist()
        if self._full is not None:
            self.tensor.check_indices(wanted)
            return self._full[ids.cpu()]
        out = torch.empty((len(wanted), self.shape[1]), dtype=self.stored_dtype)
        self.tensor.read_rows(wanted, memoryview(out.view(torch.uint8).numpy().reshape(-1)))
        return out.to(self.dtype).reshape(*ids.shape, self.shape[1])

    def full(self) -> torch.Tensor:
        """[V, D] in `dtype`: the whole matrix, read once and kept."""
        if self._full is None:
            out = torch.empty(self.shape, dtype=self.stored_dtype)
            self.tensor.read(0, self.shape[0], memoryview(out.view(torch.uint8).numpy().reshape(-1)))
            self._full = out.to(self.dtype)
        return self._full


class RowEmbedding(nn.Module):
    """A frozen embedding over `FileRows`: forward(ids [...]) -> [..., D], as nn.Embedding gives.
    `weight` is the whole matrix (read once, on first use)."""

    def __init__(self, rows: FileRows) -> None:
        super().__init__()
        self.file_rows = rows
        self.num_embeddings, self.embedding_dim = rows.shape

    @property
    def weight(self) -> torch.Tensor:
        return self.file_rows.full()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.file_rows.rows(ids)
