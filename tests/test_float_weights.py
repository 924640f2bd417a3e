"""The float prefill's float16 layer matrices, written once beside the float32 copy and mapped by
later processes (moaspec/targets/float_weights.py)."""

from __future__ import annotations

import contextlib
import json
import os
import struct
from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_target

import moaspec.atomic_files
from moaspec.targets.float_prefill import LAYER_MATRICES, FloatLlama, FloatPrefillCache
from moaspec.targets.float_weights import FILE_NAME, float16_matrices


@pytest.fixture()
def saved(tmp_path):
    """A tiny random Llama saved as float32 safetensors (weights not float16-exact: the narrowing
    is seen), its config and its layer matrices' names."""
    model = make_tiny_target("llama", seed=5, dtype=torch.float32).model
    model.save_pretrained(tmp_path)
    config = SimpleNamespace(**json.loads((tmp_path / "config.json").read_text()))
    names = [f"model.layers.{i}.{name}.weight" for i in range(config.num_hidden_layers) for name in LAYER_MATRICES]
    want = {name: tensor.half() for name, tensor in model.state_dict().items() if name in names}
    return tmp_path, config, names, want


def refused_write(path):
    """Stands in for atomic_files.file_written_atomically in a read-only cache."""
    raise PermissionError(13, "Permission denied", str(path))


def mapped_files() -> str:
    with open("/proc/self/maps") as maps:
        return maps.read()


def prefill(model_dir, config) -> FloatPrefillCache:
    cache = FloatPrefillCache(FloatLlama(model_dir, config), chunk_size=16)
    cache.prefill(list(range(3, 40)))
    return cache


def test_the_first_load_writes_the_file_and_every_load_maps_it(saved) -> None:
    """The first load narrows the float32 matrices into the file one at a time and maps it (it held
    them all, and their serialized copy, at once: ~0.4 GB at a machine's first run); a second
    maps it without writing, with the same values, and prefills the same bits."""
    model_dir, config, names, want = saved
    narrowed = prefill(model_dir, config)
    written = (model_dir / FILE_NAME).stat().st_mtime_ns
    assert str(model_dir / FILE_NAME) in mapped_files()
    mapped = prefill(model_dir, config)
    assert (model_dir / FILE_NAME).stat().st_mtime_ns == written
    for cache in (narrowed, mapped):
        held = [matrix for layer in cache.model.layers for matrix in layer.matrices]
        assert all(matrix.dtype == torch.float16 and torch.equal(matrix, want[name]) for matrix, name in zip(held, names))
    assert torch.equal(narrowed.keys, mapped.keys) and torch.equal(narrowed.values, mapped.values)
    assert torch.equal(narrowed.hidden[:37], mapped.hidden[:37])


def test_the_bfloat16_forward_maps_its_own_file_once_written(saved) -> None:
    """Products in bfloat16: the first forward narrows the float32 matrices to bfloat16 (all but
    the key and value projections) into their own file and maps it; a second model maps that
    file, with the same values, and prefills the same bits. The float16 file is not rewritten."""
    from moaspec.targets.float_prefill import FLOAT32_ALWAYS
    from moaspec.targets.float_weights import FILE_NAMES

    model_dir, config, names, _ = saved
    prefill(model_dir, config)
    float16_written = (model_dir / FILE_NAME).stat().st_mtime_ns
    path = model_dir / FILE_NAMES[torch.bfloat16]

    def bfloat16_prefill() -> FloatPrefillCache:
        cache = FloatPrefillCache(FloatLlama(model_dir, config), chunk_size=16, compute="bfloat16")
        cache.prefill(list(range(3, 40)))
        return cache

    narrowed = bfloat16_prefill()
    assert path.is_file() and str(path) in mapped_files()
    mapped = bfloat16_prefill()
    assert (model_dir / FILE_NAME).stat().st_mtime_ns == float16_written
    float32 = dict(make_tiny_target("llama", seed=5, dtype=torch.float32).model.state_dict())
    for cache in (narrowed, mapped):
        held = {name: matrix for layer in cache.model._bfloat16 for name, matrix in layer.items()}
        assert sorted(held) == sorted(n for n in names if not n.endswith(tuple(f"{k}.weight" for k in FLOAT32_ALWAYS)))
        assert all(matrix.dtype == torch.bfloat16 and torch.equal(matrix, float32[name].bfloat16()) for name, matrix in held.items())
    assert torch.equal(narrowed.keys, mapped.keys) and torch.equal(narrowed.hidden[:37], mapped.hidden[:37])


def test_writing_into_a_mapped_matrix_does_not_reach_the_file(saved) -> None:
    model_dir, _, names, want = saved
    float16_matrices(model_dir, names)
    float16_matrices(model_dir, names)[names[0]].fill_(7.0)
    assert torch.equal(float16_matrices(model_dir, names)[names[0]], want[names[0]])


@pytest.mark.parametrize(
    "damage", ["other weights", "truncated", "garbage", "empty", "a header not an object", "a matrix missing"]
)
def test_a_file_from_other_weights_or_damaged_is_written_again(saved, damage: str) -> None:
    model_dir, _, names, want = saved
    float16_matrices(model_dir, names)
    path = model_dir / FILE_NAME
    if damage == "other weights":  # the float32 copy changed since: its modification time differs
        stat = (model_dir / "model.safetensors").stat()
        os.utime(model_dir / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "garbage":
        path.write_bytes(b"\xff" * 64)
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "a header not an object":
        path.write_bytes(struct.pack("<Q", 2) + b"[]")
    else:  # a file written for fewer matrices
        path.unlink()
        float16_matrices(model_dir, names[:-1])
    before = path.stat().st_mtime_ns, path.stat().st_size
    again = float16_matrices(model_dir, names)
    assert all(torch.equal(again[name], want[name]) for name in names)
    assert (path.stat().st_mtime_ns, path.stat().st_size) != before  # written again
    assert all(torch.equal(tensor, want[name]) for name, tensor in float16_matrices(model_dir, names).items())


def test_where_the_file_cannot_be_written_the_narrowed_copies_serve(saved, monkeypatch) -> None:
    """A read-only or full cache: no error, no file, the same values (narrowed in every process)."""
    model_dir, _, names, want = saved

    monkeypatch.setattr(moaspec.atomic_files, "file_written_atomically", refused_write)
    got = float16_matrices(model_dir, names)
    assert not (model_dir / FILE_NAME).exists() and not list(model_dir.glob(".*"))
    assert all(torch.equal(got[name], want[name]) for name in names)


def test_a_write_that_fails_half_way_leaves_no_file_and_the_copies_serve(saved, monkeypatch) -> None:
    """A full disk after some matrices: no file (not even a hidden one), the narrowed copies."""
    model_dir, _, names, want = saved
    real = moaspec.atomic_files.file_written_atomically
    writes = []

    class FillingStream:
        def __init__(self, stream) -> None:
            self.stream = stream

        def write(self, data) -> int:
            writes.append(len(data))
            if len(writes) == 3:  # the header and one matrix went in
                raise OSError(28, "No space left on device")
            return self.stream.write(data)

    @contextlib.contextmanager
    def filling(path):
        with real(path) as stream:
            yield FillingStream(stream)

    monkeypatch.setattr(moaspec.atomic_files, "file_written_atomically", filling)
    got = float16_matrices(model_dir, names)
    assert len(writes) == 3 and not (model_dir / FILE_NAME).exists() and not list(model_dir.glob(".*"))
    assert all(torch.equal(got[name], want[name]) for name in names)


def mapped_rss_kb(path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if not fields[0].endswith(":"):  # a mapping's header: range, perms, offset, device, inode[, path]
                inside = len(fields) >= 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1])
    return total


@pytest.mark.parametrize("compute", ["float32", "bfloat16"])
def test_released_layers_leave_the_process_and_the_forward_keeps_its_bits(saved, compute) -> None:
    """With release_weights each layer's mapped pages leave the process once the layer is done
    (the files' resident size falls to a few pages), and prefills give the same bits as without,
    a second one too (its pages read again); the held copies of a first load (nothing mapped)
    are kept as they are."""
    from moaspec.targets.float_weights import FILE_NAMES

    # layers of ~1.7 MB: the kernel maps up to 64 kB of cached pages around each page read
    # ("fault-around"), so a release shows clearly only on layers much larger than that
    model_dir = saved[0] / "wide"
    make_tiny_target("llama", seed=5, dtype=torch.float32, hidden_size=256, intermediate_size=1024).model.save_pretrained(model_dir)
    config = SimpleNamespace(**json.loads((model_dir / "config.json").read_text()))
    files = [model_dir / FILE_NAMES[torch.float16], model_dir / FILE_NAMES[torch.bfloat16]]
    prompt = list(range(3, 40))

    def prefill_with(model: FloatLlama) -> FloatPrefillCache:
        cache = FloatPrefillCache(model, chunk_size=16, compute=compute)
        cache.prefill(prompt)
        return cache

    with pytest.MonkeyPatch.context() as unwritable:  # a read-only cache: held copies
        unwritable.setattr(moaspec.atomic_files, "file_written_atomically", refused_write)
        held = FloatLlama(model_dir, config)
        reference = prefill_with(held)
    assert not any(path.exists() for path in files)
    held.release_weights = True
    again = prefill_with(held)  # a release of held copies would have zeroed them
    assert torch.equal(again.keys, reference.keys) and torch.equal(again.hidden[:37], reference.hidden[:37])

    model = FloatLlama(model_dir, config)  # now mapped
    prefill_with(model)
    touched = sum(mapped_rss_kb(path) for path in files)
    model.release_weights = True
    for _ in range(2):
        released = prefill_with(model)
        assert torch.equal(released.keys, reference.keys) and torch.equal(released.values, reference.values)
        assert torch.equal(released.hidden[:37], reference.hidden[:37])
        left = sum(mapped_rss_kb(path) for path in files)
        assert left < 0.1 * touched and touched > 1000, (touched, left)
