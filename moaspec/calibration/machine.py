"""What identifies a machine and a runtime for the calibration cache.

Costs differ by CPU model (vector width, AMX, cache sizes decide MKL's few-row products), by
thread count and by the runtime's versions, so a calibration is reused only where all of them
are the same. The CPU is named by /proc/cpuinfo's model name and the instruction-set flags that
change kernels (a KVM guest may show a generic model name such as "AMD EPYC").
"""

from __future__ import annotations

import hashlib
import platform
from pathlib import Path

KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "fma", "f16c")


def cpu_description() -> str:
    """'<model name> [flags that change kernels]', e.g. 'AMD EPYC [avx2 avx512f fma]'."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and value.strip():
                model = value.strip()
            elif key in ("flags", "Features"):
                flags = set(value.split())
            if model and flags:
                break
    except OSError:
        pass
    present = " ".join(flag for flag in KERNEL_FLAGS if flag in flags)
    return f"{model} [{present}]" if present else model


def runtime_description(target) -> str:
    """'transformers <ver> torch <ver> <dtype> <attention> <n> threads[ on <GPU name>]', or
    'llama.cpp (llama-cpp-python <ver>) <KV cache> torch <ver> <n> threads'."""
    import torch

    if target.runtime == "llama.cpp":
        import llama_cpp

        return (
            f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) q8_0/f16 KV flash-attention "
            f"torch {torch.__version__} {target.threads} threads"
        )
    import transformers

    dtype = str(target.weights_dtype).removeprefix("torch.")  # the model's (its drafters read float32)
    attention = str(getattr(target.config, "_attn_implementation", None) or "default")
    # a GPU's costs are not the CPU's (a CPU target keeps the key it always had)
    device = "" if target.device.type == "cpu" else f" on {torch.cuda.get_device_name(target.device)}"
    return (
        f"transformers {transformers.__version__} torch {torch.__version__} {dtype} "
        f"{attention} {torch.get_num_threads()} threads{device}"
    )


def key_of(*parts: str) -> str:
    """16 hex digits identifying the given descriptions together."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
