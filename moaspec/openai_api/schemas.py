"""OpenAI response bodies (completions and chat completions): whole responses, streamed chunks,
usage. Requests are validated in validation.py.
"""

from __future__ import annotations

import secrets
import time

from moaspec.openai_api.validation import GenerationJob


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
