"""The light tokenizer of the llama.cpp runtime (moaspec/targets/tokenizer.py) gives transformers'
token ids and text for the default target, and the CLI's printer streams what transformers'
TextStreamer streamed."""

from __future__ import annotations

import io
import random

import pytest
import torch

from moaspec.bench.prompts import CATEGORIES, load_prompts
from moaspec.chat import encode_chat_messages
from moaspec.model_store import resolve_target
from moaspec.targets.load import load_tokenizer
from moaspec.targets.tokenizer import load_light_tokenizer
from moaspec.text_stream import TextPrinter


@pytest.fixture(scope="module")
def tokenizers():
    _, model_dir = resolve_target("smollm2-135m")
    light = load_light_tokenizer(model_dir)
    assert light is not None
    return light, load_tokenizer(model_dir)


def test_chat_prompts_give_transformers_ids_on_every_benchmark_prompt(tokenizers) -> None:
    light, reference = tokenizers
    checked = 0
    for items in load_prompts(CATEGORIES, None).values():
        for item in items:
            messages = list(item.history)
            for turn in item.turns:
                messages.append({"role": "user", "content": turn})
                assert encode_chat_messages(light, messages) == encode_chat_messages(reference, messages)
                messages.append({"role": "assistant", "content": "Sure: " + turn[:40]})
                checked += 1
    assert checked > 300
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_chat_messages(light, system) == encode_chat_messages(reference, system)


def test_raw_text_special_ids_and_decoding_match(tokenizers) -> None:
    light, reference = tokenizers
    text = "Hello  world!\n\tcode: `x = 1` — naïve café 東京 <|im_end|> don't"
    for special in (True, False):
        expected = reference(text, add_special_tokens=special)["input_ids"]
        assert light(text, add_special_tokens=special)["input_ids"] == expected
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(light, name) == getattr(reference, name)
    generator = random.Random(0)
    for _ in range(50):
        ids = [generator.randrange(light.backend.get_vocab_size()) for _ in range(generator.randrange(1, 40))]
        ids[generator.randrange(len(ids))] = reference.eos_token_id
        for skip in (True, False):
            assert light.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


def test_printer_streams_what_transformers_streamed(tokenizers) -> None:
    from transformers import TextStreamer

    light, reference = tokenizers
    ids = reference("One two three.\nFour, five: six seven\n\n東京 eight")["input_ids"]
    chunks = [ids[i : i + 3] for i in range(0, len(ids), 3)]
    out = io.StringIO()
    printer = TextPrinter(light, skip_prompt=True, out=out, skip_special_tokens=True)
    printed = []

    class Capture(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            printed.append(text + ("\n" if stream_end else ""))

    expected = Capture(reference, skip_prompt=True, skip_special_tokens=True)
    for streamer in (printer, expected):
        streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt: skipped
        for chunk in chunks:
            streamer.put(torch.tensor(chunk))
        streamer.end()
    assert out.getvalue() == "".join(printed)


def test_printer_prints_nothing_when_no_token_came(tokenizers) -> None:
    """An interrupt before the first token left a lone newline on stdout."""
    out = io.StringIO()
    printer = TextPrinter(tokenizers[0], skip_prompt=True, out=out)
    printer.put(torch.tensor([[1, 2, 3]]))  # the prompt
    printer.end()
    assert out.getvalue() == ""
