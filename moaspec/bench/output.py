"""Write a benchmark's output files all or nothing.

`write_results` writes results.json and results.md (plus e.g. plots) of any benchmark kind,
`write_json` one JSON file (the --out of the scripts under bench/). Every file is first written to a hidden temporary name in the output directory; only when all of
them are complete are they renamed into place (one `os.replace` each, atomic per file). A failure
before that leaves no new file behind, and an earlier run's files stay intact.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from moaspec.atomic_files import write_file_atomically, write_files_atomically


def timestamp() -> str:
    """Now, UTC, to the second (the `created` field of results and manifests)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def write_results(
    out_dir: Path, results: dict, markdown: str, extra_files: dict[str, bytes] | None = None, optional: tuple[str, ...] = ()
) -> list[Path]:
    """results.json, results.md and `extra_files` into out_dir, all or nothing; the paths go to
    stderr. optional: files a bench run may write there (the plots of either kind): those this
    one did not write are removed, so a previous run's would not pass for this one's."""
    files = {"results.json": (json.dumps(results, indent=1) + "\n").encode(), "results.md": markdown.encode()}
    paths = write_files_atomically(out_dir, {**files, **(extra_files or {})})
    for name in set(optional) - set(extra_files or {}):
        (out_dir / name).unlink(missing_ok=True)
    print(f"[moaspec] wrote {', '.join(str(path) for path in paths)}", file=sys.stderr)
    return paths


def write_json(path: Path, record: dict | list, indent: int | None = 1) -> Path:
    """One JSON file (a bench script's --out), written atomically; its folder is created if needed."""
    return write_file_atomically(path, json.dumps(record, indent=indent) + "\n")
