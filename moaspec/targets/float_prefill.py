"""A llama-architecture target's prompt prefill in float torch, for the llama.cpp runtime.

llama.cpp's Q4_1 weight products reuse no weights across a batch's tokens: on 2 cores a prompt
costs ~3.7 ms a token there (SmolLM2-135M, Intel Xeon), ~40 % of one-token decoding, while
float32 matrix products over the same weights (the GGUF's converted copy, dequantized once)
prefill it 2.5-3× faster through MKL. So the llama.cpp runtime can prefill prompts here and move the
keys and values into its cache as it moves the prompt context's (llamacpp_cells.py): trees and
one-token decoding then read the same moved cells, and stay exact (llamacpp.py).

The forward is transformers' Llama decoder written out (RMSNorm, rotary embedding of halves,
grouped-query attention, SiLU-gated MLP), for configurations `float_prefill_unsupported` accepts (llamacpp_prefill.py).
The layers' matrices are held in float16 (~212 MB on SmolLM2-135M; float32 would be ~425 MB),
mapped from a float16 file beside the float32 copy (float_weights.py: a one-shot command's float
prefill would otherwise spend what it gains narrowing them), and widened to float32 one layer at a
time (a process serving one prompt drops each layer's mapped pages once done: `release_weights`);
activations are float32. Keys and values are rounded to float16 as they are computed, as
llama.cpp's f16 cache stores them, and attention reads them from there: a prompt prefilled in
chunks then gives the same bits whether an earlier chunk was computed now or kept from an earlier
prompt (`FloatPrefillCache`).

With compute "bfloat16" the products but the key and value projections take bfloat16 inputs and
weights (float32 accumulation, rounded to bfloat16 and widened again), the weights mapped as
they are from a bfloat16 file (float_weights.py; nothing to widen per prompt): faster where the CPU has
native bfloat16 products (an AVX-512 BF16 EPYC: a 256-token prompt 0.28 s against 0.52 s), not
where it has none, so llamacpp_prefill.py measures which a machine takes. The keys and values the
cache holds stay float32 products of the (bfloat16-rounded) activations. On 32 bench prompts of
64+ tokens the next token's logits stayed about as close to the transformers runtime's as
float32's (largest difference 0.58 median, 0.91 at most, against 0.57 and 0.82; llama.cpp's own
prefill: 0.74 and 1.46), with the same argmax in all 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from moaspec.nn.layers import RMSNorm, apply_rope
from moaspec.nn.target_config import target_norm_eps, target_rope_theta
from moaspec.targets.float_weights import MappedMatrices, float16_matrices, narrowed_matrices

if TYPE_CHECKING:
    from collections.abc import Callable

LAYER_MATRICES = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)
COMPUTES = ("float32", "bfloat16")  # the forward's product types (module docstring)
# the products kept in float32 under bfloat16: what the cache holds (6 % of the work on SmolLM2-135M)
FLOAT32_ALWAYS = ("self_attn.k_proj", "self_attn.v_proj")


@dataclass
class _Layer:
    matrices: list[torch.Tensor]  # LAYER_MATRICES, float16 [out, in]
    input_norm: RMSNorm
    post_attention_norm: RMSNorm


class FloatLlama:
    """A Llama decoder's weights (float16) and its float forward over prompt chunks (float32 or
    bfloat16 products: COMPUTES)."""

    def __init__(self, model_dir: Path, config: Any) -> None:
        from moaspec.targets.safetensors_weights import SafetensorsWeights

        self.num_layers = int(config.num_hidden_layers)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.num_heads)
        self.hidden_size = int(config.hidden_size)
        half = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
        self.inv_freq = 1.0 / (target_rope_theta(config) ** half)  # [head_dim / 2]
        eps = target_norm_eps(config)

        def norm(weights, name: str) -> RMSNorm:
            module = RMSNorm(self.hidden_size, eps).requires_grad_(False)
            module.weight.copy_(weights.get_tensor(name).float())
            return module

        names = [[f"model.layers.{i}.{name}.weight" for name in LAYER_MATRICES] for i in range(self.num_layers)]
        self._model_dir, self._names = Path(model_dir), names
        matrices = self._float16 = float16_matrices(model_dir, [name for layer in names for name in layer])
        with SafetensorsWeights(model_dir) as weights:
            self.embedding = weights.rows("model.embed_tokens.weight")
            self.layers = [
                _Layer(
                    [matrices[name] for name in names[i]],
                    norm(weights, f"model.layers.{i}.input_layernorm.weight"),
                    norm(weights, f"model.layers.{i}.post_attention_layernorm.weight"),
                )
                for i in range(self.num_layers)
            ]
            self.final_norm = norm(weights, "model.norm.weight")
        # one float32 buffer per matrix of a layer, refilled layer by layer (fresh tensors of this
        # size would each be mapped and zeroed by the allocator: twice the widening's own time)
        self._widened = [torch.empty(matrix.shape) for matrix in self.layers[0].matrices]
        self._bfloat16: list[dict[str, torch.Tensor]] | None = None  # per layer, mapped on first use
        self._bfloat16_file: MappedMatrices | None = None
        # True where the process prefills one prompt: each layer's pages are dropped once it is done
        # (float_weights.py; ~190 MB less at the peak, ~8 ms more for each later 130-token prompt)
        self.release_weights = False

    def _layer_weights(self, index: int, compute: str) -> list[torch.Tensor]:
        """Layer `index`'s matrices (LAYER_MATRICES) for `compute` (COMPUTES): widened to float32
        into the layer buffers; under bfloat16 the mapped bfloat16 matrices, but FLOAT32_ALWAYS's."""
        if compute not in COMPUTES:
            raise ValueError(f"compute must be one of {COMPUTES}, not {compute!r}")
        matrices = self.layers[index].matrices
        if compute == "float32":
            return [wide.copy_(matrix) for wide, matrix in zip(self._widened, matrices)]
        if self._bfloat16 is None:
            narrow = [name for layer in self._names for short, name in zip(LAYER_MATRICES, layer) if short not in FLOAT32_ALWAYS]
            mapped = self._bfloat16_file = narrowed_matrices(self._model_dir, narrow, torch.bfloat16)
            self._bfloat16 = [{name: mapped[name] for name in layer if name in mapped} for layer in self._names]
        return [
            wide.copy_(matrix) if short in FLOAT32_ALWAYS else self._bfloat16[index][name]
            for wide, matrix, short, name in zip(self._widened, matrices, LAYER_MATRICES, self._names[index])
        ]

    def _release_layer(self, index: int) -> None:
        """Drop layer `index`'s mapped pages, of both files, from the process (`release_weights`)."""
        self._float16.release(self._names[index])
        if self._bfloat16_file is not None:
            self._bfloat16_file.release(name for name in self._names[index] if name in self._bfloat16_file)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, start: int, chunk_size: int, keys: torch.Tensor, values: torch.Tensor,
        cancelled: Callable[[], bool] = lambda: False, compute: str = "float32",
    ) -> torch.Tensor | None:
        """Prefill ids [T] at positions start..start+T-1 (start a multiple of chunk_size) after the
        keys/values in keys/values[:, :start] ([L, >= start + T, n_kv, head_dim], float16, rotated),
        writing theirs into keys/values[:, start:start + T].

        Chunk by chunk (chunk_size rows aligned to position 0) within each layer, layer by layer:
        a layer's weights are widened once for all the chunks, and each chunk computes what it
        would alone after the chunks before it; products as `compute` (COMPUTES) says; with
        `release_weights` the layer's mapped pages are dropped once its chunks are done. -> the
        final-normed hidden states [T, D] (float32), or None when `cancelled()`, asked before each
        layer, says stop."""
        end = start + ids.shape[0]
        bounds = [(first, min(first + chunk_size, end)) for first in range(start, end, chunk_size)]
        # angles as transformers computes them for a Llama (inverse frequencies in float32; the
        # drafters' rope_cos_sin takes them in float64, which rounds differently)
        angles = torch.arange(start, end, dtype=torch.float32)[:, None] * self.inv_freq[None]
        angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]
        cos, sin = angles.cos(), angles.sin()
        xs = [self.embedding.rows(ids[first - start : last - start]) for first, last in bounds]  # [c, D] each
        for index, layer in enumerate(self.layers):
            if cancelled():
                return None
            weights = self._layer_weights(index, compute)
            for number, (first, last) in enumerate(bounds):
                rows = slice(first - start, last - start)
                xs[number] = self._layer(
                    xs[number], layer, weights, cos[rows], sin[rows], keys[index, :last], values[index, :last], first
                )
            if self.release_weights:
                self._release_layer(index)
        return torch.cat([self.final_norm(x) for x in xs])

    def _layer(
        self, x: torch.Tensor, layer: _Layer, weights: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor, past: int,
    ) -> torch.Tensor:
        """One decoder layer over a chunk x [c, D] at positions past..past+c-1, writing its keys and
        values into keys/values[past:] ([past + c, n_kv, head_dim], float16) and attending over all
        of them. -> x after the layer [c, D]."""
        count = x.shape[0]
        q_proj, k_proj, v_proj, o_proj, gate, up, down = weights
        mask = torch.ones(count, past + count, dtype=torch.bool).tril(past)  # query t sees positions <= past + t
        h = layer.input_norm(x)
        q = apply_rope(_linear(h, q_proj).view(count, self.num_heads, self.head_dim).transpose(0, 1), cos, sin)
        k = apply_rope(_linear(h, k_proj).view(count, self.num_kv_heads, self.head_dim).transpose(0, 1), cos, sin)
        keys[past:] = k.transpose(0, 1)
        values[past:] = _linear(h, v_proj).view(count, self.num_kv_heads, self.head_dim)
        all_keys = keys.float().transpose(0, 1)  # [n_kv, past + c, head_dim]
        all_values = values.float().transpose(0, 1)
        # batched (4-D): CPU SDPA takes its fused kernel there, 2-4x the 3-D math path's speed
        attended = F.scaled_dot_product_attention(
            q[None], all_keys[None], all_values[None], attn_mask=mask, enable_gqa=True
        )[0]  # [heads, c, d]
        x = x + _linear(attended.transpose(0, 1).reshape(count, -1), o_proj)
        h = layer.post_attention_norm(x)
        return x + _linear(F.silu(_linear(h, gate)) * _linear(h, up), down)


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [.., in] (float32) times weight [out, in] transposed, in the weight's type (float32 or
    bfloat16: x rounded to it, the product widened back) -> [.., out] float32."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    return F.linear(x.to(weight.dtype), weight).float()


class FloatPrefillCache:
    """One context's prompt keys/values from `FloatLlama`, chunk by chunk from position 0.

    Chunks are `chunk_size` tokens aligned to position 0; a later prompt keeps the whole chunks it
    shares with the one held (a chunk's products depend on its row count, so a partial one is
    computed again), and so gets the bits a fresh prefill would."""

    def __init__(self, model: FloatLlama, chunk_size: int, compute: str = "float32") -> None:
        self.model, self.chunk_size, self.compute = model, chunk_size, compute
        self.tokens: list[int] = []
        shape = (model.num_layers, 0, model.num_kv_heads, model.head_dim)
        self.keys = torch.empty(shape, dtype=torch.float16)  # [L, capacity, n_kv, head_dim]
        self.values = torch.empty(shape, dtype=torch.float16)
        self.hidden = torch.empty(0, model.hidden_size)  # [capacity, D] final-normed hidden states

    @torch.inference_mode()
    def prefill(self, ids: list[int], cancelled: Callable[[], bool] = lambda: False) -> int:
        """Make `ids` the held prompt; -> how many leading tokens were kept from the one held.
        `cancelled()` is asked before each layer (True: stop, the held prompt cut to those kept)."""
        shared = 0
        for held, new in zip(self.tokens, ids):
            if held != new:
                break
            shared += 1
        keep = shared // self.chunk_size * self.chunk_size
        del self.tokens[keep:]
        self._reserve(len(ids))
        if keep == len(ids):
            return keep
        hidden = self.model.forward(
            torch.tensor(ids[keep:]), keep, self.chunk_size, self.keys[:, : len(ids)], self.values[:, : len(ids)], cancelled,
            self.compute,
        )
        if hidden is not None:
            self.hidden[keep : len(ids)] = hidden
            self.tokens.extend(ids[keep:])
        return keep

    def _reserve(self, length: int) -> None:
        capacity = self.keys.shape[1]
        if length <= capacity:
            return
        grown = max(length, 2 * capacity)
        held = len(self.tokens)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.empty((old.shape[0], grown, *old.shape[2:]), dtype=old.dtype)
            new[:, :held] = old[:, :held]
            setattr(self, name, new)
        hidden = torch.empty(grown, self.model.hidden_size)
        hidden[:held] = self.hidden[:held]
        self.hidden = hidden

    def reset(self) -> None:
        self.tokens = []

    def layer_rows(self, layers: tuple[int, ...], count: int) -> torch.Tensor:
        """Keys and values of the first `count` held tokens in the transformers runtime's layout:
        [count, len(layers), n_kv * 2 * head_dim], per KV head [k, v] (float32)."""
        index = torch.tensor(layers)
        keys, values = self.keys[index, :count], self.values[index, :count]  # [L', T, n_kv, head_dim]
        return torch.stack([keys, values], dim=3).permute(1, 0, 2, 3, 4).flatten(2).float()
