"""`moaspec train`: load the training data, build the drafter, train, write the checkpoint.

    moaspec train --method moa --data DIR [DIR ...] --out RUN [--tli-layers K] [--memory-layers N]
                  [--memory-hidden] [--intermediate-size N] [--draft-vocab N] [--steps S] [--batch-size B] [--micro-batch M] [--lr LR]
                  [--val-conversations V]
                  [--time-limit-min M] [--feature-cache DIR] [--init-from CHECKPOINT] [--device D] ...

Rerunning the same command resumes from RUN/train_state.pt (which takes precedence over
--init-from, so a resumed continuation does not restart from the initial weights). The float16
drafter checkpoint is written to RUN/checkpoint after every `--ckpt-every` steps and at the end;
its config.json records the full training config, the data manifest, the exact command line and
the wall time.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moaspec.config import TreeConfig
from moaspec.drafters.vocab import coverage, most_frequent_token_ids
from moaspec.errors import MoaspecError
from moaspec.train.config import TrainConfig
from moaspec.train.distill import check_data_target, read_manifest
from moaspec.train.features import TrainSample
from moaspec.train.train_state import STATE_FILE, check_resumable, saved_state
from moaspec.train.trainer import kv_layers_read, train

if TYPE_CHECKING:
    from moaspec.nn.drafter_net import DrafterNet
    from moaspec.targets.base import Target
    from moaspec.targets.hf import HFTarget
    from moaspec.train.feature_cache import FeatureCache


@dataclass(frozen=True)
class RunSpec:
    """Everything `moaspec train` needs besides the TrainConfig."""

    data_dirs: tuple[Path, ...]
    out_dir: Path
    target: str
    draft_vocab: int
    val_conversations: int
    time_limit_s: float | None
    command: str
    feature_cache: Path | None = None  # memory-mapped target features (built on first use)
    init_from: Path | None = None  # a drafter checkpoint whose weights start the run (fresh optimizer)
    device: str = "cpu"  # where the target's features and the drafter's training run ("cuda": bf16 autocast)
    micro_batch: int = 1  # sequences per forward pass (speed and memory only, trainer.train)


def load_samples(data_dirs: Iterable[Path], max_seq_len: int) -> list[TrainSample]:
    """Records of every directory, in order, as TrainSamples cut to max_seq_len: distilled ones
    (prompt_ids + response_ids; under 2 response tokens inside the cut are skipped) and
    teacher-forced conversations (input_ids + loss_spans, `moaspec data sharegpt`)."""
    from moaspec.train.distill import read_shards, record_fields

    samples = []
    for data_dir in data_dirs:
        found = len(samples)
        try:
            _add_samples(samples, read_shards(data_dir, record_fields), max_seq_len)
        except (KeyError, TypeError, ValueError) as exc:
            raise MoaspecError(f"{data_dir} holds a record that is not training data ({type(exc).__name__}: {exc})") from exc
        if len(samples) == found:
            raise MoaspecError(
                f"{data_dir} has no usable records: none has 2 or more learned tokens within --max-seq-len "
                f"{max_seq_len} (or it is empty: run `moaspec data distill` or `moaspec data sharegpt` first)"
            )
    return samples


def _add_samples(samples: list[TrainSample], records: list[dict], max_seq_len: int) -> None:
    """Append `records` (distilled or teacher-forced) to `samples` as TrainSamples (load_samples)."""
    for record in records:
        if "loss_spans" in record:
            ids = torch.tensor(record["input_ids"][:max_seq_len], dtype=torch.long)
            cut = [(start, min(end, ids.numel())) for start, end in record["loss_spans"]]
            spans = tuple((start, end) for start, end in cut if end - start >= 2)
            if spans:
                samples.append(TrainSample(ids, spans[0][0], index=len(samples), loss_spans=spans))
            continue
        prompt, response = record["prompt_ids"], record["response_ids"]
        if len(response) < 2 or len(prompt) >= max_seq_len - 2:
            continue
        ids = torch.tensor(prompt + response, dtype=torch.long)[:max_seq_len]
        samples.append(TrainSample(ids, len(prompt), index=len(samples)))


def build_net(
    method: str,
    target: Target,
    tli_layers: int,
    draft_vocab_ids: torch.Tensor | None,
    memory_layers: int = 0,
    memory_hidden: bool = False,
    layer_attention: bool = True,
    cross_attention: bool = True,
    intermediate_size: int = 0,
) -> DrafterNet:
    """A freshly initialised drafter for `target` (float32 master weights); MoA's
    `intermediate_size` 0 is 3/2 x the target's hidden size."""
    size = 0 if draft_vocab_ids is None else draft_vocab_ids.numel()
    if method == "moa":
        from moaspec.nn.moa import MoAConfig, MoADrafterNet

        config = MoAConfig.for_target(
            target.config, tli_layers=tli_layers, draft_vocab_size=size, memory_layers=memory_layers,
            memory_hidden=memory_hidden, layer_attention=layer_attention, cross_attention=cross_attention,
            intermediate_size=intermediate_size,
        )
        net = MoADrafterNet(config)
    else:
        from moaspec.nn.eagle import EagleConfig, EagleDrafterNet

        net = EagleDrafterNet(EagleConfig.for_target(target.config, draft_vocab_size=size))
    if draft_vocab_ids is not None:
        net.draft_vocab_ids.copy_(draft_vocab_ids)
    return net.float()


def checkpoint_net_config(directory: Path) -> dict:
    """The drafter config a checkpoint records (its sizes and switches, config.json's "config")."""
    try:
        config = json.loads((directory / "config.json").read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MoaspecError(f"{directory} is not a drafter checkpoint (no readable config.json)") from exc
    if not isinstance(config, dict):
        raise MoaspecError(f"{directory} is not a drafter checkpoint (no readable config.json)")
    return config


def checkpoint_vocab_size(directory: Path) -> int:
    """The draft vocabulary size a drafter checkpoint records (0: the full vocabulary)."""
    try:
        return int(checkpoint_net_config(directory).get("draft_vocab_size", 0))
    except (TypeError, ValueError) as exc:
        raise MoaspecError(f"{directory} is not a drafter checkpoint (no readable config.json)") from exc


def initial_feed_forward_width(config: TrainConfig, init_from: Path | None) -> int:
    """MoA's feed-forward width for a run: `config.intermediate_size`, else that of the --init-from
    checkpoint of the same method, else 0 (3/2 x the target's hidden size, MoAConfig.for_target)."""
    if config.intermediate_size or config.method != "moa" or init_from is None:
        return config.intermediate_size
    try:
        return int(checkpoint_net_config(init_from).get("intermediate_size") or 0)
    except (TypeError, ValueError):
        return 0  # the checkpoint's config is checked when its weights load (load_initial_weights)


def load_initial_weights(net: torch.nn.Module, directory: Path, target: Target, config: TrainConfig) -> dict:
    """Copy the weights of the drafter checkpoint in `directory` into `net` (continued training or
    fine-tuning: the optimizer and schedule start afresh); -> its provenance (steps, command,
    training tokens, wall time, and its own `init_from`, so a chain of continuations stays
    traceable). The checkpoint's draft vocabulary comes with it. A MoA checkpoint may read more
    target layers than this net (`memory_layers`): the layer mix keeps those layers' weights; one
    without `memory_hidden` starts a net with it (its hidden-state map at zero: the same function),
    and any one a net without the layer attention (its LSA weights dropped) or without the
    cross-attention (its weights kept, unused): the ablations. A MoA with narrower feed-forward
    layers starts a wider one (`intermediate_size`; the new units' output weights at zero: the
    same function, _widen_feed_forward). A MoA of another TLI depth starts
    this one (TLI borrows the target's frozen layers and adds no weights: the same weights, their
    output now entering the target's last k layers, a fine-tuning start).
    MoaspecError when its method, vocabulary size or other sizes differ."""
    from moaspec.nn.checkpoint import read_checkpoint

    record, weights = read_checkpoint(directory, target)
    if record["method"] != config.method:
        raise MoaspecError(f"--init-from {directory} holds a drafter of method '{record['method']}', not '{config.method}'")
    try:
        recorded_config = net.config_class(**record.get("config", {}))
    except (TypeError, ValueError) as exc:
        raise MoaspecError(f"--init-from {directory} has an unreadable drafter config ({exc})") from exc
    wanted, recorded = net.config.to_dict(), recorded_config.to_dict()
    differing = {key for key in wanted if wanted[key] != recorded[key]}
    if "memory_layers" in differing and set(net.config.memory_layer_ids) <= set(recorded_config.memory_layer_ids):
        weights = _narrow_layer_mix(weights, recorded_config.memory_layer_ids, net.config.memory_layer_ids)
        differing.discard("memory_layers")
    if "memory_hidden" in differing and wanted["memory_hidden"]:  # its hidden-state map starts at zero
        weights = {**weights, "h2m.weight": net.h2m.weight.detach().clone()}
        differing.discard("memory_hidden")
    if "layer_attention" in differing and not wanted["layer_attention"]:
        weights = {name: value for name, value in weights.items() if not name.startswith("layer_self_attention.")}
        differing.discard("layer_attention")
    if "cross_attention" in differing and not wanted["cross_attention"]:
        differing.discard("cross_attention")
    if "intermediate_size" in differing and wanted["intermediate_size"] > recorded["intermediate_size"]:
        weights = _widen_feed_forward(weights, net, recorded["intermediate_size"])
        differing.discard("intermediate_size")
    differing.discard("tli_layers")
    if differing:
        detail = ", ".join(f"{key} {recorded[key]} vs {wanted[key]}" for key in sorted(differing))
        raise MoaspecError(f"--init-from {directory} does not fit this drafter ({detail})")
    net.load_state_dict({name: v.float() if v.is_floating_point() else v for name, v in weights.items()})
    training = record.get("training", {})
    recorded = ("step", "command", "num_train_tokens", "train_wall_s")
    provenance = {key: training[key] for key in recorded if key in training}
    if "init_from" in training:  # the lineage: what that run itself continued
        provenance["init_from"] = training["init_from"]
    return {"path": str(directory), **provenance}


def _narrow_layer_mix(weights: dict, recorded_ids: tuple[int, ...], wanted_ids: tuple[int, ...]) -> dict:
    """A MoA state dict reading `recorded_ids` cut down to read `wanted_ids` (a subset): only the
    layer mix [Lm] depends on the layers read (the LSA places layers by their index)."""
    if "layer_mix_raw" not in weights:
        return weights
    rows = torch.tensor([recorded_ids.index(layer) for layer in wanted_ids])
    return {**weights, "layer_mix_raw": weights["layer_mix_raw"][rows]}


MOA_FEED_FORWARDS = ("self_attention.mlp.", "ca_mlp.")  # MoA's layers of width intermediate_size


def _widen_feed_forward(weights: dict, net: torch.nn.Module, width: int) -> dict:
    """A MoA state dict whose feed-forward layers are `width` wide, widened to `net`'s: the units
    it has keep their weights, the new ones take `net`'s fresh input weights and zero output
    weights, so the widened drafter computes what the narrow one did."""
    widened = dict(weights)
    fresh = net.state_dict()
    for prefix in MOA_FEED_FORWARDS:
        for name in ("gate_proj.weight", "up_proj.weight"):  # [I, H]: new rows are new units
            key = prefix + name
            widened[key] = torch.cat([weights[key].to(fresh[key].dtype), fresh[key][width:]], dim=0)
        key = prefix + "down_proj.weight"  # [H, I]: new columns at zero
        new_columns = torch.zeros_like(fresh[key][:, width:])
        widened[key] = torch.cat([weights[key].to(fresh[key].dtype), new_columns], dim=1)
    return widened


def split_validation(samples: list[TrainSample], count: int) -> tuple[list[TrainSample], list[TrainSample]]:
    """(validation, training): `count` records evenly spaced through the data set, the rest train.

    Spaced rather than the first `count`: `moaspec data distill` writes its batches grouped by
    prompt length and decoding mode, so the first records are the shortest prompts of one mode
    (all greedy or all sampled), which makes validation accuracy optimistic or pessimistic.
    """
    if len(samples) <= count:
        raise MoaspecError(f"{len(samples)} records cannot spare {count} for validation (--val-conversations {count})")
    held = {i * len(samples) // count for i in range(count)}
    validation = [sample for position, sample in enumerate(samples) if position in held]
    return validation, [sample for position, sample in enumerate(samples) if position not in held]


def recorded_training(out_dir: Path) -> dict | None:
    """What the checkpoint of the run in `out_dir` records of its training (config.json's
    `training`: data, validation records, --draft-vocab, --init-from, ...), or None before its
    first saved step; MoaspecError naming the file when it cannot be read."""
    config_path = out_dir / "checkpoint" / "config.json"
    if not (out_dir / STATE_FILE).is_file() or not config_path.is_file():
        return None
    try:
        training = json.loads(config_path.read_text()).get("training", {})
        if not isinstance(training, dict):
            raise ValueError("its 'training' is not an object")
    except (OSError, ValueError, AttributeError) as exc:
        raise MoaspecError(f"{config_path} is not a readable drafter config ({exc}); use a new --out") from None
    return training


def check_same_data(
    out_dir: Path, training: dict | None, data_dirs: tuple[Path, ...], train_samples: list[TrainSample], val_indices: list[int]
) -> None:
    """A run resumes only on the data and validation records it started with (`training`: its
    `recorded_training`, None for a new run): as many held out (--val-conversations), the same
    training sequences and tokens as recorded (whatever path names the same data), then the same
    validation records (older versions held out the first records: resuming such a run would
    move records between the two sets)."""
    if training is None:
        return
    held = training.get("val_indices")
    if isinstance(held, list) and len(held) != len(val_indices):
        raise MoaspecError(
            f"{out_dir} was started with --val-conversations {len(held)}, not {len(val_indices)}; "
            "rerun with the same options to resume, or use a new --out"
        )
    recorded = (training.get("num_train_sequences"), training.get("num_train_tokens"))
    now = (len(train_samples), sum(sample.input_ids.numel() for sample in train_samples))
    if None not in recorded and recorded != now:
        raise MoaspecError(
            f"{out_dir} was started on other data (--data {' '.join(map(str, training.get('data', [])))}: "
            f"{recorded[0]} training sequences of {recorded[1]} tokens; --data {' '.join(map(str, data_dirs))}: "
            f"{now[0]} of {now[1]}); rerun with the same --data to resume, or use a new --out"
        )
    if held != val_indices:
        raise MoaspecError(
            f"{out_dir} was started with other validation records (an older moaspec, or other data); use a new --out"
        )


def open_feature_cache(
    target: HFTarget, samples: list[TrainSample], directory: Path, tli_layers: int, kv_layers: tuple[int, ...]
) -> FeatureCache:
    """The FeatureCache of `samples` in `directory`, built (or finished) first when needed, sized
    to what this drafter reads: the keys/values of `kv_layers` and TLI depth `tli_layers`."""
    from moaspec.nn.checkpoint import target_fingerprint
    from moaspec.train.feature_cache import build_feature_cache, cached_tli_depth

    fingerprint = target_fingerprint(target)
    tli_max = cached_tli_depth(target.num_layers, tli_layers, kv_layers)
    cache = build_feature_cache(target, samples, directory, fingerprint, tli_max=tli_max, kv_layers=kv_layers)
    cache.check(samples, fingerprint, tli_layers, kv_layers)
    return cache


def run_training(spec: RunSpec, config: TrainConfig, tree: TreeConfig) -> Path:
    """Train a drafter as `spec` says; returns the checkpoint directory."""
    from moaspec.api import load_target

    started = time.perf_counter()
    check_resumable(spec.out_dir, config)
    samples = load_samples(spec.data_dirs, config.max_seq_len)  # the data's refusals before the target loads
    val_samples, train_samples = split_validation(samples, spec.val_conversations)
    val_indices = [sample.index for sample in val_samples]
    training = recorded_training(spec.out_dir)
    check_same_data(spec.out_dir, training, spec.data_dirs, train_samples, val_indices)
    if training is not None and _finished(spec, config, training):
        print(f"[moaspec] {spec.out_dir} is complete already ({config.steps} steps): nothing to train", file=sys.stderr)
        log_run(spec, config.steps, time.perf_counter() - started, "complete")
        return spec.out_dir / "checkpoint"
    torch.manual_seed(config.seed)
    target = load_target(spec.target, dtype=torch.float32, runtime="transformers")
    target.model.to(spec.device)
    check_data_target(spec.data_dirs, target.name)
    responses = [s.learned_tokens() for s in train_samples]
    width = initial_feed_forward_width(config, spec.init_from)
    vocab_ids = _draft_vocabulary(spec, target, responses)
    net = build_net(
        config.method, target, config.tli_layers, vocab_ids, config.memory_layers, config.memory_hidden,
        config.layer_attention, config.cross_attention, width,
    )
    initial = None
    if spec.init_from is not None:
        initial = load_initial_weights(net, spec.init_from, target, config)
        vocab_ids = net.draft_vocab_ids if net.config.draft_vocab_size else None
    provenance = _provenance(spec, train_samples, val_indices, responses, vocab_ids, initial)
    source = None
    if spec.feature_cache is not None:
        source = open_feature_cache(target, samples, spec.feature_cache, config.tli_layers, kv_layers_read(net, config))
        provenance["feature_cache"] = {"path": str(spec.feature_cache), "build_wall_s": source.index.get("build_wall_s")}
    try:
        state = train(
            net, target, train_samples, val_samples, config, spec.out_dir,
            tree=tree.__dict__, provenance=provenance, stop_after_s=spec.time_limit_s, source=source,
            micro_batch=spec.micro_batch,
        )
    except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: train() saved the last completed step
        from moaspec.signals import Terminated

        saved = saved_state(spec.out_dir)
        ended = "terminated" if isinstance(stop, Terminated) else "interrupted"
        log_run(spec, None if saved is None else int(saved["step"]), time.perf_counter() - started, ended)
        raise
    ended = "complete" if state.step >= config.steps else "time limit"
    log_run(spec, state.step, time.perf_counter() - started, ended)
    if state.step < config.steps:
        print(
            f"[moaspec] the time limit stopped training at step {state.step} of {config.steps}; "
            "the same command continues this run",
            file=sys.stderr,
        )
    return spec.out_dir / "checkpoint"


def _draft_vocabulary(spec: RunSpec, target: HFTarget, responses: list[torch.Tensor]) -> torch.Tensor | None:
    """The draft vocabulary's full-vocabulary ids [V_draft] (None: the full vocabulary): --init-from's
    size as placeholders (its ids come with its weights, `load_initial_weights`), else the
    --draft-vocab most frequent tokens of the training answers, the stop tokens always in."""
    if spec.init_from is not None:
        size = checkpoint_vocab_size(spec.init_from)
        return torch.zeros(size, dtype=torch.long) if size else None
    if not spec.draft_vocab:
        return None
    vocab_ids = most_frequent_token_ids(responses, spec.draft_vocab, always_include=target.stop_ids)
    if vocab_ids.numel() < spec.draft_vocab:
        print(
            f"moaspec: note: --draft-vocab {spec.draft_vocab} is more than the {vocab_ids.numel()} tokens the training "
            f"answers hold (with the stop tokens): the draft vocabulary has those {vocab_ids.numel()}",
            file=sys.stderr,
        )
    return vocab_ids


def _provenance(
    spec: RunSpec, train_samples: list[TrainSample], val_indices: list[int], responses: list[torch.Tensor],
    vocab_ids: torch.Tensor | None, initial: dict | None,
) -> dict:
    """What the checkpoint records of its run: the command, the data and its manifests, the
    validation split, the counts, the draft vocabulary's coverage, and --init-from's record."""
    provenance = {
        "command": spec.command,
        "data": [str(directory) for directory in spec.data_dirs],
        "draft_vocab": spec.draft_vocab,  # --draft-vocab and --init-from: what a finished run's rerun compares
        "data_manifest": [read_manifest(directory) for directory in spec.data_dirs],
        "val_indices": val_indices,
        "num_train_sequences": len(train_samples),
        "num_train_tokens": int(sum(s.input_ids.numel() for s in train_samples)),
        "num_learned_tokens": int(sum(end - start for s in train_samples for start, end in s.spans())),
        "draft_vocab_coverage": round(coverage(responses, vocab_ids), 4) if vocab_ids is not None else 1.0,
    }
    if initial is not None:
        provenance["init_from"] = initial
    return provenance


def _finished(spec: RunSpec, config: TrainConfig, training: dict) -> bool:
    """Whether the run in `spec.out_dir` (its checkpoint's `recorded_training`) has done every
    step, validated the last and was trained with this --draft-vocab and --init-from (not in the
    training config: a rerun that changed them takes the full path, whose checks refuse a drafter
    of another shape); a rerun of the same command then has nothing to do."""
    saved = saved_state(spec.out_dir)
    if saved is None or saved["step"] < config.steps:
        return False
    last = saved["history"][-1] if saved["history"] else {}
    initial = training.get("init_from")
    recorded_init = initial.get("path") if isinstance(initial, dict) else initial
    given = None if spec.init_from is None else str(spec.init_from)
    return "val_loss" in last and training.get("draft_vocab") == spec.draft_vocab and recorded_init == given


def log_run(spec: RunSpec, steps_done: int | None, wall_s: float, ended: str) -> None:
    """One line per invocation in `<out>/runs.jsonl`: the command, the steps done when it ended,
    its wall time (loading included) and how it ended (complete, time limit, interrupted by
    Ctrl-C, terminated by SIGTERM)."""
    record = {"command": spec.command, "steps_done": steps_done, "wall_s": round(wall_s, 1), "ended": ended}
    with (spec.out_dir / "runs.jsonl").open("a") as log:
        log.write(json.dumps(record) + "\n")

