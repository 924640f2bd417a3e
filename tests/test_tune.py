"""`moaspec tune`: the acceptance model, the choice from synthetic costs, and the saved choice
being used by default (with explicit settings still winning)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_random_drafter_net, make_tiny_target

from moaspec.calibration.costs import CycleCosts
from moaspec.calibration.tree_ranking import (
    BUDGETS,
    DEPTHS,
    TOP_KS,
    candidates,
    expected_tau,
    expected_taus_by_budget,
    geometric_rates,
    model_acceptance_per_depth,
    rates_from_hit_rates,
)
from moaspec.cli import main
from moaspec.config import TreeConfig


def synthetic_costs(verify_ms: dict[int, float], level_ms: float) -> CycleCosts:
    """Verify costs per node count; drafting costs level_ms per tree level (any top-k)."""
    propose = {(d, k): d * level_ms / 1000 for d in DEPTHS for k in TOP_KS}
    return CycleCosts({n: ms / 1000 for n, ms in verify_ms.items()}, propose, (0.0, 0.0))


def test_expected_tau_of_a_chain_is_the_geometric_sum() -> None:
    tau, nodes = expected_tau(TreeConfig(depth=3, top_k=1, budget=3), geometric_rates(0.5))
    assert nodes == 4 and tau == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    # top-2 at one level: ranks 1 and 2 hit with 0.5 and 0.25, mutually exclusive
    tau, nodes = expected_tau(TreeConfig(depth=1, top_k=2, budget=2), geometric_rates(0.5))
    assert nodes == 3 and tau == pytest.approx(1.75)


@pytest.mark.parametrize(
    "rates",
    [
        (0.25, 0.25, 0.25, 0.25),  # every path of a length ties: the pool order decides
        geometric_rates(0.5),
        rates_from_hit_rates([0.25, 0.33, 0.33, 0.44]),  # a 1e-4 floor
        (0.61, 0.07, 0.031, 0.0105),
    ],
)
def test_one_build_per_depth_and_top_k_gives_every_budget_exactly(rates) -> None:
    """The calibration's sweep (one tree per depth and top-k, cut by budget) equals building
    each tree: the same node counts and bit-identical expected tau."""
    for depth in DEPTHS:
        for top_k in TOP_KS:
            budgets = tuple(b for b in BUDGETS if b >= top_k)
            swept = expected_taus_by_budget(depth, top_k, budgets, rates)
            for budget in budgets:
                assert swept[budget] == expected_tau(TreeConfig(depth=depth, top_k=top_k, budget=budget), rates)


def test_rates_come_from_the_hit_rates_of_the_top_k() -> None:
    rates = rates_from_hit_rates([0.25, 0.33, 0.33, 0.44])
    assert rates == pytest.approx((0.25, 0.08, 1e-4, 0.11))
    # the modelled one-level trees reproduce the measured hit rates
    for top_k, hit in zip(TOP_KS, [0.25, 0.33, 0.33, 0.44]):
        tree = TreeConfig(depth=1, top_k=top_k, budget=top_k)
        assert model_acceptance_per_depth(tree, rates)[0] == pytest.approx(hit, abs=1e-3)
    # noise that makes a wider top-k look worse is clipped, never a negative rate
    assert min(rates_from_hit_rates([0.30, 0.28, 0.35, 0.40])) > 0


def test_a_peaked_drafter_gets_a_chain_where_the_geometric_fit_would_branch() -> None:
    """Same top-4 hit rate, different top-1: the measured rates, not a fit to one tree, pick the shape."""
    costs = synthetic_costs({1: 34, 2: 38, 3: 41, 5: 55, 9: 65, 17: 73}, level_ms=6)
    peaked = candidates(costs, rates_from_hit_rates([0.40, 0.42, 0.43, 0.44]))[0]
    flat = candidates(costs, rates_from_hit_rates([0.13, 0.24, 0.34, 0.44]))[0]
    assert peaked.tree.top_k == 1 and peaked.num_nodes == 2
    assert flat.tokens_per_s < peaked.tokens_per_s


def test_choice_follows_the_costs() -> None:
    """Steep verify costs beyond 4 nodes -> a small tree; flat costs and a good drafter -> a big deep one;
    a useless drafter with costly drafting loses to plain decoding."""
    steep = synthetic_costs({1: 75, 2: 80, 3: 85, 4: 90, 5: 150, 9: 300, 17: 600, 33: 1200}, level_ms=5)
    best = candidates(steep, geometric_rates(0.7))[0]
    assert best.num_nodes <= 4
    flat = synthetic_costs({1: 75, 2: 76, 3: 77, 5: 78, 9: 80, 17: 85, 33: 90}, level_ms=1)
    best_flat = candidates(flat, geometric_rates(0.9))[0]
    assert best_flat.num_nodes >= 17 and best_flat.tree.depth >= 6
    assert best_flat.tokens_per_s > candidates(flat, geometric_rates(0.2))[0].tokens_per_s
    ranked = candidates(steep, geometric_rates(0.7))
    assert [c.tokens_per_s for c in ranked] == sorted((c.tokens_per_s for c in ranked), reverse=True)


def test_no_candidate_has_fewer_nodes_than_levels() -> None:
    """Bug (a researcher's audit): `--tree-depth 2` alone got depth 2, top-k 1, budget 1 from the
    calibration: one drafted node, recorded as a depth-2 tree, drafted two levels deep for it. A
    budget below the depth never reaches the last level (the same tree as a shallower one, at
    more drafting cost), so such trees are not candidates; with the depth fixed at 2 the best
    tree now drafts two levels."""
    steep = synthetic_costs({1: 75, 2: 80, 3: 85, 4: 90, 5: 150, 9: 300, 17: 600, 33: 1200}, level_ms=5)
    ranked = candidates(steep, geometric_rates(0.3))
    assert ranked and all(c.tree.budget >= c.tree.depth for c in ranked)
    fixed_depth = [c for c in ranked if c.tree.depth == 2]
    assert fixed_depth[0].num_nodes >= 2


def test_candidates_are_distinct_trees_no_larger_than_twice_the_largest_measured() -> None:
    """Costs measured up to 8 nodes: trees of up to 16 are ranked (their verify extrapolated),
    none larger; a budget beyond a tree's pool is the same tree, ranked once; the smallest budget
    that reaches every level (a chain of depth d: budget d) is among them."""
    costs = synthetic_costs({1: 10, 2: 12, 4: 15, 8: 20}, level_ms=0.5)
    ranked = candidates(costs, geometric_rates(0.8))
    sizes = [c.num_nodes for c in ranked]
    assert 8 < max(sizes) <= 16
    shapes = [(c.tree.depth, c.tree.top_k, c.num_nodes) for c in ranked]
    assert len(shapes) == len(set(shapes))
    assert any(c.tree == TreeConfig(depth=3, top_k=1, budget=3) for c in ranked)
    assert [(-c.tokens_per_s, c.num_nodes) for c in ranked] == sorted((-c.tokens_per_s, c.num_nodes) for c in ranked)


def test_rates_never_fall_below_what_a_narrower_top_k_already_covered() -> None:
    assert rates_from_hit_rates([0.4, 0.3, 0.5]) == pytest.approx((0.4, 1e-4, 0.1))


@pytest.fixture
def tiny_with_checkpoint(tmp_path, monkeypatch):
    from test_bench import char_tokenizer

    import moaspec.api
    import moaspec.model_store
    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOASPEC_NO_TUNED", raising=False)
    target = make_tiny_target("llama", max_position_embeddings=1024, dtype=torch.float32)
    target.tokenizer = char_tokenizer()
    monkeypatch.setattr(moaspec.model_store, "resolve_target", lambda spec: ("tiny-llama", Path("unused")))
    monkeypatch.setattr(moaspec.model_store, "target_name", lambda spec: "tiny-llama")
    monkeypatch.setattr(moaspec.api, "load_target", lambda name, dtype=None, attn_implementation=None, **kwargs: target)
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config), target)
    checkpoint = save_checkpoint(tmp_path / "moa-ckpt", "moa", net, target, {"depth": 2, "top_k": 1, "budget": 2})
    return target, checkpoint


def test_tune_saves_a_choice_that_generation_then_uses(tiny_with_checkpoint, monkeypatch, capsys) -> None:
    from moaspec.drafters import make_drafter
    from moaspec.tuned import tuned_path

    target, checkpoint = tiny_with_checkpoint
    args = [
        "tune",
        "--drafters",
        str(checkpoint),
        "--target",
        "tiny",
        "--repeats",
        "1",
        "--context",
        "32",
        "--calibration-prompts",
        "1",
        "--calibration-tokens",
        "8",
    ]
    assert main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "| depth | top-k | budget |" in out and "saved: " in out
    record = json.loads(tuned_path("tiny-llama", checkpoint).read_text())
    assert record["rates_source"] in ("calibrated", "default") and len(record["rank_rates"]) == max(TOP_KS)
    assert len(record["calibration"]["tau_by_top_k"]) == len(TOP_KS)
    assert set(record["costs"]["verify_s"]) >= {"1", "2", "9"}
    chosen = TreeConfig(**record["tree"])

    drafter = make_drafter(str(checkpoint), target)
    assert drafter.tree_config == chosen and drafter.tree_source == "tuned"
    explicit = make_drafter(str(checkpoint), target, {"depth": 7, "top_k": None, "budget": None})
    assert (
        explicit.tree_config.depth == 7
        and explicit.tree_config.top_k == chosen.top_k
        and explicit.tree_source == "explicit"
    )
    monkeypatch.setenv("MOASPEC_NO_TUNED", "1")
    plain = make_drafter(str(checkpoint), target)
    assert plain.tree_config == TreeConfig(depth=2, top_k=1, budget=2) and plain.tree_source == "checkpoint"


def test_a_context_beyond_half_the_targets_is_said_to_be_capped(tiny_with_checkpoint, capsys) -> None:
    """Bug (a user's audit): `tune --context 100000` measured at half the target's context without
    a word."""
    target, checkpoint = tiny_with_checkpoint
    args = ["tune", "--drafters", str(checkpoint), "--target", "tiny", "--repeats", "1", "--context", "100000",
            "--calibration-prompts", "0", "--dry-run"]
    assert main(args) == 0
    assert "context 512 (--context 100000: at most half the target's 1024)" in capsys.readouterr().err


def test_tune_shows_each_measured_part_as_a_progress_bar_on_stderr(tiny_with_checkpoint, capsys) -> None:
    """Bug (journal, session 30's leads): tune printed two lines in its ~1 min of measuring. Each
    part now has a tqdm bar on stderr (as bench, distill and train), done/total runs of it; stdout
    keeps the table alone. The totals follow from the flags: --repeats 1 is a warm-up round and
    one timed round of every draft shape, 2 prompts a generation each per top-k."""
    import re

    _, checkpoint = tiny_with_checkpoint
    args = ["tune", "--drafters", str(checkpoint), "--target", "tiny", "--repeats", "1", "--context", "32",
            "--calibration-prompts", "2", "--calibration-tokens", "4", "--dry-run"]
    assert main(args) == 0
    captured = capsys.readouterr()

    def finished(what: str, total: str) -> int:
        """Where the completed bar of `what` is in stderr (total: its run count, as a regex)."""
        found = re.search(rf"{what}: 100%\|[^|]*\| ({total})/\1 ", captured.err)
        assert found is not None, captured.err
        return found.start()

    verify = finished("verify costs", r"\d+")
    drafts = finished("draft costs", str(2 * len(DEPTHS) * len(TOP_KS)))
    calibration = finished("calibration", str(2 * len(TOP_KS)))
    heading = captured.err.find("measuring drafter")
    assert captured.err.find("measuring target verify costs") < verify < heading < drafts < calibration
    assert captured.out.startswith("## ") and "%|" not in captured.out


def test_saved_choice_depends_on_the_checkpoint_and_survives_a_damaged_file(tiny_with_checkpoint) -> None:
    from moaspec.drafters import make_drafter
    from moaspec.tuned import save_tuned_tree, tuned_path

    target, checkpoint = tiny_with_checkpoint
    save_tuned_tree("tiny-llama", checkpoint, TreeConfig(depth=5, top_k=2, budget=6), {})
    assert make_drafter(str(checkpoint), target).tree_config == TreeConfig(depth=5, top_k=2, budget=6)
    assert make_drafter(str(checkpoint), target).tree_config != TreeConfig()
    tuned_path("tiny-llama", checkpoint).write_text("{not json")
    assert make_drafter(str(checkpoint), target).tree_source == "checkpoint"


def test_a_gpu_choice_serves_gpu_targets_only(tiny_with_checkpoint) -> None:
    from moaspec.drafters import make_drafter
    from moaspec.tuned import resolve_tree, save_tuned_tree, tuned_path

    target, checkpoint = tiny_with_checkpoint
    base = TreeConfig(depth=2, top_k=1, budget=2)
    gpu_tree, cpu_tree = TreeConfig(depth=6, top_k=4, budget=16), TreeConfig(depth=1, top_k=2, budget=2)
    path = save_tuned_tree("tiny-llama", checkpoint, gpu_tree, {}, "cuda:1")
    assert path == tuned_path("tiny-llama", checkpoint, "cuda") != tuned_path("tiny-llama", checkpoint)
    assert json.loads(path.read_text())["device"] == "cuda"
    # the CPU target keeps its checkpoint's tree; a target on any GPU gets the GPU's choice
    assert make_drafter(str(checkpoint), target).tree_source == "checkpoint"
    assert resolve_tree(base, "tiny-llama", checkpoint, None, torch.device("cuda", 0)) == (gpu_tree, "tuned")
    save_tuned_tree("tiny-llama", checkpoint, cpu_tree, {})
    assert make_drafter(str(checkpoint), target).tree_config == cpu_tree
    assert resolve_tree(base, "tiny-llama", checkpoint, None, "cuda") == (gpu_tree, "tuned")


def test_rank_rates_come_from_a_tune_on_either_device(tiny_with_checkpoint) -> None:
    from moaspec.calibration.profile import load_rank_rates
    from moaspec.tuned import save_tuned_tree

    _, checkpoint = tiny_with_checkpoint
    assert load_rank_rates("tiny-llama", checkpoint)[1] == "prior"
    rates = {"rates_source": "calibrated", "rank_rates": [0.5, 0.1, 0.05, 0.02]}
    save_tuned_tree("tiny-llama", checkpoint, TreeConfig(), rates, "cuda")
    assert load_rank_rates("tiny-llama", checkpoint) == ((0.5, 0.1, 0.05, 0.02), "tuned")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--drafters", "ngram"], "no draft tree to tune"),
        (["--drafters", ""], "--drafters is empty"),
        (["--drafters", "moa,"], "--drafters has an empty item: 'moa,'"),
        (["--drafters", "moa", "--device", "gpu"], "--device must be cpu or cuda[:N]"),
        (["--drafters", "moa", "--device", "cuda:99"], "no such CUDA device"),
        (["--drafters", "moa"], "no shipped 'moa' drafter"),
        (["--drafters", "moa", "--top1-rate", "1.5"], "--top1-rate must be in (0, 1)"),
        (["--drafters", "moa", "--repeats", "0"], "--repeats"),
        # an audit's: dropped without a word (the calibration they set does not run)
        (["--drafters", "moa", "--top1-rate", "0.5", "--calibration-prompts", "3"],
         "--top1-rate replaces the calibration: --calibration-prompts cannot be given with it"),
        (["--drafters", "moa", "--top1-rate", "0.5", "--calibration-prompts", "1", "--calibration-tokens", "8"],
         "--calibration-prompts and --calibration-tokens cannot"),
    ],
)
def test_tune_bad_flags(tiny_with_checkpoint, capsys, extra, message) -> None:
    assert main(["tune", "--target", "tiny", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moaspec: error: ") and message in err


def test_generate_rejects_tree_flags_for_model_free_drafters(capsys) -> None:
    assert main(["generate", "--prompt", "hi", "--drafter", "ngram", "--tree-depth", "3"]) == 2
    assert "model drafters only" in capsys.readouterr().err


def test_calibration_measures_every_top_k_and_restores_the_tree(tiny_with_checkpoint) -> None:
    from moaspec.bench.tune import calibrate
    from moaspec.drafters import make_drafter

    target, checkpoint = tiny_with_checkpoint
    drafter = make_drafter(str(checkpoint), target)
    kept = drafter.tree_config
    result = calibrate(drafter, target, [[5, 6, 7, 8]], max_new_tokens=6)
    assert drafter.tree_config == kept
    hits = result["hit_rate_by_top_k"]
    assert len(hits) == len(TOP_KS) and all(0.0 <= h <= 1.0 for h in hits)


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_proposals_are_timed_as_in_an_engine_cycle(method: str, monkeypatch) -> None:
    """Each timed proposal follows the accept of the previous root, so the drafter feeds one new
    token (the root) on top of its own state, not the whole context again (as EAGLE did when
    proposals were timed back to back without an accept between them)."""
    from moaspec.calibration.costs import measure_drafter
    from moaspec.drafters.eagle import EagleDrafter
    from moaspec.drafters.moa import MoADrafter
    from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    target = make_tiny_target("llama", max_position_embeddings=1024, dtype=torch.float32)
    if method == "moa":
        drafter = MoADrafter(make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(target.config), target), target)
        feeder = "_self_attend"
    else:
        drafter = EagleDrafter(make_random_drafter_net(EagleDrafterNet, EagleConfig.for_target(target.config), target), target)
        feeder = "_decode"
    fed, original_start = [], drafter.start

    original_feed = getattr(drafter, feeder)
    calls: list[int] = []

    def feed(token_ids: torch.Tensor, *rest) -> torch.Tensor:
        calls.append(token_ids.numel())
        return original_feed(token_ids, *rest)

    def start(root_id: int) -> torch.Tensor:
        calls.clear()
        log_probs = original_start(root_id)
        fed.append(calls[0])  # the tokens start() fed: the root and any verified ones not yet seen
        return log_probs

    monkeypatch.setattr(drafter, feeder, feed)

    monkeypatch.setattr(drafter, "start", start)
    propose_s, _ = measure_drafter(drafter, target, context_len=40, repeats=3, shapes=[(1, 2), (2, 2)])
    assert set(propose_s) == {(1, 2), (2, 2)}
    assert fed[0] >= 40  # the untimed first proposal takes in the context
    assert fed[1:] == [1] * (len(fed) - 1) and len(fed) == 1 + 2 * 4  # warm-up round + 3 rounds, 2 shapes


def test_tune_refuses_a_drafter_of_another_target_before_measuring(tiny_with_checkpoint, tmp_path, monkeypatch, capsys) -> None:
    import moaspec.calibration.costs
    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    other = make_tiny_target("llama", seed=1, max_position_embeddings=1024, dtype=torch.float32)
    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(other.config), other)
    foreign = save_checkpoint(tmp_path / "foreign", "moa", net, other, {"depth": 2, "top_k": 1, "budget": 2})

    def no_measuring(*args, **kwargs):
        raise AssertionError("the target was measured before the drafters were checked")

    monkeypatch.setattr(moaspec.calibration.costs, "measure_verify", no_measuring)
    _, checkpoint = tiny_with_checkpoint
    assert main(["tune", "--drafters", f"{checkpoint},{foreign}", "--target", "tiny", "--repeats", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("moaspec: error:") and "trained for target" in err[0]


def test_a_tuned_choice_applies_to_the_runtime_tune_measured_only(tiny_with_checkpoint, monkeypatch) -> None:
    """Bug: a tree `moaspec tune` chose from the transformers runtime's costs was used on the
    llama.cpp runtime too, where a verified node costs 0.3-0.9 of a step (there: τ 2.06 at 20-23
    tok/s against the calibration's τ 1.52 at 29-37); llama.cpp targets get the calibration's
    tree. MOASPEC_NO_TUNED=0 switched the choice off as =1 did."""
    from moaspec.tuned import resolve_tree, save_tuned_tree

    _, checkpoint = tiny_with_checkpoint
    base, tuned = TreeConfig(depth=2, top_k=1, budget=2), TreeConfig(depth=5, top_k=2, budget=6)
    save_tuned_tree("tiny-llama", checkpoint, tuned, {})
    assert resolve_tree(base, "tiny-llama", checkpoint, None, "cpu", "transformers") == (tuned, "tuned")
    assert resolve_tree(base, "tiny-llama", checkpoint, None, "cpu", "llama.cpp") == (base, "checkpoint")
    for value, applies in (("0", True), ("", True), ("false", True), ("1", False), ("yes", False)):
        monkeypatch.setenv("MOASPEC_NO_TUNED", value)
        assert resolve_tree(base, "tiny-llama", checkpoint, None)[1] == ("tuned" if applies else "checkpoint"), value


def test_timings_where_a_tree_costs_far_more_than_a_larger_one_are_flagged() -> None:
    """A researcher's audit: `tune` on a busy machine saved a choice from timings where 9 nodes
    took 2.8 s and 33 nodes 0.09 s, without a word. Such timings are now flagged (tune and the
    machine calibration print the warning); costs that grow with the nodes, even unevenly, are not."""
    from moaspec.calibration.costs import VerifyCosts

    growing = VerifyCosts({1: 0.010, 2: 0.018, 4: 0.017, 8: 0.040, 16: 0.075}, 0.010, 0.001)
    assert growing.irregularity() is None
    noisy = VerifyCosts({1: 0.033, 2: 0.039, 9: 2.846, 17: 2.828, 33: 0.090}, 0.033, 0.0)
    assert "9 nodes took 2846.0 ms, 33 nodes 90.0 ms" in noisy.irregularity()


def test_tune_warns_of_irregular_timings(tiny_with_checkpoint, monkeypatch, capsys) -> None:
    import moaspec.calibration.costs
    from moaspec.calibration.costs import VerifyCosts

    noisy = VerifyCosts({1: 0.033, 2: 0.039, 4: 0.040, 8: 2.846, 16: 0.090}, 0.033, 0.0)
    monkeypatch.setattr(moaspec.calibration.costs, "measure_verify", lambda *args, **kwargs: noisy)
    _, checkpoint = tiny_with_checkpoint
    args = ["tune", "--drafters", str(checkpoint), "--target", "tiny", "--repeats", "1", "--context", "32",
            "--calibration-prompts", "1", "--calibration-tokens", "8", "--dry-run"]
    assert main(args) == 0
    assert "moaspec: warning: the verify timings are irregular (8 nodes took 2846.0 ms" in capsys.readouterr().err
