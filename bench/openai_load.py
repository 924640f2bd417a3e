"""Load benchmark of the OpenAI-compatible server (issue 7): requests/s and latency percentiles
under N concurrent clients, server-side speculation vs plain decoding (`none`).

    # in-process servers on loopback, one per drafter (the target loads once):
    .venv/bin/python bench/openai_load.py --target smollm2-135m --drafters ngram,none \
        --clients 1,2,4 --requests 16 --max-tokens 64 --out bench/results/openai_load.json
    # or against a running `moaspec serve` (one drafter: the server's):
    .venv/bin/python bench/openai_load.py --url http://127.0.0.1:8000 --api-key-file key.txt --clients 1,4

Protocol: every client runs a closed loop (send a streaming chat request, read it to the end,
send the next) until the run's `--requests` are done; prompts are taken in order from the
MT-bench, translation, summarization and math sets of `moaspec bench` (request_prompts), so every
drafter and client count sees the same requests. One warm-up request per server is excluded.
Greedy by default. Latency = request sent -> `[DONE]`; TTFT = request sent -> first content chunk.
Every request has a timeout and the run a request count, so it always ends. Prints a markdown
table, then one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moaspec.bench.output import write_json
from moaspec.bench.prompts import load_prompts  # noqa: E402
from moaspec.bench.script_args import output_file, positive_int, positive_ints, run_script, script_parser, text_items

PROMPT_CATEGORIES = ("mt_bench", "translation", "summarization", "math")


def request_prompts(per_category: int = 4) -> list[str]:
    """First user turns of `moaspec bench` prompts, the categories interleaved (16 by default)."""
    by_category = load_prompts(PROMPT_CATEGORIES, per_category)
    return [prompt.turns[0] for group in zip(*by_category.values()) for prompt in group]


PROMPTS = request_prompts()


@dataclass
class Outcome:
    status: int
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    tau: float | None = None


@dataclass
class LoadRun:
    clients: int
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        ok = [o for o in self.outcomes if o.status == 200]
        latencies = sorted(o.latency_s for o in ok)
        ttfts = sorted(o.ttft_s for o in ok if o.ttft_s is not None)
        taus = [o.tau for o in ok if o.tau is not None]
        tokens = sum(o.completion_tokens for o in ok)
        return {
            "clients": self.clients,
            "requests": len(self.outcomes),
            "errors": len(self.outcomes) - len(ok),
            "statuses": sorted({o.status for o in self.outcomes}),
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(len(ok) / self.wall_s, 4) if self.wall_s else 0.0,
            "tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s else 0.0,
            "latency_s": {f"p{q}": round(percentile(latencies, q), 3) for q in (50, 90, 99)},
            "ttft_s": {f"p{q}": round(percentile(ttfts, q), 3) for q in (50, 90, 99)},
            "mean_tau": round(statistics.fmean(taus), 3) if taus else None,
        }


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an already sorted list; nan if empty."""
    if not sorted_values:
        return float("nan")
    rank = (len(sorted_values) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


async def one_request(session: aiohttp.ClientSession, base: str, model: str, prompt: str, args: argparse.Namespace) -> Outcome:
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
        "temperature": args.temperature, "seed": 0, "stream": True, "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    outcome = Outcome(status=0, latency_s=0.0)
    try:
        async with session.post(f"{base}/v1/chat/completions", json=body) as response:
            outcome.status = response.status
            if response.status == 200:
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content") and outcome.ttft_s is None:
                        outcome.ttft_s = time.perf_counter() - started
                    if chunk.get("usage"):
                        outcome.completion_tokens = chunk["usage"]["completion_tokens"]
                        outcome.tau = chunk.get("moaspec", {}).get("tau")
            else:
                await response.read()
    except (TimeoutError, aiohttp.ClientError):
        outcome.status = -1
    outcome.latency_s = time.perf_counter() - started
    return outcome


async def run_load(base: str, key: str, model: str, clients: int, args: argparse.Namespace, ssl=None) -> LoadRun:
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    headers = {"Authorization": f"Bearer {key}"}
    run = LoadRun(clients)
    next_index = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < args.requests:
            prompt = PROMPTS[next_index % len(PROMPTS)]
            next_index += 1
            run.outcomes.append(await one_request(session, base, model, prompt, args))

    connector = aiohttp.TCPConnector(limit=clients, ssl=ssl)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        await one_request(session, base, model, PROMPTS[0], args)  # warm-up, excluded
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        run.wall_s = time.perf_counter() - started
    return run


async def model_id(base: str, key: str, timeout_s: float) -> str:
    headers, timeout = {"Authorization": f"Bearer {key}"}, aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session, session.get(f"{base}/v1/models") as response:
        response.raise_for_status()
        return (await response.json())["data"][0]["id"]


def bench_url(args: argparse.Namespace, client_counts: list[int]) -> list[dict]:
    key = Path(args.api_key_file).read_text().split()[0] if args.api_key_file else os.environ["MOASPEC_API_KEY"]
    model = asyncio.run(model_id(args.url, key, args.request_timeout))
    return [{"drafter": "server", **asyncio.run(run_load(args.url, key, model, n, args)).summary()} for n in client_counts]


def bench_in_process(args: argparse.Namespace, client_counts: list[int]) -> list[dict]:
    import torch

    from moaspec.api import load_target
    from moaspec.drafters import make_drafter
    from moaspec.serving.limits import OpenAILimits
    from moaspec.split.server import ServerThread, SplitServer

    torch.set_num_threads(args.threads)
    target = load_target(args.target, runtime="transformers")
    key = secrets.token_urlsafe(16)
    rows = []
    for spec in args.drafters:
        server = SplitServer(target, make_drafter(spec, target), [key], openai_limits=OpenAILimits(max_waiting=max(client_counts)))
        thread = ServerThread(server).start()
        try:
            base = f"http://127.0.0.1:{thread.port}"
            for n in client_counts:
                rows.append({"drafter": spec, **asyncio.run(run_load(base, key, target.name, n, args)).summary()})
                print(_row(rows[-1]), file=sys.stderr)
        finally:
            thread.stop()
    return rows


def _row(row: dict) -> str:
    lat, ttft = row["latency_s"], row["ttft_s"]
    return (
        f"| {row['drafter']} | {row['clients']} | {row['requests']} | {row['errors']} | {row['requests_per_s']:.3f} | "
        f"{row['tokens_per_s']:.1f} | {lat['p50']:.2f} / {lat['p90']:.2f} / {lat['p99']:.2f} | "
        f"{ttft['p50']:.2f} / {ttft['p99']:.2f} | {row['mean_tau']} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--url", default=None, help="a running `moaspec serve` (default: start in-process servers)")
    parser.add_argument("--api-key-file", default=None, help="key for --url (default $MOASPEC_API_KEY)")
    parser.add_argument("--target", default="smollm2-135m", help="in-process target: built-in name or HF directory (default smollm2-135m)")
    parser.add_argument("--drafters", type=text_items, default="ngram,none", help="in-process drafters, comma-separated; `none` = plain decoding (default ngram,none)")
    parser.add_argument("--clients", type=positive_ints, default="1,2,4", help="concurrent clients, comma-separated (default 1,2,4)")
    parser.add_argument("--requests", type=positive_int, default=16, help="requests per run (default 16)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="max_tokens per request (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 2), help="torch threads in-process (default 2)")
    parser.add_argument("--out", type=output_file, default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    if not args.url:  # named before the table's header, not after it
        from moaspec.drafters import check_drafter_spec
        from moaspec.errors import MoaspecError

        for spec in args.drafters:
            try:
                check_drafter_spec(spec)
            except MoaspecError as exc:
                parser.error(str(exc))

    print("| drafter | clients | requests | errors | req/s | tok/s | latency p50 / p90 / p99 s | TTFT p50 / p99 s | mean τ |", file=sys.stderr)
    print("|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    rows = bench_url(args, args.clients) if args.url else bench_in_process(args, args.clients)
    if args.url:
        for row in rows:
            print(_row(row), file=sys.stderr)
    result = {
        "bench": "openai_load", "version": 1, "target": args.url or args.target, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "requests_per_run": args.requests, "rows": rows,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}",
    }
    if args.out:
        write_json(Path(args.out), result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    run_script(main)
