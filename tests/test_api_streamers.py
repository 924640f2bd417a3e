"""`SpeculativeLM.generate(streamer=...)` with transformers' streamers when the request is refused."""

from __future__ import annotations

import threading

import pytest
from openai_helpers import make_drafter, tiny_chat_target
from transformers import TextIteratorStreamer, TextStreamer

from moaspec.api import SpeculativeLM
from moaspec.errors import MoaspecError


@pytest.mark.parametrize("bad", [{"prompt": ""}, {"prompt": "hi", "temperature": -1.0}, {"prompt": "hi", "max_new_tokens": 0}])
def test_a_refused_request_ends_an_iterator_streamers_stream(bad: dict) -> None:
    """An audit's: the consumer of a TextIteratorStreamer, iterating in another thread as
    transformers documents, waited forever when generate() refused its input (end() was never
    called). The streamer's own time-out turns a regression into queue.Empty, not a hang."""
    lm = SpeculativeLM(tiny_chat_target(), make_drafter("ngram", None))
    streamer = TextIteratorStreamer(lm.tokenizer, skip_prompt=True, timeout=20)
    raised: list[BaseException] = []

    def produce() -> None:
        try:
            lm.generate(streamer=streamer, **bad)
        except MoaspecError as exc:
            raised.append(exc)

    producer = threading.Thread(target=produce)
    producer.start()
    assert "".join(streamer) == ""
    producer.join()
    assert len(raised) == 1


def test_a_refused_request_prints_nothing_through_a_text_streamer(capsys) -> None:
    lm = SpeculativeLM(tiny_chat_target(), make_drafter("ngram", None))
    with pytest.raises(MoaspecError):
        lm.generate("", streamer=TextStreamer(lm.tokenizer, skip_prompt=True))
    assert capsys.readouterr().out == ""
