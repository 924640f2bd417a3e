"""bench/prompt_context_gain.py: each case takes the path it names, nothing is reused between
calls, the runtime's threshold is left as it was, and a bad --value-caches is a usage error."""

from __future__ import annotations

import argparse
import random

import pytest
from conftest import load_bench_script


def test_each_case_times_the_path_it_names_and_restores_the_thresholds() -> None:
    from moaspec.api import load_target
    from moaspec.targets import llamacpp, llamacpp_prompt_paths

    script = load_bench_script("prompt_context_gain")
    target = load_target("smollm2-135m", runtime="llama.cpp", threads=2).new_session()
    thresholds = llamacpp.PROMPT_CONTEXT_MIN_TOKENS, llamacpp_prompt_paths.FLOAT_PREFILL_MIN_TOKENS, target._float_start
    generator = random.Random(0)
    assert script.set_context_ms(target, 40, "prompt context", generator) > 0
    assert target._moved == 40 and len(target._prompt_tokens) == 40
    assert script.set_context_ms(target, 40, "verified context", generator) > 0
    assert target._moved == 0 and target.num_cached == 40
    assert script.set_context_ms(target, 40, "float32 torch", generator) > 0
    assert target._moved == 39 and len(target._float_cache.tokens) == 39 and target._float_cache.compute == "float32"
    assert script.set_context_ms(target, 40, "bfloat16 torch", generator) > 0
    assert target._moved == 39 and len(target._float_cache.tokens) == 39 and target._float_cache.compute == "bfloat16"
    assert (llamacpp.PROMPT_CONTEXT_MIN_TOKENS, llamacpp_prompt_paths.FLOAT_PREFILL_MIN_TOKENS, target._float_start) == thresholds


def test_value_caches_are_checked_with_a_usage_message() -> None:
    script = load_bench_script("prompt_context_gain")
    assert script.value_cache_list("q8_0, f16") == ["q8_0", "f16"]
    for text, says in (("q4_0", "unknown value cache q4_0 \\(known: f16, q8_0\\)"), (",", "the list has an empty item: ','"), ("", "the list is empty")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            script.value_cache_list(text)
