"""Helpers the command-line entry points share (moaspec/cli.py, moaspec/bench/cli.py, moaspec/train/cli.py,
moaspec/bench/client_server.py): the recorded command line, --out directories, comma-separated
flag values, and the exit status of a benchmark that found a greedy mismatch. No heavy imports:
the CLI checks flags before torch loads.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from moaspec.atomic_files import new_hidden_directory
from moaspec.errors import MoaspecError

EXIT_MISMATCH = 1


def output_dir(
    value: str, flag: str = "--out", files: tuple[str, ...] = (), directories: tuple[str, ...] = ()
) -> Path:
    """A directory that exists or can be created (its parent exists) and can be written: probed
    by making and removing a hidden directory in it (or in its parent), so nothing is left.
    files / directories: the files and directories a run writes there, none of which may be in
    the way as something else (a directory of a file's name would fail the run at its end)."""
    if not value.strip():
        raise MoaspecError(f"{flag} is empty (name a directory)")
    out = Path(value).expanduser()
    if out.exists() and not out.is_dir():
        raise MoaspecError(f"{flag} {out} exists and is not a directory")
    parent = out.absolute().parent
    if not parent.is_dir():
        problem = "is not a directory" if parent.exists() else "does not exist"
        raise MoaspecError(f"the parent directory of {flag} {out} {problem}")
    try:
        os.rmdir(new_hidden_directory(out if out.is_dir() else parent, "moaspec-write-probe"))
    except OSError as exc:
        raise MoaspecError(f"cannot write {flag} {out}: {exc.strerror or exc}") from exc
    for names, kind, is_kind in ((files, "file", Path.is_file), (directories, "directory", Path.is_dir)):
        in_the_way = [name for name in names if (out / name).exists() and not is_kind(out / name)]
        if in_the_way:
            raise MoaspecError(f"{flag} {out}: {out / in_the_way[0]} is not a {kind}, and this run writes a {kind} there")
    return out


def comma_items(value: str, what: str) -> list[str]:
    """A comma-separated flag value -> its items, stripped, in order. An empty value, or an empty
    item (`math,,qa`, a trailing comma: a name left out by mistake), is a one-line MoaspecError
    naming `what` (the flag)."""
    items = [item.strip() for item in value.split(",")]
    if items == [""]:
        raise MoaspecError(f"{what} is empty")
    if "" in items:
        raise MoaspecError(f"{what} has an empty item: '{value}'")
    return items


def known_items(value: str, what: str, known: Sequence[str], noun: str) -> list[str]:
    """A comma-separated flag value -> names in the given order (duplicates dropped), each one of
    `known`; an empty list or item (comma_items), or an unknown name, is a one-line MoaspecError:
    `unknown <noun> X, Y (known: ...)`."""
    names = list(dict.fromkeys(comma_items(value, what)))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise MoaspecError(f"unknown {noun} {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def command_line(args: argparse.Namespace) -> str:
    """The exact command, recorded in manifests and checkpoints."""
    return shlex.join(["moaspec", *(sys.argv[1:] if args.argv is None else args.argv)])
