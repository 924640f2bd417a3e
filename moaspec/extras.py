"""The optional dependencies of pyproject's extras, checked before a command that needs them
starts (a missing one is a one-line error naming the extra, not an ImportError later on)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

from moaspec.errors import MoaspecError

SERVE_MODULES = ("aiohttp", "msgpack", "pydantic", "prometheus_client")  # the `serve` extra
SPLIT_CLIENT_MODULES = ("msgpack", "pydantic")  # what `generate --server` uses of it


def require_modules(extra: str, modules: Sequence[str], needed_by: str, hint: str = "") -> None:
    """MoaspecError "<needed_by> needs <missing>: pip install 'moaspec[<extra>]'<hint>" when any
    of `modules` cannot be imported."""
    missing = [name for name in modules if not _importable(name)]
    if missing:
        raise MoaspecError(f"{needed_by} needs {', '.join(missing)}: pip install 'moaspec[{extra}]'{hint}")


def _importable(name: str) -> bool:
    """Whether `import name` would find the module (without importing it: pydantic alone takes
    ~0.3 s, which a split client's start-up need not pay before it uses it)."""
    if name in sys.modules:
        return sys.modules[name] is not None  # None: an import that is known to fail
    return importlib.util.find_spec(name) is not None
