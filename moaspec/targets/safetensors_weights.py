"""Tensors by name from a model directory's safetensors weights, whole or sharded: what the
parts loader (targets/load.py) and the float prefill (targets/float_prefill.py,
float_weights.py) read a target's layers and embedding from."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    import torch

    from moaspec.nn.file_rows import FileRows


class SafetensorsWeights:
    """Tensors by name from a directory's `model.safetensors`, or from the shards its
    `model.safetensors.index.json` maps them to (a context manager: the files close on exit)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        self.shard_of: dict[str, str] | None = None
        if index.is_file():
            self.shard_of = json.loads(index.read_text())["weight_map"]
        elif not (self.model_dir / "model.safetensors").is_file():
            raise MoaspecError(f"{self.model_dir} has no safetensors weights to read the drafter's target modules from")
        self._stack = contextlib.ExitStack()
        self._open: dict[str, object] = {}

    def get_tensor(self, name: str) -> torch.Tensor:
        file = self.file_of(name)
        if file not in self._open:
            from safetensors import safe_open

            self._open[file] = self._stack.enter_context(safe_open(self.model_dir / file, framework="pt"))
        return self._open[file].get_tensor(name)

    def rows(self, name: str, dtype: torch.dtype | None = None) -> FileRows:
        """A 2-D tensor as `dtype` rows (default float32) read on demand (nn/file_rows.py: never memory-mapped)."""
        import torch

        from moaspec.nn.file_rows import FileRows

        return FileRows(self.model_dir / self.file_of(name), name, torch.float32 if dtype is None else dtype)

    def file_of(self, name: str) -> str:
        """The file (in model_dir) that holds tensor `name`."""
        file = "model.safetensors" if self.shard_of is None else self.shard_of.get(name)
        if file is None:
            raise MoaspecError(f"{self.model_dir}: no tensor '{name}' in model.safetensors.index.json")
        return file

    def __enter__(self) -> SafetensorsWeights:
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()
