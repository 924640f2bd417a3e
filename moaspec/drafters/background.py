"""A model drafter built in a background thread while the target decodes plainly.

On llama.cpp greedy decoding runs without torch (README, *Start-up*), but a model drafter is
torch's: `generate --drafter moa` imported it (1-3 s on a 2-core machine) and built the drafter
before the first token. A `BackgroundDrafter` starts that work in a thread once the first
tokens are out (PLAIN_STEPS_FIRST). Until the drafter is built, every proposal is the root alone (plain
decoding) while the target captures, from the prompt on, the keys/values the drafter reads
(`keep_layer_kv`, in numpy: llamacpp_features.py); the drafter then joins in one `accept` of the
whole verified context and drafts from that step on.

Lossless: greedy output is the same tokens whenever the drafter joins (a root alone and a verified
tree both emit the target's argmax, verify.py). A sampled step waits for the drafter first, so a
seed gives the same text every run. What the build raised is raised at the proposal that finds it.

Only a drafter that reads no hidden states qualifies (those are torch tensors, made at each step;
MoA's shipped form reads keys/values only), and only one whose target is known by name: a
shipped checkpoint (`can_build_in_background`), since its check against the target
(nn/checkpoint.check_made_for) needs torch and so runs in the thread too. Meanwhile the import
holds the interpreter's lock for long stretches: plain steps take 2-3x their time and the first
~0.3 s stalls once (measured on a 2-core AVX2 EPYC; README, *Start-up*).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from moaspec.config import SamplingConfig, TreeConfig
from moaspec.drafters.base import Drafter, VerifiedUpdate
from moaspec.tree import DraftTree

if TYPE_CHECKING:
    import torch

    from moaspec.targets.base import Target

# Plain steps before the build starts: its first ~0.3 s holds the interpreter's lock, and a printer
# shows whole words, so started at once it delayed the first text by ~0.5 s; after two steps the
# first text came as soon as `none`'s (README, *Start-up*).
PLAIN_STEPS_FIRST = 2


def can_build_in_background(spec: str, target_name: str, runtime: str) -> bool:
    """Whether drafter `spec` may be built in the background for a target by name on `runtime`
    (module docstring): on llama.cpp, a shipped MoA checkpoint that reads no hidden state, unless
    MOASPEC_NO_BACKGROUND_DRAFTER=1 asks for it built before the first step."""
    from moaspec.env_flags import NO_BACKGROUND_DRAFTER_ENV, env_flag

    if runtime != "llama.cpp" or env_flag(NO_BACKGROUND_DRAFTER_ENV):
        return False
    record = shipped_record(spec, target_name)
    config = None if record is None else record.get("config")
    return isinstance(config, dict) and record.get("method") == "moa" and not config.get("memory_hidden", False)


def shipped_record(spec: str, target_name: str) -> dict | None:
    """The config.json of shipped drafter `spec` (`moa`, `moa+ngram`, ...) for a target by name,
    or None for a checkpoint directory, a model-free drafter or a record that cannot be read."""
    from moaspec.drafters import SHIPPED, SHIPPED_DIR, split_lookup

    base = split_lookup(spec)[0]
    if base not in SHIPPED:
        return None
    try:
        record = json.loads((SHIPPED_DIR / target_name / base / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def context_layers_of(record: dict) -> range:
    """The target layers a MoA checkpoint's context encoder reads (its `MoAContextEncoder.layers`)."""
    from moaspec.nn.moa_layers import context_layers

    config = record["config"]
    return context_layers(config["num_target_layers"], config.get("memory_layers", 0), config.get("tli_layers", 0))


class BackgroundDrafter:
    """A drafter of the module docstring's kind: `build()` returns the finished drafter (layout,
    tree and lookup set), run in a thread after PLAIN_STEPS_FIRST plain proposals (at once for a
    sampled one); `layers` are the target
    layers whose keys/values it reads (captured from now on); tree_config / tree_source are the
    ones it will have."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self, build: Callable[[], Drafter], target: Target, layers: Sequence[int], tree_config: TreeConfig, tree_source: str
    ) -> None:
        target.keep_layer_kv(layers)  # before the prompt: the drafter reads every verified token's
        self.target = target
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
            self.joined.accept(update)
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
        ids = np.asarray(self._history, dtype=np.int64)
        drafter.accept(VerifiedUpdate(ids, 0, None, self.target))
        self.joined, self.joined_at, self._history = drafter, len(self._history), []
