"""Rows of one 2-D tensor in a safetensors file, read on demand with `os.preadv`, without torch.

The header is the file's first 8 bytes (its length, little-endian) and that much JSON: per tensor
its dtype, shape and byte span after the header. `TensorRows` checks it and reads rows into the
caller's buffer (nn/file_rows.py's `FileRows` gives them to torch) or, for the numpy float dtypes,
as a numpy array (the target's fingerprint on llama.cpp, where torch is not loaded:
nn/fingerprint.py). `layout_problem` checks a whole file's header the way the safetensors loader
does, so that a damaged drafter checkpoint is found before torch is (drafters/background.py).
"""

from __future__ import annotations

import json
import math
import os
import struct
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from moaspec.errors import MoaspecError

ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # the float dtypes a row may be stored in
NUMPY_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}  # those numpy holds
DTYPE_BYTES = {  # every dtype of the safetensors format -> bytes per element
    **ITEM_BYTES, "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
    "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8,
}


class TensorRows:
    """One 2-D float tensor of a safetensors file: `stored` (its dtype's name), `shape`, rows read on demand."""

    def __init__(self, path: str | Path, name: str) -> None:
        self.path, self.name = Path(path), name
        with open(self.path, "rb") as file:
            (header_size,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(header_size))
        info = header.get(name)
        if info is None:
            raise MoaspecError(f"{self.path}: no tensor '{name}'")
        if info["dtype"] not in ITEM_BYTES or len(info["shape"]) != 2:
            raise MoaspecError(f"{self.path}: tensor '{name}' is {info['dtype']} {info['shape']}, not a 2-D float matrix")
        self.stored: str = info["dtype"]
        self.shape = (int(info["shape"][0]), int(info["shape"][1]))
        begin, end = info["data_offsets"]
        self.row_bytes = self.shape[1] * ITEM_BYTES[self.stored]
        if end - begin != self.shape[0] * self.row_bytes:
            raise MoaspecError(f"{self.path}: tensor '{name}' has {end - begin} bytes, not {self.shape} of {info['dtype']}")
        self._offset = 8 + header_size + begin
        if self.path.stat().st_size < 8 + header_size + end:
            raise MoaspecError(f"{self.path}: file ends inside tensor '{name}' (truncated?)")
        self._fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, self._fd)

    def read_rows(self, wanted: Sequence[int], into: memoryview) -> None:
        """The rows at indices `wanted` (0..V-1), stored bytes one after another into `into`;
        indices that follow each other are read in one call."""
        self.check_indices(wanted)
        start = 0
        while start < len(wanted):
            stop = start + 1
            while stop < len(wanted) and wanted[stop] == wanted[stop - 1] + 1:
                stop += 1
            self.read(wanted[start], stop - start, into[start * self.row_bytes : stop * self.row_bytes])
            start = stop

    def check_indices(self, wanted: Sequence[int]) -> None:
        """IndexError unless every index is a row (0..V-1), as indexing the whole matrix says."""
        if wanted and (min(wanted) < 0 or max(wanted) >= self.shape[0]):
            raise IndexError(f"row index out of range for {self.name} with {self.shape[0]} rows")

    def read(self, first: int, count: int, into: memoryview) -> None:
        """Rows first..first+count-1, stored bytes, into `into`."""
        done = 0
        position = self._offset + first * self.row_bytes
        while done < count * self.row_bytes:
            read = os.preadv(self._fd, [into[done:]], position + done)
            if read == 0:
                raise MoaspecError(f"{self.path}: file ends inside tensor '{self.name}' (truncated?)")
            done += read

    def numpy_rows(self, wanted: Sequence[int]) -> np.ndarray | None:
        """[len(wanted), D] as stored, or None for a dtype numpy does not hold (bfloat16)."""
        dtype = NUMPY_DTYPES.get(self.stored)
        if dtype is None:
            return None
        out = np.empty((len(wanted), self.shape[1]), dtype=dtype)
        self.read_rows(list(wanted), memoryview(out.reshape(-1).view(np.uint8)))
        return out


def layout_problem(path: str | Path) -> str | None:
    """Why the safetensors file at `path` would not load, or None: its header is not a JSON object
    of tensors (dtype, shape, data_offsets) whose byte spans follow one another from the data's
    start and end exactly at the file's end, as the safetensors loader requires. Bytes damaged
    inside a tensor's span are not seen."""
    try:
        with open(path, "rb") as file:
            prefix = file.read(8)
            size = os.fstat(file.fileno()).st_size
            if len(prefix) < 8:
                return "shorter than its header's length"
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > size - 8:
                return "ends inside its header"
            header = json.loads(file.read(header_size).decode("utf-8"))
    except OSError as exc:
        return exc.strerror or str(exc)
    except ValueError as exc:  # not UTF-8 or not JSON
        return f"its header is not JSON: {exc}"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        problem = _tensor_problem(info)
        if problem is not None:
            return f"tensor '{name}' {problem}"
        spans.append(tuple(info["data_offsets"]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            return "its tensors' byte spans overlap or leave gaps"
        end = stop
    if end != size - 8 - header_size:
        return f"its tensors cover {end} bytes of the {size - 8 - header_size} after the header (truncated?)"
    return None


def _tensor_problem(info: object) -> str | None:
    """Why one header entry is not a tensor (dtype, shape, data_offsets agreeing), or None."""
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        return "lacks its dtype, shape or data_offsets"
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        return f"has an unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        return "has a shape or data_offsets that are not lists"
    if not all(isinstance(value, int) and not isinstance(value, bool) and value >= 0 for value in (*shape, *offsets)):
        return "has a shape or data_offsets that are not whole numbers"
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:  # exact: no overflow
        return f"spans {offsets[1] - offsets[0]} bytes, not {shape} of {dtype}"
    return None
