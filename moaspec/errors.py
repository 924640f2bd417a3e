"""User-facing errors.

Every mistake a user can make (unknown model, empty prompt, bad sampling value, wrong drafter)
raises `MoaspecError` with a message that fits on one line. The CLI prints it as
`moaspec: error: <message>` and exits with status 2; library users catch it like any exception.
"""

from __future__ import annotations


class MoaspecError(ValueError):
    """A problem with the user's input, reported as one line without a traceback."""


def first_line(exc: BaseException, limit: int = 400, empty: str | None = None) -> str:
    """Another library's error message as one line for a MoaspecError: its first non-blank line,
    or, where that ends in ':' (e.g. "Couldn't instantiate the backend tokenizer from one of:",
    then what it tried), all its lines joined; at most `limit` characters. A message with no
    text gives `empty`, or the exception's type name when `empty` is None."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__ if empty is None else empty
    return (" ".join(lines) if lines[0].endswith(":") else lines[0])[:limit]
