"""Strict JSON request bodies, parsed alike on both `moaspec serve` APIs (the split protocol,
moaspec/split/protocol.py, and the OpenAI API, moaspec/openai_api/validation.py), and
`ProtocolError`, which a malformed or out-of-bounds message raises (-> HTTP 400).
"""

from __future__ import annotations

import re
from typing import Any

from moaspec.errors import MoaspecError

JSON_RULES = "JSON here is UTF-8, nests at most 200 deep and holds no NaN/Infinity, unpaired surrogates or numbers over 4300 digits"
_JSON_POSITION = re.compile(r"line (\d+) column (\d+)")


class ProtocolError(MoaspecError):
    """A malformed or out-of-bounds message (the server answers 400, the client gives up)."""


def parse_json(body: bytes) -> Any:
    """Strict JSON (pydantic-core's parser): UTF-8, nesting at most 200 deep, no NaN/Infinity, no
    unpaired surrogates, integers of at most 4,300 digits. ProtocolError with our own message."""
    from pydantic_core import from_json

    try:
        return from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        where = _JSON_POSITION.search(str(exc))
        at = f" at line {where[1]}, column {where[2]}" if where else ""
        raise ProtocolError(f"the body is not valid JSON{at} ({JSON_RULES})") from None
