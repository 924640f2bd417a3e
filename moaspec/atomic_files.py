"""Files written all or nothing: every file goes to a hidden temporary name in its folder first
(`.NAME.XXXXXXXX.tmp`: a crashed write leaves a file that readers ignore and writers may sweep)
and is renamed into place (`os.replace`, atomic per file) only once complete, so a reader, a
crash or a concurrent writer sees the old file or the new one, never half of one. Files and
directories get the permissions ordinary ones get (the umask's, not tempfile's private 0600).

Used for everything moaspec writes that another run may read: benchmark results, calibration
and tuning caches, data shards and manifests, the feature cache's index.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def write_files_atomically(out_dir: Path, files: dict[str, bytes | str]) -> list[Path]:
    """Write {name: content} into out_dir (created if needed), all renamed into place only after
    every one is complete (str content as UTF-8); -> the final paths. A failure before the renames
    leaves no new file behind."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in files:  # checked before anything is written: a rename that fails half-way is not all or nothing
        if (out_dir / name).is_dir():
            raise IsADirectoryError(21, "Is a directory", str(out_dir / name))
    staged: list[tuple[str, Path]] = []
    try:
        for name, content in files.items():
            handle, temporary = _new_hidden_file(out_dir, name)
            staged.append((name, temporary))
            with os.fdopen(handle, "wb") as stream:
                stream.write(content.encode("utf-8") if isinstance(content, str) else content)
                stream.flush()
                os.fsync(stream.fileno())
        final = []
        for name, temporary in staged:
            os.replace(temporary, out_dir / name)
            final.append(out_dir / name)
        return final
    finally:
        for _, temporary in staged:
            temporary.unlink(missing_ok=True)


@contextmanager
def file_written_atomically(path: Path) -> Iterator[BinaryIO]:
    """A binary stream whose content becomes `path` (its folder created if needed) once the block
    completes, for a file too large to hold in memory first; a failure leaves no new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(21, "Is a directory", str(path))
    handle, temporary = _new_hidden_file(path.parent, path.name)
    try:
        with os.fdopen(handle, "wb") as stream:
            yield stream
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def write_file_atomically(path: Path, content: bytes | str) -> Path:
    """One file (its folder created if needed), atomically; -> path."""
    path = Path(path)
    return write_files_atomically(path.parent, {path.name: content})[0]


def new_hidden_directory(parent: Path, name: str) -> Path:
    """A new empty directory `.NAME.XXXXXXXX.tmp` in `parent`, to be filled and renamed into place."""
    while True:
        staging = Path(parent) / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            os.mkdir(staging, 0o777)  # the umask applies
            return staging
        except FileExistsError:
            continue


def _new_hidden_file(out_dir: Path, name: str) -> tuple[int, Path]:
    """A new empty file `.NAME.XXXXXXXX.tmp` in out_dir, open for writing: (descriptor, path)."""
    while True:
        temporary = out_dir / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temporary  # the umask applies
        except FileExistsError:
            continue
