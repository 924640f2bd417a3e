"""What a hand-mutation audit of the drafter training code (moaspec/train/) pinned.

Each mutant below changed one place of moaspec/train/ and left every earlier test passing, while
a user would have trained a worse drafter (or read wrong validation figures) with no crash: the
soft-CE and feature terms against a float64 reference written out by hand (reduced vocabulary,
weighted masks, TLI, top-1), MoA's loss weights at anchors, EAGLE's shift-by-one and input noise,
the anchor-interval and noise draws, the learning rate each step applies and the clipping before
it, the validated and saved steps, the drafter's guesses in full-vocabulary ids, the feature
cache's data key, conversations whose template rewrites earlier answers, and benchmark prompts of
exactly the minimum contained length.
Every test is deterministic (fixed seeds, golden values), CPU-only and takes well under a second.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_target
from test_train import make_net, samples

from moaspec.train import trainer
from moaspec.train.config import TrainConfig
from moaspec.train.features import OnlineFeatures, TrainSample
from moaspec.train.losses import drafter_loss
from moaspec.train.run import build_net
from moaspec.train.trainer import Draw, batch_loss, kv_layers_read, train

# ---------------------------------------------------------------------------------------------
# losses.py against a float64 reference


def _smooth_l1(x: torch.Tensor) -> torch.Tensor:
    """SmoothL1 with beta = 1, written out: 0.5 x^2 inside |x| < 1, |x| - 0.5 outside."""
    return torch.where(x.abs() < 1, 0.5 * x * x, x.abs() - 0.5)


def _per_sequence_mean(values: list[float], weights: list[float]) -> float:
    return sum(v * w for v, w in zip(values, weights)) / (sum(weights) + 1e-5)


def _reference_loss(drafter, target, head, draft_ids, mask, pre, stream, tli_mask, wanted_ids):
    """(soft CE, feature term, top1), one sequence and one position at a time, float64."""
    ce_rows, feature_rows, tli_rows, top1_rows = [], [], [], []
    for b in range(drafter.shape[0]):
        ce, feature, tli, hits, positions = [], [], [], 0, 0
        for t in range(drafter.shape[1]):
            full_logits = target[b, t] @ head.T  # [V]: the target's whole vocabulary
            p_target = torch.exp(full_logits[draft_ids] - torch.logsumexp(full_logits, 0))  # mass outside dropped
            log_q = torch.log_softmax(drafter[b, t] @ head[draft_ids].T, 0)
            ce.append(float(-(p_target * log_q).sum()))
            feature.append(float(_smooth_l1(drafter[b, t] - target[b, t]).mean()))
            rms = stream[b, t].pow(2).mean().sqrt()  # the target stream's, both sides
            tli.append(float(_smooth_l1(pre[b, t] / rms - stream[b, t] / rms).mean()))
            if mask[b, t] > 0:
                positions += 1
                hits += int(int(log_q.argmax()) == int(wanted_ids[b, t]))
        ce_rows.append(_per_sequence_mean(ce, mask[b].tolist()))
        feature_rows.append(_per_sequence_mean(feature, mask[b].tolist()))
        tli_rows.append(_per_sequence_mean(tli, tli_mask[b].tolist()))
        top1_rows.append(hits / (positions + 1e-5))
    num = drafter.shape[0]
    return sum(ce_rows) / num, 0.5 * sum(feature_rows) / num + 0.5 * sum(tli_rows) / num, sum(top1_rows) / num


def test_drafter_loss_equals_a_reference_written_out_by_hand() -> None:
    """Kills L3 (target probabilities renormalised over the draft vocabulary: the drafter learns
    a distribution the target does not have), L5 (feature term summed over D, not averaged:
    64x the weight of the CE), L6 (SmoothL1 beta 0.5), L7 (TLI: the final-state term not
    halved), L8 (pre-TLI term over the loss mask instead of the TLI mask: anchors included),
    L9 (RMS of the prediction, not of the target stream) and L11 (top-1 against the best draft
    row instead of the target's own choice: a target token outside the draft vocabulary counted
    a hit). Two sequences of unequal weight, a reduced vocabulary holding under half the mass,
    errors on both sides of SmoothL1's knee; float64 throughout, so 1e-12 is rounding only."""
    gen = torch.Generator().manual_seed(0)
    batch, length, dim, vocab = 2, 7, 8, 13
    head = torch.randn(vocab, dim, generator=gen, dtype=torch.float64)
    draft_ids = torch.arange(0, vocab, 2)  # 7 of 13 rows
    target = torch.randn(batch, length, dim, generator=gen, dtype=torch.float64)
    drafter = target + 1.5 * torch.randn(batch, length, dim, generator=gen, dtype=torch.float64)
    drafter[0, 4] = target[0, 4]  # a drafter that agrees with the target there
    stream = 4.0 * torch.randn(batch, length, dim, generator=gen, dtype=torch.float64)
    pre = 2.0 * stream + torch.randn(batch, length, dim, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 0.5, 1, 0, 1], [1, 1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    tli_mask = torch.tensor([[0, 1, 0, 0, 1, 0, 1], [0, 1, 0, 0, 0, 0, 0]], dtype=torch.float64)
    lse = torch.logsumexp(target @ head.T, -1)
    full_choice = (target @ head.T).argmax(-1)
    wanted_ids = torch.where(full_choice % 2 == 0, full_choice // 2, -1)  # the row of the target's choice, -1 outside
    assert bool((wanted_ids[mask > 0] == -1).any())  # some choices lie outside the draft vocabulary
    got = drafter_loss(drafter, target, head[draft_ids], lse, mask, pre, stream, tli_mask, True, wanted_ids)
    soft_ce, feature, top1 = _reference_loss(drafter, target, head, draft_ids, mask, pre, stream, tli_mask, wanted_ids)
    assert float(got.soft_ce) == pytest.approx(soft_ce, rel=1e-12)
    assert float(got.feature) == pytest.approx(feature, rel=1e-12)
    assert float(got.top1) == pytest.approx(top1, rel=1e-6)  # a metric counted in float32
    assert float(got.total) == pytest.approx(0.1 * soft_ce + feature, rel=1e-12)
    # not vacuous: the best draft row of the target agrees with the drafter more often than the
    # target's own choice does (position 4 of the first sequence)
    best_row = drafter_loss(drafter, target, head[draft_ids], lse, mask, pre, stream, tli_mask, True, None)
    assert float(best_row.top1) > float(got.top1)


# ---------------------------------------------------------------------------------------------
# trainer.batch_loss: what the loss is told


# A conversation of 12 tokens with two learned spans and a response of 8 after a 3-token prompt.
CONVERSATION = TrainSample(torch.tensor([5, 9, 14, 3, 22, 41, 7, 60, 2, 33, 18, 71]), 2, 0, ((2, 6), (8, 12)))
RESPONSE = TrainSample(torch.tensor([11, 4, 90, 23, 56, 8, 45, 30]), 3, 1)


def _spy_loss(monkeypatch) -> list[tuple]:
    """drafter_loss as the trainer calls it, its arguments recorded."""
    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return drafter_loss(*args, **kwargs)

    monkeypatch.setattr(trainer, "drafter_loss", spy)
    return calls


@pytest.mark.parametrize("memory_hidden", [False, True])
def test_moa_loss_weighs_anchors_and_leaves_them_out_of_the_pre_tli_term(monkeypatch, memory_hidden: bool) -> None:
    """Kills R8 (a memory_hidden net trained at anchors too, where its memory holds the very state
    the loss asks for: a shortcut, learned instead of drafting), R9 (the pre-TLI term at anchors,
    where the drafter reads the target's own layer) and R10 (anchor_loss_weight applied to the
    drafted positions instead of the anchors). Golden weights of a padded batch: the conversation
    (anchors every 3: 0, 1, 3, 6, 7, 9) and the response (every 2: 0, 1, 2, 4, 6)."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = build_net("moa", target, 1, None, memory_hidden=memory_hidden)
    config = TrainConfig(method="moa", tli_layers=1, anchor_loss_weight=0.25, memory_hidden=memory_hidden)
    draws = [Draw(CONVERSATION, 3), Draw(RESPONSE, 2)]
    source = OnlineFeatures(target)
    features = [source.features(d.sample, 1, kv_layers_read(net, config)) for d in draws]
    calls = _spy_loss(monkeypatch)
    batch_loss(net, target.parts(1), draws, features, config)
    (args, _), = calls
    weights, tli_mask = args[4], args[7]
    anchor = 0.0 if memory_hidden else 0.25
    assert weights.tolist() == [
        [0, 0, 1, anchor, 1, 0, 0, 0, 1, anchor, 1, 0],
        [0, 0, 0, 1, anchor, 1, anchor, 0, 0, 0, 0, 0],
    ]
    assert tli_mask.tolist() == [[0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0], [0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0]]


def test_eagle_loss_compares_row_t_with_position_t_plus_1_and_adds_the_draws_noise(monkeypatch) -> None:
    """Kills R12 (the loss mask not shifted with the features: the drafter's first guess after
    each span's root went unlearned and a guess past the span's end, into the next user turn or
    beyond the sequence, was learned instead) and R13 (the
    draw's noise never reaching the drafter's input: EAGLE trained without its §4.3 noise, so it
    cannot absorb its own drafting errors)."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = make_net("eagle", target)
    config = TrainConfig(method="eagle")
    generator = torch.Generator().manual_seed(1)
    noise = 0.1 * torch.randn(RESPONSE.input_ids.numel(), net.config.hidden_size, generator=generator)
    features = OnlineFeatures(target).features(RESPONSE, 0, ())
    calls, inputs = _spy_loss(monkeypatch), []
    real_forward = net.forward_train

    def spy(parts, ids, hidden):
        inputs.append(hidden)
        return real_forward(parts, ids, hidden)

    monkeypatch.setattr(net, "forward_train", spy)
    batch_loss(net, target.parts(0), [Draw(RESPONSE, 7, noise=noise)], [features], config)
    (args, _), = calls
    # row t is the drafter's f_{t+1}: it learns position t + 1's state and is weighed by whether
    # t + 1 predicts a token of the response (positions 3..6 of 8)
    assert args[4].tolist() == [[0, 0, 1, 1, 1, 1, 0]]
    assert torch.equal(args[1], features.final_hidden[None, 1:])
    assert torch.equal(inputs[0], (features.final_hidden + noise)[None])


def test_anchor_intervals_are_drawn_from_the_whole_closed_range() -> None:
    """Kills R5 (randrange: anchor_max never drawn, and --anchor-every K K crashed with an empty
    range): MoA trains on every interval in [anchor_min, anchor_max]."""
    config = TrainConfig(anchor_min=2, anchor_max=4)
    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    drawn = {trainer.draw_sequence(samples(3, 0), config, 0.5, rng, generator, 64).every for _ in range(60)}
    assert drawn == {2, 3, 4}
    fixed = TrainConfig(anchor_min=3, anchor_max=3)
    assert trainer.draw_sequence(samples(1, 0), fixed, 0.5, rng, generator, 64).every == 3


def test_eagle_noise_is_centred_on_zero() -> None:
    """Kills R7 (U(0, noise) instead of U(-noise/2, noise/2): every input feature shifted by
    noise/2, a bias the drafter never meets at inference)."""
    config = TrainConfig(method="eagle", eagle_noise=0.2)
    noise = trainer.feature_noise(config, samples(1, 0)[0], 64, torch.Generator().manual_seed(0))  # [24, 64]
    assert noise.shape == (24, 64)
    assert float(noise.min()) >= -0.1 and float(noise.max()) < 0.1
    assert float(noise.min()) < -0.09 and float(noise.max()) > 0.09 and abs(float(noise.mean())) < 0.01
    assert trainer.feature_noise(TrainConfig(method="moa"), samples(1, 0)[0], 64, torch.Generator()) is None


def test_target_choices_outside_the_draft_vocabulary_are_misses() -> None:
    """Kills R14 (a target choice outside the draft vocabulary mapped to row 0, so a drafter
    answering row 0 scored a hit: training top-1 overstated)."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    net = make_net("moa", target, vocab=torch.arange(50, 97))
    choices = torch.tensor([3, 50, 96, 10, 51])
    assert trainer.target_choice_in_draft_vocab(net, choices).tolist() == [-1, 0, 46, -1, 1]
    assert torch.equal(trainer.target_choice_in_draft_vocab(make_net("moa", target), choices), choices)


# ---------------------------------------------------------------------------------------------
# validation: where guesses are scored, in which ids


def test_validation_scores_moa_guesses_on_the_grid_it_labels() -> None:
    """Kills R21 (predicted_tokens drafting on an anchor grid of max_depth instead of
    max_depth + 1 while scored_positions labels depths on max_depth + 1: every acc_depth{d} a
    mixture of depths) and pins scored_positions' golden positions and depths."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = make_net("moa", target)
    config = TrainConfig(method="moa")
    features = OnlineFeatures(target).features(CONVERSATION, 0, kv_layers_read(net, config))
    anchors, real_forward = [], net.forward_train

    def spy(parts, ids, layer_kv, last_anchor, *args):
        anchors.append(last_anchor.tolist())
        return real_forward(parts, ids, layer_kv, last_anchor, *args)

    net.forward_train = spy
    with torch.no_grad():
        trainer.predicted_tokens(net, target.parts(0), CONVERSATION, features, config, max_depth=2)
    assert anchors == [[0, 1, 1, 3, 3, 3, 6, 7, 7, 9, 9, 9]]
    positions, rows, depth = trainer.scored_positions(12, CONVERSATION.spans(), "moa", 2)
    assert positions.tolist() == rows.tolist() == [2, 3, 4, 8, 9, 10]
    assert depth.tolist() == [2, 1, 2, 2, 1, 2]  # i - s(i) + 1
    positions, rows, depth = trainer.scored_positions(12, CONVERSATION.spans(), "eagle", 2)
    assert positions.tolist() == [2, 3, 4, 8, 9, 10] and rows.tolist() == [1, 2, 3, 7, 8, 9]
    assert depth.tolist() == [1] * 6


@pytest.mark.parametrize("method", ["moa", "eagle"])
def test_validation_guesses_are_full_vocabulary_ids(method: str) -> None:
    """Kills R22 (a reduced-vocabulary MoA's guesses left as draft rows and compared with the
    target's full-vocabulary ids: validation accuracy near 0 whatever the drafter learned).
    The draft vocabulary holds ids 50..96 only, so a row index (0..46) is never one of them."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    vocab = torch.arange(50, 97)
    net = make_net(method, target, vocab=vocab)
    config = TrainConfig(method=method)
    features = OnlineFeatures(target).features(CONVERSATION, 0, kv_layers_read(net, config))
    with torch.no_grad():
        guesses = trainer.predicted_tokens(net, target.parts(0), CONVERSATION, features, config, max_depth=6)
    assert guesses.numel() == (12 if method == "moa" else 11)
    assert bool(torch.isin(guesses, vocab).all())


def test_validation_loss_is_the_loss_on_the_grid_accuracy_is_measured_on() -> None:
    """Kills R17 (val_loss computed with anchors every max_depth tokens while accuracy uses
    max_depth + 1: the two validation figures of a record measured different drafting depths)."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = make_net("moa", target)
    config = TrainConfig(method="moa")
    parts, source = target.parts(0), OnlineFeatures(target)
    counts = trainer.validation_counts(net, parts, source, [CONVERSATION], config, max_depth=2)
    features = source.features(CONVERSATION, 0, kv_layers_read(net, config))
    net.eval()
    with torch.no_grad():
        on_grid = float(batch_loss(net, parts, [Draw(CONVERSATION, 3)], [features], config).total)
        off_grid = float(batch_loss(net, parts, [Draw(CONVERSATION, 2)], [features], config).total)
    assert counts.sequences == 1 and counts.loss_sum == on_grid != off_grid


def test_eagle_validation_loss_reads_true_features_as_inference_does() -> None:
    """EAGLE trains on noisy features but drafts from true ones: its validation loss is the loss on
    true features (a loss on noisy ones measured the training objective, not the drafter)."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    torch.manual_seed(0)
    net = make_net("eagle", target)
    config = TrainConfig(method="eagle", eagle_noise=0.5)
    parts, source = target.parts(0), OnlineFeatures(target)
    counts = trainer.validation_counts(net, parts, source, [CONVERSATION], config, max_depth=2)
    features = source.features(CONVERSATION, 0, kv_layers_read(net, config))
    noise = trainer.feature_noise(config, CONVERSATION, net.config.hidden_size, torch.Generator().manual_seed(0))
    net.eval()
    with torch.no_grad():
        clean = float(batch_loss(net, parts, [Draw(CONVERSATION, 3)], [features], config).total)
        noisy = float(batch_loss(net, parts, [Draw(CONVERSATION, 3, noise=noise)], [features], config).total)
    assert counts.sequences == 1 and counts.loss_sum == clean != noisy


# ---------------------------------------------------------------------------------------------
# the training loop: learning rate, clipping, validated and saved steps, resume


def test_each_update_applies_its_steps_learning_rate_to_clipped_gradients(tmp_path, monkeypatch) -> None:
    """Kills R24 (the schedule applied one step ahead: warm-up skipped its first rate and the
    record's lr was not the one applied) and R25 (gradients not clipped to grad_clip: a spike
    moves the weights as far as any step). AdamW's step is watched: the rate it applies and the
    norm of the gradients it reads."""
    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    config = TrainConfig(
        method="moa", steps=4, batch_size=1, warmup_steps=2, grad_clip=1e-3, val_every=100, ckpt_every=100
    )
    applied, norms, real_step = [], [], torch.optim.AdamW.step

    def watched(self, *args, **kwargs):
        applied.append(self.param_groups[0]["lr"])
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", watched)
    torch.manual_seed(0)
    state = train(make_net("moa", target), target, samples(2, 1), [], config, tmp_path / "run", progress=False)
    assert applied == [trainer.learning_rate(config, step) for step in range(4)] == [r["lr"] for r in state.history]
    assert applied[0] == config.lr / 2
    assert all(r["grad_norm"] > 10 * config.grad_clip for r in state.history)  # clipping had work to do
    assert all(norm <= config.grad_clip * (1 + 1e-5) for norm in norms)


def test_a_stopped_run_saves_its_last_step_and_validates_the_final_one(tmp_path) -> None:
    """Kills R30 (stop_at_step leaving the steps since the last checkpoint unsaved: a time-boxed
    run redoes them) and R29 (the last step not validated when steps is not a multiple of
    val_every: the final checkpoint has no validation figures)."""
    from moaspec.train.train_state import saved_state

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    config = TrainConfig(method="moa", steps=3, batch_size=1, warmup_steps=1, val_every=2, ckpt_every=100)
    out = tmp_path / "run"
    torch.manual_seed(0)
    train(make_net("moa", target), target, samples(2, 1), samples(1, 2), config, out, progress=False, stop_at_step=1)
    assert saved_state(out)["step"] == 1
    state = train(make_net("moa", target), target, samples(2, 1), samples(1, 2), config, out, progress=False)
    assert [r["step"] for r in state.history if "val_loss" in r] == [2, 3]


# ---------------------------------------------------------------------------------------------
# data: the feature cache's key, conversations whose template rewrites history


def test_the_feature_cache_refuses_other_tokens_of_the_same_shape(tmp_path) -> None:
    """Kills C1 (the data key blind to token ids: a cache built for other data of the same
    lengths and spans, e.g. another tokenizer's or a re-encoded data set, read as this data's
    features, so the drafter learns another text's target states)."""
    from moaspec.errors import MoaspecError
    from moaspec.train.feature_cache import build_feature_cache, data_key

    target = make_tiny_target("llama", num_hidden_layers=3, dtype=torch.float32)
    data = samples(2, 3)
    other = [TrainSample((sample.input_ids + 1) % 97, sample.response_start, sample.index) for sample in data]
    assert data_key(other) != data_key(data)
    cache = build_feature_cache(target, data, tmp_path / "cache", "fp", tli_max=0, kv_layers=(), progress=False)
    cache.check(data, "fp", 0, ())
    with pytest.raises(MoaspecError, match="built from other data"):
        cache.check(other, "fp", 0, ())


class ThinkingChatTokenizer:
    """A ChatML-like template over characters that, like Qwen3's, drops the bracketed reasoning
    of an assistant turn once a later user turn follows it."""

    eos_token_id = 3
    chat_template = "thinking"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        ids = []
        for number, message in enumerate(messages):
            content = message["content"]
            answered = any(later["role"] == "user" for later in messages[number + 1 :])
            if message["role"] == "assistant" and answered:
                content = content.split("]")[-1]
            ids += [5, 1 if message["role"] == "user" else 2, *(ord(c) for c in content), 3, 4]
        if add_generation_prompt:
            ids += [5, 2]
        return {"input_ids": ids}


def test_a_template_that_rewrites_earlier_answers_is_skipped() -> None:
    """Kills T3 (only the full encoding checked against the prefix, not the prefix against the
    sequence so far): with a template that drops earlier answers' reasoning, the first answer's
    span, taken from the first encoding, pointed into another encoding of the conversation and
    covered the user's next words."""
    from moaspec.train.teacher_forced import encode_conversation

    tokenizer = ThinkingChatTokenizer()
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
             {"role": "user", "content": "why"}, {"role": "assistant", "content": "because"}]
    assert encode_conversation(tokenizer, plain, 100, 3) is not None  # the template alone is prefix-stable
    thinking = [*plain[:1], {"role": "assistant", "content": "[think]hello"}, *plain[2:]]
    assert encode_conversation(tokenizer, thinking, 100, 3) is None


def test_a_benchmark_prompt_of_exactly_the_minimum_length_is_found_inside_a_turn() -> None:
    """Kills G3 (prompts of exactly MIN_CONTAINED_CHARS characters left out of the substring
    index: a training conversation quoting such a benchmark prompt inside a longer turn was kept,
    and the benchmark then measured text the drafter had trained on)."""
    from moaspec.train.sharegpt import MIN_CONTAINED_CHARS, Conversation, drop_benchmark_conversations

    prompt = "Name three red fruit"
    assert len(prompt) == MIN_CONTAINED_CHARS
    quoting = Conversation("q", [{"role": "user", "content": "My teacher asked: name three  red fruit. Help?"},
                                 {"role": "assistant", "content": "Apples, cherries, strawberries."}])
    kept, dropped = drop_benchmark_conversations([quoting], [prompt])
    assert (kept, dropped) == ([], 1)
