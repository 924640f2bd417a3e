"""atomic_files: whole files or none, and temporaries a crashed write leaves recognisable."""

from __future__ import annotations

import os

import pytest

from moaspec.atomic_files import write_file_atomically, write_files_atomically


def test_files_appear_together_or_not_at_all(tmp_path) -> None:
    out = tmp_path / "out"
    paths = write_files_atomically(out, {"a.json": "{}\n", "b.bin": b"\x00\x01"})
    assert paths == [out / "a.json", out / "b.bin"]
    assert (out / "a.json").read_text() == "{}\n" and (out / "b.bin").read_bytes() == b"\x00\x01"
    with pytest.raises(TypeError):  # the second file cannot be written: the first is not renamed either
        write_files_atomically(out, {"a.json": "new", "c.txt": 3})  # type: ignore[dict-item]
    assert (out / "a.json").read_text() == "{}\n" and sorted(p.name for p in out.iterdir()) == ["a.json", "b.bin"]


def test_a_directory_in_the_way_of_a_later_file_stops_the_write_before_any_rename(tmp_path) -> None:
    """An audit's: a directory named like the last file (a bench's speedup.png) failed its rename
    after the first files were in place, in an error naming the hidden temporary."""
    out = tmp_path / "out"
    write_files_atomically(out, {"a.json": "old"})
    (out / "plot.png").mkdir()
    with pytest.raises(IsADirectoryError) as raised:
        write_files_atomically(out, {"a.json": "new", "plot.png": b"png"})
    assert raised.value.filename == str(out / "plot.png")
    assert (out / "a.json").read_text() == "old" and sorted(p.name for p in out.iterdir()) == ["a.json", "plot.png"]


def test_a_temporary_is_hidden_and_ends_in_tmp(tmp_path, monkeypatch) -> None:
    """What a killed writer leaves (the rename never ran) matches `.NAME.*.tmp`, the pattern that
    readers skip and the data writers sweep (distill.ShardWriter)."""
    sources = []
    real_replace = os.replace

    def recording_replace(source, destination):
        sources.append(os.path.basename(source))
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", recording_replace)
    path = write_file_atomically(tmp_path / "deep" / "shard-00001.jsonl", "x\n")
    assert path.read_text() == "x\n"
    assert len(sources) == 1 and sources[0].startswith(".shard-00001.jsonl.") and sources[0].endswith(".tmp")
    assert sorted(p.name for p in path.parent.iterdir()) == ["shard-00001.jsonl"]


def test_files_and_directories_get_the_umasks_permissions(tmp_path) -> None:
    """Not tempfile's private 0600 / 0700: data shards, results and checkpoints are meant to be
    read by whoever may read the folder they are written to."""
    from moaspec.atomic_files import new_hidden_directory

    umask = os.umask(0o022)
    try:
        path = write_file_atomically(tmp_path / "results.json", "{}\n")
        staging = new_hidden_directory(tmp_path, "checkpoint")
        assert path.stat().st_mode & 0o777 == 0o644 and staging.stat().st_mode & 0o777 == 0o755
        assert staging.name.startswith(".checkpoint.") and staging.name.endswith(".tmp")
    finally:
        os.umask(umask)
