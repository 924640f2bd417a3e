"""Prompt encoding shared by generation, data distillation and the benchmark: messages through
the target's chat template with the generation prompt (plain tokenisation when there is none)."""

from __future__ import annotations

from typing import Any

from moaspec.errors import MoaspecError


def check_prompt_text(text: object) -> str:
    """`text` if it is a prompt a tokenizer can take: a non-blank string of valid Unicode (bytes
    that are not UTF-8 reach Python's argv as lone surrogates); MoaspecError otherwise."""
    if not isinstance(text, str):
        raise MoaspecError(f"the prompt must be a string or a list of token ids, got {type(text).__name__}")
    if not text.strip():
        raise MoaspecError("the prompt is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise MoaspecError("the prompt is not valid UTF-8 text") from None
    return text


def encode_chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` as a single user turn, ready for the assistant's answer."""
    return encode_chat_messages(tokenizer, [{"role": "user", "content": text}])


def encode_chat_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation (`{"role", "content"}` dicts ending with a user turn), ready for
    the assistant's answer. Without a chat template the contents are joined by blank lines."""
    if not getattr(tokenizer, "chat_template", None):
        text = "\n\n".join(message["content"] for message in messages)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def generation_prompt_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokens the chat template appends to a conversation for the assistant's answer (SmolLM2:
    `<|im_start|>assistant\n`); empty without a template or where they are not a plain suffix."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return ()
    messages = [{"role": "user", "content": "x"}]
    try:
        with_prompt, without = (
            list(tokenizer.apply_chat_template(messages, add_generation_prompt=flag, tokenize=True, return_dict=True)["input_ids"])
            for flag in (True, False)
        )
    except Exception:  # noqa: BLE001  a template that needs more than one user turn: no suffix to find
        return ()
    if len(with_prompt) <= len(without) or with_prompt[: len(without)] != without:
        return ()
    return tuple(with_prompt[len(without) :])
