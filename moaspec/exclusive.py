"""One generation at a time on an object that holds one context (an engine's target and drafter,
a split client's drafter).

A generation's steps run under the object's lock, so threads sharing it wait for each other's
steps instead of interleaving inside one. A generation started while another is unfinished (a
suspended stream, another thread's generation) takes the object over: the other one raises
GenerationSuperseded at its next step instead of decoding from a context that is no longer its own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TypeVar

from moaspec.errors import MoaspecError

T = TypeVar("T")


class GenerationSuperseded(MoaspecError):
    """Another generation started on the same object before this one finished."""


class OneAtATime:
    """The owner of one context: `run(steps)` runs a generation's steps exclusively."""

    def __init__(self, what: str) -> None:
        self.what = what  # named in the error: "engine", "split generator"
        self._lock = threading.RLock()  # held while a generation's step runs
        self._owner: object | None = None  # the generation whose context the object holds

    def run(self, steps: Iterator[T]) -> Iterator[T]:
        """Yield from `steps`, each step under the lock. The first step takes the context over;
        a later one raises GenerationSuperseded once another generation has taken it."""
        me, started = object(), False
        try:
            while True:
                with self._lock:
                    if not started:
                        self._owner, started = me, True
                    elif self._owner is not me:
                        article = "an" if self.what[0] in "aeiou" else "a"
                        raise GenerationSuperseded(
                            f"another generation started on this {self.what} before this one finished: "
                            f"{article} {self.what} runs one generation at a time (use one per thread)"
                        )
                    try:
                        item = next(steps)
                    except StopIteration:
                        return
                    if self._owner is not me:  # taken over from within its own step (same thread)
                        raise GenerationSuperseded(f"another generation started on this {self.what} during this one's step")
                yield item
        finally:
            steps.close()
            with self._lock:
                if self._owner is me:
                    self._owner = None
