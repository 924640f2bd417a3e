"""Which target a drafter checkpoint was made for: a fingerprint of the target's architecture and
of a strided sample of its token embedding's rows, and the check that refuses another target.

Without torch where the target says in which file its embedding is stored as float32 or float16
rows (`embedding_file`: a llama.cpp target's converted copy), so that a drafter built in the
background (drafters/background.py) is checked against its target before the first token; else
from the target's parts in torch (its first import held). Both give the same bits (tested).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from moaspec.targets.base import Target

CONFIG_FILE = "config.json"
ARCHITECTURE_FIELDS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
SAMPLED_ROWS = 512  # about this many rows of the embedding (a stride through it), not the whole matrix


def target_fingerprint(target: Target) -> str:
    """Identify a target by its architecture and (a strided sample of) its token embeddings."""
    shape = {key: getattr(target.config, key, None) for key in ARCHITECTURE_FIELDS}
    sample = _stored_sample(target)
    if sample is None:
        sample = _torch_sample(target)
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode() + sample)
    return digest.hexdigest()[:16]


def check_made_for(record: dict[str, Any], directory: str | Path, target: Target) -> None:
    """MoaspecError unless the checkpoint whose config.json is `record` was trained for `target`."""
    recorded = record.get("target")
    if not isinstance(recorded, dict):
        raise MoaspecError(f"{Path(directory) / CONFIG_FILE} is not a valid drafter config: no target recorded")
    fingerprint = target_fingerprint(target)
    if recorded.get("fingerprint") != fingerprint:
        raise MoaspecError(
            f"drafter {directory} ({record.get('method')}) was trained for target '{recorded.get('name')}' "
            f"(fingerprint {recorded.get('fingerprint')}), not for '{target.name}' ({fingerprint})"
        )


def _sampled(rows: int) -> range:
    return range(0, rows, max(1, rows // SAMPLED_ROWS))


def _stored_sample(target: Target) -> bytes | None:
    """The sampled rows as float32 bytes, read from the target's embedding file; None where it has
    none (a torch target) or stores bfloat16."""
    source = getattr(target, "embedding_file", None)  # (path, tensor name)
    if source is None:
        return None
    from moaspec.safetensors_rows import TensorRows

    rows = TensorRows(*source)
    sample = rows.numpy_rows(_sampled(rows.shape[0]))
    return None if sample is None else sample.astype(np.float32).tobytes()


def _torch_sample(target: Target) -> bytes:
    """The sampled rows as float32 bytes, from the target's parts in torch."""
    from moaspec.signals import load_library_held

    load_library_held()  # the first import of torch, held
    import torch

    from moaspec.nn.file_rows import RowEmbedding

    parts = target.parts(0)
    embed_tokens = parts.embed_tokens
    rows = embed_tokens.num_embeddings if isinstance(embed_tokens, RowEmbedding) else embed_tokens.weight.shape[0]
    sample = parts.embedding_rows(torch.tensor(list(_sampled(rows))))
    return sample.to(torch.float32).cpu().contiguous().numpy().tobytes()
