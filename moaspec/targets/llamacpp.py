"""The llama.cpp runtime: a GGUF target on llama.cpp (llama-cpp-python's C API) behind the target protocol.

One `llama_context` per sequence, its KV cache unified across sequence ids. The verified context
lives in sequence 0.

Tree verification is one `llama_decode`: every node is a batch token at position
num_cached + depth with logits on. llama.cpp attends by sequence: a token sees the cells that
carry its *first* sequence id at positions up to its own. So each leaf of the tree gets a sequence
id, each node carries the ids of the leaves below it (its first id is any of them: every cell
carrying it is an ancestor, the node itself, a later position, or the verified context), and the
verified context is first copied into every leaf's sequence. `commit(path)` keeps the sequence of
a leaf below the last accepted node, trims it after the path and makes it sequence 0 again. No
accepted token is decoded twice. A new generation (`set_context`) keeps the part of the context
that its prompt shares with the one held (a chat's next turn) and decodes only the rest.

Exactness (the same tokens as plain decoding on this runtime). llama.cpp quantizes activations to
8 bits inside its matrix products, so a rounding difference anywhere upstream moves logits by
~0.5 and flips near-ties: a tree's logits must be *bit-identical* to what one-token decoding
computes. Measured on SmolLM2-135M (Q4_1, AVX-512, 2 threads):
- the weight products are per-row kernels (chains of up to 40 tokens equal one-token decoding);
- attention is not, with an f16 KV cache: one-token decoding switches to a split-KV flash-attention
  kernel past 512 cells, long batches to a tiled one, and the non-flash path changes kernels with
  the batch size. Flash attention takes those two kernels only when keys and values are both f16
  (or both f32). With a q8_0 key cache and an f16 value cache every decode runs the same per-query
  kernel (values accumulated in f16, as llama.cpp's own f16 decoding does; masked cells skipped
  exactly), whatever the batch. An f16 value cache rather than q8_0 saves the per-cell dequantizing:
  one-token decoding 7-10 % and a 1,000-token prefill 21 % faster on the AVX-512 EPYC
  (bench/llamacpp_probes.py). Not on every CPU: on an Intel Xeon (avx512_fp16, no AMX) the q8_0
  value cache decodes one token 25 % faster after 300 cells and 42 % after 1,000, and prefills
  1,000 tokens 42 % faster. So the value cache is chosen per machine (llamacpp_value_cache.py:
  measured once where the calibration is on, or fixed by MOASPEC_LLAMA_VALUE_CACHE=f16|q8_0); both
  stay exact (the same per-query kernel) but round differently, so plain decoding's tokens are
  those of the chosen cache. Long prompts take the prompt context (llamacpp_prompt_paths.py) with either: for q8_0
  values the move rotates and quantizes them as it does the keys;
- that kernel visits cells in cell order, so verified tokens must stay in cells in position order.
  llama.cpp refills freed cells from the lowest one, so a rejected node placed *before* the last
  accepted one is parked (moved to sequence PARKED, never attended) instead of freed. Parked cells
  are reclaimed when the cache fills (`_reclaim_parked`, llamacpp_contexts.py): sequence 0 is saved through llama.cpp's
  sequence state and loaded back into the emptied cache, the same bits in cells 0.. in position
  order (a sliding-window model re-decodes the verified context instead).
Greedy equality with plain decoding is tested on real prompts (tests/test_llamacpp.py).
Not every GGUF keeps this: K-quant products (Q4_K, Q6_K, ...) switch to repacked GEMM kernels
from 4 rows on (AVX-512 EPYC), which round differently from one-token decoding. So the largest
exact tree is measured once per machine, GGUF and thread count, and saved (llamacpp_exactness.py): where
a branching tree is exact, trees of up to MAX_TREE_NODES; where only short chains are, trees are
chains of at most that length (`max_tree_nodes`, `max_tree_leaves` 1: a chain never parks a cell,
so a sliding-window model never re-decodes its context in batches larger than its tokens were
decoded in); where no chain is, plain decoding only.

The verified context starts small and grows, its cells moved through llama.cpp's sequence state
(llamacpp_contexts.py). Long prompts are prefilled outside it, in the prompt context or in float32
torch, and their cells moved in (llamacpp_prompt_paths.py); a chat's next turn keeps the cells it
shares with the previous one and equals a fresh prefill bit for bit on every path. Drafters read
final hidden states and per-layer keys/values kept for the verified tokens
(llamacpp_features.py).

Beside this module: llamacpp_contexts.py (the contexts, their growth and parked cells),
llamacpp_prompt_paths.py (long prompts' prefill), llamacpp_features.py (what drafters read: the
eval callback's keys/values, the rows kept of verified positions), llamacpp_model.py (the bindings
and the GGUF's weights), llamacpp_exactness.py (the per-machine measure of how large a tree stays
exact), llamacpp_cells.py (moving a prompt's cells), llamacpp_value_cache.py (the per-machine
choice of the value cache).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from moaspec.errors import MoaspecError
from moaspec.signals import signals_held
from moaspec.targets.base import PrefillCancelled, TargetOutput, context_overflow
from moaspec.targets.llamacpp_contexts import (
    DEFAULT_CELLS,
    KEY_CACHE_TYPE,
    MAX_BATCH,
    MAX_LEAVES,
    MAX_TREE_NODES,
    PARKED,
    ContextCells,
    first_allocation,
    session_cells,
)
from moaspec.targets.llamacpp_exactness import exact_tree_nodes, saved_or_measured
from moaspec.targets.llamacpp_features import DrafterFeatures, VerifiedRows
from moaspec.targets.llamacpp_model import LlamaCppModel
from moaspec.targets.llamacpp_prefill import SharedFloatLlama, fixed_float_compute, fixed_float_prefill_start
from moaspec.targets.llamacpp_prompt_paths import PromptPaths, shared_start
from moaspec.targets.llamacpp_value_cache import VALUE_CACHE_NAMES, fixed_value_cache_type, value_cache_type
from moaspec.tree import DraftTree, depths, leaf_groups

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import torch

    from moaspec.nn.target_parts import TargetParts
    from moaspec.targets.float_prefill import FloatPrefillCache
    from moaspec.targets.llamacpp_features import CapturedKV

PROMPT_CONTEXT_MIN_TOKENS = 384  # prompts this long or longer are prefilled in the prompt context
COMPACT_CHUNK = 32  # tokens per decode when re-decoding or appending verified tokens (per-row kernels up to 40 measured)


class LlamaCppTarget(PromptPaths, DrafterFeatures, ContextCells):
    """A GGUF target on llama.cpp (batch size 1); see the module docstring."""

    runtime = "llama.cpp"
    keeps_shared_start = True  # set_context keeps a shared start where that is bit for bit (module docstring)
    reuses_graphs = True  # llama.cpp rebuilds its compute graph only when a batch changes shape

    def __init__(
        self,
        model: LlamaCppModel,
        tokenizer: Any,
        config: Any,
        name: str,
        *,
        cells: int = DEFAULT_CELLS,
        threads: int | None = None,
        parts_loader: Callable[[int], TargetParts] | None = None,
        parts: dict[int, TargetParts] | None = None,
        value_cache: int | None = None,
        float_llama: SharedFloatLlama | None = None,
        float_prefill_start: int | None = None,
        float_compute: str | None = None,
        embedding_file: tuple[Path, str] | None = None,
    ) -> None:
        self.weights = model
        self.embedding_file = embedding_file  # where parts_loader reads the embedding (Target.embedding_file)
        self.tokenizer = tokenizer
        self.config = config
        self.name = name
        self.threads = threads or min(os.cpu_count() or 1, 8)
        # a ggml type, fixed here (a bad MOASPEC_LLAMA_VALUE_CACHE fails now) or measured on first need
        self._value_cache_type = value_cache if value_cache is not None else fixed_value_cache_type()
        self.key_cache_type = KEY_CACHE_TYPE  # q8_0 (module docstring); a probe may set another before first use
        self._parts_loader = parts_loader  # tli_layers -> TargetParts (torch copies of frozen modules)
        self._parts = {} if parts is None else parts  # tli_layers -> loaded parts, shared by sessions
        self._float = float_llama  # the float32 prefill's weights, shared by sessions (None: no float path)
        if float_prefill_start is None:
            float_prefill_start = fixed_float_prefill_start()  # a bad MOASPEC_LLAMA_PREFILL fails now
        # from which first-turn length this machine prefills in float (NEVER: not at all; None: decided on first need)
        self._float_start = float_prefill_start
        # the float forward's products (float32 or bfloat16; None: decided on first need)
        self._float_compute = float_compute if float_compute is not None else fixed_float_compute()
        self._generation_prompt: tuple[int, ...] | None = None  # the chat template's (_float_boundary)
        self._float_cache: FloatPrefillCache | None = None  # the float path's keys/values of the last prompt
        self._probing_exactness = False  # set on exact_tree_nodes_here's own probe: it verifies any tree
        self.cells = cells  # the most positions the verified context holds
        # positions it is made with (`_grow` doubles them); whole for a sliding-window model, whose
        # sequence state holds a second cache that no test here moves (no such GGUF is at hand)
        self._allocated = first_allocation(cells, model.sliding_window)
        self.lib = model.lib
        self.capture: CapturedKV | None = None  # keys/values of some layers, for drafters that read them
        self.keeps_hidden = False  # every verified token's final hidden state kept (keep_final_hidden)
        self._prompt_ctx = None  # made on first need (_prompt_context)
        self._head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        # the verified context, made on first need (`ctx`): a target loaded only for its tokenizer
        # and the parts drafters borrow (a split client) never holds its cache
        self._ctx = self._memory = None
        self._embeddings_on: dict = {}  # llama context -> whether it outputs embeddings
        self.batch = self.lib.llama_batch_init(MAX_BATCH, 0, PARKED + 1)
        self.compactions = 0  # times parked cells were reclaimed (`_reclaim_parked`)
        self._cancel: threading.Event | None = None  # set within `cancellable`
        self.weight_layout = "row"  # of the torch parts drafters use (nn/fast_linear.py)
        self.reset()

    @property
    def value_cache_type(self) -> int:
        """The ggml type of the verified context's values, chosen on first need
        (llamacpp_value_cache.py: MOASPEC_LLAMA_VALUE_CACHE, else measured once per machine)."""
        if self._value_cache_type is None:
            self._value_cache_type = value_cache_type(self)
        return self._value_cache_type

    @property
    def value_cache_name(self) -> str:
        """The value cache type's name (f16 or q8_0)."""
        return VALUE_CACHE_NAMES.get(self.value_cache_type, str(self.value_cache_type))

    def __del__(self) -> None:
        if getattr(self, "lib", None) is None:
            return
        if getattr(self, "batch", None) is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "_embeddings_on", None) is not None:
            self._drop_contexts()

    @property
    def exact_tree_nodes(self) -> int:
        """The most nodes a verified tree may have and keep one-token decoding's logits bit for bit
        on this machine (1: none; measured once per machine, GGUF and thread count, ~6 s:
        `exact_tree_nodes_here`, then read from the cache: llamacpp_exactness.py)."""
        if self._probing_exactness:
            return MAX_TREE_NODES
        if self.weights.exact_nodes is None:
            self.weights.exact_nodes = saved_or_measured(self, lambda: exact_tree_nodes_here(self))
        return self.weights.exact_nodes

    @property
    def trees_exact(self) -> bool:
        """Whether drafted tokens can be verified here without changing the output."""
        return self.exact_tree_nodes > 1

    @property
    def max_tree_nodes(self) -> int:
        """The most nodes `verify` takes in one tree: MAX_TREE_NODES, or fewer where only chains that
        short are exact (module docstring)."""
        return min(MAX_TREE_NODES, self.exact_tree_nodes)

    @property
    def max_tree_leaves(self) -> int:
        """The most leaves of one tree: MAX_LEAVES, or 1 (chains) where trees are exact only up to a
        size (module docstring)."""
        return MAX_LEAVES if self.exact_tree_nodes >= MAX_TREE_NODES else 1

    # -- facts --------------------------------------------------------------------------------
    @property
    def num_cached(self) -> int:
        """Verified tokens in the context (positions 0..num_cached-1)."""
        return len(self._tokens)

    @property
    def dtype(self) -> torch.dtype:
        """What the drafters' torch parts compute in (float32)."""
        import torch

        return torch.float32

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def use_layout(self, layout: str) -> None:
        """The layout of the torch weights drafters borrow; llama.cpp keeps its own."""
        from moaspec.nn.layout_names import check_layout

        check_layout(layout)
        self.weight_layout = layout

    def serve_one_prompt(self) -> None:
        """The float prefill (where this target has one) drops each layer's weights from the
        process once used: ~190 MB less at the peak (SmolLM2-135M), ~8 ms more for each later
        130-token prompt, which reads them from the page cache again."""
        if self._float is not None:
            self._float.release_weights = True

    @property
    def num_layers(self) -> int:
        return self.weights.num_layers

    @property
    def hidden_size(self) -> int:
        return self.weights.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.weights.vocab_size

    @property
    def max_positions(self) -> int:
        trained = self.weights.context_train
        return min(trained, self.cells) if trained > 0 else self.cells

    @property
    def stop_ids(self) -> frozenset[int]:
        """End-of-generation ids: the GGUF's own (eos, eot) and the tokenizer's eos."""
        vocab = self.weights.vocab
        ids = {self.lib.llama_vocab_eos(vocab), self.lib.llama_vocab_eot(vocab)}
        tokenizer_eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(tokenizer_eos, int):
            ids.add(tokenizer_eos)
        return frozenset(i for i in ids if i >= 0)

    def parts(self, tli_layers: int) -> TargetParts:
        """Torch copies of the frozen modules a drafter borrows, loaded on first use."""
        if self._parts_loader is None:
            raise MoaspecError(f"target '{self.name}' on llama.cpp has no torch weights for a model drafter")
        if tli_layers not in self._parts:
            self._parts[tli_layers] = self._parts_loader(tli_layers)
        return self._parts[tli_layers]

    # -- lifecycle ----------------------------------------------------------------------------
    def new_session(self, positions: int | None = None) -> LlamaCppTarget:
        """A context of its own on the same weights (capturing the same keys/values): of this
        one's size, or of `positions` rounded up to a power of two, SESSION_CELLS_MIN at least (the
        most it holds: its cache, allocated SESSION_CELLS_MIN positions at first, doubles up to
        that as it fills, `_grow`; the rounding leaves a chat's next turns room in it, which a
        server reuses: IdleTargets)."""
        cells = self.cells if positions is None else session_cells(positions, self.cells)
        other = LlamaCppTarget(
            self.weights, self.tokenizer, self.config, self.name,
            cells=cells, threads=self.threads, parts_loader=self._parts_loader, parts=self._parts,
            value_cache=self.value_cache_type,  # the same tokens as this one's
            float_llama=self._float, float_prefill_start=self._float_start,  # prompts prefilled as this one's
            float_compute=self._float_compute,
            embedding_file=self.embedding_file,
        )
        other.key_cache_type = self.key_cache_type  # set before its context is made
        if self.capture is not None:
            other.keep_layer_kv(self.capture.layers)
        other.keeps_hidden = self.keeps_hidden
        return other

    def reset(self) -> None:
        """Forget everything: an empty verified context."""
        if self._ctx is not None:
            self.lib.llama_memory_clear(self._memory, True)
        if self._prompt_ctx is not None:
            self.lib.llama_memory_clear(self.lib.llama_get_memory(self._prompt_ctx), True)
        self._prompt_tokens: list[int] = []  # the tokens the prompt context holds (positions 0...)
        if self._float_cache is not None:
            self._float_cache.reset()
        self._moved = 0  # leading verified positions whose cells and rows came from another computation:
        self._moved_from: str | None = None  # "prompt context" or "float" (float torch)
        self._tokens: list[int] = []  # the verified tokens (num_cached)
        self._parked = 0  # cells held in sequence PARKED
        self._pending: tuple[list[int], list[int], list[int], int] | None = None  # after verify
        self._kv = VerifiedRows()  # captured keys/values of the verified tokens
        self._hidden = VerifiedRows()  # their final hidden states, where asked for or kept
        self._pending_rows: tuple[np.ndarray | None, np.ndarray | None] = (None, None)  # a tree's keys/values, hidden

    def set_context(self, input_ids: np.ndarray, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Make input_ids [T] the verified context. -> logits [1, V] (numpy float32) after the last
        token, hidden [T, 1, D] (torch) when asked.

        Where this machine prefills in float32, a prompt whose first turn has
        `float_prefill_start` tokens or more has that turn prefilled so (`_prefill_in_float`).
        Otherwise a prompt of PROMPT_CONTEXT_MIN_TOKENS or more is prefilled in the prompt context
        and moved in (`_prefill_in_prompt_context`; not for sliding-window models). What is left is
        decoded here, keeping the part of the context it shares with the one held (a chat's next
        turn) where the products do not change with the batch size (`exact_tree_nodes`). Either
        way the result is the same bits a fresh context would give (module docstring)."""
        ids = np.asarray(input_ids, dtype=np.int64).tolist()
        if not ids:
            raise ValueError("set_context needs at least one token")
        if len(ids) > self.max_positions:
            raise context_overflow(0, len(ids), self.max_positions)
        self._check_hidden(hidden_layers)
        self._drop_pending()
        boundary = self._float_boundary(ids)
        if boundary is None and len(ids) >= PROMPT_CONTEXT_MIN_TOKENS and self.uses_prompt_context:
            return self._prefill_in_prompt_context(ids, hidden_layers)
        # moved cells are kept only where this prompt's own path moves the same ones in
        same_start = self._moved == 0 if boundary is None else (self._moved, self._moved_from) == (boundary, "float")
        keep = shared_start(self._tokens, ids) if same_start else 0
        if keep and self.exact_tree_nodes < MAX_TREE_NODES:
            keep = 0  # kernels that change with the batch size: kept cells would differ from a fresh prefill's
        if self.capture is not None:
            keep = min(keep, self._kv.valid)
        if self._stores_hidden(hidden_layers):
            keep = min(keep, self._hidden.valid)
        if boundary is not None and keep < boundary:
            return self._prefill_in_float(ids, boundary, hidden_layers)
        if keep == 0:
            self.reset()
        else:
            self.rollback(keep)
        logits = self._append(ids[keep:], hidden_layers).logits
        return TargetOutput(logits, self.verified_hidden(0, len(ids)) if hidden_layers else None)

    @contextmanager
    def cancellable(self, cancel: threading.Event) -> Iterator[None]:
        """Within it, a prefill checks `cancel` before each decode chunk (PrefillCancelled, the
        context reset)."""
        self._cancel = cancel
        try:
            yield
        finally:
            self._cancel = None

    def prefill(self, input_ids: np.ndarray, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Append verified tokens.  input_ids: [T] -> logits [1, V] (last position), hidden [T, 1, D].
        Into an empty context this is set_context (a prompt); after one, the tokens get the
        cells one-token decoding (and tree verification) gives them: decoded here in batches
        of `_exact_batch` tokens (a split session resumed after a cut holds the same bits)."""
        if self.num_cached == 0:
            return self.set_context(input_ids, hidden_layers)
        return self._append(input_ids, hidden_layers, self._exact_batch)

    @property
    def _exact_batch(self) -> int:
        """The most tokens one decode after the prompt takes and keeps one-token decoding's bits."""
        return min(COMPACT_CHUNK, self.exact_tree_nodes)

    def _append(
        self, input_ids: Sequence[int] | np.ndarray, hidden_layers: tuple[int, ...], batch: int = MAX_BATCH
    ) -> TargetOutput:
        """Decode input_ids [T] after the verified context, in this context, `batch` tokens per decode."""
        self._check_hidden(hidden_layers)
        ids = np.asarray(input_ids, dtype=np.int64).tolist()
        if self.num_cached + len(ids) > self.max_positions:
            raise context_overflow(self.num_cached, len(ids), self.max_positions)
        self._drop_pending()
        self._make_room(len(ids))
        logits, hidden = self._decode_in_chunks(
            self.ctx, ids, self.num_cached, batch, self._stores_hidden(hidden_layers), self._tokens
        )
        return TargetOutput(logits, _torch_rows(np.concatenate(hidden))[:, None] if hidden_layers else None)

    def _decode_in_chunks(
        self, ctx, ids: list[int], first: int, size: int, stores_hidden: bool, held: list[int]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Decode ids [T] at positions first.. in sequence 0 of `ctx`, `size` tokens per
        llama_decode; their captured keys/values (and final hidden states, where `stores_hidden`)
        go to the verified rows, the tokens to `held`. -> (logits [1, V] after the last, their
        final hidden states per chunk, [n, D] each, where `stores_hidden`: the caller's, even
        where the verified rows drop them, after earlier positions whose rows were not kept)."""
        logits, hidden_chunks = None, []
        for start in range(0, len(ids), size):
            if self._cancel is not None and self._cancel.is_set():
                self.reset()
                raise PrefillCancelled
            chunk, position = ids[start : start + size], first + start
            last = start + len(chunk) == len(ids)
            outputs = range(len(chunk)) if stores_hidden else ([len(chunk) - 1] if last else [])
            self._fill(chunk, range(position, position + len(chunk)), [[0]] * len(chunk), outputs)
            self._decode(ctx)
            if stores_hidden:
                hidden_chunks.append(self._hidden_outputs(len(chunk), ctx))
                self._hidden.write(position, hidden_chunks[-1])
            if last:
                logits = self._outputs(self.lib.llama_get_logits, len(outputs), self.vocab_size, ctx)[-1:]
            if self.capture is not None:
                self._kv.write(position, self.capture.rows(len(chunk)))
            held.extend(chunk)
        return logits, hidden_chunks

    def verify(self, tree: DraftTree, hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """Score every node of `tree` in one llama_decode.  -> logits [N, V] (numpy float32),
        hidden [N, 1, D] (torch).

        The nodes stay pending in the cache until `commit`."""
        self._check_hidden(hidden_layers)
        self._drop_pending()
        count = tree.num_nodes
        if count > 1 and not self.trees_exact:
            raise MoaspecError(
                "on this CPU llama.cpp's batched kernels do not reproduce one-token decoding bit for bit, so "
                "verifying draft trees could change the output: use --drafter none or --runtime transformers"
            )
        if count > 1 and count > self.max_tree_nodes:  # one node is one-token decoding: nothing to measure
            raise MoaspecError(
                f"a tree of {count} nodes exceeds the {self.max_tree_nodes} the llama.cpp runtime verifies here"
            )
        node_depths = depths(tree.parents)
        if self.num_cached + int(node_depths.max()) + 1 > self.max_positions:
            raise MoaspecError(f"the tree does not fit the target's context ({self.max_positions})")
        seq_sets = leaf_groups(tree.parents)
        num_seqs = len(seq_sets[0])  # the root carries every leaf's sequence
        if num_seqs > 1 and num_seqs > self.max_tree_leaves:
            raise MoaspecError(
                f"a tree with {num_seqs} leaves exceeds the {self.max_tree_leaves} the llama.cpp runtime verifies here"
            )
        self._make_room(count)
        for seq in range(1, num_seqs):
            self.lib.llama_memory_seq_cp(self.memory, 0, seq, -1, -1)
        positions = (self.num_cached + node_depths).tolist()
        tokens = tree.token_ids.tolist()
        self._fill(tokens, positions, seq_sets, range(count))
        self._pending = ([seqs[0] for seqs in seq_sets], positions, tokens, num_seqs)
        self._decode()
        kv = self.capture.rows(count) if self.capture is not None else None
        hidden = self._hidden_outputs(count) if self._stores_hidden(hidden_layers) else None
        self._pending_rows = (kv, hidden)
        logits = self._outputs(self.lib.llama_get_logits, count, self.vocab_size)
        return TargetOutput(logits, _torch_rows(hidden)[:, None] if hidden_layers else None)

    def commit(self, path_node_idx: list[int]) -> None:
        """Keep the accepted path (root first) in sequence 0. Rejected nodes placed before the
        last accepted one are parked; the others are freed (module docstring)."""
        if self._pending is None:
            raise ValueError("commit without a verified tree")
        first_seq, positions, tokens, num_seqs = self._pending
        last = path_node_idx[-1]
        keep = first_seq[last]  # its cells: the context and the whole path
        on_path = set(path_node_idx)
        lib, memory = self.lib, self.memory
        for node in range(last):  # nodes are placed in cells in batch order
            if node not in on_path:  # one node per (sequence, position): this parks exactly its cell
                lib.llama_memory_seq_cp(memory, first_seq[node], PARKED, positions[node], positions[node] + 1)
                self._parked += 1
        for seq in range(num_seqs):
            if seq != keep:
                lib.llama_memory_seq_rm(memory, seq, -1, -1)
        end = self.num_cached + len(path_node_idx)
        lib.llama_memory_seq_rm(memory, keep, end, -1)
        if keep != 0:
            lib.llama_memory_seq_cp(memory, keep, 0, -1, -1)
            lib.llama_memory_seq_rm(memory, keep, -1, -1)
        for rows, pending in zip((self._kv, self._hidden), self._pending_rows):
            if pending is not None:
                rows.write(self.num_cached, pending[path_node_idx])
        self._tokens.extend(tokens[i] for i in path_node_idx)
        self._pending, self._pending_rows = None, (None, None)

    def rollback(self, length: int) -> None:
        """Forget verified tokens at positions >= length (and anything pending)."""
        if not 0 <= length <= self.num_cached:
            raise ValueError(f"cannot roll back to {length} with {self.num_cached} verified tokens")
        self._drop_pending()
        self.lib.llama_memory_seq_rm(self.memory, 0, length, -1)
        del self._tokens[length:]
        self._moved = min(self._moved, length)
        self._kv.truncate(length)
        self._hidden.truncate(length)

    # -- internals ----------------------------------------------------------------------------

    def _drop_pending(self) -> None:
        """Free the nodes of a verified tree that was never committed (all after the context)."""
        if self._pending is not None:
            for seq in range(1, self._pending[3]):
                self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
            self.lib.llama_memory_seq_rm(self.memory, 0, self.num_cached, -1)
            self._pending, self._pending_rows = None, (None, None)

    def _fill(self, tokens: list[int], positions: Sequence[int], seq_sets: list[list[int]], outputs) -> None:
        batch = self.batch
        batch.n_tokens = len(tokens)
        wanted = set(outputs)
        for i, (token, pos, seqs) in enumerate(zip(tokens, positions, seq_sets)):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = len(seqs)
            row = batch.seq_id[i]
            for j, seq in enumerate(seqs):
                row[j] = seq
            batch.logits[i] = i in wanted

    def _decode(self, ctx=None) -> None:
        # Python runs in a capturing decode's eval callback: a signal there would stop the graph
        # part-way, so it is held until the decode ends (moaspec/signals.py)
        try:
            with signals_held() if self.capture is not None else nullcontext():
                status = self.lib.llama_decode(self.ctx if ctx is None else ctx, self.batch)
        except BaseException:
            self.reset()  # the caller is interrupted before it takes this decode's outputs
            raise
        if self.capture is not None and self.capture.failure is not None:
            self.reset()  # this decode's captured keys/values are incomplete
            self.capture.raise_failure()
        if status != 0:
            self.reset()
            raise MoaspecError(f"llama_decode failed (status {status}); the target's context was reset")

    def _outputs(self, getter, rows: int, width: int, ctx=None) -> np.ndarray:
        """A copy of the last decode's logits or embeddings of its `rows` outputs: [rows, width] float32."""
        source = getter(self.ctx if ctx is None else ctx)
        return np.ctypeslib.as_array(source, shape=(rows, width)).copy()

    def _hidden_outputs(self, rows: int, ctx=None) -> np.ndarray:
        """The last decode's final hidden states of its `rows` outputs: [rows, D] float32."""
        return self._outputs(self.lib.llama_get_embeddings, rows, self.hidden_size, ctx)


def _torch_rows(rows: np.ndarray) -> torch.Tensor:
    """torch's view of rows a model drafter asked for (torch is loaded then)."""
    import torch

    return torch.from_numpy(rows)








def exact_tree_nodes_here(target: LlamaCppTarget) -> int:
    """Measure, in a small context of its own on `target`'s weights, how many nodes a tree may
    have and keep this machine's llama.cpp kernels exact (llamacpp_exactness.py); larger trees
    are refused rather than change outputs."""
    probe = LlamaCppTarget(target.weights, None, target.config, target.name, cells=1024, threads=target.threads)
    probe._probing_exactness = True  # it verifies any tree; other sessions on the weights wait for the answer
    return exact_tree_nodes(probe, MAX_TREE_NODES)
