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
  those of the chosen cache. Long prompts take the prompt context (below) with either: for q8_0
  values the move rotates and quantizes them as it does the keys;
- that kernel visits cells in cell order, so verified tokens must stay in cells in position order.
  llama.cpp refills freed cells from the lowest one, so a rejected node placed *before* the last
  accepted one is parked (moved to sequence PARKED, never attended) instead of freed. Parked cells
  are reclaimed when the cache fills (`_reclaim_parked`): sequence 0 is saved through llama.cpp's
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

The verified context has TREE_HEADROOM cells beyond its positions: a tree at the context's end
fits by depth (the engine prunes it so) but needs a cell per node. llama.cpp allocates and clears
a context's cache when it makes it (~17 KB a cell on SmolLM2-135M: ~150 MB for 8,192 positions),
so the verified context starts at SESSION_CELLS_MIN positions and doubles, up to `cells`, when
verified tokens or a tree pass them (`_grow`): its cells move to the larger one through llama.cpp's
sequence state, the same bits in cells 0.. in position order.

Long prompts (PROMPT_CONTEXT_MIN_TOKENS or more) of models without sliding-window layers (whose
sequence state holds a second cache: Gemma-3) are prefilled in a second context, the prompt
context, with llama.cpp's default f16 / f16 cache and its tiled attention kernel, 16-25 %
faster than the per-query one over 512-1,000 tokens (AVX2 EPYC; ~4 % at 128 tokens, about what
the move costs; against a q8_0 value cache on the Xeon: 11 % at 384 tokens, 37 % at 1,000). Its
cells are then moved into the verified context through llama.cpp's sequence state
(llamacpp_cells.py: keys Hadamard-rotated and quantized as a q8_0 key cache holds them; values
copied, or rotated and quantized likewise for a q8_0 value cache). Trees stay exact: they and
one-token decoding read the same moved cells.
The tiled kernel is not batch-invariant, so the prompt context decodes in PROMPT_CHUNK chunks
aligned to position 0 and reuses only whole chunks of a previous prompt, and a prompt never
reuses cells the other path computed (a short prompt after a long one starts afresh; a long one
prefills the previous answer again). A prompt's cells are therefore a function of its tokens
(and of the thread count, which llama.cpp's one-token attention over 512+ f16 cells splits by):
a chat's next turn equals a fresh prefill bit for bit on either path. Verified tokens appended
after a prompt (`prefill`: a split session resumed after a cut rebuilds prompt and answer) are
decoded in this context in batches one-token decoding agrees with, never as part of a prompt.

Where this machine prefills faster in float32 torch (llamacpp_prefill.py: from a first-turn
length measured once, or MOASPEC_LLAMA_PREFILL), a Llama-architecture model's prompt takes the
float path instead (float_prefill.py) for its first turn: the tokens up to the chat template's
first generation prompt (the whole prompt without one), but the last of them, when there are at
least that length - 1 (FLOAT_PREFILL_MIN_TOKENS - 1 or more). They go through float32 products
over the GGUF's converted weights, in FLOAT_CHUNK chunks aligned to position 0 (whole chunks of
the previous such prompt kept), their keys and values are moved in as the prompt context's are,
and the rest is decoded here (every logit comes from llama.cpp). Where the turn ends is a
function of the tokens and the same for a conversation and its next turns, so a chat's next turn
keeps the moved cells and the answer and decodes only its new tokens, and still equals a fresh
prefill bit for bit; trees read the moved cells with the per-query kernel: exact. The drafters'
keys/values and hidden states of the moved positions come from the float forward.

Features for drafters: hidden states after the final norm come with the logits (llama.cpp's
embeddings output), where asked for or kept throughout (`keep_final_hidden`); per-layer
keys/values through the eval callback (llamacpp_features.py) for the layers a drafter asks for
(`keep_layer_kv`). Both are kept for the verified tokens, in numpy. Other intermediate hidden states and the torch
layers Target Layer Inference runs are not available on this runtime: drafters that need them
are refused with a clear error.

Beside this module: llamacpp_model.py (the bindings and the GGUF's weights), llamacpp_exactness.py
(the per-machine measure of how large a tree stays exact), llamacpp_cells.py (moving a prompt's cells),
llamacpp_features.py (the eval callback's keys/values, and the rows kept of verified positions),
llamacpp_value_cache.py (the per-machine choice of the value cache).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from moaspec.chat import generation_prompt_ids
from moaspec.errors import MoaspecError
from moaspec.signals import signals_held
from moaspec.targets.base import PrefillCancelled, TargetOutput, context_overflow
from moaspec.targets.llamacpp_cells import STATE_HEADER, SequenceState
from moaspec.targets.llamacpp_exactness import exact_tree_nodes, saved_or_measured
from moaspec.targets.llamacpp_features import CapturedKV, VerifiedRows, transformers_head_order
from moaspec.targets.llamacpp_model import LlamaCppModel
from moaspec.targets.llamacpp_prefill import (
    FLOAT_PREFILL_MIN_TOKENS,
    NEVER,
    SharedFloatLlama,
    fixed_float_prefill_start,
    float_prefill_start,
)
from moaspec.targets.llamacpp_value_cache import VALUE_CACHE_NAMES, fixed_value_cache_type, value_cache_type
from moaspec.tree import DraftTree, depths, leaf_groups

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import llama_cpp
    import torch

    from moaspec.nn.target_parts import TargetParts
    from moaspec.targets.float_prefill import FloatPrefillCache

DEFAULT_CELLS = 8192  # positions the verified context holds at most (q8_0 keys + f16 values: ~17 KB a cell on SmolLM2-135M)
MAX_BATCH = 512  # tokens per llama_decode (prefill runs in chunks of this size)
SESSION_CELLS_MIN = 1024  # the verified context's first size (it doubles as needed: `_grow`)
MAX_TREE_NODES = 128  # nodes per verified tree (a node costs 0.3-0.9 of a step on a 2-core CPU)
# cells the verified context has beyond its positions (`_allocated`): a tree verified at the context's
# end needs a cell per node, not per position (~2 MB on SmolLM2-135M)
TREE_HEADROOM = MAX_TREE_NODES
MAX_LEAVES = 62  # leaves per verified tree (one llama.cpp sequence id each)
PARKED = MAX_LEAVES + 1  # the sequence of parked cells (see the module docstring)
KEY_CACHE_TYPE = 8  # ggml_type of the key cache: q8_0
PROMPT_CACHE_TYPE = 1  # ggml_type of the prompt context's keys and values: f16 (module docstring)
PROMPT_CONTEXT_MIN_TOKENS = 384  # prompts this long or longer are prefilled in the prompt context
PROMPT_CHUNK = 256  # tokens per decode there, aligned to position 0 (what a reused prefix keeps)
PROMPT_CELLS_MIN = 512  # the prompt context's smallest size (it doubles to fit longer prompts)
FLOAT_CHUNK = 256  # tokens per chunk of the float path's forward, aligned to position 0 (what a reused prefix keeps)
COMPACT_CHUNK = 32  # tokens per decode when re-decoding or appending verified tokens (per-row kernels up to 40 measured)


class LlamaCppTarget:
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
        self._parts_loader = parts_loader  # tli_layers -> TargetParts (torch copies of frozen modules)
        self._parts = {} if parts is None else parts  # tli_layers -> loaded parts, shared by sessions
        self._float = float_llama  # the float32 prefill's weights, shared by sessions (None: no float path)
        if float_prefill_start is None:
            float_prefill_start = fixed_float_prefill_start()  # a bad MOASPEC_LLAMA_PREFILL fails now
        # from which first-turn length this machine prefills in float (NEVER: not at all; None: decided on first need)
        self._float_start = float_prefill_start
        self._generation_prompt: tuple[int, ...] | None = None  # the chat template's (_float_boundary)
        self._float_cache: FloatPrefillCache | None = None  # the float path's keys/values of the last prompt
        self._probing_exactness = False  # set on exact_tree_nodes_here's own probe: it verifies any tree
        self.cells = cells  # the most positions the verified context holds
        # positions it is made with (`_grow` doubles them); whole for a sliding-window model, whose
        # sequence state holds a second cache that no test here moves (no such GGUF is at hand)
        self._allocated = cells if model.sliding_window else min(cells, SESSION_CELLS_MIN)
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

    @property
    def uses_prompt_context(self) -> bool:
        """Whether long prompts are prefilled in the prompt context (module docstring): not for
        sliding-window models."""
        return not self.weights.sliding_window

    @property
    def float_prefill_start(self) -> int:
        """The fewest tokens of a prompt's first turn (its last included) that are prefilled in
        float32 torch here (module docstring), or NEVER (0): a model the float forward supports, no
        sliding window, no GPU layers (llama.cpp prefills faster there), and this machine's choice
        (llamacpp_prefill.py, at least FLOAT_PREFILL_MIN_TOKENS). Never in the exactness probe,
        which checks llama.cpp's own kernels."""
        if self._float is None or self._float.unsupported or self.weights.sliding_window or self.weights.gpu_layers:
            return NEVER
        if self._probing_exactness:
            return NEVER
        if self._float_start is None:
            self._float_start = float_prefill_start(self)
        return self._float_start

    @property
    def uses_float_prefill(self) -> bool:
        """Whether some prompts are prefilled in float32 torch here (`float_prefill_start`)."""
        return self.float_prefill_start != NEVER

    @property
    def ctx(self) -> llama_cpp.llama_context_p:
        """The verified context: q8_0 keys, every sequence a tree needs (module docstring)."""
        return self._context()

    @property
    def memory(self) -> llama_cpp.llama_memory_t:
        """The verified context's memory (its cache's sequence operations)."""
        self._context()
        return self._memory

    def _context(self):
        """The verified context, made on first need (with the eval callback when keys/values
        are captured)."""
        if self._ctx is None:
            self._ctx = self._new_llama_context(
                self._allocated + TREE_HEADROOM, KEY_CACHE_TYPE, self.value_cache_type, PARKED + 1, MAX_BATCH
            )
            self._memory = self.lib.llama_get_memory(self._ctx)
            self._embeddings_on[self._ctx] = False
        return self._ctx

    def _drop_contexts(self) -> None:
        """Free the verified context and the prompt context (both are made again on first need,
        with the callback capture then asks for)."""
        self._free_prompt_context()
        if self._ctx is not None:
            self._embeddings_on.pop(self._ctx, None)
            self._free_llama_context(self._ctx)
            self._ctx = self._memory = None

    def new_measuring_context(self, cells: int, value_type: int) -> llama_cpp.llama_context_p:
        """A one-sequence context with q8_0 keys and `value_type` values and no eval callback, for
        a measurement (llamacpp_value_cache.py); free it with free_measuring_context."""
        return self._new_llama_context(cells, KEY_CACHE_TYPE, value_type, 1, MAX_BATCH, capture=False)

    def free_measuring_context(self, ctx: llama_cpp.llama_context_p) -> None:
        """Free a context new_measuring_context made."""
        self._free_llama_context(ctx)

    def clear_measuring_context(self, ctx: llama_cpp.llama_context_p) -> None:
        """Empty a context new_measuring_context made."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)

    def measure_prefill(self, ctx: llama_cpp.llama_context_p, prompt: list[int], through_float: bool) -> None:
        """Prefill `prompt` into the empty measuring context `ctx` as set_context would: in one
        llama.cpp decode, or `through_float` (a fresh float forward, the move, the last token decoded)."""
        first = 0
        if through_float:
            from moaspec.targets.float_prefill import FloatPrefillCache

            cache = FloatPrefillCache(self._float.model, FLOAT_CHUNK)
            cache.prefill(prompt[:-1])
            self._load_cells(ctx, self._float_cells(ctx, cache, len(prompt) - 1))
            first = len(prompt) - 1
        self._fill(prompt[first:], range(first, len(prompt)), [[0]] * (len(prompt) - first), [len(prompt) - first - 1])
        self._decode(ctx)

    def _new_llama_context(
        self, cells: int, key_type: int, value_type: int, sequences: int, batch: int, capture: bool = True
    ):
        """A flash-attention llama_context on the weights with a cache of those ggml types, decoding
        up to `batch` tokens at once (its compute buffers are sized by it), with the eval callback
        when keys/values are captured (unless not `capture`: a measurement's context)."""
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = params.n_ubatch = batch
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = self.threads
        params.kv_unified = True
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.type_k, params.type_v = key_type, value_type
        params.no_perf = True
        if self.capture is not None and capture:
            params.cb_eval = self.capture.callback
        ctx = None
        try:
            with signals_held():  # llama.cpp logs ~1,300 lines through a Python callback: see _quiet_logs
                ctx = lib.llama_init_from_model(self.weights.model, params)
        except BaseException:  # Ctrl-C or SIGTERM delivered after the call: the context is not kept
            self._free_llama_context(ctx)
            raise
        if not ctx:
            raise MoaspecError(f"llama.cpp cannot create a context of {cells} cells for {self.name}")
        return ctx

    def _prompt_context(self, length: int):
        """The prompt context (f16 keys and values, one sequence), grown to hold `length` tokens;
        growing makes a new one, empty."""
        if self._prompt_ctx is not None and length <= self._prompt_capacity:
            return self._prompt_ctx
        self._free_prompt_context()
        cells = _cells_for(length, PROMPT_CELLS_MIN, self.cells)
        self._prompt_ctx = self._new_llama_context(cells, PROMPT_CACHE_TYPE, PROMPT_CACHE_TYPE, 1, PROMPT_CHUNK)
        self._prompt_capacity = cells
        self._embeddings_on[self._prompt_ctx] = False
        self._prompt_tokens = []
        return self._prompt_ctx

    def _free_prompt_context(self) -> None:
        if getattr(self, "_prompt_ctx", None):
            self._embeddings_on.pop(self._prompt_ctx, None)
            self._free_llama_context(self._prompt_ctx)
        self._prompt_ctx, self._prompt_capacity, self._prompt_tokens = None, 0, []

    def _free_llama_context(self, ctx) -> None:
        """llama_free (which logs too: signals held) of a context, if there is one."""
        if ctx:
            with signals_held():
                self.lib.llama_free(ctx)

    def __del__(self) -> None:
        if getattr(self, "lib", None) is None:
            return
        if getattr(self, "batch", None) is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None
        if getattr(self, "_embeddings_on", None) is not None:
            self._drop_contexts()

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

    # -- lifecycle ----------------------------------------------------------------------------
    def new_session(self, positions: int | None = None) -> LlamaCppTarget:
        """A context of its own on the same weights (capturing the same keys/values): of this
        one's size, or of `positions` rounded up to a power of two, SESSION_CELLS_MIN at least (the
        most it holds: its cache, allocated SESSION_CELLS_MIN positions at first, doubles up to
        that as it fills, `_grow`; the rounding leaves a chat's next turns room in it, which a
        server reuses: IdleTargets)."""
        cells = self.cells if positions is None else _cells_for(positions, SESSION_CELLS_MIN, self.cells)
        other = LlamaCppTarget(
            self.weights, self.tokenizer, self.config, self.name,
            cells=cells, threads=self.threads, parts_loader=self._parts_loader, parts=self._parts,
            value_cache=self.value_cache_type,  # the same tokens as this one's
            float_llama=self._float, float_prefill_start=self._float_start,  # prompts prefilled as this one's
            embedding_file=self.embedding_file,
        )
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
        self._moved_from: str | None = None  # "prompt context" or "float" (float32 torch)
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
        keep = _shared_start(self._tokens, ids) if same_start else 0
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

    def _prefill_in_prompt_context(self, ids: list[int], hidden_layers: tuple[int, ...]) -> TargetOutput:
        """Prefill a long prompt in the prompt context (f16 keys: llama.cpp's faster batched
        attention), in PROMPT_CHUNK-aligned chunks from position 0, reusing whole chunks the
        prompt context still holds, then move every cell into the verified context."""
        ctx = self._prompt_context(len(ids))
        common = min(_shared_start(self._prompt_tokens, ids), self._moved if self._moved_from == "prompt context" else 0)
        if self.capture is not None:
            common = min(common, self._kv.valid)
        if self._stores_hidden(hidden_layers):
            common = min(common, self._hidden.valid)
        keep = common // PROMPT_CHUNK * PROMPT_CHUNK
        # the verified context is rebuilt from the prompt context below: empty it first, so that an
        # interruption in between leaves an empty context rather than a stale one
        if self._ctx is not None:
            self.lib.llama_memory_clear(self._memory, True)
        self._tokens, self._moved, self._parked = [], 0, 0
        if len(ids) > self._allocated:
            self._grow(len(ids))  # empty: a larger context, nothing to move
        self._restore_prompt_cells(keep)
        self._kv.truncate(keep)
        self._hidden.truncate(keep)
        stores_hidden = self._stores_hidden(hidden_layers)
        self._use_embeddings(ctx, stores_hidden)
        logits, _ = self._decode_in_chunks(ctx, ids[keep:], keep, PROMPT_CHUNK, stores_hidden, self._prompt_tokens)
        self._move_prompt_cells(len(ids))
        self._tokens = list(ids)
        return TargetOutput(logits, self.verified_hidden(0, len(ids)) if hidden_layers else None)

    def _float_boundary(self, ids: list[int]) -> int | None:
        """How many leading tokens of a prompt the float path prefills: its first turn but the
        turn's last token (through the first generation prompt of the chat template; the whole
        prompt but its last token where there is none), or None: no float path here, or fewer than
        `float_prefill_start` - 1 such tokens. A function of the tokens alone, and the same for a
        conversation and its next turns, which keep the cells (module docstring)."""
        if len(ids) < FLOAT_PREFILL_MIN_TOKENS:
            return None
        start = self.float_prefill_start
        if start == NEVER or len(ids) < start:
            return None
        if self._generation_prompt is None:
            self._generation_prompt = generation_prompt_ids(self.tokenizer)
        boundary = _end_of_first(self._generation_prompt, ids) - 1
        return boundary if boundary >= start - 1 else None

    def _prefill_in_float(self, ids: list[int], boundary: int, hidden_layers: tuple[int, ...]) -> TargetOutput:
        """Prefill ids[:boundary] in float32 torch (float_prefill.py: FLOAT_CHUNK chunks from
        position 0, whole chunks of the last such prompt kept), move their keys and values into
        the verified context, and decode the rest here (its logits, as every token's, come from
        llama.cpp)."""
        body = ids[:boundary]
        if self._ctx is not None:  # emptied first: an interruption leaves an empty context, not a stale one
            self.lib.llama_memory_clear(self._memory, True)
        self._tokens, self._moved, self._parked = [], 0, 0
        if len(ids) > self._allocated:
            self._grow(len(ids))  # empty: a larger context, nothing to move
        if self._float_cache is None:
            from moaspec.targets.float_prefill import FloatPrefillCache

            self._float_cache = FloatPrefillCache(self._float.model, FLOAT_CHUNK)
        cache = self._float_cache
        cache.prefill(body, cancelled=lambda: self._cancel is not None and self._cancel.is_set())
        if len(cache.tokens) < len(body):
            self.reset()
            raise PrefillCancelled
        self._load_cells(self.ctx, self._float_cells(self.ctx, cache, len(body)))
        self._moved, self._moved_from = len(body), "float"
        self._tokens = list(body)
        self._kv.truncate(0)
        self._hidden.truncate(0)
        if self.capture is not None:
            self._kv.write(0, cache.layer_rows(self.capture.layers, len(body)))
        stores_hidden = self._stores_hidden(hidden_layers)
        if stores_hidden:
            self._hidden.write(0, cache.hidden[: len(body)])
        logits, _ = self._decode_in_chunks(self.ctx, ids[boundary:], boundary, MAX_BATCH, stores_hidden, self._tokens)
        return TargetOutput(logits, self.verified_hidden(0, len(ids)) if hidden_layers else None)

    def _float_cells(self, ctx, cache: FloatPrefillCache, count: int) -> SequenceState:
        """The float path's first `count` held tokens as cells for `ctx` (empty): keys in llama.cpp's
        per-head order (llamacpp_features.py), rotated and q8_0 as its key cache holds them; values
        likewise for a q8_0 value cache, else float16."""
        header = bytes(self._sequence_state(ctx))[:STATE_HEADER]  # an empty sequence's state: its header
        to_llama = transformers_head_order(self._head_dim).argsort()
        keys = cache.keys[:, :count].numpy()[..., to_llama]
        keys = keys.reshape(*keys.shape[:2], -1)  # [L, T, n_kv * head_dim]
        values = cache.values[:, :count].flatten(2).numpy()
        cells = SequenceState.of_floats(header, list(keys), list(values))
        return cells.to_q8_0(self._head_dim, values=self.value_cache_name == "q8_0")

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

    def _drop_pending(self) -> None:
        """Free the nodes of a verified tree that was never committed (all after the context)."""
        if self._pending is not None:
            for seq in range(1, self._pending[3]):
                self.lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
            self.lib.llama_memory_seq_rm(self.memory, 0, self.num_cached, -1)
            self._pending, self._pending_rows = None, (None, None)

    def _make_room(self, count: int) -> None:
        """Make room for `count` more cells after the verified ones: a larger verified context
        when they pass its positions (`_grow`), else parked cells reclaimed when they would not fit
        after the used ones in its cells (positions + TREE_HEADROOM, as llama.cpp rounds them up);
        after that they fit: at most `cells` positions plus TREE_HEADROOM nodes."""
        if self.num_cached + count > self._allocated and self._allocated < self.cells:
            self._grow(self.num_cached + count)
        if self.num_cached + self._parked + count <= self.lib.llama_n_ctx(self.ctx) or not self._parked:
            return
        self._reclaim_parked()

    def _reclaim_parked(self) -> None:
        """Free the parked cells, sequence 0 left in cells 0.. in position order: saved through
        llama.cpp's sequence state and loaded back into the emptied cache (the same bits, nothing
        decoded), or, for a sliding-window model (whose state holds a second cache that no test
        here moves; it never uses the prompt context), by re-decoding the verified tokens."""
        self._parked = 0
        self.compactions += 1
        if not self.weights.sliding_window:
            state = self._sequence_state(self.ctx)
            self.lib.llama_memory_clear(self.memory, True)
            self._load_state(self.ctx, state)
            return
        tokens = self._tokens
        self.lib.llama_memory_clear(self.memory, True)
        step = self._exact_batch
        for start in range(0, len(tokens), step):
            chunk = tokens[start : start + step]
            self._fill(chunk, range(start, start + len(chunk)), [[0]] * len(chunk), ())
            self._decode()

    def _grow(self, positions: int) -> None:
        """Make the verified context one of `positions` rounded up to a power of two (at most
        `cells`): the KV cache is allocated and cleared up front, ~17 KB a cell on SmolLM2-135M,
        so a context starts at SESSION_CELLS_MIN rather than the 8,192 positions' ~150 MB. The
        verified cells move through llama.cpp's sequence state, the same bits in cells 0.. in
        position order (parked cells stay behind, as a compaction leaves them)."""
        state = self._sequence_state(self._ctx) if self._ctx is not None and self.num_cached else None
        embeddings = self._embeddings_on.pop(self._ctx, False) if self._ctx is not None else False
        old, self._ctx, self._memory = self._ctx, None, None  # cleared before the free: no dangling pointer
        self._free_llama_context(old)
        self._allocated = _cells_for(positions, SESSION_CELLS_MIN, self.cells)
        self._parked = 0
        try:
            if state is not None:
                self._load_state(self.ctx, state)
            self._use_embeddings(self.ctx, embeddings)
        except BaseException:  # no context holds the verified tokens: forget them
            self.reset()
            raise

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

    def _prompt_cells(self, count: int) -> SequenceState:
        """The prompt context's first `count` cells, as llama.cpp saves them."""
        return SequenceState.parse(memoryview(self._sequence_state(self._prompt_ctx))).leading(count)

    def _sequence_state(self, ctx) -> ctypes.Array:
        """Sequence 0 of `ctx` (its cells' positions, keys and values) as llama.cpp saves it."""
        lib = self.lib
        size = lib.llama_state_seq_get_size(ctx, 0)
        state = (ctypes.c_uint8 * size)()
        if lib.llama_state_seq_get_data(ctx, state, size, 0) != size:
            self.reset()
            raise MoaspecError("llama.cpp could not save the context's cells; the target's context was reset")
        return state

    def _load_cells(self, ctx, cells: SequenceState) -> None:
        """Make `cells` sequence 0 of the empty context `ctx` (in cells 0.., position order)."""
        data = cells.to_buffer()
        self._load_state(ctx, (ctypes.c_uint8 * len(data)).from_buffer(data))

    def _load_state(self, ctx, state: ctypes.Array) -> None:
        """Make a saved sequence state sequence 0 of the empty context `ctx` (in cells 0.., position order)."""
        if self.lib.llama_state_seq_set_data(ctx, state, len(state), 0) != len(state):
            self.reset()
            raise MoaspecError("llama.cpp refused the context's cells; the target's context was reset")

    def _restore_prompt_cells(self, keep: int) -> None:
        """Keep the prompt context's first `keep` cells only, in cells 0..keep-1 as a fresh
        prefill leaves them (llama.cpp may refill freed cells elsewhere)."""
        if keep == len(self._prompt_tokens):
            return
        memory = self.lib.llama_get_memory(self._prompt_ctx)
        kept = self._prompt_cells(keep) if keep else None
        self.lib.llama_memory_clear(memory, True)
        del self._prompt_tokens[keep:]
        if kept is not None:
            self._load_cells(self._prompt_ctx, kept)

    def _move_prompt_cells(self, count: int) -> None:
        """Copy the prompt context's first `count` cells into the verified context's empty
        sequence 0 (llamacpp_cells.py): rotated, q8_0 keys; values rotated and q8_0 for a q8_0
        value cache, else the same."""
        cells = self._prompt_cells(count).to_q8_0(self._head_dim, values=self.value_cache_name == "q8_0")
        self._load_cells(self.ctx, cells)
        self._moved, self._moved_from = count, "prompt context"

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


def _cells_for(positions: int, at_least: int, at_most: int) -> int:
    """A context's size for `positions`: rounded up to a power of two, within the bounds."""
    return min(at_most, max(at_least, 1 << (positions - 1).bit_length()))


def _end_of_first(pattern: Sequence[int], ids: list[int]) -> int:
    """The index after the first occurrence of `pattern` in `ids`; len(ids) where there is none
    (or `pattern` is empty)."""
    if pattern:
        first, size = pattern[0], len(pattern)
        for start in range(len(ids) - size + 1):
            if ids[start] == first and tuple(ids[start : start + size]) == tuple(pattern):
                return start + size
    return len(ids)


def _shared_start(held: list[int], ids: list[int]) -> int:
    """How many leading tokens of `held` the prompt `ids` repeats, its last token left out (it
    is decoded again for its logits)."""
    count = 0
    for old, new in zip(held, ids[:-1]):
        if old != new:
            break
        count += 1
    return count


def exact_tree_nodes_here(target: LlamaCppTarget) -> int:
    """Measure, in a small context of its own on `target`'s weights, how many nodes a tree may
    have and keep this machine's llama.cpp kernels exact (llamacpp_exactness.py); larger trees
    are refused rather than change outputs."""
    probe = LlamaCppTarget(target.weights, None, target.config, target.name, cells=1024, threads=target.threads)
    probe._probing_exactness = True  # it verifies any tree; other sessions on the weights wait for the answer
    return exact_tree_nodes(probe, MAX_TREE_NODES)
