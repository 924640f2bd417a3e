"""Where the llama.cpp runtime prefills prompts on this machine: in llama.cpp, or in float32 torch
with the keys and values moved into llama.cpp's cache (float_prefill.py).

Which is faster depends on the CPU and the GGUF: llama.cpp's quantized products against MKL's
float32 ones over the dequantized weights (2.5× faster for a 128-token prompt on an Intel Xeon with
SmolLM2-135M Q4_1; README, *Target runtimes*). So where the machine calibration is on, the first
prompt of FLOAT_PREFILL_MIN_TOKENS or more is preceded by a measurement (~1.5 s on 2 cores): a
prompt of that length prefilled both ways, taking turns over MEASURE_ROUNDS rounds, medians (in
llama.cpp: one decode in a context with the target's caches; in torch: the forward, the move of
its keys and values into such a context and the decode of the last token, as `set_context` does);
float only where at most FLOAT_MARGIN of llama.cpp's time. The shortest prompt is where the float
path gains least (its products grow more efficient with the rows, llama.cpp's do not). The answer
is saved per machine, llama.cpp build, GGUF, offloaded layers and thread count, as the value cache
is (llamacpp_value_cache.py), so every process on the machine prefills the same way, hence gives
the same tokens.

MOASPEC_LLAMA_PREFILL=float|llama.cpp fixes the choice; with the calibration off
(MOASPEC_NO_CALIBRATION=1) it is llama.cpp, unmeasured. The two round differently (a prompt's
cells differ by llama.cpp's 8-bit activations), so plain decoding's tokens are those of the path
chosen; trees stay exact on either (llamacpp.py).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from moaspec.env_flags import NO_CALIBRATION_ENV, env_flag
from moaspec.errors import MoaspecError
from moaspec.targets.llamacpp_exactness import machine_record_path, saved_or_measured_record

PREFILL_ENV = "MOASPEC_LLAMA_PREFILL"
PREFILL_PATHS = ("float", "llama.cpp")
FLOAT_PREFILL_MIN_TOKENS = 64  # prompts this long or longer may be prefilled in float32 torch
MEASURE_VERSION = 1
MEASURE_ROUNDS = 3
FLOAT_MARGIN = 0.9  # the float path only where it takes at most this much of llama.cpp's time


def fixed_prefill_path() -> str | None:
    """The path MOASPEC_LLAMA_PREFILL names, else llama.cpp where the calibration is off, else None
    (to be measured). MoaspecError for another name."""
    name = os.environ.get(PREFILL_ENV, "").strip()
    if name:
        if name not in PREFILL_PATHS:
            raise MoaspecError(f"{PREFILL_ENV} must be float or llama.cpp, not {name!r}")
        return name
    return "llama.cpp" if env_flag(NO_CALIBRATION_ENV) else None


def prefill_path(target) -> str:
    """'float' or 'llama.cpp' for `target` (a LlamaCppTarget whose model the float path supports):
    fixed (fixed_prefill_path), else saved or measured here (module docstring)."""
    fixed = fixed_prefill_path()
    if fixed is not None:
        return fixed
    path = machine_record_path(target, "prefill", str(MEASURE_VERSION), f"values {target.value_cache_name}")
    return saved_or_measured_record(
        path, "prefill_path", target, lambda: "float" if measure_float_prefill(target) else "llama.cpp",
        valid=PREFILL_PATHS.__contains__,
    )


def faster_path(llama_s: float, float_s: float) -> bool:
    """Whether the float path is chosen, given a prompt's seconds on each."""
    return float_s <= FLOAT_MARGIN * llama_s


@torch.inference_mode()
def measure_float_prefill(target) -> bool:
    """Time a FLOAT_PREFILL_MIN_TOKENS-token prompt's prefill both ways (module docstring); -> whether
    the float path is faster by the margin."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.vocab_size, (FLOAT_PREFILL_MIN_TOKENS,), generator=generator).tolist()
    seconds: dict[str, list[float]] = {"llama.cpp": [], "float": []}
    ctx = None
    try:
        ctx = target.new_measuring_context(2 * FLOAT_PREFILL_MIN_TOKENS, target.value_cache_type)
        for round_ in range(MEASURE_ROUNDS + 1):  # the first round warms both up and is not counted
            for name in seconds:
                target.clear_measuring_context(ctx)
                started = time.perf_counter()
                target.measure_prefill(ctx, prompt, through_float=name == "float")
                if round_:
                    seconds[name].append(time.perf_counter() - started)
    except MoaspecError:  # a model llama.cpp cannot time this way (too short a context): llama.cpp
        return False
    finally:
        if ctx is not None:
            target.free_measuring_context(ctx)
    return faster_path(statistics.median(seconds["llama.cpp"]), statistics.median(seconds["float"]))
