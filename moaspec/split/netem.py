"""A user-space TCP proxy that emulates a network link (kernel netem is not available here).

Each direction is a serial link: a chunk of n bytes occupies the link for 8n / bandwidth seconds
after the previous one, then arrives one-way latency (RTT / 2) plus jitter later, in order.
`cut()` takes the link down: "reset" closes every connection and refuses new ones (the server is
unreachable), "blackhole" silently drops everything (the client sees timeouts). `restore()`
brings it back. Loopback only by default; used by tests and benchmarks.

    python -m moaspec.split.netem --upstream 127.0.0.1:8000 --listen-port 8001 --profile 4g
    (then type `cut`, `cut blackhole`, `restore` or `profile 3g` on stdin)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

from moaspec.split.loop_thread import LoopThread

CHUNK = 16384
STOP_GRACE_S = 1.0  # stop(): how long open connections get to wind down


@dataclass(frozen=True)
class LinkProfile:
    """rtt_s: round trip latency; jitter_s: max extra one-way delay; bandwidth_bps: None = unlimited."""

    name: str
    rtt_s: float
    jitter_s: float = 0.0
    bandwidth_bps: float | None = None


PROFILES: dict[str, LinkProfile] = {
    "lan": LinkProfile("lan", 0.001, 0.0001, 1e9),
    "5g": LinkProfile("5g", 0.020, 0.003, 100e6),
    "4g": LinkProfile("4g", 0.060, 0.010, 10e6),
    "3g": LinkProfile("3g", 0.200, 0.030, 1e6),
}


def get_profile(name: str) -> LinkProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown network profile '{name}' (known: {', '.join(PROFILES)})")
    return PROFILES[name]


class _Direction:
    """One direction of the link: serialisation, latency, jitter, byte count."""

    def __init__(self, proxy: NetemProxy) -> None:
        self.proxy = proxy
        self.link_free = 0.0
        self.last_arrival = 0.0
        self.num_bytes = 0

    def arrival(self, size: int) -> float:
        profile, now = self.proxy.profile, time.monotonic()
        bandwidth = profile.bandwidth_bps
        sent = max(now, self.link_free) + (8.0 * size / bandwidth if bandwidth else 0.0)
        self.link_free = sent
        arrival = sent + profile.rtt_s / 2 + self.proxy.random.uniform(0.0, profile.jitter_s)
        self.last_arrival = max(arrival, self.last_arrival)  # TCP delivers in order
        self.num_bytes += size
        return self.last_arrival


class NetemProxy(LoopThread):
    """Listen on listen_host:listen_port and forward to upstream through an emulated link."""

    thread_name = "moaspec-netem"
    start_message = "the proxy did not start"

    def __init__(self, upstream_host: str, upstream_port: int, profile: LinkProfile | str = "lan",
                 listen_host: str = "127.0.0.1", listen_port: int = 0, seed: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.listen = (listen_host, listen_port)
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        self.random = random.Random(seed)
        self.up, self.down = _Direction(self), _Direction(self)
        self.cut_mode: str | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        super().__init__()

    # -- control (thread-safe) -------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self.listen[1]

    @property
    def bytes_up(self) -> int:
        return self.up.num_bytes

    @property
    def bytes_down(self) -> int:
        return self.down.num_bytes

    def start(self, timeout_s: float = 10.0) -> NetemProxy:
        return super().start(timeout_s)

    def cut(self, mode: str = "reset") -> None:
        """Take the link down: "reset" (connections closed, new ones refused) or "blackhole"."""
        if mode not in ("reset", "blackhole"):
            raise ValueError("cut mode is 'reset' or 'blackhole'")
        self.cut_mode = mode
        if mode == "reset" and self._loop is not None:
            self._loop.call_soon_threadsafe(self._abort_all)

    def restore(self) -> None:
        self.cut_mode = None

    def set_profile(self, profile: LinkProfile | str) -> None:
        self.profile = get_profile(profile) if isinstance(profile, str) else profile

    # -- the event loop ----------------------------------------------------------------------------
    async def _serve(self) -> None:
        self._stop_event = asyncio.Event()
        server = await asyncio.start_server(self._handle, *self.listen)
        self.listen = (self.listen[0], server.sockets[0].getsockname()[1])
        self._ready.set()
        await self._stop_event.wait()
        server.close()
        self._abort_all()
        # Aborted connections end their pumps within one latency; only what is left is cancelled
        # (Python 3.11's asyncio logs a spurious error for every cancelled connection handler).
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending, timeout=STOP_GRACE_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    def _abort_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.cut_mode == "reset":
            client_writer.transport.abort()
            return
        try:
            server_reader, server_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.transport.abort()
            return
        self._writers.update((client_writer, server_writer))
        try:
            await asyncio.gather(
                self._pump(client_reader, server_writer, self.up), self._pump(server_reader, client_writer, self.down)
            )
        finally:
            for writer in (client_writer, server_writer):
                self._writers.discard(writer)
                writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: _Direction) -> None:
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(queue, writer))
        try:
            while data := await reader.read(CHUNK):
                if self.cut_mode is None:
                    queue.put_nowait((direction.arrival(len(data)), data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
        await deliver

    async def _deliver(self, queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        try:
            while (item := await queue.get()) is not None:
                arrival, data = item
                await asyncio.sleep(max(0.0, arrival - time.monotonic()))
                if self.cut_mode is None:
                    writer.write(data)
                    await writer.drain()
            writer.transport.abort()
        except (ConnectionError, OSError):
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moaspec.split.netem", description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="host:port to forward to")
    parser.add_argument("--listen-port", type=int, required=True, help="loopback port to listen on")
    parser.add_argument("--profile", default="lan", choices=list(PROFILES), help="network profile (default lan)")
    args = parser.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    proxy = NetemProxy(host, int(port), args.profile, listen_port=args.listen_port).start()
    print(f"netem {args.profile}: 127.0.0.1:{proxy.port} -> {args.upstream}; commands: cut [blackhole], restore, profile NAME, quit")
    for line in sys.stdin:
        words = line.split()
        try:
            if words[:1] == ["cut"]:
                proxy.cut(words[1] if len(words) > 1 else "reset")
            elif words[:1] == ["restore"]:
                proxy.restore()
            elif words[:1] == ["profile"] and len(words) == 2:
                proxy.set_profile(words[1])
            elif words[:1] == ["quit"]:
                break
        except ValueError as exc:
            print(exc)
    proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
