"""A training run's resumable state: `train_state.pt` beside the float16 drafter checkpoint in
the run's directory (`save_state`), read back on resume (`resume_state`), which refuses a state
written with another training config or network shape, naming what changed. Writes go through a
hidden staging file with signals held, so no interruption leaves a partial state behind.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import torch

from moaspec.errors import MoaspecError, first_line
from moaspec.signals import signals_held
from moaspec.train.config import TrainConfig

if TYPE_CHECKING:
    from pathlib import Path

    from moaspec.targets.hf import HFTarget

STATE_FILE = "train_state.pt"
STATE_KEYS = ("config", "net", "optimizer", "step", "history", "python_rng", "torch_rng")


@dataclass
class TrainState:
    step: int = 0
    history: list[dict] = field(default_factory=list)
    train_wall_s: float = 0.0  # time spent in train() over all resumed calls


def resume_state(
    out_dir: Path, config: TrainConfig, net: torch.nn.Module, optimizer: torch.optim.Optimizer,
    rng: random.Random, generator: torch.Generator,
) -> TrainState:
    """Where a run in `out_dir` stopped: its weights, optimizer state and random states loaded
    into `net`, `optimizer`, `rng` and `generator` (a run of another config or network shape
    refused, naming what changed); a fresh TrainState when it has not begun."""
    state_path = out_dir / STATE_FILE
    if not state_path.is_file():
        return TrainState()
    saved = _read_state(state_path, mmap=False)
    _check_same_config(saved, config, state_path)
    _check_same_network(saved, net, state_path)
    net.load_state_dict(saved["net"])
    optimizer.load_state_dict(saved["optimizer"])
    rng.setstate(saved["python_rng"])
    generator.set_state(saved["torch_rng"])
    return TrainState(saved["step"], saved["history"], saved.get("train_wall_s", 0.0))


def check_resumable(out_dir: Path, config: TrainConfig) -> None:
    """ValueError naming the changed settings when `out_dir` holds a run begun with another
    config (checked before the features are prepared: a feature cache of other layers would
    otherwise be the first complaint)."""
    saved = saved_state(out_dir)
    if saved is not None:
        _check_same_config(saved, config, out_dir / STATE_FILE)


def saved_state(out_dir: Path) -> dict | None:
    """The resumable state in `out_dir` memory-mapped, for its config and step without reading
    its weights and optimizer state (train() loads those); None when there is none yet."""
    state_path = out_dir / STATE_FILE
    if not state_path.is_file():
        return None
    return _read_state(state_path, mmap=True)


def _read_state(state_path: Path, mmap: bool) -> dict:
    """The saved state at `state_path`; MoaspecError naming it when it is damaged (truncated,
    not torch's, lacking a field)."""
    try:
        saved = torch.load(state_path, weights_only=False, map_location="cpu", mmap=mmap)
    except Exception as exc:  # noqa: BLE001  torch raises RuntimeError, EOFError, UnpicklingError, ... for a damaged file
        saved, problem = None, first_line(exc)
    else:
        missing = [key for key in STATE_KEYS if key not in saved] if isinstance(saved, dict) else ["a dict"]
        problem = f"no {', '.join(missing)}" if missing else None
    if problem is not None:
        raise MoaspecError(
            f"{state_path} is not a readable training state ({problem}); remove it to start the run again "
            "(--init-from its checkpoint keeps the weights)"
        )
    return saved


def _check_same_config(saved: dict, config: TrainConfig, state_path: Path) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}  # fields added since the run began
    written, wanted = {**defaults, **saved["config"]}, asdict(config)
    if written != wanted:
        raise ValueError(
            f"{state_path} was written with another training config ({', '.join(_changes(written, wanted))}); "
            "rerun with the same options to resume, continue a finished run with --init-from it and a new --out"
        )


def _changes(written: dict, wanted: dict) -> list[str]:
    """'key old -> new' for every setting of `wanted` that `written` holds otherwise."""
    return [f"{key} {written.get(key)} -> {wanted[key]}" for key in sorted(wanted) if written.get(key) != wanted[key]]


def _check_same_network(saved: dict, net: torch.nn.Module, state_path: Path) -> None:
    """ValueError naming what differs when the saved drafter is not of `net`'s shape (the network
    settings, e.g. --draft-vocab or --memory-layers, changed since the run began)."""
    wanted = net.config.to_dict()
    written = saved.get("net_config")
    if written is not None and written != wanted:
        changes = _changes(written, wanted)
    else:  # states saved before net_config: compare the tensors' shapes
        current = net.state_dict()
        changes = [
            f"{name} {tuple(tensor.shape)} -> {tuple(current[name].shape) if name in current else 'absent'}"
            for name, tensor in saved["net"].items()
            if name not in current or current[name].shape != tensor.shape
        ]
    if changes:
        raise ValueError(
            f"{state_path} holds a drafter of another shape ({', '.join(changes)}): the network settings "
            "(--draft-vocab, --memory-layers, --tli-layers, ...) changed; rerun with the same options to resume"
        )


def save_state(
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    config: TrainConfig,
    rng: random.Random,
    generator: torch.Generator,
    out_dir: Path,
    target: HFTarget,
    tree: dict | None,
    provenance: dict | None,
) -> None:
    """The resumable state (fp32) and a float16 drafter checkpoint with the full config, written
    with signals held: a second Ctrl-C while the first one's save runs waits for it."""
    with signals_held():
        _write_state(net, optimizer, state, config, rng, generator, out_dir)
        training = {
            "train_config": asdict(config), "step": state.step, "train_wall_s": round(state.train_wall_s, 1),
            "last": state.history[-1] if state.history else {}, **(provenance or {}),
        }
        net.save_pretrained(out_dir / "checkpoint", target, tree=tree, training=training)


def _write_state(
    net: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainState, config: TrainConfig,
    rng: random.Random, generator: torch.Generator, out_dir: Path,
) -> None:
    """train_state.pt, through a hidden staging file that no end leaves behind."""
    staging = out_dir / f".{STATE_FILE}.tmp"  # hidden: a run directory may hold it (--out's check)
    state_record = {
        "config": asdict(config),
        "net_config": net.config.to_dict(),  # the network's shape: a resume must build the same
        "net": net.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": state.step,
        "history": state.history,
        "train_wall_s": state.train_wall_s,
        "python_rng": rng.getstate(),
        "torch_rng": generator.get_state(),
    }
    try:
        torch.save(state_record, staging)
        staging.replace(out_dir / STATE_FILE)
    except (OSError, RuntimeError) as exc:  # a full disk surfaces as torch's RuntimeError ("unexpected pos")
        raise MoaspecError(
            f"cannot write the training state into {out_dir} ({first_line(exc)}); the run resumes from its last saved step"
        ) from None
    finally:
        staging.unlink(missing_ok=True)
