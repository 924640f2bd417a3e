"""Ctrl-C and SIGTERM held over code that must not be interrupted half-way, delivered after it.

Two places need it: a llama.cpp decode that runs Python in its eval callback (a KeyboardInterrupt
raised at the callback's entry is swallowed by ctypes, which answers llama.cpp False and stops the
graph part-way: wrong logits, no error; targets/llamacpp.py), and the first import of the heavy
libraries (torch, llama-cpp-python), which an interrupt half-way leaves half-imported or swallows
(the command then went on, or failed with an ImportError traceback).

Also here: `Terminated` (SIGTERM raised where Ctrl-C would be) and the exit statuses the CLI
gives both.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be (every handler of KeyboardInterrupt saves progress)."""


class DeferredSignals:
    """Ctrl-C and SIGTERM held for a `with` block, delivered after it (`deliver`).

    On the main thread (where Python runs signal handlers) the two signals only mark themselves
    for the block's duration; `deliver` then calls the handler that was in place (KeyboardInterrupt,
    or the CLI's SIGTERM unwinding) as if the signal came then. Elsewhere, while the interpreter
    shuts down (its handlers are gone) and for a handler not set from Python (it could not be put
    back) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is threading.main_thread() and not sys.is_finalizing():
            for number in self.SIGNALS:
                if signal.getsignal(number) is None:  # not installed from Python: it could not be put back
                    continue
                self._previous[number] = signal.signal(number, lambda signum, frame: self.received.append(signum))
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def deliver(self) -> None:
        """Run the handler of the first signal received (after __exit__), as if it came now."""
        if not self.received:
            return
        number = self.received[0]
        handler = self._previous.get(number)
        if callable(handler):
            handler(number, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(number)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM for the block; one that came is delivered when it ends normally."""
    with DeferredSignals() as held:
        yield
    held.deliver()


def load_library_held() -> None:
    """Import torch (~1.4 s, what moaspec's library side loads first) with Ctrl-C and SIGTERM
    held, so that an interrupt lands before or after it, never half-way; the commands call it
    once their cheap checks have passed."""
    with signals_held():
        import torch  # noqa: F401
