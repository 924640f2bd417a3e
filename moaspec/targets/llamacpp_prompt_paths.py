"""How the llama.cpp runtime prefills long prompts outside its verified context (a part of
`LlamaCppTarget`, llamacpp.py): in the prompt context, or in float torch.

Long prompts (PROMPT_CONTEXT_MIN_TOKENS or more, llamacpp.py) of models without sliding-window
layers (whose sequence state holds a second cache: Gemma-3) are prefilled in a second context, the
prompt context, with llama.cpp's default f16 / f16 cache and its tiled attention kernel, 16-25 %
faster than the per-query one over 512-1,000 tokens (AVX2 EPYC; ~4 % at 128 tokens, about what the
move costs; against a q8_0 value cache on the Xeon: 11 % at 384 tokens, 37 % at 1,000). Its cells
are then moved into the verified context through llama.cpp's sequence state (llamacpp_cells.py:
keys Hadamard-rotated and quantized as a q8_0 key cache holds them; values copied, or rotated and
quantized likewise for a q8_0 value cache). Trees stay exact: they and one-token decoding read the
same moved cells.
The tiled kernel is not batch-invariant, so the prompt context decodes in PROMPT_CHUNK chunks
aligned to position 0 and reuses only whole chunks of a previous prompt, and a prompt never reuses
cells the other path computed (a short prompt after a long one starts afresh; a long one prefills
the previous answer again). A prompt's cells are therefore a function of its tokens (and of the
thread count, which llama.cpp's one-token attention over 512+ f16 cells splits by): a chat's next
turn equals a fresh prefill bit for bit on either path. Verified tokens appended after a prompt
(`prefill`: a split session resumed after a cut rebuilds prompt and answer) are decoded in the
verified context in batches one-token decoding agrees with, never as part of a prompt.

Where this machine prefills faster in float torch (llamacpp_prefill.py: from a first-turn length
measured once, or MOASPEC_LLAMA_PREFILL), a Llama-architecture model's prompt takes the float path
instead (float_prefill.py) for its first turn: the tokens up to the chat template's first
generation prompt (the whole prompt without one), but the last of them, when there are at least
that length - 1 (FLOAT_PREFILL_MIN_TOKENS - 1 or more). They go through float32 (or, where this
machine measured them faster, bfloat16) products over the GGUF's converted weights, in FLOAT_CHUNK
chunks aligned to position 0 (whole chunks of the previous such prompt kept), their keys and
values are moved in as the prompt context's are, and the rest is decoded in the verified context
(every logit comes from llama.cpp). Where the turn ends is a function of the tokens and the same
for a conversation and its next turns, so a chat's next turn keeps the moved cells and the answer
and decodes only its new tokens, and still equals a fresh prefill bit for bit; trees read the
moved cells with the per-query kernel: exact. The drafters' keys/values and hidden states of the
moved positions come from the float forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from moaspec.chat import generation_prompt_ids
from moaspec.targets.base import PrefillCancelled, TargetOutput
from moaspec.targets.llamacpp_cells import STATE_HEADER, SequenceState
from moaspec.targets.llamacpp_contexts import MAX_BATCH, cells_for
from moaspec.targets.llamacpp_features import transformers_head_order
from moaspec.targets.llamacpp_prefill import (
    FLOAT_PREFILL_MIN_TOKENS,
    NEVER,
    float_prefill_compute,
    float_prefill_start,
)

if TYPE_CHECKING:
    import llama_cpp

    from moaspec.targets.float_prefill import FloatPrefillCache

PROMPT_CACHE_TYPE = 1  # ggml_type of the prompt context's keys and values: f16 (module docstring)
PROMPT_CHUNK = 256  # tokens per decode there, aligned to position 0 (what a reused prefix keeps)
PROMPT_CELLS_MIN = 512  # the prompt context's smallest size (it doubles to fit longer prompts)
FLOAT_CHUNK = 256  # tokens per chunk of the float path's forward, aligned to position 0 (what a reused prefix keeps)


class PromptPaths:
    """The prompt context and the float path of a `LlamaCppTarget` (module docstring); `set_context`
    (llamacpp.py) chooses between them and the verified context. Its methods use the target's state
    (`_tokens`, `_moved`, `_kv`, `_hidden`, ...)."""

    @property
    def uses_prompt_context(self) -> bool:
        """Whether long prompts are prefilled in the prompt context (module docstring): not for
        sliding-window models."""
        return not self.weights.sliding_window

    @property
    def float_prefill_start(self) -> int:
        """The fewest tokens of a prompt's first turn (its last included) that are prefilled in
        float torch here (module docstring), or NEVER (0): a model the float forward supports, no
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
    def float_compute(self) -> str:
        """The float forward's products here (float32 or bfloat16; llamacpp_prefill.py): fixed,
        saved or measured on first need, and kept by this target's sessions."""
        if self._float_compute is None:
            self._float_compute = float_prefill_compute(self)
        return self._float_compute

    def measure_float_forward(self, prompt: list[int], compute: str) -> None:
        """The float forward of `prompt` alone with `compute`'s products, from a fresh cache."""
        from moaspec.targets.float_prefill import FloatPrefillCache

        FloatPrefillCache(self._float.model, FLOAT_CHUNK, compute).prefill(prompt)

    @property
    def uses_float_prefill(self) -> bool:
        """Whether some prompts are prefilled in float torch here (`float_prefill_start`)."""
        return self.float_prefill_start != NEVER

    def measure_prefill(self, ctx: llama_cpp.llama_context_p, prompt: list[int], through_float: bool) -> None:
        """Prefill `prompt` into the empty measuring context `ctx` as set_context would: in one
        llama.cpp decode, or `through_float` (a fresh float forward, the move, the last token decoded)."""
        first = 0
        if through_float:
            from moaspec.targets.float_prefill import FloatPrefillCache

            cache = FloatPrefillCache(self._float.model, FLOAT_CHUNK, self.float_compute)
            cache.prefill(prompt[:-1])
            self._load_cells(ctx, self._float_cells(ctx, cache, len(prompt) - 1))
            first = len(prompt) - 1
        self._fill(prompt[first:], range(first, len(prompt)), [[0]] * (len(prompt) - first), [len(prompt) - first - 1])
        self._decode(ctx)

    def _prompt_context(self, length: int):
        """The prompt context (f16 keys and values, one sequence), grown to hold `length` tokens;
        growing makes a new one, empty."""
        if self._prompt_ctx is not None and length <= self._prompt_capacity:
            return self._prompt_ctx
        self._free_prompt_context()
        cells = cells_for(length, PROMPT_CELLS_MIN, self.cells)
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

    def _prefill_in_prompt_context(self, ids: list[int], hidden_layers: tuple[int, ...]) -> TargetOutput:
        """Prefill a long prompt in the prompt context (f16 keys: llama.cpp's faster batched
        attention), in PROMPT_CHUNK-aligned chunks from position 0, reusing whole chunks the
        prompt context still holds, then move every cell into the verified context."""
        ctx = self._prompt_context(len(ids))
        common = min(shared_start(self._prompt_tokens, ids), self._moved if self._moved_from == "prompt context" else 0)
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
        boundary = end_of_first(self._generation_prompt, ids) - 1
        return boundary if boundary >= start - 1 else None

    def _prefill_in_float(self, ids: list[int], boundary: int, hidden_layers: tuple[int, ...]) -> TargetOutput:
        """Prefill ids[:boundary] in float torch (float_prefill.py, products as `float_compute`:
        FLOAT_CHUNK chunks from position 0, whole chunks of the last such prompt kept), move their keys and values into
        the verified context, and decode the rest there (its logits, as every token's, come from
        llama.cpp)."""
        body = ids[:boundary]
        if self._ctx is not None:  # emptied first: an interruption leaves an empty context, not a stale one
            self.lib.llama_memory_clear(self._memory, True)
        self._tokens, self._moved, self._parked = [], 0, 0
        if len(ids) > self._allocated:
            self._grow(len(ids))  # empty: a larger context, nothing to move
        if self._float_cache is None:
            from moaspec.targets.float_prefill import FloatPrefillCache

            self._float_cache = FloatPrefillCache(self._float.model, FLOAT_CHUNK, self.float_compute)
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

    def _prompt_cells(self, count: int) -> SequenceState:
        """The prompt context's first `count` cells, as llama.cpp saves them."""
        return SequenceState.parse(memoryview(self._sequence_state(self._prompt_ctx))).leading(count)

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


def end_of_first(pattern: Sequence[int], ids: list[int]) -> int:
    """The index after the first occurrence of `pattern` in `ids`; len(ids) where there is none
    (or `pattern` is empty)."""
    if pattern:
        first, size = pattern[0], len(pattern)
        for start in range(len(ids) - size + 1):
            if ids[start] == first and tuple(ids[start : start + size]) == tuple(pattern):
                return start + size
    return len(ids)

def shared_start(held: list[int], ids: list[int]) -> int:
    """How many leading tokens of `held` the prompt `ids` repeats, its last token left out (it
    is decoded again for its logits)."""
    count = 0
    for old, new in zip(held, ids[:-1]):
        if old != new:
            break
        count += 1
    return count
