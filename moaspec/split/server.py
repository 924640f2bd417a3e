"""`moaspec serve`: the target side of the split deployment over HTTP(S) (docs/protocol.md).

The server holds the target and the drafter's context encoder. Per client session it keeps one
`TargetSession` (its own KV cache over the shared model weights) and answers:
    GET    /v1/split/info                      target, drafter fingerprint, limits
    POST   /v1/split/sessions                  prefill (or resume) -> first token + context
    POST   /v1/split/sessions/{id}/verify      one draft tree -> accepted path, next token, context
    DELETE /v1/split/sessions/{id}
Every request needs `Authorization: Bearer <key>` (constant-time compare). Model work runs on one
worker thread, one request at a time, so sessions never share state; a bad request gets a 4xx
with {"error": {"code", "message", "type", "param"}} and never affects another session. A request
changes its session only once its body is complete, so a cut or slow upload leaves the session as
it was (the client retries the same `seq`); a session is dropped only when the model work on it
fails. Sessions are admitted by `SessionBudget` (sessions and cached tokens per key and in total),
connections by `moaspec.serving.http_guard` (count, header/keep-alive time-outs). `build_app`
also adds the OpenAI-compatible API (moaspec/openai_api, issue 7) to the same application.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch
from aiohttp import web

from moaspec.config import SamplingConfig
from moaspec.decode_step import last_emitted
from moaspec.drafters.base import Drafter
from moaspec.errors import MoaspecError
from moaspec.openai_api.routes import OpenAILimits, OpenAIRoutes, add_openai_routes
from moaspec.serving.errors import APIError, error_response
from moaspec.serving.http_body import read_body
from moaspec.serving.http_guard import ConnectionGuard, GuardedSite, guard_middleware
from moaspec.serving.identity import drafter_fingerprint, drafter_form
from moaspec.serving.limits import ServerLimits
from moaspec.serving.strict_json import ProtocolError
from moaspec.session import TargetSession, resumed_seed
from moaspec.split import protocol as wire
from moaspec.split.budget import Reservation, SessionBudget
from moaspec.split.idle_targets import IdleTargets
from moaspec.split.loop_thread import LoopThread
from moaspec.targets.base import Target
from moaspec.tree import depths

if TYPE_CHECKING:
    import ssl

    from moaspec.calibration.plan import Calibration

REAPER = web.AppKey("reaper", asyncio.Task)
KEY_INDEX = web.RequestKey("key_index", int)
logger = logging.getLogger("moaspec.serve")
# target sessions kept after their split session ends (IdleTargets): on SmolLM2-135M a llama.cpp
# context holds ~17 KB of cache a cell, up to ~155 MB once grown to 8,192 positions
IDLE_TARGETS = 2
# a key at its session limit gets room by ending its own sessions idle this long (a client that
# died, or one offline, which resynchronises on reconnect) instead of a 429 until the idle time-out
STALE_SESSION_S = 10.0
ENDED_OPENS = 4096  # opens remembered after their client closed the session (for the idle time-out)


class HTTPError(APIError):
    """A refusal of the split protocol: a status, a code and a one-line reason."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status, message, None, code)


class ModelFailed(Exception):
    """The model work of a request raised: a server bug or resource failure (500)."""


@dataclass
class _Session:
    key_index: int
    target_session: TargetSession
    context_dtype: str
    max_new_tokens: int
    root_id: int
    open_ident: tuple[int, str]  # (key, request_id) of the open request
    reservation: Reservation  # its sessions and cached tokens in the budget
    stop_ids: frozenset[int] = frozenset()  # the client's: a verify with `remaining` that ends the generation closes it
    num_verified: int = 0  # tokens this session added to the context (budget)
    next_seq: int = 0
    last_reply: dict | None = None
    last_used: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one request of a session at a time


@dataclass(frozen=True)
class _Finished:
    """What is kept of a session the server closed after its last verify: that reply, for a retry."""

    key_index: int
    seq: int
    reply: dict
    closed_at: float


@dataclass(frozen=True)
class _Prefilled:
    first_token: int
    target_session: TargetSession
    context: dict  # encoded for the wire
    server_s: float


class SplitServer:
    """Sessions over one target + one drafter's context encoder."""

    def __init__(
        self, target: Target, drafter: Drafter, api_keys: list[str], limits: ServerLimits = ServerLimits(),
        openai_limits: OpenAILimits | None = None, openai: tuple[Target, Drafter] | None = None,
        openai_calibration: Calibration | None = None,
    ) -> None:
        """openai: the target (the OpenAI routes decode in a session of it) and the drafter the
        OpenAI routes generate with (issue 7); default: the split's own `target` and `drafter`.
        openai_calibration: the machine calibration that chose the OpenAI routes' drafter, if one
        did (their generations far slower than it predicts are logged)."""
        if not api_keys or not all(api_keys):
            raise MoaspecError("the server needs at least one non-empty API key")
        self.target = target
        self.drafter = drafter
        self.openai_target, self.openai_drafter = openai if openai is not None else (target, drafter)
        self.openai_limits = openai_limits
        self.openai_calibration = openai_calibration
        self.encoder = getattr(drafter, "context_encoder", None)
        if self.encoder is None:
            raise MoaspecError(f"drafter {drafter_form(drafter)} cannot be split (it has no context encoder)")
        self.api_keys = [key.encode() for key in api_keys]
        runtime_limit = getattr(target, "max_tree_nodes", None)
        if runtime_limit is not None and limits.max_tree_nodes > runtime_limit:
            raise MoaspecError(
                f"--max-tree-nodes {limits.max_tree_nodes} is more than the {target.runtime} runtime verifies in one tree ({runtime_limit})"
            )
        self.limits = limits
        self.info = {
            "version": wire.PROTOCOL_VERSION,
            "target": target.name,
            "runtime": target.runtime,
            "vocab_size": target.vocab_size,
            "max_positions": target.max_positions,
            "max_tree_leaves": getattr(target, "max_tree_leaves", None),
            "drafter": drafter_form(drafter),
            "drafter_fingerprint": drafter_fingerprint(drafter),
            "limits": asdict(limits),
        }
        self.sessions: dict[str, _Session] = {}
        self.finished: dict[str, _Finished] = {}  # closed by their last verify, oldest first (at most max_sessions)
        self.budget = SessionBudget(limits)
        self.idle = IdleTargets(IDLE_TARGETS)
        self.connections = ConnectionGuard(limits)
        self.openai: OpenAIRoutes | None = None  # set by build_app
        # open replies by (key, request_id), with the digest of the open request's body
        self.opening: dict[tuple[int, str], tuple[asyncio.Future, bytes]] = {}
        # (key, request_id) of opens whose session its client ended -> when, oldest first (at most
        # ENDED_OPENS, for the idle time-out): a late duplicate is refused instead of opening an orphan
        self.ended_opens: dict[tuple[int, str], float] = {}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moaspec-target")

    # -- the application ------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[guard_middleware, self._errors, self._auth])
        app.router.add_get("/v1/split/info", self._info)
        app.router.add_post("/v1/split/sessions", self._open)
        app.router.add_post("/v1/split/sessions/{session_id}/verify", self._verify)
        app.router.add_delete("/v1/split/sessions/{session_id}", self._close)
        self.openai = add_openai_routes(
            app, self.openai_target, self.openai_drafter, self.worker, self.limits.max_new_tokens, self.openai_limits,
            self.limits.body_timeout_s, self.openai_calibration,
        )
        self.openai.metrics.add_server_gauges(lambda: self.connections.num_open, lambda: len(self.sessions), lambda: self.budget.num_tokens)
        self.connections.on_refusal = self.openai.metrics.count_refusal
        app.on_startup.append(self._start_reaper)
        app.on_cleanup.append(self._stop)
        return app

    def site(self) -> GuardedSite:
        """The application behind guarded connections (count, time-outs); serve it with
        `start(host, port, ssl_context)` or `run_until_signalled(...)`."""
        return GuardedSite(self.build_app(), self.connections)

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            return error_response(exc)
        except ProtocolError as exc:
            return error_response(APIError(400, str(exc), None, "bad_request"))
        except web.HTTPException as exc:
            response = error_response(APIError(exc.status, exc.reason, None, "http"))
            if "Allow" in exc.headers:  # a 405 names the methods the route takes (RFC 9110)
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except ModelFailed:
            return error_response(APIError(500, "the model failed on this request; its session was closed", None, "internal"))
        except Exception:  # a bug must not take the server down; logged with its traceback, no request content
            logger.exception("internal error on %s %s", request.method, request.path)
            if request.writer.output_size > 0:  # a stream began: no response can follow; the connection is cut
                raise  # (GuardedHandler.handle_error drops it, so the client sees the stream end unfinished)
            return error_response(APIError(500, "internal error", None, "internal"))

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():  # the scheme is case-insensitive (RFC 9110)
            raise HTTPError(401, "unauthorized", "missing API key (send 'Authorization: Bearer <key>')")
        # aiohttp reads header bytes that are not UTF-8 as lone surrogates: encoded back to those bytes
        presented = credentials.strip().encode("utf-8", "surrogateescape")
        matches = [hmac.compare_digest(presented, key) for key in self.api_keys]  # no short circuit
        if not any(matches):
            raise HTTPError(401, "unauthorized", "invalid API key")
        request[KEY_INDEX] = matches.index(True)
        return await handler(request)

    # -- handlers ---------------------------------------------------------------------------------
    async def _info(self, request: web.Request) -> web.StreamResponse:
        return _reply(request, self.info)

    async def _open(self, request: web.Request) -> web.StreamResponse:
        """Idempotent per (key, request_id): a retried open (its reply was lost or late) gets the
        same session instead of a new one; the same id with another body is a 409."""
        body = await read_body(request, self.limits.body_timeout_s)
        message = wire.loads(body, request.content_type)
        request_id = message.get("request_id")
        if not isinstance(request_id, str) or not 8 <= len(request_id) <= 64:
            raise ProtocolError("'request_id' must be a string of 8..64 characters")
        ident, digest = (request[KEY_INDEX], request_id), _message_digest(message)
        if ident in self.opening:
            earlier, earlier_digest = self.opening[ident]
            if earlier_digest != digest:
                raise HTTPError(409, "request_id_reused", "this request_id was used by another open request")
            return _reply(request, await asyncio.shield(earlier))
        if ident in self.ended_opens:
            raise HTTPError(409, "request_id_reused", "this request_id opened a session that was closed; open with a new one")
        self.opening[ident] = (asyncio.get_running_loop().create_future(), digest)
        try:
            reply = await self._open_session(request, message, ident)
        except BaseException as exc:
            pending = self.opening.pop(ident)[0]
            if isinstance(exc, Exception):
                pending.set_exception(exc)
                pending.exception()  # retrieved: a retry waiting on it gets it through its shield, else asyncio logs it
            else:
                pending.cancel()
            raise
        self.opening[ident][0].set_result(reply)
        return _reply(request, reply)

    async def _open_session(self, request: web.Request, message: dict, ident: tuple[int, str]) -> dict:
        version = wire.get_int(message, "version", 0, 1 << 16)
        if version != wire.PROTOCOL_VERSION:
            raise HTTPError(400, "version", f"protocol version {version} is not supported (server: {wire.PROTOCOL_VERSION})")
        vocab, limit = self.target.vocab_size, self.limits
        given = message.get("prompt_ids")
        if isinstance(given, list) and len(given) >= self.target.max_positions:  # as the OpenAI routes answer it
            raise HTTPError(
                413, "context_length_exceeded", f"the prompt has {len(given)} tokens but the model's context holds "
                f"{self.target.max_positions}, the answer's first token included: at most {self.target.max_positions - 1}",
            )
        prompt = wire.get_ids(message, "prompt_ids", vocab, 1, self.target.max_positions - 1)
        try:
            sampling = SamplingConfig(
                temperature=wire.get_float(message, "temperature", 0.0, 100.0, 0.0),
                top_k=wire.get_int(message, "top_k", 0, vocab, 0),
                top_p=wire.get_float(message, "top_p", 0.0, 1.0, 1.0),
            )
        except MoaspecError as exc:
            raise ProtocolError(str(exc)) from exc
        seed = wire.get_int(message, "seed", 0, 2**64 - 1, 0)
        max_new = wire.get_int(message, "max_new_tokens", 1, limit.max_new_tokens, 256)
        root_id = message.get("root_id")
        if root_id is not None:
            root_id = wire.get_int(message, "root_id", 0, vocab - 1)
        context_from = wire.get_int(message, "context_from", 0, len(prompt), 0)
        prompt_len = message.get("prompt_len")
        if prompt_len is not None:
            if root_id is None:
                raise ProtocolError("'prompt_len' is only for a resume (with 'root_id')")
            prompt_len = wire.get_int(message, "prompt_len", 1, len(prompt))
        context_dtype = wire.get_choice(message, "context_dtype", wire.CONTEXT_DTYPES, "f16")
        has_stop_ids = message.get("stop_ids") is not None  # absent or null alike, as root_id
        stop_ids = frozenset(wire.get_ids(message, "stop_ids", vocab, 0, wire.MAX_STOP_IDS)) if has_stop_ids else frozenset()
        reservation = self._reserve(request[KEY_INDEX], len(prompt) + max_new)
        try:
            done = await self._prefill(reservation, prompt, sampling, seed, root_id, prompt_len, context_from, context_dtype)
        except BaseException:
            self.budget.release(reservation)
            raise
        session_id = secrets.token_urlsafe(16)
        self.sessions[session_id] = _Session(
            reservation.key_index, done.target_session, context_dtype, max_new, done.first_token, ident, reservation,
            stop_ids=stop_ids, last_used=time.monotonic(),
        )
        return {"session_id": session_id, "next_token": done.first_token, "start_pos": context_from, "context": done.context,
                "server_s": done.server_s}

    async def _prefill(
        self, reservation: Reservation, prompt: list[int], sampling: SamplingConfig, seed: int, root_id: int | None,
        prompt_len: int | None, context_from: int, context_dtype: str,
    ) -> _Prefilled:
        """A new session's target state: prefill (or resume) on the worker, in a target this key
        left idle (keeping what the prompt shares with it), another key's emptied, or a new one
        sized to the session's reservation (prompt + max_new_tokens)."""
        positions = reservation.num_tokens
        kept = self.idle.take(reservation.key_index, positions)
        session_target, must_reset = kept if kept is not None else (self.target.new_session(positions), False)
        verifier_seed = seed if root_id is None else resumed_seed(seed, len(prompt))
        target_session = TargetSession(session_target, self.encoder.hidden_layers, sampling, verifier_seed)
        prompt_ids = torch.tensor(prompt)
        # set when the server's shutdown time-out cuts this open: its prefill stops at the next chunk
        # (a client that left does not stop it: its retry of the same open waits for this one)
        cancel = threading.Event()

        def prefill() -> tuple[int, dict]:
            with session_target.cancellable(cancel):
                if must_reset:
                    session_target.reset()
                if root_id is None:
                    first, update = target_session.prefill(prompt_ids)
                else:
                    first, update = root_id, target_session.resume(prompt_ids, prompt_len)
            context = {k: v[context_from:] for k, v in self.encoder.encode(update).items()}
            return first, wire.encode_context(context, context_dtype)

        started = time.perf_counter()
        try:
            first, context = await self._compute(prefill)
        except asyncio.CancelledError:
            cancel.set()
            raise
        return _Prefilled(first, target_session, context, time.perf_counter() - started)

    async def _verify(self, request: web.Request) -> web.StreamResponse:
        message = await self._read(request)  # in full before the session is touched: a cut upload changes nothing
        finished = self._finished(request)
        if finished is not None and wire.get_int(message, "seq", 0, 1 << 40) == finished.seq:
            return _reply(request, finished.reply)  # a retry of the verify that closed it: same answer
        session = self._session(request)
        async with session.lock:
            return await self._verify_locked(request, session, message)

    async def _verify_locked(self, request: web.Request, session: _Session, message: dict) -> web.StreamResponse:
        seq = wire.get_int(message, "seq", 0, 1 << 40)
        if seq == session.next_seq - 1 and session.last_reply is not None:
            return _reply(request, session.last_reply)  # a retry after a lost reply: same answer
        if seq != session.next_seq:
            raise HTTPError(409, "out_of_order", f"expected request seq {session.next_seq}, got {seq}")
        tree = wire.parse_tree(
            message, self.target.vocab_size, self.limits.max_tree_nodes, self.info["max_tree_leaves"],
            self.limits.max_draft_prob_entries,
        )
        if int(tree.token_ids[0]) != session.root_id:
            raise HTTPError(409, "wrong_root", "the tree's root is not the last token this session emitted")
        depth = int(depths(tree.parents).max())
        # emitted so far: num_verified + 1 (the open's token counts); this tree adds up to depth + 1
        left = session.max_new_tokens - session.num_verified - 1
        if depth + 1 > left:
            budget = f"the session's budget of {session.max_new_tokens} new tokens"
            if left == 0:
                raise HTTPError(400, "too_many_tokens", f"{budget} is spent")
            tree_emits = f"a tree {depth} deep emits up to {depth + 1} tokens"
            raise HTTPError(400, "too_many_tokens", f"{tree_emits}; {budget} leaves {left}")
        if session.target_session.target.num_cached + depth + 1 > session.target_session.target.max_positions:
            raise HTTPError(400, "context_full", "the tree does not fit in the target's context")
        remaining = wire.get_int(message, "remaining", 1, 1 << 40) if "remaining" in message else None

        def verify() -> tuple[dict, bool]:
            """-> (the reply, whether this verify ends the generation)."""
            verified = session.target_session.verify(tree)
            accepted = verified.accepted
            context = self.encoder.encode(verified.update)
            emitted = [int(tree.token_ids[i]) for i in accepted.path_node_idx[1:]] + [accepted.next_token]
            last = None if remaining is None else last_emitted(emitted, remaining, session.stop_ids)
            if last is not None:
                # the context plain decoding would hold, as Engine.stream leaves it (the accepted path
                # may run past a stop token or the limit): a kept target's next session starts from it
                target = session.target_session.target
                target.rollback(target.num_cached - (len(emitted) - 1 - last))
            return {
                "seq": seq,
                "path_node_idx": accepted.path_node_idx,
                "next_token": accepted.next_token,
                "start_pos": verified.update.start_pos,
                "context": wire.encode_context(context, session.context_dtype),
            }, last is not None

        started = time.perf_counter()
        try:
            reply, ends = await self._compute(verify)
        except Exception as exc:  # its cache may be half-updated: the session cannot go on
            self._drop(request.match_info["session_id"], reusable=False)
            logger.exception("model failure on a verify; session closed")
            raise ModelFailed from exc
        reply["server_s"] = time.perf_counter() - started
        session.num_verified += len(reply["path_node_idx"])
        session.root_id = reply["next_token"]
        session.next_seq, session.last_reply, session.last_used = seq + 1, reply, time.monotonic()
        if ends:
            reply["closed"] = True  # the client is done: no DELETE round trip needed
            self._finish(request.match_info["session_id"], session, seq, reply)
        return _reply(request, reply)

    async def _close(self, request: web.Request) -> web.StreamResponse:
        session_id = request.match_info["session_id"]
        if self._finished(request) is not None:
            del self.finished[session_id]
        else:
            self._session(request)
            self._end(session_id)
        return _reply(request, {"closed": True})

    def _finish(self, session_id: str, session: _Session, seq: int, reply: dict) -> None:
        """Close a session its last verify finished, keeping that reply for a retry."""
        self._end(session_id)
        self.finished[session_id] = _Finished(session.key_index, seq, reply, time.monotonic())
        while len(self.finished) > self.limits.max_sessions:
            del self.finished[next(iter(self.finished))]

    def _reserve(self, key_index: int, num_tokens: int) -> Reservation:
        """The budget's reservation for a new session of this key; when the key's own share
        refuses it (429), the key's sessions idle STALE_SESSION_S or more (and not mid-request)
        are ended, least recently used first, until it fits."""
        while True:
            try:
                return self.budget.reserve(key_index, num_tokens)
            except APIError as exc:
                stale_before = time.monotonic() - STALE_SESSION_S
                stale = [
                    (session.last_used, session_id) for session_id, session in self.sessions.items()
                    if session.key_index == key_index and session.last_used < stale_before and not session.lock.locked()
                ]
                if exc.status != 429 or not stale:
                    raise
                self._drop(min(stale)[1])

    def _end(self, session_id: str) -> None:
        """End a session its client is done with (DELETE, or the verify that finished it): the
        client had the open's reply, so a duplicate of that open arriving later is refused. (A
        session the reaper expires is not remembered: its client may still be retrying the open.)"""
        session = self.sessions.get(session_id)
        if session is not None:
            self.ended_opens[session.open_ident] = time.monotonic()
            while len(self.ended_opens) > ENDED_OPENS:
                del self.ended_opens[next(iter(self.ended_opens))]
        self._drop(session_id)

    def _drop(self, session_id: str, reusable: bool = True) -> None:
        """End a session; its target is kept for the next ones (IdleTargets) unless `reusable` is
        False (a model failure may have left its cache half-updated)."""
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self.opening.pop(session.open_ident, None)
            self.budget.release(session.reservation)
            if reusable:
                self.idle.put(session.key_index, session.target_session.target)

    # -- helpers ------------------------------------------------------------------------------------
    def _finished(self, request: web.Request) -> _Finished | None:
        """The request's session if its last verify closed it and it is this key's, else None."""
        finished = self.finished.get(request.match_info["session_id"])
        return finished if finished is not None and finished.key_index == request[KEY_INDEX] else None

    def _session(self, request: web.Request) -> _Session:
        session = self.sessions.get(request.match_info["session_id"])
        # another key's session is reported exactly like a missing one
        if session is None or session.key_index != request[KEY_INDEX]:
            raise HTTPError(404, "no_session", "no such session (expired, closed or the server restarted)")
        return session

    async def _read(self, request: web.Request) -> dict:
        body = await read_body(request, self.limits.body_timeout_s)
        return wire.loads(body, request.content_type)

    async def _compute(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn)

    async def _start_reaper(self, app: web.Application) -> None:
        app[REAPER] = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        period = max(0.05, min(5.0, self.limits.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            deadline = time.monotonic() - self.limits.idle_timeout_s
            for session_id in [k for k, s in self.sessions.items() if s.last_used < deadline]:
                self._drop(session_id)
            for session_id in [k for k, f in self.finished.items() if f.closed_at < deadline]:
                del self.finished[session_id]
            for ident in [k for k, ended in self.ended_opens.items() if ended < deadline]:
                del self.ended_opens[ident]
            self.idle.expire(deadline)

    async def _stop(self, app: web.Application) -> None:
        app[REAPER].cancel()
        self.sessions.clear()
        self.idle.clear()
        self.finished.clear()
        self.opening.clear()
        self.ended_opens.clear()
        self.budget.clear()


def _reply(request: web.Request, message: dict) -> web.Response:
    content_type = wire.MSGPACK if wire.MSGPACK in request.headers.get("Accept", "") or request.content_type == wire.MSGPACK else wire.JSON
    return web.Response(body=wire.dumps(message, content_type), content_type=content_type)


class ServerThread(LoopThread):
    """A server on a loopback port in a background thread (tests, benchmarks): start() / stop()."""

    thread_name = "moaspec-serve"
    start_error = MoaspecError
    start_message = "the server did not start in time"

    def __init__(
        self, server: SplitServer, host: str = "127.0.0.1", port: int = 0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.server, self.host, self.port, self.ssl_context = server, host, port, ssl_context
        super().__init__()

    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        site = self.server.site()
        self.port = await site.start(self.host, self.port, self.ssl_context)
        self._ready.set()
        await self._stop_event.wait()
        await site.stop()


def _message_digest(message: dict) -> bytes:
    """A digest of a request's content, not of its bytes: a retry that encodes the same message
    differently (JSON spacing, key order, msgpack) is the same request."""
    canonical = json.dumps(message, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(canonical.encode()).digest()
