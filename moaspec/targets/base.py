"""The target runtime protocol: what the engine, verifiers, drafters and servers ask of a target.

A runtime holds one sequence's verified context (batch size 1) and answers five operations:
- `prefill(ids)` appends verified tokens and returns the logits after the last one
  (`set_context(ids)`: the same for a whole new context, reusing what the runtime still holds);
- `verify(tree)` scores every node of a draft tree in one forward (each node sees the verified
  context and its own ancestors), leaving the nodes pending;
- `commit(path)` keeps the accepted path's pending entries (root first) and drops the rest;
- `rollback(length)` forgets verified tokens at positions >= length;
- `reset()` forgets everything.
A prefill inside `cancellable(event)` stops soon after `event` is set (between llama.cpp's decode
chunks, between transformers' decoder layers), raising `PrefillCancelled` with the context reset:
a server frees the model when a client leaves during a long prompt.
Invariant: `num_cached` verified tokens sit at positions 0..num_cached-1; a tree's root sits at
position num_cached, a node at depth d at num_cached + d.

Drafters read target activations through the runtime, never through its internals:
- `hidden_layers` passed to prefill / verify: hidden states in the outputs (index as in
  transformers' `output_hidden_states`: 0 = embeddings, l = after layer l, num_layers = after the
  final norm);
- `layer_kv(start, end, layers)`: per-layer keys (post-RoPE) and values of verified positions
  (of the layers announced with `keep_layer_kv`, which a drafter calls when it is made);
- `parts(tli_layers)`: the frozen torch modules a drafter shares with the target (embeddings, LM
  head, final norm, rotary embedding, the last k decoder layers for Target Layer Inference).

Runtimes: `hf.HFTarget` (transformers, CPU or CUDA, training and features) and
`llamacpp.LlamaCppTarget` (GGUF on llama.cpp, the fast CPU path).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    import torch

    from moaspec.nn.target_parts import TargetParts
    from moaspec.tree import DraftTree


class PrefillCancelled(Exception):
    """A prefill inside `Target.cancellable` was stopped; the target's context is empty."""


def context_overflow(cached: int, count: int, max_positions: int) -> MoaspecError:
    """The error of a prefill of `count` tokens after `cached` verified ones that the target's
    context of `max_positions` cannot hold."""
    if cached == 0:
        return MoaspecError(f"the prompt has {count} tokens but the target's context holds {max_positions}")
    return MoaspecError(
        f"{count} more tokens after the {cached} verified make {cached + count}, but the target's context holds {max_positions}"
    )


@dataclass(frozen=True)
class TargetOutput:
    """logits: [N, V], a float32 numpy array (llama.cpp, whose greedy path runs without torch) or a
    torch tensor of the model dtype (transformers). hidden: [N, H, D] at the requested layers, or None."""

    logits: np.ndarray | torch.Tensor
    hidden: torch.Tensor | None


class Target(Protocol):
    """A target LLM behind prefill / verify / commit / rollback (see the module docstring)."""

    name: str
    runtime: str  # one of options.RUNTIMES
    # set_context keeps what a new prompt shares with the context held (a chat's next turn) where
    # that gives a fresh prefill's bits: a server reuses such a target for its next session
    # instead of making a new one
    keeps_shared_start: bool
    max_tree_nodes: int | None  # the most nodes `verify` takes in one tree (None: no limit of its own)
    # a forward whose batch has the shape of the one before costs less (llama.cpp reuses its
    # compute graph): the calibration times plain steps and the penalty of a tree apart
    reuses_graphs: bool
    max_tree_leaves: int | None  # ... and leaves
    tokenizer: Any  # a transformers fast tokenizer, or None
    config: Any  # the transformers config of the architecture (shapes, rope, model_type)
    num_cached: int
    # (safetensors file, tensor name) of the token embedding's rows where they are read from a
    # file (a llama.cpp target's converted copy): its fingerprint is taken there without torch
    embedding_file: tuple[Path, str] | None

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_positions(self) -> int: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...

    @property
    def weight_layout(self) -> str: ...

    def use_layout(self, layout: str) -> None: ...

    def serve_one_prompt(self) -> None:
        """Told by a process that prefills one prompt and exits (a one-shot command): the runtime
        may keep less in memory for later prompts (llama.cpp: the float prefill drops each
        layer's weights once used). The output is the same either way."""
        ...

    def new_session(self, positions: int | None = None) -> Target:
        """A target sharing these weights with an empty context of its own (one per client);
        positions: the most tokens it will hold (a runtime that allocates its cache ahead of
        use bounds it so; its max_positions may then be that), None for the whole context."""
        ...

    def reset(self) -> None: ...

    def set_context(self, input_ids: np.ndarray, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """input_ids [T] (int64; a torch tensor is taken too) become the whole verified context (a
        new generation); a runtime may keep the part it already holds. -> logits [1, V] after the
        last token, hidden [T, H, D]."""
        ...

    def prefill(self, input_ids: np.ndarray, hidden_layers: tuple[int, ...] = ()) -> TargetOutput: ...

    def cancellable(self, cancel: threading.Event) -> AbstractContextManager[None]:
        """Within it, set_context / prefill stop soon after `cancel` is set (PrefillCancelled)."""
        ...

    def verify(self, tree: DraftTree, hidden_layers: tuple[int, ...] = ()) -> TargetOutput: ...

    def commit(self, path_node_idx: list[int]) -> None: ...

    def rollback(self, length: int) -> None: ...

    def keep_layer_kv(self, layers: Sequence[int]) -> None:
        """A drafter will read `layer_kv` of these layers (llama.cpp captures only those)."""
        ...

    def forget_layer_kv(self) -> None:
        """No drafter reads `layer_kv` any more (llama.cpp stops capturing; resets the context)."""
        ...

    def forget_final_hidden(self) -> None:
        """No drafter reads hidden states it did not ask for any more (llama.cpp stops keeping them:
        `LlamaCppTarget.keep_final_hidden`)."""
        ...

    def layer_kv(self, start: int, end: int, layers: Sequence[int] | None = None) -> torch.Tensor: ...

    def parts(self, tli_layers: int) -> TargetParts: ...
