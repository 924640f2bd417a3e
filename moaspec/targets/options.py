"""Choosing a target runtime: the rules and the command-line flags (no torch import: the CLI
checks its flags before any model loads)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError
from moaspec.model_store import BUILTIN_TARGETS, check_target_spec

if TYPE_CHECKING:
    import argparse

RUNTIMES = ("transformers", "llama.cpp")
DTYPES = ("float32", "bfloat16", "float16")  # --dtype (targets/load.py takes float64 too)


def check_runtime(runtime: str | None, spec: str) -> str:
    """The runtime to use for `spec` (None = its default); MoaspecError when it cannot run it."""
    check_target_spec(spec)
    if runtime is None:
        return default_runtime(spec)
    if runtime not in RUNTIMES:
        raise MoaspecError(f"unknown runtime '{runtime}' (known: {', '.join(RUNTIMES)})")
    if runtime == "llama.cpp":
        if not (spec in BUILTIN_TARGETS or spec.endswith(".gguf")):
            raise MoaspecError(
                f"the llama.cpp runtime runs GGUF targets; '{spec}' is not one (use --runtime transformers)"
            )
        if not llama_cpp_available():
            raise MoaspecError("the llama.cpp runtime needs llama-cpp-python: pip install llama-cpp-python==0.3.36")
    return runtime


def default_runtime(spec: str) -> str:
    """llama.cpp for GGUF targets when llama-cpp-python is installed, else transformers."""
    if spec in BUILTIN_TARGETS or spec.endswith(".gguf"):
        return "llama.cpp" if llama_cpp_available() else "transformers"
    return "transformers"


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def add_runtime_arguments(parser: argparse.ArgumentParser) -> None:
    """--runtime, --device, --dtype, --threads, --n-gpu-layers (argparse; llama.cpp's own name for it, with
    --gpu-layers and -ngl as aliases)."""
    group = parser.add_argument_group("target runtime")
    group.add_argument(
        "--runtime", choices=RUNTIMES, default=None,
        help="llama.cpp (GGUF targets; their default when llama-cpp-python is installed) or transformers "
        "(any target; the default for HF directories)",
    )
    group.add_argument("--device", default="cpu", help="transformers runtime: cpu, cuda or cuda:N (default cpu)")
    group.add_argument(
        "--dtype", choices=DTYPES, default="float32",
        help="transformers runtime: the target's precision (default float32, the lossless one; bfloat16 "
        "and float16 are faster on GPUs and on CPUs with bfloat16 units, but a forward's output then depends "
        "on how many tokens it holds, so speculative output may differ from plain decoding)",
    )
    group.add_argument("--threads", type=int, default=None, help="llama.cpp runtime: CPU threads (default: torch's)")
    group.add_argument(
        "--n-gpu-layers", "--gpu-layers", "-ngl", dest="gpu_layers", type=int, default=0,
        help="llama.cpp runtime: layers offloaded to a GPU by a GPU build of llama-cpp-python (default 0)",
    )


def runtime_options(args: argparse.Namespace, target: str) -> dict:
    """Checked load_target keyword arguments from the flags of add_runtime_arguments."""
    runtime = check_runtime(args.runtime, target)
    check_placement(runtime, args.device, args.dtype, args.threads, args.gpu_layers, FLAG_NAMES)
    return {
        "runtime": runtime, "device": args.device, "threads": args.threads, "gpu_layers": args.gpu_layers,
        "dtype": args.dtype,
    }


# how the CLI spells the settings check_placement names (load() uses the keywords themselves)
FLAG_NAMES = {"device": "--device", "dtype": "--dtype", "threads": "--threads", "gpu_layers": "--n-gpu-layers"}


def check_placement(
    runtime: str, device: str, dtype: str, threads: int | None, gpu_layers: int, names: dict[str, str] | None = None
) -> None:
    """Where and how a target runs (dtype by name, e.g. "float32"), checked against its runtime:
    MoaspecError naming the setting as the caller spells it (`names`: the CLI's flags; default:
    load()'s keywords). Run by the CLI before torch loads, and by load_target for the library."""
    name = names or {key: key for key in FLAG_NAMES}
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise MoaspecError(f"{name['threads']} must be >= 1 (an integer), got {threads!r}")
    if isinstance(gpu_layers, bool) or not isinstance(gpu_layers, int) or gpu_layers < 0:
        raise MoaspecError(f"{name['gpu_layers']} must be >= 0 (an integer), got {gpu_layers!r}")
    if runtime == "llama.cpp" and device != "cpu":
        raise MoaspecError(f"{name['device']} applies to the transformers runtime; llama.cpp takes {name['gpu_layers']}")
    if runtime == "llama.cpp" and dtype != "float32":
        raise MoaspecError(
            f"{name['dtype']} applies to the transformers runtime; a GGUF target's precision on llama.cpp is its "
            "quantization type"
        )
    if runtime == "transformers" and (threads is not None or gpu_layers):
        raise MoaspecError(f"{name['threads']} and {name['gpu_layers']} apply to the llama.cpp runtime")
    check_device(device, name["device"])


def default_threads() -> int:
    """The llama.cpp runtime's CPU threads when none are given: as many as torch's intra-op pool
    has by default, so the target and a model drafter share the cores alike. torch's own count
    where torch is loaded; otherwise its rule, read without importing it (a generation that needs
    no model drafter never does): MKL_NUM_THREADS, else OMP_NUM_THREADS, at most the physical
    cores this process may run on (MKL's cap), which is the count where neither is set."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.get_num_threads()
    cores = physical_cores()
    for variable in ("MKL_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(variable, "").strip()
        if value.isdigit() and int(value) > 0:
            return min(int(value), cores)
    return cores


def physical_cores(cpuinfo: str | None = None, allowed: set[int] | None = None) -> int:
    """Physical cores among the processors this process may run on (/proc/cpuinfo's distinct
    physical id and core id pairs); the processor count where cpuinfo names no cores (ARM)."""
    if allowed is None:  # sched_getaffinity is Linux's; elsewhere every processor
        affinity = getattr(os, "sched_getaffinity", None)
        allowed = affinity(0) if affinity is not None else set(range(os.cpu_count() or 1))
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    cores: set[tuple[str, str]] = set()
    for block in cpuinfo.split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        if "processor" in fields and "core id" in fields and int(fields["processor"]) in allowed:
            cores.add((fields.get("physical id", "0"), fields["core id"]))
    return len(cores) or len(allowed) or 1


def check_device(device: str, name: str = "--device") -> None:
    """`--device` (or the setting `name` spells): cpu, or a CUDA device this machine has
    (MoaspecError otherwise)."""
    import re

    if device == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise MoaspecError(f"{name} must be cpu or cuda[:N], got '{device}'")
    index = int(device.partition(":")[2] or 0)
    import torch

    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise MoaspecError(f"{name} {device}: this machine has no such CUDA device")
