"""Shared fixtures: tiny random Llama and Qwen2 targets (float64 where exactness is claimed).

The tiny targets have no tokenizer; tests drive the engine with token ids. Random weights give
near-uniform but deterministic distributions, which is all losslessness tests need.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from moaspec.targets.hf import HFTarget

TINY_VOCAB = 97
BENCH_SCRIPTS = Path(__file__).resolve().parent.parent / "bench"

# Tiny models gain nothing from a second thread, and on a shared 2-core machine an oversubscribed
# OpenMP pool makes small ops orders of magnitude slower.
torch.set_num_threads(1)

# Loading a model calibrates the machine on first use (~20 s of timing, moaspec/calibration);
# tests that load real models would each pay it in a fresh cache, and timings must not decide
# test results. tests/test_calibration.py turns it on where it is the subject.
os.environ.setdefault("MOASPEC_NO_CALIBRATION", "1")

# The Ctrl-C tests need Python's own SIGINT handler, which a shell without job control withholds
# from a background job (`scripts/test &` starts with SIGINT ignored): put it back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _tiny_config(config_cls, **overrides):
    base = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    base.update(overrides)
    return config_cls(**base)


def make_tiny_target(
    family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float64, attn: str = "eager", **overrides
) -> HFTarget:
    """A random 2-layer target of the given family ("llama", "qwen2" or "qwen3"), eager or sdpa attention."""
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(_tiny_config(LlamaConfig, **overrides))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(_tiny_config(Qwen2Config, **overrides))
    elif family == "qwen3":  # per-head q/k norms (Target Layer Inference runs them)
        model = Qwen3ForCausalLM(_tiny_config(Qwen3Config, **({"head_dim": 16} | overrides)))
    else:
        raise ValueError(family)
    model.config._attn_implementation = attn
    # Random init gives tiny logits (near-uniform, many near-ties); scale the head so argmax is
    # well separated and greedy comparisons are meaningful.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return HFTarget(model.to(dtype).eval(), None, f"tiny-{family}")


@pytest.fixture(params=["llama", "qwen2"])
def tiny_target(request) -> HFTarget:
    return make_tiny_target(request.param)


@pytest.fixture
def tiny_llama() -> HFTarget:
    return make_tiny_target("llama")


@pytest.fixture(scope="module")
def llama_target():
    """The built-in SmolLM2-135M GGUF on the llama.cpp runtime, 2 threads, loaded once per module."""
    from moaspec.api import load_target

    return load_target("smollm2-135m", runtime="llama.cpp", threads=2)


@pytest.fixture(scope="module")
def category_prompts(llama_target) -> dict[str, list[int]]:
    """The first prompt of every benchmark category, through the chat template."""
    from moaspec.bench.prompts import CATEGORIES, load_prompts
    from moaspec.chat import encode_chat_prompt

    prompts = load_prompts(CATEGORIES, 1)
    return {name: encode_chat_prompt(llama_target.tokenizer, items[0].turns[0]) for name, items in prompts.items()}


def make_random_drafter_net(net_class, config, target: HFTarget, draft_vocab: torch.Tensor | None = None, seed: int = 0):
    """A random drafter net (MoA or EAGLE) with weights large enough that its outputs are far
    from uniform (init std 0.2, RMSNorm weights 1), in the target's dtype."""
    torch.manual_seed(seed)
    net = net_class(config)
    net.reset_parameters(std=0.2)
    if hasattr(net, "layer_mix_raw"):  # MoA's layer mix starts uniform; make it uneven here
        with torch.no_grad():
            net.layer_mix_raw.normal_(0.0, 0.2)
    if draft_vocab is not None:
        with torch.no_grad():
            net.draft_vocab_ids.copy_(draft_vocab)
    return net.to(target.dtype)


def load_bench_script(name: str):
    """A script of bench/ (not a package) as a module, e.g. load_bench_script("mtbench_top1")."""
    spec = importlib.util.spec_from_file_location(name, BENCH_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
