"""Transport of the split client: one keep-alive HTTP(S) connection to `moaspec serve`.

Failures are sorted into what the generation loop (split/generator.py) must do about them:
- `LinkDown`: no answer (refused, reset, timeout, 5xx) -> keep drafting alone, retry later;
- `SessionLost`: the server answers but no longer knows the session (restart, idle expiry)
  -> resynchronise;
- `ServerRefused`: a 4xx with the server's reason (bad key, limits) -> stop with that message
  (a 429, the server busy, is worth retrying while a generation is resynchronising);
- a server certificate that does not verify: a MoaspecError at once (no outage to wait out).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from dataclasses import dataclass

from moaspec.errors import MoaspecError
from moaspec.serving.api_keys import check_api_key
from moaspec.split import protocol as wire
from moaspec.split.address import server_address

# OpenSSL's X509_V_ERR_HOSTNAME_MISMATCH and X509_V_ERR_IP_ADDRESS_MISMATCH: the CA is right, the name is not
CERTIFICATE_NAME_MISMATCH = (62, 64)


class LinkDown(MoaspecError):
    """The server could not be reached or did not answer in time."""


class SessionLost(MoaspecError):
    """The server no longer has the session."""


class ServerRefused(MoaspecError):
    """The server refused the request (4xx); the message is the server's reason."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class TransportStats:
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_s: float = 0.0  # time spent in requests (network + server)


class SplitClient:
    """Requests to one split server. url: http(s)://host:port; cafile: a CA bundle for TLS."""

    def __init__(
        self, url: str, api_key: str, timeout_s: float = 10.0, cafile: str | None = None, content_type: str = wire.MSGPACK
    ) -> None:
        scheme, self.host, self.port = server_address(url)
        if not api_key:
            raise MoaspecError("an API key is required (--api-key-file or MOASPEC_API_KEY)")
        try:
            self.ssl_context = ssl.create_default_context(cafile=cafile) if scheme == "https" else None
        except (OSError, ssl.SSLError) as exc:  # missing, unreadable, or not a certificate
            raise MoaspecError(f"cannot load the CA bundle {cafile}: {getattr(exc, 'strerror', None) or exc}") from exc
        check_api_key(api_key)
        self.api_key, self.timeout_s, self.content_type = api_key, timeout_s, content_type
        self.stats = TransportStats()
        self._conn: http.client.HTTPConnection | None = None

    # -- endpoints -----------------------------------------------------------------------------------
    def info(self) -> dict:
        return self.request("GET", "/v1/split/info")

    def open(self, request: wire.OpenRequest, timeout_s: float | None = None) -> dict:
        return self.request("POST", "/v1/split/sessions", request.to_wire(), timeout_s)

    def verify(self, session_id: str, request: wire.VerifyRequest) -> dict:
        return self.request("POST", f"/v1/split/sessions/{session_id}/verify", request.to_wire())

    def end_session(self, session_id: str, timeout_s: float | None = None) -> None:
        """DELETE the session; LinkDown when the server cannot be reached (a session it no
        longer has, or refuses to close, is as good as closed)."""
        try:
            self.request("DELETE", f"/v1/split/sessions/{session_id}", timeout_s=timeout_s)
        except (SessionLost, ServerRefused):
            pass

    def close_session(self, session_id: str) -> None:
        try:
            self.end_session(session_id)
        except MoaspecError:
            pass  # best effort: the server expires idle sessions anyway

    # -- transport ----------------------------------------------------------------------------------
    def request(self, method: str, path: str, message: dict | None = None, timeout_s: float | None = None) -> dict:
        body = wire.dumps(message, self.content_type) if message is not None else b""
        headers = {"Authorization": f"Bearer {self.api_key}", "Accept": self.content_type}
        if message is not None:
            headers["Content-Type"] = self.content_type
        started = time.perf_counter()
        try:
            conn = self._connection(timeout_s or self.timeout_s)
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except ssl.SSLCertVerificationError as exc:
            self.drop_connection()
            hint = (
                f"connect by a host name or address the certificate lists, not {self.host}"
                if exc.verify_code in CERTIFICATE_NAME_MISMATCH else "pass the CA that signed it with --cafile"
            )
            raise MoaspecError(f"the certificate of {self.host}:{self.port} does not verify ({exc.verify_message}); {hint}") from None
        except (OSError, http.client.HTTPException, socket.timeout) as exc:
            self.drop_connection()
            raise LinkDown(f"server {self.host}:{self.port} unreachable: {type(exc).__name__}: {exc}") from exc
        finally:
            self.stats.wall_s += time.perf_counter() - started
        self.stats.calls += 1
        self.stats.bytes_sent += len(body)
        self.stats.bytes_received += len(data)
        content_type = response.headers.get_content_type()
        if response.status >= 500:
            self.drop_connection()
            raise LinkDown(f"server error {response.status}: {_reason(data, content_type)}")
        if response.status == 404 and "/sessions/" in path:
            raise SessionLost(_reason(data, content_type))
        if response.status >= 400:
            raise ServerRefused(f"server refused the request ({response.status}): {_reason(data, content_type)}", response.status)
        return wire.loads(data, content_type)

    def drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        if self._conn is None:
            if self.ssl_context is not None:
                self._conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout_s, context=self.ssl_context)
            else:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        self._conn.timeout = timeout_s
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout_s)
        return self._conn


def _reason(data: bytes, content_type: str) -> str:
    """The server's one-line reason; a reply not in moaspec's error shape (another HTTP server on
    that port, say) is named by its type, not printed."""
    try:
        return str(wire.loads(data, content_type)["error"]["message"])
    except (MoaspecError, KeyError, TypeError):
        text = data[:200].decode(errors="replace").strip()
        if content_type == "text/plain" and text and "\n" not in text:
            return text  # a proxy's one-line reason
        return f"not a moaspec server's reply ({content_type}, {len(data)} bytes)" if data else "no reason given"
