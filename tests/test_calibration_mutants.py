"""The calibration pinned where a hand-mutation audit of moaspec/calibration/ found it free to change
unseen: the choice against the fastest plain decoding, the predictions' node and token counts, the
limits of trees on targets that verify short chains only, and the cache keys and checks that
decide whether measured costs are reused. Costs are injected; nothing depends on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_calibration import CHEAP_TREES, tiny_default  # noqa: F401  (tiny_default is a fixture)

import moaspec.calibration.plan as plan
from moaspec.calibration import costs_store
from moaspec.calibration.costs import CycleCosts, VerifyCosts
from moaspec.calibration.predict import Option, choose, lookup_first_option, lookup_option, model_option
from moaspec.calibration.profile import LookupStats
from moaspec.calibration.tree_ranking import Candidate
from moaspec.config import NgramConfig, TreeConfig
from moaspec.drafters.lookup_gate import LookupGate

VERIFY_S = {1: 0.050, 2: 0.060, 4: 0.080, 8: 0.120}
# 10 matched cycles of 6-node tries (60 nodes) emitting 20 tokens, and 60 plain steps: the
# matched tokens and nodes differ, so a formula that takes one for the other is seen
SPARSE_MATCHES = LookupStats(matched_cycles=10, matched_tokens=20, matched_nodes=60, unmatched_cycles=60)


def test_speculation_must_beat_the_fastest_layouts_plain_decoding_by_the_margin() -> None:
    """Mutant: choose() weighed the best speculative option against the slowest `none` (row-major
    plain decoding at 20 tok/s) instead of the fastest (column-major, 23): a lookup at 23.5 tok/s,
    2 % above the plain decoding it would replace, was chosen as 17.5 % faster."""
    slow_plain, fast_plain = Option("none", "row", 20.0), Option("none", "column", 23.0)
    within_margin = Option("ngram", "column", 23.5)
    assert choose([slow_plain, fast_plain, within_margin]) is fast_plain
    assert choose([fast_plain, within_margin, slow_plain]) is fast_plain
    beyond = Option("ngram", "column", 23.0 * 1.06)
    assert choose([slow_plain, fast_plain, beyond]) is beyond


def test_the_lookup_prediction_verifies_the_tries_nodes_not_its_tokens() -> None:
    """Mutant: the lookup's matched cycles were priced at a tree of (matched tokens / matched
    cycles) nodes, 2, instead of the 6 nodes verified: 10 x 100 ms + 60 x 50 ms for 80 tokens
    is 20 tok/s, not 22.2."""
    option = lookup_option("row", CycleCosts(VERIFY_S, {}, (0.0, 0.0)), NgramConfig(), SPARSE_MATCHES, lookup_s=0.0)
    assert option.tokens_per_s == pytest.approx(80 / (10 * 0.100 + 60 * 0.050))
    assert option.expected_tau == pytest.approx(80 / 70)


def test_the_lookup_first_prediction_accepts_the_tokens_emitted_not_the_nodes() -> None:
    """Mutant: `X+ngram`'s matched cycles paid the drafter's per-token accept for their 60 nodes
    instead of the 20 tokens they emitted (the drafter takes in verified tokens only)."""
    costs = CycleCosts(VERIFY_S, {}, (0.001, 0.0005))
    candidate = Candidate(TreeConfig(depth=2, top_k=1, budget=2), num_nodes=3, expected_tau=2.0, cycle_s=0.070)
    option = lookup_first_option("moa", "row", costs, candidate, NgramConfig(), SPARSE_MATCHES, lookup_s=0.0)
    seconds = 10 * (0.100 + 0.001) + 0.0005 * 20 + (60 / 2.0) * 0.070
    assert option.tokens_per_s == pytest.approx(80 / seconds, rel=1e-9)


def test_a_model_cycle_pays_propose_tree_and_the_accept_of_tau_tokens() -> None:
    """Mutants: a model drafter's cycle left out the accept's per-token seconds (or took them per
    tree node, or priced the tree at its verify alone without the penalty after it): a 3-node
    chain, 2.5 tokens expected, costs 4 ms propose + 70 + 2 x 5 ms tree + 1 + 2.5 x 0.5 ms accept."""
    costs = CycleCosts(VERIFY_S, {(2, 1): 0.004}, (0.001, 0.0005), plain_step_s=0.040, tree_penalty_s=0.005)
    cycle = costs.cycle_s(TreeConfig(depth=2, top_k=1, budget=2), 3, 2.5)
    assert cycle == pytest.approx(0.004 + (0.070 + 2 * 0.005) + 0.001 + 2.5 * 0.0005, rel=1e-12)


def test_cycle_costs_carry_the_plain_step_and_the_penalty() -> None:
    """Mutants: costs_store.cycle_costs dropped the measured plain step (pricing plain decoding at
    a one-node forward among trees) or the tree penalty."""
    verify = VerifyCosts({1: 0.009, 2: 0.012}, 0.007, 0.002)
    costs = costs_store.cycle_costs(verify, ({(1, 1): 0.003}, (0.001, 0.0002)))
    assert (costs.plain_step(), costs.tree_s(2)) == (0.007, pytest.approx(0.014))
    assert (costs.propose_s, costs.accept_s) == ({(1, 1): 0.003}, (0.001, 0.0002))


def test_a_model_drafter_alone_reports_its_trees_expected_tau() -> None:
    """Mutant: `X` alone reported τ 1.0 (the field's default) instead of its tree's 2.5; the
    busy-machine note (busy_machine.py) derives the predicted cycle from it (τ / tokens/s)."""
    candidate = Candidate(TreeConfig(depth=3, top_k=1, budget=3), num_nodes=4, expected_tau=2.5, cycle_s=0.050)
    option = model_option("moa", "column", candidate)
    assert (option.tokens_per_s, option.expected_tau, option.tree) == (pytest.approx(50.0), 2.5, candidate.tree)
    assert option.to_dict()["expected_tau"] == 2.5


def test_the_reported_speedup_is_over_the_fastest_plain_decoding() -> None:
    """Mutant: the record's `plain` (predicted_speedup's base, the summary's `predicted 1.10x`)
    was the slowest `none` option of the layouts, so plain decoding at 20 and 23 tok/s and a
    lookup at 25.3 reported 1.265x where 1.1x is what the choice rests on. Another: the chosen
    option was listed among its own runners-up."""
    options = [Option("none", "row", 20.0), Option("none", "column", 23.0), Option("ngram", "column", 25.3)]
    chosen = choose(options)
    record = plan._calibration("default", chosen, options, "cpu", "runtime", None, "shipped", None, None)
    assert record.plain is options[1] and record.to_dict()["predicted_speedup"] == pytest.approx(1.1)
    assert "predicted 1.10x plain decoding" in plan._summary(chosen, record.plain, "transformers")
    assert record.runners_up == [options[1], options[0]]  # every other form and layout, the chosen left out


def test_a_target_that_verifies_short_chains_gets_no_larger_tree_and_no_branching_lookup() -> None:
    """Mutants: TreeLimit let a model drafter's tree of one node more than the target verifies
    exactly through, and ignored `chains_only` for the lookup tries: a target exact for chains
    of up to 7 nodes (SmolLM2 Q6_K on the AVX-512 EPYC) was offered 3-branch tries of 4 and 7
    nodes, which its batched kernels do not verify bit for bit."""
    chains = plan.TreeLimit.of(SimpleNamespace(max_tree_nodes=7, max_tree_leaves=1))
    assert chains == plan.TreeLimit(7, True)
    assert chains.takes(TreeConfig(depth=6, top_k=1, budget=6), 7)
    assert not chains.takes(TreeConfig(depth=7, top_k=1, budget=7), 8)
    assert not chains.takes(TreeConfig(depth=2, top_k=2, budget=3), 4)
    lookups = chains.lookups()
    assert lookups and all(c.max_branches == 1 and c.max_nodes <= 7 for c in lookups)
    trees = plan.TreeLimit.of(SimpleNamespace(max_tree_nodes=7, max_tree_leaves=None))
    assert any(c.max_branches == 3 for c in trees.lookups()) and trees.takes(TreeConfig(depth=2, top_k=2, budget=3), 4)
    assert not trees.takes(TreeConfig(depth=4, top_k=2, budget=8), 9)


# -- what decides whether cached costs are reused --------------------------------------------------
def _fake_verify_measurement(monkeypatch) -> list:
    """costs_store.measure_verify_costs replaced: verify costs up to the target's exact tree size
    (or 16 nodes); -> the list of targets measured, one entry per measurement."""
    measured = []

    def measure_verify_costs(target, layouts, say):
        measured.append(getattr(target, "exact_tree_nodes", None))
        largest = getattr(target, "exact_tree_nodes", None) or 16
        return {layout: VerifyCosts({n: 0.01 * n for n in range(1, largest + 1)}, 0.007, 0.002) for layout in layouts}

    monkeypatch.setattr(costs_store, "measure_verify_costs", measure_verify_costs)
    monkeypatch.setattr(costs_store, "measure_lookup_s", lambda sequences: 0.0)
    return measured


def _verify_costs(target, runtime: str = "llama.cpp runtime, 2 threads"):
    """plan._costs without a model drafter: -> (verify costs per layout, measured now?)."""
    verify, _, _, measured = plan._costs(target, None, ("row",), [], "A CPU [avx2]", runtime, lambda what: None)
    return verify, measured


def test_llama_cpp_costs_measured_within_another_exact_tree_size_are_measured_again(tmp_path, monkeypatch) -> None:
    """Mutant: the llama.cpp verify record was reused whatever exact tree size it was measured
    within: costs timed up to 3-node trees (none larger) were kept after the size measured here
    became 7, so trees of 4-7 nodes were priced by extrapolation and never measured."""
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(plan, "target_identity", lambda target: target.name)  # no GGUF file to key
    measured = _fake_verify_measurement(monkeypatch)
    target = SimpleNamespace(runtime="llama.cpp", name="tiny.gguf", exact_tree_nodes=3)
    assert _verify_costs(target)[1] and not _verify_costs(target)[1]
    target.exact_tree_nodes = 7
    verify, again = _verify_costs(target)
    assert again and max(verify["row"].verify_s) == 7 and measured == [3, 7]
    assert not _verify_costs(target)[1]


def test_verify_costs_are_keyed_by_the_runtime(tmp_path, monkeypatch) -> None:
    """Mutant: the verify record's key left the runtime out (versions, dtype, attention, thread
    count): costs measured with 2 threads were reused with 1, where each forward costs about
    twice as much and the choice rests on the wrong prices."""
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))
    measured = _fake_verify_measurement(monkeypatch)
    target = SimpleNamespace(runtime="transformers", name="tiny")
    assert _verify_costs(target, "transformers 4 torch 2 float32 sdpa 2 threads")[1]
    assert not _verify_costs(target, "transformers 4 torch 2 float32 sdpa 2 threads")[1]
    assert _verify_costs(target, "transformers 4 torch 2 float32 sdpa 1 threads")[1] and len(measured) == 2


def test_a_retrained_checkpoints_drafter_costs_are_measured_again(tiny_default) -> None:  # noqa: F811
    """Mutant: the drafter record's key left the checkpoint out, so a retrained drafter (new
    weights, new mtime) kept the old one's propose and accept seconds. (The existing cache test
    checked `calls[-1] == "drafter"` after a measurement that already ended with one.)"""
    import os

    target, checkpoint, set_costs, calls = tiny_default
    set_costs(CHEAP_TREES)
    plan.calibrated_drafter(target, None)
    assert calls == ["verify", "drafter"]
    os.utime(checkpoint / "model.safetensors", ns=(1, 1))  # retrained
    _, retrained = plan.calibrated_drafter(target, None)
    assert calls == ["verify", "drafter", "drafter"] and retrained.source == "measured"


def test_cached_drafter_costs_without_the_trees_shape_are_measured_again(tiny_default) -> None:  # noqa: F811
    """Mutant: cached drafter costs were reused though they lack the shape of the tree named now
    (depth 7: the sweep times depths 1-6), and pricing that tree failed on the missing shape."""
    target, checkpoint, set_costs, calls = tiny_default
    set_costs(CHEAP_TREES)
    plan.calibrated_drafter(target, str(checkpoint))
    deep = {"depth": 7, "top_k": 1, "budget": 7}
    drafter, calibration = plan.calibrated_drafter(target, str(checkpoint), deep)
    assert calls == ["verify", "drafter", "drafter"]
    assert drafter.tree_config == calibration.chosen.tree == TreeConfig(**deep)


def test_a_model_drafter_named_alone_gets_no_prompt_lookup(tiny_default) -> None:  # noqa: F811
    """Mutant: the drafter the calibration built for `--drafter DIR` (no `+ngram`) had the prompt
    lookup switched on: it ran another form than the one named and predicted."""
    target, checkpoint, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES)
    drafter, calibration = plan.calibrated_drafter(target, str(checkpoint))
    assert calibration.chosen.drafter == str(checkpoint) and calibration.chosen.lookup is None
    assert drafter.lookup is None


def test_the_ngram_gate_prices_the_chosen_layouts_plain_steps_and_penalty(
    tiny_default, monkeypatch  # noqa: F811
) -> None:
    """Mutants: the `ngram` form's gate was built from the verify costs alone (a trie's extra
    cost over a one-node forward among trees, not over the steady plain step, and without the
    penalty on the plain steps after it), or from the row-major layout's costs whatever layout
    was chosen. Column-major here: 3.5 ms plain steps, 5 + 4 (n - 1) ms a tree, 1 ms a node
    after it."""
    target, _, set_costs, _ = tiny_default
    set_costs(CHEAP_TREES)
    shapes = {
        "row": VerifyCosts({n: (10.0 + 4 * (n - 1)) / 1000 for n in CHEAP_TREES}, 0.010, 0.0),
        "column": VerifyCosts({n: (5.0 + 4 * (n - 1)) / 1000 for n in CHEAP_TREES}, 0.0035, 0.001),
    }
    monkeypatch.setattr(
        costs_store, "measure_verify_costs", lambda target, layouts, say: {layout: shapes[layout] for layout in layouts}
    )
    drafter, calibration = plan.calibrated_drafter(target, "ngram")
    assert calibration.chosen.layout == "column" and calibration.chosen.drafter == "ngram"
    column = costs_store.cycle_costs(shapes["column"], None)
    expected = LookupGate.from_cycle_costs(column.tree_s, 16).extra_cost
    assert expected[4] == pytest.approx((5 + 12 + 3) / 3.5 - 1)
    assert drafter.gate.extra_cost == pytest.approx(expected)


def test_the_calibrations_trees_rest_on_measured_verify_costs_only(tmp_path, monkeypatch) -> None:
    """Mutant: the calibration's tree candidates were not cut at the largest tree measured, so a
    tree of 9-16 nodes was chosen on verify costs extrapolated from 4 and 8 nodes (`moaspec
    tune` ranks up to twice the largest; the calibration promises no extrapolation)."""
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))
    propose = {(depth, top_k): 1e-4 for depth in range(1, 7) for top_k in range(1, 5)}
    costs = CycleCosts({1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104}, propose, (0.0, 0.0))
    tree = TreeConfig(depth=1, top_k=2, budget=2)
    model = SimpleNamespace(tree_config=tree, tree_source="checkpoint", fixed_fields={})
    found = plan._tree_candidates(model, costs, (0.6, 0.1, 0.05, 0.05), plan.TreeLimit())
    assert found and max(c.num_nodes for c in found) <= 8


def test_cached_verify_costs_read_back_as_measured(tmp_path, monkeypatch) -> None:
    """Mutant: the verify record saved a one-node forward among trees as the plain step, so a
    cached calibration priced plain decoding at 10 ms where the first had measured 7 ms (and
    could choose another form than the measuring run)."""
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))
    _fake_verify_measurement(monkeypatch)
    target = SimpleNamespace(runtime="transformers", name="tiny")
    (measured, fresh), (cached, again) = _verify_costs(target), _verify_costs(target)
    assert fresh and not again and cached == measured
    assert (cached["row"].plain_step_s, cached["row"].tree_penalty_s) == (0.007, 0.002)


def test_the_lookup_replay_cache_tells_gates_apart(tmp_path, monkeypatch) -> None:
    """Mutant: the replay cache's key held the gate's decay but not its costs, so the replay with
    one layout's gate (or an earlier machine's) was read back for another gate's."""
    from moaspec.calibration.profile import LookupSequence

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))
    replays = []

    def simulate(sequences, config, gate):
        replays.append(gate)
        return LookupStats(int(10 * gate.extra_cost[2]), 0, 0, 1)

    sequences, configs = [LookupSequence([1, 2, 3], [4, 5, 6])], [NgramConfig()]
    cheap, dear = LookupGate((0.0, 0.0, 0.2)), LookupGate((0.0, 0.0, 0.9))
    assert costs_store.simulated_lookups("tiny", sequences, configs, simulate, cheap)[0][1].matched_cycles == 2
    assert costs_store.simulated_lookups("tiny", sequences, configs, simulate, dear)[0][1].matched_cycles == 9
    assert costs_store.simulated_lookups("tiny", sequences, configs, simulate, cheap)[0][1].matched_cycles == 2
    assert replays == [cheap, dear]


# -- where the acceptance comes from, and what names the machine ----------------------------------
def _checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text('{"method": "moa"}')
    (directory / "model.safetensors").write_bytes(b"weights")
    return directory


def test_hit_rates_of_other_weights_and_tunes_without_a_calibration_are_not_used(tmp_path, monkeypatch) -> None:
    """Mutants: a checkpoint's acceptance.json was read whatever weights it measured (a
    retrained drafter kept its predecessor's hit rates); `moaspec tune`'s rank rates were used as
    measured though they were given (--top1-rate) or its default; the prior's top-1 was not the
    documented 0.3."""
    import json

    from moaspec.calibration.profile import PROFILE_FILE, load_rank_rates, weights_digest
    from moaspec.calibration.tree_ranking import geometric_rates, rates_from_hit_rates
    from moaspec.tuned import save_tuned_tree

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    directory = _checkpoint(tmp_path)
    hits = [0.6, 0.7, 0.75, 0.8]
    (directory / PROFILE_FILE).write_text(json.dumps({"hit_rate_by_top_k": hits, "weights_sha256": "0" * 16}))
    assert load_rank_rates("tiny", directory) == (geometric_rates(0.3), "prior")
    assert geometric_rates(0.3)[0] == pytest.approx(0.3)
    matching = {"hit_rate_by_top_k": hits, "weights_sha256": weights_digest(directory)}
    (directory / PROFILE_FILE).write_text(json.dumps(matching))
    assert load_rank_rates("tiny", directory) == (rates_from_hit_rates(hits), "checkpoint")
    tuned_rates = [0.5, 0.1, 0.05, 0.02]
    save_tuned_tree("tiny", directory, TreeConfig(), {"rates_source": "given", "rank_rates": tuned_rates})
    assert load_rank_rates("tiny", directory)[1] == "checkpoint"
    save_tuned_tree("tiny", directory, TreeConfig(), {"rates_source": "calibrated", "rank_rates": tuned_rates})
    assert load_rank_rates("tiny", directory) == ((0.5, 0.1, 0.05, 0.02), "tuned")


def test_the_runtime_names_its_threads_and_device(monkeypatch) -> None:
    """Mutants: the runtime description (part of every cost record's key) left out torch's or
    llama.cpp's thread count, the GPU the transformers runtime runs on, or whether llama.cpp's
    weights are repacked: costs measured with 2 threads were reused with 1, a GPU's with a CPU's."""
    import sys

    import torch

    from moaspec.calibration.machine import runtime_description

    def transformers_on(device: str):
        return SimpleNamespace(runtime="transformers", weights_dtype=torch.float32, device=torch.device(device),
                               config=SimpleNamespace(_attn_implementation="sdpa"))

    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    cpu = runtime_description(transformers_on("cpu"))
    assert cpu.endswith(" float32 sdpa 3 threads")
    assert runtime_description(transformers_on("cuda")) == cpu + " on NVIDIA H200"
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert runtime_description(transformers_on("cpu")) != cpu
    features = {"info": b"CPU : AVX2 = 1 | REPACK = 1 | "}
    monkeypatch.setitem(sys.modules, "llama_cpp", SimpleNamespace(
        __version__="0.3.0", llama_print_system_info=lambda: features["info"]))

    def llama(threads: int):
        return runtime_description(SimpleNamespace(runtime="llama.cpp", value_cache_name="f16", threads=threads))

    assert llama(2).endswith(" 2 threads") and llama(2) != llama(1)
    plain = llama(2)  # a build with AMX kernels loads its weights unrepacked: other costs
    features["info"] = b"CPU : AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1 | "
    assert llama(2) != plain and "unrepacked weights" in llama(2)


def test_each_kernel_flag_tells_cpus_apart() -> None:
    """Mutant: a kernel flag (amx_tile) left out of the CPU description: a KVM guest showing a
    generic model name shared one calibration with and without AMX, whose few-row products
    decide which trees pay."""
    from moaspec.calibration.machine import cpu_description

    flags = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "fma", "f16c",
             "asimddp", "asimdhp", "i8mm", "sve", "sve2", "bf16")
    base = cpu_description("model name\t: AMD EPYC\nflags\t\t: fpu sse2\n")
    assert base == "AMD EPYC"
    for flag in flags:
        assert cpu_description(f"model name\t: AMD EPYC\nflags\t\t: fpu sse2 {flag}\n") == f"AMD EPYC [{flag}]", flag
