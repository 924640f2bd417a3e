"""Acceptance profiles: what a drafter form is expected to accept, independent of the machine.

Acceptance under greedy decoding depends on the target and the drafter, never on the CPU, so it
is measured once and stored; the machine calibration combines it with costs measured where it
runs (calibration/predict.py).

- **Lookup profile** (per target): the target's own greedy continuations of 48 prompts (chat,
  prompts that feed text in, and ShareGPT users' first turns; bench/acceptance_profile.py). Prompt lookup is model-free, so its acceptance on that
  text is obtained exactly by replaying greedy decoding with the n-gram drafter over the known
  sequence (`simulate_lookup`): no target forward is needed, and any lookup configuration can be
  evaluated at calibration time.
- **Rank rates** (per drafter checkpoint): h_r = P(the target's next token is the drafter's r-th
  candidate), from `moaspec tune`'s calibration (bench/tune.py).

Where they come from (first found wins):
- lookup: the shipped `moaspec/checkpoints/<target>/acceptance.json`, else the shipped
  SmolLM2-135M profile as a prior (labelled "prior": text repetition is mostly a property of the prompts, not the model);
- rank rates: `moaspec tune`'s saved record for the checkpoint (cache), else the checkpoint's
  `acceptance.json` (when its weights digest matches), else a geometric prior with top-1
  PRIOR_TOP1 (the shipped drafters' measured top-1 on chat is 0.25-0.35).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moaspec.config import NgramConfig, SamplingConfig
from moaspec.drafters.lookup_gate import LookupGate
from moaspec.drafters.ngram import NgramDrafter
from moaspec.tree import trie_children, walk

PROFILE_FILE = "acceptance.json"
PRIOR_TARGET = "smollm2-135m"
PRIOR_TOP1 = 0.3


@dataclass(frozen=True)
class LookupSequence:
    """prompt_ids: the prompt as the target saw it; generated_ids: the target's greedy continuation."""

    prompt_ids: list[int]
    generated_ids: list[int]


@dataclass(frozen=True)
class LookupStats:
    """Greedy decoding with prompt lookup alone, replayed over known sequences.

    matched_*: cycles whose lookup found a continuation (tokens emitted, tree nodes incl. the
    root); unmatched_cycles: cycles without one (a plain step, one token each).
    """

    matched_cycles: int
    matched_tokens: int
    matched_nodes: int
    unmatched_cycles: int

    @property
    def cycles(self) -> int:
        return self.matched_cycles + self.unmatched_cycles

    @property
    def tokens(self) -> int:
        return self.matched_tokens + self.unmatched_cycles


def accepted_length(tree_token_ids: list[int], tree_parents: list[int], future: list[int]) -> int:
    """Drafted tokens greedy verification keeps: the longest root path spelling `future`'s start."""
    return walk(trie_children(tree_token_ids, tree_parents), future)[0]


def simulate_lookup(
    sequences: list[LookupSequence],
    config: NgramConfig,
    gate: LookupGate | None = None,
    on_cycle: Callable[[int, int], None] | None = None,
) -> LookupStats:
    """Replay greedy decoding with the n-gram drafter (and its gate) over each sequence: exactly
    the cycles the engine runs with that drafter (greedy, max_new_tokens = the sequence's length)
    on these prompts, whose first generated token comes from the prefill and needs no cycle. The
    drafter's trie is taken as lists (`propose_nodes`), ~6x faster than as tensors.
    on_cycle(num_nodes, emitted), when given, sees every cycle (nodes verified incl. the root)."""
    matched_cycles = matched_tokens = matched_nodes = unmatched = 0
    for sequence in sequences:
        drafter = NgramDrafter(config, gate)
        drafter.extend(list(sequence.prompt_ids))
        generated = sequence.generated_ids
        position = 0  # index in `generated` of the current root
        while position < len(generated) - 1:
            tokens, parents, node_depths = drafter.propose_nodes(generated[position])
            # as the engine: no deeper than still useful (prune_to_depth keeps the nodes this deep)
            useful_depth = min(config.max_depth, len(generated) - position - 2)
            num_nodes = sum(1 for depth in node_depths if depth <= useful_depth)
            future = generated[position + 1 : position + 1 + useful_depth]
            emitted = accepted_length(tokens, parents, future) + 1
            if num_nodes > 1:
                matched_cycles += 1
                matched_tokens += emitted
                matched_nodes += num_nodes
            else:
                unmatched += 1
            if on_cycle is not None:
                on_cycle(num_nodes, emitted)
            drafter.extend(generated[position : position + emitted])
            position += emitted
    return LookupStats(matched_cycles, matched_tokens, matched_nodes, unmatched)


def measure_lookup_s(sequences: list[LookupSequence], repeats: int = 3) -> float:
    """Median seconds of the lookup's own work per cycle (propose + accept of the emitted tokens),
    replaying the widest lookup over the sequences."""
    import statistics
    import time

    import numpy as np

    config, sampling = NgramConfig(), SamplingConfig()  # greedy: the lookup draws nothing
    per_cycle = []
    for _ in range(repeats):
        cycles, elapsed = 0, 0.0
        for sequence in sequences:
            drafter = NgramDrafter(config)
            drafter.accept_context(np.array(sequence.prompt_ids), 0, {})
            for position, root in enumerate(sequence.generated_ids[:-1]):
                begin = time.perf_counter()
                drafter.propose(root, sampling, None)
                drafter.accept_context(np.array([root]), 0, {})
                elapsed += time.perf_counter() - begin
                cycles += 1
        per_cycle.append(elapsed / cycles if cycles else 0.0)
    return statistics.median(per_cycle)


# -- stored profiles ------------------------------------------------------------------------------
def shipped_profile_path(target_name: str) -> Path:
    from moaspec.drafters import SHIPPED_DIR

    return SHIPPED_DIR / target_name / PROFILE_FILE


def sequences_to_json(sequences: list[LookupSequence]) -> list[dict]:
    return [{"prompt_ids": s.prompt_ids, "generated_ids": s.generated_ids} for s in sequences]


def sequences_from_json(records: list[dict]) -> list[LookupSequence]:
    return [LookupSequence(list(map(int, r["prompt_ids"])), list(map(int, r["generated_ids"]))) for r in records]


def load_lookup_profile(target_name: str) -> tuple[list[LookupSequence], str]:
    """-> (sequences, source) with source "shipped" or "prior" (see the module docstring)."""
    for path, source in (
        (shipped_profile_path(target_name), "shipped"),
        (shipped_profile_path(PRIOR_TARGET), "prior"),
    ):
        record = _read_json(path)
        if record and record.get("lookup_sequences"):
            try:
                return sequences_from_json(record["lookup_sequences"]), source
            except (KeyError, TypeError, ValueError):
                continue
    return [], "none"


def weights_digest(directory: Path) -> str:
    """sha256 (16 hex) of a checkpoint's model.safetensors: ties a profile to the weights it measured."""
    weights = directory / "model.safetensors"
    if not weights.is_file():
        return ""
    with weights.open("rb") as file:  # streamed: reading it whole raised a load's peak memory by its size
        return hashlib.file_digest(file, "sha256").hexdigest()[:16]


def load_rank_rates(target_name: str, directory: Path) -> tuple[tuple[float, ...], str]:
    """-> (rank rates h_1..h_4, source) with source "tuned", "checkpoint" or "prior". Acceptance
    does not depend on the device, so a tune run on either kind (CPU first) serves."""
    from moaspec.calibration.tree_ranking import geometric_rates, rates_from_hit_rates
    from moaspec.tuned import DEVICE_KINDS, tuned_path

    for kind in DEVICE_KINDS:
        tuned = _read_json(tuned_path(target_name, directory, kind))
        if tuned and tuned.get("rates_source") == "calibrated" and tuned.get("rank_rates"):
            return tuple(float(r) for r in tuned["rank_rates"]), "tuned"
    stored = _read_json(directory / PROFILE_FILE)
    if stored and stored.get("hit_rate_by_top_k") and stored.get("weights_sha256") == weights_digest(directory):
        return rates_from_hit_rates([float(h) for h in stored["hit_rate_by_top_k"]]), "checkpoint"
    return geometric_rates(PRIOR_TOP1), "prior"


def _read_json(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None
