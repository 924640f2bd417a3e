"""The llama.cpp runtime's contexts and their cells (a part of `LlamaCppTarget`, llamacpp.py).

The verified context is one `llama_context` whose KV cache is unified across sequence ids: the
verified tokens in sequence 0, a verified tree's leaves in sequences 1..MAX_LEAVES, parked cells
in PARKED (llamacpp.py's module docstring says why cells are parked rather than freed).

Its cache has TREE_HEADROOM cells beyond its positions: a tree at the context's end fits by depth
(the engine prunes it so) but needs a cell per node. llama.cpp allocates and clears a context's
cache when it makes it (~17 KB a cell on SmolLM2-135M: ~150 MB for 8,192 positions), so the
verified context starts at SESSION_CELLS_MIN positions and doubles, up to `cells`, when verified
tokens or a tree pass them (`_grow`): its cells move to the larger one through llama.cpp's sequence
state, the same bits in cells 0.. in position order. Parked cells are reclaimed the same way when
the cache fills (`_reclaim_parked`). A sliding-window model's sequence state holds a second cache
that no test here moves (no such GGUF is at hand): its context is allocated whole, and reclaiming
re-decodes its verified tokens instead.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError
from moaspec.signals import signals_held

if TYPE_CHECKING:
    import llama_cpp

    from moaspec.targets.llamacpp_cells import SequenceState

DEFAULT_CELLS = 8192  # positions the verified context holds at most (q8_0 keys + f16 values: ~17 KB a cell on SmolLM2-135M)
MAX_BATCH = 512  # tokens per llama_decode (prefill runs in chunks of this size)
SESSION_CELLS_MIN = 1024  # the verified context's first size (it doubles as needed: `_grow`)
MAX_TREE_NODES = 128  # nodes per verified tree (a node costs 0.3-0.9 of a step on a 2-core CPU)
# cells the verified context has beyond its positions (`_allocated`): a tree verified at the context's
# end needs a cell per node, not per position (~2 MB on SmolLM2-135M)
TREE_HEADROOM = MAX_TREE_NODES
MAX_LEAVES = 62  # leaves per verified tree (one llama.cpp sequence id each)
PARKED = MAX_LEAVES + 1  # the sequence of parked cells (llamacpp.py's module docstring)
KEY_CACHE_TYPE = 8  # ggml_type of the key cache: q8_0 (a target's `key_cache_type` unless a probe sets another)


class ContextCells:
    """The contexts of a `LlamaCppTarget` and the moves of their cells (module docstring): making
    and freeing contexts, growing the verified one, reclaiming parked cells, saving and loading a
    sequence's state. Its methods use the target's state (`_ctx`, `_allocated`, `_parked`, ...)."""

    @property
    def ctx(self) -> llama_cpp.llama_context_p:
        """The verified context: `key_cache_type` keys (q8_0), every sequence a tree needs (module docstring)."""
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
                self._allocated + TREE_HEADROOM, self.key_cache_type, self.value_cache_type, PARKED + 1, MAX_BATCH
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
        return self._new_llama_context(cells, self.key_cache_type, value_type, 1, MAX_BATCH, capture=False)

    def free_measuring_context(self, ctx: llama_cpp.llama_context_p) -> None:
        """Free a context new_measuring_context made."""
        self._free_llama_context(ctx)

    def clear_measuring_context(self, ctx: llama_cpp.llama_context_p) -> None:
        """Empty a context new_measuring_context made."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(ctx), True)

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

    def _free_llama_context(self, ctx) -> None:
        """llama_free (which logs too: signals held) of a context, if there is one."""
        if ctx:
            with signals_held():
                self.lib.llama_free(ctx)

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
        self._allocated = cells_for(positions, SESSION_CELLS_MIN, self.cells)
        self._parked = 0
        try:
            if state is not None:
                self._load_state(self.ctx, state)
            self._use_embeddings(self.ctx, embeddings)
        except BaseException:  # no context holds the verified tokens: forget them
            self.reset()
            raise

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


def cells_for(positions: int, at_least: int, at_most: int) -> int:
    """A context's size for `positions`: rounded up to a power of two, within the bounds."""
    return min(at_most, max(at_least, 1 << (positions - 1).bit_length()))


def first_allocation(cells: int, sliding_window: int) -> int:
    """The positions a verified context of at most `cells` is made with: SESSION_CELLS_MIN (it
    grows as needed), or all of them for a sliding-window model (module docstring)."""
    return cells if sliding_window else min(cells, SESSION_CELLS_MIN)


def session_cells(positions: int, cells: int) -> int:
    """The most positions a new session sized for `positions` holds: rounded up to a power of two,
    SESSION_CELLS_MIN at least, `cells` at most."""
    return cells_for(positions, SESSION_CELLS_MIN, cells)
