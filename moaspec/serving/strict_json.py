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
    unpaired surrogates, integers of at most 4,300 digits, no key twice in an object.
    ProtocolError with our own message."""
    from pydantic_core import from_json

    try:
        parsed = from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        where = _JSON_POSITION.search(str(exc))
        at = f" at line {where[1]}, column {where[2]}" if where else ""
        raise ProtocolError(f"the body is not valid JSON{at} ({JSON_RULES})") from None
    if b'"' in body and _has_duplicate_keys(body):
        raise ProtocolError("the body repeats a key in one JSON object")
    return parsed


def _has_duplicate_keys(body: bytes) -> bool:
    """Whether an object names a key twice (the parser above keeps the last silently). The body
    already parsed strictly, so the standard library reads it safely: at most 200 deep."""
    import json

    def unique(pairs: list[tuple[str, Any]]) -> dict:
        if len({key for key, _ in pairs}) != len(pairs):
            raise _DuplicateKey
        return dict(pairs)

    try:
        json.loads(body, object_pairs_hook=unique)
    except _DuplicateKey:
        return True
    return False


class _DuplicateKey(Exception):
    pass
