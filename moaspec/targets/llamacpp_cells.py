"""Moving a prompt's cells from the prompt context (f16 keys and values) into the verified
context (q8_0 keys; f16 or q8_0 values).

llama.cpp prefills a long prompt faster with an f16 / f16 cache (its tiled attention kernel) than
with the q8_0 keys that keep tree verification exact (bench/llamacpp_probes.py items 2 and 5), so
the llama.cpp runtime prefills long prompts in a second context and moves the cells over through
llama.cpp's sequence state:

    [magic u32][seq id i32][streams u32][cells u32]
    per cell: [pos i32][n u32][n seq ids i32]
    [v_trans u32][layers u32]
    per layer: [key type i32][row bytes u64][cells rows]   then the values likewise

A quantized cache does not hold the keys and values themselves: llama.cpp multiplies each head's
queries and keys by a normalised Walsh-Hadamard matrix (`attn_rot_k`), and each head's values by
one, rotating the attention's output back (`attn_rot_v`), wherever that cache is quantized. So the
moved keys (and values, for a q8_0 value cache) are rotated (rotation_size), then quantized to
q8_0 with llama.cpp's reference rounding; f16 values are copied as they are.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

import numpy as np

from moaspec.errors import MoaspecError

FLOAT_CACHE_TYPES = {0: np.float32, 1: np.float16}  # ggml types f32, f16
GGML_FLOAT_TYPES = {np.dtype(dtype): kind for kind, dtype in FLOAT_CACHE_TYPES.items()}
GGML_TYPE_Q8_0 = 8
Q8_0_BLOCK = 32  # values per q8_0 block: an f16 scale and 32 int8
STATE_HEADER = 8  # magic and sequence id


def hadamard(size: int) -> np.ndarray:
    """The normalised Sylvester-Hadamard matrix of llama.cpp's `ggml_gen_hadamard`: [size, size]."""
    matrix = np.ones((1, 1), dtype=np.float64)
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return (matrix / np.sqrt(size)).astype(np.float32)


def rotation_size(head_dim: int) -> int:
    """Size of the Hadamard blocks llama.cpp rotates a quantized cache's keys or values by, for
    heads of `head_dim` (0: not rotated): the largest power of two from 64 up that divides the head
    size, unless LLAMA_ATTN_ROT_DISABLE is set."""
    setting = re.match(r"\s*[+-]?\d+", os.environ.get("LLAMA_ATTN_ROT_DISABLE", ""))  # read as C's atoi
    if (setting is not None and int(setting.group())) or head_dim % 64:
        return 0
    size = 64
    while head_dim % (2 * size) == 0:
        size *= 2
    return size


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
    """llama.cpp's reference q8_0 quantization (`quantize_row_q8_0_ref`): values [..., n] (n a
    multiple of 32) -> bytes [..., n // 32 * 34] (per block: f16 scale, 32 int8)."""
    blocks = values.reshape(-1, Q8_0_BLOCK).astype(np.float32, copy=False)
    scale = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    scaled = blocks * inverse
    rounded = np.rint(scaled)  # halves to even; roundf takes them away from zero (both exact in float32)
    ties = np.abs(scaled - rounded) == np.float32(0.5)
    rounded[ties] = scaled[ties] + np.copysign(np.float32(0.5), scaled[ties])
    packed = np.empty((blocks.shape[0], 2 + Q8_0_BLOCK), dtype=np.uint8)
    packed[:, :2] = scale.astype(np.float16).view(np.uint8)
    packed[:, 2:] = rounded.astype(np.int8).view(np.uint8)
    return packed.reshape(*values.shape[:-1], values.shape[-1] // Q8_0_BLOCK * (2 + Q8_0_BLOCK))


class _Reader:
    def __init__(self, state: bytes) -> None:
        self.state, self.offset = state, 0

    def take(self, dtype, count: int = 1) -> np.ndarray:
        size = np.dtype(dtype).itemsize * count
        if self.offset + size > len(self.state):
            raise MoaspecError("llama.cpp's sequence state is shorter than its layout says")
        values = np.frombuffer(self.state, dtype, count, self.offset)
        self.offset += size
        return values

    def one(self, dtype) -> int:
        return int(self.take(dtype)[0])


@dataclass
class SequenceState:
    """One sequence's cells as llama.cpp saves them (module docstring), positions 0.. in cell order."""

    header: bytes
    metas: list[bytes]  # per cell: position, sequence ids
    keys: list[tuple[int, np.ndarray]]  # per layer: ggml type, rows [cells, row bytes] (uint8)
    values: list[tuple[int, np.ndarray]]

    @classmethod
    def parse(cls, state: bytes | memoryview) -> SequenceState:
        """Read a saved state (any bytes-like object; the rows stay views into it)."""
        reader = _Reader(state)
        header = reader.take(np.uint8, STATE_HEADER).tobytes()
        if reader.one(np.uint32) != 1:
            raise MoaspecError("moving cells needs a unified KV cache (one stream)")
        cells = reader.one(np.uint32)
        metas = []
        for expected in range(cells):
            start = reader.offset
            position, seqs = reader.one(np.int32), reader.one(np.uint32)
            reader.take(np.int32, seqs)
            if position != expected:
                raise MoaspecError("the prompt context's cells are not in position order")
            metas.append(bytes(state[start : reader.offset]))
        v_trans, layers = reader.one(np.uint32), reader.one(np.uint32)
        if v_trans:
            raise MoaspecError("moving cells needs untransposed values (flash attention)")
        tables = []
        for _ in range(2 * layers):
            kind, row = reader.one(np.int32), reader.one(np.uint64)
            tables.append((kind, reader.take(np.uint8, cells * row).reshape(cells, row)))
        if reader.offset != len(state):
            raise MoaspecError("llama.cpp's sequence state has a layout this version of moaspec does not know")
        return cls(header, metas, tables[:layers], tables[layers:])

    @classmethod
    def of_floats(cls, header: bytes, keys: list[np.ndarray], values: list[np.ndarray]) -> SequenceState:
        """Cells 0..T-1 of one sequence holding per layer float keys and values [T, row] (float32
        or float16, llama.cpp's layout); `header` is the first STATE_HEADER bytes of a state saved
        from the context they go to (an empty one's will do)."""
        count = keys[0].shape[0]
        metas = [struct.pack("<iIi", position, 1, 0) for position in range(count)]  # one sequence id: 0

        def table(rows: np.ndarray) -> tuple[int, np.ndarray]:
            return GGML_FLOAT_TYPES[rows.dtype], np.ascontiguousarray(rows).view(np.uint8).reshape(count, -1)

        return cls(header[:STATE_HEADER], metas, [table(rows) for rows in keys], [table(rows) for rows in values])

    @property
    def cells(self) -> int:
        return len(self.metas)

    def leading(self, count: int) -> SequenceState:
        """The first `count` cells (positions 0..count-1)."""
        if not 0 < count <= self.cells:
            raise MoaspecError(f"cannot take {count} cells out of {self.cells}")
        return SequenceState(
            self.header, self.metas[:count],
            [(kind, rows[:count]) for kind, rows in self.keys], [(kind, rows[:count]) for kind, rows in self.values],
        )

    def to_q8_0(self, head_dim: int, values: bool = False) -> SequenceState:
        """The same cells for a context with q8_0 keys, and q8_0 values where `values` (else the
        values are kept): float rows rotated (rotation_size), quantized."""
        return SequenceState(
            self.header, self.metas, self._rotated_q8_0(self.keys, head_dim, "keys"),
            self._rotated_q8_0(self.values, head_dim, "values") if values else self.values,
        )

    def _rotated_q8_0(self, tables: list[tuple[int, np.ndarray]], head_dim: int, role: str) -> list[tuple[int, np.ndarray]]:
        """Per layer: float rows [cells, row bytes] -> q8_0 rows of the rotated floats."""
        rotation = rotation_size(head_dim)
        rotate = hadamard(rotation) if rotation else None
        quantized = []
        for kind, rows in tables:
            if kind not in FLOAT_CACHE_TYPES:
                raise MoaspecError(f"moving cells needs f32 or f16 {role} in the prompt context")
            floats = rows.view(FLOAT_CACHE_TYPES[kind]).astype(np.float32)
            if rotate is not None:
                floats = (floats.reshape(self.cells, -1, rotation) @ rotate.T).reshape(self.cells, -1)
            quantized.append((GGML_TYPE_Q8_0, quantize_q8_0(floats)))
        return quantized

    def to_buffer(self) -> bytearray:
        """The state for llama_state_seq_set_data, written once into one buffer."""
        head = [self.header, np.array([1, self.cells], np.uint32).tobytes(), *self.metas]
        head.append(np.array([0, len(self.keys)], np.uint32).tobytes())
        tables = [
            (np.int32(kind).tobytes() + np.uint64(rows.shape[1]).tobytes(), rows) for kind, rows in (*self.keys, *self.values)
        ]
        buffer = bytearray(sum(map(len, head)) + sum(len(label) + rows.nbytes for label, rows in tables))
        view, offset = memoryview(buffer), 0
        for part in head:
            view[offset : offset + len(part)] = part
            offset += len(part)
        for label, rows in tables:
            view[offset : offset + len(label)] = label
            offset += len(label)
            np.frombuffer(buffer, np.uint8, rows.nbytes, offset).reshape(rows.shape)[...] = rows
            offset += rows.nbytes
        return buffer
