"""A model drafter built in a background thread while the target decodes plainly.

On llama.cpp greedy decoding runs without torch (README, *Start-up*), but a model drafter is
torch's: `generate --drafter moa` imported it (1-3 s on a 2-core machine) and built the drafter
before the first token. A `BackgroundDrafter` starts that work in a thread once the first
tokens are out (PLAIN_STEPS_FIRST). Until the drafter is built, every proposal is the root alone (plain
decoding) while the target keeps, from the prompt on, what the drafter reads (`DrafterReads`: the
keys/values of some layers, `keep_layer_kv`; the final hidden states, `keep_final_hidden`; both
in numpy: llamacpp_features.py); the drafter then joins in one `accept` of the whole verified
context and drafts from that step on. The final hidden states it reads are the target's kept
rows, at the join and after (the generation's session, made before the drafter was, asks for none).

Lossless: greedy output is the same tokens whenever the drafter joins (a root alone and a verified
tree both emit the target's argmax, verify.py). A sampled step waits for the drafter first, so a
seed gives the same text every run. What the build raised is raised at the proposal that finds it.

Qualify: MoA and EAGLE-2 checkpoints, shipped or a directory (`can_build_in_background`), whose
check against the target (nn/fingerprint.check_made_for, without torch on llama.cpp) the caller
runs before the first token. Meanwhile the import holds the interpreter's lock for long
stretches: plain steps take 2-3x their time and the first ~0.3 s stalls once (measured on a
2-core AVX2 EPYC; README, *Start-up*). A weights file whose header would not load is built first
(it says so before the first token); what the build finds wrong beyond that is raised
mid-answer, at the step that finds it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from moaspec.config import SamplingConfig, TreeConfig
from moaspec.drafters.base import Drafter, VerifiedUpdate
from moaspec.errors import MoaspecError
from moaspec.tree import DraftTree

if TYPE_CHECKING:
    import torch

    from moaspec.targets.llamacpp import LlamaCppTarget

# Plain steps before the build starts: its first ~0.3 s holds the interpreter's lock, and a printer
# shows whole words, so started at once it delayed the first text by ~0.5 s; after two steps the
# first text came as soon as `none`'s (README, *Start-up*).
PLAIN_STEPS_FIRST = 2


class DrafterReads(NamedTuple):
    """What a model drafter reads of the target: the keys/values of `layers`, and the final
    hidden state (after the last layer's norm) where `final_hidden`."""

    layers: tuple[int, ...]
    final_hidden: bool


def can_build_in_background(spec: str, target_name: str, runtime: str) -> bool:
    """Whether drafter `spec` may be built in the background for a target by name on `runtime`
    (module docstring): on llama.cpp, a MoA or EAGLE-2 checkpoint (shipped or a directory with its
    weights), unless MOASPEC_NO_BACKGROUND_DRAFTER=1 asks for it built before the first step."""
    from moaspec.env_flags import NO_BACKGROUND_DRAFTER_ENV, env_flag

    if runtime != "llama.cpp" or env_flag(NO_BACKGROUND_DRAFTER_ENV):
        return False
    record = drafter_record(spec, target_name)
    config = None if record is None else record.get("config")
    if not isinstance(config, dict) or record.get("method") not in ("moa", "eagle"):
        return False
    try:
        reads_of(record)
    except (KeyError, TypeError, ValueError, MoaspecError):  # a damaged config: built first, it says why
        return False
    return True


def drafter_record(spec: str, target_name: str) -> dict | None:
    """The config.json of model drafter `spec` (`moa`, `moa+ngram`, a checkpoint or training run
    directory, ...) for a target by name, or None for a model-free drafter, a shipped name the
    target lacks, or a checkpoint whose record cannot be read or whose weights file is missing or
    would not load (its header: safetensors_rows.layout_problem; built first, it says why before
    the first token, not mid-answer)."""
    from moaspec.drafters import MODEL_FREE, checkpoint_directory, split_lookup
    from moaspec.safetensors_rows import layout_problem

    if split_lookup(spec)[0] in MODEL_FREE:
        return None
    try:
        directory = checkpoint_directory(spec, target_name)
        record = json.loads((directory / "config.json").read_text())
    except (MoaspecError, OSError, ValueError):
        return None
    weights = directory / "model.safetensors"
    return record if isinstance(record, dict) and weights.is_file() and layout_problem(weights) is None else None


def reads_of(record: dict) -> DrafterReads:
    """What a checkpoint's drafter reads (`record`: its config.json): MoA, the layers its
    context encoder reads (`MoAContextEncoder.layers`) and, with `memory_hidden`, the final hidden
    state; EAGLE-2, the final hidden state only."""
    from moaspec.nn.moa_layers import context_layers

    config = record["config"]
    if record["method"] == "eagle":
        return DrafterReads((), True)
    layers = context_layers(config["num_target_layers"], config.get("memory_layers", 0), config.get("tli_layers", 0))
    return DrafterReads(tuple(layers), bool(config.get("memory_hidden", False)))


class BackgroundDrafter:
    """A drafter of the module docstring's kind: `build()` returns the finished drafter (layout,
    tree and lookup set), run in a thread after PLAIN_STEPS_FIRST plain proposals (at once for a
    sampled one); `reads` is what it reads of the target (kept from now on); tree_config /
    tree_source are the ones it will have."""

    hidden_layers: tuple[int, ...] = ()  # the session asks for none: kept rows are read (module docstring)

    def __init__(
        self,
        build: Callable[[], Drafter],
        target: LlamaCppTarget,
        reads: DrafterReads,
        tree_config: TreeConfig,
        tree_source: str,
    ) -> None:
        # before the prompt: the drafter reads every verified token's
        if reads.layers:
            target.keep_layer_kv(reads.layers)
        if reads.final_hidden:
            target.keep_final_hidden()
        self.target, self.reads = target, reads
        self.tree_config, self.tree_source = tree_config, tree_source
        self._build = build
        self._thread: threading.Thread | None = None
        self._finished = threading.Event()
        self._built: Drafter | None = None
        self._failure: BaseException | None = None
        self.joined: Drafter | None = None  # the built drafter, once it drafts
        self.joined_at: int | None = None  # verified tokens (the prompt's included) when it joined
        self._history: list[int] = []  # the verified tokens of this generation, until it joins
        self._proposals = 0

    @property
    def building(self) -> bool:
        """Whether the build has started and not finished."""
        return self._thread is not None and not self._finished.is_set()

    def reset(self) -> None:
        self._history = []
        if self.joined is not None:
            self.joined.reset()

    def accept(self, update: VerifiedUpdate) -> None:
        if self.joined is not None:
            self.joined.accept(self._with_hidden(update.token_ids, update.start_pos))
            return
        if update.start_pos != len(self._history):
            raise ValueError(f"verified tokens start at {update.start_pos}, expected {len(self._history)}")
        self._history.extend(update.token_ids.tolist())

    def propose(self, root_id: int, sampling: SamplingConfig, generator: torch.Generator | None) -> DraftTree:
        if self.joined is None:
            self._proposals += 1
            if self._proposals > PLAIN_STEPS_FIRST or not sampling.greedy:
                self._start()
            if sampling.greedy and not self._finished.is_set():
                return DraftTree.root_only(root_id)
            self._join()
        return self.joined.propose(root_id, sampling, generator)

    def _start(self) -> None:
        if self._thread is None:
            # daemon: a command that ends mid-build (an error, Ctrl-C) exits without waiting for it
            self._thread = threading.Thread(target=self._run, name="moaspec-drafter-build", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._built = self._build()
        except BaseException as exc:  # noqa: BLE001  raised on the main thread by _join
            self._failure = exc
        finally:
            self._finished.set()

    def _join(self) -> None:
        """Wait for the build; the drafter catches up on the verified context in one accept."""
        self._finished.wait()
        if self._failure is not None:
            raise self._failure
        drafter = self._built
        drafter.reset()
        drafter.accept(self._with_hidden(np.asarray(self._history, dtype=np.int64), 0))
        self.joined, self.joined_at, self._history = drafter, len(self._history), []

    def _with_hidden(self, token_ids: np.ndarray, start: int) -> VerifiedUpdate:
        """Verified tokens [n] at start.. for the built drafter, with their final hidden states
        [n, 1, D] where it reads them (the target's kept rows)."""
        end = start + len(token_ids)
        hidden = self.target.verified_hidden(start, end) if self.reads.final_hidden else None
        return VerifiedUpdate(token_ids, start, hidden, self.target)
