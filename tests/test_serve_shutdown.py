"""`moaspec serve` stopped by SIGTERM or Ctrl-C while requests are in flight (a subprocess running
the real CLI entry, on a tiny target whose drafter sleeps per step).

Bug: the server went on until every request had finished, the queued ones included (70 s after a
SIGTERM in an audit), a second Ctrl-C did nothing, and it exited 0 without the CLI's line. Now
waiting requests get 503 at once, the running one gets --shutdown-timeout-s, a second signal exits
at once, and the exit is the CLI's: 143 `moaspec: terminated`, 130 `moaspec: interrupted`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from openai_helpers import KEY

try:
    import httpx2 as httpx  # the HTTP client of openai >= 3
except ImportError:  # openai 1.x-2.x ship httpx, same API
    import httpx

TESTS = Path(__file__).resolve().parent
SERVER = textwrap.dedent(
    """
    import sys
    from openai_helpers import KEY, SlowDrafter, make_drafter, tiny_chat_target
    from moaspec.serving.limits import OpenAILimits
    from moaspec.split import commands
    from moaspec.split.server import SplitServer
    from moaspec.cli import entry

    def build_server(args, keys):  # the tiny target instead of smollm2-135m, everything else as served
        target = tiny_chat_target()
        drafter = SlowDrafter(make_drafter("moa", target), 0.05)
        from moaspec.split.serve_flags import server_limits_from_args
        return SplitServer(target, drafter, keys, server_limits_from_args(args), OpenAILimits(max_waiting=4)), "tiny"

    commands.build_server = build_server
    sys.argv = ["moaspec", "serve", "--port", sys.argv[1], "--shutdown-timeout-s", sys.argv[2], "--drafter", "ngram"]
    entry()
    """
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(tmp_path: Path, shutdown_timeout_s: float) -> tuple[subprocess.Popen, str]:
    script, port = tmp_path / "serve_tiny.py", free_port()
    script.write_text(SERVER)
    env = {**os.environ, "MOASPEC_API_KEY": KEY, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, str(script), str(port), str(shutdown_timeout_s)], env=env, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a signal sent to it reaches it alone
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)
    process.kill()
    pytest.fail(f"the server did not start: {process.stderr.read()}")


def wait_for_queue(url: str, active: int, waiting: int) -> None:
    """Until /health shows that many generations running and waiting (the requests have arrived)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        queue = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).json()["queue"]
        if (queue["active"], queue["waiting"]) == (active, waiting):
            return
        time.sleep(0.05)
    pytest.fail(f"the queue never showed {active} running and {waiting} waiting")


def request_in_background(url: str, outcomes: list, max_tokens: int, stream: bool) -> threading.Thread:
    model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).json()["data"][0]["id"]

    def run() -> None:
        body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "stream": stream}
        try:
            reply = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
            outcomes.append((reply.status_code, reply.text))
        except httpx.HTTPError as exc:
            outcomes.append((None, type(exc).__name__))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sigterm_turns_waiting_requests_away_cuts_the_running_one_after_the_time_out_and_exits_143(tmp_path) -> None:
    process, url = start(tmp_path, shutdown_timeout_s=1.0)
    try:
        running: list = []
        waiting: list = []
        threads = [request_in_background(url, running, 400, stream=True)]  # ~20 s of 0.05 s steps
        wait_for_queue(url, active=1, waiting=0)
        threads += [request_in_background(url, waiting, 8, stream=False) for _ in range(2)]
        wait_for_queue(url, active=1, waiting=2)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=15)
        took_s = time.monotonic() - signalled
        for thread in threads:
            thread.join(timeout=5)
        stderr = process.stderr.read()
    finally:
        process.kill()
    assert status == 143 and stderr.rstrip().endswith("moaspec: terminated"), stderr
    assert "Traceback" not in stderr, stderr
    assert took_s < 8, took_s  # the running request's 1 s and start-up slack, not its ~20 s
    assert [code for code, _ in waiting] == [503, 503] and all("shutting_down" in text for _, text in waiting), waiting
    assert len(running) == 1 and "[DONE]" not in running[0][1]  # cut, not finished


def test_a_second_ctrl_c_exits_at_once_with_130(tmp_path) -> None:
    process, url = start(tmp_path, shutdown_timeout_s=60.0)
    try:
        running: list = []
        request_in_background(url, running, 400, stream=True)
        wait_for_queue(url, active=1, waiting=0)
        process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert process.poll() is None  # the first one waits for the running request
        signalled = time.monotonic()
        process.send_signal(signal.SIGINT)
        status = process.wait(timeout=15)
        took_s = time.monotonic() - signalled
        stderr = process.stderr.read()
    finally:
        process.kill()
    assert status == 130 and stderr.rstrip().endswith("moaspec: interrupted"), stderr
    assert "Traceback" not in stderr, stderr
    assert took_s < 5, took_s


def test_the_running_stream_is_cut_when_the_shutdown_time_out_ends_not_twice_that(tmp_path) -> None:
    """Bug: aiohttp waits the time-out for a running handler, then cancels only its request's body
    and waits the time-out again; a stream never reads its body, so it ran for twice
    --shutdown-timeout-s (10 s of 5 in an audit), past what a service manager sized from the flag
    allows. Now the handler is cancelled when the time-out ends."""
    timeout_s = 3.0
    process, url = start(tmp_path, shutdown_timeout_s=timeout_s)
    try:
        running: list = []
        stream = request_in_background(url, running, 400, stream=True)  # ~20 s of 0.05 s steps
        wait_for_queue(url, active=1, waiting=0)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        stream.join(timeout=15)
        cut_s = time.monotonic() - signalled
        status = process.wait(timeout=15)
    finally:
        process.kill()
    assert status == 143
    assert len(running) == 1 and "[DONE]" not in running[0][1]
    assert timeout_s - 0.2 < cut_s < timeout_s + 1.5, cut_s  # the time-out, not twice it
