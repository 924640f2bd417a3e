"""Load a target by name or path on a runtime: `transformers` (HF directories and GGUF files,
CPU or CUDA) or `llama.cpp` (GGUF files, CPU, GPU layers passed through).

GGUF targets (the built-in `smollm2-135m`, any `.gguf` path) run on llama.cpp by default; HF
directories on transformers. Both runtimes read the tokenizer and the architecture from the same
directory (model_store.py converts a GGUF once), so a prompt becomes the same token ids on both.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from moaspec.errors import MoaspecError
from moaspec.model_store import BUILTIN_TARGETS, builtin_gguf_path, resolve_target
from moaspec.targets.base import RUNTIMES, Target, TargetParts

# Measured on the 2-core machine, interleaved, SmolLM2 with column-major weights, 256-token cache:
# sdpa 73.9 ms per decode step and 127 ms for an 8-node tree; eager 81.1 and 161 ms.
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a target name or path stands for, or None (an HF directory, or unknown)."""
    if spec in BUILTIN_TARGETS:
        return builtin_gguf_path(spec)
    path = Path(spec).expanduser()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def default_runtime(spec: str) -> str:
    """llama.cpp for GGUF targets when llama-cpp-python is installed, else transformers."""
    if spec in BUILTIN_TARGETS or spec.endswith(".gguf"):
        return "llama.cpp" if llama_cpp_available() else "transformers"
    return "transformers"


def check_runtime(runtime: str | None, spec: str) -> str:
    """The runtime to use for `spec` (None = its default); MoaspecError when it cannot run it."""
    if runtime is None:
        return default_runtime(spec)
    if runtime not in RUNTIMES:
        raise MoaspecError(f"unknown runtime '{runtime}' (known: {', '.join(RUNTIMES)})")
    if runtime == "llama.cpp":
        if not (spec in BUILTIN_TARGETS or spec.endswith(".gguf")):
            raise MoaspecError(f"the llama.cpp runtime runs GGUF targets; '{spec}' is not one (use --runtime transformers)")
        if not llama_cpp_available():
            raise MoaspecError("the llama.cpp runtime needs llama-cpp-python: pip install llama-cpp-python==0.3.36")
    return runtime


def load_target(
    target: str,
    runtime: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION,
    device: str = "cpu",
    threads: int | None = None,
    gpu_layers: int = 0,
) -> Target:
    """Load a target by built-in name, HF directory or .gguf path (offline only).

    transformers: `dtype` and `device` ("cpu", "cuda", "cuda:1"); llama.cpp: `threads` (default:
    the cores torch uses) and `gpu_layers` (layers offloaded by a GPU build of llama.cpp).
    """
    runtime = check_runtime(runtime, target)
    if runtime == "llama.cpp":
        return _load_llama_cpp(target, threads, gpu_layers)
    return _load_transformers(target, dtype, attn_implementation, device)


def _load_transformers(spec: str, dtype: torch.dtype, attn_implementation: str, device: str) -> Target:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from moaspec.nn.fast_linear import requested_layout
    from moaspec.targets.hf import HFTarget

    hf_logging.disable_progress_bar()
    name, model_dir = resolve_target(spec)
    try:
        tokenizer = load_tokenizer(model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise MoaspecError(f"cannot load target {spec}: {str(exc).splitlines()[0]}") from exc
    if device != "cpu":
        model.to(device)
    loaded = HFTarget(model, tokenizer, name)
    layout = requested_layout()  # else the machine calibration picks the layout (moaspec/calibration)
    if layout is not None:
        loaded.use_layout(layout)
    return loaded


def _load_llama_cpp(spec: str, threads: int | None, gpu_layers: int) -> Target:
    from moaspec.targets.llamacpp import LlamaCppModel, LlamaCppTarget

    gguf = gguf_file(spec)
    if gguf is None:
        raise MoaspecError(f"the llama.cpp runtime runs GGUF targets; '{spec}' is not a .gguf file")
    name, model_dir = resolve_target(spec)  # tokenizer, architecture and drafter parts (converted once)
    tokenizer = load_tokenizer(model_dir)
    config = SimpleNamespace(**json.loads((model_dir / "config.json").read_text()))
    model = LlamaCppModel(gguf, gpu_layers)
    return LlamaCppTarget(
        model, tokenizer, config, name, threads=threads or torch.get_num_threads(),
        parts_loader=lambda tli_layers: _torch_parts(model_dir, config, tli_layers),
    )


def _torch_parts(model_dir: Path, config: SimpleNamespace, tli_layers: int) -> TargetParts:
    """The embedding (= LM head when tied) a drafter borrows, read from the converted copy."""
    if tli_layers:
        raise MoaspecError("drafters with Target Layer Inference need --runtime transformers")
    from safetensors import safe_open

    from moaspec.nn.layers import RMSNorm

    with safe_open(model_dir / "model.safetensors", framework="pt") as weights:
        embedding = weights.get_tensor("model.embed_tokens.weight").float()
        head = embedding if getattr(config, "tie_word_embeddings", True) else weights.get_tensor("lm_head.weight").float()
        norm = RMSNorm(embedding.shape[1], float(getattr(config, "rms_norm_eps", 1e-5)))
        norm.weight.data.copy_(weights.get_tensor("model.norm.weight"))
    embed_tokens = torch.nn.Embedding.from_pretrained(embedding, freeze=True)
    return TargetParts(embed_tokens=embed_tokens, lm_head_weight=head, final_norm=norm, tli_layers=[], rotary_emb=None)


def load_tokenizer(model_dir: Path):
    """The fast tokenizer straight from tokenizer.json when there is one (2 s faster than AutoTokenizer)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (model_dir / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def add_runtime_arguments(parser) -> None:
    """--runtime, --device, --threads, --gpu-layers (argparse)."""
    group = parser.add_argument_group("target runtime")
    group.add_argument(
        "--runtime", choices=RUNTIMES, default=None,
        help="llama.cpp (GGUF targets; their default when llama-cpp-python is installed) or transformers "
        "(any target; the default for HF directories)",
    )
    group.add_argument("--device", default="cpu", help="transformers runtime: cpu, cuda or cuda:N (default cpu)")
    group.add_argument("--threads", type=int, default=None, help="llama.cpp runtime: CPU threads (default: torch's)")
    group.add_argument("--gpu-layers", type=int, default=0, help="llama.cpp runtime: layers offloaded to a GPU (default 0)")


def runtime_options(args, target: str) -> dict:
    """Checked load_target keyword arguments from the flags of add_runtime_arguments."""
    runtime = check_runtime(args.runtime, target)
    if args.threads is not None and args.threads < 1:
        raise MoaspecError("--threads must be >= 1")
    if args.gpu_layers < 0:
        raise MoaspecError("--gpu-layers must be >= 0")
    if runtime == "llama.cpp" and args.device != "cpu":
        raise MoaspecError("--device applies to the transformers runtime; llama.cpp takes --gpu-layers")
    if runtime == "transformers" and (args.threads is not None or args.gpu_layers):
        raise MoaspecError("--threads and --gpu-layers apply to the llama.cpp runtime")
    check_device(args.device)
    return {"runtime": runtime, "device": args.device, "threads": args.threads, "gpu_layers": args.gpu_layers}


def check_device(device: str) -> None:
    """`--device`: cpu, or a CUDA device this machine has (MoaspecError otherwise)."""
    import re

    if device == "cpu":
        return
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise MoaspecError(f"--device must be cpu or cuda[:N], got '{device}'")
    index = int(device.partition(":")[2] or 0)
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise MoaspecError(f"--device {device}: this machine has no such CUDA device")
