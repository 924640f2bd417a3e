"""Rows of a target matrix read from its safetensors file on demand (moaspec/nn/file_rows.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from moaspec.errors import MoaspecError
from moaspec.nn.file_rows import FileRows, RowEmbedding
from moaspec.nn.layers import RMSNorm
from moaspec.nn.target_parts import TargetParts


@pytest.fixture()
def matrices(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.f32": torch.randn(300, 24, generator=generator),
        "b.f16": torch.randn(50, 16, generator=generator).half(),
        "c.bf16": torch.randn(40, 8, generator=generator).bfloat16(),
        "vector": torch.randn(7, generator=generator),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("name", ["a.f32", "b.f16", "c.bf16"])
def test_rows_equal_indexing_the_whole_matrix(matrices, name: str) -> None:
    path, tensors = matrices
    rows = FileRows(path, name)
    want = tensors[name].float()
    assert rows.shape == tuple(want.shape)
    generator = torch.Generator().manual_seed(1)
    cases = [
        torch.tensor([3]),
        torch.tensor([5, 4, 5, 0, want.shape[0] - 1]),  # unsorted, repeated, both ends
        torch.arange(10, 30),  # one consecutive run: one read
        torch.randint(0, want.shape[0], (4, 6), generator=generator),  # any shape, as nn.Embedding takes
        torch.empty(0, dtype=torch.long),
    ]
    for ids in cases:
        got = rows.rows(ids)
        assert got.dtype == torch.float32 and torch.equal(got, want[ids]), ids
    assert torch.equal(rows.full(), want)
    assert torch.equal(rows.rows(torch.tensor([2, 1])), want[[2, 1]])  # after full(): from memory


def test_bad_requests_and_files_are_clear_errors(matrices, tmp_path) -> None:
    path, _ = matrices
    rows = FileRows(path, "a.f32")
    for ids in (torch.tensor([300]), torch.tensor([-1])):
        with pytest.raises(IndexError, match="out of range for a.f32 with 300 rows"):
            rows.rows(ids)
    with pytest.raises(MoaspecError, match="no tensor 'nope'"):
        FileRows(path, "nope")
    with pytest.raises(MoaspecError, match="not a 2-D float matrix"):
        FileRows(path, "vector")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[: rows.tensor._offset + 10 * rows.row_bytes])
    with pytest.raises(MoaspecError, match="file ends inside tensor 'a.f32'"):
        FileRows(cut, "a.f32")


@pytest.mark.parametrize("name", ["a.f32", "b.f16", "c.bf16"])
def test_numpy_rows_are_the_stored_rows_without_torch(matrices, name: str) -> None:
    """safetensors_rows.TensorRows, under FileRows: numpy rows as stored (the target's fingerprint
    on llama.cpp reads them before torch loads), None for bfloat16, which numpy does not hold."""
    from moaspec.safetensors_rows import TensorRows

    path, tensors = matrices
    ids = [5, 4, 5, 0, tensors[name].shape[0] - 1, 10, 11, 12]
    got = TensorRows(path, name).numpy_rows(ids)
    if name == "c.bf16":
        assert got is None
        return
    assert got.dtype == tensors[name].numpy().dtype and np.array_equal(got, tensors[name][ids].numpy())


def test_rows_are_read_without_mapping_the_file(matrices) -> None:
    """The point of FileRows: a memory-mapped embedding put the whole file in the process's RSS
    (fault-around maps the pages around every row read); pread reads only the rows."""
    path, _ = matrices
    rows = FileRows(path, "a.f32")
    rows.rows(torch.arange(0, 300, 7))
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()


def test_a_row_embedding_is_a_frozen_embedding_and_parts_read_rows_of_it(matrices) -> None:
    path, tensors = matrices
    rows = FileRows(path, "a.f32")
    embedding = RowEmbedding(rows)
    plain = nn.Embedding.from_pretrained(tensors["a.f32"], freeze=True)
    ids = torch.tensor([[1, 2, 299], [0, 0, 7]])
    assert torch.equal(embedding(ids), plain(ids)) and (embedding.num_embeddings, embedding.embedding_dim) == (300, 24)
    parts = TargetParts(embedding, rows, RMSNorm(24, 1e-5), [], None)
    stored = TargetParts(plain, tensors["a.f32"], RMSNorm(24, 1e-5), [], None)
    ids = torch.tensor([9, 3, 3])
    assert torch.equal(parts.lm_head_rows(ids), stored.lm_head_rows(ids))
    assert torch.equal(parts.embedding_rows(ids), stored.embedding_rows(ids))
    assert torch.equal(parts.lm_head_weight, stored.lm_head_weight)
    on_cpu = parts.to("cpu")
    assert on_cpu.lm_head is rows and on_cpu.embed_tokens is embedding  # still read on demand
    elsewhere = parts.to("meta")  # another device: the whole matrix, moved
    assert isinstance(elsewhere.embed_tokens, nn.Embedding) and elsewhere.embed_tokens.weight.device.type == "meta"
    assert elsewhere.lm_head.device.type == "meta"


def test_a_copy_reads_its_own_file_and_ids_are_checked_after_a_full_read(matrices) -> None:
    """Audit: a deep copy kept the original's fd number, which the original's finalizer closed (a
    reused number then read another file); -1 wrapped to the last row once the matrix was in memory."""
    import copy
    import gc
    import pickle

    path, tensors = matrices
    rows = FileRows(path, "a.f32")
    copies = [copy.deepcopy(rows), pickle.loads(pickle.dumps(rows))]
    del rows
    gc.collect()
    for other in copies:
        assert torch.equal(other.rows(torch.tensor([4, 2])), tensors["a.f32"][[4, 2]])
    other = copies[0]
    other.full()
    with pytest.raises(IndexError, match="out of range"):
        other.rows(torch.tensor([-1]))


def test_a_files_layout_problem_is_found_exactly_when_the_safetensors_loader_refuses_it(matrices, tmp_path) -> None:
    """safetensors_rows.layout_problem, which decides before torch whether a drafter checkpoint may
    be built in the background: None for a whole file; a reason wherever safetensors' own loader
    refuses a damaged one (header bytes changed, its numbers changed, truncated, bytes appended),
    and never where it loads."""
    import json
    import random
    import struct

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from moaspec.safetensors_rows import layout_problem

    path, _ = matrices
    assert layout_problem(path) is None
    whole = path.read_bytes()
    (header_size,) = struct.unpack("<Q", whole[:8])
    digits = [i for i in range(8, 8 + header_size) if chr(whole[i]).isdigit()]
    rng = random.Random(0)
    damaged = tmp_path / "damaged.safetensors"
    refused = 0
    for trial in range(240):
        data = bytearray(whole)
        kind = trial % 4
        if kind == 0:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(8, 8 + header_size)] = rng.randrange(256)
        elif kind == 1:
            data = data[: rng.randrange(len(data))]
        elif kind == 2:
            data += bytes(rng.randrange(1, 64))
        else:
            at = rng.choice(digits)
            data[at] = ord(str((int(chr(data[at])) + rng.randint(1, 9)) % 10))
        damaged.write_bytes(bytes(data))
        problem = layout_problem(damaged)
        try:
            load_file(str(damaged))
        except SafetensorError as exc:
            refused += 1
            assert problem is not None, (trial, exc)
        else:
            assert problem is None, (trial, problem)
    assert refused >= 200  # most changes damage the file: the comparison was not vacuous
    # two tensors of one size on the same bytes, then one beyond a gap: sizes agree, spans do not
    for offsets in ([[0, 16], [0, 16]], [[0, 16], [32, 48]]):
        header = {"x": {"dtype": "F32", "shape": [4], "data_offsets": offsets[0]},
                  "y": {"dtype": "F32", "shape": [4], "data_offsets": offsets[1]}}
        text = json.dumps(header).encode()
        damaged.write_bytes(struct.pack("<Q", len(text)) + text + bytes(offsets[1][1]))
        assert layout_problem(damaged) == "its tensors' byte spans overlap or leave gaps"
        with pytest.raises(SafetensorError):
            load_file(str(damaged))
    # a review's: fields of the wrong type or sizes past int64 raised instead of answering
    for info in ({"shape": 5, "data_offsets": [0, 16]}, {"shape": [4], "data_offsets": None},
                 {"shape": [2**40, 2**40], "data_offsets": [0, 0]}):
        text = json.dumps({"x": {"dtype": "F32", **info}}).encode()
        damaged.write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
        assert layout_problem(damaged) is not None, info
        with pytest.raises(SafetensorError):
            load_file(str(damaged))
    assert layout_problem(tmp_path / "missing.safetensors") is not None
