"""Where the llama.cpp runtime prefills prompts on this machine: in llama.cpp, or in float torch
with the keys and values moved into llama.cpp's cache (float_prefill.py), from which prompt length.

Which is faster depends on the CPU, the GGUF and the prompt's length: llama.cpp's quantized
products against MKL's float32 ones over the dequantized weights, which cost a fixed part per
prompt (the weights widened and streamed once) and less per token (2.5× faster for a 128-token
prompt on an Intel Xeon with SmolLM2-135M Q4_1, 1.3× on an AVX2-only AMD EPYC, where it loses at 64
tokens; README, *Target runtimes*). So where the machine calibration is on, the first prompt of
FLOAT_PREFILL_MIN_TOKENS or more is preceded by a measurement: a prompt of that length prefilled
both ways, taking turns over MEASURE_ROUNDS rounds, medians (in llama.cpp: one decode in a context
with the target's caches; in torch: the forward, the move of its keys and values into such a
context and the decode of the last token, as `set_context` does). Where the float path takes at
most FLOAT_MARGIN of llama.cpp's time there, it prefills from FLOAT_PREFILL_MIN_TOKENS (~1.5 s of
measuring on 2 cores). Otherwise a FLOAT_PREFILL_LONG_TOKENS-token prompt is timed the same way
(~9 s more on an AVX2-only EPYC): where float does not pay there either, it is never taken;
where it does, it prefills from the length where the two lines through the measurements (seconds
against tokens, one per path) meet at that margin (`start_from_timings`). The answer, a prompt length (0:
never), is saved per machine, llama.cpp build, GGUF, offloaded layers, thread count and value cache,
as the value cache is (llamacpp_value_cache.py), so every process on the machine prefills the same
way, hence gives the same tokens.

The float path's products are float32 or bfloat16 (float_prefill.py). Before the start is
measured, the float forward of a COMPUTE_TOKENS-token prompt is timed both ways, taking turns over
MEASURE_ROUNDS rounds after an uncounted one (~3 s on 2 cores): bfloat16 where it takes at most
BFLOAT16_MARGIN of float32's time, else float32 (CPUs with native bfloat16 products gain, more
with longer prompts: on an AVX-512 BF16 EPYC bfloat16 took 0.60 / 0.52 / 0.53 / 0.58 of float32's
time for 64 / 128 / 256 / 512 tokens). That answer is saved per machine like the start, and the
start is then measured and saved for it.

MOASPEC_LLAMA_PREFILL=float|bfloat16|llama.cpp fixes the choice (float: float32 products,
bfloat16: bfloat16 products, each from FLOAT_PREFILL_MIN_TOKENS); with the calibration off
(MOASPEC_NO_CALIBRATION=1) it is llama.cpp, unmeasured. The paths round differently (a prompt's
cells differ by llama.cpp's 8-bit activations or bfloat16's), so plain decoding's tokens are
those of the path chosen; trees stay exact on any (llamacpp.py).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moaspec.env_flags import NO_CALIBRATION_ENV, env_flag
from moaspec.errors import MoaspecError
from moaspec.signals import load_library_held
from moaspec.targets.llamacpp_exactness import machine_record_path, saved_or_measured_record
from moaspec.timing import interleaved_medians

if TYPE_CHECKING:
    from moaspec.targets.float_prefill import FloatLlama
    from moaspec.targets.llamacpp import LlamaCppTarget

PREFILL_ENV = "MOASPEC_LLAMA_PREFILL"
PREFILL_PATHS = ("float", "bfloat16", "llama.cpp")
PATH_COMPUTES = {"float": "float32", "bfloat16": "bfloat16", "llama.cpp": "float32"}  # the float forward's products
FLOAT_PREFILL_MIN_TOKENS = 64  # the shortest prompt (first turn, its last token included) the float path may take
FLOAT_PREFILL_LONG_TOKENS = 256  # timed too where the float path does not pay at the shortest
NEVER = 0  # a start that means: no prompt is prefilled in float
MEASURE_VERSION = 3  # 1 saved a path (float from 64 tokens, or llama.cpp), not a start; 2 timed the unfused attention
MEASURE_ROUNDS = 3
FLOAT_MARGIN = 0.9  # the float path only where it takes at most this much of llama.cpp's time
COMPUTE_TOKENS = 256  # the prompt the float forward's products are timed on, both ways (the gain grows with it)
COMPUTE_VERSION = 1
BFLOAT16_MARGIN = 0.8  # bfloat16 products only where they take at most this much of float32's time


def float_prefill_unsupported(config: Any) -> str | None:
    """Why a target of this configuration (config.json's fields) cannot be prefilled here, or None."""
    if getattr(config, "model_type", None) != "llama":
        return f"model type {getattr(config, 'model_type', None)!r} (only 'llama')"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return "biases"
    rope = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None)
    if rope.get("rope_type", "default") != "default" or (scaling and scaling.get("rope_type", "default") != "default"):
        return "scaled rotary embedding"
    return None


class SharedFloatLlama:
    """A target's FloatLlama, loaded on first use and shared by all its contexts."""

    def __init__(self, model_dir: Path, config: Any) -> None:
        self.model_dir, self.config = Path(model_dir), config
        self.unsupported = float_prefill_unsupported(config)  # None: this forward computes it
        self._model: FloatLlama | None = None
        self._release_weights = False

    @property
    def model(self) -> FloatLlama:
        if self._model is None:
            load_library_held()  # torch's first import, where a long first turn is prefilled in float32
            from moaspec.targets.float_prefill import FloatLlama

            self._model = FloatLlama(self.model_dir, self.config)
            self._model.release_weights = self._release_weights
        return self._model

    @property
    def release_weights(self) -> bool:
        """Whether the forward drops each layer's weights once used (FloatLlama.release_weights)."""
        return self._release_weights

    @release_weights.setter
    def release_weights(self, release: bool) -> None:
        self._release_weights = release
        if self._model is not None:
            self._model.release_weights = release


def _fixed_path() -> str | None:
    """The path MOASPEC_LLAMA_PREFILL names, or None; MoaspecError for another name."""
    name = os.environ.get(PREFILL_ENV, "").strip()
    if name and name not in PREFILL_PATHS:
        raise MoaspecError(f"{PREFILL_ENV} must be float, bfloat16 or llama.cpp, not {name!r}")
    return name or None


def fixed_float_prefill_start() -> int | None:
    """The start MOASPEC_LLAMA_PREFILL names (float or bfloat16: FLOAT_PREFILL_MIN_TOKENS,
    llama.cpp: NEVER), else NEVER where the calibration is off, else None (to be measured).
    MoaspecError for another name."""
    name = _fixed_path()
    if name:
        return NEVER if name == "llama.cpp" else FLOAT_PREFILL_MIN_TOKENS
    return NEVER if env_flag(NO_CALIBRATION_ENV) else None


def fixed_float_compute() -> str | None:
    """The float forward's products MOASPEC_LLAMA_PREFILL names (PATH_COMPUTES), else float32
    where the calibration is off, else None (to be measured). MoaspecError for another name."""
    name = _fixed_path()
    if name:
        return PATH_COMPUTES[name]
    return "float32" if env_flag(NO_CALIBRATION_ENV) else None


def float_prefill_compute(target: LlamaCppTarget) -> str:
    """The float forward's products for `target` (float_prefill.COMPUTES): fixed
    (fixed_float_compute), else saved or measured here (module docstring)."""
    fixed = fixed_float_compute()
    if fixed is not None:
        return fixed
    path = machine_record_path(target, "float-compute", str(COMPUTE_VERSION))
    return saved_or_measured_record(
        path, "float_compute", target, lambda: measure_float_compute(target), valid=valid_compute
    )


def valid_compute(value: object) -> bool:
    """Whether a saved compute is one the float forward takes."""
    return value in PATH_COMPUTES.values()


def compute_from_timings(float32_s: float, bfloat16_s: float) -> str:
    """The float forward's products from its seconds for one prompt with each (module docstring)."""
    return "bfloat16" if bfloat16_s <= BFLOAT16_MARGIN * float32_s else "float32"


def measure_float_compute(target: LlamaCppTarget) -> str:
    """Time the float forward of a COMPUTE_TOKENS-token prompt with each product type (module
    docstring); -> the faster, as compute_from_timings decides."""
    load_library_held()  # the float path's torch: measured only where this machine may prefill in it
    import torch

    generator = torch.Generator().manual_seed(COMPUTE_TOKENS)
    prompt = torch.randint(0, target.vocab_size, (COMPUTE_TOKENS,), generator=generator).tolist()
    seconds = interleaved_medians(
        {compute: (lambda compute=compute: target.measure_float_forward(prompt, compute)) for compute in ("float32", "bfloat16")},
        MEASURE_ROUNDS,
    )
    return compute_from_timings(seconds["float32"], seconds["bfloat16"])


def float_prefill_start(target: LlamaCppTarget) -> int:
    """The fewest tokens of a prompt's first turn (its last included) that `target` (a
    LlamaCppTarget whose model the float path supports) prefills in float torch, or NEVER:
    fixed (fixed_float_prefill_start), else saved or measured here for its products
    (`target.float_compute`; module docstring)."""
    fixed = fixed_float_prefill_start()
    if fixed is not None:
        return fixed
    path = machine_record_path(
        target, "prefill", str(MEASURE_VERSION), f"values {target.value_cache_name}", f"compute {target.float_compute}"
    )
    return saved_or_measured_record(
        path, "float_prefill_start", target, lambda: measure_float_prefill_start(target), valid=valid_start
    )


def valid_start(value: object) -> bool:
    """Whether a saved start is one this module answers."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return value == NEVER or FLOAT_PREFILL_MIN_TOKENS <= value <= FLOAT_PREFILL_LONG_TOKENS


def faster_path(llama_s: float, float_s: float) -> bool:
    """Whether the float path pays for a prompt, given its seconds on each."""
    return float_s <= FLOAT_MARGIN * llama_s


def start_from_timings(short: tuple[float, float], long: tuple[float, float] | None) -> int:
    """The start (module docstring) from the (llama.cpp, float) seconds of a
    FLOAT_PREFILL_MIN_TOKENS-token prompt and, where float does not pay there, of a
    FLOAT_PREFILL_LONG_TOKENS-token one (None: not timed, never)."""
    if faster_path(*short):
        return FLOAT_PREFILL_MIN_TOKENS
    if long is None or not faster_path(*long):
        return NEVER
    # float's excess over the margin, linear in the length: positive at the short prompt, not at the long one
    excess_short = short[1] - FLOAT_MARGIN * short[0]
    excess_long = long[1] - FLOAT_MARGIN * long[0]
    span = FLOAT_PREFILL_LONG_TOKENS - FLOAT_PREFILL_MIN_TOKENS
    meet = FLOAT_PREFILL_MIN_TOKENS + span * excess_short / (excess_short - excess_long)
    return min(FLOAT_PREFILL_LONG_TOKENS, math.ceil(meet))


def measure_float_prefill_start(target: LlamaCppTarget) -> int:
    """Time prompts' prefills both ways (module docstring); -> the start."""
    ctx = None
    try:
        ctx = target.new_measuring_context(2 * FLOAT_PREFILL_LONG_TOKENS, target.value_cache_type)
        short = _median_prefill_s(target, ctx, FLOAT_PREFILL_MIN_TOKENS, warm_up=True)
        long = None if faster_path(*short) else _median_prefill_s(target, ctx, FLOAT_PREFILL_LONG_TOKENS)
    except MoaspecError:  # a model llama.cpp cannot time this way (too short a context): never
        return NEVER
    finally:
        if ctx is not None:
            target.free_measuring_context(ctx)
    return start_from_timings(short, long)


def _median_prefill_s(target, ctx, length: int, warm_up: bool = False) -> tuple[float, float]:
    """(llama.cpp, float) median seconds of a `length`-token prompt's prefill into `ctx`, the two
    taking turns over MEASURE_ROUNDS rounds (after an uncounted one where `warm_up`)."""
    load_library_held()  # the float path's: measured only where this machine may prefill in torch
    import torch

    generator = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, target.vocab_size, (length,), generator=generator).tolist()

    def prefill(through_float: bool) -> float:
        target.clear_measuring_context(ctx)  # not timed
        started = time.perf_counter()
        target.measure_prefill(ctx, prompt, through_float=through_float)
        return time.perf_counter() - started

    seconds = interleaved_medians(
        {"llama.cpp": lambda: prefill(False), "float": lambda: prefill(True)}, MEASURE_ROUNDS, warm_up_rounds=int(warm_up)
    )
    return seconds["llama.cpp"], seconds["float"]
