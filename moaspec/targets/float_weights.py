"""The float prefill's layer matrices in float16, kept in a file beside the target's float32 copy
and mapped by every process that prefills in float (float_prefill.py).

Narrowed from the float32 copy, they cost a process 0.3-0.6 s at its first float prefill (425 MB
read into fresh memory, then narrowed to 212 MB on SmolLM2-135M): about what a one-shot command's
only prompt gains on that path. Mapped from a float16 file, written once (atomically) by the first
process that narrows them, they load in ~0.02 s, and their pages come from the page cache as the
forward first reads them; they count in the process's RSS as the held copies did. The mapping is
copy-on-write (nothing reaches the file) and is never closed: the tensors hold it.

The file records the float32 files it came from (name, size, modification time); one that does
not match them, cannot be parsed or lacks a matrix is written again; where it cannot be written
(a read-only cache) the narrowed copies are held, as before this file existed.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import torch

FILE_NAME = "float16-layers.safetensors"
FORMAT_VERSION = "1"


def float16_matrices(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """{name: float16 [out, in]} for `names` (2-D tensors of model_dir's safetensors weights):
    mapped from FILE_NAME where it holds them for these weights, else narrowed from them (and
    that file written for the next process)."""
    from moaspec.targets.safetensors_weights import SafetensorsWeights

    model_dir = Path(model_dir)
    with SafetensorsWeights(model_dir) as weights:
        source = _source_identity(model_dir, sorted({weights.file_of(name) for name in names}))
        mapped = _mapped(model_dir / FILE_NAME, names, source)
        if mapped is not None:
            return mapped
        narrowed = {name: weights.rows(name, torch.float16).full() for name in names}
    _write(model_dir / FILE_NAME, narrowed, source)
    return narrowed


def _source_identity(model_dir: Path, files: list[str]) -> str:
    """The float32 files the matrices come from, as a string that changes when any of them does."""
    identity = {}
    for file in files:
        stat = (model_dir / file).stat()
        identity[file] = [stat.st_size, stat.st_mtime_ns]
    return json.dumps(identity, sort_keys=True)


def _mapped(path: Path, names: list[str], source: str) -> dict[str, torch.Tensor] | None:
    """The matrices mapped from `path`, or None where it is missing, unreadable, from other
    weights or without one of them."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):  # ValueError: an empty file
        return None
    finally:
        os.close(fd)
    try:
        (header_size,) = struct.unpack("<Q", mapping[:8])
        header = json.loads(mapping[8 : 8 + header_size])
        metadata = header.get("__metadata__", {})
        if metadata.get("version") != FORMAT_VERSION or metadata.get("source") != source:
            return None
        matrices = {}
        for name in names:
            info = header[name]
            begin, end = (8 + header_size + offset for offset in info["data_offsets"])
            rows, columns = info["shape"]
            if info["dtype"] != "F16" or end - begin != 2 * rows * columns or end > len(mapping):
                return None
            matrices[name] = torch.frombuffer(mapping, dtype=torch.float16, count=rows * columns, offset=begin).view(
                rows, columns
            )
        return matrices
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):  # json's errors are ValueErrors
        return None


def _write(path: Path, matrices: dict[str, torch.Tensor], source: str) -> None:
    """Write the matrices to `path` for the next process, where the folder allows it."""
    from safetensors.torch import save

    from moaspec.atomic_files import write_file_atomically

    try:
        write_file_atomically(path, save(matrices, metadata={"version": FORMAT_VERSION, "source": source}))
    except OSError:
        pass  # a read-only or full cache: each process narrows its own copies, as before
