"""An asyncio service on its own daemon thread (the split server in tests, the network emulator)."""

from __future__ import annotations

import asyncio
import threading
from typing import Self


class LoopThread:
    """start() / stop() around `_serve`, which subclasses write: it sets `self._stop_event`
    (an asyncio.Event), calls `self._ready.set()` once listening, then awaits the stop event."""

    thread_name = "moaspec-loop"
    start_error: type[Exception] = RuntimeError
    start_message = "the service did not start in time"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)

    def start(self, timeout_s: float = 30.0) -> Self:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise self.start_error(self.start_message)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_event.set)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        raise NotImplementedError
