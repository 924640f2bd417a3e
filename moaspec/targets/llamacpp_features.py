"""Per-layer keys and values out of llama.cpp, through its eval callback (`cb_eval`).

A context created with the callback is asked, node by node while `llama_decode` runs, whether we
want that tensor; for the ones we want it calls again once they are computed, and
`ggml_backend_tensor_get` copies them out (CPU or GPU buffers alike). The llama graph names the
keys after RoPE `Kcur-<layer>` (op ROPE) and the values `Vcur-<layer>` (a reshape of the value
projection), each [n_tokens, n_kv_heads, head_dim] in memory; an earlier node (before RoPE) has the
same key name, and the later write wins.

Layout. The GGUF converter permutes each head's query/key rows so that llama.cpp's RoPE, which
rotates adjacent pairs (x0, x1), (x2, x3), ..., equals transformers' rotation of halves (x_i,
x_{i+d/2}); llama.cpp's keys are therefore transformers' keys with each head's dimensions
interleaved. `CapturedKV.rows` undoes that, so `layer_kv` has the transformers runtime's layout:
per token, per layer, per KV head [k (head_dim), v (head_dim)]. Values are not permuted.

Cost, measured on SmolLM2-135M (2 threads, AVX-512): the callback answers ~1,200 questions per
decode from Python, and each captured tensor splits the graph; one-token decoding after 300
tokens took 8.1 ms without it, 9.4 ms capturing 4 layers and 10.1 ms capturing all 30
(bench/llamacpp_probes.py). Contexts are therefore created
with the callback only for drafters that need keys/values (LlamaCppTarget.keep_layer_kv).

What a decode captured for verified positions (keys/values, final hidden states) is kept in
`VerifiedRows`, so a drafter reads it without decoding again. Both are kept in numpy, so a
context keeps them without torch (a model drafter built in the background while the target
decodes reads them when it joins: drafters/background.py).

What `LlamaCppTarget` gives drafters (`DrafterFeatures`): hidden states after the final norm
come with the logits (llama.cpp's embeddings output), where asked for or kept throughout
(`keep_final_hidden`); per-layer keys/values through the eval callback for the layers a drafter
asks for (`keep_layer_kv`). Both are kept for the verified tokens, in numpy. Other intermediate
hidden states and the torch layers Target Layer Inference runs are not available on this
runtime: drafters that need them are refused with a clear error.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from types import ModuleType

    import torch


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` of the ggml vendored in llama-cpp-python 0.3.36 (ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


GGML_TYPE_F32 = 0


def _ggml(llama_cpp):
    """libggml-base from llama-cpp-python's own lib directory, with the two calls we use."""
    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    library.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    library.ggml_backend_tensor_get.restype = None
    library.ggml_nbytes.argtypes = [ctypes.c_void_p]
    library.ggml_nbytes.restype = ctypes.c_size_t
    return library


def transformers_head_order(head_dim: int) -> np.ndarray:
    """[head_dim]: transformers' dimension j of a key head is llama.cpp's dimension order[j]
    (0, 2, 4, ..., 1, 3, 5, ...: the module docstring's layout); `.argsort()` goes the other way."""
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


class CapturedKV:
    """The eval callback of one context: keeps the keys/values of `layers` from the last decode."""

    def __init__(self, llama_cpp: ModuleType, layers: Sequence[int], num_kv_heads: int, head_dim: int) -> None:
        self.layers = tuple(layers)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.ggml = _ggml(llama_cpp)
        self.names = {f"{kind}cur-{layer}".encode(): (kind, i) for i, layer in enumerate(self.layers) for kind in "KV"}
        self.current: dict[tuple[str, int], np.ndarray] = {}
        self.failure: BaseException | None = None  # raised in the callback, re-raised after the decode
        self.unpermute = transformers_head_order(head_dim)
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)  # kept alive here

    def _on_tensor(self, tensor: int, ask: bool, user_data) -> bool:
        """ctypes swallows what a callback raises, and a False answer to a computed tensor stops the
        graph mid-way (wrong logits, no error), so anything raised here (Ctrl-C, SIGTERM) is kept
        for `raise_failure` and the graph runs to its end."""
        try:
            return self._take(tensor, ask)
        except BaseException as exc:  # noqa: BLE001  re-raised by raise_failure after llama_decode
            self.failure = self.failure or exc
            return not ask

    def raise_failure(self) -> None:
        """Raise what the callback caught during the last decode, if anything (once)."""
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure

    def _take(self, tensor: int, ask: bool) -> bool:
        view = GgmlTensor.from_address(tensor)
        slot = self.names.get(view.name)
        if ask or slot is None:
            return slot is not None
        if view.type != GGML_TYPE_F32:
            return True  # not the f32 activation we read (never seen for Kcur / Vcur)
        size = self.ggml.ggml_nbytes(tensor)
        data = np.empty(size // 4, dtype=np.float32)
        self.ggml.ggml_backend_tensor_get(tensor, data.ctypes.data, 0, size)
        self.current[slot] = data
        return True

    def rows(self, count: int) -> np.ndarray:
        """The last decode's keys/values of its `count` tokens: [count, L, 2 * n_kv * head_dim]
        float32, per KV head [k_h, v_h] in transformers' layout."""
        shape = (count, self.num_kv_heads, self.head_dim)
        size = count * self.num_kv_heads * self.head_dim
        per_layer = []
        for i in range(len(self.layers)):
            keys = self.current[("K", i)][:size].reshape(shape)[..., self.unpermute]
            values = self.current[("V", i)][:size].reshape(shape)
            per_layer.append(np.stack([keys, values], axis=2).reshape(count, -1))  # [count, n_kv * 2 * head_dim]
        return np.stack(per_layer, axis=1)


class VerifiedRows:
    """Per-token rows of the verified positions 0..valid-1 (captured keys/values, final hidden
    states), numpy float32 in a buffer that doubles when full; torch rows written to it (the float
    prefill's) are converted."""

    def __init__(self) -> None:
        self.buffer: np.ndarray | None = None
        self.valid = 0

    def write(self, start: int, rows: np.ndarray | torch.Tensor) -> None:
        """rows [n, ...] for positions start..start+n-1; ignored past a gap (start > valid). Rows
        of another shape than those held may only start again from position 0 (ValueError)."""
        if start > self.valid:
            return
        if not isinstance(rows, np.ndarray):
            rows = rows.numpy()  # the float prefill's (CPU torch)
        if start > 0 and self.buffer is not None and self.buffer.shape[1:] != rows.shape[1:]:
            raise ValueError(f"rows of shape {rows.shape[1:]} at position {start} after rows of {self.buffer.shape[1:]}")
        end = start + rows.shape[0]
        if self.buffer is None or self.buffer.shape[0] < end or self.buffer.shape[1:] != rows.shape[1:]:
            capacity = 0 if self.buffer is None else self.buffer.shape[0]
            grown = np.empty((max(end, 2 * capacity, 256), *rows.shape[1:]), dtype=np.float32)
            if start > 0:
                grown[:start] = self.buffer[:start]
            self.buffer = grown
        self.buffer[start:end] = rows
        self.valid = end

    def read(self, start: int, end: int) -> np.ndarray:
        """Rows start..end-1: a view of the buffer (a later write may change it)."""
        return self.buffer[start:end]

    def truncate(self, length: int) -> None:
        self.valid = min(self.valid, length)


class DrafterFeatures:
    """What a `LlamaCppTarget` (llamacpp.py) gives drafters (module docstring): keys/values of the
    layers asked for, final hidden states, and the refusal of what this runtime cannot give. Its
    methods use the target's state (`capture`, `_kv`, `_hidden`, ...)."""

    def keep_layer_kv(self, layers: Sequence[int]) -> None:
        """Capture the keys/values of `layers` from now on (a drafter that reads `layer_kv` asks
        at its creation). Recreates the context with the eval callback: the context is reset."""
        wanted = sorted(set(layers) | set(self.capture.layers if self.capture else ()))
        if self.capture is not None and len(wanted) == len(self.capture.layers):
            return
        if not all(0 <= layer < self.num_layers for layer in wanted):
            raise MoaspecError(f"layers {wanted} are not all in 0..{self.num_layers - 1}")
        config = self.config
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.capture = CapturedKV(self.lib, wanted, num_kv_heads, self._head_dim)
        self._drop_contexts()
        self.reset()

    def forget_layer_kv(self) -> None:
        """Stop capturing keys/values (the eval callback costs time on every decode): a context
        without the callback, reset."""
        if self.capture is not None:
            self.capture = None
            self._drop_contexts()
            self.reset()

    def layer_kv(self, start: int, end: int, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Per-layer keys (post-RoPE) and values of verified positions start..end-1, captured
        while they were decoded (keep_layer_kv): [end - start, len(layers), 2 * n_kv * head_dim],
        in the transformers runtime's layout (llamacpp_features.py)."""
        if self.capture is None:
            raise MoaspecError("this llama.cpp context does not capture keys/values (keep_layer_kv)")
        if not 0 <= start <= end <= self.num_cached:
            raise ValueError(f"positions {start}..{end} are not all verified ({self.num_cached})")
        captured = self.capture.layers
        layers = captured if layers is None else tuple(layers)
        missing = sorted(set(layers) - set(captured))
        if missing:
            raise MoaspecError(f"layers {missing} are not captured (keep_layer_kv)")
        index = [captured.index(layer) for layer in layers]
        import torch  # a model drafter's read: it has loaded torch

        return torch.from_numpy(self._kv.read(start, end)[:, index])

    def keep_final_hidden(self) -> None:
        """Keep the final hidden state of every verified token from now on, asked for or not (a
        drafter built in the background reads them when it joins: `verified_hidden`). Every decode
        then outputs llama.cpp's embeddings, and with them every token's logits."""
        self.keeps_hidden = True

    def forget_final_hidden(self) -> None:
        """Keep final hidden states only where asked for again (`keep_final_hidden`)."""
        self.keeps_hidden = False

    def verified_hidden(self, start: int, end: int) -> torch.Tensor:
        """The final hidden states of verified positions start..end-1, kept while they were decoded
        (asked for, or since `keep_final_hidden`): [end - start, 1, D] float32, a copy."""
        if not 0 <= start <= end <= min(self._hidden.valid, self.num_cached):
            raise MoaspecError(
                f"the hidden states of positions {start}..{end} are not kept "
                f"({min(self._hidden.valid, self.num_cached)} are: keep_final_hidden)"
            )
        import torch  # a model drafter's read: it has loaded torch

        return torch.from_numpy(self._hidden.read(start, end).copy())[:, None]

    def _check_hidden(self, hidden_layers: tuple[int, ...]) -> None:
        """Refuse hidden states this runtime cannot give; switch llama.cpp's embeddings output
        (every token an output, logits included) on only when they are asked for or kept."""
        if hidden_layers and tuple(hidden_layers) != (self.num_layers,):
            raise MoaspecError(
                f"the llama.cpp runtime provides the hidden state after the final norm (layer {self.num_layers}) "
                f"only, not layers {list(hidden_layers)}: use the transformers runtime for this drafter "
                "(`--runtime transformers`, `runtime='transformers'`)"
            )
        self._use_embeddings(self.ctx, self._stores_hidden(hidden_layers))

    def _stores_hidden(self, hidden_layers: tuple[int, ...]) -> bool:
        """Whether a decode keeps its tokens' final hidden states: asked for, or kept throughout."""
        return bool(hidden_layers) or self.keeps_hidden

    def _use_embeddings(self, ctx, wanted: bool) -> None:
        if wanted != self._embeddings_on[ctx]:
            self.lib.llama_set_embeddings(ctx, wanted)
            self._embeddings_on[ctx] = wanted
