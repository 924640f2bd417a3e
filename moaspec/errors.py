"""User-facing errors.

Every mistake a user can make (unknown model, empty prompt, bad sampling value, wrong drafter)
raises `MoaspecError` with a message that fits on one line. The CLI prints it as
`moaspec: error: <message>` and exits with status 2; library users catch it like any exception.
"""

from __future__ import annotations


class MoaspecError(ValueError):
    """A problem with the user's input, reported as one line without a traceback."""
