"""`moaspec serve` under hostile clients (issue 19, items 3-5): a cut upload keeps the split
session, half-sent requests and slow bodies time out, connections and cached tokens are capped,
and bad input on either route gets a 4xx in OpenAI's error shape with our own message, never a
500, a traceback in the log or key material anywhere.

Loopback only, tiny random models (tests/openai_helpers.py); every socket has a timeout and every
polling loop a deadline."""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import time
from pathlib import Path

import pytest
from openai_helpers import KEY, make_drafter, self_signed_certificate, start_server, tiny_chat_target

from moaspec.serving.http_guard import LINGER_S
from moaspec.split import protocol as wire
from moaspec.split.client import ServerRefused, SplitClient
from moaspec.split.server import ServerLimits, ServerThread, SplitServer

PROMPT = [40, 69, 76, 76, 79, 12, 0, 87, 79, 82]
MODEL = "tiny-llama"
SOCKET_TIMEOUT_S = 5.0


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def request(port: int, method: str, path: str, body: bytes | None = None, content_type: str = "application/json",
            key: str = KEY) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SOCKET_TIMEOUT_S)
    try:
        headers = {"Authorization": f"Bearer {key}", "Content-Type": content_type}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def read_response(sock: socket.socket) -> bytes:
    """One whole response (head + Content-Length bytes), or what came before the server closed."""
    received = b""
    while b"\r\n\r\n" not in received and (chunk := sock.recv(65536)):
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")), 0)
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return head + b"\r\n\r\n" + body


def metric(port: int, line_start: str) -> float:
    _, text = request(port, "GET", "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines() if line.startswith(line_start))


def assert_our_error(status: int, body: bytes, expected_status: int | None = None) -> dict:
    """A refusal (a 4xx unless `expected_status` says otherwise) in OpenAI's shape whose message
    is ours: one line, no exception class or traceback. -> the error object."""
    if expected_status is None:
        assert 400 <= status < 500, (status, body[:200])
    else:
        assert status == expected_status, (status, body[:200])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    message = error["message"]
    assert message and "\n" not in message and len(message) < 300
    assert not any(word in message for word in ("Traceback", "Error:", "Exception", "File \""))
    return error


@pytest.fixture(scope="module")
def server():
    started = start_server("ngram")
    yield started
    started.stop()


# -- item 3: a cut upload keeps the session ------------------------------------------------------------
def test_a_cut_upload_leaves_the_split_session_for_the_retry() -> None:
    """Bug: a verify whose body was cut mid-upload made the server drop the session (500), so the
    client's retry with the same seq got 404 and it had to prefill again. Not flaky: the retry is
    sent only once /metrics shows the cut request was answered (deadline 10 s), so the server has
    already done whatever it does with the session."""
    started = start_server("ngram")
    try:
        port = started.port
        client = SplitClient(f"http://127.0.0.1:{port}", KEY, timeout_s=SOCKET_TIMEOUT_S)
        session_id = client.open(wire.OpenRequest(PROMPT, max_new_tokens=8))["session_id"]
        next_token = started.server.sessions[session_id].root_id
        verify = wire.VerifyRequest(0, [next_token], [-1])
        body = wire.dumps(verify.to_wire(), wire.MSGPACK)
        path = f"/v1/split/sessions/{session_id}/verify"
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                f"Content-Type: {wire.MSGPACK}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(head + body[: len(body) // 2])  # then the connection drops
        route = 'moaspec_http_requests_total{route="/v1/split/sessions/{session_id}/verify"'
        assert wait_until(lambda: metric(port, route) >= 1)
        assert metric(port, route + ',status="500"') == 0
        reply = client.verify(session_id, verify)  # the same seq: answered, not 404
        assert reply["seq"] == 0 and reply["path_node_idx"] == [0]
    finally:
        started.stop()


# -- item 4: time-outs and caps ------------------------------------------------------------------------
def test_half_sent_requests_and_slow_bodies_time_out() -> None:
    """Bug: a request whose headers never finished (no key needed) kept its connection open with no
    time-out, one descriptor each, on a new connection or after a keep-alive request; a body that
    never finished did the same. Not flaky: 0.3 s time-outs against a 5 s socket deadline, and the
    server closes every connection itself."""
    started = start_server("ngram", limits=ServerLimits(header_timeout_s=0.3, body_timeout_s=0.3))
    try:
        port = started.port
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) for _ in range(20)]
        for sock in sockets:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bear")
        for sock in sockets:
            received = read_response(sock)
            assert sock.recv(1) == b""  # and then closed by the server
            sock.close()
            assert received.startswith(b"HTTP/1.1 408 ") and b'"header_timeout"' in received
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:  # a keep-alive request, then half of one
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 408 ") and sock.recv(1) == b""
        assert metric(port, 'moaspec_http_requests_total{route="other",status="408"}') == 21  # each counted
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                          "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"").encode())
            slow = read_response(sock)
            answered = time.monotonic()
            assert sock.recv(1) == b""  # closed within the lingering second, not after aiohttp's 10 s of it
            assert time.monotonic() - answered < LINGER_S + 1.0
        assert slow.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in slow and b"connection: close" in slow.lower()
        assert wait_until(lambda: started.server.connections.num_open == 0)
        assert request(port, "GET", "/health")[0] == 200
    finally:
        started.stop()


def test_a_shorter_keep_alive_time_out_does_not_cut_a_request_being_sent() -> None:
    """Bug: with --keepalive-timeout-s below --header-timeout-s, a connection part-way through its
    request's headers was closed silently at the keep-alive time-out (aiohttp's timer) instead of
    getting its 408; an idle connection must still close at the keep-alive time-out."""
    started = start_server("ngram", limits=ServerLimits(header_timeout_s=1.0, keepalive_timeout_s=0.2))
    try:
        port = started.port
        greeting = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            began = time.monotonic()
            received = read_response(sock)
            assert received.startswith(b"HTTP/1.1 408 ") and b'"header_timeout"' in received
            assert time.monotonic() - began > 0.5
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:  # after a response
            sock.sendall(greeting)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.1)
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 408 ")
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:  # idle: closed
            sock.sendall(greeting)
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            began = time.monotonic()
            assert sock.recv(1) == b""
            assert time.monotonic() - began < 0.8
    finally:
        started.stop()


def test_a_body_sent_after_its_headers_does_not_restart_the_header_clock() -> None:
    """A request whose body arrives after its headers (alone, or pipelined behind a keep-alive
    request answered meanwhile) and whose handler runs past the header time-out is answered in
    full: the header clock stops with the headers and a body's bytes never start it again (that
    would write a 408 into the response and cut the connection). The handler takes ~1 s (20
    proposals of a drafter slowed by 50 ms) against a 0.3 s header time-out."""
    started = start_server("ngram", delay_s=0.05, limits=ServerLimits(header_timeout_s=0.3))
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 20, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    health = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    try:
        for before in (b"", health):  # alone; pipelined behind a request answered before the body comes
            with socket.create_connection(("127.0.0.1", started.port), timeout=SOCKET_TIMEOUT_S) as sock:
                sock.sendall(before + head)
                if before:
                    assert read_response(sock).startswith(b"HTTP/1.1 200 ")
                time.sleep(0.1)
                sock.sendall(body)
                answer = read_response(sock)
                assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
                assert json.loads(answer.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 20
    finally:
        started.stop()


def test_a_stream_whose_handler_fails_after_it_began_is_cut_not_appended_to(monkeypatch) -> None:
    """A failure escaping a streaming handler after its first bytes were sent (here: building the
    usage chunk) cannot be answered with an error response any more: the connection is dropped,
    so the client sees a stream without its end, never an HTTP error body inside the stream."""
    import moaspec.openai_api.routes as routes

    def broken_usage(*args, **kwargs):
        raise RuntimeError("a fault after the stream began")

    monkeypatch.setattr(routes.schemas, "usage_chunk", broken_usage)
    started = start_server("ngram")
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    try:
        with socket.create_connection(("127.0.0.1", started.port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                          f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
            received = b""
            while chunk := sock.recv(65536):  # until the server closes
                received += chunk
        assert received.startswith(b"HTTP/1.1 200 ") and b"data: " in received
        assert b"[DONE]" not in received and b'"internal error"' not in received
        assert request(started.port, "GET", "/health")[0] == 200
    finally:
        started.stop()


def test_connections_over_the_cap_get_503_and_room_comes_back(caplog) -> None:
    """Bug: nothing bounded open connections. Not flaky: the held connections are counted by the
    server before the extra one is made (polled with a deadline), and the header time-out (10 s
    default) is far longer than the test. The refusal is logged, as every other one (it was not)."""
    caplog.set_level(logging.INFO)
    started = start_server("ngram", limits=ServerLimits(max_connections=3))
    try:
        port = started.port
        held = [socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) for _ in range(2)]
        assert wait_until(lambda: started.server.connections.num_open == 2)
        assert request(port, "GET", "/health")[0] == 200  # the third connection: within the cap
        held.append(socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S))
        assert wait_until(lambda: started.server.connections.num_open == 3)
        error = assert_our_error(*request(port, "GET", "/health"), 503)
        assert error["code"] == "too_many_connections" and "3 open connections" in error["message"]
        assert "refused GET /health: 503 too_many_connections" in [r.getMessage() for r in caplog.records]
        for sock in held:
            sock.close()
        assert wait_until(lambda: started.server.connections.num_open == 0)
        assert request(port, "GET", "/health")[0] == 200
    finally:
        started.stop()


def test_cached_token_budgets_per_key_and_per_server() -> None:
    """Bug: one key could open sessions until memory ran out. Each session reserves prompt +
    max_new_tokens = 10 + 40 = 50 tokens: the key's share (100) stops its third session with 429,
    the server's total (150) stops the other key's second with 503, and closing a session makes room.
    Deterministic: sequential requests, token counts fixed by the request."""
    target = tiny_chat_target()
    limits = ServerLimits(max_cached_tokens_per_key=100, max_cached_tokens=150)
    started = ServerThread(SplitServer(target, make_drafter("ngram", target), [KEY, "other-key"], limits)).start()
    try:
        url = f"http://127.0.0.1:{started.port}"
        first, second = SplitClient(url, KEY), SplitClient(url, "other-key")
        opened = [first.open(wire.OpenRequest(PROMPT, max_new_tokens=40)) for _ in range(2)]
        with pytest.raises(ServerRefused, match=r"\(429\).*more than 100 tokens"):
            first.open(wire.OpenRequest(PROMPT, max_new_tokens=40))
        second.open(wire.OpenRequest(PROMPT, max_new_tokens=40))
        status, body = request(started.port, "POST", "/v1/split/sessions", key="other-key",
                               body=json.dumps(wire.OpenRequest(PROMPT, max_new_tokens=40).to_wire()).encode())
        assert "more than 150 tokens" in assert_our_error(status, body, 503)["message"]
        first.close_session(opened[0]["session_id"])
        second.open(wire.OpenRequest(PROMPT, max_new_tokens=40))
        assert started.server.budget.num_tokens == 150
        with pytest.raises(ServerRefused, match=r"\(413\).*ask for fewer tokens"):  # could never fit: not a 429 to retry
            first.open(wire.OpenRequest(PROMPT, max_new_tokens=95))
    finally:
        started.stop()


# -- item 5: bad input is a 400 in our shape on every route ------------------------------------------
DEEP = b"[" * 3000 + b"]" * 3000
# name -> (body, what the OpenAI routes' message says)
BAD_BODIES = {
    "nested 3,000 deep": (b'{"model": "tiny-llama", "prompt": ' + DEEP + b"}", "not valid JSON"),
    "5,000-digit integer": (b'{"model": "tiny-llama", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON"),
    "lone surrogate": (
        b'{"model": "tiny-llama", "prompt": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}]}', "not valid JSON",
    ),
    "400-digit temperature": (
        b'{"model": "tiny-llama", "prompt": "x", "messages": [{"role": "user", "content": "x"}], "temperature": ' + b"9" * 400 + b"}",
        "'temperature' must be a number",
    ),
    "a key twice": (
        b'{"model": "tiny-llama", "prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_tokens": 3}',
        "repeats a key",
    ),
}
OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")


@pytest.mark.parametrize("name", list(BAD_BODIES))
def test_bad_json_is_a_400_with_our_message_on_every_route(server, name: str, caplog) -> None:
    """Bug: a body nested 3,000 deep or holding a 5,000-digit integer got 500 with the internal
    exception text; a lone surrogate got the tokenizer's internal message; a 400-digit number
    overflowed float() (500). Deterministic: fixed bodies."""
    caplog.set_level(logging.INFO)
    body, says = BAD_BODIES[name]
    for path in OPENAI_ROUTES:
        status, reply = request(server.port, "POST", path, body)
        assert says in assert_our_error(status, reply, 400)["message"]
    status, reply = request(server.port, "POST", "/v1/split/sessions", body)
    assert_our_error(status, reply, 400)
    assert not [r for r in caplog.records if r.exc_info], "a client error was logged with a traceback"
    # each refusal is one log line: method, route, status and code (README, *Limits*)
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")]
    assert "refused POST /v1/split/sessions: 400 bad_request" in refusals
    assert all(f"refused POST {path}: 400 " in "\n".join(refusals) for path in OPENAI_ROUTES)


def test_a_method_a_route_does_not_take_is_a_405_that_names_those_it_does(server, caplog) -> None:
    """Bug: the 405 carried no Allow header (RFC 9110 requires it), and was logged and counted
    under the route "other"."""
    caplog.set_level(logging.INFO)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=SOCKET_TIMEOUT_S)
    try:
        conn.request("DELETE", "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        response = conn.getresponse()
        assert_our_error(response.status, response.read(), 405)
        assert response.getheader("Allow") is not None and "GET" in response.getheader("Allow")
    finally:
        conn.close()
    status, _ = request(server.port, "DELETE", "/v1/models/anything")
    assert status == 405
    refusals = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused DELETE")]
    assert refusals == ["refused DELETE /v1/models: 405 http", "refused DELETE /v1/models/{model}: 405 http"]


def test_an_oversized_header_is_refused_in_our_shape_and_never_logged(server, caplog) -> None:
    """Bug: a 10 KB Authorization header got aiohttp's plain-text 400 (quoting the header) and a
    traceback with the start of the key in the server log. Deterministic: one fixed request."""
    caplog.set_level(logging.DEBUG)
    secret = "sk-" + "s3cret" * 1700
    before = metric(server.port, 'moaspec_http_requests_total{route="other",status="431"}')
    status, body = request(server.port, "GET", "/v1/models", key=secret)
    error = assert_our_error(status, body, 431)
    assert error["code"] == "header_too_large" and b"s3cret" not in body
    assert metric(server.port, 'moaspec_http_requests_total{route="other",status="431"}') == before + 1
    logged = "\n".join(r.getMessage() + str(r.exc_info or "") + str(r.args) for r in caplog.records)
    assert "s3cret" not in logged and not [r for r in caplog.records if r.exc_info]


def test_a_key_that_is_not_utf8_is_refused_as_invalid(server, caplog) -> None:
    """Bug: a key with bytes that are not UTF-8 (aiohttp reads them as lone surrogates) raised
    UnicodeEncodeError in the key check: a 500 and a traceback in the log, on every route."""
    caplog.set_level(logging.DEBUG)
    for path in ("/v1/models", "/health"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}".encode()
                         + b"\xff\xfe\r\nConnection: close\r\n\r\n")
            head, _, body = read_response(sock).partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        assert assert_our_error(status, body, 401)["message"] == "invalid API key"
    assert not [r for r in caplog.records if r.exc_info]


# -- fuzz: a few hundred malformed bodies on both routes -----------------------------------------------
def _nested(rng, depth: int):
    """[[...[10**30]...]] or {"k": ...}: `depth` levels (over 200 is beyond the JSON parser's limit)."""
    value: object = [10**30]
    for _ in range(depth - 1):
        value = [value] if rng.random() < 0.7 else {"k": value}
    return value


def _hostile(rng):
    """A value that no field of either route accepts (each field's check is listed in the
    fuzz test's docstring): huge or negative numbers, long strings, lone surrogates, deep or
    out-of-vocabulary lists, objects."""
    kind = rng.randrange(7)
    if kind == 0:
        return rng.choice((1, -1)) * 10 ** rng.randint(20, 4000)
    if kind == 1:
        return rng.choice((-3.5, -3.5e300))
    if kind == 2:
        return "x" * rng.randint(1000, 3000)
    if kind == 3:
        return "\ud800" + "y" * rng.randint(0, 5)
    if kind == 4:
        return _nested(rng, rng.randint(1, 250))
    if kind == 5:
        return {"k": _nested(rng, rng.randint(1, 40))}
    return [rng.randint(10**6, 10**9) for _ in range(rng.randint(2, 5))]


def _random_json(rng, depth: int = 0):
    kind = rng.randrange(8 if depth < 6 else 5)
    if kind == 0:
        return rng.choice((0, -1, 2**63, 10 ** rng.randint(1, 300)))
    if kind == 1:
        return rng.choice((0.5, -1e308, 1e-300))
    if kind == 2:
        return "".join(chr(rng.randint(1, 0x2FFFF)) for _ in range(rng.randint(0, 20)))
    if kind == 3:
        return rng.choice((True, False))
    if kind == 4:
        return None
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 6:
        return {f"f{rng.randint(0, 99)}": _random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    return _nested(rng, rng.randint(150, 400))


def _dumps(value) -> bytes:
    return json.dumps(value).encode()  # ensure_ascii: a lone surrogate travels as the escape \ud800


def _fuzz_bodies(rng, valid: dict, fields: tuple[str, ...], count: int) -> list[tuple[bytes, str]]:
    """`count` malformed (body, content type) pairs: random bytes, random JSON values, and the
    valid request with one field made hostile."""
    bodies = []
    for i in range(count):
        family = i % 3
        if family == 0:
            data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
            bodies.append((data, rng.choice(("application/json", wire.MSGPACK, "text/plain"))))
        elif family == 1:
            bodies.append((_dumps(_random_json(rng)), "application/json"))
        else:
            field = rng.choice(fields)
            mutated = json.loads(json.dumps(valid))
            if field.startswith("messages[0]."):
                mutated["messages"][0][field.split(".")[1]] = _hostile(rng)
            else:
                mutated[field] = _hostile(rng)
            bodies.append((_dumps(mutated), "application/json"))
    return bodies


def test_fuzzed_bodies_get_4xx_and_the_server_keeps_working(caplog) -> None:
    """A few hundred generated malformed bodies (random bytes in three content types, random JSON
    of random depth and types, valid requests with one field replaced by a huge/negative number,
    a long string, a lone surrogate, a deep or out-of-vocabulary list or an object) on both
    routes: each gets a 4xx in our shape, none a 5xx, no traceback is logged, /metrics counts
    them as client errors, and afterwards a completion and the split session (still at seq 0:
    no malformed verify moved it) work. Hostile values are invalid for every mutated field by
    construction (e.g. the 1,000+-character string is over the 512-token context as a prompt,
    over 64 characters as a request_id, over 256 as a stop), so each 4xx is required, not
    likely. Not flaky: fixed seed, sequential requests, bounded socket time-outs."""
    import random

    caplog.set_level(logging.INFO)
    rng = random.Random(19)
    started = start_server("ngram")
    try:
        port = started.port
        client = SplitClient(f"http://127.0.0.1:{port}", KEY, timeout_s=SOCKET_TIMEOUT_S)
        session_id = client.open(wire.OpenRequest(PROMPT, max_new_tokens=4))["session_id"]
        root = started.server.sessions[session_id].root_id
        completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
        targets = [
            ("/v1/completions", completion, ("model", "prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop",
                                             "stream", "logprobs", "presence_penalty")),
            ("/v1/chat/completions", chat, ("model", "messages", "messages[0].role", "messages[0].content", "max_tokens",
                                            "max_completion_tokens", "temperature", "stop", "stream")),
            ("/v1/split/sessions", wire.OpenRequest(PROMPT, max_new_tokens=4).to_wire(),
             ("prompt_ids", "version", "temperature", "top_k", "top_p", "seed", "max_new_tokens", "root_id", "context_from",
              "context_dtype", "request_id")),
            (f"/v1/split/sessions/{session_id}/verify", {"seq": 0, "token_ids": [root], "parents": [-1]},
             ("seq", "token_ids", "parents", "draft_probs")),
        ]
        num_sent = 0
        for path, valid, fields in targets:
            for body, content_type in _fuzz_bodies(rng, valid, fields, 75):
                status, reply = request(port, "POST", path, body, content_type)
                assert 400 <= status < 500, (path, status, body[:120], reply[:200])
                assert_our_error(status, reply)
                num_sent += 1
        assert num_sent == 300
        assert metric(port, 'moaspec_http_requests_total{route="/v1/') >= num_sent
        assert sum(metric(port, f'moaspec_http_requests_total{{route="{path}",status="5') for path, _, _ in targets) == 0
        status, reply = request(port, "POST", "/v1/completions", _dumps(completion))
        assert status == 200 and json.loads(reply)["usage"]["completion_tokens"] == 2
        assert client.verify(session_id, wire.VerifyRequest(0, [root], [-1]))["seq"] == 0
    finally:
        started.stop()
    assert not [r for r in caplog.records if r.exc_info], "a client error was logged with a traceback"


# -- item 6: /metrics from prometheus_client, same names ------------------------------------------------
def test_metrics_parse_as_prometheus_text_with_the_documented_names(server) -> None:
    """/metrics is rendered by prometheus_client (was a hand-written registry): it parses with the
    library's own text parser, keeps every documented name, has no `_created` series, and exposes
    the server's limits state (connections, split sessions, reserved tokens). Deterministic:
    names only, values checked where the test set them."""
    from prometheus_client.parser import text_string_to_metric_families

    SplitClient(f"http://127.0.0.1:{server.port}", KEY).open(wire.OpenRequest(PROMPT, max_new_tokens=6))
    _, text = request(server.port, "GET", "/metrics")
    families = {family.name: family for family in text_string_to_metric_families(text.decode())}
    section = (Path(__file__).parents[1] / "docs" / "protocol.md").read_text().split("## Metrics")[1].split("\n## ")[0]
    documented = {name.removesuffix("_total") for name in re.findall(r"^\| `(moaspec_[a-z_]+)`", section, re.M)}
    assert len(documented) == 23 and documented == {name for name in families if name.startswith("moaspec_")}
    assert not [line for line in text.decode().splitlines() if "_created" in line]
    assert families["moaspec_split_reserved_tokens"].samples[0].value >= len(PROMPT) + 6
    assert families["moaspec_connections_open"].samples[0].value >= 1


def test_the_bearer_scheme_is_case_insensitive_and_full_queues_say_when_to_retry(server) -> None:
    """RFC 9110: `bearer KEY` is `Bearer KEY`; a 429 or 503 carries Retry-After."""
    status, _ = request(server.port, "GET", "/health", key=KEY)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=SOCKET_TIMEOUT_S)
    try:
        conn.request("GET", "/health", headers={"Authorization": f"bearer {KEY}"})
        assert conn.getresponse().status == status == 200
    finally:
        conn.close()
    from aiohttp import web

    from moaspec.serving.errors import APIError, error_response

    assert error_response(APIError(429, "full", None, "queue_full")).headers["Retry-After"] == "1"
    assert "Retry-After" not in error_response(APIError(400, "bad")).headers
    assert isinstance(error_response(APIError(503, "busy")), web.Response)


def test_a_tls_handshake_that_never_comes_times_out(tmp_path) -> None:
    """A TLS connection whose client never sends its handshake is closed at the header time-out
    (asyncio's default is 60 s: a descriptor held each meanwhile). Not flaky: a 0.3 s time-out
    against the 5 s socket deadline."""
    import ssl

    cert, key = self_signed_certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    target = tiny_chat_target()
    server = SplitServer(target, make_drafter("ngram", target), [KEY], ServerLimits(header_timeout_s=0.3))
    started = ServerThread(server, ssl_context=context).start()
    try:
        with socket.create_connection(("127.0.0.1", started.port), timeout=SOCKET_TIMEOUT_S) as sock:
            try:
                assert sock.recv(1) == b""  # closed by the server
            except ConnectionResetError:
                pass
    finally:
        started.stop()


def test_a_tls_connection_the_server_closes_frees_its_slot_at_once(tmp_path) -> None:
    """Bug: over TLS a connection closed by the header time-out (or the keep-alive one) waited
    asyncio's default 30 s for the client's close_notify, holding its --max-connections slot (503s
    meanwhile). Not flaky: the client never closes; the slot must come back within 5 s (TLS_SHUTDOWN_S
    is 1 s), against 30 s before."""
    import ssl

    from moaspec.serving.http_guard import TLS_SHUTDOWN_S

    cert, key = self_signed_certificate(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=str(cert))
    target = tiny_chat_target()
    server = SplitServer(target, make_drafter("ngram", target), [KEY], ServerLimits(header_timeout_s=0.3, max_connections=2))
    started = ServerThread(server, ssl_context=server_context).start()
    try:
        raw = socket.create_connection(("127.0.0.1", started.port), timeout=SOCKET_TIMEOUT_S)
        with client_context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
            assert read_response(sock).startswith(b"HTTP/1.1 408 ")
            assert wait_until(lambda: server.connections.num_open == 0, timeout_s=TLS_SHUTDOWN_S + 4.0)
    finally:
        started.stop()


def test_a_body_that_does_not_decode_is_a_400_that_says_so_and_logs_no_traceback(server, caplog) -> None:
    """Bug: a body not decodable as its Content-Encoding got 400 "cut off before its end", and
    aiohttp's lingering read after the response raised the decoding error again, logged as an
    "Unhandled exception" with its traceback. Not flaky: the log line would come before the server
    closes the connection, which the test waits for."""
    import gzip
    import zlib

    caplog.set_level(logging.DEBUG)
    port = server.port
    valid = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    for encoding, body in (("gzip", b"\x1f\x8bnot gzip at all"), ("deflate", b"not deflate either"),
                           ("gzip", zlib.compress(valid)[:-3])):
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                          f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
            response = read_response(sock)
            while sock.recv(65536):  # until the server closes the connection
                pass
        head, _, payload = response.partition(b"\r\n\r\n")
        error = assert_our_error(int(head.split()[1]), payload, 400)
        assert error["code"] == "bad_content_encoding" and f"({encoding})" in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    gzipped = gzip.compress(valid)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=SOCKET_TIMEOUT_S)
    try:  # a valid compressed body is read as the JSON it holds
        conn.request("POST", "/v1/completions", body=gzipped, headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert conn.getresponse().status == 200
    finally:
        conn.close()


@pytest.mark.parametrize(("method", "path", "key", "status"), [
    ("POST", "/v1/completions", None, 401), ("POST", "/v1/models", KEY, 405), ("POST", "/v1/nowhere", KEY, 404),
])
def test_an_unread_body_that_does_not_decode_logs_no_traceback(server, caplog, method, path, key, status) -> None:
    """Bug (an audit): a request answered without its body read (no key, a wrong method or route)
    whose body does not decode as its Content-Encoding put aiohttp's "Unhandled exception" and
    three chained tracebacks in the log (its lingering read after the response raised the error);
    an unauthenticated client could fill the log so. The response is ours; the log one line."""
    caplog.set_level(logging.DEBUG)
    body = b"\x1f\x8bnot gzip at all"
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    with socket.create_connection(("127.0.0.1", server.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall((f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                      f"Content-Encoding: gzip\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
        response = read_response(sock)
        while sock.recv(65536):  # until the server closes the connection
            pass
    head, _, payload = response.partition(b"\r\n\r\n")
    assert_our_error(int(head.split()[1]), payload, status)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    assert any("does not decode as its Content-Encoding" in r.getMessage() for r in caplog.records)


def test_a_declared_oversized_body_is_refused_at_once(server) -> None:
    """Bug: a request whose Content-Length is over --max-body-bytes, its body not sent (a client
    waiting for the answer, without `Expect: 100-continue`), got a 408 after the 30 s body
    time-out instead of the 413 the limit documents."""
    port = server.port
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 99999999\r\n\r\n").encode())
        response = read_response(sock)
    head, _, body = response.partition(b"\r\n\r\n")
    assert assert_our_error(int(head.split()[1]), body, 413)["code"] == "request_too_large"
    assert time.monotonic() - started < 5.0


def test_an_address_that_cannot_be_listened_on_is_a_one_line_error_and_port_0_is_told(server) -> None:
    """Bug: `moaspec serve` on a port in use, an address not this machine's or a host name that
    does not resolve said it was serving, then failed with a traceback; with --port 0 it said
    port 0 instead of the one it listened on."""
    import asyncio

    from moaspec.errors import MoaspecError

    def site():  # one per event loop
        target = tiny_chat_target()
        return SplitServer(target, make_drafter("ngram", target), [KEY], ServerLimits()).site()

    for host, port in (("127.0.0.1", server.port), ("no-such-host.invalid", 0)):
        refused, cleaned = site(), []

        async def cleanup_hook(app) -> None:
            cleaned.append(app)

        refused.app.on_cleanup.append(cleanup_hook)
        with pytest.raises(MoaspecError, match=f"cannot listen on {re.escape(host)}:{port}: ") as raised:
            asyncio.run(refused.start(host, port))
        assert "\n" not in str(raised.value)
        assert cleaned == [refused.app]  # the application set up for it is cleaned up again

    told: list[int] = []

    async def listen_then_stop() -> None:
        task = asyncio.ensure_future(site().run_until_signalled("127.0.0.1", 0, None, told.append))
        while not told:
            await asyncio.sleep(0.01)
        with socket.create_connection(("127.0.0.1", told[0]), timeout=SOCKET_TIMEOUT_S):
            pass  # it listens on the port it told
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(listen_then_stop())
    assert told[0] > 0
