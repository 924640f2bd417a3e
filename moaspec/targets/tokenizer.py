"""A light tokenizer for the llama.cpp runtime: the `tokenizers` library and the chat template,
without importing transformers (~1 s of start-up: importing it 0.5 s, its auto mappings 0.3 s,
loading the tokenizer 0.2 s, against 0.07 s here).

It gives the token ids transformers' fast tokenizer gives for the same directory (tested on every
benchmark prompt, tests/test_tokenizer.py): the same `tokenizer.json` underneath, and the chat
template rendered as transformers 5 renders it (a sandboxed jinja2 environment with trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML, and the special tokens as variables). The API is the part moaspec and transformers'
streamers use: `tokenizer(text)["input_ids"]`, `apply_chat_template`, `decode`, the special token
ids and `chat_template`. `load_light_tokenizer` returns None where this is not enough (no
tokenizer.json, a template using features this does not provide): the caller then loads
transformers' tokenizer.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import torch
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class LightTokenizer:
    """See the module docstring."""

    def __init__(self, backend: Tokenizer, config: dict, chat_template: str | None) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = {name: config[name] for name in SPECIAL_TOKENS if isinstance(config.get(name), str)}
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._template = None

    def __getattr__(self, name: str):
        if name.endswith("_token_id") and name.removesuffix("_id") in SPECIAL_TOKENS:
            token = self.special_tokens.get(name.removesuffix("_id"))
            return None if token is None else self.backend.token_to_id(token)
        raise AttributeError(name)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens)["input_ids"]

    def decode(
        self, token_ids: Sequence[int] | np.ndarray | torch.Tensor, skip_special_tokens: bool = False, **_: object
    ) -> str:
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False, tokenize: bool = True,
        return_dict: bool = False,
    ) -> str | list[int] | dict[str, list[int]]:
        """The conversation through the chat template; tokenized without adding special tokens."""
        if self._template is None:
            self._template = _compile(self.chat_template)
        plain = [{key: value for key, value in message.items()} for message in messages]
        text = self._template.render(
            messages=plain, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
            **self.special_tokens,
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids} if return_dict else ids


def load_light_tokenizer(model_dir: Path) -> LightTokenizer | None:
    """The light tokenizer of a converted target directory, or None where it would not do."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if template is not None and not isinstance(template, str):
        return None  # several named templates: transformers' tokenizer picks among them
    if template is not None and ("{% generation" in template or "namespace(" in template):
        return None  # features of transformers' environment this one leaves out
    from tokenizers import Tokenizer

    return LightTokenizer(Tokenizer.from_file(str(path)), config, template)


def _compile(template: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(template)


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization (spaces before punctuation and contractions)."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text
