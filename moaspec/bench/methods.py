"""The methods a benchmark compares, behind one call: `run(prompt_ids, ...) -> MethodRun`.

`--methods` values:
- `none`, `ngram`, `eagle`, `moa`, `moa-tli1`, or a drafter checkpoint directory, each model
  drafter optionally with `+ngram` (prompt lookup first): our engine with that drafter
  (`none` = plain decoding, the speed baseline); `LABEL=DIR` names a checkpoint directory in the
  tables (default label: the value as given);
- `X@ref` for a model drafter X: the same checkpoint with the fixed reference tree
  (REFERENCE_TREE: depth 6, top-k 4, 16 drafted nodes) whatever its tuned or --tree-* tree, so a
  run can show `moa` and `moa@ref` side by side (acceptance per depth needs a deep tree); with
  `+ngram`, the prompt lookup is fixed too (REFERENCE_LOOKUP, the lookup's defaults), not the
  machine calibration's, so `X+ngram@ref`'s τ does not depend on the CPU it ran on;
- `default`: what `moaspec generate` uses when no drafter is named: the machine calibration's
  choice (moaspec/calibration/plan.py), recorded in results.json's `config.calibration`;
- `hf`: transformers `generate()` on the same loaded model (same weights and weight layout, so the
  comparison isolates the decode loop); `hf-pld`: the same with prompt-lookup decoding
  (`prompt_lookup_num_tokens=HF_PLD_TOKENS`). transformers runtime only;
- `llama.cpp`, `llama.cpp-pld`: llama-cpp-python's own generation (and its prompt-lookup
  decoding) on the target's GGUF with the same threads (bench/llamacpp_methods.py); GGUF targets.

A shipped drafter name whose checkpoint is missing for the target is an error up front (a
benchmark that silently drops a method is easy to misread).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moaspec.bench.method_run import Method, MethodRun
from moaspec.cli_support import comma_items
from moaspec.config import NgramConfig
from moaspec.drafters import (
    MODEL_FREE,
    SHIPPED,
    SHIPPED_DIR,
    check_drafter_spec,
    checkpoint_directory,
    default_drafter,
    tree_settings_given,
)
from moaspec.errors import MoaspecError
from moaspec.metrics import SpecStats

if TYPE_CHECKING:
    from moaspec.config import SamplingConfig
    from moaspec.drafters.base import Drafter
    from moaspec.targets.base import Target
    from moaspec.targets.hf import HFTarget

HF_METHODS = ("hf", "hf-pld")
LLAMA_CPP_METHODS = ("llama.cpp", "llama.cpp-pld")
EXTERNAL_METHODS = (*HF_METHODS, *LLAMA_CPP_METHODS)  # generation by another library, not our engine
OWN_GENERATION_METHODS = (HF_METHODS[0], LLAMA_CPP_METHODS[0])  # each runtime's own plain generation
DEFAULT_METHOD = "default"
HF_PLD_TOKENS = 10  # transformers' documented default for prompt_lookup_num_tokens
REFERENCE_SUFFIX = "@ref"
REFERENCE_TREE = {"depth": 6, "top_k": 4, "budget": 16}  # issue 20's fixed tree for comparing drafters
REFERENCE_LOOKUP = NgramConfig()  # X+ngram@ref's lookup: 2- to 4-grams, 8 deep x 3 branches, 16 nodes


@dataclass(frozen=True)
class MethodSpec:
    """label: the name in the tables. source: an EXTERNAL_METHODS name or a drafter spec for our engine.
    reference_tree: draft with REFERENCE_TREE instead of the drafter's own tree."""

    label: str
    source: str
    reference_tree: bool = False

    @property
    def described(self) -> str:
        """The source as given in --methods (with @ref when the reference tree is used)."""
        return self.source + (REFERENCE_SUFFIX if self.reference_tree else "")

    @property
    def drafter(self) -> str | None:
        """The drafter spec of an engine method, None for another library's generation."""
        return None if self.source in EXTERNAL_METHODS else self.source

    @property
    def takes_tree_flags(self) -> bool:
        """Whether --tree-* fix this method's tree: a model drafter's, unless @ref fixes it."""
        return self.drafter not in (None, DEFAULT_METHOD, *MODEL_FREE) and not self.reference_tree


def parse_methods(value: str) -> tuple[MethodSpec, ...]:
    """`--methods a,b,...` -> specs (checked cheaply; `none` is put first when missing)."""
    specs: list[MethodSpec] = []
    for item in comma_items(value, "--methods"):
        label, _, path = item.partition("=") if "=" in item else (item, "", item)
        reference = path.endswith(REFERENCE_SUFFIX)
        path = path.removesuffix(REFERENCE_SUFFIX)
        if not label or not path:
            raise MoaspecError(f"bad method '{item}' (expected NAME, DIR or LABEL=DIR, optionally ending in @ref)")
        if reference and path in (*EXTERNAL_METHODS, DEFAULT_METHOD, *MODEL_FREE):
            raise MoaspecError(f"method '{item}': {REFERENCE_SUFFIX} applies to model drafters only")
        if path not in (*EXTERNAL_METHODS, DEFAULT_METHOD):
            check_drafter_spec(path)
        specs.append(MethodSpec(label, path, reference))
    if any(spec.label == "none" and spec.source != "none" for spec in specs):
        raise MoaspecError("the label 'none' is reserved for plain decoding")
    labels = [spec.label for spec in specs]
    if len(set(labels)) != len(labels):
        raise MoaspecError(f"--methods names a method twice: {', '.join(labels)}")
    if any(spec.source == "none" and spec.label != "none" for spec in specs):
        raise MoaspecError("the plain-decoding baseline must be called 'none'")
    if "none" not in labels:
        specs.insert(0, MethodSpec("none", "none"))  # the baseline every speedup is measured against
    return tuple(specs)


def default_methods(target_name: str, runtime: str = "transformers") -> str:
    """`none`, the other library's generation on the runtime (`hf,hf-pld` / `llama.cpp,llama.cpp-pld`),
    `ngram`, every shipped drafter that exists for the target, the
    default drafter form (`moa+ngram`) and `default` (the calibrated choice), on any device."""
    shipped = [name for name in SHIPPED if (SHIPPED_DIR / target_name / name / "config.json").is_file()]
    external = HF_METHODS if runtime == "transformers" else LLAMA_CPP_METHODS
    methods = ["none", *external, "ngram", *shipped]
    return ",".join(dict.fromkeys([*methods, default_drafter(target_name), DEFAULT_METHOD]))


def check_tree_flags(specs: tuple[MethodSpec, ...], tree_overrides: dict | None) -> None:
    """Refuse --tree-* when no method of the run has a tree they fix (as `generate` refuses them
    with a model-free drafter), instead of ignoring them."""
    given = tree_settings_given(tree_overrides)
    if given and not any(spec.takes_tree_flags for spec in specs):
        named = ", ".join(spec.described for spec in specs)
        raise MoaspecError(
            f"--tree-* settings set the tree of model-drafter methods without @ref; --methods has none of them ({named})"
        )


def check_available(specs: tuple[MethodSpec, ...], target_name: str) -> None:
    """Refuse, before any model loads, drafter methods without a checkpoint for the target."""
    for spec in specs:
        if spec.drafter is None or spec.drafter in (*MODEL_FREE, DEFAULT_METHOD):
            continue
        try:
            directory = checkpoint_directory(spec.drafter, target_name)
        except MoaspecError as exc:
            raise MoaspecError(
                f"method '{spec.label}': {exc} (e.g. {spec.label}=runs/{spec.drafter}/checkpoint)"
            ) from exc
        if not (directory / "config.json").is_file():
            raise MoaspecError(
                f"method '{spec.label}': {directory} has no config.json (not a drafter checkpoint)"
            )


def build_method(
    spec: MethodSpec,
    target: Target,
    calibrated: Drafter | None = None,
    tree_overrides: dict | None = None,
    ignore_eos: bool = False,
    hf_target: HFTarget | None = None,
) -> Method:
    """calibrated: the drafter of the `default` method (the calibrated choice); tree_overrides:
    --tree-* values for the model-drafter methods (the model-free ones have no tree); ignore_eos:
    stop tokens do not end a generation (every method writes max_new_tokens); hf_target: where
    `hf` / `hf-pld` run when `target` is not on the transformers runtime (a transformers copy of
    the same target, needs_hf_copy)."""
    stop_ids = frozenset() if ignore_eos else target.stop_ids
    if spec.source in LLAMA_CPP_METHODS:
        return _llama_cpp_method(spec, target, stop_ids)
    if spec.drafter is None:
        runs_on = target if target.runtime == "transformers" else hf_target
        if runs_on is None:
            raise MoaspecError(f"method '{spec.label}' needs a transformers copy of the target (needs_hf_copy)")
        lookup = HF_PLD_TOKENS if spec.source == "hf-pld" else None
        return HFGenerateMethod(spec.label, runs_on, lookup, stop_ids, lossless=runs_on is target)
    if spec.drafter == DEFAULT_METHOD:
        return EngineMethod(spec.label, target, calibrated, stop_ids)
    from moaspec.calibration.plan import drafter_for

    # a session of its own: what one drafter asks of the target (llama.cpp: the keys/values MoA
    # reads, captured at a cost on every decode) must not slow the other methods down. The drafter
    # as `generate --drafter NAME` makes it: the machine calibration's tree and lookup for that
    # form, unless --tree-* (or @ref) fix the tree; every method on the target's one weight layout.
    session = target.new_session()
    drafter, _ = drafter_for(session, spec.drafter, drafter_tree(spec, tree_overrides), layout=target.weight_layout)
    if spec.reference_tree and getattr(drafter, "lookup", None) is not None:
        drafter.enable_lookup(REFERENCE_LOOKUP)
    return EngineMethod(spec.label, session, drafter, stop_ids)


def needs_hf_copy(specs: tuple[MethodSpec, ...], runtime: str) -> bool:
    """Whether `hf` / `hf-pld` are asked for on a run whose target is not on transformers: they
    then need the same target loaded on the transformers runtime beside it."""
    return runtime != "transformers" and any(spec.source in HF_METHODS for spec in specs)


def _llama_cpp_method(spec: MethodSpec, target: Target, stop_ids: frozenset[int]) -> Method:
    from moaspec.bench.llamacpp_methods import LLAMA_CPP_PLD_TOKENS, LlamaCppGenerateMethod
    from moaspec.targets.load import gguf_file
    from moaspec.targets.options import llama_cpp_available

    weights = getattr(target, "weights", None)  # the llama.cpp runtime's loaded GGUF
    gguf = weights.path if weights is not None else gguf_file(target.name)
    if gguf is None:
        raise MoaspecError(f"method '{spec.label}' needs a GGUF target; '{target.name}' is not one")
    if not llama_cpp_available():
        raise MoaspecError(f"method '{spec.label}' needs llama-cpp-python: pip install llama-cpp-python==0.3.36")
    threads = llama_cpp_threads(target)
    lookup = LLAMA_CPP_PLD_TOKENS if spec.source == "llama.cpp-pld" else None
    return LlamaCppGenerateMethod(spec.label, gguf, threads, target.max_positions, stop_ids, lookup)


def llama_cpp_threads(target: Target) -> int:
    """The threads llama.cpp decodes with for `target`: its own setting, else the cores torch uses
    (the llama.cpp runtime's default)."""
    import torch

    return getattr(target, "threads", None) or torch.get_num_threads()


def drafter_tree(spec: MethodSpec, tree_overrides: dict | None) -> dict | None:
    """The tree overrides `make_drafter` gets for an engine method: REFERENCE_TREE for `X@ref`,
    the --tree-* values for the other model drafters, none for the model-free ones."""
    if spec.reference_tree:
        return REFERENCE_TREE
    return tree_overrides if spec.takes_tree_flags else None


class EngineMethod:
    """Our engine with one drafter."""

    lossless = True  # greedy output must equal plain decoding's (the benchmark checks)

    def __init__(self, label: str, target: Target, drafter: Drafter, stop_ids: frozenset[int]) -> None:
        from moaspec.engine import Engine

        self.label = label
        self.engine = Engine(target, drafter)
        self.stop_ids = stop_ids

    def run(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int, seed: int) -> MethodRun:
        from moaspec.config import GenerationConfig

        started = time.perf_counter()
        generation = GenerationConfig(max_new_tokens=max_new_tokens, seed=seed)
        result = self.engine.generate(prompt_ids, sampling, generation, stop_ids=self.stop_ids)
        wall = time.perf_counter() - started
        return MethodRun(result.token_ids, wall, result.stats, has_time_split=True)


class HFGenerateMethod:
    """transformers `generate()` on the target's model, optionally with prompt-lookup decoding.

    lossless: it runs on the bench's own target (the same float32 model as our `none`, whose
    greedy output it must then equal); on a transformers copy of a llama.cpp target it is another
    runtime's generation, compared for agreement only (as `llama.cpp` on a transformers run)."""

    def __init__(
        self, label: str, target: HFTarget, prompt_lookup_tokens: int | None, stop_ids: frozenset[int],
        lossless: bool = True,
    ) -> None:
        self.label = label
        self.target = target
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.stop_ids = stop_ids
        self.lossless = lossless

    def run(self, prompt_ids: list[int], sampling: SamplingConfig, max_new_tokens: int, seed: int) -> MethodRun:
        import torch
        from transformers import GenerationConfig as HFGenerationConfig

        model = self.target.model
        room = self.target.max_positions - len(prompt_ids)
        stop_ids = sorted(self.stop_ids)
        config = HFGenerationConfig(
            max_new_tokens=min(max_new_tokens, room),
            do_sample=not sampling.greedy,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_k=sampling.top_k if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            eos_token_id=stop_ids or None,
            pad_token_id=stop_ids[0] if stop_ids else min(self.target.stop_ids, default=0),
            prompt_lookup_num_tokens=self.prompt_lookup_tokens,
        )
        forwards = [0]
        hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        input_ids = torch.tensor([prompt_ids], device=self.target.device)  # [1, T] where the target's weights are
        try:
            torch.manual_seed(seed)  # generate() samples from the global generator
            started = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
            wall = time.perf_counter() - started
        finally:
            hook.remove()
        token_ids = out[0, len(prompt_ids) :].tolist()
        stats = SpecStats(
            new_tokens=len(token_ids), target_forwards=forwards[0], forward_tokens=len(token_ids), wall_s=wall
        )
        return MethodRun(token_ids, wall, stats, has_time_split=False)
