"""Library entry points: `load()` a target with a drafter, then `generate()` text.

    from moaspec import load
    from transformers import TextStreamer
    lm = load()                                   # smollm2-135m + the default drafter
    out = lm.generate("Name three colours.", streamer=TextStreamer(lm.tokenizer, skip_prompt=True))
    print(out.stats.tau, out.stats.tokens_per_s)
"""

from __future__ import annotations

import numbers
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from inspect import signature
from typing import TYPE_CHECKING, Any

from moaspec.chat import check_prompt_text, encode_chat_prompt
from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.drafters import (
    MODEL_FREE,
    check_drafter_spec,
    default_drafter,
    default_for_tree_settings,
    tree_settings_given,
)
from moaspec.drafters.base import Drafter
from moaspec.drafters.none import NoDrafter
from moaspec.engine import Engine, GenerationResult, check_prompt_length
from moaspec.errors import MoaspecError
from moaspec.metrics import SpecStats
from moaspec.model_store import DEFAULT_TARGET
from moaspec.targets import load as targets_load
from moaspec.targets.base import Target
from moaspec.targets.load import DEFAULT_ATTN_IMPLEMENTATION, load_tokenizer  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    import torch

    from moaspec.calibration.plan import Calibration

@dataclass(frozen=True)
class GenerationOutput:
    """text: decoded new tokens (special tokens skipped); token_ids: new tokens only."""

    text: str
    token_ids: list[int]
    stats: SpecStats
    stop_reason: str
    calibration: dict | None = None  # Calibration.to_dict() of the loaded model, None when off

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "stop_reason": self.stop_reason,
            **self.stats.to_dict(),
            "calibration": self.calibration,
        }


class SpeculativeLM:
    """A target, its tokenizer and a drafter, ready to generate.

    drafter_name: the drafter form in use (`none`, `ngram`, `moa+ngram`, a directory...);
    calibration: what the machine calibration chose (moaspec/calibration), or None when it was off.
    """

    def __init__(
        self, target: Target, drafter: Drafter, drafter_name: str = "", calibration: Calibration | None = None
    ) -> None:
        if target.tokenizer is None:
            raise MoaspecError("the target has no tokenizer")
        self.target = target
        self.tokenizer = target.tokenizer
        self.drafter = drafter
        self.drafter_name = drafter_name
        self.calibration = calibration
        self.engine = Engine(target, drafter)
        self._generating = threading.RLock()  # generate() calls from several threads run one after another

    def encode_prompt(self, prompt: str, raw: bool = False) -> list[int]:
        """Token ids of `prompt`, through the chat template unless `raw`."""
        return prompt_token_ids(self.target, prompt, raw)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        raw: bool = False,
        streamer: Any = None,
    ) -> GenerationOutput:
        """Generate from a text prompt (chat template applied unless `raw`) or from token ids (a
        list or tuple, or a numpy array or torch tensor, [T] or a tokenizer's [1, T]).

        streamer: any transformers streamer (`TextStreamer`, `TextIteratorStreamer`): it gets
        `put(prompt_ids)` first ([1, T]), then the new tokens as they are verified ([n]), then
        `end()`; as torch tensors, as transformers' generate() gives them, or as lists for a
        streamer that says it `takes_token_lists` (text_stream.py's: the CLI runs without torch).
        Calls from several threads run one after another (one target context, one drafter state).
        """
        result = GenerationResult()
        with self._generating:
            # stream() checks the prompt before returning, so a refused request never reaches a
            # printing streamer (whose end() would print an empty line); an iterator streamer's
            # consumer, waiting on its queue in another thread, is told that the stream ended
            try:
                sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
                generation = GenerationConfig(max_new_tokens=max_new_tokens, seed=seed)
                prompt_ids = prompt_token_ids(self.target, prompt, raw)
                steps = self.engine.stream(prompt_ids, sampling, generation, result=result)
            except BaseException:
                if hasattr(streamer, "text_queue"):  # TextIteratorStreamer, AsyncTextIteratorStreamer
                    streamer.end()
                raise
            if streamer is not None:
                streamer.put(_streamed([prompt_ids], streamer))
            try:
                for new_ids in steps:
                    if streamer is not None and new_ids:
                        streamer.put(_streamed(new_ids, streamer))
            finally:
                if streamer is not None:
                    streamer.end()
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        calibration = self.calibration.to_dict() if self.calibration is not None else None
        return GenerationOutput(text, result.token_ids, result.stats, result.stop_reason, calibration)


def _streamed(ids: list, streamer: Any) -> Any:
    """Token ids as a streamer takes them: a list where it `takes_token_lists`, else a torch tensor."""
    if getattr(streamer, "takes_token_lists", False):
        return ids
    from moaspec.signals import load_library_held

    load_library_held()  # transformers' streamers read tensors: torch's first import, whole or not at all
    import torch

    return torch.tensor(ids)


def load_target(
    target: str = DEFAULT_TARGET,
    dtype: torch.dtype | str = "float32",
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION,
    runtime: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    gpu_layers: int = 0,
    light_tokenizer: bool = False,
) -> Target:
    """Load a target by built-in name, HF directory or .gguf path (offline only) on `runtime`
    ("llama.cpp" or "transformers"; None: llama.cpp for GGUF targets, see targets/load.py).
    dtype: the transformers runtime's precision, a torch dtype or its name (float32, the lossless
    default; bfloat16 / float16 are faster where the hardware has them, but outputs may then differ
    from plain decoding: targets/load.py).
    light_tokenizer: on llama.cpp, the tokenizer that needs no transformers (targets/tokenizer.py;
    the CLI's choice) instead of transformers' own."""
    return targets_load.load_target(
        target, runtime, dtype=dtype, attn_implementation=attn_implementation, device=device,
        threads=threads, gpu_layers=gpu_layers, light_tokenizer=light_tokenizer,
    )


def load(
    target: str = DEFAULT_TARGET,
    drafter: str | None = None,
    dtype: torch.dtype | str = "float32",
    attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION,
    tree_overrides: dict | None = None,
    calibrate: bool = True,
    runtime: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    gpu_layers: int = 0,
    light_tokenizer: bool = False,
    *,
    n_gpu_layers: int | None = None,
) -> SpeculativeLM:
    """Load a target and a drafter for it.

    drafter None (the default): the machine calibration (moaspec/calibration/plan.py) chooses
    among `none`, `ngram` and the target's default model drafter with prompt lookup (`moa+ngram`
    where a shipped MoA drafter exists), with the weight layout, tree and lookup trie, by
    predicted tokens/s on this machine (measured once, ~20 s, cached). A named drafter keeps its
    form; the calibration still picks its layout, tree and lookup. `calibrate=False` or
    MOASPEC_NO_CALIBRATION=1: the named drafter, else `moa+ngram` / `ngram`, as configured.

    tree_overrides: e.g. {"depth": 5, "top_k": 2, "budget": 12} for a model drafter; fields left
    out come from `moaspec tune`'s saved choice, else the calibration, else the checkpoint
    (precedence: moaspec/tuned.py).

    runtime: "llama.cpp" or "transformers" (None: llama.cpp for GGUF targets, targets/load.py);
    dtype and device (transformers: "float32", "bfloat16", ...; "cpu", "cuda", ...; see
    load_target), threads, gpu_layers and light_tokenizer (llama.cpp);
    n_gpu_layers: llama.cpp's name for gpu_layers (the CLI's --n-gpu-layers), either may be given.
    """
    gpu_layers = _gpu_layers(gpu_layers, n_gpu_layers)
    _check_drafter_request(drafter, tree_overrides)
    loaded = load_target(target, dtype, attn_implementation, runtime, device, threads, gpu_layers, light_tokenizer)
    return speculative_lm(loaded, drafter, tree_overrides, calibrate)


def speculative_lm(
    loaded: Target,
    drafter: str | None = None,
    tree_overrides: dict | None = None,
    calibrate: bool = True,
    background_drafter: bool = False,
) -> SpeculativeLM:
    """load()'s second half: the drafter for a loaded target (drafter, tree_overrides, calibrate:
    as load() takes them). Callers with a prompt in hand check it between the two halves, before
    a first calibration's ~20 s. background_drafter: a model drafter that qualifies is built in a
    background thread while the first tokens decode plainly (drafters/background.py)."""
    from moaspec.calibration.plan import configured_drafter, drafter_for

    _check_drafter_request(drafter, tree_overrides)
    tree_given = tree_settings_given(tree_overrides)
    default = default_for_tree_settings(loaded.name) if drafter is None and tree_given else default_drafter(loaded.name)
    if not calibrate:
        name = drafter or default
        return SpeculativeLM(loaded, configured_drafter(loaded, name, tree_overrides, background_drafter), name)
    chosen, calibration = drafter_for(loaded, drafter, tree_overrides, background=background_drafter)
    name = calibration.chosen.drafter if calibration is not None else drafter or default
    if isinstance(chosen, NoDrafter):  # also where trees would not be exact (calibration/plan.py)
        name = "none"
    return SpeculativeLM(loaded, chosen, name, calibration)


def generate(
    prompt: str | Sequence[int],
    *,
    target: str = DEFAULT_TARGET,
    drafter: str | None = None,
    runtime: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype | str = "float32",
    threads: int | None = None,
    n_gpu_layers: int | None = None,
    gpu_layers: int = 0,
    tree_overrides: dict | None = None,
    calibrate: bool = True,
    **kwargs: Any,
) -> GenerationOutput:
    """One-shot convenience: `load(target, drafter, ...)` with the keywords that say where and how
    the target and drafter run, then `.generate(prompt, **kwargs)` (max_new_tokens, temperature,
    top_p, top_k, seed, raw, streamer). Loads every call: keep the `SpeculativeLM` from `load()`
    to generate repeatedly. The keywords and settings are checked before anything loads, the
    prompt before the drafter's calibration."""
    generate_signature = signature(SpeculativeLM.generate)
    generate_signature.bind(None, prompt, **kwargs)  # TypeError for an unknown keyword
    settings = {**{name: p.default for name, p in generate_signature.parameters.items()}, **kwargs}
    SamplingConfig(temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"])
    GenerationConfig(max_new_tokens=settings["max_new_tokens"], seed=settings["seed"])
    lm, prompt_ids = load_for_prompt(
        prompt, settings["raw"], target, drafter, tree_overrides, calibrate, dtype, runtime, device, threads,
        _gpu_layers(gpu_layers, n_gpu_layers),
    )
    return lm.generate(prompt_ids, **kwargs)


def load_for_prompt(
    prompt: str | Sequence[int],
    raw: bool = False,
    target: str = DEFAULT_TARGET,
    drafter: str | None = None,
    tree_overrides: dict | None = None,
    calibrate: bool = True,
    dtype: torch.dtype | str = "float32",
    runtime: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    gpu_layers: int = 0,
    light_tokenizer: bool = False,
    background_drafter: bool = False,
) -> tuple[SpeculativeLM, list[int]]:
    """load() for one prompt (the CLI's and the one-shot generate()'s): the target loads, the
    prompt is encoded and checked against its context, and only then is the drafter chosen, so a
    refused prompt costs no calibration (~20 s the first time) -> (the model, the prompt's ids).
    background_drafter: as `speculative_lm` (the CLI's `generate`)."""
    _check_drafter_request(drafter, tree_overrides)
    loaded = load_target(target, dtype, DEFAULT_ATTN_IMPLEMENTATION, runtime, device, threads, gpu_layers, light_tokenizer)
    loaded.serve_one_prompt()
    prompt_ids = prompt_token_ids(loaded, prompt, raw)
    check_prompt_length(len(prompt_ids), loaded)
    return speculative_lm(loaded, drafter, tree_overrides, calibrate, background_drafter), prompt_ids


def prompt_token_ids(target: Target, prompt: str | Sequence[int], raw: bool = False) -> list[int]:
    """A prompt's token ids: text through the target's chat template unless `raw`; token ids
    (`_token_ids`) checked to be integers in [0, vocab_size)."""
    if isinstance(prompt, (list, tuple)) or _is_array(prompt):
        return _token_ids(prompt, target.vocab_size)
    check_prompt_text(prompt)
    if target.tokenizer is None:
        raise MoaspecError("the target has no tokenizer: give the prompt as token ids")
    if raw:
        return list(target.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    return encode_chat_prompt(target.tokenizer, prompt)


def _check_drafter_request(drafter: str | None, tree_overrides: dict | None) -> None:
    """A drafter name or path and tree overrides that can go together (nothing loaded)."""
    if drafter is not None:
        check_drafter_spec(drafter)
        if drafter in MODEL_FREE and tree_settings_given(tree_overrides):
            raise MoaspecError(f"tree_overrides apply to model drafters only, not to '{drafter}'")


def _is_array(value: object) -> bool:
    """Whether `value` is a numpy array or a torch tensor (told without importing torch)."""
    return hasattr(value, "shape") and hasattr(value, "tolist") and not isinstance(value, (str, bytes))


def _token_ids(prompt, vocab_size: int) -> list[int]:
    """A prompt given as token ids: a list or tuple of integers (Python's or numpy's), or a numpy
    array or torch tensor [T], or [1, T] as a tokenizer's `return_tensors` gives -> list[int],
    checked: integers in [0, vocab_size)."""
    if _is_array(prompt):
        shape = tuple(prompt.shape)
        if len(shape) == 2 and shape[0] == 1:
            prompt = prompt[0]
        elif len(shape) != 1:
            raise MoaspecError(f"prompt token ids must be one sequence, [T] or [1, T], got shape {list(shape)}")
        prompt = prompt.tolist()  # integer dtypes give ints; others are refused below
    ids = list(prompt)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise MoaspecError(f"prompt token ids must be integers in [0, {vocab_size})")
    return [int(t) for t in ids]


def _gpu_layers(gpu_layers: int, n_gpu_layers: int | None) -> int:
    """The one value of load()'s two spellings (MoaspecError when they disagree)."""
    if n_gpu_layers is None or n_gpu_layers == gpu_layers:
        return gpu_layers
    if gpu_layers:
        raise MoaspecError(f"gpu_layers={gpu_layers} and n_gpu_layers={n_gpu_layers} disagree: give one")
    return n_gpu_layers
