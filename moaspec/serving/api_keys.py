"""What an API key may hold: it travels as a bearer token in an HTTP header's value."""

from __future__ import annotations

from moaspec.errors import MoaspecError


def check_api_key(key: str) -> str:
    """`key` where it is printable ASCII without spaces, else a MoaspecError (a key that HTTP
    cannot carry, or a file that is not a key list)."""
    if not key or any(ord(char) < 0x21 or ord(char) > 0x7E for char in key):
        raise MoaspecError("an API key must be printable ASCII without spaces")
    return key
