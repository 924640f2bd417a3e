"""Load a target by name or path on a runtime: `transformers` (HF directories and GGUF files,
CPU or CUDA) or `llama.cpp` (GGUF files, CPU, GPU layers passed through).

GGUF targets (the built-in `smollm2-135m`, any `.gguf` path) run on llama.cpp by default; HF
directories on transformers. Both runtimes read the tokenizer and the architecture from the same
directory (model_store.py converts a GGUF once), so a prompt becomes the same token ids on both.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError, first_line
from moaspec.model_store import BUILTIN_TARGETS, builtin_gguf_path, check_target_exists, resolve_target
from moaspec.targets.base import Target
from moaspec.targets.options import check_placement, check_runtime, default_threads
from moaspec.targets.safetensors_weights import SafetensorsWeights

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from moaspec.nn.target_parts import TargetParts

# Measured on the 2-core machine, interleaved, SmolLM2 with column-major weights, 256-token cache:
# sdpa 73.9 ms per decode step and 127 ms for an 8-node tree; eager 81.1 and 161 ms.
DEFAULT_ATTN_IMPLEMENTATION = "sdpa"
# float32 is the default and the lossless one; float64 for exact small-scale checks; the reduced
# precisions for speed (targets/hf.py). By name: torch loads only for the transformers runtime.
TARGET_DTYPES = ("float32", "float64", "bfloat16", "float16")


def gguf_file(spec: str) -> Path | None:
    """The GGUF file a target name or path stands for, or None (an HF directory, or unknown)."""
    if spec in BUILTIN_TARGETS:
        return builtin_gguf_path(spec)
    path = Path(spec).expanduser()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def load_target(
    target: str,
    runtime: str | None = None,
    *,
    dtype: torch.dtype | str = "float32",
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION,
    device: str = "cpu",
    threads: int | None = None,
    gpu_layers: int = 0,
    light_tokenizer: bool = False,
) -> Target:
    """Load a target by built-in name, HF directory or .gguf path (offline only).

    transformers: `dtype` (float32, the default; float64; bfloat16 or float16, see hf.py: faster
    on some hardware, but a forward's output then depends on how many tokens it holds, so
    speculative output may differ from plain decoding) and `device` ("cpu", "cuda", "cuda:1");
    llama.cpp: `threads` (default: the cores torch uses), `gpu_layers` (layers offloaded by a GPU
    build of llama.cpp) and `light_tokenizer` (tokenizer.py: no transformers import; the CLI's choice).
    """
    check_target_exists(target)  # an unknown target is named before its runtime's settings are checked
    runtime = check_runtime(runtime, target)
    dtype = dtype_name(dtype)
    check_placement(runtime, device, dtype, threads, gpu_layers)
    if runtime == "llama.cpp":
        return _load_llama_cpp(target, threads, gpu_layers, light_tokenizer)
    return _load_transformers(target, torch_dtype(dtype), attn_implementation, device)


def dtype_name(dtype: torch.dtype | str) -> str:
    """A target dtype's name ("float32", "bfloat16", ...), given by name or as a torch dtype;
    MoaspecError for others."""
    if isinstance(dtype, str):
        if dtype not in TARGET_DTYPES:
            raise MoaspecError(f"unknown target dtype '{dtype}' (known: {', '.join(TARGET_DTYPES)})")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in TARGET_DTYPES:
        raise MoaspecError(f"unsupported target dtype {dtype} (known: {', '.join(TARGET_DTYPES)})")
    return name


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A target dtype by name ("float32", "bfloat16", ...) or as a torch dtype; MoaspecError for others."""
    import torch

    return getattr(torch, dtype_name(dtype))


def _load_transformers(spec: str, dtype: torch.dtype, attn_implementation: str, device: str) -> Target:
    from moaspec.signals import load_library_held

    load_library_held()  # transformers' models are torch's: its first import, whole or not at all
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    from moaspec.nn.layout_names import requested_layout
    from moaspec.targets.hf import REDUCED_PRECISION, HFTarget

    hf_logging.disable_progress_bar()
    name, model_dir = resolve_target(spec)
    check_architecture(spec, model_dir)
    try:
        tokenizer = load_tokenizer(model_dir)
        model = load_causal_lm(model_dir, dtype, attn_implementation)
    except (OSError, ValueError, KeyError) as exc:
        raise MoaspecError(f"cannot load target {spec}: {first_line(exc)}") from exc
    if device != "cpu":
        model.to(device)
    parts_loader = None
    if dtype in REDUCED_PRECISION and model.config.model_type in LLAMA_STYLE_FILES:
        # the drafters' modules in float32, as read from the files (other layouts: the model's
        # own modules widened, HFTarget._float32_parts)
        parts_loader = functools.partial(_torch_parts, model_dir, model.config)
    loaded = HFTarget(model, tokenizer, name, parts_loader)
    layout = requested_layout()  # else the machine calibration picks the layout (moaspec/calibration)
    if layout is not None:
        loaded.use_layout(layout)
    return loaded


def check_architecture(spec: str, model_dir: Path) -> None:
    """MoaspecError naming the model_type of `model_dir`'s config.json when transformers knows no
    such architecture (the loaders blamed a missing tokenizer, after a warning of their own)."""
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # the loaders say what is wrong with the file
    import transformers
    from transformers import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type not in CONFIG_MAPPING:
        raise MoaspecError(
            f"cannot load target {spec}: its config.json names model_type '{model_type}', an architecture "
            f"transformers {transformers.__version__} does not know"
        )


def load_causal_lm(
    model_dir: Path, dtype: torch.dtype, attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION
) -> PreTrainedModel:
    """transformers' causal LM from `model_dir` (offline). The default attention (sdpa) falls back
    to eager for the models that have no sdpa path (Gemma 2: its logits are soft-capped)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if attn_implementation == DEFAULT_ATTN_IMPLEMENTATION:
        config_class = type(AutoConfig.from_pretrained(model_dir, local_files_only=True))
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[config_class] if config_class in MODEL_FOR_CAUSAL_LM_MAPPING else None
        if model_class is not None and not getattr(model_class, "_supports_sdpa", True):
            attn_implementation = "eager"
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )


def _load_llama_cpp(spec: str, threads: int | None, gpu_layers: int, light_tokenizer: bool) -> Target:
    from moaspec.targets.llamacpp import LlamaCppTarget
    from moaspec.targets.llamacpp_model import LlamaCppModel
    from moaspec.targets.llamacpp_prefill import SharedFloatLlama

    gguf = gguf_file(spec)
    if gguf is None:
        raise MoaspecError(f"the llama.cpp runtime runs GGUF targets; '{spec}' is not a .gguf file")
    from moaspec.targets.tokenizer import load_light_tokenizer

    name, model_dir = resolve_target(spec)  # tokenizer, architecture and drafter parts (converted once)
    tokenizer = (load_light_tokenizer(model_dir) if light_tokenizer else None) or load_tokenizer(model_dir)
    config = SimpleNamespace(**json.loads((model_dir / "config.json").read_text()))
    model = LlamaCppModel(gguf, gpu_layers)
    try:  # where _torch_parts reads the embedding (its fingerprint is read there without torch)
        with SafetensorsWeights(model_dir) as weights:
            embedding_file: tuple[Path, str] | None = (model_dir / weights.file_of(EMBEDDING), EMBEDDING)
    except MoaspecError:  # named otherwise: the fingerprint reads it through torch's parts (nn/fingerprint.py)
        embedding_file = None
    return LlamaCppTarget(
        model, tokenizer, config, name, threads=threads or default_threads(),
        parts_loader=lambda tli_layers: _torch_parts(model_dir, config, tli_layers),
        float_llama=SharedFloatLlama(model_dir, config), embedding_file=embedding_file,
    )


# architectures whose files name the embedding `model.embed_tokens` and the final RMSNorm (w * x)
# `model.norm`, which _torch_parts reads
LLAMA_STYLE_FILES = ("llama", "mistral", "qwen2", "qwen3")
EMBEDDING = "model.embed_tokens.weight"


def _torch_parts(model_dir: Path, config, tli_layers: int) -> TargetParts:
    """What a drafter borrows from a llama.cpp or reduced-precision target, as float32 torch
    modules read from the target's files (a GGUF's converted copy): the embedding (= LM head when
    tied) and final norm, and for Target Layer Inference the target's last `tli_layers` decoder
    layers with its rotary embedding."""
    from moaspec.nn.file_rows import RowEmbedding
    from moaspec.nn.layers import RMSNorm
    from moaspec.nn.target_config import target_norm_eps
    from moaspec.nn.target_parts import TargetParts

    with SafetensorsWeights(model_dir) as weights:
        embedding = weights.rows(EMBEDDING)
        tied = getattr(config, "tie_word_embeddings", True)
        head = embedding if tied else weights.rows("lm_head.weight")
        norm = RMSNorm(embedding.shape[1], target_norm_eps(config))
        norm.weight.data.copy_(weights.get_tensor("model.norm.weight"))
        layers, rotary_emb = _last_decoder_layers(model_dir, weights, tli_layers) if tli_layers else ([], None)
    return TargetParts(
        embed_tokens=RowEmbedding(embedding), lm_head=head, final_norm=norm, tli_layers=layers, rotary_emb=rotary_emb
    )


def _last_decoder_layers(model_dir: Path, weights, count: int) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """The target's last `count` decoder layers (transformers' own modules for its architecture,
    built on the meta device, only those layers materialised and loaded from `weights`) and its
    rotary embedding: what Target Layer Inference runs (nn/target_layers.py). Imports
    transformers' modeling code, which only TLI drafters need on llama.cpp."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    decoder = skeleton.model
    total = len(decoder.layers)
    if not 0 < count < total:
        raise MoaspecError(f"Target Layer Inference over {count} layers needs a target with more than {count} ({total})")
    layers = []
    for index in range(total - count, total):
        layer = decoder.layers[index].to_empty(device="cpu")
        prefix = f"model.layers.{index}."
        layer.load_state_dict({name: weights.get_tensor(prefix + name).float() for name in layer.state_dict()})
        layers.append(layer.eval().requires_grad_(False))
    return layers, type(decoder.rotary_emb)(config=hf_config)


def target_tokenizer(spec: str) -> tuple[str, PreTrainedTokenizerBase]:
    """The tokenizer of target `spec` alone, no model loaded: (the target's name, its tokenizer);
    a one-line MoaspecError when it cannot be read."""
    name, model_dir = resolve_target(spec)
    try:
        return name, load_tokenizer(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        raise MoaspecError(f"cannot read the tokenizer of target {spec}: {first_line(exc)}") from exc


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The fast tokenizer straight from tokenizer.json when there is one (2 s faster than AutoTokenizer)."""
    if (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir, local_files_only=True)
    from transformers import AutoTokenizer  # imports transformers' auto mappings: 0.3 s more

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
