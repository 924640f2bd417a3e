"""Signals held over code that must not be interrupted half-way, delivered after it: Ctrl-C,
SIGTERM, and every other signal with a Python handler (an application's SIGALRM time-out, say).

Two places need it: a llama.cpp decode that runs Python in its eval callback (an exception raised
by a signal handler at the callback's entry is swallowed by ctypes, which answers llama.cpp False
and stops the graph part-way: wrong logits, no error; targets/llamacpp.py), and the first import of
the heavy libraries (torch, llama-cpp-python), which an interrupt half-way leaves half-imported or
swallows (the command then went on, or failed with an ImportError traceback).

Also here: `Terminated` (SIGTERM raised where Ctrl-C would be) and the exit statuses the CLI
gives both.
"""

from __future__ import annotations

import _signal
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
    """Signals held for a `with` block, delivered after it (`deliver`).

    On the main thread (where Python runs signal handlers) each held signal only marks itself for
    the block's duration; `deliver` then calls the handler that was in place (KeyboardInterrupt,
    the CLI's SIGTERM unwinding, an application's handler) as if the signal came then. Held:
    Ctrl-C and SIGTERM, also under their default action, and every other signal whose handler was
    set from Python (the C-level default and ignore actions run outside Python: nothing to hold).
    Elsewhere, while the interpreter shuts down (its handlers are gone) and for a handler not set
    from Python (it could not be put back) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)  # held even under their default action
    ALL = tuple(int(number) for number in signal.valid_signals())  # once: valid_signals() takes ~0.1 ms

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, object] = {}

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is threading.main_thread() and not sys.is_finalizing():
            for number in self.ALL:
                handler = _signal.getsignal(number)  # signal.getsignal's raw form: 20x faster, no enum
                if handler is None:  # not installed from Python: it could not be put back
                    continue
                if callable(handler) or (number in self.SIGNALS and handler == signal.SIG_DFL):
                    self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _record(self, number: int, frame) -> None:
        self.received.append(number)

    def deliver(self) -> None:
        """Run the handlers of the signals received (after __exit__), in the order they came, as
        if they came now (each once: the system merges repeats of a pending signal too); one that
        raises ends the delivery with its exception."""
        for number in dict.fromkeys(self.received):
            handler = self._previous.get(number)
            if callable(handler):
                handler(number, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(number)


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold signals for the block (DeferredSignals); those that came are delivered when it ends
    normally."""
    with DeferredSignals() as held:
        yield
    held.deliver()


def load_library_held() -> None:
    """Import torch (1-3 s, what moaspec's library side loads first) with signals held, so that
    an interrupt lands before or after it, never half-way; the commands call it once their cheap
    checks have passed, and the first users of torch where a command may run without it (model
    drafters, the transformers runtime, the calibration's measurements)."""
    with signals_held():
        import torch  # noqa: F401
