"""The float prefill's layer matrices in float16 (and, where its products run in bfloat16, in
bfloat16), kept in a file per type beside the target's float32 copy and mapped by every process
that prefills in float (float_prefill.py).

Narrowed from the float32 copy, they cost a process 0.3-0.6 s at its first float prefill (425 MB
read, narrowed to 212 MB on SmolLM2-135M): about what a one-shot command's only prompt gains on
that path. So the first process narrows them once into a float16 file, a matrix at a time
(atomically; holding them all and their serialized copy took ~0.4 GB more at the machine's first
run, session 56), and maps that file as every later process does: they load in ~0.02 s, and their
pages come from the page cache as the forward first reads them. The mapping is
copy-on-write (nothing reaches the file) and is never closed: the tensors hold it.

The bfloat16 file spares the bfloat16 forward the per-prompt narrowing of every layer's weights
(~0.06 s a prompt on SmolLM2-135M, a quarter of a 140-token prompt's forward): its products read
the mapped matrices as they are.

A file records the float32 files it came from (name, size, modification time); one that does
not match them, cannot be parsed or lacks a matrix is written again; where it cannot be written
(a read-only or full cache) each process holds narrowed copies of its own.

A process that prefills one prompt (a one-shot command) need not keep the pages it has read:
`MappedMatrices.release` drops named matrices' pages from the process (madvise DONTNEED; they stay
in the page cache, and a later read faults them in again as the file holds them), so the forward
holds about one layer's weights at a time. Held copies are not released.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import torch

FILE_NAMES = {torch.float16: "float16-layers.safetensors", torch.bfloat16: "bfloat16-layers.safetensors"}
FILE_NAME = FILE_NAMES[torch.float16]
STORED_TYPES = {torch.float16: "F16", torch.bfloat16: "BF16"}  # safetensors' names
FORMAT_VERSION = "1"


class MappedMatrices(dict):
    """{name: matrix} as `narrowed_matrices` gives them, with the mapping they were read from
    (None: held copies)."""

    def __init__(self, matrices: dict[str, torch.Tensor], mapping: mmap.mmap | None = None,
                 spans: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__(matrices)
        self._mapping, self._spans = mapping, spans or {}

    def release(self, names: Iterable[str]) -> None:
        """Drop these mapped matrices' pages from the process's memory (module docstring); the
        pages around a matrix's first and last bytes go too (read again where needed). Nothing
        for held copies."""
        if self._mapping is None:
            return
        for name in names:
            begin, end = self._spans[name]
            first = begin - begin % mmap.PAGESIZE
            self._mapping.madvise(mmap.MADV_DONTNEED, first, end - first)


def float16_matrices(model_dir: Path, names: list[str]) -> MappedMatrices:
    """{name: float16 [out, in]} for `names` (2-D tensors of model_dir's safetensors weights):
    `narrowed_matrices` in float16."""
    return narrowed_matrices(model_dir, names, torch.float16)


def narrowed_matrices(model_dir: Path, names: list[str], dtype: torch.dtype) -> MappedMatrices:
    """{name: `dtype` [out, in]} for `names` (2-D tensors of model_dir's safetensors weights;
    dtype float16 or bfloat16): mapped from that type's file (FILE_NAMES) where it holds them for
    these weights, else narrowed from them (and that file written for the next process)."""
    from moaspec.targets.safetensors_weights import SafetensorsWeights

    model_dir = Path(model_dir)
    path = model_dir / FILE_NAMES[dtype]
    with SafetensorsWeights(model_dir) as weights:
        source = _source_identity(model_dir, sorted({weights.file_of(name) for name in names}))
        mapped = _mapped(path, names, source, dtype)
        if mapped is None and _written(path, weights, names, dtype, source):
            mapped = _mapped(path, names, source, dtype)
        if mapped is not None:
            return mapped
        return MappedMatrices({name: weights.rows(name, dtype).full() for name in names})


def _source_identity(model_dir: Path, files: list[str]) -> str:
    """The float32 files the matrices come from, as a string that changes when any of them does."""
    identity = {}
    for file in files:
        stat = (model_dir / file).stat()
        identity[file] = [stat.st_size, stat.st_mtime_ns]
    return json.dumps(identity, sort_keys=True)


def _mapped(path: Path, names: list[str], source: str, dtype: torch.dtype) -> MappedMatrices | None:
    """The `dtype` matrices mapped from `path`, or None where it is missing, unreadable, from
    other weights or without one of them."""
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
        matrices, spans = {}, {}
        for name in names:
            info = header[name]
            begin, end = (8 + header_size + offset for offset in info["data_offsets"])
            rows, columns = info["shape"]
            if info["dtype"] != STORED_TYPES[dtype] or end - begin != 2 * rows * columns or end > len(mapping):
                return None
            matrices[name] = torch.frombuffer(mapping, dtype=dtype, count=rows * columns, offset=begin).view(rows, columns)
            spans[name] = (begin, end)
        return MappedMatrices(matrices, mapping, spans)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):  # json's errors are ValueErrors
        return None


def _written(path: Path, weights, names: list[str], dtype: torch.dtype, source: str) -> bool:
    """Narrow the matrices (of `weights`, a SafetensorsWeights) into `path` one at a time, so that
    no process holds them all (the first process maps the file as later ones do); False where the
    folder does not allow it (a read-only or full cache: each process then narrows its own copies)."""
    from moaspec.atomic_files import file_written_atomically
    from moaspec.safetensors_header import safetensors_header

    size = torch.tensor([], dtype=dtype).element_size()
    shapes = {name: list(weights.rows(name, dtype).shape) for name in names}
    header = safetensors_header(
        [(name, STORED_TYPES[dtype], shape, shape[0] * shape[1] * size) for name, shape in shapes.items()],
        {"version": FORMAT_VERSION, "source": source},
    )
    try:
        with file_written_atomically(path) as stream:
            stream.write(header)
            for name in names:
                stream.write(weights.rows(name, dtype).full().view(torch.uint8).numpy().data)
    except OSError:
        return False
    return True
