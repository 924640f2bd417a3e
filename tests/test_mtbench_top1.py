"""bench/mtbench_top1.py's scoring of `X+ngram` at draft depth 1: the lookup's guess is the n-gram
drafter's own first token, and the model's guess fills in where the lookup has none."""

from __future__ import annotations

import pytest
import torch
from conftest import load_bench_script, make_tiny_target

from moaspec.drafters.ngram import NgramDrafter
from moaspec.train.config import TrainConfig
from moaspec.train.features import OnlineFeatures, TrainSample
from moaspec.train.run import build_net
from moaspec.train.trainer import first_guesses


def test_lookup_guesses_are_the_ngram_drafters_first_tokens() -> None:
    script = load_bench_script("mtbench_top1")
    tokens = [5, 6, 7, 8, 5, 6, 7, 9, 1, 5, 6, 7, 8, 2, 6, 7]
    guesses = script.lookup_guesses(tokens)
    for root in range(len(tokens)):
        drafter = NgramDrafter()
        drafter.accept_context(torch.tensor(tokens[:root], dtype=torch.long), 0, {})
        alone = drafter.draft_alone(tokens[root], None, torch.Generator())
        assert guesses[root] == (alone and alone.token_id)
    assert guesses[5] == 7 and guesses[0] is None and sum(g is not None for g in guesses) >= 6


def test_depth_one_counts_take_the_lookup_first_then_the_model_per_turn() -> None:
    script = load_bench_script("mtbench_top1")
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = build_net("eagle", target, 0, None)
    config = TrainConfig(method="eagle")
    repeated = torch.tensor([3, 4, 5, 6, 7, 8] * 4)
    data = [TrainSample(repeated, 6, 0), TrainSample(torch.arange(10, 34), 6, 1, ((6, 12), (15, 24)))]
    source, parts = OnlineFeatures(target), target.parts(0)
    turns = script.depth_one_counts(net, parts, source, data, config, with_lookup=True)
    counts = script.summed(turns)
    expected = {"hits": 0, "positions": 0, "lookup_answered": 0, "lookup_hits": 0}
    for sample in data:
        features = source.features(sample, 0, ())
        with torch.inference_mode():
            roots, model = first_guesses(net.eval(), parts, sample, features, config)
        lookup = script.lookup_guesses(sample.input_ids.tolist())
        for root, guess in zip(roots.tolist(), model.tolist()):
            wanted = int(features.target_argmax[root])
            if lookup[root] is not None:
                expected["lookup_answered"] += 1
                expected["lookup_hits"] += lookup[root] == wanted
                guess = lookup[root]
            expected["hits"] += guess == wanted
            expected["positions"] += 1
    assert counts == expected
    assert 0 < counts["lookup_answered"] < counts["positions"]  # the repeated sample only
    # scored roots (trainer.loss_mask): turn 1 the first sample's 6..22 and the second's 6..10,
    # turn 2 the second's 15..22
    assert [t["positions"] for t in turns] == [17 + 5, 8]


def test_turn_of_places_a_root_in_the_answer_its_next_token_belongs_to() -> None:
    script = load_bench_script("mtbench_top1")
    spans = ((6, 12), (15, 24))
    assert [script.turn_of(root, spans) for root in (6, 10, 15, 22)] == [0, 0, 1, 1]
    for outside in (5, 11, 14, 23):
        with pytest.raises(StopIteration):
            script.turn_of(outside, spans)


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_per_turn_counts_from_validation_equal_a_pass_of_their_own(method: str) -> None:
    """`evaluate` splits depth 1 by turn inside the validation pass (its `on_first_guesses` hook)
    instead of reading every conversation teacher-forced a second time: the same counts, turn by
    turn, and the same totals as validation's depth 1."""
    import functools

    from moaspec.train.trainer import kv_layers_read, validation_counts

    script = load_bench_script("mtbench_top1")
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = build_net(method, target, 0, None)
    config = TrainConfig(method=method)
    data = [TrainSample(torch.arange(3, 27), 6, 0), TrainSample(torch.arange(10, 40), 6, 1, ((6, 12), (15, 30)))]
    source, parts = OnlineFeatures(target), target.parts(0)
    assert kv_layers_read(net, config) or method == "eagle"
    turns: list[dict] = []
    counts = validation_counts(net, parts, source, data, config, script.MAX_DEPTH, on_first_guesses=functools.partial(script.count_by_turn, turns))
    assert turns == script.depth_one_counts(net, parts, source, data, config, with_lookup=False)
    depth = 2 if method == "moa" else 1
    assert len(turns) == 2 and script.summed(turns)["positions"] == int(counts.counts[depth]) > 0
    assert script.summed(turns)["hits"] == int(counts.hits[depth]) > 0
