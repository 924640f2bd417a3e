"""Keep glibc's allocator from unmapping freed memory while a drafter trains or the target
distills (`moaspec train`, `moaspec data distill`).

A training step allocates and frees tensors of tens to hundreds of MB (attention scores, the
draft vocabulary's logits, their gradients), a batched generation step its batch's logits and
activations. glibc serves blocks above its mmap threshold (dynamic, 128 KB up to 32 MB) with
fresh mappings and unmaps them when they are freed, and gives the heap's free top back above its
trim threshold, so every step page-faults the same memory in again. `keep_freed_memory` raises
both thresholds to 2 GiB: freed blocks stay in the heap and the next step reuses them.

Measured in session 16 (AVX2-only AMD EPYC, 2 threads, MoA `--memory-layers 4`, forward and
backward of 8 sequences from the feature cache, 3 repeats): 4.1-4.35 s -> 3.7-3.9 s one sequence
at a time, 7.3-7.6 s -> 4.5-5.6 s as one micro-batch of 8; peak RSS 3.1 -> 3.8 GB. Whole
`moaspec train` steps (bench/results/train-allocator-s16/): 1,523-1,574 -> 1,652-1,656 tok/s one
at a time, 806-821 -> 1,263-1,358 tok/s in micro-batches of 8. `moaspec data distill` of 48
conversations (batch 48, 64 new tokens, alternating, 2 rounds each): 72-81 s -> 56-57 s, 43.5 ->
57.0 new tokens/s, the same rows. The cost it removes is the kernel's (page faults), not the
CPU's arithmetic, so it does not depend on the CPU's ISA.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's malloc.h
M_MMAP_THRESHOLD = -3
KEPT_BYTES = 2**31 - 1  # the largest value mallopt takes (an int)


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds in this process (see the module docstring).
    -> whether both took effect; False, changing nothing, where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, KEPT_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, KEPT_BYTES))
