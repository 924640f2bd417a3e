"""Printing generated text as it is verified, whole words at a time (the CLI's stdout), and
keeping the verified token ids (what `--json` prints if the generation is interrupted).

The same rules as transformers' `TextStreamer` (what the CLI used before): the token ids so far
are decoded together; text is printed up to the last space, or all of it after a newline or a
CJK character; `end()` prints the rest and a newline. Kept here so the llama.cpp generate path
does not import transformers (its import alone is ~0.5 s of start-up).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    import torch

# CJK Unified Ideographs and their extensions (and compatibility ideographs), as transformers checks
CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)


class TextPrinter:
    """A streamer (`put(ids)`, `end()`) printing decoded text to `out`; skip_prompt drops the
    first `put` (the prompt, as the engine's callers send it). As transformers' TextStreamer,
    `end()` ends the text with a newline, unless no token came (an interrupt before the first)."""

    takes_token_lists = True  # SpeculativeLM.generate puts lists, not torch tensors

    def __init__(
        self, tokenizer: Any, skip_prompt: bool = True, out: TextIO | None = None, **decode_kwargs: Any
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.decode_kwargs = decode_kwargs
        self.out = out
        self.token_cache: list[int] = []
        self.print_len = 0
        self.next_tokens_are_prompt = True
        self.any_tokens = False  # since the prompt

    def put(self, value: list[int] | list[list[int]] | torch.Tensor) -> None:
        ids = _token_list(value)
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(ids)
        self.any_tokens = self.any_tokens or bool(ids)
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        if text.endswith("\n"):
            printable = text[self.print_len :]
            self.token_cache, self.print_len = [], 0
        elif text and _is_cjk(ord(text[-1])):
            printable = text[self.print_len :]
            self.print_len += len(printable)
        else:
            printable = text[self.print_len : text.rfind(" ") + 1]
            self.print_len += len(printable)
        self._print(printable)

    def end(self) -> None:
        printable = ""
        if self.token_cache:
            printable = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)[self.print_len :]
        self.token_cache, self.print_len = [], 0
        self.next_tokens_are_prompt = True
        if self.any_tokens:
            self._print(printable, end="\n")
        self.any_tokens = False

    def _print(self, text: str, end: str = "") -> None:
        print(text, flush=True, end=end, file=self.out if self.out is not None else sys.stdout)


class TokenCollector:
    """A streamer (`put(ids)`, `end()`) keeping the new token ids; the first `put` (the prompt)
    is dropped, as TextPrinter's skip_prompt does."""

    takes_token_lists = True  # SpeculativeLM.generate puts lists, not torch tensors

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self._prompt_seen = False

    def put(self, value: list[int] | list[list[int]] | torch.Tensor) -> None:
        if self._prompt_seen:
            self.token_ids.extend(_token_list(value))
        self._prompt_seen = True

    def end(self) -> None:
        pass


def _token_list(value) -> list[int]:
    """A streamer's `put` argument (a tensor or list, [n] or [1, n]) as a list of ids."""
    ids = value.tolist() if hasattr(value, "tolist") else list(value)
    return ids[0] if ids and isinstance(ids[0], list) else ids


def _is_cjk(code: int) -> bool:
    return any(low <= code <= high for low, high in CJK_RANGES)
