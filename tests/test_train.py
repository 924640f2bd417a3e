"""Trainer smoke tests on a tiny target: the loss falls when overfitting, resume is exact,
anchors and masks follow the reference conventions."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import make_tiny_target

from moaspec.errors import MoaspecError
from moaspec.train.config import TrainConfig
from moaspec.train.features import OnlineFeatures, TrainSample
from moaspec.train.run import build_net
from moaspec.train.trainer import last_anchors, learning_rate, loss_mask, staircase_probability, train


def test_anchor_and_mask_conventions() -> None:
    anchors = last_anchors(12, ((4, 12),), every=3)
    # prompt 0..3 are anchors, then 6 and 9 (multiples of 3 in the response)
    assert anchors.tolist() == [0, 1, 2, 3, 3, 3, 6, 6, 6, 9, 9, 9]
    assert loss_mask(6, ((2, 6),)).tolist() == [0, 0, 1, 1, 1, 0]


def test_multi_span_anchors_and_masks() -> None:
    """Two assistant turns [2, 6) and [8, 12): the user turn between them is verified context
    (every position an anchor) and each span's last token is predicted, never beyond it."""
    spans = ((2, 6), (8, 12))
    assert last_anchors(12, spans, every=3).tolist() == [0, 1, 1, 3, 3, 3, 6, 7, 7, 9, 9, 9]
    assert loss_mask(12, spans).tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]
    sample = TrainSample(torch.arange(12), 2, loss_spans=spans)
    assert sample.learned_tokens() == [2, 3, 4, 5, 8, 9, 10, 11]
    assert TrainSample(torch.arange(5), 3).spans() == ((3, 5),)


def test_learning_rate_warms_up_then_decays_to_the_final_rate_at_the_last_step() -> None:
    config = TrainConfig(steps=8, warmup_steps=2, lr=1e-3, min_lr=1e-4)
    rates = [learning_rate(config, step) for step in range(config.steps)]
    assert rates[:3] == [5e-4, 1e-3, 1e-3] and rates[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(rates[2:], rates[3:]))
    with pytest.raises(ValueError, match="final learning rate"):
        TrainConfig(lr=1e-4, min_lr=1e-3)


def test_staircase_curriculum_anneals_by_steps() -> None:
    config = TrainConfig(steps=10, staircase_fraction=0.5)
    assert [staircase_probability(config, step) for step in (0, 2, 5, 9)] == pytest.approx([1.0, 0.6, 0.0, 0.0])
    assert staircase_probability(TrainConfig(steps=10, staircase_fraction=0.0), 0) == 0.0


def test_pre_tli_feature_term_is_relative_to_the_stream_rms() -> None:
    """Scaled: multiplying the stream and its prediction by 100 leaves the loss unchanged; raw:
    the term grows with the stream (SmoothL1 is linear there), as in the reference code."""
    from moaspec.train.losses import drafter_loss

    gen = torch.Generator().manual_seed(0)
    state, head = torch.randn(5, 8, generator=gen), torch.randn(11, 8, generator=gen)
    lse = torch.logsumexp(state @ head.T, -1)
    mask, stream = torch.ones(5), torch.randn(5, 8, generator=gen)
    predicted = stream + 0.3 * torch.randn(5, 8, generator=gen)

    def loss(scale: float, scaled: bool) -> float:
        return float(drafter_loss(state, state, head, lse, mask, scale * predicted, scale * stream, mask, scaled).feature)

    assert loss(100.0, True) == pytest.approx(loss(1.0, True), rel=1e-5)
    assert loss(100.0, False) > 50 * loss(1.0, False)


def test_loss_weights_scale_their_terms() -> None:
    """total = ce_weight * soft CE + feature_weight * feature term; the defaults are the paper's 0.1 / 1."""
    from moaspec.train.losses import drafter_loss

    gen = torch.Generator().manual_seed(1)
    target_state, head = torch.randn(6, 8, generator=gen), torch.randn(11, 8, generator=gen)
    drafter_state = target_state + 0.5 * torch.randn(6, 8, generator=gen)
    lse, mask = torch.logsumexp(target_state @ head.T, -1), torch.ones(6)
    paper = drafter_loss(drafter_state, target_state, head, lse, mask)
    assert float(paper.soft_ce) > 0 and float(paper.feature) > 0
    torch.testing.assert_close(paper.total, 0.1 * paper.soft_ce + paper.feature)
    ce_led = drafter_loss(drafter_state, target_state, head, lse, mask, ce_weight=1.0, feature_weight=0.1)
    torch.testing.assert_close(ce_led.total, paper.soft_ce + 0.1 * paper.feature)
    only_ce = drafter_loss(drafter_state, target_state, head, lse, mask, ce_weight=1.0, feature_weight=0.0)
    torch.testing.assert_close(only_ce.total, paper.soft_ce)
    with pytest.raises(ValueError, match="not both 0"):
        TrainConfig(ce_weight=0.0, feature_weight=0.0)


def make_net(method: str, target, tli: int = 0, vocab: torch.Tensor | None = None):
    return build_net(method, target, tli, vocab).to(target.dtype)


def samples(count: int, seed: int) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    return [TrainSample(torch.randint(0, 97, (24,), generator=gen), 6, index) for index in range(count)]


def unequal_samples(seed: int) -> list[TrainSample]:
    """Four sequences of different lengths, one with two learned spans (a conversation)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 97, (length,), generator=gen) for length in (19, 31, 24, 12)]
    return [
        TrainSample(ids[0], 5, 0),
        TrainSample(ids[1], 4, 1, loss_spans=((4, 12), (17, 31))),
        TrainSample(ids[2], 9, 2),
        TrainSample(ids[3], 3, 3),
    ]


@pytest.mark.parametrize("method, tli, reduced", [("moa", 0, False), ("moa", 1, True), ("eagle", 0, False)])
def test_loss_falls_when_overfitting_one_batch(tmp_path, method: str, tli: int, reduced: bool) -> None:
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = make_net(method, target, tli, torch.arange(0, 97, 2) if reduced else None)
    config = TrainConfig(method=method, tli_layers=tli, steps=50, batch_size=1, lr=1e-2, min_lr=1e-2, warmup_steps=1, val_every=1000, ckpt_every=1000)
    state = train(net, target, samples(1, 0), [], config, tmp_path / "run", progress=False)
    losses = [record["loss"] for record in state.history]
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_resume_continues_from_the_same_state(tmp_path, method: str) -> None:
    """Bit for bit, EAGLE's feature noise included (its generator's state is saved)."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data, val = samples(4, 1), samples(1, 2)
    config = TrainConfig(method=method, steps=6, batch_size=2, warmup_steps=2, val_every=3, ckpt_every=3)
    torch.manual_seed(0)
    straight = make_net(method, target)
    train(straight, target, data, val, config, tmp_path / "straight", progress=False)

    torch.manual_seed(0)
    interrupted = make_net(method, target)
    train(interrupted, target, data, val, config, tmp_path / "resumed", progress=False, stop_at_step=4)
    torch.manual_seed(123)  # resume must not depend on the global RNG
    resumed = make_net(method, target)
    state = train(resumed, target, data, val, config, tmp_path / "resumed", progress=False)
    assert state.step == 6
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    validated = [record for record in state.history if "acc_depth1" in record]
    assert [record["step"] for record in validated] == [3, 6]
    assert all(1.0 <= record["val_tau"] <= 5.0 for record in validated)  # default tree: depth 4
    assert (tmp_path / "resumed" / "checkpoint" / "config.json").is_file()


def test_a_state_that_cannot_be_written_is_one_error_and_leaves_the_run_resumable(tmp_path, monkeypatch) -> None:
    """An audit's: a full disk ended `moaspec train` in torch's traceback and left
    train_state.pt.tmp, which made the rerun refuse its own --out ("holds other files")."""
    import moaspec.train.trainer as trainer
    from moaspec.errors import MoaspecError
    from moaspec.train.cli import RUN_FILES, _own_directory

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    config = TrainConfig(method="moa", steps=2, batch_size=2, warmup_steps=1, val_every=1000, ckpt_every=1)
    save = torch.save

    def full_disk(record, path):
        save(record, path)  # a part of it written, as a full disk leaves it
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 11008 vs 10912")

    monkeypatch.setattr(trainer.torch, "save", full_disk)
    with pytest.raises(MoaspecError, match="cannot write the training state into .*unexpected pos"):
        train(make_net("moa", target), target, samples(4, 1), [], config, tmp_path / "run", progress=False)
    assert not [path.name for path in (tmp_path / "run").iterdir() if "tmp" in path.name]
    assert _own_directory(tmp_path / "run", "--out", RUN_FILES, "a run") == tmp_path / "run"
    monkeypatch.setattr(trainer.torch, "save", save)
    assert train(make_net("moa", target), target, samples(4, 1), [], config, tmp_path / "run", progress=False).step == 2


def test_run_training_end_to_end_with_reduced_vocab(tmp_path, monkeypatch, capsys) -> None:
    """`moaspec train`'s driver: distilled shards in, a loadable checkpoint out, provenance kept."""
    import json

    import moaspec.api
    from moaspec.config import TreeConfig
    from moaspec.drafters import make_drafter
    from moaspec.train.run import RunSpec, run_training

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    monkeypatch.setattr(moaspec.api, "load_target", lambda name, dtype=None, **kwargs: target)
    data = tmp_path / "data"
    data.mkdir()
    gen = torch.Generator().manual_seed(3)
    records = [
        {"id": str(i), "prompt_ids": torch.randint(0, 97, (6,), generator=gen).tolist(),
         "response_ids": torch.randint(0, 50, (12,), generator=gen).tolist(), "mode": "greedy", "seed": 0}
        for i in range(6)
    ]
    (data / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = RunSpec((data,), tmp_path / "run", "tiny", draft_vocab=20, val_conversations=2, time_limit_s=None, command="moaspec train ...")
    config = TrainConfig(method="moa", steps=3, batch_size=2, val_every=3, ckpt_every=3)
    checkpoint = run_training(spec, config, TreeConfig(depth=2, top_k=2, budget=3))
    record = json.loads((checkpoint / "config.json").read_text())
    assert record["config"]["draft_vocab_size"] == 20
    assert record["tree"] == {"depth": 2, "top_k": 2, "budget": 3, "sampled": False}
    assert record["training"]["command"] == "moaspec train ..." and record["training"]["num_train_sequences"] == 4
    drafter = make_drafter(str(checkpoint), target)
    assert set(drafter.draft_vocab_ids.tolist()) <= set(range(50))  # only tokens seen in responses
    logged = json.loads((tmp_path / "run" / "runs.jsonl").read_text())
    assert logged["command"] == "moaspec train ..." and (logged["steps_done"], logged["ended"]) == (3, "complete")
    assert record["training"]["val_indices"] == [0, 3]  # spaced through the data, not the first two

    continued = RunSpec(
        (data,), tmp_path / "run2", "tiny", draft_vocab=20, val_conversations=2, time_limit_s=None,
        command="moaspec train --init-from ...", init_from=checkpoint,
    )
    second = run_training(continued, config, TreeConfig())
    first_record = json.loads((checkpoint / "config.json").read_text())["training"]
    lineage = {
        "path": str(checkpoint), "step": 3, "command": "moaspec train ...",
        "num_train_tokens": first_record["num_train_tokens"], "train_wall_s": first_record["train_wall_s"],
    }
    assert json.loads((second / "config.json").read_text())["training"]["init_from"] == lineage
    third = RunSpec(
        (data,), tmp_path / "run3", "tiny", draft_vocab=20, val_conversations=2, time_limit_s=None,
        command="moaspec train --init-from run2", init_from=second,
    )
    record = json.loads((run_training(third, config, TreeConfig()) / "config.json").read_text())
    assert record["training"]["init_from"]["command"] == "moaspec train --init-from ..."
    assert record["training"]["init_from"]["init_from"] == lineage  # the chain back to the first run

    # the weights are as readable as the config beside them (safetensors' save_file made them 0600)
    assert (checkpoint / "model.safetensors").stat().st_mode == (checkpoint / "config.json").stat().st_mode

    # a run resumed with other settings is refused naming them, before any features are prepared
    import moaspec.train.run

    def prepared(*args, **kwargs):
        raise AssertionError("features prepared before the resume check")

    monkeypatch.setattr(moaspec.train.run, "open_feature_cache", prepared)
    narrowed = dataclasses.replace(config, memory_layers=2)
    with pytest.raises(ValueError, match=r"another training config \(memory_layers 0 -> 2\)"):
        run_training(dataclasses.replace(spec, feature_cache=tmp_path / "features"), narrowed, TreeConfig())

    # a finished run rerun says so without loading the target (an audit's: it loaded it and showed the bar)
    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded for a finished run")

    monkeypatch.setattr(moaspec.api, "load_target", no_load)
    assert run_training(spec, config, TreeConfig(depth=2, top_k=2, budget=3)) == checkpoint
    assert "is complete already (3 steps): nothing to train" in capsys.readouterr().err
    logged = json.loads((tmp_path / "run" / "runs.jsonl").read_text().splitlines()[-1])
    assert (logged["steps_done"], logged["ended"]) == (3, "complete")
    # another --draft-vocab is not in the training config: the full path, whose checks refuse it
    with pytest.raises(AssertionError, match="the target was loaded"):
        run_training(dataclasses.replace(spec, draft_vocab=30), config, TreeConfig(depth=2, top_k=2, budget=3))
    monkeypatch.setattr(moaspec.api, "load_target", lambda name, dtype=None, **kwargs: target)
    with pytest.raises(ValueError, match=r"another shape \(draft_vocab_size 20 -> 30"):
        run_training(dataclasses.replace(spec, draft_vocab=30), config, TreeConfig(depth=2, top_k=2, budget=3))
    # a run resumes only with the validation records it started with
    stale = json.loads((checkpoint / "config.json").read_text())
    stale["training"]["val_indices"] = [0, 1]  # as an older moaspec held out the first records
    (checkpoint / "config.json").write_text(json.dumps(stale))
    with pytest.raises(MoaspecError, match="other validation records"):
        run_training(spec, config, TreeConfig(depth=2, top_k=2, budget=3))
    stale["training"]["val_indices"] = [0, 3]
    (checkpoint / "config.json").write_text(json.dumps(stale))
    # other data (an audit's: it resumed on it and recorded it as the run's) or another
    # --val-conversations are refused naming them
    other = tmp_path / "other"
    other.mkdir()
    (other / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:5]))
    with pytest.raises(MoaspecError, match=rf"started on other data \(--data {data}: 4 training sequences of 72 tokens; "
                       rf"--data {other}: 3 of 54\)"):
        run_training(dataclasses.replace(spec, data_dirs=(other,)), config, TreeConfig(depth=2, top_k=2, budget=3))
    with pytest.raises(MoaspecError, match="started with --val-conversations 2, not 1"):
        run_training(dataclasses.replace(spec, val_conversations=1), config, TreeConfig(depth=2, top_k=2, budget=3))
    (checkpoint / "config.json").write_text(json.dumps({**stale, "training": None}))
    with pytest.raises(MoaspecError, match=r"config.json is not a readable drafter config \(its 'training' is not an object\)"):
        run_training(spec, config, TreeConfig(depth=2, top_k=2, budget=3))
    (checkpoint / "config.json").write_text(json.dumps(stale))

    # an interrupted run is logged too, with the step it saved
    import moaspec.train.trainer

    real_batch_loss, calls = moaspec.train.trainer.batch_loss, []

    def cut_in_step_2(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # two sequences a step, one at a time
            raise KeyboardInterrupt
        return real_batch_loss(*args, **kwargs)

    monkeypatch.setattr(moaspec.train.trainer, "batch_loss", cut_in_step_2)
    cut = dataclasses.replace(spec, out_dir=tmp_path / "cut")
    with pytest.raises(KeyboardInterrupt):
        run_training(cut, config, TreeConfig())
    logged = json.loads((tmp_path / "cut" / "runs.jsonl").read_text())
    assert (logged["steps_done"], logged["ended"]) == (1, "interrupted")
    from moaspec.signals import Terminated

    calls.clear()
    real_cut = cut_in_step_2

    def terminated_in_step_2(*args, **kwargs):
        try:
            return real_cut(*args, **kwargs)
        except KeyboardInterrupt:
            raise Terminated from None

    monkeypatch.setattr(moaspec.train.trainer, "batch_loss", terminated_in_step_2)
    with pytest.raises(Terminated):
        run_training(dataclasses.replace(spec, out_dir=tmp_path / "terminated"), config, TreeConfig())
    logged = json.loads((tmp_path / "terminated" / "runs.jsonl").read_text())
    assert (logged["steps_done"], logged["ended"]) == (1, "terminated")


def test_validation_records_are_spaced_through_the_data() -> None:
    from moaspec.train.run import split_validation

    samples = [TrainSample(torch.arange(4), 2, index=i) for i in range(10)]
    validation, training = split_validation(samples, 4)
    assert [s.index for s in validation] == [0, 2, 5, 7]
    assert [s.index for s in training] == [1, 3, 4, 6, 8, 9]
    with pytest.raises(MoaspecError, match="cannot spare 10"):
        split_validation(samples, 10)


def test_init_from_copies_the_weights_and_refuses_another_architecture(tmp_path) -> None:
    """A TLI-0 checkpoint starts a TLI-1 net with the same weights (TLI adds none); other sizes refuse."""
    from moaspec.nn.checkpoint import read_checkpoint
    from moaspec.train.run import load_initial_weights

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    source = build_net("moa", target, 0, torch.arange(0, 97, 3))
    checkpoint = source.save_pretrained(tmp_path / "ckpt", target, training={"step": 7, "command": "c"})
    torch.manual_seed(1)
    fresh = build_net("moa", target, 0, torch.arange(0, 97, 3))
    assert load_initial_weights(fresh, checkpoint, target, TrainConfig()) == {"path": str(checkpoint), "step": 7, "command": "c"}
    _, saved = read_checkpoint(checkpoint, target)
    for name, value in fresh.state_dict().items():
        assert value.dtype == (torch.float32 if value.is_floating_point() else torch.long)
        torch.testing.assert_close(value, saved[name].to(value.dtype), rtol=0, atol=0, msg=name)
    with_tli = build_net("moa", target, 1, torch.arange(0, 97, 3))
    load_initial_weights(with_tli, checkpoint, target, TrainConfig(tli_layers=1))
    for name, value in with_tli.state_dict().items():
        torch.testing.assert_close(value, saved[name].to(value.dtype), rtol=0, atol=0, msg=name)
    with pytest.raises(MoaspecError, match="does not fit"):
        load_initial_weights(build_net("moa", target, 0, torch.arange(0, 97, 2)), checkpoint, target, TrainConfig())
    with pytest.raises(MoaspecError, match="holds a drafter of method 'moa', not 'eagle'"):
        load_initial_weights(build_net("eagle", target, 0, None), checkpoint, target, TrainConfig(method="eagle"))


def test_init_from_widens_moas_feed_forward_layers_keeping_its_function(tmp_path) -> None:
    """A wider --intermediate-size starts from a narrower MoA checkpoint: its units kept, the new
    ones' output weights at zero, so both feed-forward layers compute what they did; the width
    not given is the checkpoint's, and a narrower one is refused."""
    from moaspec.train.run import initial_feed_forward_width, load_initial_weights

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    vocab = torch.arange(0, 97, 3)
    torch.manual_seed(0)
    narrow = build_net("moa", target, 0, vocab)
    width = narrow.config.intermediate_size
    checkpoint = narrow.save_pretrained(tmp_path / "narrow", target, training={"step": 3})
    narrow = build_net("moa", target, 0, vocab)
    load_initial_weights(narrow, checkpoint, target, TrainConfig())  # the float16-rounded weights, as saved
    config = TrainConfig(intermediate_size=2 * width)
    torch.manual_seed(1)
    wide = build_net("moa", target, 0, vocab, intermediate_size=initial_feed_forward_width(config, checkpoint))
    assert wide.config.intermediate_size == 2 * width
    load_initial_weights(wide, checkpoint, target, config)
    x = torch.randn(5, narrow.config.hidden_size)
    for module in ("ca_mlp", "self_attention.mlp"):
        before, after = narrow.get_submodule(module), wide.get_submodule(module)
        torch.testing.assert_close(after(x), before(x), rtol=1e-6, atol=1e-6, msg=module)
        assert torch.count_nonzero(after.gate_proj.weight[width:]) > 0  # active new units: their output weights learn at once
        assert torch.count_nonzero(after.down_proj.weight[:, width:]) == 0
    narrow_state = narrow.state_dict()
    for name, value in wide.state_dict().items():
        if not name.startswith(("ca_mlp.", "self_attention.mlp.")):
            torch.testing.assert_close(value, narrow_state[name], rtol=0, atol=0, msg=name)
    wide_checkpoint = wide.save_pretrained(tmp_path / "wide", target, training={"step": 4})
    assert initial_feed_forward_width(TrainConfig(), wide_checkpoint) == 2 * width  # continues the wide shape
    assert initial_feed_forward_width(TrainConfig(intermediate_size=3 * width), wide_checkpoint) == 3 * width
    assert initial_feed_forward_width(TrainConfig(), None) == 0
    assert initial_feed_forward_width(TrainConfig(method="eagle"), wide_checkpoint) == 0
    with pytest.raises(MoaspecError, match=f"intermediate_size {2 * width} vs {width}"):
        load_initial_weights(build_net("moa", target, 0, vocab), wide_checkpoint, target, TrainConfig())
    with pytest.raises(ValueError, match="apply to the moa method only"):
        TrainConfig(method="eagle", intermediate_size=64)


def test_training_on_distilled_and_teacher_forced_data_with_a_narrowed_memory(tmp_path, monkeypatch, capsys) -> None:
    """Both record kinds train together (the draft vocabulary comes from learned tokens only), and
    an all-layer MoA checkpoint starts a last-layer MoA: the layer mix keeps that layer's weight."""
    import json

    import moaspec.api
    from moaspec.config import TreeConfig
    from moaspec.nn.checkpoint import read_checkpoint
    from moaspec.train.run import RunSpec, load_samples, run_training

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    monkeypatch.setattr(moaspec.api, "load_target", lambda name, dtype=None, **kwargs: target)
    gen = torch.Generator().manual_seed(5)
    distilled, conversations = tmp_path / "distilled", tmp_path / "conversations"
    distilled.mkdir(), conversations.mkdir()
    rows = [
        {"id": str(i), "prompt_ids": torch.randint(0, 97, (6,), generator=gen).tolist(),
         "response_ids": torch.randint(0, 40, (10,), generator=gen).tolist(), "mode": "greedy", "seed": None}
        for i in range(4)
    ]
    (distilled / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    user = lambda: torch.randint(60, 97, (5,), generator=gen).tolist()  # noqa: E731
    reply = lambda: torch.randint(40, 60, (6,), generator=gen).tolist()  # noqa: E731
    rows = [
        {"id": f"c{i}", "input_ids": user() + reply() + user() + reply(), "loss_spans": [[5, 11], [16, 22]],
         "mode": "teacher-forced"}
        for i in range(4)
    ]
    (conversations / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_samples((distilled, conversations), max_seq_len=20)
    assert [s.index for s in loaded] == list(range(8))
    assert loaded[4].spans() == ((5, 11), (16, 20)) and loaded[0].spans() == ((6, 16),)
    config = TrainConfig(method="moa", steps=2, batch_size=2, val_every=2, ckpt_every=2)
    spec = RunSpec((distilled, conversations), tmp_path / "all", "tiny", draft_vocab=70, val_conversations=2,
                   time_limit_s=None, command="moaspec train ...", micro_batch=2)
    all_layers = run_training(spec, config, TreeConfig(depth=2, top_k=2, budget=3))
    record, weights = read_checkpoint(all_layers, target)
    size = weights["draft_vocab_ids"].numel()
    assert size < 70 and f"--draft-vocab 70 is more than the {size} tokens" in capsys.readouterr().err  # said, not silent
    assert set(record["training"]["last"]) >= {"acc_depth1", "val_tau"}
    vocab = set(weights["draft_vocab_ids"].tolist())
    assert vocab <= set(range(60))  # learned tokens only (an audit's: the check read as its own alternative)
    narrowed = TrainConfig(method="moa", steps=2, batch_size=2, val_every=2, ckpt_every=2, memory_layers=1)
    spec = RunSpec((distilled, conversations), tmp_path / "last", "tiny", draft_vocab=70, val_conversations=2,
                   time_limit_s=None, command="moaspec train --memory-layers 1 ...", init_from=all_layers)
    mix = weights["layer_mix_raw"].float()
    last = run_training(spec, narrowed, TreeConfig(depth=2, top_k=2, budget=3))
    record, _ = read_checkpoint(last, target)
    assert record["config"]["memory_layers"] == 1
    initial = build_net("moa", target, 0, weights["draft_vocab_ids"], memory_layers=1)
    from moaspec.train.run import load_initial_weights

    load_initial_weights(initial, all_layers, target, narrowed)
    assert torch.equal(initial.layer_mix_raw.detach(), mix[2:])
    with pytest.raises(MoaspecError, match="memory_layers 1 vs 0"):
        load_initial_weights(build_net("moa", target, 0, weights["draft_vocab_ids"]), last, target, config)
    # a memory that also reads the target's last hidden state continues the same checkpoint
    hidden = TrainConfig(method="moa", steps=2, batch_size=2, val_every=2, ckpt_every=2, memory_hidden=True)
    spec = RunSpec((distilled, conversations), tmp_path / "hidden", "tiny", draft_vocab=70, val_conversations=2,
                   time_limit_s=None, command="moaspec train --memory-hidden ...", init_from=all_layers, micro_batch=2)
    record, hidden_weights = read_checkpoint(run_training(spec, hidden, TreeConfig(depth=2, top_k=2, budget=3)), target)
    assert record["config"]["memory_hidden"] and torch.count_nonzero(hidden_weights["h2m.weight"]) > 0
    started = build_net("moa", target, 0, weights["draft_vocab_ids"], memory_hidden=True)
    load_initial_weights(started, all_layers, target, hidden)
    assert torch.count_nonzero(started.h2m.weight) == 0
    with pytest.raises(MoaspecError, match="memory_hidden True vs False"):
        plain = build_net("moa", target, 0, weights["draft_vocab_ids"])
        load_initial_weights(plain, tmp_path / "hidden" / "checkpoint", target, config)
    # the layer-attention ablation starts from any MoA checkpoint without its LSA, not the reverse
    ablated = TrainConfig(method="moa", steps=2, batch_size=2, val_every=2, ckpt_every=2, layer_attention=False)
    spec = RunSpec((distilled, conversations), tmp_path / "no-lsa", "tiny", draft_vocab=70, val_conversations=2,
                   time_limit_s=None, command="moaspec train --no-layer-attention ...", init_from=all_layers)
    record, ablated_weights = read_checkpoint(run_training(spec, ablated, TreeConfig(depth=2, top_k=2, budget=3)), target)
    assert not record["config"]["layer_attention"]
    assert not any(name.startswith("layer_self_attention.") for name in ablated_weights)
    started = build_net("moa", target, 0, weights["draft_vocab_ids"], layer_attention=False)
    load_initial_weights(started, all_layers, target, ablated)
    torch.testing.assert_close(started.ekv2e.weight.detach(), weights["ekv2e.weight"].float())
    with pytest.raises(MoaspecError, match="layer_attention False vs True"):
        plain = build_net("moa", target, 0, weights["draft_vocab_ids"])
        load_initial_weights(plain, tmp_path / "no-lsa" / "checkpoint", target, config)
    # so does the cross-attention ablation (its weights kept, unused)
    no_ca = TrainConfig(method="moa", steps=2, batch_size=2, val_every=2, ckpt_every=2, cross_attention=False)
    started = build_net("moa", target, 0, weights["draft_vocab_ids"], cross_attention=False)
    load_initial_weights(started, all_layers, target, no_ca)
    assert not started.config.cross_attention
    torch.testing.assert_close(started.cross_attention.q_proj.weight.detach(), weights["cross_attention.q_proj.weight"].float())


def test_an_interrupt_mid_step_or_mid_validation_resumes_exactly(tmp_path, monkeypatch) -> None:
    """Ctrl-C / SIGTERM inside a step (its sequences drawn, half its micro-batches run) keeps the
    last completed step and rewinds the draws, and one inside the last step's validation keeps
    the step and validates it on resume: the result equals an uninterrupted run bit for bit."""
    import moaspec.train.trainer as trainer

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data, val = samples(4, 1), samples(1, 2)
    config = TrainConfig(method="moa", steps=6, batch_size=2, warmup_steps=2, val_every=3, ckpt_every=3)
    torch.manual_seed(0)
    straight = make_net("moa", target)
    reference = train(straight, target, data, val, config, tmp_path / "straight", progress=False)

    real_batch_loss, real_validate, calls = trainer.batch_loss, trainer.validate, []

    def batch_loss_cut_in_step_5(*args, **kwargs):  # calls: 2 per step, 1 for step 3's validation
        calls.append(1)
        if len(calls) == 11:  # step 5's second micro-batch
            raise KeyboardInterrupt
        return real_batch_loss(*args, **kwargs)

    def validate_cut(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "cut"
    torch.manual_seed(0)
    monkeypatch.setattr(trainer, "batch_loss", batch_loss_cut_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(make_net("moa", target), target, data, val, config, out, progress=False, micro_batch=1)
    monkeypatch.setattr(trainer, "batch_loss", real_batch_loss)
    monkeypatch.setattr(trainer, "validate", validate_cut)  # the validation of step 6
    with pytest.raises(KeyboardInterrupt):
        train(make_net("moa", target), target, data, val, config, out, progress=False)
    monkeypatch.setattr(trainer, "validate", real_validate)
    resumed = make_net("moa", target)
    state = train(resumed, target, data, val, config, out, progress=False)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert [r["loss"] for r in state.history] == [r["loss"] for r in reference.history]
    assert [r["step"] for r in state.history if "val_loss" in r] == [3, 6]
    assert state.history[-1]["val_loss"] == reference.history[-1]["val_loss"]


def test_an_interrupt_during_the_optimizer_update_lands_after_it(tmp_path, monkeypatch) -> None:
    """Ctrl-C arriving while AdamW updates the weights is delivered once the step counts as done:
    the saved state is never half a step, and the resumed run equals an uninterrupted one."""
    import signal

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data = samples(4, 1)
    config = TrainConfig(method="moa", steps=4, batch_size=2, warmup_steps=1, val_every=100, ckpt_every=2)
    torch.manual_seed(0)
    straight = make_net("moa", target)
    train(straight, target, data, [], config, tmp_path / "straight", progress=False)

    real_step, updates = torch.optim.AdamW.step, []

    def step_then_ctrl_c(self, *args, **kwargs):
        result = real_step(self, *args, **kwargs)
        updates.append(1)
        if len(updates) == 3:  # step 3's update done, its bookkeeping not yet
            signal.raise_signal(signal.SIGINT)
        return result

    out = tmp_path / "cut"
    torch.manual_seed(0)
    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        train(make_net("moa", target), target, data, [], config, out, progress=False)
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 3
    resumed = make_net("moa", target)
    train(resumed, target, data, [], config, out, progress=False)
    for (name, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_second_interrupt_while_the_first_ones_save_runs_waits_for_it(tmp_path, monkeypatch) -> None:
    """An audit's: Ctrl-C twice (the second while the first one's save was writing) left only the
    staging file, no state: the whole run lost. The save holds signals; the second is delivered
    after it."""
    import signal

    import moaspec.train.trainer as trainer

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    config = TrainConfig(method="moa", steps=6, batch_size=2, warmup_steps=1, val_every=100, ckpt_every=100)
    real_batch_loss, real_save, calls = trainer.batch_loss, torch.save, []

    def cut_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real_batch_loss(*args, **kwargs)

    def save_then_ctrl_c(record, path):
        real_save(record, path)  # the staging file written, not yet moved into place
        signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(trainer, "batch_loss", cut_in_step_3)
    monkeypatch.setattr(trainer.torch, "save", save_then_ctrl_c)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(make_net("moa", target), target, samples(4, 1), [], config, out, progress=False, micro_batch=1)
    assert torch.load(out / "train_state.pt", weights_only=False)["step"] == 2
    assert not [path.name for path in out.iterdir() if "tmp" in path.name]
    # SIGTERM first, Ctrl-C during its save: the first decides how the command ends (143, not 130)
    from moaspec.signals import Terminated

    def terminated_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise Terminated
        return real_batch_loss(*args, **kwargs)

    calls.clear()
    monkeypatch.setattr(trainer, "batch_loss", terminated_in_step_3)
    with pytest.raises(Terminated):
        train(make_net("moa", target), target, samples(4, 1), [], config, tmp_path / "term", progress=False, micro_batch=1)
    assert torch.load(tmp_path / "term" / "train_state.pt", weights_only=False)["step"] == 2


def test_a_damaged_state_is_one_error_naming_it(tmp_path) -> None:
    """An audit's: a truncated or foreign train_state.pt ended `moaspec train` in torch's traceback."""
    from moaspec.train.train_state import saved_state

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    config = TrainConfig(method="moa", steps=2, batch_size=1, warmup_steps=1, val_every=100, ckpt_every=1)
    run = tmp_path / "run"
    train(make_net("moa", target), target, samples(2, 1), [], config, run, progress=False)
    whole = (run / "train_state.pt").read_bytes()
    for damaged in (whole[:1000], b"not a torch file", None):
        if damaged is None:
            torch.save({"step": 2}, run / "train_state.pt")  # torch's, lacking the rest
        else:
            (run / "train_state.pt").write_bytes(damaged)
        with pytest.raises(MoaspecError, match=r"train_state.pt is not a readable training state \(.+\); remove it"):
            saved_state(run)
        with pytest.raises(MoaspecError, match="is not a readable training state"):
            train(make_net("moa", target), target, samples(2, 1), [], config, run, progress=False)


def test_resuming_with_other_settings_names_them(tmp_path) -> None:
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    config = TrainConfig(method="moa", steps=2, batch_size=1, warmup_steps=1, val_every=100, ckpt_every=1)
    train(make_net("moa", target), target, samples(2, 1), [], config, tmp_path / "run", progress=False)
    longer = TrainConfig(method="moa", steps=3, batch_size=1, warmup_steps=1, val_every=100, ckpt_every=1)
    with pytest.raises(ValueError, match=r"another training config \(steps 2 -> 3\).*--init-from"):
        train(make_net("moa", target), target, samples(2, 1), [], longer, tmp_path / "run", progress=False)
    # a network of another shape (e.g. --draft-vocab changed) is named too, not a load_state_dict crash
    reduced = make_net("moa", target, vocab=torch.arange(40))
    with pytest.raises(ValueError, match=r"another shape \(draft_vocab_size 0 -> 40\)"):
        train(reduced, target, samples(2, 1), [], config, tmp_path / "run", progress=False)
    state = torch.load(tmp_path / "run" / "train_state.pt", weights_only=False)
    del state["net_config"]  # a state saved before the network's config was: its tensors' shapes are compared
    torch.save(state, tmp_path / "run" / "train_state.pt")
    with pytest.raises(ValueError, match=r"another shape \(draft_vocab_ids \(0,\) -> \(40,\)"):
        train(make_net("moa", target, vocab=torch.arange(40)), target, samples(2, 1), [], config, tmp_path / "run", progress=False)


def test_training_data_of_another_target_or_shape_is_refused_naming_it(tmp_path) -> None:
    from moaspec.train.distill import check_data_target
    from moaspec.train.run import load_samples

    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(MoaspecError, match=r"shard-00000.jsonl:1 is not a record of this data \(id, prompt_ids, response_ids"):
        load_samples([data], 64)
    good = {"id": "c0", "input_ids": list(range(10)), "loss_spans": [[2, 8]], "mode": "teacher-forced"}
    (data / "shard-00000.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({**good, "input_ids": "0 1 2"}) + "\n")
    with pytest.raises(MoaspecError, match=r"shard-00000.jsonl:2 is not a record of this data \(input_ids missing or mistyped\)"):
        load_samples([data], 64)
    (data / "shard-00000.jsonl").write_text(json.dumps({**good, "loss_spans": [[2]]}) + "\n")  # well typed, wrong shape
    with pytest.raises(MoaspecError, match="holds a record that is not training data"):
        load_samples([data], 64)
    (data / "manifest.json").write_text(json.dumps({"target": "smollm2-135m"}))
    check_data_target((data,), "smollm2-135m")
    with pytest.raises(MoaspecError, match="made by target 'smollm2-135m', not 'tiny-llama'"):
        check_data_target((data,), "tiny-llama")
    (data / "manifest.json").write_text("{not json")
    with pytest.raises(MoaspecError, match="manifest.json is not readable JSON"):
        check_data_target((data,), "tiny-llama")


def test_feature_cache_matches_online_features_and_resumes(tmp_path, monkeypatch) -> None:
    """The fp16 cache gives the online features to fp16 precision (TLI keys/values included),
    an interrupted build resumes to the same arrays, and other data or depths are refused."""
    import json

    import numpy as np

    from moaspec.train import feature_cache
    from moaspec.train.feature_cache import FeatureCache, build_feature_cache

    target = make_tiny_target("qwen2", num_hidden_layers=3, dtype=torch.float32)
    data = [TrainSample(sample.input_ids[: 10 + 3 * sample.index], 4, sample.index) for sample in samples(5, 7)]
    monkeypatch.setattr(feature_cache, "SAVE_EVERY", 2)
    all_layers = (0, 1, 2)
    cache = build_feature_cache(target, data, tmp_path / "full", "fp", tli_max=2, kv_layers=all_layers, progress=False)
    online = OnlineFeatures(target)
    for sample in data:
        for tli in (0, 1, 2):
            expected, got = online.features(sample, tli, all_layers), cache.features(sample, tli, all_layers)
            scale = dict(rtol=2e-3, atol=2e-3)
            torch.testing.assert_close(got.layer_kv, expected.layer_kv, **scale)
            torch.testing.assert_close(got.final_hidden, expected.final_hidden, **scale)
            torch.testing.assert_close(got.target_logsumexp, expected.target_logsumexp, **scale)
            assert torch.equal(got.target_argmax, expected.target_argmax)
            assert len(got.tli_kv) == tli
            for (k, v), (k_ref, v_ref) in zip(got.tli_kv, expected.tli_kv):
                torch.testing.assert_close(k, k_ref, **scale)
                torch.testing.assert_close(v, v_ref, **scale)
            if tli:
                torch.testing.assert_close(got.tli_hidden, expected.tli_hidden, **scale)

    class Interrupt(Exception):
        pass

    calls = {"n": 0}
    original = target.prefill

    def failing_prefill(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise Interrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(target, "prefill", failing_prefill)
    with pytest.raises(Interrupt):
        build_feature_cache(target, data, tmp_path / "resumed", "fp", tli_max=2, kv_layers=all_layers, progress=False)
    monkeypatch.setattr(target, "prefill", original)
    with pytest.raises(MoaspecError, match="incomplete"):
        FeatureCache(tmp_path / "resumed")
    resumed = build_feature_cache(target, data, tmp_path / "resumed", "fp", tli_max=2, kv_layers=all_layers, progress=False)
    for name in ("layer_kv", "hidden", "lse", "argmax"):
        assert np.array_equal(np.load(tmp_path / "full" / f"{name}.npy"), np.load(tmp_path / "resumed" / f"{name}.npy"))
    resumed.check(data, "fp", 2, all_layers)
    with pytest.raises(MoaspecError, match="other data"):
        resumed.check(data[:4], "fp", 0, ())
    with pytest.raises(MoaspecError, match="another target"):
        resumed.check(data, "other", 0, ())
    with pytest.raises(MoaspecError, match="TLI depths up to 2"):
        resumed.check(data, "fp", 3, ())
    index = json.loads((tmp_path / "full" / "index.json").read_text())
    (tmp_path / "full" / "index.json").write_text(json.dumps({**index, "version": 1}))  # an older moaspec's cache
    with pytest.raises(MoaspecError, match="another moaspec version"):
        build_feature_cache(target, data, tmp_path / "full", "fp", tli_max=2, kv_layers=all_layers, progress=False)


def test_feature_cache_stores_only_what_the_drafter_reads(tmp_path) -> None:
    """EAGLE's cache holds no keys/values and one hidden state per token; a MoA cache reading the
    last layer holds that layer only and refuses a drafter that reads more."""
    import numpy as np

    from moaspec.train.feature_cache import build_feature_cache

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data = samples(2, 3)
    eagle = build_feature_cache(target, data, tmp_path / "eagle", "fp", tli_max=0, kv_layers=(), progress=False)
    assert np.load(tmp_path / "eagle" / "layer_kv.npy").shape[1] == 0
    assert np.load(tmp_path / "eagle" / "hidden.npy").shape[1] == 1
    eagle.check(data, "fp", 0, ())
    moa = build_feature_cache(target, data, tmp_path / "moa", "fp", tli_max=0, kv_layers=(2,), progress=False)
    assert np.load(tmp_path / "moa" / "layer_kv.npy").shape[1] == 1
    online = OnlineFeatures(target).features(data[0], 0, (2,))
    torch.testing.assert_close(moa.features(data[0], 0, (2,)).layer_kv, online.layer_kv, rtol=2e-3, atol=2e-3)
    with pytest.raises(MoaspecError, match=r"lacks the keys/values of target layers \[1\]"):
        moa.check(data, "fp", 0, (1, 2))


def test_the_readmes_three_runs_share_one_all_layer_cache(tmp_path) -> None:
    """Bug (a user's audit): the README trains MoA TLI 0, MoA TLI 1 and EAGLE-2 on one
    --feature-cache, but the cache MoA TLI 0 built held no TLI stream and refused the second run.
    An all-layer cache now keeps the stream entering the last layer too; a smaller cache still
    refuses what it lacks, saying what to do."""
    from moaspec.train.run import open_feature_cache

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data = samples(2, 3)
    all_layers = (0, 1, 2)
    cache = open_feature_cache(target, data, tmp_path / "shared", 0, all_layers)  # MoA TLI 0 builds it
    assert cache.tli_max == 1
    online = OnlineFeatures(target).features(data[0], 1, all_layers)
    for tli, kv_layers in ((1, all_layers), (0, ())):  # MoA TLI 1, then EAGLE-2, from the same cache
        got = open_feature_cache(target, data, tmp_path / "shared", tli, kv_layers).features(data[0], tli, kv_layers)
        torch.testing.assert_close(got.final_hidden, online.final_hidden, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(cache.features(data[0], 1, all_layers).tli_hidden, online.tli_hidden, rtol=2e-3, atol=2e-3)
    open_feature_cache(target, data, tmp_path / "eagle", 0, ())  # EAGLE-2's alone: one hidden state a token
    with pytest.raises(MoaspecError, match=r"holds TLI depths up to 0, not 1; use another --feature-cache"):
        open_feature_cache(target, data, tmp_path / "eagle", 1, ())


@pytest.mark.parametrize("method, tli", [("moa", 1), ("eagle", 0)])
def test_training_from_the_feature_cache_follows_online_training(tmp_path, method: str, tli: int) -> None:
    """Same seeds, cached vs online features: the loss curves agree to fp16 feature precision."""
    from moaspec.train.feature_cache import build_feature_cache

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data = samples(3, 4)
    kv_layers = (0, 1, 2) if method == "moa" else ()
    cache = build_feature_cache(target, data, tmp_path / "cache", "fp", tli_max=tli, kv_layers=kv_layers, progress=False)
    config = TrainConfig(method=method, tli_layers=tli, steps=4, batch_size=2, warmup_steps=1, val_every=1000, ckpt_every=1000)
    histories = []
    for name, source in (("online", None), ("cached", cache)):
        torch.manual_seed(0)
        net = make_net(method, target, tli)
        histories.append([r["loss"] for r in train(net, target, data, [], config, tmp_path / name, progress=False, source=source).history])
    assert histories[0] == pytest.approx(histories[1], rel=1e-3)  # fp16 features: measured 2e-5 apart


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_first_guesses_are_the_positions_validation_scores_at_draft_depth_one(tmp_path, method: str) -> None:
    """first_guesses (the bench's view of draft depth 1) agrees with validation_counts: the same
    positions and the same hits, on a net overfitted until it hits some."""
    from moaspec.train.trainer import first_guesses, validation_counts

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = make_net(method, target)
    config = TrainConfig(method=method, steps=40, batch_size=1, lr=1e-2, min_lr=1e-2, warmup_steps=1, val_every=1000, ckpt_every=1000)
    data = samples(2, 3)
    train(net, target, data[:1], [], config, tmp_path / "run", progress=False)
    source = OnlineFeatures(target)
    parts = target.parts(0)
    counts = validation_counts(net, parts, source, data, config, 6)
    depth = 2 if method == "moa" else 1  # MoA's acc_depth1 is the anchor itself
    hits = positions = 0
    net.eval()
    for sample in data:
        features = source.features(sample, 0, tuple(range(3)) if method == "moa" else ())
        with torch.inference_mode():
            roots, guesses = first_guesses(net, parts, sample, features, config, 6)
        assert bool((roots >= sample.response_start).all()) and bool((roots < sample.input_ids.numel() - 1).all())
        hits += int((guesses == features.target_argmax[roots]).sum())
        positions += roots.numel()
    assert positions == int(counts.counts[depth]) > 0
    assert hits == int(counts.hits[depth]) > 0


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_tau_probe_runs_the_engine_on_a_copy_of_the_network(method: str) -> None:
    from moaspec.config import GenerationConfig, TreeConfig
    from moaspec.drafters.eagle import EagleDrafter
    from moaspec.drafters.moa import MoADrafter
    from moaspec.engine import Engine
    from moaspec.train.tau_probe import TAU_NEW_TOKENS, measure_tau

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = make_net(method, target).train()
    before = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    val = samples(2, 5)
    tree = TreeConfig(depth=2, top_k=2, budget=3)
    tau = measure_tau(net, method, target, val, tree)
    assert net.training and all(torch.equal(before[name], t) for name, t in net.state_dict().items())
    # the same measurement by hand, with the inference drafter around the same weights
    drafter = {"moa": MoADrafter, "eagle": EagleDrafter}[method](make_net(method, target).eval(), target, tree)
    drafter.net.load_state_dict(before)
    engine = Engine(target, drafter)
    runs = [engine.generate(s.input_ids[: s.response_start], generation=GenerationConfig(max_new_tokens=TAU_NEW_TOKENS)).stats for s in val]
    assert tau == sum(r.forward_tokens for r in runs) / sum(r.target_forwards for r in runs)


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_mixed_precision_training_runs_the_gpu_code_path_on_the_cpu(tmp_path, method: str) -> None:
    """The path `--device cuda` takes (features moved to the target's device, bfloat16 autocast,
    CPU-made masks moved over, val_tau skipped off the CPU only) runs here with autocast on the
    CPU, in padded micro-batches as a GPU run would: the loss is finite and within bfloat16 error
    of the float32 run's, validation works."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data = unequal_samples(11)
    config = TrainConfig(method=method, steps=2, batch_size=3, warmup_steps=1, val_every=2, ckpt_every=1000)
    losses = []
    for autocast in (False, True):
        torch.manual_seed(0)
        net = make_net(method, target)
        state = train(
            net, target, data[:3], data[3:], config, tmp_path / str(autocast), progress=False, autocast=autocast,
            micro_batch=3 if autocast else 1,
        )
        losses.append(state.history[0]["loss"])
        assert "acc_depth1" in state.history[-1] and "val_tau" in state.history[-1]
    # measured (AVX2 EPYC): bfloat16 moves the first loss by 1e-5-5e-5 of it, padded micro-batches
    # alone by 2e-8, so autocast did engage, and stayed within bfloat16's error (the bound was 5 %,
    # an audit's)
    assert math.isfinite(losses[1]) and losses[1] == pytest.approx(losses[0], rel=1e-3)
    assert losses[1] != pytest.approx(losses[0], rel=1e-7)


def test_train_device_flag_is_checked_before_loading(tmp_path, capsys) -> None:
    from moaspec.cli import main

    data = tmp_path / "d"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text("{}\n")
    for device, message in (("gpu", "cpu or cuda"), ("cuda:7", "no such CUDA device")):
        code = main(["train", "--method", "moa", "--data", str(data), "--out", str(tmp_path / "o"), "--device", device])
        assert code != 0 and message in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_target_features_of_a_padded_batch_are_those_of_each_sequence(family: str) -> None:
    """One right-padded target forward over sequences of unequal lengths gives each sequence's
    own features (float64): keys/values of the layers read, both hidden states TLI reads, the
    teacher's summary. SDPA attention: transformers' eager attention takes its softmax in float32
    even for a float64 model, and how a float32 row of 12 or 31 columns rounds depends on the
    CPU's vector width (equal on an AVX2 EPYC, 2e-7 apart on an AVX-512 one)."""
    from moaspec.train.features import batch_target_features, target_features

    target = make_tiny_target(family, num_hidden_layers=3, attn="sdpa")
    sequences = [sample.input_ids for sample in unequal_samples(4)]
    together = batch_target_features(target, sequences, tli_layers=1, kv_layers=(0, 2))
    for sequence, got in zip(sequences, together, strict=True):
        expected = target_features(target, sequence, tli_layers=1, kv_layers=(0, 2))
        assert got.layer_kv.shape == (sequence.numel(), 2, expected.layer_kv.shape[-1])
        for name in ("layer_kv", "final_hidden", "target_logsumexp", "tli_hidden"):
            torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-9, atol=1e-9, msg=name)
        assert torch.equal(got.target_argmax, expected.target_argmax)
        (k, v), (k_expected, v_expected) = got.tli_kv[0], expected.tli_kv[0]
        torch.testing.assert_close((k, v), (k_expected, v_expected), rtol=1e-9, atol=1e-9)
    assert target.num_cached == 0  # the verified context is left empty, as after target_features


@pytest.mark.parametrize("method, tli", [("moa", 0), ("moa", 1), ("eagle", 0)])
def test_a_padded_batch_has_the_loss_and_gradient_of_its_sequences_one_at_a_time(method: str, tli: int) -> None:
    """batch_loss over sequences of unequal lengths (padded, staircase on some) = the mean of
    their own losses, gradients included, in float64: padding never reaches a real token and
    every sequence weighs the same whatever its length."""
    from moaspec.train.trainer import Draw, batch_loss, feature_noise, kv_layers_read

    target = make_tiny_target("llama", num_hidden_layers=3)
    torch.manual_seed(0)
    net = make_net(method, target, tli, torch.arange(0, 97, 2))
    config = TrainConfig(method=method, tli_layers=tli, anchor_loss_weight=0.5)
    parts = target.parts(tli)
    generator = torch.Generator().manual_seed(3)
    draws = [
        Draw(sample, every, staircase, feature_noise(config, sample, net.config.hidden_size, generator))
        for sample, every, staircase in zip(unequal_samples(7), (3, 5, 4, 2), (True, False, True, False))
    ]
    source = OnlineFeatures(target)
    features = [source.features(draw.sample, tli, kv_layers_read(net, config)) for draw in draws]

    def loss_and_grads(groups: list[list[int]]) -> tuple[list[float], dict[str, torch.Tensor]]:
        net.zero_grad(set_to_none=True)
        parts_sum = [0.0, 0.0, 0.0, 0.0]
        for group in groups:
            loss = batch_loss(net, parts, [draws[i] for i in group], [features[i] for i in group], config)
            (loss.total * len(group) / len(draws)).backward()
            for k, value in enumerate((loss.total, loss.soft_ce, loss.feature, loss.top1)):
                parts_sum[k] += float(value.detach()) * len(group) / len(draws)
        return parts_sum, {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}

    one_at_a_time, grads_single = loss_and_grads([[0], [1], [2], [3]])
    together, grads_batched = loss_and_grads([[0, 1, 2, 3]])
    assert together[:3] == pytest.approx(one_at_a_time[:3], rel=1e-9)
    assert together[3] == pytest.approx(one_at_a_time[3], rel=1e-6)  # top1, a metric counted in float32
    assert grads_single.keys() == grads_batched.keys() and grads_single
    for name, grad in grads_single.items():
        rtol = 1e-6 if name == "layer_mix_raw" else 1e-8  # the layer mix's softmax runs in float32 (nn/moa.py)
        torch.testing.assert_close(grads_batched[name], grad, rtol=rtol, atol=1e-12, msg=lambda m: f"{name}: {m}")
    # the padded batch is not simply the longest sequence: each sequence counts once
    assert abs(together[0] - loss_and_grads([[1]])[0][0]) > 1e-3


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_training_by_micro_batches_follows_training_one_sequence_at_a_time(tmp_path, method: str) -> None:
    """The same run with 1 or 3 sequences per forward pass draws the same sequences and reaches
    the same weights (float64), so a run may resume with another --micro-batch. SDPA attention,
    float64 throughout (see the padded-batch features test above)."""
    target = make_tiny_target("llama", num_hidden_layers=3, attn="sdpa")
    config = TrainConfig(method=method, steps=3, batch_size=4, warmup_steps=1, staircase_fraction=1.0, val_every=1000, ckpt_every=1)
    weights = []
    for micro_batch, stop in ((1, None), (3, 2)):
        torch.manual_seed(0)
        net = make_net(method, target)
        train(net, target, unequal_samples(2), [], config, tmp_path / str(micro_batch), progress=False, micro_batch=micro_batch, stop_at_step=stop)
        if stop:  # resumed with a third size
            torch.manual_seed(0)
            net = make_net(method, target)
            train(net, target, unequal_samples(2), [], config, tmp_path / str(micro_batch), progress=False, micro_batch=2)
        weights.append(net.state_dict())
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-7, atol=1e-10, msg=name)
    with pytest.raises(ValueError, match="micro_batch"):
        train(make_net(method, target), target, unequal_samples(2), [], config, tmp_path / "bad", progress=False, micro_batch=0)


def test_moaspec_train_keeps_freed_memory_for_the_next_step(tmp_path, monkeypatch) -> None:
    """`moaspec train` raises glibc's mmap and trim thresholds before it trains (allocator.py);
    on a Linux/glibc machine both mallopt calls take effect (checked in a child process, which
    keeps this one's allocator as it is)."""
    import subprocess
    import sys

    import moaspec.train.allocator as allocator
    import moaspec.train.run as run

    if sys.platform.startswith("linux"):
        code = "from moaspec.train.allocator import keep_freed_memory; print(keep_freed_memory())"
        assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "True\n"
    order = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: order.append("allocator") or True)
    monkeypatch.setattr(run, "run_training", lambda spec, config, tree: order.append("train") or tmp_path)
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 3}')
    monkeypatch.setattr("moaspec.model_store.resolve_target", lambda name: (name, tmp_path))
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text("{}\n")
    from moaspec.cli import main

    assert main(["train", "--method", "moa", "--data", str(data), "--out", str(tmp_path / "run")]) == 0
    assert order == ["allocator", "train"]
