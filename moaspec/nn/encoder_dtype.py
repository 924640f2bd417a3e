"""The dtype MoA's memory encoder computes in: bfloat16 where the CPU multiplies it natively.

The encoder (Layer Self-Attention over all target layers, layer pooling, Ekv2E) runs once per
verified token, 30 rows per token for SmolLM2: about 32 M multiply-adds a token, a quarter of the
target's own forward. A prompt makes it one large batch, which on the AMX Xeon of 2026-11-22 runs
3-4x faster in bfloat16 (64 tokens: 65 ms float32, 16-20 ms bfloat16; one token: 1.5 vs 1.8 ms).
Drafts only decide how much is accepted, never what is emitted (the float32 target verifies every
token), so the lower precision can cost speed through acceptance but not correctness.

MOASPEC_ENCODER_DTYPE: auto (default: bfloat16 for a float32 drafter on a CPU with AMX or
AVX512-BF16, else the drafter's dtype), float32, bfloat16, or drafter (always the drafter's dtype).
"""

from __future__ import annotations

import os

import torch

from moaspec.errors import MoaspecError

ENCODER_DTYPE_ENV = "MOASPEC_ENCODER_DTYPE"
CHOICES = {"auto": None, "drafter": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def native_bfloat16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX512-BF16)."""
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in probes)


def encoder_dtype(drafter_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the memory encoder should compute in, per MOASPEC_ENCODER_DTYPE."""
    choice = os.environ.get(ENCODER_DTYPE_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise MoaspecError(f"{ENCODER_DTYPE_ENV} must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "auto":
        native = device.type == "cpu" and drafter_dtype == torch.float32 and native_bfloat16_cpu()
        return torch.bfloat16 if native else drafter_dtype
    return CHOICES[choice] or drafter_dtype
