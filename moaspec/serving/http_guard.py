"""Connections of `moaspec serve`: bounded in number and time, malformed HTTP refused in our shape.

Left to itself aiohttp keeps a connection that never finishes its request headers open for an
hour, answers a malformed request (e.g. a 10 KB header) in plain text, and logs a traceback that
quotes the offending bytes, key material included. `GuardedHandler`, an aiohttp RequestHandler,
changes that:
- header time-out: a request's line and headers must be complete within `header_timeout_s` of
  the connection opening, or of the first byte of a later request on it (else 408 and close);
  a TLS handshake must finish within it too;
- idle keep-alive connections close after `keepalive_timeout_s` of silence after a response
  (our own timer: aiohttp's would also close a connection part-way through its next request's
  headers, before the header time-out could answer it);
- connection cap: while more than `max_connections` are open, a new connection's request is
  answered 503 and the connection closed (so refused clients hold a descriptor only briefly);
- malformed HTTP: 431 for an over-long request line or header, 400 otherwise, as OpenAI-shaped
  JSON, with one log line that names the status, never the request's bytes;
- a refusal sent before the request's body was read closes the connection within LINGER_S
  (aiohttp lingers 10 s by default); where that unread body does not decode as its
  Content-Encoding (aiohttp's lingering read raises the error), one log line, not a traceback;
- shutdown: a request still running when the shutdown time-out ends is cancelled then (aiohttp
  cancels only its body and waits the time-out again, so a handler that does not read its body,
  a stream or a prefill, ran for twice the time-out).
Refusals made here, outside the application, are reported through `on_refusal(status)` so the
metrics count them. `GuardedSite` serves an application through these handlers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import ssl
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong

from moaspec.errors import MoaspecError
from moaspec.serving.errors import APIError, error_response
from moaspec.serving.limits import ServerLimits

if TYPE_CHECKING:
    from aiohttp.typedefs import Handler

logger = logging.getLogger("moaspec.serve")
# After a response sent before its request's body was read (408 body_timeout, 413, 400 cut off),
# what the client still sends is read and dropped for this long before the connection closes
# (aiohttp's lingering close: closing at once could reset the connection under the response).
LINGER_S = 1.0
# A TLS connection the server closes (a time-out, a refusal) waits this long for the client's
# close_notify before it is dropped (asyncio's default, 30 s, held its --max-connections slot).
TLS_SHUTDOWN_S = 1.0
# A request cancelled at the end of the shutdown time-out gets this long to unwind (its handler's
# finally blocks) before aiohttp's own shutdown of the connection.
CANCELLED_GRACE_S = 1.0


class ConnectionGuard:
    """The state shared by all connections of one site (event loop thread only: no locks)."""

    def __init__(self, limits: ServerLimits, on_refusal: Callable[[int], None] | None = None) -> None:
        self.limits = limits
        self.num_open = 0
        self.on_refusal = on_refusal or (lambda status: None)


class GuardedHandler(web.RequestHandler):
    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.over_capacity = False
        self._counted = False
        self._between_requests = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self.request_task: asyncio.Task | None = None  # the task running this connection's request, while one runs

    async def shutdown(self, timeout: float | None = 15.0) -> None:
        """The server is stopping: the running request gets `timeout` to finish, then its task is
        cancelled (aiohttp's own shutdown then finds nothing running)."""
        task = self.request_task
        if timeout is not None and task is not None and not task.done():
            self.close()  # no further request on this connection
            await asyncio.wait([task], timeout=timeout)
            if not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=CANCELLED_GRACE_S)
        await super().shutdown(timeout)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.guard.num_open += 1
        self._counted = True
        self.over_capacity = self.guard.num_open > self.guard.limits.max_connections
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self.guard.num_open -= 1
            self._counted = False
        self.headers_received()
        self._stop_idle_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._between_requests and data:  # the first byte of the next request
            self._between_requests = False
            self._stop_idle_timer()
            self._arm_header_timer()
        super().data_received(data)

    def headers_received(self) -> None:
        """A request's headers are complete (its handler starts): stop the header clock (and the
        idle one, which a pipelined request's bytes, read before the last response ended, did not)."""
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._between_requests = False
        self._stop_idle_timer()

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        finished = await super().finish_response(request, resp, start_time)
        self._between_requests = True
        self._stop_idle_timer()
        self._idle_timer = asyncio.get_running_loop().call_later(self.guard.limits.keepalive_timeout_s, self._idle_timeout)
        return finished

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's hook for requests it could not parse (and handler failures, which the
        application's own error middleware already turns into responses)."""
        self.headers_received()
        if isinstance(exc, LineTooLong):
            too_long = f"the request line or a header is longer than {self.max_field_size} bytes"
            error = APIError(431, too_long, None, "header_too_large", True)
        elif isinstance(exc, HttpProcessingError) or status < 500:
            error = APIError(400, "malformed HTTP request (request line, headers or framing)", None, "bad_http", True)
        else:
            logger.error("internal error while handling a request", exc_info=exc)
            error = APIError(500, "internal error", None, "internal", True)
        if error.status < 500:
            logger.info("refused a request from %s: %d %s", request.remote, error.status, error.code)
        self.guard.on_refusal(error.status)
        if request.writer.output_size > 0:
            raise ConnectionError("a response was already sent on this connection")
        return error_response(error)

    def log_exception(self, *args: Any, **kwargs: Any) -> None:
        """aiohttp's log of what its connection loop raised. After a response sent without reading
        its request's body (a 401, 404, 405), aiohttp reads the rest and drops it; a body that
        does not decode as its Content-Encoding raises there: the client's error, logged in one
        line (the connection closes, as aiohttp does after any such error)."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, web.RequestPayloadError) and isinstance(exc.__cause__, ContentEncodingError):
            logger.info("closed a connection: the unread request body does not decode as its Content-Encoding")
            return
        super().log_exception(*args, **kwargs)

    def _arm_header_timer(self) -> None:
        self.headers_received()
        loop = asyncio.get_running_loop()
        self._header_timer = loop.call_later(self.guard.limits.header_timeout_s, self._header_timeout)

    def _stop_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_timeout(self) -> None:
        self._idle_timer = None
        if self._between_requests and self.transport is not None:
            self.force_close()

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport is None:
            return
        too_slow = f"the request headers did not arrive within {self.guard.limits.header_timeout_s:g} s"
        error = APIError(408, too_slow, None, "header_timeout")
        logger.info("refused a connection: 408 header_timeout")
        self.transport.write(_raw_response(error))
        self.guard.on_refusal(408)
        self.force_close()


@web.middleware
async def guard_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """First in the application: stops the header clock, refuses connections over the cap."""
    protocol = request.protocol
    if isinstance(protocol, GuardedHandler):
        protocol.headers_received()
        if protocol.over_capacity:
            full = f"the server already has {protocol.guard.limits.max_connections} open connections; retry later"
            return error_response(APIError(503, full, None, "too_many_connections", True))
        protocol.request_task = asyncio.current_task()
        try:
            return await handler(request)
        finally:
            protocol.request_task = None
    return await handler(request)


class GuardedSite:
    """An aiohttp application on host:port, every connection a GuardedHandler."""

    def __init__(self, app: web.Application, guard: ConnectionGuard) -> None:
        self.app, self.guard = app, guard
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen; -> the port (useful with port 0)."""
        # after Ctrl-C / SIGTERM, handlers still running get the shutdown time-out, then are cancelled
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=self.guard.limits.shutdown_timeout_s)
        await self._runner.setup()
        manager, loop, limits = self._runner.server, asyncio.get_running_loop(), self.guard.limits

        def connection() -> GuardedHandler:
            # aiohttp's keep-alive timer never fires first: GuardedHandler times connections itself
            never = limits.header_timeout_s + limits.keepalive_timeout_s + 3600.0
            return GuardedHandler(
                manager, self.guard, loop=loop, keepalive_timeout=never, lingering_time=LINGER_S, access_log=None
            )

        # a TLS handshake gets the header time-out too (asyncio's default is 60 s)
        tls = {"ssl_handshake_timeout": limits.header_timeout_s, "ssl_shutdown_timeout": TLS_SHUTDOWN_S} if ssl_context else {}
        try:
            self._server = await loop.create_server(connection, host, port, ssl=ssl_context, **tls)
        except OSError as exc:  # in use, not this machine's address, a name that does not resolve
            await self._runner.cleanup()
            raise MoaspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.cleanup()

    async def run_until_signalled(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None = None, listening: Callable[[int], None] | None = None
    ) -> int:
        """Serve until SIGINT or SIGTERM (the CLI) -> that signal. After it, nothing new is
        accepted and requests in flight get the shutdown time-out to finish (the application's
        on_shutdown hooks turn waiting ones away); a second signal stops waiting for them.
        listening: called with the port once it listens (the one chosen where `port` is 0)."""
        bound = await self.start(host, port, ssl_context)
        if listening is not None:
            listening(bound)
        loop = asyncio.get_running_loop()
        received: list[int] = []
        stop = asyncio.Event()
        stopping: asyncio.Task | None = None  # the shutdown, once begun

        def on_signal(sig: int) -> None:
            received.append(sig)
            stop.set()
            if len(received) > 1 and stopping is not None:
                stopping.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await stop.wait()
        finally:
            stopping = asyncio.ensure_future(self.stop())
            try:
                await stopping
            except asyncio.CancelledError:
                if len(received) < 2:  # cancelled from outside, not by a second signal
                    raise
        return received[0]


def _raw_response(error: APIError) -> bytes:
    """A whole HTTP/1.1 response for a connection that has no request object to answer."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}\r\n"
        f"Content-Type: application/json; charset=utf-8\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body
