"""Moving cells between llama.cpp contexts (moaspec/targets/llamacpp_cells.py): the rotation and
quantization llama.cpp's q8_0 key and value caches expect, and the sequence-state layout."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from moaspec.errors import MoaspecError
from moaspec.targets.llamacpp_cells import SequenceState, hadamard, quantize_q8_0, rotation_size


def test_the_hadamard_matrix_is_orthonormal_symmetric_and_sylvester_ordered() -> None:
    matrix = hadamard(64)
    assert np.allclose(matrix @ matrix.T, np.eye(64), atol=1e-6)
    assert np.array_equal(matrix, matrix.T)
    assert np.array_equal(np.sign(matrix[1, :4]), [1, -1, 1, -1])  # ggml_gen_hadamard's [[H, H], [H, -H]]
    assert np.array_equal(np.sign(matrix[2, :4]), [1, 1, -1, -1])


@pytest.mark.parametrize(("head_dim", "size"), [(64, 64), (128, 128), (256, 256), (192, 64), (80, 0), (32, 0)])
def test_the_rotation_size_follows_llama_cpp(head_dim: int, size: int, monkeypatch) -> None:
    monkeypatch.delenv("LLAMA_ATTN_ROT_DISABLE", raising=False)
    assert rotation_size(head_dim) == size
    for setting, rotated in (("1", False), (" 2x", False), ("0", True), ("off", True)):  # C's atoi
        monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", setting)
        assert rotation_size(head_dim) == (size if rotated else 0)


def test_q8_0_quantization_equals_llama_cpps_own() -> None:
    """Bytes equal to ggml_quantize_chunk's (llama-cpp-python's libggml-base), ties included."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_quantize_chunk.restype = ctypes.c_size_t
    ggml.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    generator = np.random.default_rng(0)
    values = (generator.standard_normal((6, 192)) * generator.uniform(0.01, 30, (6, 1))).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block
    values[1, :32] = np.arange(32) - 15.5  # scale 16.5 / 127
    values[2, :32] = np.concatenate([[127.0], np.arange(31) - 15.5])  # scale 1: exact halves, rounded away from zero
    ours = quantize_q8_0(values)
    theirs = np.empty_like(ours)
    ggml.ggml_quantize_chunk(8, values.ctypes.data, theirs.ctypes.data, 0, 6, 192, None)
    assert ours.shape == (6, 6 * 34)
    assert np.array_equal(ours, theirs)


def _state(cells: int, layers: int = 2, width: int = 128, start: int = 0, key_type: int = 0) -> bytes:
    """A sequence state as llama.cpp writes it: f32 (key_type 0) or f16 (1) keys, f16 values,
    positions start.."""
    generator = np.random.default_rng(cells)
    parts = [np.array([0xAF143CD8, 0], np.uint32).tobytes(), np.array([1, cells], np.uint32).tobytes()]
    parts += [np.array([start + i, 1, 0], np.int32).tobytes() for i in range(cells)]
    parts.append(np.array([0, layers], np.uint32).tobytes())
    key_dtype = np.float32 if key_type == 0 else np.float16
    for kind, dtype in [(key_type, key_dtype)] * layers + [(1, np.float16)] * layers:
        rows = generator.standard_normal((cells, width)).astype(dtype)
        parts += [np.int32(kind).tobytes(), np.uint64(rows.nbytes // cells).tobytes(), rows.tobytes()]
    return b"".join(parts)


def test_a_state_parses_and_writes_back_unchanged_and_its_first_cells_are_a_state() -> None:
    blob = _state(5)
    state = SequenceState.parse(blob)
    assert state.cells == 5 and state.to_buffer() == blob
    first = state.leading(3)
    assert SequenceState.parse(first.to_buffer()).cells == 3
    assert first.to_buffer() == _state_prefix(blob, 5, 3)
    with pytest.raises(MoaspecError, match="cannot take"):
        state.leading(6)


def _state_prefix(blob: bytes, cells: int, count: int) -> bytes:
    state = SequenceState.parse(blob)
    return b"".join([state.header, np.array([1, count], np.uint32).tobytes(), *state.metas[:count],
                     np.array([0, 2], np.uint32).tobytes(),
                     *[np.int32(k).tobytes() + np.uint64(r.shape[1]).tobytes() + r[:count].tobytes() for k, r in (*state.keys, *state.values)]])


def _rotated_q8_0(rows: np.ndarray, dtype, cells: int = 4) -> np.ndarray:
    floats = rows.view(dtype).astype(np.float32)
    return quantize_q8_0((floats.reshape(cells, 2, 64) @ hadamard(64).T).reshape(cells, 128))


@pytest.mark.parametrize(("key_type", "dtype"), [(0, np.float32), (1, np.float16)])
def test_moved_keys_are_rotated_then_quantized_and_values_kept(key_type: int, dtype) -> None:
    state = SequenceState.parse(_state(4, width=128, key_type=key_type))
    moved = state.to_q8_0(head_dim=64)
    assert moved.keys[0][0] == 8 and np.array_equal(moved.keys[0][1], _rotated_q8_0(state.keys[0][1], dtype))
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(moved.values, state.values))
    assert SequenceState.parse(moved.to_buffer()).keys[1][1].shape == (4, 4 * 34)


def test_moved_values_for_a_q8_0_value_cache_are_rotated_then_quantized_too() -> None:
    state = SequenceState.parse(_state(4, width=128, key_type=1))
    moved = state.to_q8_0(head_dim=64, values=True)
    for (kind, rows), (_, before) in zip(moved.values, state.values):
        assert kind == 8 and np.array_equal(rows, _rotated_q8_0(before, np.float16))
    assert np.array_equal(moved.keys[1][1], state.to_q8_0(head_dim=64).keys[1][1])
    written = SequenceState.parse(moved.to_buffer())
    assert written.values[1][1].shape == (4, 4 * 34) and written.values[1][0] == 8


@pytest.mark.parametrize(("blob", "message"), [
    (_state(3)[:-5], "shorter than its layout"),
    (_state(3) + b"\0", "does not know"),
    (_state(3, start=1), "position order"),
])
def test_a_state_of_another_layout_is_refused_clearly(blob: bytes, message: str) -> None:
    with pytest.raises(MoaspecError, match=message):
        SequenceState.parse(blob)


def test_keys_of_another_type_are_refused_clearly() -> None:
    state = SequenceState.parse(_state(3, key_type=8))
    with pytest.raises(MoaspecError, match="f32 or f16 keys"):
        state.to_q8_0(head_dim=64)
