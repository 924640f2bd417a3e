"""The clients and servers that `moaspec bench --client-server` measures
(moaspec/bench/client_server_runner.py).

- `SplitCase`: the split client (moaspec/split/generator.py) with a local drafter;
- `StreamCase`: a plain OpenAI SSE client of `/v1/completions` (the prompt as token ids), reading
  the text deltas and the server's `moaspec` extension of the final chunk;
- `LoopbackServers`: one `SplitServer` per method on a loopback port (`none`, the plain baseline,
  first), all over the weights of one loaded target, plus the client's copy of every drafter.
Each case talks to its server through its own `NetemProxy`, which counts the bytes of both
directions; a case's numbers are the differences around one generation.
"""

from __future__ import annotations

import http.client
import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, Self

from moaspec.bench.runner import BASELINE
from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.drafters.base import Drafter, SplitDrafter
from moaspec.drafters.none import NoDrafter
from moaspec.errors import MoaspecError
from moaspec.serving.limits import ServerLimits
from moaspec.split.client import SplitClient
from moaspec.split.generator import SplitGenerator, SplitOptions
from moaspec.split.netem import NetemProxy
from moaspec.split.server import ServerThread, SplitServer
from moaspec.targets.base import Target

SPLIT, SERVER = "split", "server"  # where the drafting happens: client (split) or server (streamed)
CLIENT_TIMEOUT_S = 120.0  # per request; a 3g link with a long prompt still answers well within it

DrafterFactory = Callable[[Target], Drafter]


@dataclass(frozen=True)
class CaseRun:
    """One generation, as the client saw it."""

    text: str
    new_tokens: int
    wall_s: float  # request sent -> last token received
    first_token_s: float  # request sent -> first token received
    num_calls: int  # HTTP requests to the server
    num_bytes: int  # through the proxy, both directions
    target_forwards: int
    forward_tokens: int  # tau = forward_tokens / target_forwards


# -- the cases --------------------------------------------------------------------------------------
class Case(Protocol):
    method: str
    mode: str

    def run(self, prompt_ids: tuple[int, ...], sampling: SamplingConfig, max_new_tokens: int, seed: int) -> CaseRun: ...

    def close(self) -> None: ...


class SplitCase:
    """Draft on the client, verify on the server: one round trip per verification."""

    mode = SPLIT

    def __init__(self, method: str, proxy: NetemProxy, key: str, drafter: SplitDrafter, target: Target,
                 options: SplitOptions = SplitOptions()) -> None:
        self.method, self.proxy, self.target, self.drafter = method, proxy, target, drafter
        self.fixed_tree = getattr(drafter, "tree_config", None)  # adaptive trees change it: restored on close
        self.client = SplitClient(f"http://127.0.0.1:{proxy.port}", key, timeout_s=CLIENT_TIMEOUT_S)
        self.generator = SplitGenerator(self.client, drafter, options)

    def run(self, prompt_ids: tuple[int, ...], sampling: SamplingConfig, max_new_tokens: int, seed: int) -> CaseRun:
        calls, num_bytes = self.client.stats.calls, _link_bytes(self.proxy)
        generation = GenerationConfig(max_new_tokens=max_new_tokens, seed=seed)
        result = self.generator.generate(list(prompt_ids), sampling, generation, self.target.stop_ids)
        stats = result.stats
        return CaseRun(
            self.target.tokenizer.decode(result.token_ids, skip_special_tokens=True),
            stats.new_tokens,
            stats.wall_s,
            result.first_token_s,
            self.client.stats.calls - calls,
            _link_bytes(self.proxy) - num_bytes,
            stats.target_forwards,
            stats.forward_tokens,
        )

    def close(self) -> None:
        if self.fixed_tree is not None:
            self.drafter.tree_config = self.fixed_tree
        self.client.drop_connection()
        self.proxy.stop()


class StreamCase:
    """Generate on the server, stream the text to the client (OpenAI SSE on /v1/completions,
    the prompt sent as token ids so every case sees the same prompt)."""

    mode = SERVER

    def __init__(self, method: str, proxy: NetemProxy, key: str, model_id: str) -> None:
        self.method, self.proxy, self.key, self.model_id = method, proxy, key, model_id
        self.connection = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=CLIENT_TIMEOUT_S)

    def run(self, prompt_ids: tuple[int, ...], sampling: SamplingConfig, max_new_tokens: int, seed: int) -> CaseRun:
        body = {
            "model": self.model_id,
            "prompt": list(prompt_ids),
            "max_tokens": max_new_tokens,
            "stream": True,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": seed,
        }
        num_bytes, started = _link_bytes(self.proxy), time.perf_counter()
        pieces: list[str] = []
        first_token_s, extension = None, None
        for event in self._events(body):
            text = event["choices"][0]["text"] if event.get("choices") else ""
            if text and first_token_s is None:
                first_token_s = time.perf_counter() - started
            pieces.append(text)
            extension = event.get("moaspec", extension)
        wall_s = time.perf_counter() - started
        if extension is None:
            raise MoaspecError("the server's stream ended without its final chunk")
        forwards = int(extension["target_forwards"])
        return CaseRun(
            "".join(pieces),
            int(extension["new_tokens"]),
            wall_s,
            wall_s if first_token_s is None else first_token_s,
            1,
            _link_bytes(self.proxy) - num_bytes,
            forwards,
            round(float(extension["tau"]) * forwards),
        )

    def _events(self, body: dict) -> Iterator[dict]:
        """The JSON payloads of one streamed request, up to `data: [DONE]`."""
        headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        payload = json.dumps(body).encode()
        try:
            self.connection.request("POST", "/v1/completions", body=payload, headers=headers)
            response = self.connection.getresponse()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            # the server closed the kept-alive connection while other cases ran (its keep-alive
            # timeout): open a new one, as an HTTP client library would, and send again
            self.connection.close()
            self.connection.request("POST", "/v1/completions", body=payload, headers=headers)
            response = self.connection.getresponse()
        if response.status != 200:
            raise MoaspecError(
                f"the server refused the stream ({response.status}): {response.read()[:200].decode(errors='replace')}"
            )
        while line := response.readline():
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                raise MoaspecError(f"the server's stream failed: {event['error'].get('message')}")
            yield event
        response.read()  # the end of the chunked body, so the connection is reused

    def close(self) -> None:
        self.connection.close()
        self.proxy.stop()


def _link_bytes(proxy: NetemProxy) -> int:
    return proxy.bytes_up + proxy.bytes_down


def target_view(target: Target) -> Target:
    """Another adapter over the same weights, with its own cache."""
    return target.new_session()


# -- the servers ----------------------------------------------------------------------------------
class LoopbackServers:
    """One `SplitServer` per method (`none` first) on loopback, plus the client's copy of each
    drafter; a context manager that stops them all."""

    def __init__(self, target: Target, drafters: dict[str, DrafterFactory], limits: ServerLimits) -> None:
        self.target, self.key = target, secrets.token_urlsafe(24)
        self.servers: dict[str, ServerThread] = {}
        self.client_drafters: dict[str, SplitDrafter] = {}
        try:
            for method, make in {BASELINE: NoDrafter.for_target, **drafters}.items():
                served = target_view(target)  # the server's drafter announces its features to the target it serves
                server = SplitServer(served, make(served), [self.key], limits)
                self.servers[method] = ServerThread(server).start()
                if method != BASELINE:
                    self.client_drafters[method] = _split_drafter(method, make(target_view(target)))
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()

    def proxy(self, method: str, profile: str) -> NetemProxy:
        return NetemProxy("127.0.0.1", self.servers[method].port, profile).start()

    def cases(self, profile: str, options: SplitOptions = SplitOptions()) -> list[Case]:
        """`none` server, then split (with these client options) and server for each drafter
        method, each behind its own proxy."""
        cases: list[Case] = []
        try:
            for method in self.servers:
                if method != BASELINE:
                    drafter = self.client_drafters[method]
                    cases.append(SplitCase(method, self.proxy(method, profile), self.key, drafter, self.target, options))
                cases.append(StreamCase(method, self.proxy(method, profile), self.key, self.target.name))
        except BaseException:
            for case in cases:
                case.close()
            raise
        return cases


def _split_drafter(method: str, drafter: Drafter) -> SplitDrafter:
    if not hasattr(drafter, "accept_context") or not hasattr(drafter, "context_encoder"):
        raise MoaspecError(f"method '{method}': this drafter cannot run split (no context encoder)")
    return drafter  # type: ignore[return-value]
