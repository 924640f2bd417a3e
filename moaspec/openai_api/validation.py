"""OpenAI request validation: a JSON body becomes a `GenerationJob` or an `APIError` with OpenAI's
error fields and our own one-line message.

Types are checked by pydantic models in strict mode (no "5" for 5, no bool for a number, no
float too large for a double); ranges that depend on the server (max tokens, the vocabulary, the
context) and semantic rules are checked by hand afterwards. Supported: model, prompt / messages,
max_tokens (max_completion_tokens for chat), temperature, top_p, top_k (vLLM's extension), seed,
stop (a string or up to 4), n = 1, stream, stream_options.include_usage (with stream only), user.
Options that would change the output or its form in ways the engine does not implement
(penalties, logit_bias, logprobs, echo, best_of > 1, tools and tool_choice, audio output, vLLM's
repetition_penalty / min_p / min_tokens / ignore_eos) are refused with 400 instead of being
silently ignored; other unknown fields are ignored. Defaults follow OpenAI: temperature 1, top_p 1,
max_tokens 16 for /v1/completions and "up to the context" for chat, both bounded by the server's
max new tokens; a max_tokens given beyond the context left after the prompt is a 400
(`context_length_exceeded`), as OpenAI answers.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.serving.errors import APIError
from moaspec.serving.strict_json import ProtocolError, parse_json

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "developer", "user", "assistant")


def _integral(value: int | float) -> int:
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("not an integer")
        return int(value)
    return value


Integer = Annotated[StrictInt | StrictFloat, AfterValidator(_integral)]  # 16 or 16.0
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # an int or a float that fits a double


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class _StreamOptions(_Strict):
    include_usage: StrictBool = False


class _ContentPart(_Strict):
    type: StrictStr
    text: StrictStr | None = None


class _ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[_ContentPart]


class _Request(_Strict):
    """The fields both endpoints share (types only)."""

    n: Integer | None = None
    max_tokens: Integer | None = None
    max_completion_tokens: Integer | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Integer | None = None
    seed: Integer | None = None
    stream: StrictBool | None = None
    stream_options: _StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    response_format: dict[str, Any] | None = None
    user: StrictStr | None = None  # an end-user id, unused
    # refused unless neutral (see _REFUSED)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    best_of: Any = None
    logit_bias: Any = None
    suffix: Any = None
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    modalities: Any = None
    audio: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class ChatRequest(_Request):
    messages: list[_ChatMessage] = Field(min_length=1)


_STOP_RULE = (
    f"'stop' must be a string or a list of up to {MAX_STOP_SEQUENCES} non-empty strings of at most {MAX_STOP_CHARS} characters"
)
# field -> (message, code) for a value of the wrong type; the first field in this order is reported
_TYPE_ERRORS: dict[str, tuple[str, str]] = {
    "prompt": ("'prompt' must be a non-empty string or list of token ids", "invalid_type"),
    "messages": ("'messages' must be a non-empty list", "invalid_type"),
    "n": ("'n' must be an integer", "invalid_type"),
    "max_tokens": ("'max_tokens' must be an integer", "invalid_type"),
    "max_completion_tokens": ("'max_completion_tokens' must be an integer", "invalid_type"),
    "temperature": ("'temperature' must be a number", "invalid_type"),
    "top_p": ("'top_p' must be a number", "invalid_type"),
    "top_k": ("'top_k' must be an integer", "invalid_type"),
    "seed": ("'seed' must be an integer", "invalid_type"),
    "stream": ("'stream' must be a boolean", "invalid_type"),
    "stream_options": ("'stream_options' must be an object with a boolean 'include_usage'", "invalid_type"),
    "stop": (_STOP_RULE, "invalid_value"),
    "response_format": ("only response_format {'type': 'text'} is supported", "unsupported_parameter"),
}


@dataclass(frozen=True)
class GenerationJob:
    """One validated request. prompt_ids: [T] token ids."""

    chat: bool
    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig
    generation: GenerationConfig
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool


def parse_body(raw: bytes) -> dict:
    try:
        body = parse_json(raw)
    except ProtocolError as exc:
        raise APIError(400, str(exc), code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def check_model(body: dict, model_id: str) -> None:
    model = body.get("model")
    if model is None or model == "":
        raise APIError(400, "'model' is required (a string)", "model", "missing_required_parameter")
    if not isinstance(model, str):
        raise APIError(400, f"'model' must be a string, got {type(model).__name__}", "model", "invalid_type")
    if model != model_id:
        unknown = f"the model '{_shown(model)}' does not exist (this server serves '{model_id}')"
        raise APIError(404, unknown, "model", "model_not_found")


def parse_request(body: dict, chat: bool) -> CompletionRequest | ChatRequest:
    """The body's fields, type-checked (ranges are checked later, with the encoded prompt)."""
    try:
        given = {name: value for name, value in body.items() if value is not None}  # null means "the default"
        return (ChatRequest if chat else CompletionRequest).model_validate(given)
    except ValidationError as exc:
        raise _type_error(exc) from None


def _type_error(exc: ValidationError) -> APIError:
    """The first error, in _TYPE_ERRORS order, as our own message."""
    order = list(_TYPE_ERRORS)
    first = min(exc.errors(), key=lambda e: order.index(e["loc"][0]) if e["loc"] and e["loc"][0] in order else len(order))
    loc = first["loc"]
    if len(loc) >= 2 and loc[0] == "messages" and isinstance(loc[1], int):
        param = f"messages[{loc[1]}]"
        if len(loc) == 2:
            return APIError(400, f"{param} must be an object with a role and content", param, "invalid_type")
        if loc[2] == "role":
            return APIError(400, f"{param}.role must be one of {', '.join(CHAT_ROLES)}", f"{param}.role", "invalid_value")
        return APIError(400, f"{param}.content must be a string or a list of text parts", f"{param}.content", "invalid_type")
    field = str(loc[0]) if loc else "body"
    message, code = _TYPE_ERRORS.get(field, (f"'{field}' has the wrong type", "invalid_type"))
    return APIError(400, message, field, code)


def completion_prompt(request: CompletionRequest, vocab_size: int) -> str | list[int]:
    """/v1/completions `prompt`: a string, or token ids; a batch of one of either."""
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt.strip():  # as `moaspec generate` and load().generate refuse it (chat.py)
            raise APIError(400, "the prompt is empty", "prompt", "invalid_value")
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt", "invalid_value")
        return list(prompt)
    if len(prompt) > 1:
        raise APIError(400, "batched prompts are not supported; send one prompt per request", "prompt", "unsupported_value")
    raise APIError(400, _TYPE_ERRORS["prompt"][0], "prompt", "invalid_type")


def chat_messages(request: ChatRequest) -> list[dict[str, str]]:
    """`messages` as {"role", "content"} dicts with text content (text parts joined)."""
    out = []
    for i, message in enumerate(request.messages):
        content = message.content
        if not isinstance(content, str):
            if not all(part.type == "text" and part.text is not None for part in content):
                param = f"messages[{i}].content"
                raise APIError(400, f"{param}: only text parts are supported", param, "unsupported_value")
            content = "".join(part.text for part in content)
        out.append({"role": "system" if message.role == "developer" else message.role, "content": content})
    if not any(m["content"].strip() for m in out):
        raise APIError(400, "the messages are empty", "messages", "invalid_value")
    return out


def parse_job(
    request: CompletionRequest | ChatRequest, prompt_ids: list[int], max_new_tokens: int, room: int
) -> GenerationJob:
    """The sampling/limit fields of a request whose prompt is already encoded (`prompt_ids`).

    max_new_tokens: the server's per-request limit; room: context positions left after the prompt.
    """
    chat = isinstance(request, ChatRequest)
    _refuse_unsupported(request)
    if (request.n if request.n is not None else 1) != 1:
        raise APIError(400, "only n = 1 is supported", "n", "unsupported_value")
    # chat: max_completion_tokens rules where both are given; each given one must be valid
    given = [field for field in (("max_completion_tokens", "max_tokens") if chat else ("max_tokens",))
             if getattr(request, field) is not None]
    for field in given:
        if not 1 <= getattr(request, field) <= max_new_tokens:
            shown = _shown(getattr(request, field))
            raise APIError(400, f"'{field}' must be in [1, {max_new_tokens}], got {shown}", field, "invalid_value")
    name = given[0] if given else "max_tokens"
    max_tokens = getattr(request, name)
    if max_tokens is None:
        max_tokens = min(max_new_tokens, room) if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, max_new_tokens, room)
    elif max_tokens > room:
        context = room + len(prompt_ids)
        raise APIError(
            400, f"the model's context holds {context} tokens: {len(prompt_ids)} in the prompt leave room for {room}, "
            f"but '{name}' asks for {max_tokens}", name, "context_length_exceeded",
        )
    temperature = 1.0 if request.temperature is None else request.temperature
    if not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"'temperature' must be in [0, 2], got {_shown(temperature)}", "temperature", "invalid_value")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0.0 < top_p <= 1.0:
        raise APIError(400, f"'top_p' must be in (0, 1], got {_shown(top_p)}", "top_p", "invalid_value")
    top_k = 0 if request.top_k is None or request.top_k == -1 else request.top_k  # vLLM: -1 = off, as 0
    if top_k < 0:
        raise APIError(400, f"'top_k' must be >= 0, or -1 (off, as 0), got {_shown(top_k)}", "top_k", "invalid_value")
    seed = request.seed
    if seed is None:
        seed = secrets.randbits(63)
    elif not -(2**63) <= seed < 2**64:
        raise APIError(400, "'seed' must fit in 64 bits", "seed", "invalid_value")
    stream = bool(request.stream)
    if request.stream_options is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed with 'stream': true", "stream_options", "invalid_value")
    return GenerationJob(
        chat=chat,
        prompt_ids=tuple(prompt_ids),
        sampling=SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k),
        generation=GenerationConfig(max_new_tokens=max_tokens, seed=seed),
        stop=_stop(request.stop),
        stream=stream,
        include_usage=stream and request.stream_options is not None and request.stream_options.include_usage,
    )


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_SEQUENCES or not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise APIError(400, _STOP_RULE, "stop", "invalid_value")
    return tuple(stops)


# field -> the values that ask for nothing (null always does)
_NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,),
    "best_of": (1,), "logit_bias": ({},), "suffix": ("",), "tools": ([],), "functions": ([],),
    "tool_choice": ("none", "auto"), "modalities": (["text"],), "audio": (), "repetition_penalty": (1,),
    "min_p": (0,), "min_tokens": (0,), "ignore_eos": (False,),
}


def _refuse_unsupported(request: _Request) -> None:
    for name, neutral in _NEUTRAL.items():
        value = getattr(request, name)
        if value is not None and not any(_same(value, n) for n in neutral):
            raise APIError(400, f"'{name}' is not supported by this server", name, "unsupported_parameter")
    format_ = request.response_format
    if format_ is not None and format_.get("type") != "text":
        raise APIError(400, _TYPE_ERRORS["response_format"][0], "response_format", "unsupported_parameter")


def _same(value: object, neutral: object) -> bool:
    """Equal, with booleans apart from numbers: `logprobs: 0` asks for log-probabilities on
    /v1/completions though 0 == False."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _shown(value: object) -> str:
    """A value for an error message, cut to 40 characters (a 4,000-digit number is not a message)."""
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."
