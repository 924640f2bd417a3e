"""Baselines a llama.cpp user already runs: llama-cpp-python's own generation on the same GGUF.

`llama.cpp`: `Llama.generate` with the library's defaults (f16 KV cache, flash attention as
llama.cpp decides), the same threads as the target; `llama.cpp-pld`: the same with its
prompt-lookup decoding (`LlamaPromptLookupDecoding`, LLAMA_CPP_PLD_TOKENS drafted tokens).

These are another program's outputs, not our engine's: llama.cpp's numerics change with the KV
cache type and batch shapes, so their greedy tokens may differ from our `none` by near-ties. The
benchmark reports how often they agree instead of calling a difference a mismatch (`lossless`
False).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.bench.method_run import MethodRun
from moaspec.metrics import SpecStats

if TYPE_CHECKING:
    from moaspec.config import SamplingConfig

LLAMA_CPP_PLD_TOKENS = 10  # llama-cpp-python's documented example value


@contextmanager
def _loaded_as_the_runtime_loads() -> Iterator[None]:
    """While a `Llama` is built, llama_model_default_params answers with the extra buffer types
    our runtime loads its models with (llamacpp_model.repacks_weights: none in a build with AMX
    kernels, which crash), so the baseline runs the kernels the target does (`Llama` takes its
    model parameters from that function and has no argument for them)."""
    import llama_cpp.llama_cpp as bindings

    from moaspec.targets.llamacpp_model import repacks_weights

    defaults = bindings.llama_model_default_params

    def runtime_params():
        params = defaults()
        params.use_extra_bufts = repacks_weights(bindings)
        return params

    bindings.llama_model_default_params = runtime_params
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


class LlamaCppGenerateMethod:
    """llama-cpp-python's `Llama.generate` on `gguf`, optionally with prompt-lookup decoding."""

    lossless = False

    def __init__(
        self, label: str, gguf: Path, threads: int, context: int, stop_ids: frozenset[int], prompt_lookup: int | None
    ) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.label = label
        self.stop_ids = stop_ids
        draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup) if prompt_lookup else None
        # logits_all with a draft model: llama-cpp-python keeps every position's logits then, and
        # sizes that buffer by this flag, not by draft_model (0.3.36)
        with _loaded_as_the_runtime_loads():
            self.llm = Llama(
                model_path=str(gguf), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                draft_model=draft, logits_all=draft is not None, verbose=False,
            )
        self.context = context
        self.evals = 0
        evaluate = self.llm.eval

        def counted(tokens):
            self.evals += 1
            return evaluate(tokens)

        self.llm.eval = counted

    def run(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int, seed: int) -> MethodRun:
        self.llm.set_seed(seed)
        self.evals = 0
        room = self.context - len(prompt_ids)
        token_ids: list[int] = []
        started = time.perf_counter()
        steps = self.llm.generate(
            prompt_ids, temp=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            min_p=0.0, repeat_penalty=1.0, reset=True,
        )
        for token in steps:
            token_ids.append(int(token))
            if token in self.stop_ids or len(token_ids) >= min(max_new_tokens, room):
                break
        wall = time.perf_counter() - started
        count = len(token_ids)
        stats = SpecStats(new_tokens=count, target_forwards=self.evals, forward_tokens=count, wall_s=wall)
        return MethodRun(token_ids, wall, stats, has_time_split=False)
