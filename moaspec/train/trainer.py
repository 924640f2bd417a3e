"""Drafter training loop (nanoGPT-style): online target features, MoA anchors and staircase
curriculum, AdamW with warm-up and decay, clipping, validation (teacher-forced accuracy per
depth, and a short τ measurement: tau_probe.py), checkpoints and resume (train_state.py).

MoA (moa_reference.md §2.2): per sequence draw T in [anchor_min, anchor_max]; every position
outside the learned spans (prompt, user turns) and every span position with index % T == 0 is an
anchor; s(i) = the last anchor <= i; the CA at i sees memory up to s(i). Staircase SA curriculum:
a sequence uses the staircase mask with probability 1 - min(1, step / (staircase_fraction *
steps)), annealed by steps.
EAGLE (§4.3): true features in, next feature out, U(-noise/2, noise/2) added to the input features.
Loss inside the learned spans only (a response, or every assistant turn of a conversation; a
position predicts the token after it); accuracy against the target's argmax. A step's loss is the
mean over its sequences of each one's own loss; its sequences are drawn first (`draw_sequence`)
and run `micro_batch` at a time, padded (`batch_loss`), which changes speed, not the gradient.
Device: the net trains where the target's weights are (a GPU when `--device cuda`), bfloat16
autocast there; features, masks and noise are moved to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from moaspec.config import TreeConfig
from moaspec.nn.target_layers import check_tli_layers
from moaspec.nn.target_parts import TargetParts
from moaspec.signals import signals_held
from moaspec.targets.hf import HFTarget
from moaspec.train.config import TrainConfig
from moaspec.train.features import FeatureSource, OnlineFeatures, TargetFeatures, TrainSample
from moaspec.train.losses import LossParts, drafter_loss
from moaspec.train.tau_probe import measure_tau
from moaspec.train.train_state import TrainState, resume_state, save_state


def learning_rate(config: TrainConfig, step: int) -> float:
    """Linear warm-up to lr, then cosine decay to min_lr at the last step (steps - 1)."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.steps - 1 - config.warmup_steps))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def staircase_probability(config: TrainConfig, step: int) -> float:
    """Chance that a sequence at `step` uses MoA's staircase SA mask: 1 at the start, falling
    linearly to 0 at staircase_fraction of the steps (0 = never)."""
    span = config.staircase_fraction * config.steps
    return 0.0 if span <= 0 else 1.0 - min(1.0, step / span)


def _in_spans(length: int, spans: tuple[tuple[int, int], ...], end_offset: int = 0) -> torch.Tensor:
    """[length] bool: start <= i < end - end_offset for some span."""
    positions = torch.arange(length)
    inside = torch.zeros(length, dtype=torch.bool)
    for start, end in spans:
        inside |= (positions >= start) & (positions < end - end_offset)
    return inside


def last_anchors(length: int, spans: tuple[tuple[int, int], ...], every: int) -> torch.Tensor:
    """s(i) for i < length: positions outside the learned spans (context the target verified)
    and span positions with i % every == 0 are anchors."""
    positions = torch.arange(length)
    is_anchor = ~_in_spans(length, spans) | (positions % every == 0)
    return torch.cummax(torch.where(is_anchor, positions, 0), dim=0).values


def loss_mask(length: int, spans: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """[length] 0/1: positions predicting a later token of their span, start <= i <= end - 2 (a
    span's first token is the target's own at inference: the root, never a draft)."""
    return _in_spans(length, spans, end_offset=1).float()


@dataclass(frozen=True)
class Draw:
    """One sequence as a training step draws it: the sample, MoA's anchor interval (`every`),
    whether its SA uses the staircase mask, and EAGLE's feature noise [T, D] (None for MoA)."""

    sample: TrainSample
    every: int
    staircase: bool = False
    noise: torch.Tensor | None = None


def draw_sequence(
    samples: list[TrainSample], config: TrainConfig, staircase_p: float, rng: random.Random,
    generator: torch.Generator, hidden_size: int,
) -> Draw:
    """The next training sequence and its random choices, in a fixed order of draws, so a step's
    draws do not depend on how its sequences are grouped into forward passes."""
    sample = samples[rng.randrange(len(samples))]
    every = rng.randint(config.anchor_min, config.anchor_max)
    staircase = rng.random() < staircase_p
    return Draw(sample, every, staircase, feature_noise(config, sample, hidden_size, generator))


def feature_noise(config: TrainConfig, sample: TrainSample, hidden_size: int, generator: torch.Generator) -> torch.Tensor | None:
    """EAGLE's input noise for a sequence, U(-noise/2, noise/2) [T, D]; None for MoA."""
    if config.method != "eagle":
        return None
    return (torch.rand((sample.input_ids.numel(), hidden_size), generator=generator) - 0.5) * config.eagle_noise


def padded_stack(tensors: list[torch.Tensor], length: int, dim: int = 0) -> torch.Tensor:
    """Tensors of equal shape but along `dim` -> [B, ...] with zeros after each one's end up to
    `length`."""
    def pad(tensor: torch.Tensor) -> torch.Tensor:
        shape = list(tensor.shape)
        shape[dim] = length - shape[dim]
        return torch.cat([tensor, tensor.new_zeros(shape)], dim=dim) if shape[dim] else tensor

    if len(tensors) == 1:
        return pad(tensors[0]).unsqueeze(0)  # no copy for a batch of one
    return torch.stack([pad(tensor) for tensor in tensors])


def stacked_features(features: list[TargetFeatures], length: int) -> TargetFeatures:
    """Per-sequence features -> one batch padded with zeros to `length` (each tensor gains a
    leading [B]; keys/values [B, Hkv, T, d]); an empty layer_kv (EAGLE) stays empty."""
    first = features[0]
    layer_kv = padded_stack([f.layer_kv for f in features], length) if first.layer_kv.numel() else first.layer_kv
    tli_kv = [
        (padded_stack([f.tli_kv[i][0] for f in features], length, 1), padded_stack([f.tli_kv[i][1] for f in features], length, 1))
        for i in range(len(first.tli_kv))
    ]
    return TargetFeatures(
        layer_kv=layer_kv,
        final_hidden=padded_stack([f.final_hidden for f in features], length),
        target_logsumexp=padded_stack([f.target_logsumexp for f in features], length),
        target_argmax=padded_stack([f.target_argmax for f in features], length),
        tli_kv=tli_kv,
        tli_hidden=None if first.tli_hidden is None else padded_stack([f.tli_hidden for f in features], length),
    )


def batch_loss(
    net: torch.nn.Module,
    parts: TargetParts,
    draws: list[Draw],
    features: list[TargetFeatures],
    config: TrainConfig,
) -> LossParts:
    """The mean over `draws` of each sequence's loss (MoA or EAGLE), in one forward pass over the
    sequences padded to the longest. features: the target's, one per draw, on the device the net
    trains on (ids, masks and noise are made on the CPU and moved there). Equal to the mean of
    the sequences' losses computed one at a time (tested), whatever the grouping."""
    device = features[0].final_hidden.device
    length = max(draw.sample.input_ids.numel() for draw in draws)
    ids = padded_stack([draw.sample.input_ids for draw in draws], length).to(device)  # [B, T]
    batch = stacked_features(features, length)
    head = net.head_weight(parts).to(next(net.parameters()).dtype)
    mask = padded_stack([loss_mask(d.sample.input_ids.numel(), d.sample.spans()) for d in draws], length).to(device)
    wanted = target_choice_in_draft_vocab(net, batch.target_argmax)  # [B, T]
    if config.method == "moa":
        positions = torch.arange(length)
        anchors = torch.stack([  # the padding: anchors (s(i) = i), never read by the sequence's tokens
            torch.cat([last_anchors(n, d.sample.spans(), d.every), positions[n:]])
            for d in draws for n in [d.sample.input_ids.numel()]
        ])
        at_anchor = (anchors == positions).to(device)
        staircase = torch.tensor([draw.staircase for draw in draws], device=device)
        out = net.forward_train(
            parts, ids, batch.layer_kv, anchors.to(device), staircase,
            batch.tli_kv, batch.tli_hidden, batch.final_hidden,
        )
        tli_mask = mask * (~at_anchor).float() if config.tli_layers else None
        # a memory_hidden net's memory at an anchor holds the very state its loss asks for there
        anchor_weight = 0.0 if config.memory_hidden else config.anchor_loss_weight
        weights = mask * torch.where(at_anchor, anchor_weight, 1.0)
        return drafter_loss(
            out.final, batch.final_hidden, head, batch.target_logsumexp, weights,
            out.pre_tli, batch.tli_hidden, tli_mask, config.tli_rms_scaled, wanted,
            ce_weight=config.ce_weight, feature_weight=config.feature_weight,
        )
    inputs = batch.final_hidden  # [B, T, D]; validation's draws carry no noise
    if draws[0].noise is not None:
        inputs = inputs + padded_stack([draw.noise for draw in draws], length).to(device=device, dtype=inputs.dtype)
    predicted = net.forward_train(parts, ids, inputs)  # [B, T-1, D]
    return drafter_loss(
        predicted, batch.final_hidden[:, 1:], head, batch.target_logsumexp[:, 1:], mask[:, 1:], wanted_ids=wanted[:, 1:],
        ce_weight=config.ce_weight, feature_weight=config.feature_weight,
    )


def micro_batches(draws: list[Draw], size: int) -> list[list[Draw]]:
    """A step's draws in groups of at most `size` sequences of similar lengths (less padding)."""
    by_length = sorted(draws, key=lambda draw: draw.sample.input_ids.numel())
    return [by_length[i : i + size] for i in range(0, len(by_length), size)]


def target_choice_in_draft_vocab(net: torch.nn.Module, target_argmax: torch.Tensor) -> torch.Tensor:
    """target_argmax [T] (full-vocabulary ids) -> [T] their rows in the drafter's vocabulary,
    -1 where the target's choice lies outside it (a miss whatever the drafter says)."""
    if not net.config.draft_vocab_size:
        return target_argmax
    vocab = net.draft_vocab_ids
    lookup = torch.full((int(max(vocab.max(), target_argmax.max())) + 1,), -1, dtype=torch.long, device=vocab.device)
    lookup[vocab] = torch.arange(vocab.numel(), device=vocab.device)
    return lookup[target_argmax.to(vocab.device)]


def features_on(features: TargetFeatures, device: torch.device) -> TargetFeatures:
    """The same features on `device` (no copy when they are there already)."""
    moved = {
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in ((f.name, getattr(features, f.name)) for f in dataclasses.fields(features))
    }
    moved["tli_kv"] = [(k.to(device), v.to(device)) for k, v in features.tli_kv]
    return TargetFeatures(**moved)


def mixed_precision(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager[None]:
    """bfloat16 autocast on `device` when enabled (the drafter's matmuls; losses stay float32),
    else nothing. CUDA training uses it; tests run the same path on the CPU."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def kv_layers_read(net: torch.nn.Module, config: TrainConfig) -> tuple[int, ...]:
    """The target layers whose keys/values the drafter's training reads (MoA's memory)."""
    return net.config.memory_layer_ids if config.method == "moa" else ()


@dataclass
class ValidationCounts:
    """Teacher-forced hits and positions per draft depth ([max_depth + 1], index 0 unused) and the
    summed sequence losses; counts of disjoint sample sets add up."""

    hits: torch.Tensor
    counts: torch.Tensor
    loss_sum: float = 0.0
    sequences: int = 0

    def __add__(self, other: ValidationCounts) -> ValidationCounts:
        return ValidationCounts(
            self.hits + other.hits, self.counts + other.counts,
            self.loss_sum + other.loss_sum, self.sequences + other.sequences,
        )

    def summary(self) -> dict:
        """{"val_loss", "acc_depth{d}"...} (depths without positions left out)."""
        accuracy = {
            f"acc_depth{d}": round(float(self.hits[d] / self.counts[d]), 4)
            for d in range(1, self.hits.numel()) if self.counts[d] > 0
        }
        return {"val_loss": round(self.loss_sum / max(1, self.sequences), 5), **accuracy}


@torch.no_grad()
def validation_counts(
    net: torch.nn.Module,
    parts: TargetParts,
    source: FeatureSource,
    samples: list[TrainSample],
    config: TrainConfig,
    max_depth: int = 6,
    device: torch.device | str = "cpu",
    autocast: bool = False,
    on_first_guesses: Callable[[TrainSample, torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
) -> ValidationCounts:
    """Top-1 agreement with the target's own next token (its argmax, full vocabulary: a choice
    outside the draft vocabulary counts as a miss) per draft depth (MoA: depth = i - s(i) + 1 on a
    fixed anchor grid of max_depth + 1, as `scored_positions` says; EAGLE: depth 1, true features), and the losses
    (EAGLE's on true features too: validation draws none of its training noise).
    on_first_guesses(sample, roots [R], guesses [R], target_next [T]): called per sample with its
    draft-depth-1 guesses (`first_guesses`' view), for a caller that splits them further (by turn)."""
    net.eval()
    totals = ValidationCounts(torch.zeros(max_depth + 1), torch.zeros(max_depth + 1))
    device = torch.device(device)
    for sample in samples:
        length = sample.input_ids.numel()
        features = features_on(source.features(sample, config.tli_layers, kv_layers_read(net, config)), device)
        draw = Draw(sample, max_depth + 1)  # EAGLE without its training noise: true features, as inference reads them
        with mixed_precision(device, autocast):
            parts_loss = batch_loss(net, parts, [draw], [features], config)
            totals.loss_sum += float(parts_loss.total)
            totals.sequences += 1
            predicted = predicted_tokens(net, parts, sample, features, config, max_depth).cpu()
        target_next = features.target_argmax.cpu()  # [T]: the target's token after t
        positions, rows, depth = scored_positions(length, sample.spans(), config.method, max_depth)
        if on_first_guesses is not None:
            on_first_guesses(sample, *_at_first_draft(predicted, positions, rows, depth, config.method), target_next)
        correct = predicted[rows] == target_next[positions]
        for d in range(1, max_depth + 1):
            selected = depth == d
            totals.hits[d] += correct[selected].sum()
            totals.counts[d] += selected.sum()
    net.train()
    return totals


def scored_positions(
    length: int, spans: tuple[tuple[int, int], ...], method: str, max_depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where validation scores a drafter's teacher-forced guesses in a sequence of `length`:
    (positions [P]: the guess is compared with the target's argmax there; rows [P]: the guess's
    row of `predicted_tokens`; depth [P]). MoA: depth = i - s(i) + 1 on the fixed anchor grid of
    max_depth + 1 (1 is the anchor itself, 2 the first drafted token); EAGLE: depth 1, row t
    guessing the token after t + 1."""
    mask = loss_mask(length, spans).bool()
    if method == "moa":
        positions = torch.nonzero(mask[:-1]).flatten()
        depth = torch.arange(length) - last_anchors(length, spans, max_depth + 1) + 1
        return positions, positions, depth[positions]
    rows = torch.nonzero(mask[1:-1]).flatten()
    return rows + 1, rows, torch.ones_like(rows)


def validate(
    net: torch.nn.Module,
    parts: TargetParts,
    source: FeatureSource,
    samples: list[TrainSample],
    config: TrainConfig,
    max_depth: int = 6,
    device: torch.device | str = "cpu",
    autocast: bool = False,
) -> dict:
    """`validation_counts` as the record the training history keeps: val_loss and acc_depth{d}."""
    return validation_counts(net, parts, source, samples, config, max_depth, device, autocast).summary()


def predicted_tokens(
    net: torch.nn.Module, parts: TargetParts, sample: TrainSample, features: TargetFeatures, config: TrainConfig,
    max_depth: int,
) -> torch.Tensor:
    """The drafter's argmax (full-vocabulary ids) teacher-forced: MoA [T] on the fixed anchor grid
    of max_depth + 1 (row i predicts the token after i); EAGLE [T - 1] with the true features
    (row t predicts the token after t + 1)."""
    ids = sample.input_ids.to(features.final_hidden.device)
    head = net.head_weight(parts)
    vocab = net.draft_vocab_ids if net.config.draft_vocab_size else torch.arange(head.shape[0], device=head.device)
    if config.method == "moa":
        anchors = last_anchors(ids.numel(), sample.spans(), max_depth + 1).to(ids.device)
        out = net.forward_train(
            parts, ids, features.layer_kv, anchors, False, features.tli_kv, features.tli_hidden, features.final_hidden
        )
        return vocab[(out.final @ head.T.to(out.final.dtype)).argmax(-1)]
    out = net.forward_train(parts, ids, features.final_hidden)
    return vocab[(out @ head.T.to(out.dtype)).argmax(-1)]


def first_guesses(
    net: torch.nn.Module,
    parts: TargetParts,
    sample: TrainSample,
    features: TargetFeatures,
    config: TrainConfig,
    max_depth: int = 6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's guesses at draft depth 1, teacher-forced, where `validation_counts` scores
    them: (roots [R], guesses [R]): at root position r (the target's own token, the verified
    context before it) the drafter guesses the token after r (full-vocabulary id), to be compared
    with the target's argmax at r."""
    predicted = predicted_tokens(net, parts, sample, features, config, max_depth).cpu()
    positions, rows, depth = scored_positions(sample.input_ids.numel(), sample.spans(), config.method, max_depth)
    return _at_first_draft(predicted, positions, rows, depth, config.method)


def _at_first_draft(
    predicted: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, depth: torch.Tensor, method: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(roots [R], guesses [R]) of the scored positions (`scored_positions`) at draft depth 1."""
    first_draft = depth == (2 if method == "moa" else 1)  # MoA's depth 1 is the anchor itself
    return positions[first_draft], predicted[rows[first_draft]]


def train(
    net: torch.nn.Module,
    target: HFTarget,
    train_samples: list[TrainSample],
    val_samples: list[TrainSample],
    config: TrainConfig,
    out_dir: Path,
    tree: dict | None = None,
    provenance: dict | None = None,
    progress: bool = True,
    stop_at_step: int | None = None,
    stop_after_s: float | None = None,
    source: FeatureSource | None = None,
    autocast: bool | None = None,
    micro_batch: int = 1,
) -> TrainState:
    """Train `net` in place; resume from out_dir/train_state.pt when it exists.

    micro_batch: sequences per forward pass (padded to the longest of them, grouped by length);
    the step's gradient is the same for any value (up to rounding), only speed and memory
    change, so a run may resume with another.

    source: where target features come from (default: run the target online per sequence).
    The net trains where the target's weights are (`target.device`: a GPU when the caller put the
    target there), with bfloat16 autocast when `autocast` (default: on a GPU only). `val_tau`
    runs the CPU engine, so it is measured on the CPU only.

    stop_at_step / stop_after_s end this call early (state saved), e.g. to fit a time box;
    calling again with the same config continues exactly where it stopped.
    """
    from tqdm import tqdm

    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    if any(sample.input_ids.numel() > config.max_seq_len for sample in [*train_samples, *val_samples]):
        raise ValueError(f"training samples must be cut to max_seq_len={config.max_seq_len} tokens first")
    parts = target.parts(config.tli_layers)
    check_tli_layers(parts.tli_layers, parts.rotary_emb)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = source or OnlineFeatures(target)
    device = target.device
    autocast = device.type == "cuda" if autocast is None else autocast
    net.to(device)
    for param in target.model.parameters():
        param.requires_grad_(False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    rng = random.Random(config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    state = resume_state(out_dir, config, net, optimizer, rng, generator)
    bar = tqdm(total=config.steps, initial=state.step, disable=not progress, desc=f"train {config.method}", unit="step")
    run_started = time.perf_counter()
    wall_before = state.train_wall_s
    step_start = (state.step, rng.getstate(), generator.get_state())  # what an interrupted step rewinds to
    validate_step = functools.partial(
        _validate_step, net=net, parts=parts, source=source, val_samples=val_samples, config=config, target=target,
        tree=tree, device=device, autocast=autocast, bar=bar,
    )
    save = functools.partial(save_state, net, optimizer, state, config, rng, generator, out_dir, target, tree, provenance)
    try:
        if _missing_validation(state, config, val_samples):  # an interrupt cut the last step's validation
            validate_step(state.history[-1])
            save()
        net.train()
        while state.step < min(config.steps, stop_at_step or config.steps):
            if stop_after_s is not None and time.perf_counter() - run_started > stop_after_s:
                save()
                break
            step_start = (state.step, rng.getstate(), generator.get_state())
            record = _optimizer_step(
                net, optimizer, parts, source, train_samples, config, state, rng, generator, micro_batch, device, autocast
            )
            state.train_wall_s = wall_before + time.perf_counter() - run_started
            state.history.append(record)  # before its validation, which _missing_validation finds cut
            bar.set_postfix(loss=f"{record['loss']:.3f}", top1=f"{record['top1']:.2f}", tok_s=f"{record['tokens_per_s']:.0f}")
            bar.update(1)
            if val_samples and _validates_at(state.step, config):
                validate_step(record)
            if state.step % config.ckpt_every == 0 or state.step in (config.steps, stop_at_step):
                save()
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the last completed step
        if state.step == step_start[0]:  # cut before its update: its draws are drawn again on resume
            rng.setstate(step_start[1])
            generator.set_state(step_start[2])
        try:
            save()
        except KeyboardInterrupt:  # a second signal, held during the save: the first one decides the exit
            pass
        raise
    finally:  # whatever ends the loop: an error's line starts on a line of its own, not after the bar
        bar.close()
    return state


def _optimizer_step(
    net: torch.nn.Module, optimizer: torch.optim.Optimizer, parts: TargetParts, source: FeatureSource,
    train_samples: list[TrainSample], config: TrainConfig, state: TrainState, rng: random.Random,
    generator: torch.Generator, micro_batch: int, device: torch.device, autocast: bool,
) -> dict:
    """One optimizer step over `config.batch_size` drawn sequences; `state.step` advanced once the
    update is applied (signals held, so an update is never saved half-made). Its history record:
    step, learning rate, gradient norm, the losses and accuracies, tokens/s."""
    started = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(config, state.step)
    staircase_p = staircase_probability(config, state.step)
    optimizer.zero_grad(set_to_none=True)
    draws = [
        draw_sequence(train_samples, config, staircase_p, rng, generator, net.config.hidden_size)
        for _ in range(config.batch_size)
    ]
    totals = _accumulate_gradients(net, parts, source, draws, config, micro_batch, device, autocast)
    num_tokens = sum(draw.sample.input_ids.numel() for draw in draws)
    grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), config.grad_clip)
    with signals_held():  # an update cut half-way would be saved as the step before it
        optimizer.step()
        state.step += 1
    record = {"step": state.step, "lr": learning_rate(config, state.step - 1), "grad_norm": float(grad_norm), **totals}
    record["tokens_per_s"] = num_tokens / (time.perf_counter() - started)
    return record


def _accumulate_gradients(
    net: torch.nn.Module, parts: TargetParts, source: FeatureSource, draws: list[Draw], config: TrainConfig,
    micro_batch: int, device: torch.device, autocast: bool,
) -> dict[str, float]:
    """Backpropagate one step's loss, the mean over its `draws`, `micro_batch` sequences per forward
    pass. -> the step's mean loss, soft CE, feature loss and top-1 ({"loss", "ce", "feat", "top1"})."""
    totals = {"loss": 0.0, "ce": 0.0, "feat": 0.0, "top1": 0.0}
    for sequences in micro_batches(draws, micro_batch):
        samples = [draw.sample for draw in sequences]
        batch = source.batch_features(samples, config.tli_layers, kv_layers_read(net, config))
        features = [features_on(one, device) for one in batch]
        with mixed_precision(device, autocast):
            parts_loss = batch_loss(net, parts, sequences, features, config)
        share = len(sequences) / len(draws)  # the step's loss is the mean over its sequences
        (parts_loss.total * share).backward()
        totals["loss"] += float(parts_loss.total.detach()) * share
        totals["ce"] += float(parts_loss.soft_ce) * share
        totals["feat"] += float(parts_loss.feature) * share
        totals["top1"] += float(parts_loss.top1) * share
    return totals


def _validates_at(step: int, config: TrainConfig) -> bool:
    return step % config.val_every == 0 or step == config.steps


def _missing_validation(state: TrainState, config: TrainConfig, val_samples: list[TrainSample]) -> bool:
    """Whether the last completed step should have been validated and was not (an interrupt cut
    its validation: the step itself was saved)."""
    last = state.history[-1] if state.history else None
    return bool(val_samples) and last is not None and last["step"] == state.step and (
        _validates_at(state.step, config) and "val_loss" not in last
    )


def _validate_step(record: dict, net, parts, source, val_samples, config: TrainConfig, target, tree, device, autocast, bar) -> None:
    """Add the validation figures to a step's record (in place, all at once: an interrupt leaves
    none) and print it; the bar says it is validating meanwhile (5-35 s a held-out record on 2 cores)."""
    bar.set_postfix_str(f"validating step {record['step']} on {len(val_samples)} held-out records", refresh=True)
    figures = validate(net, parts, source, val_samples, config, device=device, autocast=autocast)
    if device.type == "cpu":
        figures["val_tau"] = round(measure_tau(net, config.method, target, val_samples, TreeConfig(**(tree or {}))), 4)
    record.update(figures)
    bar.write(json.dumps({k: float(f"{v:.4g}") if k == "lr" else round(v, 4) if isinstance(v, float) else v for k, v in record.items()}))


__all__ = [
    "Draw", "TrainConfig", "TrainSample", "TrainState", "batch_loss", "last_anchors", "learning_rate", "loss_mask",
    "staircase_probability", "train", "validate", "validation_counts",
]
