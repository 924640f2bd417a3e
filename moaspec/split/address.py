"""A split server's URL, checked without importing anything heavy (the CLI checks it first)."""

from __future__ import annotations

from urllib.parse import urlsplit

from moaspec.errors import MoaspecError


def server_address(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a split server's URL (http(s)://host[:port], an IPv6 host in
    brackets; the scheme's port where none is given). MoaspecError for anything else."""
    wrong = MoaspecError(f"--server must be an http:// or https:// URL with a host and a port of 1-65535, got '{url}'")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # "Invalid IPv6 URL", "Port out of range 0-65535", "Port could not be cast ..."
        raise wrong from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise wrong
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def server_url(scheme: str, host: str, port: int) -> str:
    """The URL a split client reaches a server listening on host:port at (an IPv6 host bracketed)."""
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
