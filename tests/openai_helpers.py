"""Tiny targets with a character-level tokenizer and chat template, and a server around them, for
the OpenAI-compatible API tests (loopback only)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import torch
from conftest import TINY_VOCAB, make_random_drafter_net, make_tiny_target

from moaspec.config import SamplingConfig, TreeConfig
from moaspec.drafters.moa import MoADrafter
from moaspec.drafters.ngram import NgramDrafter
from moaspec.nn.moa import MoAConfig, MoADrafterNet
from moaspec.serving.limits import OpenAILimits
from moaspec.split.server import ServerLimits, ServerThread, SplitServer
from moaspec.targets.hf import HFTarget

KEY = "test-key"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def char_tokenizer():
    """One token per printable ASCII character or newline (96) + <unk> = TINY_VOCAB; no EOS, so
    generations run to max_tokens unless a stop sequence ends them."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["<unk>"] = len(vocab)
    assert len(vocab) == TINY_VOCAB
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_chat_target(max_positions: int = 512) -> HFTarget:
    """The same random float64 Llama every call, with the character tokenizer."""
    target = make_tiny_target("llama", max_position_embeddings=max_positions)
    return HFTarget(target.model, char_tokenizer(), "tiny-llama")


def make_drafter(method: str, target: HFTarget):
    if method == "ngram":
        return NgramDrafter()
    if method == "moa":
        config = MoAConfig.for_target(target.config)
        return MoADrafter(make_random_drafter_net(MoADrafterNet, config, target), target, TreeConfig(depth=3, top_k=2, budget=5))
    raise ValueError(method)


class SlowDrafter:
    """Any drafter, sleeping `delay_s` per proposal: makes a generation last long enough to
    disconnect from it or queue behind it, deterministically."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator):
        time.sleep(self.delay_s)
        return self.inner.propose(root_id, sampling, generator)


def start_server(
    method: str = "ngram", delay_s: float = 0.0, max_waiting: int = 8, limits: ServerLimits | None = None, calibration=None,
) -> ServerThread:
    target = tiny_chat_target()
    drafter = make_drafter(method, target)
    if delay_s:
        drafter = SlowDrafter(drafter, delay_s)
    server = SplitServer(target, drafter, [KEY], limits or ServerLimits(), OpenAILimits(max_waiting=max_waiting),
                         openai_calibration=calibration)
    return ServerThread(server).start()


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1 in `directory`, made with openssl."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key
