"""Measured costs per machine, runtime, target and drafter checkpoint, cached as JSON.

Two files under `<cache root>/calibration/<target name>/` (cache root as in model_store.py):
- `verify-<key>.json`: the target's verify seconds for VERIFY_NODE_COUNTS tree nodes, its plain
  step and tree penalty (costs.py), per weight layout, and the prompt lookup's own seconds per
  cycle; key = CPU + runtime + target + the layouts measured;
- `drafter-<key>.json`: a model drafter's propose seconds per tree shape and accept seconds, per
  layout; key = the same + the checkpoint (tuned.checkpoint_key: config, weights size and mtime).
A change of any of them is a new key, hence a new measurement. Unreadable files are measured
again, never an error. Beside them, results computed from cached inputs are kept by content:
`lookup-<key>.json` (the prompt lookup replayed over the acceptance profile) and, in
`<cache root>/calibration/`, `rank-model-<key>.json` (the expected tau of every tree under a
drafter's rank rates: tree_ranking.tau_table, the one part of a cached calibration that needs torch).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moaspec.atomic_files import write_file_atomically
from moaspec.calibration.costs import CycleCosts, VerifyCosts, measure_drafter, measure_verify
from moaspec.calibration.machine import key_of
from moaspec.errors import MoaspecError
from moaspec.model_store import cache_root
from moaspec.signals import load_library_held

if TYPE_CHECKING:
    from moaspec.calibration.profile import LookupSequence, LookupStats
    from moaspec.config import NgramConfig
    from moaspec.drafters.lookup_gate import LookupGate
    from moaspec.drafters.tree_drafter import TreeDrafter
    from moaspec.targets.base import Target

FORMAT_VERSION = 2  # 2: the plain step and the tree penalty (costs.py)
CONTEXT_LEN = 128  # a chat prompt's length; the verify cost of this model moves little with it
REPEATS = 3
VERIFY_NODE_COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
DRAFT_DEPTHS = tuple(range(1, 7))
DRAFT_TOP_KS = (1, 2, 3, 4)
LOOKUP_REPLAY_VERSION = 2  # bumped when the drafter's or the gate's rules change what a replay counts
RANK_MODEL_VERSION = 1  # bumped when something besides the two modules rank_model_taus reads changes a tau


def context_len(target: Target) -> int:
    """CONTEXT_LEN, or a quarter of a smaller target's context."""
    return max(1, min(CONTEXT_LEN, target.max_positions // 4))


def cache_dir(target_name: str) -> Path:
    return cache_root() / "calibration" / target_name


def load_verify_costs(path: Path, layouts: tuple[str, ...]) -> tuple[dict[str, VerifyCosts], float] | None:
    """-> (verify costs per layout; lookup seconds per cycle), or None."""
    record = _read(path)
    try:
        verify = {
            layout: VerifyCosts(
                {int(n): float(s) for n, s in record["verify_s"][layout].items()},
                float(record["plain_step_s"][layout]),
                float(record["tree_penalty_s"][layout]),
            )
            for layout in layouts
        }
        return verify, float(record["lookup_s"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def load_drafter_costs(path: Path, layouts: tuple[str, ...]) -> dict[str, tuple[dict, tuple[float, float]]] | None:
    record = _read(path)
    try:
        return {
            layout: (
                {_shape(key): float(s) for key, s in record["propose_s"][layout].items()},
                (float(record["accept_s"][layout][0]), float(record["accept_s"][layout][1])),
            )
            for layout in layouts
        }
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None


def verify_key(cpu: str, runtime: str, target_name: str, layouts: tuple[str, ...]) -> str:
    return key_of(str(FORMAT_VERSION), cpu, runtime, target_name, ",".join(layouts))


def _weights(target, layout: str) -> str:
    """How a progress line names the weights being timed."""
    if target.runtime == "transformers":
        return f"{layout}-major weights"
    return f"{target.runtime} (drafter weights {layout}-major)"


def measure_verify_costs(
    target: Target, layouts: tuple[str, ...], say: Callable[[str], None]
) -> dict[str, VerifyCosts]:
    """Verify costs in each layout (the target is left in the last layout)."""
    found = {}
    for layout in layouts:
        say(f"target verify costs, {_weights(target, layout)}")
        target.use_layout(layout)
        found[layout] = measure_verify(target, context_len(target), REPEATS, VERIFY_NODE_COUNTS)
        warning = found[layout].irregularity()
        if warning is not None:
            print(f"moaspec: warning: {warning} (remove {cache_dir(target.name)} to measure again)", file=sys.stderr)
    target.reset()
    return found


def measure_drafter_costs(
    drafter: TreeDrafter, target: Target, layouts: tuple[str, ...], shapes: list[tuple[int, int]],
    say: Callable[[str], None],
) -> dict[str, tuple[dict, tuple[float, float]]]:
    """Drafter propose / accept seconds in each layout (target and drafter left in the last one)."""
    needed = context_len(target) + 5 * REPEATS + (REPEATS + 1) * len(shapes) + 8  # see costs.py
    if needed > target.max_positions:
        raise MoaspecError(f"the target's context ({target.max_positions} tokens) is too short to time the drafter")
    found = {}
    for layout in layouts:
        say(f"drafter costs, {_weights(target, layout)}")
        target.use_layout(layout)
        drafter.use_layout(layout)
        found[layout] = measure_drafter(drafter, target, context_len(target), REPEATS, shapes)
    target.reset()
    drafter.reset()
    return found


def measure_lookup_s(sequences: list[LookupSequence]) -> float:
    """The prompt lookup's seconds per cycle (profile.measure_lookup_s), 0 without a profile."""
    from moaspec.calibration.profile import measure_lookup_s

    return measure_lookup_s(sequences) if sequences else 0.0


def save(path: Path, record: dict) -> None:
    """Write atomically (a concurrent reader sees the old file or the new one, never half)."""
    write_file_atomically(path, json.dumps({"format_version": FORMAT_VERSION, **record}, indent=1) + "\n")


def read_field(path: Path, key: str) -> Any:
    """One field of a cached record (None when absent or unreadable)."""
    return _read(path).get(key)


def verify_record(costs: dict[str, VerifyCosts], lookup_s: float, identity: dict) -> dict:
    return {
        **identity,
        "verify_s": {layout: {str(n): s for n, s in per.verify_s.items()} for layout, per in costs.items()},
        "plain_step_s": {layout: per.plain_step_s for layout, per in costs.items()},
        "tree_penalty_s": {layout: per.tree_penalty_s for layout, per in costs.items()},
        "lookup_s": lookup_s,
    }


def drafter_record(costs: dict[str, tuple[dict, tuple[float, float]]], identity: dict) -> dict:
    return {
        **identity,
        "propose_s": {layout: {f"{d}x{k}": s for (d, k), s in per[0].items()} for layout, per in costs.items()},
        "accept_s": {layout: list(per[1]) for layout, per in costs.items()},
    }


def cycle_costs(verify: VerifyCosts, drafter: tuple[dict, tuple[float, float]] | None) -> CycleCosts:
    propose_s, accept_s = drafter if drafter is not None else ({}, (0.0, 0.0))
    return CycleCosts(verify.verify_s, propose_s, accept_s, verify.plain_step_s, verify.tree_penalty_s)


def _shape(key: str) -> tuple[int, int]:
    depth, _, top_k = key.partition("x")
    return int(depth), int(top_k)


def _read(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) and record.get("format_version") == FORMAT_VERSION else {}


def simulated_lookups(
    target_name: str,
    sequences: list[LookupSequence],
    configs: list[NgramConfig],
    simulate: Callable[[list[LookupSequence], NgramConfig, LookupGate | None], LookupStats],
    gate: LookupGate | None = None,
) -> list:
    """[(config, LookupStats)] for every lookup config over the profile's sequences, replayed once
    (`simulate(sequences, config, gate)`, ~1.3 s for the shipped profile's 36 tries) and cached
    by content (the gate's costs included)."""
    from dataclasses import asdict

    from moaspec.calibration.profile import LookupStats

    gate_costs = None if gate is None else [gate.decay, *(round(cost, 6) for cost in gate.extra_cost)]
    content = json.dumps(
        [[s.prompt_ids, s.generated_ids] for s in sequences]
        + [asdict(c) for c in configs]
        + [gate_costs, LOOKUP_REPLAY_VERSION]
    )
    path = cache_dir(target_name) / f"lookup-{key_of(content)}.json"
    cached = _read(path).get("stats")
    if isinstance(cached, list) and len(cached) == len(configs):
        try:
            return [(config, LookupStats(**stats)) for config, stats in zip(configs, cached)]
        except TypeError:
            pass
    found = [(config, simulate(sequences, config, gate)) for config in configs]
    save(path, {"stats": [asdict(stats) for _, stats in found]})
    return found


def rank_model_taus(rates: tuple[float, ...]) -> dict[tuple[int, int, int], tuple[float, int]]:
    """tree_ranking.tau_table(rates), computed once (~0.1 s, but in torch) and cached by content:
    the rates, the trees ranked, RANK_MODEL_VERSION and the source of the rank model and of the
    tree builder it runs (a change to either computes it again)."""
    from moaspec.calibration import tree_ranking

    package = Path(tree_ranking.__file__).parent.parent
    sources = [(package / name).read_text() for name in ("calibration/tree_ranking.py", "drafters/dynamic_tree.py")]
    content = json.dumps(
        [list(rates), tree_ranking.DEPTHS, tree_ranking.TOP_KS, tree_ranking.BUDGETS, RANK_MODEL_VERSION, sources]
    )
    path = cache_root() / "calibration" / f"rank-model-{key_of(content)}.json"
    cached = _read(path).get("taus")
    if isinstance(cached, list):
        try:
            return {(int(d), int(k), int(b)): (float(tau), int(nodes)) for d, k, b, tau, nodes in cached}
        except (TypeError, ValueError):
            pass
    load_library_held()  # the model drafter's tree builder is torch's
    table = tree_ranking.tau_table(rates)
    save(path, {"rates": list(rates), "taus": [[*tree, tau, nodes] for tree, (tau, nodes) in table.items()]})
    return table
