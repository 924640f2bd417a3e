"""Client-server benchmark (to be wired into `moaspec bench --client-server`).

`run_split_bench` serves a target on loopback behind the network emulator and, per profile and
per split drafter, generates the prompts through the split client, reporting tokens/s, server
calls per 100 tokens, bytes per token (counted by the proxy, both directions, HTTP included) and
time to first token. `run_disconnection` cuts the link after N verified tokens, lets the drafter
continue alone for M tokens, and reports how many of them agree with the target's own
continuation (the in-process greedy output). Server-side streaming baselines ((c), (d) of
issue 6) need the streaming endpoint of issue 7 and are not measured here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.engine import Engine
from moaspec.split.client import SplitClient
from moaspec.split.generator import SplitGenerator, SplitOptions, SplitResult
from moaspec.split.netem import NetemProxy
from moaspec.split.server import ServerThread, SplitServer

BENCH_KEY = "moaspec-bench-loopback-key"


@dataclass(frozen=True)
class SplitBenchRow:
    profile: str
    drafter: str
    new_tokens: int
    tokens_per_s: float
    tau: float
    server_calls_per_100_tokens: float
    bytes_per_token: float
    time_to_first_token_s: float


@dataclass(frozen=True)
class DisconnectionRow:
    drafter: str
    cut_after: int
    num_offline: int  # tokens the drafter produced alone (M, or fewer if it had nothing)
    num_agreeing: int  # leading offline tokens equal to the target's own continuation
    agreement: float


def run_split_bench(
    target_factory: Callable[[], object],
    drafter_factories: dict[str, Callable[[object], object]],
    prompts: list[list[int]],
    profiles: tuple[str, ...] = ("lan", "5g", "4g", "3g"),
    max_new_tokens: int = 64,
    options: SplitOptions = SplitOptions(),
) -> list[SplitBenchRow]:
    """One row per (profile, drafter): totals over the prompts (greedy). The target factory is
    called twice per drafter (server copy, client copy for its frozen parts)."""
    rows = []
    for name, make_drafter in drafter_factories.items():
        server_target, client_target = target_factory(), target_factory()
        server = ServerThread(SplitServer(server_target, make_drafter(server_target), [BENCH_KEY])).start()
        client_drafter = make_drafter(client_target)
        try:
            for profile in profiles:
                rows.append(_bench_one(server.port, client_drafter, name, profile, prompts, max_new_tokens, options))
        finally:
            server.stop()
    return rows


def _bench_one(port: int, drafter, name: str, profile: str, prompts: list[list[int]], max_new: int, options: SplitOptions) -> SplitBenchRow:
    proxy = NetemProxy("127.0.0.1", port, profile).start()
    try:
        generator = SplitGenerator(SplitClient(f"http://127.0.0.1:{proxy.port}", BENCH_KEY, timeout_s=60.0), drafter, options)
        bytes_before = proxy.bytes_up + proxy.bytes_down
        tokens, forwards, calls, ttft, started = 0, 0, 0, 0.0, time.perf_counter()
        for prompt in prompts:
            calls_before = generator.client.stats.calls
            result = generator.generate(prompt, SamplingConfig(), GenerationConfig(max_new_tokens=max_new))
            tokens += len(result.token_ids)
            forwards += result.stats.target_forwards
            calls += generator.client.stats.calls - calls_before
            ttft += result.first_token_s
        wall = time.perf_counter() - started
        num_bytes = proxy.bytes_up + proxy.bytes_down - bytes_before
    finally:
        proxy.stop()
    return SplitBenchRow(
        profile, name, tokens, round(tokens / wall, 3), round(tokens / max(forwards, 1), 3),
        round(100.0 * calls / max(tokens, 1), 2), round(num_bytes / max(tokens, 1), 1), round(ttft / len(prompts), 4),
    )


def run_disconnection(
    target_factory: Callable[[], object],
    drafter_factories: dict[str, Callable[[object], object]],
    prompts: list[list[int]],
    cut_after: int = 16,
    offline_tokens: int = 16,
) -> list[DisconnectionRow]:
    """Greedy; per drafter, totals over the prompts. The reference continuation is in-process
    greedy decoding, which the split output equals whenever the link is up."""
    rows = []
    for name, make_drafter in drafter_factories.items():
        reference_target = target_factory()
        reference = Engine(reference_target, make_drafter(reference_target))
        server_target, client_target = target_factory(), target_factory()
        server = ServerThread(SplitServer(server_target, make_drafter(server_target), [BENCH_KEY])).start()
        client_drafter = make_drafter(client_target)
        num_offline = num_agreeing = 0
        try:
            for prompt in prompts:
                expected = reference.generate(prompt, generation=GenerationConfig(max_new_tokens=cut_after + offline_tokens + 8)).token_ids
                offline = _offline_continuation(server.port, client_drafter, prompt, cut_after, offline_tokens)
                start = len(offline[0])
                produced = offline[1]
                agree = 0
                for i, token in enumerate(produced):
                    if start + i >= len(expected) or expected[start + i] != token:
                        break
                    agree += 1
                num_offline += len(produced)
                num_agreeing += agree
        finally:
            server.stop()
        rows.append(DisconnectionRow(name, cut_after, num_offline, num_agreeing, round(num_agreeing / max(num_offline, 1), 4)))
    return rows


def _offline_continuation(port: int, drafter, prompt: list[int], cut_after: int, offline_tokens: int) -> tuple[list[int], list[int]]:
    """Generate through a proxy that is cut once `cut_after` tokens are verified and never
    restored; accept the offline output. -> (verified before the cut, offline tokens)."""
    proxy = NetemProxy("127.0.0.1", port, "lan").start()
    options = SplitOptions(max_provisional=offline_tokens, offline_deadline_s=0.5, accept_offline=True,
                           retry_initial_s=0.05, retry_max_s=0.1)
    try:
        generator = SplitGenerator(SplitClient(f"http://127.0.0.1:{proxy.port}", BENCH_KEY, timeout_s=5.0), drafter, options)
        result, before = SplitResult(), None
        generation = GenerationConfig(max_new_tokens=cut_after + offline_tokens + 8)
        for _ in generator.stream(prompt, SamplingConfig(), generation, frozenset(), result):
            if before is None and len(result.token_ids) >= cut_after:
                before = list(result.token_ids)
                proxy.cut("reset")
    finally:
        proxy.stop()
    before = before if before is not None else list(result.token_ids)
    return before, result.token_ids[len(before):]


def format_rows(rows: list) -> str:
    """A plain text table of dataclass rows."""
    if not rows:
        return ""
    dicts = [asdict(row) for row in rows]
    keys = list(dicts[0])
    widths = {k: max(len(k), *(len(str(d[k])) for d in dicts)) for k in keys}
    lines = ["  ".join(k.ljust(widths[k]) for k in keys)]
    lines += ["  ".join(str(d[k]).ljust(widths[k]) for k in keys) for d in dicts]
    return "\n".join(lines)
