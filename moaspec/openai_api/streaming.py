"""Token ids -> text deltas with OpenAI's stop-sequence semantics, and server-sent events.

`TextStream` decodes all generated ids after every engine step and releases only text that is
final: the returned text never contains a stop sequence nor anything after one, and text that
could still become the start of a stop sequence (or an unfinished UTF-8 character, decoded as
U+FFFD) is held back until the next step decides it. So a streaming client never sees text that
the non-streaming answer would not contain, and the concatenated deltas equal that answer.
"""

from __future__ import annotations

import json
from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` already released
        self.stopped = False  # a stop sequence was found; nothing more will be released

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """The new releasable text after the generation reached `token_ids` (all new tokens).
        final: the generation is over, release everything up to a stop sequence."""
        if self.stopped:
            return ""
        self.text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = self._first_stop()
        if cut is not None:
            self.stopped = True
            end = max(cut, self.sent)
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

    @property
    def released(self) -> str:
        return self.text[: self.sent]

    def _first_stop(self) -> int | None:
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that may still grow into a stop sequence (or is an
        unfinished character)."""
        text = self.text
        hold = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), hold, -1):
                if stop.startswith(text[len(text) - length :]):
                    hold = length
                    break
        if text.endswith(REPLACEMENT_CHAR):
            hold = max(hold, len(text) - len(text.rstrip(REPLACEMENT_CHAR)))
        return hold


def sse(payload: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")
