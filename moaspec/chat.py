"""Prompt encoding shared by generation and data distillation: one user message through the
target's chat template with the generation prompt (plain tokenisation when there is none)."""

from __future__ import annotations


def encode_chat_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as a single user turn, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])
