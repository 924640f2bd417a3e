"""Which value cache the llama.cpp runtime's verified context has on this machine: f16 or q8_0.

Both keep tree verification exact (llamacpp.py's module docstring: one per-query attention kernel
with q8_0 keys, whatever the batch); which decodes faster depends on the CPU. On the AVX-512 EPYC
an f16 value cache decodes one token 7-10 % faster than q8_0; on an Intel Xeon with avx512_fp16
q8_0 values are 25-42 % faster (README, *Target runtimes*). So where the machine calibration is on,
the first context the target needs on a machine is preceded by a measurement (~3 s on 2 cores):
one-token decoding after MEASURE_CONTEXT tokens with each value cache (raw llama_decode loops in two
contexts prefilled once, taking turns over MEASURE_ROUNDS rounds, medians), q8_0 kept only where
it is faster by the margin Q8_0_MARGIN. The answer is saved per machine, llama.cpp build, GGUF
content, offloaded layers and thread count, as the exact tree size is (llamacpp_exactness.py), so
every later process on the machine, whatever path its GGUF is installed at, decodes with the same
cache, hence the same tokens.

MOASPEC_LLAMA_VALUE_CACHE=f16|q8_0 fixes the choice; with the calibration off
(MOASPEC_NO_CALIBRATION=1) it is f16, unmeasured. The two round differently, so plain decoding's
tokens are those of the cache chosen.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from moaspec.env_flags import NO_CALIBRATION_ENV, env_flag
from moaspec.errors import MoaspecError
from moaspec.signals import load_library_held
from moaspec.targets.llamacpp_exactness import machine_record_path, saved_or_measured_record
from moaspec.timing import interleaved_medians

if TYPE_CHECKING:
    from moaspec.targets.llamacpp import LlamaCppTarget

VALUE_CACHE_ENV = "MOASPEC_LLAMA_VALUE_CACHE"
VALUE_CACHE_TYPES = {"f16": 1, "q8_0": 8}  # ggml types: the value caches the per-query kernel keeps exact
VALUE_CACHE_NAMES = {kind: name for name, kind in VALUE_CACHE_TYPES.items()}
DEFAULT_VALUE_CACHE = "f16"
MEASURE_VERSION = 1
MEASURE_CONTEXT = 256  # tokens before the timed decodes
MEASURE_STEPS = 12  # one-token decodes timed per round and cache
MEASURE_ROUNDS = 3
MEASURE_CELLS = 512  # the measuring contexts' cells: the context and every round's tokens
Q8_0_MARGIN = 0.9  # q8_0 values only where one token costs at most this much of f16's


def fixed_value_cache_type() -> int | None:
    """The ggml type MOASPEC_LLAMA_VALUE_CACHE names, else f16 where the calibration is off, else
    None (to be measured). MoaspecError for a name other than f16 or q8_0."""
    name = os.environ.get(VALUE_CACHE_ENV, "").strip()
    if name:
        if name not in VALUE_CACHE_TYPES:
            raise MoaspecError(f"{VALUE_CACHE_ENV} must be f16 or q8_0, not {name!r}")
        return VALUE_CACHE_TYPES[name]
    return VALUE_CACHE_TYPES[DEFAULT_VALUE_CACHE] if env_flag(NO_CALIBRATION_ENV) else None


def value_cache_type(target: LlamaCppTarget) -> int:
    """The ggml type of the verified context's values for `target` (a LlamaCppTarget): fixed
    (fixed_value_cache_type), else saved or measured here (module docstring)."""
    fixed = fixed_value_cache_type()
    if fixed is not None:
        return fixed
    path = machine_record_path(target, "value-cache", str(MEASURE_VERSION))
    return saved_or_measured_record(path, "value_cache_type", target, lambda: measure_value_cache_type(target))


def faster_value_cache(f16_s: float, q8_0_s: float) -> int:
    """The ggml type to use given one-token seconds with f16 and with q8_0 values."""
    return VALUE_CACHE_TYPES["q8_0"] if q8_0_s <= Q8_0_MARGIN * f16_s else VALUE_CACHE_TYPES["f16"]


def measure_value_cache_type(target: LlamaCppTarget) -> int:
    """Time one-token decoding with each value cache, in two contexts of the target's own
    prefilled once with the same MEASURE_CONTEXT tokens and then decoding in turns (module
    docstring); -> the faster's ggml type."""
    load_library_held()  # its random tokens are torch's (once per machine, then read from its record)
    import torch

    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, target.vocab_size, (MEASURE_CONTEXT,), generator=generator).tolist()
    contexts = {}
    try:
        for kind in VALUE_CACHE_TYPES.values():
            contexts[kind] = target.new_measuring_context(MEASURE_CELLS, kind)
        last = {kind: _decode(target, ctx, context) for kind, ctx in contexts.items()}

        def steps(kind: int) -> None:
            for _ in range(MEASURE_STEPS):
                last[kind] = _decode(target, contexts[kind], [last[kind]])

        seconds = interleaved_medians({kind: (lambda kind=kind: steps(kind)) for kind in contexts}, MEASURE_ROUNDS, warm_up_rounds=0)
    except MoaspecError:  # a model llama.cpp cannot time this way (too short a context): the default
        return VALUE_CACHE_TYPES[DEFAULT_VALUE_CACHE]
    finally:
        for ctx in contexts.values():
            target.free_measuring_context(ctx)
    f16, q8_0 = (seconds[VALUE_CACHE_TYPES[name]] / MEASURE_STEPS for name in ("f16", "q8_0"))  # one token's
    return faster_value_cache(f16, q8_0)


def _decode(target, ctx, tokens: list[int]) -> int:
    """llama_decode `tokens` in `ctx`; -> the greedy next token."""
    lib = target.lib
    batch = (lib.llama_token * len(tokens))(*tokens)  # held: the batch only points at it
    if lib.llama_decode(ctx, lib.llama_batch_get_one(batch, len(tokens))):
        raise MoaspecError("llama.cpp could not decode the value cache measurement's tokens")
    return int(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(target.vocab_size,)).argmax())
