"""The bounded admission queue in front of the model.

The engine decodes one sequence at a time (batch size 1), so one generation holds the model and
the others wait here, first come first served. At most `max_waiting` may wait: one more gets
`QueueFull` (HTTP 429) at once rather than an unbounded wait. A waiter whose client went away
leaves the queue (polled every `poll_s`), and a slot is handed straight to the next waiter on
release, so nobody can overtake the queue between release and wake-up. When the server shuts
down, `close()` turns every waiter away (ShuttingDown, HTTP 503) and admits nobody after.

Used only from the server's event loop thread: no locks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class QueueFull(Exception):
    """No room to wait."""


class ClientGone(Exception):
    """The client disconnected (while waiting or generating)."""


class ShuttingDown(Exception):
    """The server is shutting down: nothing more is admitted."""


class AdmissionQueue:
    def __init__(self, max_waiting: int, max_active: int = 1, poll_s: float = 0.1) -> None:
        if max_waiting < 0 or max_active < 1:
            raise ValueError("max_waiting must be >= 0 and max_active >= 1")
        self.max_waiting, self.max_active, self.poll_s = max_waiting, max_active, poll_s
        self.active = 0
        self.closed = False
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, client_gone: Callable[[], bool]) -> None:
        """Take a slot, waiting in line; QueueFull when the line is full, ClientGone when the
        client left while waiting, ShuttingDown once closed. The caller must `release()` after a
        successful acquire."""
        if self.closed:
            raise ShuttingDown("the server is shutting down")
        if self.active < self.max_active and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise QueueFull(f"{self.active} generation(s) running and {len(self._waiters)} waiting; retry later")
        handed_over = asyncio.get_running_loop().create_future()
        self._waiters.append(handed_over)
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(handed_over), self.poll_s)
                    return
                except TimeoutError:
                    if client_gone():
                        raise ClientGone("the client disconnected while waiting") from None
        except BaseException:
            if not handed_over.done():
                handed_over.cancel()
                self._waiters.remove(handed_over)
            elif not handed_over.cancelled() and handed_over.exception() is None:
                self.release()  # the slot reached us just as we left: pass it on
            raise  # (a waiter the closing queue turned away holds no slot and is no longer in line)

    def close(self) -> None:
        """Admit nothing more: every waiter and every later acquire get ShuttingDown (the
        generations running keep their slots until they release them)."""
        self.closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ShuttingDown("the server is shutting down"))

    def release(self) -> None:
        """Give the slot to the first waiter still waiting, else free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # `active` is unchanged: the slot changes hands
                return
        self.active -= 1
