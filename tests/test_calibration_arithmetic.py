"""The calibration's arithmetic pinned where a mutation audit found it free to change: verify-cost
extrapolation, the penalty and irregularity rules, the interleaved timing's warm-up and rotation,
the accept fit, the room checks of `measure_verify`, and the predictions' lookup and accept
seconds. Every timing comes from a fake clock, so nothing depends on the CPU that runs them."""

from __future__ import annotations

import pytest
import torch
from conftest import make_random_drafter_net, make_tiny_target

import moaspec.calibration.costs as costs_module
from moaspec.calibration.costs import (
    SETTLED_STEPS,
    CycleCosts,
    VerifyCosts,
    measure_drafter,
    measure_verify,
    penalty_per_node,
)
from moaspec.calibration.predict import (
    LOOKUP_MAX_NODES,
    MIN_GAIN,
    Option,
    choose,
    lookup_configs,
    lookup_first_option,
    lookup_option,
)
from moaspec.calibration.profile import LookupStats
from moaspec.calibration.tree_ranking import Candidate
from moaspec.config import NgramConfig, TreeConfig


def verify_only(verify_s: dict[int, float], accept_s: tuple[float, float] = (0.0, 0.0)) -> CycleCosts:
    return CycleCosts(verify_s, {}, accept_s)


def test_verify_costs_extrapolate_from_the_nearest_two_sizes_and_never_below_zero() -> None:
    costs = verify_only({1: 1.0, 2: 1.5, 4: 2.0})
    assert costs.verify(3) == pytest.approx(1.75)
    assert costs.verify(8) == pytest.approx(3.0)  # 4 more nodes at the 2-4 slope, 0.25 s a node
    assert costs.verify(0) == pytest.approx(0.5)  # the 1-2 slope below
    assert verify_only({1: 1.0, 2: 3.0}).verify(0) == 0.0
    assert verify_only({1: 1.0, 2: 0.5}).verify(5) == 0.0


def test_the_penalty_per_node_is_the_median_ratio_and_never_negative() -> None:
    assert penalty_per_node([(2, 1.0), (4, 1.5), (8, 3.5)]) == pytest.approx(0.5)
    assert penalty_per_node([(2, -1.0)]) == 0.0
    assert penalty_per_node([]) == 0.0


def test_a_tree_is_irregular_only_beyond_three_times_a_larger_ones_time() -> None:
    assert VerifyCosts({1: 0.020, 2: 0.010}, 0.010, 0.0).irregularity() is None  # 2x: few-row products may do that
    assert "1 nodes took 40.0 ms, 2 nodes 10.0 ms" in VerifyCosts({1: 0.040, 2: 0.010}, 0.010, 0.0).irregularity()


def test_the_accept_fit_splits_fixed_and_per_token_seconds(monkeypatch) -> None:
    """A drafter whose accept of n tokens takes 3 + 0.5 n seconds on the fake clock: fixed 3 s,
    0.5 s a token (from n = 1 and n = 4)."""
    from moaspec.drafters.moa import MoADrafter
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    target = make_tiny_target("llama", max_position_embeddings=1024, dtype=torch.float32)
    drafter = MoADrafter(make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config), target), target)
    clock = {"now": 0.0}
    accept = drafter.accept

    def timed_accept(update) -> None:
        clock["now"] += 3.0 + 0.5 * len(update.token_ids)
        accept(update)

    monkeypatch.setattr(drafter, "accept", timed_accept)
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock["now"])
    _, accept_s = measure_drafter(drafter, target, context_len=40, repeats=2, shapes=[(1, 2)])
    assert accept_s == pytest.approx((3.0, 0.5))


def test_measure_verify_keeps_every_timed_forward_inside_the_context(monkeypatch) -> None:
    """Trees are timed from the same context each time (rolled back after each), a target that
    reuses graphs refuses a context leaving no room for its timed plain steps, and sizes whose
    forward after another would pass the context's end are left out."""
    from moaspec.targets.hf import HFTarget

    verify = HFTarget.verify
    seen: dict[int, set[int]] = {}

    def recording(self, tree, hidden_layers=()):
        seen.setdefault(tree.num_nodes, set()).add(self.num_cached)
        return verify(self, tree, hidden_layers)

    monkeypatch.setattr(HFTarget, "verify", recording)
    target = make_tiny_target("llama", max_position_embeddings=256)
    target.reuses_graphs = True
    measure_verify(target, 16, 2, (1, 2, 4, 8))
    for nodes in (2, 4, 8):  # right after the context (the forward before a plain one), after the other
        # forward's one token, or after the plain steps before a penalty's tree
        assert seen[nodes] <= {16, 16 + 1, 16 + 2 * SETTLED_STEPS}, (nodes, seen[nodes])

    small = make_tiny_target("llama", max_position_embeddings=64)
    small.reuses_graphs = True
    with pytest.raises(ValueError, match="leaves no room"):
        measure_verify(small, 30, 1, (1, 2, 4, 8))  # 30 + 3 x 10 plain steps + an 8-node tree > 64
    small.reuses_graphs = False
    assert sorted(measure_verify(small, 56, 1, (1, 2, 4, 8)).verify_s) == [1, 2, 4]  # 56 + 1 + 8 > 64


LOOKUP_STATS = LookupStats(matched_cycles=10, matched_tokens=40, matched_nodes=40, unmatched_cycles=60)
VERIFY_MS = {1: 0.050, 2: 0.060, 4: 0.080, 8: 0.120}


def test_the_lookup_prediction_pays_the_lookup_on_every_cycle() -> None:
    """60 plain steps and 10 4-node trees, each after a 1 ms lookup: 100 tokens in 3.87 s."""
    option = lookup_option("row", verify_only(VERIFY_MS), NgramConfig(), LOOKUP_STATS, lookup_s=0.001)
    assert option.tokens_per_s == pytest.approx(100 / (60 * 0.051 + 10 * 0.081))


def test_the_lookup_first_prediction_pays_lookup_accepts_and_model_cycles() -> None:
    """10 lookup cycles (a 4-node tree, a 2 ms lookup, the drafter's 1 ms + 0.5 ms a token accept
    of their 40 tokens) and the 60 tokens left drafted by a model at 2 tokens per 70 ms cycle
    (plus the lookup each time): 100 tokens in 0.83 + 0.02 + 2.16 s over 40 cycles."""
    costs = verify_only(VERIFY_MS, accept_s=(0.001, 0.0005))
    candidate = Candidate(TreeConfig(depth=2, top_k=1, budget=2), num_nodes=3, expected_tau=2.0, cycle_s=0.070)
    option = lookup_first_option("moa", "row", costs, candidate, NgramConfig(), LOOKUP_STATS, lookup_s=0.002)
    assert option.tokens_per_s == pytest.approx(100 / (10 * (0.002 + 0.080 + 0.001) + 0.0005 * 40 + 30 * (0.002 + 0.070)))
    assert option.expected_tau == pytest.approx(100 / 40)


def test_the_margin_is_five_percent_and_an_option_at_it_is_chosen() -> None:
    plain = Option("none", "row", 20.0)
    assert choose([plain, Option("ngram", "row", 20.0 * 1.03)]) is plain
    at_margin = Option("ngram", "row", MIN_GAIN * 20.0)
    assert MIN_GAIN == 1.05 and choose([plain, at_margin]) is at_margin


def test_lookup_tries_hold_at_most_sixteen_nodes() -> None:
    configs = lookup_configs()
    assert max(config.max_nodes for config in configs) == LOOKUP_MAX_NODES == 16
    widest = next(config for config in configs if config.max_depth == 8 and config.max_branches == 3)
    assert widest.max_nodes == 16  # 1 + 8 x 3 = 25, capped


def test_the_warm_up_rounds_plain_steps_and_penalties_are_left_out(monkeypatch) -> None:
    """Every forward costs 1 s, except in the first (warm-up) round, where it costs 5 s and each
    plain step after a tree 2 s more: with one timed round, the plain step is 1 s and the penalty
    0, as if the warm-up never happened."""
    from moaspec.targets.hf import HFTarget

    verify = HFTarget.verify
    clock = {"now": 0.0, "forwards": 0, "last": 0}
    warm_up = {"forwards": 0}

    def priced(self, tree, hidden_layers=()):
        clock["forwards"] += 1
        warm = clock["forwards"] <= warm_up["forwards"]
        settling = 2.0 if warm and tree.num_nodes == 1 and clock["last"] > 1 else 0.0
        clock["now"] += (5.0 if warm else 1.0) + settling
        clock["last"] = tree.num_nodes
        return verify(self, tree, hidden_layers)

    monkeypatch.setattr(HFTarget, "verify", priced)
    monkeypatch.setattr(costs_module.time, "perf_counter", lambda: clock["now"])
    target = make_tiny_target("llama")
    target.reuses_graphs = True
    measure_verify(target, 16, 1, (1, 2, 4, 8))  # counts the forwards of the two rounds
    warm_up["forwards"], clock["forwards"] = clock["forwards"] // 2, 0
    measured = measure_verify(target, 16, 1, (1, 2, 4, 8))
    assert measured.plain_step_s == pytest.approx(1.0) and measured.tree_penalty_s == pytest.approx(0.0)



def _generation(verifications: int, verify_s: float):
    from moaspec.metrics import SpecStats

    return SpecStats(new_tokens=2 * verifications + 1, num_verifications=verifications, verify_s=verify_s, draft_s=50.0,
                     prefill_s=9.0)


def test_target_steps_far_slower_than_calibrated_get_the_busy_machine_note() -> None:
    """Other work on the cores made llama.cpp's 2 threads decode 244x slower than calibrated (0.3
    against 74 tok/s; session 51); the note says so and names the remedy. It compares the target's
    forwards alone (a drafter's seconds, here 50, never count) with the predicted cycle (τ 2 at 80
    tok/s: 25 ms), beyond 10x; not for fewer than 8 verifications, without a calibration or on a
    GPU."""
    from types import SimpleNamespace

    import torch

    from moaspec.calibration.busy_machine import busy_machine_note

    calibration = SimpleNamespace(chosen=Option("moa", "row", 80.0, expected_tau=2.0))
    llama = SimpleNamespace(runtime="llama.cpp", threads=2, weights=SimpleNamespace(gpu_layers=0))
    note = busy_machine_note(_generation(10, 10 * 0.5), calibration, llama)  # 500 ms a forward: 20x
    assert note is not None and note.startswith("the target's steps took 500 ms, 20x what this machine's calibration predicts (25 ms)")
    assert "the target's 2 threads wait" in note and "--threads N, with N no more than the idle cores" in note
    cpu = SimpleNamespace(runtime="transformers", device=torch.device("cpu"))
    transformers = busy_machine_note(_generation(10, 10 * 0.5), calibration, cpu)
    assert f"torch's {torch.get_num_threads()} threads wait" in transformers and "OMP_NUM_THREADS=N" in transformers
    assert busy_machine_note(_generation(10, 10 * 0.25), calibration, llama) is None  # exactly 10x
    assert busy_machine_note(_generation(10, 10 * 0.2501), calibration, llama) is not None
    assert busy_machine_note(_generation(7, 7 * 0.5), calibration, llama) is None  # 7 verifications
    assert busy_machine_note(_generation(8, 8 * 0.5), calibration, llama) is not None
    assert busy_machine_note(_generation(10, 10 * 0.5), None, llama) is None
    offloaded = SimpleNamespace(runtime="llama.cpp", threads=2, weights=SimpleNamespace(gpu_layers=30))
    assert busy_machine_note(_generation(10, 10 * 0.5), calibration, offloaded) is None
    gpu = SimpleNamespace(runtime="transformers", device=torch.device("cuda"))
    assert busy_machine_note(_generation(10, 10 * 0.5), calibration, gpu) is None
