"""The README's table of environment variables names every MOASPEC_* variable the code reads,
and no other."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_environment_variable_the_code_reads_is_in_the_readmes_table() -> None:
    in_code = set()
    for path in (ROOT / "moaspec").rglob("*.py"):
        in_code |= set(re.findall(r"\bMOASPEC_[A-Z_]+\b", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("Environment variables (all optional):") : readme.index("## Library")]
    in_table = set(re.findall(r"^\| `(MOASPEC_[A-Z_]+)", table, flags=re.MULTILINE))
    assert in_code and in_table == in_code
