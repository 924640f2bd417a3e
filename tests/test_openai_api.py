"""The OpenAI-compatible API (moaspec/openai_api) against the official `openai` client on loopback,
with tiny float64 targets and a character tokenizer: output equals in-process generation, stop
sequences, streaming, errors in OpenAI's shape, concurrency, queue limit, disconnects, metrics.

Every network call has a timeout and every polling loop a deadline."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

try:
    import httpx2 as httpx  # the HTTP client of openai >= 3
except ImportError:  # openai 1.x-2.x ship httpx, same API
    import httpx
import openai
import pytest
from conftest import TINY_VOCAB
from openai_helpers import KEY, make_drafter, start_server, tiny_chat_target

from moaspec.api import SpeculativeLM
from moaspec.openai_api.queue import AdmissionQueue, ClientGone, QueueFull, ShuttingDown
from moaspec.openai_api.streaming import TextStream
from moaspec.serving.limits import OpenAILimits
from moaspec.split.server import ServerLimits, ServerThread, SplitServer

MODEL = "tiny-llama"
TIMEOUT_S = 30.0
HEADERS = {"Authorization": f"Bearer {KEY}"}


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0, timeout=TIMEOUT_S)


def url(server, path: str) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def reference(method: str) -> SpeculativeLM:
    """In-process generation with an identical target and drafter (same seeds)."""
    target = tiny_chat_target()
    return SpeculativeLM(target, make_drafter(method, target))


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def health(server) -> dict:
    return httpx.get(url(server, "/health"), headers=HEADERS, timeout=TIMEOUT_S).json()


@pytest.fixture(scope="module", params=["ngram", "moa"])
def server(request):
    started = start_server(request.param)
    started.method = request.param
    yield started
    started.stop()


@pytest.fixture(scope="module")
def ngram_server():
    started = start_server("ngram")
    yield started
    started.stop()


# -- output equals in-process generation -----------------------------------------------------------
def test_models_lists_the_target(ngram_server) -> None:
    models = client(ngram_server).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client(ngram_server).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(ngram_server).models.retrieve("gpt-4")


def test_chat_greedy_equals_in_process(server) -> None:
    lm = reference(server.method)
    expected = lm.generate("Tell me a story.", max_new_tokens=40, temperature=0.0)
    reply = client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=40, temperature=0
    )
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == len(expected.token_ids) == 40
    assert reply.usage.prompt_tokens == len(lm.encode_prompt("Tell me a story."))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 40
    extension = reply.model_extra["moaspec"]
    assert extension["new_tokens"] == 40 and extension["tau"] >= 1.0 and extension["tokens_per_s"] > 0
    assert extension["target_forwards"] == expected.stats.target_forwards  # same drafts, same verifications


def test_completion_greedy_equals_in_process(server) -> None:
    lm = reference(server.method)
    expected = lm.generate("Once upon a time", max_new_tokens=30, temperature=0.0, raw=True)
    reply = client(server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    assert reply.choices[0].text == expected.text and reply.object == "text_completion"
    ids = lm.encode_prompt("Once upon a time", raw=True)
    by_ids = client(server).completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0)
    assert by_ids.choices[0].text == expected.text and by_ids.usage.prompt_tokens == len(ids)


def test_seeded_sampling_equals_in_process(ngram_server) -> None:
    lm = reference("ngram")
    expected = lm.generate("Pick colours.", max_new_tokens=25, temperature=0.8, top_p=0.9, seed=1234)
    make = lambda: client(ngram_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick colours."}], max_tokens=25, temperature=0.8, top_p=0.9, seed=1234
    )
    assert make().choices[0].message.content == expected.text == make().choices[0].message.content


def test_a_vanishing_temperature_decodes_as_greedy_not_a_500(server) -> None:
    """Bug (the OpenAI API's mutation audit): `temperature` 1e-320, inside [0, 2], overflowed the
    logits / temperature to inf, and the NaN probabilities made the draw raise: 500 `internal`
    (in a stream, an error event). The limit is greedy decoding, with either drafter."""
    greedy = client(server).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 1e-320, "seed": 1}
    reply = _post(server, "/v1/completions", body=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == greedy.choices[0].text


def test_multi_turn_chat_goes_through_the_template(ngram_server) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": [{"type": "text", "text": "More"}, {"type": "text", "text": " please"}]},
    ]
    reply = client(ngram_server).chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    templated = "system: Be brief.\nuser: Hi\nassistant: Hello\nuser: More please\nassistant:"
    assert reply.usage.prompt_tokens == len(templated)  # one token per character
    developer = [{"role": "developer", "content": "Be brief."}, *messages[1:]]  # OpenAI's newer name for system
    again = client(ngram_server).chat.completions.create(model=MODEL, messages=developer, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens == len(templated)
    assert again.choices[0].message.content == reply.choices[0].message.content


# -- streaming and stop sequences ------------------------------------------------------------------
def test_streaming_equals_non_streaming(server) -> None:
    messages = [{"role": "user", "content": "Count to ten."}]
    whole = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=35, temperature=0)
    chunks = list(client(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=35, temperature=0, stream=True, stream_options={"include_usage": True}
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 35
    assert finals[0].model_extra["moaspec"]["new_tokens"] == 35

    completion = list(client(server).completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0, stream=True))
    plain = client(server).completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=0)
    assert "".join(c.choices[0].text for c in completion) == plain.choices[0].text


def test_raw_stream_ends_with_done(ngram_server) -> None:
    body = {"model": MODEL, "prompt": "xy", "max_tokens": 8, "temperature": 0, "stream": True}
    response = httpx.post(url(ngram_server, "/v1/completions"), json=body, headers=HEADERS, timeout=TIMEOUT_S)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences_cut_the_text(server, stream: bool) -> None:
    messages = [{"role": "user", "content": "Write something."}]
    full = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0).choices[0].message.content
    stop = full[25:28]  # 3 characters = 3 tokens: may span engine steps and arrive in pieces
    second = full[40:42] if full[40:42] not in full[:40] else full[45:47]
    expected = full[: min(full.find(stop), full.find(second) if second in full else len(full))]
    for stops in (stop, [second, stop]):
        kwargs = {"model": MODEL, "messages": messages, "max_tokens": 60, "temperature": 0, "stop": stops}
        if stream:
            chunks = list(client(server).chat.completions.create(**kwargs, stream=True))
            deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
            text, finish = "".join(deltas), chunks[-1].choices[0].finish_reason
        else:
            reply = client(server).chat.completions.create(**kwargs)
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        want = full[: full.find(stop)] if isinstance(stops, str) else expected
        assert text == want and finish == "stop"


def test_time_to_first_token_is_the_first_released_text_in_both_response_kinds() -> None:
    """Bug: a non-streamed answer timed its first token when the token existed, a streamed one when
    its text was released, so text held back (here all of it, being the start of a stop sequence
    that never comes) counted early in one kind only, and a generation whose text a stop sequence
    cut to nothing had a time there. Not flaky: each engine step sleeps DELAY_S in the drafter, so
    text released only after the last step is timed at >= num_verifications * DELAY_S (about 0.5 s
    here), against one prefill step (milliseconds, no sleep) if timed at the first token."""
    delay_s = 0.05
    started = start_server("ngram", delay_s=delay_s)
    try:
        base = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
        full = client(started).completions.create(**base).choices[0].text

        def extension(stop: str, stream: bool) -> dict:
            if not stream:
                return client(started).completions.create(**base, stop=stop).model_extra["moaspec"]
            chunks = list(client(started).completions.create(**base, stop=stop, stream=True))
            return next(c.model_extra["moaspec"] for c in chunks if c.choices and c.choices[0].finish_reason)

        count = "moaspec_time_to_first_token_seconds_count"
        for stream in (False, True):
            held = extension(full + "\n\n", stream)  # the whole answer may become this stop: released only at the end
            assert held["new_tokens"] == 12 and held["num_verifications"] >= 1
            assert held["time_to_first_token_s"] >= held["num_verifications"] * delay_s
            before = _metric(started, count)
            assert extension(full[:3], stream)["time_to_first_token_s"] is None  # no text at all
            assert _metric(started, count) == before
    finally:
        started.stop()


def test_text_stream_holds_back_possible_stop_prefixes() -> None:
    class Chars:  # token id = character code
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    stream = TextStream(Chars(), ("END", "xyz"))
    ids = [ord(c) for c in "abcENxyEND tail"]
    deltas = [stream.update(ids[:n]) for n in (3, 5, 7, 10, 15)]
    assert deltas == ["abc", "", "EN", "xy", ""]  # "EN" waits until "x" rules out END; "xy" until END
    assert stream.released == "abcENxy" and stream.stopped
    finished = TextStream(Chars(), ("END",))
    assert finished.update([ord("E")]) == "" and finished.update([ord("E"), ord("N")], final=True) == "EN"


def test_text_stream_cuts_at_the_earliest_stop_and_holds_the_longest_possible_start() -> None:
    class Chars:  # token id = character code
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    def ids(text: str) -> list[int]:
        return [ord(c) for c in text]

    assert TextStream(Chars(), ("zz", "ab")).update(ids("xxabyyzz"), final=True) == "xx"  # "ab" comes first
    # "abc" may still become "abcd", "c" may become "cx": the longer tail is held, whichever stop is listed last
    assert TextStream(Chars(), ("abcd", "cx")).update(ids("zzabc")) == "zz"


# -- errors ------------------------------------------------------------------------------------------
def test_wrong_or_missing_key_is_401(ngram_server) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        client(ngram_server, key="wrong").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 401
    response = httpx.get(url(ngram_server, "/v1/models"), timeout=TIMEOUT_S)
    error = response.json()["error"]
    assert response.status_code == 401 and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "authentication_error"


def _post(server, path: str, content: bytes | None = None, body: dict | None = None) -> httpx.Response:
    return httpx.post(url(server, path), content=content, json=body, headers=HEADERS, timeout=TIMEOUT_S)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ({"prompt": "x"}, 400, "model"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": " \n\t"}, 400, "prompt"),  # blank: refused as `moaspec generate` refuses it
        ({"model": MODEL, "prompt": ["  "]}, 400, "prompt"),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [5, 500]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "temperature": 2.01}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
        ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
        ({"model": MODEL, "prompt": "x", "user": 42}, 400, "user"),  # was accepted: documented, never typed
        ({"model": MODEL, "prompt": "x", "logprobs": 3}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"model": MODEL, "prompt": "x" * 600}, 413, "prompt"),
        ({"model": MODEL, "prompt": "x", "logprobs": 0}, 400, "logprobs"),
        ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
        ({"model": MODEL, "prompt": "x", "repetition_penalty": 1.5}, 400, "repetition_penalty"),
        ({"model": MODEL, "prompt": "x", "min_p": 0.5}, 400, "min_p"),
        ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"model": MODEL, "prompt": "x" * 400, "max_tokens": 200}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": [-1]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [0, TINY_VOCAB]}, 400, "prompt"),  # one past the vocabulary
        ({"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}, 400, "seed"),
        ({"model": MODEL, "prompt": "x", "stop": ["y" * 257]}, 400, "stop"),  # 256 characters at most
        ({"model": MODEL, "prompt": "x", "best_of": True}, 400, "best_of"),  # a bool is not the neutral 1
        ({"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ],
)
def test_bad_completion_requests(ngram_server, body: dict, status: int, param: str) -> None:
    response = _post(ngram_server, "/v1/completions", body=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("model", "code"), [(None, "missing_required_parameter"), ("", "missing_required_parameter"),
                                             (5, "invalid_type"), (["m"], "invalid_type")])
def test_a_missing_model_and_one_not_a_string_are_told_apart(ngram_server, model, code: str) -> None:
    """An audit: `"model": 5` was said to be missing."""
    body = {"prompt": "x"} if model is None else {"model": model, "prompt": "x"}
    error = _post(ngram_server, "/v1/completions", body=body).json()["error"]
    assert (error["param"], error["code"]) == ("model", code)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({"model": MODEL}, 400),
        ({"model": MODEL, "messages": []}, 400),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, 413),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, 400),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "audio": {"voice": "alloy", "format": "wav"}}, 400),
        ({"model": MODEL, "messages": [{"role": "system", "content": " "}, {"role": "user", "content": "\n\t"}]}, 400),
    ],
)
def test_bad_chat_requests(ngram_server, body: dict, status: int) -> None:
    response = _post(ngram_server, "/v1/chat/completions", body=body)
    assert response.status_code == status, response.text
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_bad_json_body_size_and_route(ngram_server) -> None:
    assert _post(ngram_server, "/v1/chat/completions", content=b"{not json").status_code == 400
    assert _post(ngram_server, "/v1/chat/completions", content=b"[1, 2]").status_code == 400
    huge = _post(ngram_server, "/v1/completions", content=b'{"model": "tiny-llama", "prompt": "' + b"x" * (2 << 20) + b'"}')
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "invalid_request_error"
    missing = httpx.get(url(ngram_server, "/v1/engines"), headers=HEADERS, timeout=TIMEOUT_S)
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError):
        client(ngram_server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)


def test_requests_without_max_tokens_fit_the_context_and_completions_ignore_max_completion_tokens(ngram_server) -> None:
    """The default max_tokens (16 on /v1/completions) is cut to the room the prompt leaves in the
    512-position context; `max_completion_tokens` is a chat field, which /v1/completions ignores."""
    near_end = _post(ngram_server, "/v1/completions", body={"model": MODEL, "prompt": "x" * 500, "temperature": 0})
    assert near_end.status_code == 200, near_end.text
    assert near_end.json()["usage"]["completion_tokens"] == 512 - 500
    assert near_end.json()["moaspec"]["stop_reason"] == "length", near_end.json()["moaspec"]
    ignored = _post(ngram_server, "/v1/completions", body={"model": MODEL, "prompt": "x", "max_tokens": 3, "max_completion_tokens": 10**6})
    assert ignored.status_code == 200 and ignored.json()["usage"]["completion_tokens"] == 3


def test_chat_refuses_an_invalid_max_tokens_beside_a_valid_max_completion_tokens(ngram_server) -> None:
    """Bug: with both given, chat used max_completion_tokens and let an invalid max_tokens (0)
    pass silently; alone it was refused. Both given and valid: max_completion_tokens rules."""
    messages = [{"role": "user", "content": "x"}]
    for bad in ({"max_completion_tokens": 3, "max_tokens": 0}, {"max_completion_tokens": 0, "max_tokens": 3}):
        refused = _post(ngram_server, "/v1/chat/completions", body={"model": MODEL, "messages": messages, **bad})
        param = next(field for field, value in bad.items() if value == 0)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    both = _post(ngram_server, "/v1/chat/completions",
                 body={"model": MODEL, "messages": messages, "max_completion_tokens": 3, "max_tokens": 5, "temperature": 0})
    assert both.status_code == 200 and both.json()["usage"]["completion_tokens"] == 3


def test_max_tokens_limit_follows_the_split_limits() -> None:
    started = start_server("ngram", limits=ServerLimits(max_new_tokens=10))
    try:
        response = _post(started, "/v1/completions", body={"model": MODEL, "prompt": "x", "max_tokens": 11})
        assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
        chat = client(started).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=0)
        assert chat.usage.completion_tokens == 10  # chat default: as many as allowed
        completion = _post(started, "/v1/completions", body={"model": MODEL, "prompt": "x", "temperature": 0})
        assert completion.json()["usage"]["completion_tokens"] == 10, completion.text  # 16, bounded by the limit
    finally:
        started.stop()


# -- concurrency, queue, disconnects, metrics ---------------------------------------------------------
def test_concurrent_requests_get_their_own_answers(ngram_server) -> None:
    lm = reference("ngram")
    prompts = [f"Question number {i}?" for i in range(5)]
    expected = [lm.generate(p, max_new_tokens=20, temperature=0.0).text for p in prompts]

    def ask(prompt: str) -> str:
        reply = client(ngram_server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=20, temperature=0)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(max_workers=5) as pool:
        answers = list(pool.map(ask, prompts, timeout=TIMEOUT_S * 2))
    assert answers == expected


def _open_stream(server, max_tokens: int = 400) -> tuple[httpx.Client, httpx.Response, object]:
    """Start a streaming generation and return once its first chunk arrived (with the line
    iterator: dropping it would close the stream)."""
    session = httpx.Client(timeout=TIMEOUT_S)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens, "temperature": 0, "stream": True}
    response = session.send(session.build_request("POST", url(server, "/v1/chat/completions"), json=body, headers=HEADERS), stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    next(lines)
    return session, response, lines


def _metric(server, line_start: str) -> float:
    text = httpx.get(url(server, "/metrics"), headers=HEADERS, timeout=TIMEOUT_S).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return sum(values)


def test_disconnect_mid_stream_cancels_and_frees_the_slot() -> None:
    started = start_server("ngram", delay_s=0.1)  # >= 10 s for 400 tokens if not cancelled
    try:
        session, response, _lines = _open_stream(started)
        assert health(started)["queue"]["active"] == 1
        response.close()
        session.close()
        assert wait_until(lambda: health(started)["queue"]["active"] == 0, timeout_s=5.0)
        assert _metric(started, 'moaspec_generations_total{endpoint="chat",finish_reason="cancelled"}') == 1
        assert _metric(started, "moaspec_generated_tokens_total") < 200
        # the stream's 200 headers were sent, yet its client left: counted as 499 (it was counted 200)
        left = 'moaspec_http_requests_total{route="/v1/chat/completions",status="499"}'
        assert wait_until(lambda: _metric(started, left) == 1, timeout_s=5.0)
        assert _metric(started, 'moaspec_http_requests_total{route="/v1/chat/completions",status="200"}') == 0
        reply = client(started).completions.create(model=MODEL, prompt="after", max_tokens=3, temperature=0)
        assert reply.usage.completion_tokens == 3
    finally:
        started.stop()


def test_non_streaming_disconnect_cancels_too() -> None:
    started = start_server("ngram", delay_s=0.05)
    try:
        body = {"model": MODEL, "prompt": "go", "max_tokens": 400, "temperature": 0}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url(started, "/v1/completions"), json=body, headers=HEADERS, timeout=0.5)
        assert wait_until(lambda: health(started)["queue"]["active"] == 0, timeout_s=5.0)
        assert _metric(started, 'moaspec_generations_total{endpoint="completions",finish_reason="cancelled"}') == 1
    finally:
        started.stop()


def test_a_client_leaving_during_a_long_prefill_stops_it() -> None:
    """Bug (documented as a limit until now): the prompt's prefill was one worker step, so a
    client that left during a long one held the model until it ended. Now the connection is
    checked while a step runs and the prefill stops at the next decoder layer. Deterministic:
    each decoder layer of a prefill sleeps 2 s (4 s for the tiny target's two), the client leaves
    after 0.5 s, so the slot must be free before the second layer runs; the next request gets the
    same answer as before (the half-written cache was reset)."""
    started = start_server("ngram")
    body = {"model": MODEL, "prompt": "a long prompt " * 4, "max_tokens": 5, "temperature": 0}
    expected = httpx.post(url(started, "/v1/completions"), json=body, headers=HEADERS, timeout=TIMEOUT_S).json()
    layers = started.server.openai_target.decoder_layers
    assert len(layers) == 2
    slept = []

    def slow_prefill(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] > 1:  # a prefill, not a one-token step
            slept.append(module)
            time.sleep(2.0)

    handles = [layer.register_forward_pre_hook(slow_prefill, with_kwargs=True) for layer in layers]
    try:
        began = time.monotonic()
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url(started, "/v1/completions"), json=body, headers=HEADERS, timeout=0.5)
        assert wait_until(lambda: health(started)["queue"]["active"] == 0, timeout_s=10.0)
        assert time.monotonic() - began < 3.5 and len(slept) == 1  # before: both layers, 4 s and more
        assert _metric(started, 'moaspec_generations_total{endpoint="completions",finish_reason="cancelled"}') == 1
    finally:
        for handle in handles:
            handle.remove()
    try:
        again = httpx.post(url(started, "/v1/completions"), json=body, headers=HEADERS, timeout=TIMEOUT_S).json()
        assert again["choices"][0]["text"] == expected["choices"][0]["text"]
    finally:
        started.stop()


def test_full_queue_gets_429_and_waiters_are_served_in_turn() -> None:
    started = start_server("ngram", delay_s=0.1, max_waiting=1)
    try:
        first = _open_stream(started)
        results: list = []
        waiter = threading.Thread(
            target=lambda: results.append(client(started).completions.create(model=MODEL, prompt="w", max_tokens=2, temperature=0)),
            daemon=True,
        )
        waiter.start()
        assert wait_until(lambda: health(started)["queue"]["waiting"] == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            client(started).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert caught.value.status_code == 429 and caught.value.body["code"] == "queue_full"
        first[1].close()
        first[0].close()
        waiter.join(TIMEOUT_S)
        assert len(results) == 1 and results[0].usage.completion_tokens == 2
        assert _metric(started, 'moaspec_http_requests_total{route="/v1/completions",status="429"}') == 1
    finally:
        started.stop()


def test_health_and_prometheus_metrics(ngram_server) -> None:
    client(ngram_server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "m"}], max_tokens=6, temperature=0)
    state = health(ngram_server)
    assert state["status"] == "ok" and state["model"] == MODEL and state["queue"]["active"] == 0
    assert state["drafter"] == "ngram"  # as a user names it (was the class name, NgramDrafter)
    response = httpx.get(url(ngram_server, "/metrics"), headers=HEADERS, timeout=TIMEOUT_S)
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("moaspec_http_requests_total", "moaspec_generated_tokens_total", "moaspec_mean_tokens_per_forward",
                 "moaspec_accepted_drafts_total", "moaspec_http_request_duration_seconds_bucket", "moaspec_time_to_first_token_seconds_count"):
        assert f"# TYPE {name.removesuffix('_bucket').removesuffix('_count')} " in text and name in text
    assert _metric(ngram_server, 'moaspec_http_requests_total{route="/v1/chat/completions",status="200"}') >= 1
    assert _metric(ngram_server, "moaspec_mean_tokens_per_forward") >= 1.0
    assert httpx.get(url(ngram_server, "/metrics"), timeout=TIMEOUT_S).status_code == 401


def test_generations_far_slower_than_the_calibration_predicts_are_logged_at_most_every_ten_minutes(caplog) -> None:
    """serve's log gets the note `generate` prints on a busy machine (calibration/busy_machine.py):
    with a calibration predicting a 1 ns cycle, the first generation logs it as a warning, the next
    within BUSY_NOTE_EVERY_S does not, and one after it does again. A server without a calibration
    logs none (the ngram_server fixture's generations)."""
    from types import SimpleNamespace

    from moaspec.calibration.predict import Option
    from moaspec.openai_api import routes

    calibration = SimpleNamespace(chosen=Option("moa", "row", 1e9, expected_tau=1.0))
    started = start_server("moa", calibration=calibration)
    messages = [{"role": "user", "content": "tell me more"}]

    def notes_after_a_generation() -> list[str]:
        """A non-streamed response is sent after its generation's log line."""
        caplog.clear()
        with caplog.at_level("WARNING", logger="moaspec.serve"):
            client(started).chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        return [r.getMessage() for r in caplog.records if r.name == "moaspec.serve"]

    try:
        first = notes_after_a_generation()
        assert len(first) == 1 and "x what this machine's calibration predicts (0 ms)" in first[0], first
        assert "torch's" in first[0] and "OMP_NUM_THREADS=N" in first[0]
        assert notes_after_a_generation() == []
        started.server.openai.busy_logged_at -= routes.BUSY_NOTE_EVERY_S
        assert len(notes_after_a_generation()) == 1
    finally:
        started.stop()
    with caplog.at_level("WARNING", logger="moaspec.serve"):
        caplog.clear()
        unlogged = start_server("moa")
        try:
            client(unlogged).chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        finally:
            unlogged.stop()
    assert [r for r in caplog.records if r.name == "moaspec.serve"] == []


def test_serve_flags() -> None:
    import argparse

    from moaspec.errors import MoaspecError
    from moaspec.openai_api.cli import add_openai_arguments, openai_limits_from_args

    parser = argparse.ArgumentParser()
    add_openai_arguments(parser)
    assert openai_limits_from_args(parser.parse_args([])).max_waiting == 8
    assert openai_limits_from_args(parser.parse_args(["--max-queue", "0"])).max_waiting == 0
    with pytest.raises(MoaspecError):
        openai_limits_from_args(parser.parse_args(["--max-queue", "-1"]))


def test_tls_with_the_openai_client(tmp_path) -> None:
    """The same TLS as the split protocol: ServerThread with the server's SSL context."""
    import ssl

    from openai_helpers import make_drafter as drafter_for
    from openai_helpers import self_signed_certificate

    from moaspec.errors import MoaspecError
    from moaspec.split.server import ServerThread, SplitServer

    cert, key = self_signed_certificate(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    target = tiny_chat_target()
    started = ServerThread(SplitServer(target, drafter_for("ngram", target), [KEY]), ssl_context=context).start()
    try:
        trusted = openai.OpenAI(
            base_url=f"https://127.0.0.1:{started.port}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S,
            http_client=httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=TIMEOUT_S),
        )
        assert trusted.completions.create(model=MODEL, prompt="tls", max_tokens=3, temperature=0).usage.completion_tokens == 3
        with pytest.raises(openai.APIConnectionError):  # an unknown certificate is refused
            openai.OpenAI(base_url=f"https://127.0.0.1:{started.port}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S).models.list()
        # the split client: trusted with --cafile; without it an error at once, not an outage to
        # retry for --offline-deadline-s (it was one)
        from moaspec.split.client import LinkDown, SplitClient

        split_url = f"https://127.0.0.1:{started.port}"
        assert SplitClient(split_url, KEY, cafile=str(cert)).info()["vocab_size"] == target.vocab_size
        with pytest.raises(MoaspecError, match="does not verify.*--cafile") as refused:
            SplitClient(split_url, KEY).info()
        assert not isinstance(refused.value, LinkDown)
        # the right CA but a name the certificate does not list: the hint names the host, not --cafile
        with pytest.raises(MoaspecError, match="does not verify.*not localhost$") as misnamed:
            SplitClient(f"https://localhost:{started.port}", KEY, cafile=str(cert)).info()
        assert "--cafile" not in str(misnamed.value)
    finally:
        started.stop()


# -- queue unit tests ----------------------------------------------------------------------------------
def test_admission_queue_order_limit_and_departures() -> None:
    import asyncio

    async def scenario() -> list[str]:
        queue, order = AdmissionQueue(max_waiting=2, poll_s=0.01), []
        await queue.acquire(lambda: False)
        gone = {"b": False}

        async def wait(name: str) -> None:
            try:
                await queue.acquire(lambda: gone.get(name, False))
            except ClientGone:
                order.append(f"{name} left")
                return
            order.append(name)
            queue.release()

        tasks = [asyncio.create_task(wait(n)) for n in ("b", "c")]
        await asyncio.sleep(0.02)
        with pytest.raises(QueueFull):
            await queue.acquire(lambda: False)
        gone["b"] = True
        await asyncio.sleep(0.05)
        queue.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        assert queue.active == 0 and queue.waiting == 0
        return order

    assert asyncio.run(scenario()) == ["b left", "c"]


def test_a_closed_admission_queue_turns_waiters_away_and_keeps_the_running_slot() -> None:
    import asyncio

    async def scenario() -> None:
        queue = AdmissionQueue(max_waiting=4, poll_s=0.01)
        await queue.acquire(lambda: False)  # the generation running
        waiters = [asyncio.create_task(queue.acquire(lambda: False)) for _ in range(2)]
        await asyncio.sleep(0.03)
        queue.close()
        for waiter in waiters:
            with pytest.raises(ShuttingDown):
                await asyncio.wait_for(waiter, 1.0)
        with pytest.raises(ShuttingDown):  # at once, not a wait for the running generation's slot
            await asyncio.wait_for(queue.acquire(lambda: False), 1.0)
        assert queue.active == 1 and queue.waiting == 0
        queue.release()
        assert queue.active == 0

    asyncio.run(scenario())


def test_split_sessions_and_openai_generations_interleave_safely() -> None:
    """Both use the one model thread, each with its own cache: running them at the same time must
    leave each output equal to its in-process reference."""
    from moaspec.config import GenerationConfig, SamplingConfig
    from moaspec.engine import Engine
    from moaspec.split.client import SplitClient
    from moaspec.split.generator import SplitGenerator, SplitOptions

    started = start_server("moa")
    try:
        prompt_ids = [40, 69, 76, 76, 79, 12, 0, 87, 79, 82]
        reference_target = tiny_chat_target()
        expected_split = Engine(reference_target, make_drafter("moa", reference_target)).generate(
            prompt_ids, SamplingConfig(), GenerationConfig(max_new_tokens=40), frozenset()
        ).token_ids
        expected_chat = reference("moa").generate("Interleave.", max_new_tokens=60, temperature=0.0).text
        with ThreadPoolExecutor(max_workers=1) as pool:
            chat = pool.submit(lambda: client(started).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Interleave."}], max_tokens=60, temperature=0
            ))
            client_target = tiny_chat_target()
            split = SplitGenerator(SplitClient(f"http://127.0.0.1:{started.port}", KEY, timeout_s=TIMEOUT_S),
                                   make_drafter("moa", client_target), SplitOptions())
            result = split.generate(prompt_ids, SamplingConfig(), GenerationConfig(max_new_tokens=40))
            assert chat.result(timeout=TIMEOUT_S * 2).choices[0].message.content == expected_chat
        assert result.token_ids == expected_split
    finally:
        started.stop()


def test_neutral_options_pass_and_top_k_reaches_the_engine(ngram_server) -> None:
    """Fields that ask for nothing are accepted; vLLM's `top_k` samples: top_k = 1 at temperature 1
    is greedy decoding; a max_tokens beyond the context left is OpenAI's context_length_exceeded."""
    neutral = {"tool_choice": "none", "modalities": ["text"], "logprobs": False, "frequency_penalty": 0,
               "repetition_penalty": 1, "min_p": 0}
    messages = [{"role": "user", "content": "m"}]
    response = _post(ngram_server, "/v1/chat/completions", body={"model": MODEL, "messages": messages, "max_tokens": 4, **neutral})
    assert response.status_code == 200, response.text
    base = {"model": MODEL, "prompt": "hello", "max_tokens": 12}
    greedy = _post(ngram_server, "/v1/completions", body={**base, "temperature": 0}).json()["choices"][0]["text"]
    top1 = _post(ngram_server, "/v1/completions", body={**base, "temperature": 1, "top_k": 1, "seed": 3}).json()
    assert top1["choices"][0]["text"] == greedy
    sampled = {_post(ngram_server, "/v1/completions", body={**base, "temperature": 1, "top_k": 50, "seed": seed}).json()["choices"][0]["text"]
               for seed in range(4)}
    assert len(sampled) > 1
    too_long = _post(ngram_server, "/v1/completions", body={**base, "prompt": "x" * 400, "max_tokens": 200}).json()["error"]
    assert too_long["code"] == "context_length_exceeded" and "room for" in too_long["message"]


# -- boundaries and paths the mutation audit of session 23 found untested --------------------------
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_an_end_of_sequence_token_finishes_with_stop() -> None:
    """OpenAI's finish_reason: "stop" when the model emits its end-of-sequence token, "length"
    only at max_tokens."""
    expected = reference("ngram").generate("Once upon a time", max_new_tokens=30, temperature=0.0, raw=True).text
    target = tiny_chat_target()
    eos = ord(expected[4]) - 32  # the character tokenizer: one id per printable character
    target.model.generation_config.eos_token_id = eos
    started = ServerThread(SplitServer(target, make_drafter("ngram", target), [KEY], ServerLimits(), OpenAILimits())).start()
    try:
        reply = client(started).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage.completion_tokens <= 5
    finally:
        started.stop()


def test_a_prompt_that_fills_the_context_is_413(ngram_server) -> None:
    """A prompt of max_positions tokens leaves no room for the answer's first token: 413
    context_length_exceeded on the prompt, as OpenAI answers; one token fewer is served."""
    context = tiny_chat_target().max_positions
    full = httpx.post(url(ngram_server, "/v1/completions"), headers=AUTH, timeout=TIMEOUT_S,
                      json={"model": MODEL, "prompt": [40] * context, "max_tokens": 1})
    assert full.status_code == 413, full.text
    assert full.json()["error"]["code"] == "context_length_exceeded" and full.json()["error"]["param"] == "prompt"
    fits = httpx.post(url(ngram_server, "/v1/completions"), headers=AUTH, timeout=TIMEOUT_S,
                      json={"model": MODEL, "prompt": [40] * (context - 1), "max_tokens": 1, "temperature": 0})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 1


def test_max_tokens_just_past_the_context_left_is_refused(ngram_server) -> None:
    """validation.py: a max_tokens beyond the context left after the prompt is a 400
    context_length_exceeded, by one token as well; exactly the room left is served."""
    context = tiny_chat_target().max_positions
    body = {"model": MODEL, "prompt": [40] * (context - 5), "temperature": 0}
    over = httpx.post(url(ngram_server, "/v1/completions"), headers=AUTH, timeout=TIMEOUT_S, json={**body, "max_tokens": 6})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded", over.text
    exact = httpx.post(url(ngram_server, "/v1/completions"), headers=AUTH, timeout=TIMEOUT_S, json={**body, "max_tokens": 5})
    assert exact.status_code == 200 and exact.json()["usage"]["completion_tokens"] == 5


def test_a_waiter_that_leaves_frees_its_place_in_line_at_once() -> None:
    """queue.py: a waiter whose client left is out of the line: it no longer counts as waiting
    (/health) nor against max_waiting, before any release."""
    async def scenario() -> None:
        queue, gone = AdmissionQueue(max_waiting=1, poll_s=0.01), {"left": False}
        await queue.acquire(lambda: False)
        leaving = asyncio.create_task(queue.acquire(lambda: gone["left"]))
        await asyncio.sleep(0.03)
        assert queue.waiting == 1
        gone["left"] = True
        with pytest.raises(ClientGone):
            await asyncio.wait_for(leaving, 1.0)
        assert queue.waiting == 0
        staying = asyncio.create_task(queue.acquire(lambda: False))  # room in line again: no QueueFull
        await asyncio.sleep(0.03)
        assert queue.waiting == 1 and not staying.done()
        queue.release()
        await asyncio.wait_for(staying, 1.0)
        queue.release()
        assert queue.active == 0 and queue.waiting == 0

    asyncio.run(scenario())


def test_a_slot_handed_to_a_waiter_cancelled_at_that_moment_is_passed_on() -> None:
    """queue.py: the slot reached the waiter just as it left (its request cut): it is released,
    not leaked (else the server would admit nobody again)."""
    async def scenario() -> None:
        queue = AdmissionQueue(max_waiting=2, poll_s=0.01)
        await queue.acquire(lambda: False)
        waiter = asyncio.create_task(queue.acquire(lambda: False))
        await asyncio.sleep(0.03)
        queue.release()  # hands the slot to the waiter...
        waiter.cancel()  # ...whose request is cut before it wakes up
        try:
            await waiter
        except asyncio.CancelledError:
            pass
        else:  # it took the slot after all
            queue.release()
        assert queue.active == 0 and queue.waiting == 0
        await asyncio.wait_for(queue.acquire(lambda: False), 1.0)

    asyncio.run(scenario())


def test_text_stream_holds_back_an_unfinished_character() -> None:
    """streaming.py: a character whose bytes are split over tokens decodes as U+FFFD until its
    last byte arrives: that is held back, never streamed, and the deltas add up to the text."""
    class Bytes:  # token id = one byte of UTF-8
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    ids = list("ab\u00e9c".encode())  # é is two bytes
    stream = TextStream(Bytes())
    deltas = [stream.update(ids[:n]) for n in (2, 3, 4)]
    assert deltas == ["ab", "", "\u00e9"]
    assert stream.update(ids, final=True) == "c" and stream.released == "ab\u00e9c"


def test_completions_default_to_16_tokens(ngram_server) -> None:
    """OpenAI's default for /v1/completions: max_tokens 16 (chat: up to the context)."""
    reply = client(ngram_server).completions.create(model=MODEL, prompt="Once upon a time", temperature=0)
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


# -- the mutation audit of validation.py / schemas.py (session 52) --------------------------------
def _job(body: dict, chat: bool = False, max_new_tokens: int = 10, room: int = 100):
    """validation.parse_job on a body (a 3-token prompt), as the routes call it."""
    from moaspec.openai_api import validation

    base = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
    request = validation.parse_request({"model": MODEL, **base, **body}, chat)
    return validation.parse_job(request, [1, 2, 3], max_new_tokens, room)


def _refused(body: dict, chat: bool = False):
    from moaspec.serving.errors import APIError

    with pytest.raises(APIError) as caught:
        _job(body, chat)
    return caught.value


def test_every_range_is_closed_where_the_docs_say_so() -> None:
    """Mutations that survived: a `<` for `<=` refusing max_tokens equal to --max-new-tokens,
    temperature 2, 4 stop sequences, a 256-character stop, seed -2**63 or 2**64 - 1; and top_k -1
    (vLLM's "off") refused once its special case was dropped. Each edge is accepted, as documented."""
    assert _job({"max_tokens": 10}).generation.max_new_tokens == 10
    assert _job({"max_completion_tokens": 10}, chat=True).generation.max_new_tokens == 10
    assert _job({"temperature": 2}).sampling.temperature == 2.0
    assert _job({"temperature": 0}).sampling.greedy
    assert _job({"top_k": -1}).sampling.top_k == 0
    assert _job({"stop": ["a", "b", "c", "d"]}).stop == ("a", "b", "c", "d")
    assert _job({"stop": "y" * 256}).stop == ("y" * 256,)
    assert _job({"seed": -(2**63)}).generation.seed == -(2**63)
    assert _job({"seed": 2**64 - 1}).generation.seed == 2**64 - 1


def test_a_default_max_tokens_is_cut_to_the_room_the_prompt_leaves() -> None:
    """The mutation that survived session 52's audit: the default max_tokens not cut to the
    context left let the engine stop at the context's end (stop_reason "context", not "length").
    The cut holds on both routes; with more room, the defaults are 16 and --max-new-tokens.
    Bug: /v1/completions' default 16 ran past a server's --max-new-tokens below 16, which an
    explicit max_tokens 16 gets a 400 for."""
    assert _job({}, room=5).generation.max_new_tokens == 5
    assert _job({}, chat=True, room=5).generation.max_new_tokens == 5
    assert _job({}, max_new_tokens=100).generation.max_new_tokens == 16
    assert _job({}, chat=True).generation.max_new_tokens == 10
    assert _job({}, max_new_tokens=10).generation.max_new_tokens == 10


def test_n_other_than_one_and_options_asking_for_something_are_refused() -> None:
    """Mutations that survived: `n != 1` as `n > 1` let n = 0 through (OpenAI refuses it);
    `top_logprobs` dropped from the refused fields was silently ignored; `tool_choice` "auto"
    (neutral without tools) refused once only "none" counted as neutral."""
    assert _refused({"n": 0}).param == "n"
    assert _refused({"top_logprobs": 5}, chat=True).param == "top_logprobs"
    assert _refused({"echo": True}).param == "echo"
    assert _job({"tool_choice": "auto", "n": 1, "top_logprobs": 0}, chat=True).chat


def test_a_batch_of_one_prompt_is_that_prompt_and_only_text_parts_pass() -> None:
    """Mutations that survived: without the batch-of-one case `prompt: ["text"]` and
    `prompt: [[ids]]` (batches of one, which the docstring and OpenAI accept) were refused as batches; a content
    part of another type carrying a `text` was joined in when only `text` was checked."""
    from moaspec.openai_api import validation

    def prompt(value):
        return validation.completion_prompt(validation.parse_request({"model": MODEL, "prompt": value}, False), TINY_VOCAB)

    assert prompt(["ab"]) == "ab" and prompt([[1, 2]]) == [1, 2]
    with pytest.raises(validation.APIError):
        validation.chat_messages(validation.parse_request(
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, True))


def test_response_bodies_name_their_object_id_and_choice_as_openai_does() -> None:
    """Mutations that survived (the openai client checks none of these): a chat id without its
    `chatcmpl-` prefix, `chat.completion` misnamed, streamed chat chunks or the usage chunk named as
    whole responses, a choice index other than 0, the usage chunk without its `moaspec` object, a
    closing chat chunk whose delta carries `content: null`, a `created` overwritten with 0."""
    from moaspec.openai_api import schemas

    chat, text = _job({"stream": True, "stream_options": {"include_usage": True}}, chat=True), _job({})
    use = schemas.usage(3, 4)
    assert use == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert schemas.new_id(True).startswith("chatcmpl-") and schemas.new_id(False).startswith("cmpl-")
    before = int(time.time())
    whole = schemas.response_body(chat, "r", MODEL, "fp", "hi", "stop", use, {"x": 1})
    assert before <= whole["created"] <= int(time.time())  # a Unix time, not a constant
    assert whole["object"] == "chat.completion" and whole["choices"][0]["index"] == 0
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"} and whole["usage"] == use
    plain = schemas.response_body(text, "r", MODEL, "fp", "hi", "length", use, {"x": 1})
    assert plain["object"] == "text_completion" and plain["choices"][0] == {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length"}
    for job, name in ((chat, "chat.completion.chunk"), (text, "text_completion")):
        chunks = [schemas.chunk_body(job, "r", MODEL, "fp", "a", None), schemas.chunk_body(job, "r", MODEL, "fp", None, "stop"),
                  schemas.usage_chunk(job, "r", MODEL, "fp", use, {"x": 1})]
        assert [c["object"] for c in chunks] == [name] * 3 and chunks[0]["choices"][0]["index"] == 0
        assert chunks[1]["choices"][0]["finish_reason"] == "stop" and chunks[2]["moaspec"] == {"x": 1}
    assert schemas.chunk_body(chat, "r", MODEL, "fp", None, "stop")["choices"][0]["delta"] == {}
    assert schemas.chunk_body(text, "r", MODEL, "fp", None, "stop")["choices"][0]["text"] == ""
