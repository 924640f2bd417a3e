"""Drafter checkpoints: a directory with `config.json` + `model.safetensors`.

The safetensors file holds only the drafter's own weights (and its draft-vocabulary id map); the
target's embeddings, LM head and layers are borrowed at load time. `config.json` records:
    format_version, method ("moa" | "eagle"), config (the net's dataclass), tree (TreeConfig),
    target: {"name", "fingerprint"}, and free-form "training" provenance.
Loading for a target with a different fingerprint is refused with a one-line MoaspecError.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from moaspec.atomic_files import new_hidden_directory
from moaspec.errors import MoaspecError
from moaspec.nn.fingerprint import CONFIG_FILE, check_made_for, target_fingerprint

if TYPE_CHECKING:
    from moaspec.targets.base import Target

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"


def save_checkpoint(
    directory: str | Path,
    method: str,
    net: torch.nn.Module,
    target: Target,
    tree: dict[str, Any],
    training: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float16,
) -> Path:
    """Write the checkpoint atomically (a staging directory renamed into place)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "format_version": FORMAT_VERSION,
        "method": method,
        "config": net.config.to_dict(),
        "tree": tree,
        "target": {"name": target.name, "fingerprint": target_fingerprint(target)},
        "training": training or {},
    }
    tensors = {
        name: (value.to(dtype) if value.is_floating_point() else value).cpu().contiguous()
        for name, value in net.state_dict().items()
    }
    staging = new_hidden_directory(directory.parent, directory.name)
    try:
        (staging / WEIGHTS_FILE).write_bytes(save(tensors))  # the umask's permissions (save_file's are 0600)
        (staging / CONFIG_FILE).write_text(json.dumps(record, indent=2) + "\n")
        if directory.exists():
            shutil.rmtree(directory)
        os.rename(staging, directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def read_checkpoint(directory: str | Path, target: Target) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """-> (config record, state dict). MoaspecError when unreadable or made for another target."""
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise MoaspecError(f"{directory} is not a drafter checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        record = json.loads(config_path.read_text())
    except ValueError as exc:
        raise MoaspecError(f"{config_path} is not a valid drafter config: {exc}") from exc
    missing = [key for key in ("method", "target", "config") if key not in record] if isinstance(record, dict) else ["an object"]
    if missing:
        raise MoaspecError(f"{config_path} is not a valid drafter config: no {', '.join(missing)}")
    version = record.get("format_version", 0)
    if not isinstance(record["config"], dict) or isinstance(version, bool) or not isinstance(version, int):
        raise MoaspecError(f"{config_path} is not a valid drafter config: 'config' must be an object, 'format_version' an integer")
    if version > FORMAT_VERSION:
        raise MoaspecError(f"{directory} was written by a newer moaspec (format {record['format_version']})")
    check_made_for(record, directory, target)
    try:
        return record, load_file(str(weights_path))
    except SafetensorError as exc:
        raise MoaspecError(f"{weights_path} is not readable safetensors ({exc}); the checkpoint is damaged") from None
