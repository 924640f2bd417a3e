"""The OpenAI-compatible HTTP API on the `moaspec serve` application, decoding speculatively.

    GET  /v1/models, /v1/models/{model}     the target, by its name (e.g. smollm2-135m)
    POST /v1/completions                    raw prompt (string or token ids), no chat template
    POST /v1/chat/completions               messages through the target's chat template
    GET  /health                            liveness + queue state
    GET  /metrics                           Prometheus text format

`add_openai_routes` adds these to the split server's aiohttp application (moaspec/split/server.py),
so they share its API-key check, TLS, body-size limit and its single model worker thread.

Invariants:
- one generation holds the model at a time (the engine has batch size 1); others wait in a
  bounded queue (`OpenAILimits.max_waiting`, then 429). Each engine step (one draft tree +
  one target forward) is a separate job on the worker thread, so split sessions interleave with
  generations, and the client connection is checked between steps and every CLIENT_POLL_S
  during one: a client that disconnects stops its generation within one step, or its prompt's
  prefill part-way (Target.cancellable), and frees its slot.
- greedy output equals in-process `Engine` / `moaspec generate` output for the same target and
  drafter; sampling draws from the target's distribution with the request's seed.
- every refusal is OpenAI's error JSON {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from aiohttp import web

from moaspec.calibration.busy_machine import busy_machine_note
from moaspec.chat import encode_chat_messages
from moaspec.drafters.base import Drafter
from moaspec.engine import Engine, GenerationResult
from moaspec.errors import first_line
from moaspec.openai_api import schemas, validation
from moaspec.openai_api.metrics import CONTENT_TYPE, ServerMetrics
from moaspec.openai_api.queue import AdmissionQueue, ClientGone, QueueFull, ShuttingDown
from moaspec.openai_api.streaming import DONE, TextStream, sse
from moaspec.openai_api.validation import ChatRequest, CompletionRequest, GenerationJob
from moaspec.serving.errors import APIError, error_body, error_response
from moaspec.serving.http_body import read_body
from moaspec.serving.identity import drafter_fingerprint, drafter_form
from moaspec.serving.limits import OpenAILimits, ServerLimits
from moaspec.targets.base import PrefillCancelled, Target

if TYPE_CHECKING:
    from moaspec.calibration.plan import Calibration
    from moaspec.metrics import SpecStats

CLIENT_CLOSED = 499  # nginx's "client closed request": logged and counted, never seen by the client
# set on a request whose stream was cut by its client leaving: counted as CLIENT_CLOSED, not 200
STREAM_LEFT = web.RequestKey("stream_left", bool)
CLIENT_POLL_S = 0.1  # while a step runs (a long prefill), how often the client's connection is checked
BUSY_NOTE_EVERY_S = 600.0  # the busy-machine note is logged at most this often while it holds
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
logger = logging.getLogger("moaspec.serve")


def add_openai_routes(
    app: web.Application,
    target: Target,
    drafter: Drafter,
    worker: ThreadPoolExecutor,
    max_new_tokens: int,
    limits: OpenAILimits | None = None,
    body_timeout_s: float = ServerLimits.body_timeout_s,
    calibration: Calibration | None = None,
) -> OpenAIRoutes:
    """Register the OpenAI routes and a request-metrics middleware on `app` (before it starts).

    worker: the single thread that runs all model work; max_new_tokens: per-request cap;
    body_timeout_s: how long a request body may take to arrive; calibration: the machine
    calibration that chose `drafter`, if one did (a generation far slower than it predicts is
    logged: calibration/busy_machine.py)."""
    routes = OpenAIRoutes(target, drafter, worker, max_new_tokens, limits or OpenAILimits(), body_timeout_s, calibration)
    routes.register(app)
    return routes


class OpenAIRoutes:
    def __init__(
        self, target: Target, drafter: Drafter, worker: ThreadPoolExecutor, max_new_tokens: int, limits: OpenAILimits,
        body_timeout_s: float = ServerLimits.body_timeout_s, calibration: Calibration | None = None,
    ) -> None:
        # Own cache over the shared weights, as split sessions have; the drafter is the server's.
        self.target = target.new_session()
        self.tokenizer = target.tokenizer
        self.engine = Engine(self.target, drafter)
        self.worker = worker
        self.max_new_tokens = max_new_tokens
        self.body_timeout_s = body_timeout_s
        self.model_id = target.name
        self.drafter = drafter_form(drafter)
        self.fingerprint = f"moaspec-{self.drafter}-{drafter_fingerprint(drafter)[:8]}"
        self.created = int(time.time())
        self.queue = AdmissionQueue(limits.max_waiting)
        self.metrics = ServerMetrics(lambda: self.queue.waiting, lambda: self.queue.active, limits.max_waiting)
        self.calibration = calibration
        self.busy_logged_at: float | None = None  # time.monotonic() of the last busy-machine note

    def register(self, app: web.Application) -> None:
        app.middlewares.insert(0, self._count)  # outermost: sees every final status, 401s included
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_shutdown.append(self._shut_down)

    async def _shut_down(self, app: web.Application) -> None:
        """The server is stopping (Ctrl-C, SIGTERM): waiting generations get 503 now, new ones
        too; running ones may finish within the shutdown time-out."""
        self.queue.close()

    # -- middleware ---------------------------------------------------------------------------------
    @web.middleware
    async def _count(self, request: web.Request, handler) -> web.StreamResponse:
        """Counts every final status; logs each refusal (4xx, 503) in one line: method, route, status
        and code, never the request's content."""
        started, status, code = time.perf_counter(), 500, None
        try:
            response = await handler(request)
            status, code = response.status, getattr(response, "code", None)
            if request.get(STREAM_LEFT):
                status = CLIENT_CLOSED
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            route = _route_label(request)
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
            if status == CLIENT_CLOSED:
                logger.info("client left %s %s", request.method, route)
            elif 400 <= status < 500 or status == 503:  # 503: too many connections, shutting down
                logger.info("refused %s %s: %d %s", request.method, route, status, code or "")

    # -- small routes -----------------------------------------------------------------------------
    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "moaspec"}

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["model"] != self.model_id:
            return error_response(APIError(404, f"the model '{request.match_info['model']}' does not exist", "model", "model_not_found"))
        return web.json_response(self._model_card())

    async def _health(self, request: web.Request) -> web.StreamResponse:
        queue = {"active": self.queue.active, "waiting": self.queue.waiting, "max_waiting": self.queue.max_waiting}
        return web.json_response({"status": "ok", "model": self.model_id, "drafter": self.drafter, "queue": queue})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    # -- generation routes ------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request, chat=False)
            prompt = validation.completion_prompt(body, self.target.vocab_size)
            if isinstance(prompt, str):
                prompt = await self._encode(lambda: list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]))
            return await self._generate(request, self._job(body, prompt), "completions")
        except APIError as exc:
            return error_response(exc)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request, chat=True)
            messages = validation.chat_messages(body)
            prompt = await self._encode(lambda: encode_chat_messages(self.tokenizer, messages))
            return await self._generate(request, self._job(body, prompt), "chat")
        except APIError as exc:
            return error_response(exc)

    async def _body(self, request: web.Request, chat: bool) -> CompletionRequest | ChatRequest:
        body = validation.parse_body(await read_body(request, self.body_timeout_s))
        validation.check_model(body, self.model_id)
        if self.tokenizer is None:
            raise APIError(503, "this server's target has no tokenizer", None, "no_tokenizer")
        return validation.parse_request(body, chat)

    async def _encode(self, encode) -> list[int]:
        """Tokenise off the event loop (not on the model worker: it may be busy generating)."""
        from jinja2 import TemplateError

        try:
            return await asyncio.get_running_loop().run_in_executor(None, encode)
        except TemplateError as exc:  # e.g. a chat template that refuses the roles' order: its author's message
            reason = first_line(exc, limit=200, empty="refused")
            raise APIError(400, f"the chat template refused these messages: {reason}", "messages", "invalid_prompt") from None
        except Exception:  # noqa: BLE001  the tokenizer's own errors are its internals, not a reason for the client
            raise APIError(400, "the target's tokenizer cannot encode this prompt", None, "invalid_prompt") from None

    def _job(self, body: CompletionRequest | ChatRequest, prompt_ids: list[int]) -> GenerationJob:
        chat, context = isinstance(body, ChatRequest), self.target.max_positions
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", "messages" if chat else "prompt", "invalid_value")
        if len(prompt_ids) >= context:
            raise APIError(413, f"the prompt has {len(prompt_ids)} tokens but the model's context holds {context}, "
                           f"the answer's first token included: at most {context - 1}",
                           "messages" if chat else "prompt", "context_length_exceeded")
        return validation.parse_job(body, prompt_ids, self.max_new_tokens, context - len(prompt_ids))

    async def _generate(self, request: web.Request, job: GenerationJob, endpoint: str) -> web.StreamResponse:
        # Created (not started) before taking a slot: a refusal here cannot leak the slot.
        generation = _Generation(self.engine, self.worker, self.tokenizer, job)
        queued = time.perf_counter()
        try:
            await self.queue.acquire(lambda: _client_gone(request))
        except QueueFull as exc:
            raise APIError(429, f"the server is busy: {exc}", None, "queue_full") from None
        except ShuttingDown:
            raise APIError(503, "the server is shutting down", None, "shutting_down") from None
        except ClientGone:
            self.metrics.generations.labels(endpoint, "cancelled").inc()
            return web.Response(status=CLIENT_CLOSED)
        wait_s = time.perf_counter() - queued
        self.metrics.queue_wait.observe(wait_s)
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))
        finish = "error"
        try:
            run = self._stream if job.stream else self._complete
            response = await run(request, job, generation, wait_s)
            finish = generation.finish_reason or "cancelled"
            return response
        except (ClientGone, ConnectionError):
            finish = "cancelled"
            return web.Response(status=CLIENT_CLOSED)
        finally:
            generation.close()  # queued on the worker, so it runs before the next generation's steps
            self.queue.release()
            self.metrics.generations.labels(endpoint, finish).inc()
            self.metrics.record_stats(generation.result.stats)
            self.metrics.generation_s.observe(time.perf_counter() - queued - wait_s)
            self._log_a_busy_machine(generation.result.stats)

    def _log_a_busy_machine(self, stats: SpecStats) -> None:
        """Logs the busy-machine note of a generation that has one, at most every BUSY_NOTE_EVERY_S."""
        note = busy_machine_note(stats, self.calibration, self.target)
        now = time.monotonic()
        if note is None or (self.busy_logged_at is not None and now - self.busy_logged_at < BUSY_NOTE_EVERY_S):
            return
        self.busy_logged_at = now
        logger.warning("%s", note)

    async def _complete(self, request: web.Request, job: GenerationJob, generation: _Generation, wait_s: float) -> web.StreamResponse:
        started = time.perf_counter()
        while generation.finish_reason is None:
            if _client_gone(request):
                raise ClientGone
            await self._next_delta(request, generation, started)
        body = schemas.response_body(
            job, schemas.new_id(job.chat), self.model_id, self.fingerprint, generation.text.released,
            generation.finish_reason, self._usage(job, generation), self._extension(generation, wait_s),
        )
        return web.json_response(body)

    async def _stream(self, request: web.Request, job: GenerationJob, generation: _Generation, wait_s: float) -> web.StreamResponse:
        rid, started = schemas.new_id(job.chat), time.perf_counter()
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)

        def chunk(text: str | None, finish_reason: str | None = None, first: bool = False) -> dict:
            return schemas.chunk_body(job, rid, self.model_id, self.fingerprint, text, finish_reason, first)

        if job.chat:
            await response.write(sse(chunk(None, first=True)))
        try:
            while generation.finish_reason is None:
                if _client_gone(request):
                    raise ClientGone
                delta = await self._next_delta(request, generation, started)
                if delta:
                    await response.write(sse(chunk(delta)))
        except (ClientGone, ConnectionError):
            request[STREAM_LEFT] = True
            return response  # headers already sent: end quietly; counted as a cancelled generation
        except Exception:  # noqa: BLE001  headers are sent: report in-band, as OpenAI does, then end the stream
            logger.exception("generation failed mid-stream")
            await response.write(sse(error_body(500, "generation failed (internal error)", None, "internal")))
            await response.write(DONE)
            await response.write_eof()
            return response
        extension = self._extension(generation, wait_s)
        await response.write(sse({**chunk(None, generation.finish_reason), "moaspec": extension}))
        if job.include_usage:
            await response.write(sse(schemas.usage_chunk(job, rid, self.model_id, self.fingerprint, self._usage(job, generation), extension)))
        await response.write(DONE)
        await response.write_eof()
        return response

    async def _next_delta(self, request: web.Request, generation: _Generation, started: float) -> str:
        """One engine step's newly released text. The first non-empty one times the first token
        (the `time_to_first_token_s` field and the histogram), for both response kinds alike: a
        token whose text is held back (an unfinished character, a possible stop-sequence start)
        does not count until its text is released, and a generation releasing none has no time."""
        delta = await generation.next_delta(lambda: _client_gone(request))
        if delta and generation.first_token_s is None:
            generation.first_token_s = time.perf_counter() - started
            self.metrics.ttft.observe(generation.first_token_s)
        return delta

    def _usage(self, job: GenerationJob, generation: _Generation) -> dict:
        return schemas.usage(len(job.prompt_ids), len(generation.result.token_ids))

    def _extension(self, generation: _Generation, wait_s: float) -> dict:
        """The `moaspec` object: τ and speed of this generation (moaspec/metrics.py conventions)."""
        return {
            "drafter": self.drafter,
            **generation.result.stats.to_dict(),
            "stop_reason": "stop_sequence" if generation.text.stopped else generation.result.stop_reason,
            "queue_s": round(wait_s, 4),
            "time_to_first_token_s": None if generation.first_token_s is None else round(generation.first_token_s, 4),
        }


class _Generation:
    """One request's engine stream, advanced one step per worker job."""

    def __init__(self, engine: Engine, worker: ThreadPoolExecutor, tokenizer, job: GenerationJob) -> None:
        self.result = GenerationResult()
        self.worker = worker
        self.cancel = threading.Event()  # set when the client leaves during a step: stops a long prefill
        self._steps = engine.stream(list(job.prompt_ids), job.sampling, job.generation, result=self.result, cancel=self.cancel)
        self.text = TextStream(tokenizer, job.stop)
        self.finish_reason: str | None = None  # "stop" | "length" once over
        self.first_token_s: float | None = None

    async def next_delta(self, client_gone: Callable[[], bool]) -> str:
        """Run one engine step on the worker; the newly releasable text. While it runs the client's
        connection is checked every CLIENT_POLL_S: one that left stops the prompt's prefill
        (ClientGone)."""
        step = asyncio.get_running_loop().run_in_executor(self.worker, next, self._steps, None)
        while not step.done():
            try:
                await asyncio.wait([step], timeout=CLIENT_POLL_S)
            except asyncio.CancelledError:  # the request was cut (the server's shutdown time-out)
                self.cancel.set()
                raise
            if not step.done() and client_gone():
                self.cancel.set()
        try:
            new_ids = step.result()
        except PrefillCancelled:
            raise ClientGone from None
        if new_ids is None:  # the engine finished: stop token, max_tokens or the context
            self.finish_reason = "stop" if self.result.stop_reason == "stop_token" else "length"
            return self.text.update(self.result.token_ids, final=True)
        delta = self.text.update(self.result.token_ids)
        if self.text.stopped:
            self.finish_reason = "stop"
        return delta

    def close(self) -> None:
        """End the engine stream on the worker thread (a step may still be running there)."""
        self.worker.submit(self._steps.close)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _route_label(request: web.Request) -> str:
    """The route a request was for, as a bounded label: the matched route's path pattern; for a
    method the route does not take (405, which matches no route), the route of that path;
    "other" for no route at all."""
    resource = request.match_info.route.resource
    if resource is not None:
        return resource.canonical
    for candidate in request.app.router.resources():
        info = candidate.get_info()
        pattern = info.get("pattern")
        if info.get("path") == request.path or (pattern is not None and pattern.fullmatch(request.path)):
            return candidate.canonical
    return "other"
