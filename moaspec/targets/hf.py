"""The transformers runtime: a Hugging Face causal LM behind the target protocol (base.py), on CPU or CUDA.

State: one KV cache holding exactly `num_cached` verified tokens (positions 0..num_cached-1).
- `prefill(ids)` appends ids to the verified context.
- `verify(tree)` runs the tree's nodes in one forward at positions `num_cached + depth` with an
  additive tree mask; their keys/values are appended *after* the verified context, pending.
- `commit(path_node_idx)` keeps the pending entries of the accepted path (KV compaction: the
  keys were rotated at `num_cached + depth`, which is exactly their final position, so no
  re-rotation is needed) and drops the rest.
- `rollback(length)` forgets verified tokens beyond `length`.
Every layer's cache is a full one, sliding-window layers' too: their window is applied by the
masks (hf_attention.py), so the compaction above and `layer_kv` index all layers by position.

Drafters read activations through `hidden_states` in the outputs (layer index as in transformers'
`output_hidden_states`: 0 = embeddings, l = output of layer l, num_layers = after the final norm),
`layer_kv()` (per-layer keys/values of verified positions) and the frozen modules exposed below.

Reduced precision (a bfloat16 or float16 model, `--dtype`): the verifiers get float32 logits and
the drafters float32 features, and the modules they borrow (`parts`) are float32 copies read from
the target's files, so a drafter trained on the float32 target computes as it was trained.
"""

from __future__ import annotations

import copy
import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from moaspec.errors import MoaspecError
from moaspec.nn.fast_linear import layout_of, use_layout
from moaspec.nn.target_parts import TargetParts
from moaspec.targets.base import PrefillCancelled, TargetOutput, context_overflow
from moaspec.targets.hf_attention import AttentionLayout
from moaspec.tree import DraftTree, depths

REDUCED_PRECISION = (torch.bfloat16, torch.float16)


def cache_keyword(model: PreTrainedModel) -> str:
    """The argument transformers' forward takes the KV cache by: `cache` in recent 5.x releases
    (where `past_key_values` is deprecated, to be removed in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def per_head_kv(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One layer's keys, values [Hkv, n, d] -> [n, Hkv * 2 * d], laid out per KV head as [k_h, v_h]
    (the MoA Layer-Self-Attention input, moa_reference.md §1.2)."""
    return torch.stack([keys, values], dim=2).permute(1, 0, 2, 3).flatten(1)


class HFTarget:
    """Adapter over a transformers Llama/Qwen2-style `*ForCausalLM` (batch size 1)."""

    runtime = "transformers"
    keeps_shared_start = False  # transformers' batched kernels round differently from one-token steps
    max_tree_nodes = max_tree_leaves = None
    reuses_graphs = False  # eager torch: every forward costs what its shape costs
    embedding_file = None  # its embedding is a torch module's (nn/fingerprint.py)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None,
        name: str,
        parts_loader: Callable[[int], TargetParts] | None = None,
        parts: dict[int, TargetParts] | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.config = model.config
        self.attention = AttentionLayout.of(self.config, name, model)  # sliding windows: hf_attention.py
        self.cache = DynamicCache()  # full layers, also for sliding-window ones (hf_attention.py)
        self.num_cached = 0
        self.cache_argument = cache_keyword(model)  # how model.forward takes a KV cache
        # reduced precision: tli_layers -> float32 copies of the borrowed modules (shared by sessions)
        self._parts_loader = parts_loader
        self._parts = {} if parts is None else parts

    # -- facts --------------------------------------------------------------------------------
    @property
    def weights_dtype(self) -> torch.dtype:
        """The model's own precision (float32 unless loaded with another `dtype`)."""
        return self.model.dtype

    @property
    def reduced_precision(self) -> bool:
        return self.weights_dtype in REDUCED_PRECISION

    @property
    def dtype(self) -> torch.dtype:
        """What drafters read and compute in: the model's dtype, float32 for a reduced-precision one."""
        return torch.float32 if self.reduced_precision else self.weights_dtype

    @property
    def weight_layout(self) -> str:
        """How the Linear weights are stored: "row" or "column" (nn/fast_linear.py)."""
        return layout_of(self.model)

    def use_layout(self, layout: str) -> None:
        """Store the Linear weights in `layout` (same values; few-row product speed differs by CPU)."""
        use_layout(self.model, layout)

    def serve_one_prompt(self) -> None:
        """Nothing here: the model's weights serve every forward."""

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def stop_ids(self) -> frozenset[int]:
        """End-of-sequence ids from the generation config (and the tokenizer as a fallback); an id
        outside the vocabulary (a config that names another tokenizer's) can never be generated."""
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for source in (gen_eos, getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif source is not None:
                ids.update(int(i) for i in source)
        return frozenset(i for i in ids if 0 <= i < self.vocab_size)

    # -- frozen modules drafters may share ----------------------------------------------------
    @property
    def embed_tokens(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    @property
    def device(self) -> torch.device:
        """Where the model's weights live (training may run the target on a GPU)."""
        return self.model.get_input_embeddings().weight.device

    @property
    def lm_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        return _inner_module(self.model, ("layers", "h"), "decoder layers")

    @property
    def final_norm(self) -> torch.nn.Module:
        return _inner_module(self.model, ("norm", "ln_f", "final_layernorm"), "final norm")

    @property
    def rotary_emb(self) -> torch.nn.Module | None:
        """The target's rotary embedding; None for a model without (GPT-2: absolute positions)."""
        return getattr(self.model.base_model, "rotary_emb", None)

    def parts(self, tli_layers: int) -> TargetParts:
        """The frozen modules a drafter borrows (its last `tli_layers` decoder layers for TLI):
        the model's own, or float32 copies for a reduced-precision model (module docstring)."""
        if self.reduced_precision:
            if tli_layers not in self._parts:
                self._parts[tli_layers] = self._float32_parts(tli_layers)
            return self._parts[tli_layers]
        layers = list(self.decoder_layers)
        return TargetParts(
            embed_tokens=self.embed_tokens,
            lm_head=self.lm_head.weight,
            final_norm=self.final_norm,
            tli_layers=layers[len(layers) - tli_layers :] if tli_layers else [],
            rotary_emb=self.rotary_emb,
        )

    def _float32_parts(self, tli_layers: int) -> TargetParts:
        """The loader's copies from the target's files; without one (a model made in memory),
        copies of the model's own modules widened to float32."""
        if self._parts_loader is not None:
            return self._parts_loader(tli_layers).to(self.device)
        layers = list(self.decoder_layers)
        return TargetParts(
            embed_tokens=copy.deepcopy(self.embed_tokens).float(),
            lm_head=self.lm_head.weight.detach().float(),
            final_norm=copy.deepcopy(self.final_norm).float(),
            tli_layers=[copy.deepcopy(layer).float() for layer in layers[len(layers) - tli_layers :]] if tli_layers else [],
            rotary_emb=self.rotary_emb,
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def new_session(self, positions: int | None = None) -> HFTarget:
        """A target sharing these weights with an empty cache of its own (it grows as it fills:
        `positions` changes nothing here)."""
        return HFTarget(self.model, self.tokenizer, self.name, self._parts_loader, self._parts)

    def reset(self) -> None:
        """Forget everything: an empty verified context."""
        self.cache = DynamicCache()
        self.num_cached = 0

    def set_context(self, input_ids: np.ndarray | torch.Tensor, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Make input_ids [T] the verified context: a fresh prefill (transformers' batched kernels
        round differently from one-token steps, so a kept prefix would not be the same)."""
        self.reset()
        return self.prefill(input_ids, hidden_layers)

    @contextmanager
    def cancellable(self, cancel: threading.Event) -> Iterator[None]:
        """Within it, a forward checks `cancel` before each decoder layer (PrefillCancelled, the
        context reset: the layers before the stop wrote to the cache)."""

        def check(module, args) -> None:
            if cancel.is_set():
                raise PrefillCancelled

        handles = [layer.register_forward_pre_hook(check) for layer in self.decoder_layers]
        try:
            yield
        except PrefillCancelled:
            self.reset()
            raise
        finally:
            for handle in handles:
                handle.remove()

    @torch.inference_mode()
    def prefill(self, input_ids: np.ndarray | torch.Tensor, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Append verified tokens.  input_ids: [T] -> logits [1, V] (last position), hidden [T, H, D]."""
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        count = input_ids.numel()
        if self.num_cached + count > self.max_positions:
            raise context_overflow(self.num_cached, count, self.max_positions)
        positions = torch.arange(self.num_cached, self.num_cached + count)
        out = self._forward(input_ids, positions, None, hidden_layers, logits_to_keep=1)
        self.num_cached += count
        return out

    @torch.inference_mode()
    def verify(self, tree: DraftTree, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Score every node of `tree` in one forward.  -> logits [N, V], hidden [N, H, D].

        The nodes' keys/values stay pending in the cache until `commit`.
        """
        node_depths = depths(tree.parents)
        positions = torch.from_numpy(self.num_cached + node_depths)
        is_chain = bool((node_depths == np.arange(tree.num_nodes)).all())
        # A chain is plain causal attention: let transformers build its own mask.
        bias = None if is_chain else self.attention.tree_mask(tree.parents, self.num_cached, self.weights_dtype)
        return self._forward(torch.from_numpy(tree.token_ids), positions, bias, hidden_layers, logits_to_keep=0)

    def commit(self, path_node_idx: list[int]) -> None:
        """Keep the pending entries of the accepted path (root first), drop the other nodes."""
        pending = self.cache.get_seq_length() - self.num_cached
        num_keep = len(path_node_idx)
        if path_node_idx != list(range(num_keep)):
            keep = torch.cat([torch.arange(self.num_cached), self.num_cached + torch.tensor(path_node_idx)]).to(self.device)
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(-2, keep)
                layer.values = layer.values.index_select(-2, keep)
        elif pending > num_keep:
            self.cache.crop(num_keep - pending)
        self.num_cached += num_keep

    def rollback(self, length: int) -> None:
        """Forget verified tokens at positions >= length (and anything pending)."""
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot roll back to {length} with {self.num_cached} verified tokens")
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            self.cache.crop(-excess)
        self.num_cached = length

    def keep_layer_kv(self, layers: Sequence[int]) -> None:
        """Nothing to do: the transformers cache holds every layer's keys/values."""

    def forget_layer_kv(self) -> None:
        """Nothing to do (see keep_layer_kv)."""

    def forget_final_hidden(self) -> None:
        """Nothing to do: hidden states are computed where asked for only."""

    def layer_kv(self, start: int, end: int, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Per-layer keys (post-RoPE) and values of verified positions start..end-1.

        -> [end - start, L, 2 * n_kv * head_dim], laid out per KV head as [k_h, v_h]
        (the MoA Layer-Self-Attention input, moa_reference.md §1.2); with `layers`, only those
        layers, in that order ([end - start, len(layers), ...]).
        """
        if not 0 <= start <= end <= self.num_cached:
            raise ValueError(f"positions {start}..{end} are not all verified ({self.num_cached})")
        per_layer = []
        cached = self.cache.layers
        for layer in cached if layers is None else [cached[i] for i in layers]:
            per_layer.append(per_head_kv(layer.keys[0, :, start:end], layer.values[0, :, start:end]))
        return torch.stack(per_layer, dim=1).to(self.dtype)

    # -- internals ----------------------------------------------------------------------------
    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_bias: torch.Tensor | dict[str, torch.Tensor] | None,
        hidden_layers: tuple[int, ...],
        logits_to_keep: int,
    ) -> TargetOutput:
        device = self.device  # inputs are made on the CPU; .to() is a no-op there
        out = self.model(
            input_ids=input_ids[None].to(device),
            position_ids=positions[None].to(device),
            attention_mask=_to_device(attention_bias, device),
            **{self.cache_argument: self.cache},
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=logits_to_keep,
        )
        hidden = None
        if hidden_layers:
            hidden = torch.stack([out.hidden_states[i][0] for i in hidden_layers], dim=1).to(self.dtype)
        return TargetOutput(out.logits[0].to(self.dtype), hidden)


def _to_device(mask: torch.Tensor | dict[str, torch.Tensor] | None, device) -> torch.Tensor | dict[str, torch.Tensor] | None:
    """A mask (or a mask per layer kind) on `device` (a no-op on the CPU)."""
    if isinstance(mask, dict):
        return {kind: bias.to(device) for kind, bias in mask.items()}
    return None if mask is None else mask.to(device)


def _inner_module(model: PreTrainedModel, names: tuple[str, ...], what: str) -> torch.nn.Module:
    """The base model's submodule by the first of `names` it has (Llama-style `model.layers` /
    `model.norm`, GPT-2's `transformer.h` / `transformer.ln_f`, ...)."""
    base = model.base_model
    for name in names:
        module = getattr(base, name, None)
        if module is not None:
            return module
    raise MoaspecError(f"cannot find the {what} of {type(model).__name__} (looked for {', '.join(names)})")
