"""Machine calibration: lookup replay equals the engine, the prediction and choice rule, the cache,
and the choice applied to target and drafter.

Every test injects its costs (no timing decides an assertion), so the results do not depend on
the CPU that runs them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import make_random_drafter_net, make_tiny_target

import moaspec.calibration.plan as plan
from moaspec.calibration import costs_store
from moaspec.calibration.costs import CycleCosts, VerifyCosts
from moaspec.calibration.predict import MIN_GAIN, Option, choose, lookup_configs, lookup_option, plain_option
from moaspec.calibration.profile import LookupSequence, LookupStats, accepted_length, simulate_lookup
from moaspec.config import GenerationConfig, NgramConfig, TreeConfig
from moaspec.drafters.lookup_gate import LookupGate
from moaspec.drafters.ngram import NgramDrafter
from moaspec.engine import Engine
from moaspec.errors import MoaspecError


def test_accepted_length_walks_the_matching_path() -> None:
    # root -> 5 -> 6 -> 7 ; root -> 5 -> 8 ; root -> 9
    tokens, parents = [0, 5, 6, 7, 8, 9], [-1, 0, 1, 2, 1, 0]
    assert accepted_length(tokens, parents, [5, 8, 1]) == 2
    assert accepted_length(tokens, parents, [5, 6, 7, 3]) == 3
    assert accepted_length(tokens, parents, [4]) == 0
    assert accepted_length(tokens, parents, []) == 0


# a gate that finds many matches too costly (an extra node costs half a step): it opens and closes
HALF_STEP_GATE = tuple(0.5 * (n - 1) if n else 0.0 for n in range(17))


@pytest.mark.parametrize(
    "config, gate_costs",
    [
        (NgramConfig(), None),
        (NgramConfig(max_depth=2, max_branches=1, max_nodes=3), None),
        (NgramConfig(), HALF_STEP_GATE),
    ],
)
def test_lookup_replay_equals_the_engine_with_the_ngram_drafter(config: NgramConfig, gate_costs) -> None:
    """The replay over the target's greedy text counts exactly the engine's cycles, tokens and
    nodes, with or without the gate (which then verifies fewer matches: asserted, so the gated
    case is not the ungated one again).

    A random tiny target falls into loops under greedy decoding, so the lookup matches often
    (asserted, so the comparison is not vacuous)."""
    target = make_tiny_target("llama", max_position_embeddings=512)
    prompts = [[3, 14, 15, 92, 65], [2, 71, 82, 81, 82, 84, 59]]

    def gate() -> LookupGate | None:
        return None if gate_costs is None else LookupGate(gate_costs)

    cycles = tokens = nodes = 0
    sequences = []
    for prompt in prompts:
        engine = Engine(target, NgramDrafter(config, gate()))
        result = engine.generate(prompt, generation=GenerationConfig(max_new_tokens=120))
        sequences.append(LookupSequence(prompt, result.token_ids))
        cycles += result.stats.num_verifications
        tokens += result.stats.new_tokens - 1  # the first token comes from the prefill
        nodes += result.stats.drafted_nodes + result.stats.num_verifications  # roots included
    seen = []
    stats = simulate_lookup(sequences, config, gate(), on_cycle=lambda nodes, emitted: seen.append((nodes, emitted)))
    assert stats.matched_cycles > 10
    assert (stats.cycles, stats.tokens, stats.matched_nodes + stats.unmatched_cycles) == (cycles, tokens, nodes)
    assert (len(seen), sum(e for _, e in seen), sum(n for n, _ in seen)) == (cycles, tokens, nodes)
    if gate_costs is not None:
        assert stats.matched_cycles < simulate_lookup(sequences, config).matched_cycles


def _costs(verify_ms: dict[int, float], level_ms: float = 2.0, accept_ms: float = 1.0) -> CycleCosts:
    propose = {(d, k): d * level_ms / 1000 for d in costs_store.DRAFT_DEPTHS for k in costs_store.DRAFT_TOP_KS}
    return CycleCosts({n: ms / 1000 for n, ms in verify_ms.items()}, propose, (accept_ms / 1000, 0.0))


def test_lookup_prediction_is_tokens_over_seconds() -> None:
    costs = _costs({1: 50, 2: 60, 4: 80, 8: 120})
    stats = LookupStats(matched_cycles=10, matched_tokens=40, matched_nodes=40, unmatched_cycles=60)
    option = lookup_option("row", costs, NgramConfig(), stats, lookup_s=0.0)
    # 10 matched cycles of a 4-node tree (80 ms) + 60 plain steps (50 ms): 100 tokens in 3.8 s
    assert option.tokens_per_s == pytest.approx(100 / 3.8)
    assert option.expected_tau == pytest.approx(100 / 70)


def test_plain_steps_cost_the_steady_step_and_trees_their_penalty() -> None:
    """Where a plain step costs 40 ms and the plain steps after a tree 5 ms more per node beyond
    its root (llama.cpp rebuilding its graph and settling), plain decoding runs at 25 tok/s, and
    the lookup's 10 4-node trees cost 80 + 15 ms each and its 60 plain steps 40 ms: 100 tokens in
    0.95 + 2.4 s. Unmeasured, both are the one-node forward's 50 ms and nothing (3.8 s)."""
    costs = replace(_costs({1: 50, 2: 60, 4: 80, 8: 120}), plain_step_s=0.040, tree_penalty_s=0.005)
    assert plain_option("row", costs).tokens_per_s == pytest.approx(25.0)
    stats = LookupStats(matched_cycles=10, matched_tokens=40, matched_nodes=40, unmatched_cycles=60)
    option = lookup_option("row", costs, NgramConfig(), stats, lookup_s=0.0)
    assert option.tokens_per_s == pytest.approx(100 / (0.95 + 2.4))
    unmeasured = _costs({1: 50, 2: 60, 4: 80, 8: 120})
    assert lookup_option("row", unmeasured, NgramConfig(), stats, 0.0).tokens_per_s == pytest.approx(100 / 3.8)


def test_speculation_must_beat_plain_decoding_by_the_margin() -> None:
    plain = Option("none", "row", 20.0)
    barely = Option("moa+ngram", "row", 20.0 * (MIN_GAIN - 0.01))
    clearly = Option("moa+ngram", "column", 20.0 * (MIN_GAIN + 0.01))
    assert choose([plain, barely]) is plain
    assert choose([plain, barely, clearly]) is clearly
    faster_plain = Option("none", "column", 23.0)
    assert choose([plain, faster_plain, barely]) is faster_plain


def _two_gram_trap_profile() -> list[LookupSequence]:
    """Text whose 2-token matches are mostly wrong and whose longer matches are right: the prompt
    holds a passage and many (a, b, x) triples; the answer copies the passage and, for each
    triple, writes (c, a, b) then x only one time in three (y otherwise), with c never before a."""
    passage = list(range(100, 140))
    prompt, answer = list(passage), [7, *passage]
    for j in range(30):
        a, b, x, c = 200 + 4 * j, 201 + 4 * j, 202 + 4 * j, 203 + 4 * j
        prompt += [a, b, x, 9]
        answer += [c, a, b, x if j % 3 == 0 else 600 + j]
    return [LookupSequence(prompt, answer)]


def _best_lookup(profile: list[LookupSequence], costs: CycleCosts) -> NgramConfig:
    options = [lookup_option("row", costs, c, simulate_lookup(profile, c), 0.0) for c in lookup_configs()]
    return max(options, key=lambda option: option.tokens_per_s).lookup


def test_the_lookup_matches_longer_ngrams_where_verified_nodes_are_costly() -> None:
    """Where an extra node costs most of a step, wrong 2-gram guesses cost more than the right
    ones bring, so the calibration's lookup matches 3+ tokens; where nodes are nearly free, it
    keeps the 2-gram matches for the tokens they add."""
    profile = _two_gram_trap_profile()
    steep = {1: 10.0, 2: 18.4, 3: 24.6, 4: 29.2, 5: 34.1, 6: 36.7, 8: 45.3, 10: 55.3, 12: 64.7, 16: 83.3}
    flat = {n: 10.0 + 0.1 * n for n in steep}
    assert _best_lookup(profile, _costs(steep)).min_ngram >= 3
    assert _best_lookup(profile, _costs(flat)).min_ngram == 2
    assert {c.min_ngram for c in lookup_configs()} == {2, 3, 4}


# -- the whole procedure on a tiny target with a tiny MoA checkpoint -----------------------------
# Costs as measured on the two kinds of CPU (ms per target forward over N nodes): where few-row
# products are cheap (the AMX Xeon) a 3-node tree costs 1.2 plain steps; on the AVX-512 EPYC of
# the hardening issue a MoA cycle cost 1.9 plain steps and the old default ran 0.75x.
CHEAP_TREES = {1: 33.0, 2: 36.0, 3: 40.0, 4: 44.0, 5: 48.0, 6: 52.0, 8: 60.0, 10: 68.0, 12: 75.0, 16: 90.0}
COSTLY_TREES = {1: 55.0, 2: 95.0, 3: 105.0, 4: 160.0, 5: 170.0, 6: 180.0, 8: 220.0, 10: 260.0, 12: 300.0, 16: 380.0}


@pytest.fixture
def tiny_default(tmp_path, monkeypatch):
    """A tiny target whose default drafter is a tiny MoA checkpoint + lookup, a lookup profile of
    its own greedy text, hit rates for the checkpoint, and an injected cost measurement."""
    import moaspec.calibration.profile as profile
    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOASPEC_WEIGHT_LAYOUT", raising=False)
    monkeypatch.setenv("MOASPEC_NO_TUNED", "1")
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    target = make_tiny_target("llama", max_position_embeddings=512, dtype=torch.float32)
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config), target)
    checkpoint = save_checkpoint(tmp_path / "moa-ckpt", "moa", net, target, {"depth": 1, "top_k": 2, "budget": 2})
    (checkpoint / profile.PROFILE_FILE).write_text(
        json.dumps({"hit_rate_by_top_k": [0.6, 0.7, 0.75, 0.8], "weights_sha256": profile.weights_digest(checkpoint)})
    )
    prompt = [3, 14, 15, 92, 65]
    text = Engine(target, NgramDrafter()).generate(prompt, generation=GenerationConfig(max_new_tokens=60)).token_ids
    shipped = tmp_path / "shipped-profile.json"
    shipped.write_text(json.dumps({"lookup_sequences": [{"prompt_ids": prompt, "generated_ids": text}]}))
    monkeypatch.setattr(profile, "shipped_profile_path", lambda name: shipped)
    monkeypatch.setattr(plan, "default_drafter", lambda target_name: f"{checkpoint}+ngram")
    calls = []

    def set_costs(
        verify_ms: dict[int, float], column_factor: float = 1.0, plain_ms: float | None = None, penalty_ms: float = 0.0
    ) -> None:
        """Measured costs: verify_ms per node count, a plain step of plain_ms (None: verify_ms[1])
        and a tree penalty of penalty_ms."""
        plain = verify_ms[1] if plain_ms is None else plain_ms

        def measure_verify_costs(target, layouts, say):
            calls.append("verify")
            say("target verify costs")
            factors = {"row": 1.0, "column": column_factor}
            return {
                layout: VerifyCosts(
                    {n: ms * factors[layout] / 1000 for n, ms in verify_ms.items()},
                    plain * factors[layout] / 1000,
                    penalty_ms * factors[layout] / 1000,
                )
                for layout in layouts
            }

        def measure_drafter_costs(drafter, target, layouts, shapes, say):
            calls.append("drafter")
            return {layout: ({shape: shape[0] * 0.002 for shape in shapes}, (0.001, 0.0002)) for layout in layouts}

        monkeypatch.setattr(costs_store, "measure_verify_costs", measure_verify_costs)
        monkeypatch.setattr(costs_store, "measure_lookup_s", lambda sequences: 1e-4)
        monkeypatch.setattr(costs_store, "measure_drafter_costs", measure_drafter_costs)

    return target, checkpoint, set_costs, calls


def test_default_is_plain_decoding_where_trees_cost_too_much(tiny_default, monkeypatch, capsys) -> None:
    """Regression (hardening issue): the tuned default ran at 0.75x plain decoding on CPUs where
    verifying a few nodes costs nearly as much as several steps. With such costs the calibration
    must not choose a model drafter; where trees are cheap it must."""
    target, checkpoint, set_costs, _ = tiny_default
    set_costs(COSTLY_TREES)
    drafter, costly = plan.calibrated_drafter(target, None)
    assert costly.chosen.drafter in ("none", "ngram")
    assert costly.chosen.tokens_per_s >= costly.plain.tokens_per_s
    assert "calibrating this machine" in capsys.readouterr().err

    monkeypatch.setattr(plan, "cpu_description", lambda: "A CPU with cheap few-row products [amx_tile]")
    set_costs(CHEAP_TREES)
    drafter, cheap = plan.calibrated_drafter(target, None)
    assert cheap.chosen.drafter == f"{checkpoint}+ngram" and cheap.chosen.tree is not None
    assert drafter.lookup is not None and drafter.tree_config == cheap.chosen.tree
    assert drafter.tree_source == "calibrated" and cheap.to_dict()["predicted_speedup"] >= MIN_GAIN


def test_a_model_drafter_built_in_the_background_is_finished_as_the_calibration_chose(tiny_default, monkeypatch) -> None:
    """`generate`'s background build (drafters/background.py) of the calibration's choice: the
    same tree, tree source, layout and lookup as the drafter built at once, and the layers its
    context encoder reads captured before the build."""
    from moaspec.drafters.background import BackgroundDrafter

    target, checkpoint, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES, column_factor=0.8)
    at_once, calibration = plan.calibrated_drafter(target, None)
    monkeypatch.setattr(plan, "in_background", lambda target, base: True)  # qualifies (a tiny target has no shipped one)
    kept = []
    monkeypatch.setattr(target, "keep_layer_kv", lambda layers: kept.append(list(layers)), raising=False)
    background, again = plan.calibrated_drafter(target, None, background=True)
    assert isinstance(background, BackgroundDrafter) and again.chosen == calibration.chosen
    assert (background.tree_config, background.tree_source) == (at_once.tree_config, at_once.tree_source) == (calibration.chosen.tree, "calibrated")
    background._start()
    background._thread.join(60)
    built = background._built
    assert kept[0] == list(built.context_encoder.layers)  # captured first; the build asks for nothing new
    assert (built.tree_config, built.tree_source) == (at_once.tree_config, at_once.tree_source)
    assert built.lookup is not None and built.lookup.config == at_once.lookup.config
    assert built.head.stride(0) == at_once.head.stride(0) == 1  # the column layout, as chosen


def test_cheap_plain_steps_and_the_penalty_after_trees_keep_plain_decoding(tiny_default) -> None:
    """Regression (issue 21, an Intel Xeon): in engine generations llama.cpp's plain steps took
    7.3 ms (it reuses its compute graph between them), one-node forwards timed among trees 9-10
    ms, and the plain steps after a 4-node tree ~6 ms more in all. Priced at one-node forwards
    among trees, the default's lookup was predicted at 1.14x plain decoding and ran at
    0.94-1.02x. With verify costs where the lookup pays at that price, the default speculates;
    with the same costs, plain steps of 7 ms and a penalty of 2 ms per node, it decodes plainly."""
    target, _, set_costs, _ = tiny_default
    lookup_pays = {n: 10.0 + 4 * (n - 1) for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)}
    set_costs(lookup_pays)
    _, dearer = plan.calibrated_drafter(target, None)
    assert dearer.chosen.drafter != "none" and dearer.chosen.tokens_per_s >= MIN_GAIN * dearer.plain.tokens_per_s
    set_costs(lookup_pays, plain_ms=7.0, penalty_ms=2.0)
    plan_cache = costs_store.cache_dir(target.name)
    for path in plan_cache.glob("verify-*.json"):
        path.unlink()  # measured again, as on a new machine
    drafter, steady = plan.calibrated_drafter(target, None)
    assert steady.chosen.drafter == "none" and steady.plain.tokens_per_s == pytest.approx(1000 / 7.0)


def test_layout_follows_the_measured_costs_and_is_applied(tiny_default) -> None:
    target, checkpoint, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES, column_factor=0.8)
    drafter, calibration = plan.calibrated_drafter(target, f"{checkpoint}+ngram")
    assert calibration.chosen.layout == "column" and target.weight_layout == "column"
    assert drafter.head.stride(0) == 1  # the drafter's head followed the target
    assert calibration.requested == f"{checkpoint}+ngram"


def test_costs_are_cached_per_cpu_and_checkpoint(tiny_default, monkeypatch, capsys) -> None:
    target, checkpoint, set_costs, calls = tiny_default
    set_costs(CHEAP_TREES)
    _, first = plan.calibrated_drafter(target, None)
    assert first.source == "measured" and calls == ["verify", "drafter"]
    _, again = plan.calibrated_drafter(target, None)
    assert again.source == "cached" and calls == ["verify", "drafter"]
    assert again.chosen == first.chosen
    capsys.readouterr()
    _, quiet = plan.calibrated_drafter(target, None)
    assert "calibrating" not in capsys.readouterr().err

    monkeypatch.setattr(plan, "cpu_description", lambda: "Another CPU [avx2]")
    _, other_cpu = plan.calibrated_drafter(target, None)
    assert other_cpu.source == "measured" and calls[-2:] == ["verify", "drafter"]

    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # retrained (new mtime): the drafter is measured again
    import os

    os.utime(weights, ns=(1, 1))
    _, retrained = plan.calibrated_drafter(target, None)
    assert calls[-3:] == ["verify", "drafter", "drafter"] and retrained.source == "measured"  # the drafter's alone


def test_cached_costs_that_choose_no_model_drafter_never_read_the_target_for_it(tiny_default, monkeypatch) -> None:
    """Checking that the drafter was made for this target reads the target's embedding (rows of it:
    on llama.cpp from its file in numpy; before session 48 ~40 MB of torch weights): done before a
    measurement, never on a load whose cached costs choose `none` or `ngram`."""
    import moaspec.nn.fingerprint as fingerprint_module

    target, _, set_costs, calls = tiny_default
    fingerprints = []
    fingerprint = fingerprint_module.target_fingerprint
    monkeypatch.setattr(fingerprint_module, "target_fingerprint", lambda t: fingerprints.append(1) or fingerprint(t))
    set_costs(COSTLY_TREES)
    _, first = plan.calibrated_drafter(target, None)
    assert first.source == "measured" and first.chosen.drafter in ("none", "ngram") and fingerprints
    fingerprints.clear()
    _, again = plan.calibrated_drafter(target, None)
    assert again.source == "cached" and again.chosen == first.chosen and calls == ["verify", "drafter"]
    assert fingerprints == []


def test_cached_costs_rank_trees_from_the_cached_rank_model_without_building_any(tiny_default, monkeypatch) -> None:
    """The expected tau of every tree is a function of the rank rates alone: computed once (in
    torch) and read back from disk, so a cached calibration builds no tree (and imports no torch)
    and chooses as the first did; the table equals the taus computed tree by tree."""
    from moaspec.calibration import tree_ranking

    target, _, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES)
    builds = []
    build = tree_ranking.expected_taus_by_budget
    monkeypatch.setattr(tree_ranking, "expected_taus_by_budget", lambda *a: builds.append(a) or build(*a))
    _, first = plan.calibrated_drafter(target, None)
    assert first.source == "measured" and builds
    builds.clear()
    model_build = tree_ranking._model_build
    monkeypatch.setattr(tree_ranking, "_model_build", lambda *a: pytest.fail("a cached calibration built a tree"))
    _, again = plan.calibrated_drafter(target, None)
    assert again.source == "cached" and again.chosen == first.chosen and builds == []
    monkeypatch.setattr(tree_ranking, "_model_build", model_build)
    rates = (0.4, 0.2, 0.1, 0.05)
    table = costs_store.rank_model_taus(rates)
    assert table == tree_ranking.tau_table(rates) == costs_store.rank_model_taus(rates)
    for (depth, top_k, budget), value in table.items():
        assert value == tree_ranking.expected_tau(TreeConfig(depth=depth, top_k=top_k, budget=budget), rates)


def test_a_drafter_for_another_target_is_the_error_alone_with_costs_cached(tiny_default, tmp_path, capsys) -> None:
    """With the target's costs cached (the check then runs inside the measurement's error
    handling), a drafter made for another target is that one error: no "no machine calibration"
    warning before it."""
    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    target, _, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES)
    plan.calibrated_drafter(target, None)  # the target's verify costs, now cached
    other = make_tiny_target("llama", seed=1, max_position_embeddings=512, dtype=torch.float32)
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(other.config), other)
    foreign = save_checkpoint(tmp_path / "foreign", "moa", net, other, {"depth": 1, "top_k": 2, "budget": 2})
    capsys.readouterr()
    with pytest.raises(MoaspecError, match="was trained for target"):
        plan.drafter_for(target, str(foreign))
    assert "warning" not in capsys.readouterr().err


def test_a_damaged_cache_file_is_measured_again(tiny_default) -> None:
    target, _, set_costs, calls = tiny_default
    set_costs(CHEAP_TREES)
    plan.calibrated_drafter(target, None)
    for path in costs_store.cache_dir(target.name).glob("*.json"):
        path.write_text("{not json")
    _, again = plan.calibrated_drafter(target, None)
    assert again.source == "measured" and calls.count("verify") == 2


def test_explicit_choices_are_kept(tiny_default, monkeypatch) -> None:
    target, checkpoint, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES, column_factor=0.5)
    drafter, calibration = plan.calibrated_drafter(target, "none")
    assert calibration.chosen.drafter == "none" and calibration.chosen.layout == "column"
    drafter, calibration = plan.calibrated_drafter(target, str(checkpoint), {"depth": 3, "top_k": 1, "budget": None})
    assert calibration.chosen.drafter == str(checkpoint)
    # the given fields are kept, the budget left open is the calibration's
    assert (drafter.tree_config.depth, drafter.tree_config.top_k) == (3, 1) and drafter.tree_source == "calibrated"
    drafter, _ = plan.calibrated_drafter(target, str(checkpoint), {"depth": 3, "top_k": 1, "budget": 2})
    assert drafter.tree_config == TreeConfig(depth=3, top_k=1, budget=2) and drafter.tree_source == "explicit"
    monkeypatch.setenv("MOASPEC_WEIGHT_LAYOUT", "row")
    _, fixed = plan.calibrated_drafter(target, "ngram")
    assert fixed.chosen.layout == "row" and fixed.chosen.drafter == "ngram" and fixed.chosen.lookup is not None


def test_load_reports_the_calibration_and_can_turn_it_off(tiny_default, monkeypatch) -> None:
    from test_bench import char_tokenizer

    import moaspec.api

    target, _, set_costs, _ = tiny_default
    set_costs(COSTLY_TREES)
    target.tokenizer = char_tokenizer()
    monkeypatch.setattr(moaspec.api, "load_target", lambda *args, **kwargs: target)
    lm = moaspec.api.load("tiny")
    out = lm.generate([3, 14, 15], max_new_tokens=4).to_dict()
    assert out["calibration"]["drafter"] == lm.drafter_name and out["calibration"]["requested"] == "default"
    assert {"layout", "predicted_tokens_per_s", "predicted_speedup", "cpu", "runtime"} <= set(out["calibration"])
    monkeypatch.setenv("MOASPEC_NO_CALIBRATION", "1")
    off = moaspec.api.load("tiny")
    assert off.calibration is None and off.generate([3, 14, 15], max_new_tokens=4).to_dict()["calibration"] is None


def test_real_profiles_are_shipped_for_the_default_target() -> None:
    """The shipped drafters' hit rates belong to the shipped weights (digest checked), and the
    lookup profile holds the target's greedy text."""
    from moaspec.calibration.profile import load_lookup_profile, load_rank_rates
    from moaspec.drafters import SHIPPED, SHIPPED_DIR

    sequences, source = load_lookup_profile("smollm2-135m")
    assert source == "shipped" and sum(len(s.generated_ids) for s in sequences) > 300
    for name in SHIPPED:
        rates, rates_source = load_rank_rates("smollm2-135m", SHIPPED_DIR / "smollm2-135m" / name)
        assert rates_source in ("checkpoint", "tuned") and 0.1 < rates[0] < 0.9, name
    assert Path(SHIPPED_DIR / "smollm2-135m" / "acceptance.json").is_file()


@pytest.mark.slow
def test_real_target_calibrates_once_and_stays_lossless(tmp_path, monkeypatch, capsys) -> None:
    """On the real default target: the first load measures (progress on stderr), the second
    reads the cache, and the calibrated default's greedy tokens equal plain decoding's."""
    from moaspec.api import load

    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    monkeypatch.delenv("MOASPEC_WEIGHT_LAYOUT", raising=False)
    monkeypatch.setattr(costs_store, "cache_dir", lambda name: tmp_path / "calibration" / name)
    first = load()
    assert first.calibration.source == "measured" and "calibrating this machine" in capsys.readouterr().err
    assert first.target.weight_layout == first.calibration.chosen.layout
    second = load()
    assert second.calibration.source == "cached" and second.calibration.chosen == first.calibration.chosen
    prompt = "Repeat the following line twice: the quick brown fox jumps over the lazy dog."
    out = second.generate(prompt, max_new_tokens=32)
    plain = load(drafter="none", calibrate=False).generate(prompt, max_new_tokens=32)
    assert out.token_ids == plain.token_ids
    assert out.to_dict()["calibration"]["drafter"] == second.drafter_name


def test_a_target_too_short_to_time_falls_back_to_the_configured_drafter(tmp_path, monkeypatch, capsys) -> None:
    """A target whose context cannot hold the drafter timing (here 64 positions) still loads:
    one warning line, then the drafter as configured (measured for real: tiny models, no timing
    decides the assertion)."""
    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    target = make_tiny_target("llama", max_position_embeddings=64, dtype=torch.float32)
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config), target)
    checkpoint = save_checkpoint(tmp_path / "moa-ckpt", "moa", net, target, {"depth": 1, "top_k": 2, "budget": 2})
    drafter, calibration = plan.drafter_for(target, f"{checkpoint}+ngram")
    assert calibration is None and drafter.lookup is not None and target.weight_layout == "row"
    assert "warning: no machine calibration" in capsys.readouterr().err


def test_bench_methods_get_the_drafter_generate_would_make_on_one_layout(tiny_default) -> None:
    """Bug: `bench --methods moa` ran the checkpoint's tree while `generate --drafter moa` ran the
    calibration's. A bench method's drafter is now calibrated as generate's is, on the weight
    layout the run already uses (the calibration would pick column here)."""
    from moaspec.bench.methods import build_method, parse_methods

    target, checkpoint, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES, column_factor=0.5)
    target.use_layout("row")
    spec = parse_methods(str(checkpoint))[-1]  # after the `none` it adds
    method = build_method(spec, target)
    _, alone = plan.calibrated_drafter(make_tiny_target("llama", max_position_embeddings=512, dtype=torch.float32), str(checkpoint))
    assert method.engine.drafter.tree_source == "calibrated" and target.weight_layout == "row"
    assert alone.chosen.layout == "column"


def test_reference_tree_methods_look_up_with_the_reference_lookup_not_the_calibrations(
    tiny_default, monkeypatch
) -> None:
    """Bug: `moa+ngram@ref` took the machine calibration's prompt lookup (2 deep on the AVX-512
    EPYC), so its τ changed with the CPU it ran on: the fixed lookup is now part of the reference."""
    from moaspec.bench.methods import REFERENCE_LOOKUP, build_method, parse_methods
    from moaspec.config import NgramConfig

    target, checkpoint, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES)
    calibrated = NgramConfig(max_depth=2, max_branches=1)
    real_drafter_for = plan.drafter_for

    def with_calibrated_lookup(*args, **kwargs):
        drafter, calibration = real_drafter_for(*args, **kwargs)
        drafter.enable_lookup(calibrated)
        return drafter, calibration

    monkeypatch.setattr(plan, "drafter_for", with_calibrated_lookup)
    own, reference = parse_methods(f"own={checkpoint}+ngram,ref={checkpoint}+ngram@ref")[1:]
    assert build_method(own, target).engine.drafter.lookup.config == calibrated
    assert build_method(reference, target).engine.drafter.lookup.config == REFERENCE_LOOKUP == NgramConfig()


def test_tree_fields_left_open_are_the_calibrations_to_choose(tiny_default) -> None:
    """`--tree-depth 3` alone: the depth is 3 and the top-k and budget are the calibration's best
    for depth 3 (they came from the checkpoint, 1 and 2, whatever the costs said)."""
    target, checkpoint, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES)
    drafter, calibration = plan.calibrated_drafter(target, str(checkpoint), {"depth": 3, "top_k": None, "budget": None})
    assert drafter.tree_config.depth == 3 and drafter.tree_source == "calibrated"
    assert drafter.tree_config == calibration.chosen.tree
    assert (drafter.tree_config.top_k, drafter.tree_config.budget) != (2, 2)  # not the checkpoint's


def test_verify_costs_are_measured_on_the_trees_the_target_takes_up_to_its_largest(monkeypatch) -> None:
    """A target verifying chains of at most 7 nodes (SmolLM2 as Q6_K on llama.cpp, AVX-512 EPYC):
    its verify costs are measured on chains, for every listed size up to 7 and for 7 itself (not
    in the list: the longest chain it takes was never a candidate, having no measured cost)."""
    from moaspec.calibration.costs import measure_verify
    from moaspec.calibration.costs_store import VERIFY_NODE_COUNTS
    from moaspec.targets.hf import HFTarget

    target = make_tiny_target("llama")
    target.max_tree_nodes, target.max_tree_leaves = 7, 1
    shapes = []
    verify = HFTarget.verify

    def recording(self, tree, hidden_layers=()):
        shapes.append(tree.parents.tolist())
        return verify(self, tree, hidden_layers)

    monkeypatch.setattr(HFTarget, "verify", recording)
    assert 7 not in VERIFY_NODE_COUNTS
    costs = measure_verify(target, 16, 1, VERIFY_NODE_COUNTS)
    assert sorted(costs.verify_s) == [1, 2, 3, 4, 5, 6, 7]
    assert all(parents == list(range(-1, len(parents) - 1)) for parents in shapes)  # chains only
    target.max_tree_nodes, target.max_tree_leaves = None, None
    assert sorted(measure_verify(target, 16, 1, VERIFY_NODE_COUNTS).verify_s) == list(VERIFY_NODE_COUNTS)


def test_plain_steps_trees_and_the_penalty_after_trees_are_timed_apart(monkeypatch) -> None:
    """A target whose forward costs a second per node, half a second more when the batch has
    another size than the one before (llama.cpp rebuilding its compute graph), and a quarter of a
    second per node of the last tree more on the second plain step after it (settling): the
    plain step is measured at 1.0 s, a tree of n nodes at n + 0.5 s (1.5 s for the one-node
    forward after a tree) and the penalty at (0.5 + 0.25 n) / (n - 1) per node beyond the root,
    whose median over the trees timed (2, 4, 8 nodes: 1.0, 0.5, 0.36) is 0.5 s. Timed among
    trees, as before, plain decoding would have been priced at 1.5 s and the settling missed."""
    import moaspec.calibration.costs as costs_module
    from moaspec.calibration.costs import measure_verify
    from moaspec.targets.hf import HFTarget

    clock = {"now": 0.0, "last": 0, "streak": 0, "tree": 1}
    verify = HFTarget.verify

    def priced(self, tree, hidden_layers=()):
        nodes = tree.num_nodes
        clock["streak"] = clock["streak"] + 1 if nodes == clock["last"] else 0
        settling = 0.25 * clock["tree"] if nodes == 1 and clock["streak"] == 1 and clock["tree"] > 1 else 0.0
        clock["now"] += nodes + (0.5 if clock["streak"] == 0 else settling)
        clock["last"] = nodes
        if nodes > 1:
            clock["tree"] = nodes
        return verify(self, tree, hidden_layers)

    monkeypatch.setattr(HFTarget, "verify", priced)
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock["now"])
    target = make_tiny_target("llama")
    target.reuses_graphs = True  # as llama.cpp
    measured = measure_verify(target, 16, 3, (1, 2, 4, 8))
    assert measured.plain_step_s == pytest.approx(1.0)
    assert measured.verify_s == pytest.approx({1: 1.5, 2: 2.5, 4: 4.5, 8: 8.5})
    assert measured.tree_penalty_s == pytest.approx(0.5)
    target.reuses_graphs = False  # a runtime without the effect: neither timed apart
    unreused = measure_verify(target, 16, 3, (1, 2, 4, 8))
    assert (unreused.plain_step_s, unreused.tree_penalty_s) == (unreused.verify_s[1], 0.0)


X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_vnni avx512_bf16
processor\t: 1
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma f16c avx512f avx512_vnni avx512_bf16
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes asimdhp cpuid asimddp sve i8mm bf16
CPU implementer\t: {implementer}
CPU architecture: 8
CPU part\t: {part}
"""


def test_the_cpu_is_told_apart_by_its_kernel_flags_on_x86_and_arm() -> None:
    """Bug: an ARM CPU was named by `platform.processor()` alone ('aarch64' or nothing) with no
    flags, so every ARM machine shared one calibration and one llama.cpp exact tree size,
    whatever its dot-product, int8-matrix or SVE kernels."""
    from moaspec.calibration.machine import cpu_description

    assert cpu_description(X86_CPUINFO) == "AMD EPYC 9R14 [avx2 avx512f avx512_bf16 avx512_vnni fma f16c]"
    graviton3 = cpu_description(ARM_CPUINFO.format(implementer="0x41", part="0xd40"))
    assert graviton3 == "ARM 0x41 part 0xd40 [asimddp asimdhp i8mm sve bf16]"
    assert cpu_description(ARM_CPUINFO.format(implementer="0x41", part="0xd0c")) != graviton3
    without_i8mm = ARM_CPUINFO.format(implementer="0x41", part="0xd40").replace(" i8mm", "")
    assert cpu_description(without_i8mm) == "ARM 0x41 part 0xd40 [asimddp asimdhp sve bf16]"


def test_progress_lines_count_seconds_from_the_calibrations_start(monkeypatch, capsys) -> None:
    """An audit's: `done in 31 s ... [28 s]`: the last line's two clocks disagreed (one from the
    first line, one from the measurement's start). One clock now, from the start."""
    clock = {"now": 100.0}
    monkeypatch.setattr(plan.time, "perf_counter", lambda: clock["now"])
    say = plan._progress(True)
    clock["now"] = 103.0
    say("target verify costs")
    clock["now"] = 131.0
    say("done: drafter none")
    assert capsys.readouterr().err.splitlines() == [
        "moaspec: calibrating this machine (once): target verify costs [3 s]",
        "moaspec: calibrating this machine (once): done: drafter none [31 s]",
    ]
    plan._progress(False)("quiet")
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("calibrate", [True, False])
def test_tree_settings_without_a_drafter_on_a_target_without_a_shipped_model_drafter(calibrate: bool, monkeypatch) -> None:
    """An audit's: tree settings alone (the default model drafter's form) on a target whose default
    is model-free were refused as settings 'not for ngram', a drafter the user never named."""
    from moaspec.api import speculative_lm

    target = make_tiny_target("llama")
    monkeypatch.setenv(plan.DISABLE_ENV, "0" if calibrate else "1")
    for use_calibration in (calibrate, True):  # load(calibrate=False), and the calibration switched off or on
        with pytest.raises(MoaspecError, match=f"target '{target.name}' has no shipped one: name a checkpoint as the drafter"):
            speculative_lm(target, None, {"depth": 2, "top_k": None, "budget": None}, use_calibration)
    with pytest.raises(MoaspecError, match="has no shipped one"):
        plan.drafter_for(target, None, {"depth": 2})
