"""Helpers the command-line entry points share (moaspec/cli.py, moaspec/bench/cli.py,
moaspec/bench/client_server.py): the recorded command line, --out directories, and the exit
status of a benchmark that found a greedy mismatch. No heavy imports: the CLI checks flags
before torch loads.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from moaspec.errors import MoaspecError

EXIT_MISMATCH = 1


def output_dir(value: str) -> Path:
    """An --out directory that exists or can be created (its parent exists)."""
    out = Path(value).expanduser()
    if out.exists() and not out.is_dir():
        raise MoaspecError(f"--out {out} exists and is not a directory")
    if not out.absolute().parent.is_dir():
        raise MoaspecError(f"the parent directory of --out {out} does not exist")
    return out


def command_line(args: argparse.Namespace) -> str:
    """The exact command, recorded in manifests and checkpoints."""
    return shlex.join(["moaspec", *(sys.argv[1:] if args.argv is None else args.argv)])
