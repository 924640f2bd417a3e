"""What identifies a machine and a runtime for the calibration cache.

Costs differ by CPU model (vector width, AMX, cache sizes decide MKL's few-row products), by
thread count and by the runtime's versions, so a calibration is reused only where all of them
are the same. The CPU is named by /proc/cpuinfo's model name (on ARM: implementer and part) and
the instruction-set flags that change kernels (a KVM guest may show a generic model name such as
"AMD EPYC").
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moaspec.targets.base import Target

KERNEL_FLAGS = (
    "avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "fma", "f16c",  # x86
    "asimddp", "asimdhp", "i8mm", "sve", "sve2", "bf16",  # ARM: dot products, fp16, int8 matrices, SVE
)


def cpu_description(cpuinfo: str | None = None) -> str:
    """'<model name> [flags that change kernels]', e.g. 'AMD EPYC [avx2 avx512f fma]'; on ARM,
    whose /proc/cpuinfo names no model, the implementer and part, e.g. 'ARM 0x41 part 0xd40
    [asimddp asimdhp i8mm sve bf16]'. cpuinfo: /proc/cpuinfo's text (read when None)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if value.strip():
            fields.setdefault(key.strip(), value.strip())  # the first processor's
    model = fields.get("model name")
    if not model and "CPU implementer" in fields and "CPU part" in fields:
        model = f"ARM {fields['CPU implementer']} part {fields['CPU part']}"
    model = model or platform.processor() or platform.machine()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    present = " ".join(flag for flag in KERNEL_FLAGS if flag in flags)
    return f"{model} [{present}]" if present else model


def runtime_description(target: Target) -> str:
    """'transformers <ver> torch <ver> <dtype> <attention> <n> threads[ on <GPU name>]', or
    'llama.cpp (llama-cpp-python <ver>) <KV cache>[ unrepacked weights] torch <ver> <n> threads'
    (unrepacked: a build whose AMX kernels are avoided, llamacpp_model.repacks_weights; torch's
    version, which the drafters' costs depend on, read from its installed metadata: a generation
    that needs no model drafter does not import torch)."""
    if target.runtime == "llama.cpp":
        import llama_cpp

        from moaspec.targets.llamacpp_model import repacks_weights

        weights = "" if repacks_weights(llama_cpp) else " unrepacked weights"
        return (
            f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) q8_0/{target.value_cache_name} KV flash-attention"
            f"{weights} torch {importlib.metadata.version('torch')} {target.threads} threads"
        )
    import torch
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
