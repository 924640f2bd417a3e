"""OpenAI request validation and response bodies (completions and chat completions).

A request becomes a `GenerationJob` or an `APIError` with OpenAI's error fields. Supported:
model, prompt / messages, max_tokens (max_completion_tokens for chat), temperature, top_p, seed,
stop (a string or up to 4), n = 1, stream, stream_options.include_usage, user. Options that would
change the output distribution in ways the engine does not implement (penalties, logit_bias,
logprobs, echo, best_of > 1, tools) are refused with 400 instead of being silently ignored;
unknown fields are ignored. Defaults follow OpenAI: temperature 1, top_p 1, max_tokens 16 for
/v1/completions and "up to the context" (bounded by the server's max new tokens) for chat.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

from moaspec.config import GenerationConfig, SamplingConfig

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant")


class APIError(Exception):
    """An OpenAI-shaped refusal: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationJob:
    """One validated request. prompt_ids: [T] token ids; messages: the chat turns (chat only)."""

    chat: bool
    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig
    generation: GenerationConfig
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def check_model(body: dict, model_id: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required (a string)", "model", "missing_required_parameter")
    if model != model_id:
        raise APIError(404, f"the model '{model}' does not exist (this server serves '{model_id}')", "model", "model_not_found")


def parse_job(body: dict, chat: bool, prompt_ids: list[int], max_new_tokens: int, room: int) -> GenerationJob:
    """The sampling/limit fields of a request whose prompt is already encoded (`prompt_ids`).

    max_new_tokens: the server's per-request limit; room: context positions left after the prompt.
    """
    _refuse_unsupported(body)
    n = _number(body, "n", int, 1)
    if n != 1:
        raise APIError(400, "only n = 1 is supported", "n", "unsupported_value")
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = min(max_new_tokens, room) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
    max_tokens = _number(body, name, int, default)
    if not 1 <= max_tokens <= max_new_tokens:
        raise APIError(400, f"'{name}' must be in [1, {max_new_tokens}], got {max_tokens}", name, "invalid_value")
    temperature = _number(body, "temperature", float, 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"'temperature' must be in [0, 2], got {temperature}", "temperature", "invalid_value")
    top_p = _number(body, "top_p", float, 1.0)
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}", "top_p", "invalid_value")
    seed = _number(body, "seed", int, None)
    if seed is None:
        seed = secrets.randbits(63)
    elif not -(2**63) <= seed < 2**64:
        raise APIError(400, "'seed' must fit in 64 bits", "seed", "invalid_value")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
    return GenerationJob(
        chat=chat,
        prompt_ids=tuple(prompt_ids),
        sampling=SamplingConfig(temperature=temperature, top_p=top_p),
        generation=GenerationConfig(max_new_tokens=max_tokens, seed=seed),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=stream and bool(options.get("include_usage")),
    )


def completion_prompt(body: dict, vocab_size: int) -> str | list[int]:
    """/v1/completions `prompt`: a string, or token ids; a batch of one of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt", "invalid_value")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt", "invalid_value")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(400, "batched prompts are not supported; send one prompt per request", "prompt", "unsupported_value")
    raise APIError(400, "'prompt' must be a non-empty string or list of token ids", "prompt", "invalid_type")


def chat_messages(body: dict) -> list[dict[str, str]]:
    """`messages` as {"role", "content"} dicts with text content (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{param} must be an object", param, "invalid_type")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise APIError(400, f"{param}.role must be one of {', '.join(CHAT_ROLES)}", f"{param}.role", "invalid_value")
        out.append({"role": "system" if role == "developer" else role, "content": _content(message.get("content"), param)})
    if not any(m["content"].strip() for m in out):
        raise APIError(400, "the messages are empty", "messages", "invalid_value")
    return out


def _content(content, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        if all(part.get("type") == "text" and isinstance(part.get("text"), str) for part in content):
            return "".join(part["text"] for part in content)
        raise APIError(400, f"{param}.content: only text parts are supported", f"{param}.content", "unsupported_value")
    raise APIError(400, f"{param}.content must be a string or a list of text parts", f"{param}.content", "invalid_type")


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise APIError(
            400, f"'stop' must be a string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings of at most {MAX_STOP_CHARS} characters",
            "stop", "invalid_value",
        )
    return tuple(stops)


def _number(body: dict, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}", name, "invalid_type")
    return kind(value)


_REFUSED = {
    "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "top_logprobs": 0, "echo": False,
    "best_of": 1, "logit_bias": {}, "suffix": "", "tools": [], "functions": [],
}


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in _REFUSED.items():
        value = body.get(name)
        if value is not None and value != neutral and value != {} and value != [] and value is not False:
            raise APIError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    format_ = body.get("response_format")
    if format_ is not None and (not isinstance(format_, dict) or format_.get("type") != "text"):
        raise APIError(400, "only response_format {'type': 'text'} is supported", "response_format", "unsupported_parameter")


# -- responses ------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def response_body(job: GenerationJob, rid: str, model: str, fingerprint: str, text: str, finish_reason: str, use: dict, extension: dict) -> dict:
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": now(), "model": model,
        "system_fingerprint": fingerprint, "choices": [choice], "usage": use, "moaspec": extension,
    }


def chunk_body(job: GenerationJob, rid: str, model: str, fingerprint: str, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
    """One streamed chunk; text None with a finish reason is the closing chunk."""
    if job.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": now(), "model": model,
        "system_fingerprint": fingerprint, "choices": [choice],
    }


def usage_chunk(job: GenerationJob, rid: str, model: str, fingerprint: str, use: dict, extension: dict) -> dict:
    return {
        "id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": now(), "model": model,
        "system_fingerprint": fingerprint, "choices": [], "usage": use, "moaspec": extension,
    }
