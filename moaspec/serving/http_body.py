"""Reading a request body on both `moaspec serve` routes (split protocol and OpenAI API).

A body must arrive within `timeout_s` of the handler asking for it and fit in the application's
`client_max_size`. Failures become `APIError`s that close the connection (the rest of the body was
not read): 408 too slow, 413 too large, 400 cut off (the connection failed mid-upload) or not
decodable as its Content-Encoding (gzip, deflate, br). Callers
read the whole body before they change any state, so a client can retry the same request.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError

from moaspec.serving.errors import APIError

# What request.read() raises when the connection fails or closes before the body's end.
TRANSPORT_ERRORS = (ConnectionError, web.RequestPayloadError, HttpProcessingError, asyncio.IncompleteReadError)


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    too_large = APIError(413, f"the request body is larger than {request.client_max_size} bytes", None, "request_too_large", True)
    if request.content_length is not None and request.content_length > request.client_max_size:
        raise too_large  # declared: refused before any of it arrives, not after the body time-out
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s", None, "body_timeout", True) from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except web.RequestPayloadError as exc:
        if not isinstance(exc.__cause__, ContentEncodingError):
            raise _cut_off() from None
        # aiohttp's parser ended the body at the error; marked read, aiohttp does not linger over it
        # after the response (that read raised the error again, logged as an unhandled exception)
        request.content.feed_eof()
        encoding = request.headers.get("Content-Encoding", "")
        message = f"the request body does not decode as its Content-Encoding ({encoding})"
        raise APIError(400, message, None, "bad_content_encoding", True) from None
    except TRANSPORT_ERRORS:
        raise _cut_off() from None


def _cut_off() -> APIError:
    return APIError(400, "the request body was cut off before its end", None, "body_incomplete", True)
