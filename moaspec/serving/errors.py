"""Refusals on every `moaspec serve` route, in OpenAI's error shape:

    {"error": {"message": "one line", "type": "invalid_request_error", "param": null, "code": "..."}}

The message is always ours (never a library's exception text, never request content such as key
material). A 4xx is the client's fault and is never logged with a traceback.
"""

from __future__ import annotations

import json

from aiohttp import web


class APIError(Exception):
    """A refusal with an HTTP status, one-line message, the offending field (param) and a code.
    close_connection: the rest of the request was not read (cut or slow body), so the connection
    cannot carry another request."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 close_connection: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.close_connection = close_connection

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


RETRY_AFTER_S = 1


class ErrorResponse(web.Response):
    """A refusal's response; `code` names it for the server's one-line log (openai_api/routes.py)."""

    def __init__(self, exc: APIError) -> None:
        super().__init__(text=json.dumps(exc.body()), status=exc.status, content_type="application/json")
        self.code = exc.code
        if exc.status in (429, 503):  # full queue or too many connections: room comes back soon
            self.headers["Retry-After"] = str(RETRY_AFTER_S)


def error_response(exc: APIError) -> web.Response:
    response = ErrorResponse(exc)
    if exc.close_connection:
        response.force_close()
    return response
