"""Machine calibration: choose weight layout, drafter form, tree and lookup by predicted tokens/s.

What is fastest differs by CPU (the AMX Xeon the shipped trees were tuned on verifies few-row
trees cheaply; the AVX2 and AVX-512 EPYCs do not, and there the tuned default ran 0.75x plain
decoding). So on first use on a machine, `calibrate` measures what decides speed there:
- the target's verify seconds for 1-16 tree nodes in each weight layout (nn/fast_linear.py);
- a model drafter's propose seconds per tree shape and accept seconds, in each layout;
and combines them with stored, machine-independent acceptance (profile.py) to predict tokens/s
for every option (predict.py). The measurement takes ~10-20 s with a progress line on stderr and
is cached per CPU model, runtime and checkpoint (costs_store.py); later loads only predict.

What is chosen, by what the user named:
- nothing (the default): the form among `none`, `ngram` and the default `X+ngram`, with its
  layout, tree and lookup trie;
- a form (`none`, `ngram`, `moa`, `moa+ngram`, a directory...): that form, with the layout and
  (where it has them) tree and lookup trie chosen for it.
Fixed choices are kept: MOASPEC_WEIGHT_LAYOUT fixes the layout; explicit `--tree-*` values or a
`moaspec tune` result fix the tree (precedence in moaspec/tuned.py; the checkpoint's tree is
only the fallback when calibration is off). MOASPEC_NO_CALIBRATION=1 turns it all off: the
named (or default) drafter as before, row-major unless MOASPEC_WEIGHT_LAYOUT says otherwise.

The prediction assumes greedy decoding (acceptance under sampling is lower): the choice made for
greedy is kept for sampled requests.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.calibration import costs_store
from moaspec.calibration.machine import cpu_description, runtime_description
from moaspec.calibration.predict import (
    LOOKUP_MAX_NODES,
    Option,
    choose,
    lookup_configs,
    lookup_first_option,
    lookup_option,
    model_option,
    plain_option,
)
from moaspec.calibration.profile import load_lookup_profile, load_rank_rates, simulate_lookup
from moaspec.drafters import (
    MODEL_FREE,
    checkpoint_directory,
    default_drafter,
    default_for_tree_settings,
    make_drafter,
    split_lookup,
    tree_settings_given,
)
from moaspec.drafters.lookup_gate import LookupGate
from moaspec.env_flags import NO_CALIBRATION_ENV, env_flag
from moaspec.errors import MoaspecError
from moaspec.nn.layout_names import LAYOUTS, requested_layout
from moaspec.signals import load_library_held
from moaspec.tuned import checkpoint_key

if TYPE_CHECKING:
    from moaspec.config import NgramConfig, TreeConfig
    from moaspec.drafters.base import Drafter
    from moaspec.drafters.tree_drafter import TreeDrafter
    from moaspec.targets.base import Target

DISABLE_ENV = NO_CALIBRATION_ENV
DEFAULT = "default"
# the verify record's field on llama.cpp: the exact tree size its costs were measured within (the
# size itself is saved by llamacpp_exactness.py; costs measured for another size, or recorded
# before session 28 under other field names, are measured again)
EXACT_NODES_FIELD = "exact_tree_nodes"


@dataclass(frozen=True)
class TreeLimit:
    """The trees the target verifies: at most `max_nodes` nodes (None: any), only chains where
    `chains_only` (llama.cpp where only short chains are exact: llamacpp.py's module docstring)."""

    max_nodes: int | None = None
    chains_only: bool = False

    @classmethod
    def of(cls, target: Target) -> TreeLimit:
        return cls(getattr(target, "max_tree_nodes", None), getattr(target, "max_tree_leaves", None) == 1)

    def takes(self, tree: TreeConfig, num_nodes: int) -> bool:
        """Whether a model drafter's tree (TreeConfig) of num_nodes nodes is within the limit."""
        return (self.max_nodes is None or num_nodes <= self.max_nodes) and (not self.chains_only or tree.top_k == 1)

    def lookups(self) -> list[NgramConfig]:
        """The lookup tries (predict.lookup_configs) whose tries are within the limit."""
        return [
            config for config in lookup_configs()
            if (self.max_nodes is None or config.max_nodes <= self.max_nodes)
            and (not self.chains_only or config.max_branches == 1)
        ]


@dataclass(frozen=True)
class Calibration:
    """What the calibration chose and why (the `calibration` field of `--json` and bench results)."""

    requested: str  # "default" or the drafter spec the user named
    chosen: Option
    plain: Option | None  # the best `none` option, when one was evaluated
    cpu: str
    runtime: str
    source: str  # "measured" (this run) or "cached"
    measure_s: float
    lookup_profile: str  # where the lookup acceptance came from (profile.py)
    rates_source: str | None  # where the model drafter's rank rates came from, or None
    tree_source: str | None  # "calibrated", "tuned" or "explicit" for model drafters
    runners_up: list[Option] = field(default_factory=list)  # the best option of every other form and layout

    def to_dict(self) -> dict:
        chosen = self.chosen.to_dict()
        record = {
            "requested": self.requested,
            **chosen,
            "predicted_speedup": round(self.chosen.tokens_per_s / self.plain.tokens_per_s, 4) if self.plain else None,
            "cpu": self.cpu,
            "runtime": self.runtime,
            "source": self.source,
            "measure_s": round(self.measure_s, 2),
            "lookup_profile": self.lookup_profile,
            "rates_source": self.rates_source,
            "tree_source": self.tree_source,
            "runners_up": [option.to_dict() for option in self.runners_up],
        }
        return record


class CalibrationUnavailable(MoaspecError):
    """The costs cannot be measured for this target (e.g. its context is too short)."""


def calibration_enabled() -> bool:
    return not env_flag(DISABLE_ENV)


def drafter_for(
    target: Target, spec: str | None, tree_overrides: dict | None = None, layout: str | None = None,
    background: bool = False,
) -> tuple[Drafter, Calibration | None]:
    """-> (drafter, Calibration or None): calibrated unless MOASPEC_NO_CALIBRATION is set, else
    the named drafter (or the target's default) as configured. layout: keep the target's weights
    in this layout (a benchmark compares drafters on one layout) instead of choosing it.
    background: a model drafter that qualifies is built in a background thread while the target
    decodes plainly (drafters/background.py; the CLI's one-shot `generate`)."""
    if calibration_enabled():
        try:
            return calibrated_drafter(target, spec, tree_overrides, layout=layout, background=background)
        except CalibrationUnavailable as exc:
            print(f"moaspec: warning: no machine calibration ({exc}); using the drafter as configured", file=sys.stderr)
            target.use_layout(requested_layout() or "row")  # the measurement may have left the other one
    return configured_drafter(target, spec, tree_overrides, background), None


def configured_drafter(
    target: Target, spec: str | None, tree_overrides: dict | None = None, background: bool = False
) -> Drafter:
    """The named drafter (or the target's default) as configured, without a calibration;
    background: as `drafter_for`."""
    if spec is None:
        given = tree_settings_given(tree_overrides)
        spec = default_for_tree_settings(target.name) if given else default_drafter(target.name)
    base, with_lookup = split_lookup(spec)
    if background and in_background(target, base):
        model = LazyModelDrafter(base, target, tree_overrides)
        return _model_drafter(model, model.tree_config, model.tree_source, lambda drafter: _lookup_on(drafter, with_lookup), True)
    return make_drafter(spec, target, tree_overrides)


def in_background(target: Target, base: str) -> bool:
    """Whether model drafter `base` would be built in the background for `target` (module
    docstring of drafters/background.py): before torch is loaded, where it qualifies
    (`can_build_in_background`)."""
    from moaspec.drafters.background import can_build_in_background

    return "torch" not in sys.modules and can_build_in_background(base, target.name, target.runtime)


def _lookup_on(drafter, with_lookup: bool, lookup=None) -> None:
    if with_lookup:
        drafter.enable_lookup(lookup)


def _model_drafter(model: LazyModelDrafter, tree, tree_source: str, finish, background: bool):
    """The model drafter with `tree` (from `tree_source`) and finished by `finish(drafter)` (its
    layout, lookup): built now, or in a background thread (BackgroundDrafter) where `background`
    (the caller checked that it qualifies: `in_background`)."""

    def build():
        drafter = model.drafter()
        drafter.tree_config, drafter.tree_source = tree, tree_source
        finish(drafter)
        return drafter

    if background:
        from moaspec.drafters.background import BackgroundDrafter, reads_of
        from moaspec.nn.fingerprint import check_made_for

        check_made_for(model.record, model.directory, model.target)  # before the first token, without torch
        return BackgroundDrafter(build, model.target, reads_of(model.record), tree, tree_source)
    return build()


def calibrated_drafter(
    target: Target,
    spec: str | None,
    tree_overrides: dict | None = None,
    progress: bool = True,
    layout: str | None = None,
    background: bool = False,
) -> tuple[Drafter, Calibration | None]:
    """-> (drafter, Calibration) for `spec` (None = the default), with the target re-laid out
    (in `layout`, else MOASPEC_WEIGHT_LAYOUT's, else the fastest measured); background: as
    `drafter_for`.

    MoaspecError for a drafter that cannot be made (as make_drafter).
    """
    if spec is None and tree_settings_given(tree_overrides):
        spec = default_for_tree_settings(target.name)
    requested = spec or DEFAULT
    spec = spec or default_drafter(target.name)
    base, with_lookup = split_lookup(spec)
    model = None if base in MODEL_FREE else LazyModelDrafter(base, target, tree_overrides)
    fixed = layout or requested_layout()
    # on llama.cpp the layout only concerns the drafter's own (small) torch weights: row-major
    layouts = (fixed,) if fixed else LAYOUTS if target.runtime == "transformers" else ("row",)
    cpu, runtime = cpu_description(), runtime_description(target)
    say = _progress(progress)
    if target.runtime == "llama.cpp" and _exact_tree_nodes(target, say, model) == 1:
        if model is not None and requested != DEFAULT:
            model.check_target()  # a named drafter of another target: that error, not the trees'
        return _plain_decoding(target, requested, base)
    limit = TreeLimit.of(target)
    sequences, lookup_source = load_lookup_profile(target.name)
    verify_costs, lookup_s, drafter_costs, measure_s = _measured_costs(target, model, layouts, sequences, cpu, runtime, say)
    lookups = []  # the lookup tries as the model drafter's first guess (no gate: the model answers otherwise)
    if sequences and with_lookup:
        lookups = costs_store.simulated_lookups(target.name, sequences, limit.lookups(), simulate_lookup)
    rates, rates_source = None, None
    if model is not None:
        rates, rates_source = load_rank_rates(target.name, model.directory)
    options: list[Option] = []
    trees = None  # the model's tree candidates: their acceptance is the same in every layout
    gates: dict[str, LookupGate] = {}  # the `ngram` form's gate per layout, from its verify costs
    for layout in layouts:
        costs = costs_store.cycle_costs(verify_costs[layout], drafter_costs[layout] if model is not None else None)
        if model is not None:
            trees = _tree_candidates(model, costs, rates, limit) if trees is None else _recost(trees, costs)
        gated = []  # the lookup tries of the `ngram` form, behind the gate
        if sequences and (requested == DEFAULT or base == "ngram"):
            gates[layout] = LookupGate.from_cycle_costs(costs.tree_s, LOOKUP_MAX_NODES)
            gated = costs_store.simulated_lookups(
                target.name, sequences, limit.lookups(), simulate_lookup, gates[layout]
            )
        options += _options(requested, base, with_lookup, trees, layout, costs, lookups, gated, lookup_s)
    chosen = choose(options)
    drafter = _apply(target, chosen, model, spec, gates.get(chosen.layout), background)
    tree_source = None if model is None or chosen.tree is None else drafter.tree_source
    calibration = _calibration(requested, chosen, options, cpu, runtime, measure_s, lookup_source, rates_source, tree_source)
    if measure_s is not None:
        say(f"done: {_summary(chosen, calibration.plain, target.runtime)}")
    return drafter, calibration


def _calibration(
    requested: str, chosen: Option, options: list[Option], cpu: str, runtime: str, measure_s: float | None,
    lookup_source: str, rates_source: str | None, tree_source: str | None,
) -> Calibration:
    """The record of a choice among `options`: the best `none` beside it, and the best option of
    every other form and layout as runners-up; measure_s: None when the costs were cached."""
    plain = max((o for o in options if o.drafter == "none"), key=lambda o: o.tokens_per_s, default=None)
    best_per_form: dict[tuple[str, str], Option] = {}
    for option in sorted(options, key=lambda o: -o.tokens_per_s):
        best_per_form.setdefault((option.drafter, option.layout), option)
    source = "cached" if measure_s is None else "measured"
    return Calibration(
        requested, chosen, plain, cpu, runtime, source, measure_s or 0.0, lookup_source, rates_source, tree_source,
        [o for o in best_per_form.values() if o is not chosen],
    )


def _options(
    requested: str, base: str, with_lookup: bool, trees, layout: str, costs, lookups, gated, lookup_s: float
) -> list[Option]:
    """The options of one layout for what was requested (module docstring); trees: the model
    drafter's candidates costed in this layout, None without a model drafter; lookups / gated:
    [(lookup config, replayed stats)] without / with the `ngram` form's gate."""
    options: list[Option] = []
    if requested in (DEFAULT, "none"):
        options.append(plain_option(layout, costs))
    if requested == DEFAULT or base == "ngram":
        options += [lookup_option(layout, costs, config, stats, lookup_s) for config, stats in gated]
    if trees is not None:
        if with_lookup and lookups:
            options += [
                lookup_first_option(base, layout, costs, tree, config, stats, lookup_s)
                for tree in trees
                for config, stats in lookups
            ]
        else:
            options += [model_option(base, layout, tree) for tree in trees]
    if not options:  # `ngram` without any lookup profile: the named form, in this layout
        options.append(replace(plain_option(layout, costs), drafter="ngram"))
    return options


class DrafterUnavailable(MoaspecError):
    """The model drafter a calibration weighs cannot be made (e.g. trained for another target):
    the user's error, not a failed measurement."""


class LazyModelDrafter:
    """The model drafter a calibration weighs, loaded only when it is measured or chosen: its tree
    (checkpoint, tuned or explicit: tuned.py) comes from config.json without the weights, so a
    load whose cached costs choose `none` or `ngram` never builds it, nor reads the target's
    embedding that `check_target` compares (llama.cpp: ~40 MB more peak memory, tested)."""

    def __init__(self, base: str, target: Target, tree_overrides: dict | None) -> None:
        import json

        from moaspec.config import TreeConfig
        from moaspec.tuned import resolve_tree

        self.base, self.target, self.tree_overrides = base, target, tree_overrides
        self.directory = directory = checkpoint_directory(base, target.name)
        try:
            self.record = record = json.loads((directory / "config.json").read_text())
            tree = TreeConfig(**record.get("tree", {}))
        except (OSError, ValueError, TypeError, AttributeError):
            tree = None
        # llama.cpp's drafters run on the CPU (its `device`, which is torch's: read without it here)
        device = "cpu" if target.runtime == "llama.cpp" else target.device
        if tree is None:  # unreadable: make_drafter says why
            self._drafter = make_drafter(base, target, tree_overrides)
            self.tree_config, self.tree_source = self._drafter.tree_config, self._drafter.tree_source
        else:
            self._drafter = None
            self.tree_config, self.tree_source = resolve_tree(
                tree, target.name, directory, tree_overrides, device, target.runtime
            )
        # some --tree-* fields fixed, the others left to the calibration (not to a tuned choice,
        # which outranks it: tuned.py): the candidates are the trees with those fields
        given = {key: value for key, value in (tree_overrides or {}).items() if value is not None}
        partial = tree is not None and 0 < len(given) < 3
        below = resolve_tree(tree, target.name, directory, None, device, target.runtime)[1] if partial else None
        self.fixed_fields = given if below == "checkpoint" else {}

    def check_target(self) -> None:
        """MoaspecError for a drafter made for another target: before anything is measured for it
        (building it checks the same; costs saved for it were measured with it built)."""
        from moaspec.nn.fingerprint import check_made_for  # without torch on llama.cpp (else its import held)

        if self._drafter is None:
            try:
                check_made_for(self.record, self.directory, self.target)
            except MoaspecError as exc:  # the user's error, not a failed measurement
                raise DrafterUnavailable(str(exc)) from exc

    def drafter(self) -> TreeDrafter:
        if self._drafter is None:
            try:
                self._drafter = make_drafter(self.base, self.target, self.tree_overrides)
            except MoaspecError as exc:
                raise DrafterUnavailable(str(exc)) from exc
        return self._drafter


def _tree_candidates(model, costs, rates, limit: TreeLimit):
    """Every tree with measured costs that the target verifies, or only the model's own when it
    was fixed: tuned (where the target verifies it) or explicit (where not, cut at every step)."""
    from moaspec.calibration.tree_ranking import Candidate, candidates, expected_tau

    tree = model.tree_config
    taus = costs_store.rank_model_taus(rates)
    known = taus.get((tree.depth, tree.top_k, tree.budget))
    tau, nodes = known if known is not None else expected_tau(tree, rates)
    beyond = not limit.takes(tree, nodes) and model.tree_source != "explicit"
    if model.tree_source == "checkpoint" or model.fixed_fields or beyond:
        fixed = model.fixed_fields
        found = [
            c for c in candidates(costs, rates, taus)
            if c.num_nodes <= max(costs.verify_s)  # no extrapolation
            and limit.takes(c.tree, c.num_nodes)
            and all(getattr(c.tree, field) == value for field, value in fixed.items())
        ]
        if found:
            return found
    if not limit.takes(tree, nodes):  # fixed by --tree-* beyond what the target verifies
        shape = "chains" if limit.chains_only else "trees"
        print(f"moaspec: the target verifies {shape} of at most {limit.max_nodes} nodes here: the drafter's tree "
              f"(depth {tree.depth}, top-k {tree.top_k}) is cut to that at every step", file=sys.stderr)
    return [Candidate(tree, nodes, tau, costs.cycle_s(tree, nodes, tau))]


def _recost(trees, costs):
    """The same candidates with this layout's cycle seconds."""
    from moaspec.calibration.tree_ranking import Candidate

    return [
        Candidate(c.tree, c.num_nodes, c.expected_tau, costs.cycle_s(c.tree, c.num_nodes, c.expected_tau))
        for c in trees
    ]


def target_identity(target: Target) -> str:
    """What the measured costs belong to besides the CPU and runtime: the target's name, and for
    a llama.cpp target its file's content (gguf_digest: two different `model.gguf` files share a
    name, one file installed at two paths shares its costs) and the layers it offloads to a GPU."""
    if target.runtime != "llama.cpp":
        return target.name
    from moaspec.model_store import gguf_digest

    return f"{target.name}|{gguf_digest(target.weights.path)}|ngl {target.weights.gpu_layers}"


def _verify_record(target, cpu: str, runtime: str, layouts) -> tuple[Path, str, dict]:
    """Where the target's verify costs (and llama.cpp's exact tree size) are cached here: -> (path,
    its key, the identity fields the record carries)."""
    key = costs_store.verify_key(cpu, runtime, target_identity(target), layouts)
    identity = {"cpu": cpu, "runtime": runtime, "target": target.name, "layouts": list(layouts)}
    return costs_store.cache_dir(target.name) / f"verify-{key}.json", key, identity


def _exact_tree_nodes(target, say, model) -> int:
    """How many nodes a tree llama.cpp verifies for this target here may have and stay exact:
    saved on this machine, else measured now (~6 s) and saved (llamacpp_exactness.py)."""
    from moaspec.targets.llamacpp_exactness import saved_exact_tree_nodes

    if target.weights.exact_nodes is None and saved_exact_tree_nodes(target) is None:
        if model is not None:
            model.check_target()  # a drafter of another target is refused before the measurement
        say("how large a tree llama.cpp verifies exactly here")
    return target.exact_tree_nodes


def _plain_decoding(target, requested: str, base: str):
    """Where trees would change the output (llama.cpp's batched kernels are not exact for this
    target here): plain decoding for the default, an error for a named drafter. -> (drafter, None)."""
    from moaspec.drafters.none import NoDrafter

    reason = (
        f"on this CPU llama.cpp's batched kernels do not reproduce one-token decoding bit for bit for {target.name}, "
        "so verifying draft trees could change the output"
    )
    if requested == DEFAULT:
        print(f"moaspec: {reason}: plain decoding (--runtime transformers speculates)", file=sys.stderr)
    elif base != "none":
        raise MoaspecError(f"{reason}: use --drafter none or --runtime transformers")
    target.use_layout("row")
    return NoDrafter.for_target(target), None


def _measured_costs(target, model, layouts, sequences, cpu: str, runtime: str, say):
    """_costs, and the seconds it measured for (None when every cost was cached). The named
    drafter's own failure is a MoaspecError; the measurement's, CalibrationUnavailable."""
    begin = time.perf_counter()
    try:
        verify, lookup_s, drafter, measured = _costs(target, model, layouts, sequences, cpu, runtime, say)
    except DrafterUnavailable as exc:  # the named drafter itself cannot be made: that is the error
        raise MoaspecError(str(exc)) from exc
    except MoaspecError as exc:  # raised by the measurement
        raise CalibrationUnavailable(str(exc)) from exc
    return verify, lookup_s, drafter, time.perf_counter() - begin if measured else None


def _costs(target, model, layouts, sequences, cpu: str, runtime: str, say):
    """Cached costs, or measured (and saved) ones. -> (verify, lookup_s, drafter, measured?).
    On llama.cpp the costs hold the exact tree size they were measured within (they time no
    larger tree): costs measured within another size are measured again."""
    verify_path, key, identity = _verify_record(target, cpu, runtime, layouts)
    measured = False
    cached = costs_store.load_verify_costs(verify_path, layouts)
    measured_within = costs_store.read_field(verify_path, EXACT_NODES_FIELD)
    drafter = drafter_path = shapes = None
    if model is not None:
        checkpoint = checkpoint_key(model.directory)
        drafter_path = verify_path.parent / f"drafter-{costs_store.key_of(key, checkpoint)}.json"
        drafter = costs_store.load_drafter_costs(drafter_path, layouts)
        shapes = sorted({(d, k) for d in costs_store.DRAFT_DEPTHS for k in costs_store.DRAFT_TOP_KS}
                        | {(model.tree_config.depth, model.tree_config.top_k)})
    drafter_missing = model is not None and (drafter is None or any(s not in drafter[layouts[0]][0] for s in shapes))
    verify_missing = cached is None or (target.runtime == "llama.cpp" and measured_within != target.exact_tree_nodes)
    if verify_missing or drafter_missing:
        load_library_held()  # the measurements run in torch (a cached calibration needs none)
    if model is not None and (verify_missing or drafter_missing):
        model.check_target()  # a drafter of another target is refused now, not after the measurements
    if verify_missing:
        measured = True
        verify = costs_store.measure_verify_costs(target, layouts, say)
        lookup_s = costs_store.measure_lookup_s(sequences)
        record = costs_store.verify_record(verify, lookup_s, identity)
        if target.runtime == "llama.cpp":
            record[EXACT_NODES_FIELD] = target.exact_tree_nodes
        costs_store.save(verify_path, record)
    else:
        verify, lookup_s = cached
    if drafter_missing:
        measured = True
        drafter = costs_store.measure_drafter_costs(model.drafter(), target, layouts, shapes, say)
        costs_store.save(drafter_path, costs_store.drafter_record(drafter, {**identity, "checkpoint": checkpoint}))
    return verify, lookup_s, drafter, measured


def _apply(target, chosen: Option, model, spec: str, gate: LookupGate | None, background: bool = False):
    """Lay out the target (and drafter) as chosen; -> the drafter of the chosen form (`ngram`
    with `gate`, the chosen layout's; a model drafter built in the background where `background`
    and it qualifies: `_model_drafter`)."""
    from moaspec.drafters.ngram import NgramDrafter
    from moaspec.drafters.none import NoDrafter

    target.use_layout(chosen.layout)
    if chosen.drafter in ("none", "ngram"):
        target.forget_layer_kv()  # a model drafter made for the measurement is not used
        target.forget_final_hidden()
    if chosen.drafter == "none":
        return NoDrafter.for_target(target)
    if chosen.drafter == "ngram" or model is None:
        return NgramDrafter(chosen.lookup, gate) if chosen.lookup is not None else make_drafter(spec, target)
    partly_fixed = bool(model.fixed_fields)  # the calibration chose the fields --tree-* left open
    tree, tree_source = model.tree_config, model.tree_source
    replaced = chosen.tree is not None and chosen.tree != tree  # too large for the target (_tree_candidates)
    if chosen.tree is not None and (tree_source == "checkpoint" or partly_fixed or replaced):
        tree, tree_source = chosen.tree, "calibrated"

    def finish(drafter) -> None:
        drafter.use_layout(chosen.layout)
        _lookup_on(drafter, chosen.drafter.endswith("+ngram"), chosen.lookup)

    return _model_drafter(model, tree, tree_source, finish, background and in_background(target, model.base))


def _summary(chosen: Option, plain: Option | None, runtime: str) -> str:
    parts = [f"drafter {chosen.drafter}", f"{chosen.layout}-major" if runtime == "transformers" else runtime]
    if chosen.tree is not None:
        parts.append(f"tree depth {chosen.tree.depth} top-k {chosen.tree.top_k} budget {chosen.tree.budget}")
    if chosen.lookup is not None:
        lookup = chosen.lookup
        parts.append(f"lookup {lookup.min_ngram}+-grams, depth {lookup.max_depth} x {lookup.max_branches}")
    if plain is not None:
        parts.append(f"predicted {chosen.tokens_per_s / plain.tokens_per_s:.2f}x plain decoding")
    return ", ".join(parts)


def _progress(enabled: bool):
    """A `say(what)` printing one stderr line per measured part, with seconds since the
    calibration began (one clock for every line, the last included)."""
    started = time.perf_counter()

    def say(what: str) -> None:
        if enabled:
            line = f"moaspec: calibrating this machine (once): {what} [{time.perf_counter() - started:.0f} s]"
            print(line, file=sys.stderr, flush=True)

    return say
