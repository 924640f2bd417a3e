"""llama.cpp itself: llama-cpp-python's bindings, imported on first use, and the weights of one
GGUF file, loaded once and shared by every context (`LlamaCppTarget`, llamacpp.py) made from them."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError
from moaspec.signals import signals_held

if TYPE_CHECKING:
    from types import ModuleType


def load_bindings() -> ModuleType:
    """The llama-cpp-python bindings, imported on first use (a clear error when missing)."""
    try:
        with signals_held():  # an interrupt half-way would leave it half-imported
            import llama_cpp
    except ImportError as exc:
        raise MoaspecError(
            "the llama.cpp runtime needs llama-cpp-python: pip install llama-cpp-python==0.3.36 "
            "(or --runtime transformers)"
        ) from exc
    return llama_cpp


_LOG_CALLBACK = None  # keeps the ctypes callback alive


def _quiet_logs(llama_cpp) -> None:
    """Silence llama.cpp's stderr chatter (errors included: ours are raised with context).

    The silencing callback is Python, called for every line llama.cpp logs (~1,100 while loading
    the weights, ~1,300 while making a context): Ctrl-C landing in one is raised there and
    swallowed by ctypes, so the calls that log run with signals held (signals.py)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


AMX_BUILD_FEATURE = "AMX_INT8 = 1"  # in llama_print_system_info: a build with ggml's AMX kernels


def build_features(lib: ModuleType) -> str:
    """The CPU features llama.cpp was compiled with, as it prints them ('AVX2 = 1 | ... |')."""
    return lib.llama_print_system_info().decode(errors="replace")


def repacks_weights(lib: ModuleType) -> bool:
    """Whether models are loaded with llama.cpp's extra buffer types (weights repacked for the AMX
    or CPU_REPACK kernels): not in a build with AMX kernels, whose matrix products crash the
    process (SIGSEGV in ggml_backend_amx_mul_mat at the first decode, llama.cpp issue #20824; seen
    with SmolLM2's Q4_1 on a 2-core AMX Xeon, session 56, where llama-cpp-python's own `Llama`
    crashed too). Without them llama.cpp runs its plain CPU kernels."""
    return AMX_BUILD_FEATURE not in build_features(lib)


def model_params(lib: ModuleType, n_gpu_layers: int = 0):
    """llama.cpp's model parameters as every model of this runtime (and the bench's llama.cpp
    baselines) is loaded with: `n_gpu_layers` offloaded, extra buffer types where repacks_weights."""
    params = lib.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = repacks_weights(lib)
    return params


class LlamaCppModel:
    """Weights of one GGUF file loaded by llama.cpp, shared by every context made from them."""

    def __init__(self, gguf: Path, n_gpu_layers: int = 0) -> None:
        lib = load_bindings()
        _quiet_logs(lib)
        lib.llama_backend_init()
        if n_gpu_layers and not lib.llama_supports_gpu_offload():
            # a CPU-only build: the layers would stay on the CPU anyway; as 0, the float prefill and
            # the machine's saved choices (keyed by offloaded layers) stay those of a CPU run
            print(
                f"moaspec: note: this llama-cpp-python build cannot offload to a GPU (a CPU-only build); "
                f"--n-gpu-layers {n_gpu_layers} (gpu_layers) is ignored", file=sys.stderr,
            )
            n_gpu_layers = 0
        params = model_params(lib, n_gpu_layers)
        self.lib = lib
        self.path = gguf
        self.gpu_layers = n_gpu_layers
        with signals_held():
            self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if not self.model:
            raise MoaspecError(f"llama.cpp cannot load {gguf}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.vocab_size = lib.llama_vocab_n_tokens(self.vocab)
        self.num_layers = lib.llama_model_n_layer(self.model)
        self.hidden_size = lib.llama_model_n_embd(self.model)
        self.context_train = lib.llama_model_n_ctx_train(self.model)
        self.sliding_window = lib.llama_model_n_swa(self.model)  # 0: none (Gemma-3: 512)
        self.exact_nodes: int | None = None  # the largest exact tree here (exact_tree_nodes_here, on first need)

    def __del__(self) -> None:
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None
