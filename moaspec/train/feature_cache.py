"""Target features cached on disk as memory-mapped float16 arrays, shared by every training run.

Why (measured on this 2-core machine, SmolLM2-135M, MoA TLI 0, 8192-token draft vocabulary):
computing the features online costs about half of every training step (12 s of 24.5 s for 3,191
tokens: the target's prefill plus its full-vocabulary LM head for the soft labels). A data set is
trained on for several epochs and by three drafters (MoA TLI 0, MoA TLI k, EAGLE-2), so running
the target once per token and reading fp16 features back from the page cache is the better deal.
A cache holds what its drafter reads and no more (`kv_layers`, `tli_max`), except that an
all-layer cache also keeps TLI 1's stream (ALL_LAYER_CACHE_TLI), so MoA TLI 0 / 1 and EAGLE-2
share it: per token (Lk * kv_dim + (k_max + 1) * D) * 2 + 8 bytes. SmolLM2: EAGLE-2 (Lk = 0,
k_max = 0) 1.2 KB, MoA reading the last 4 layers 4.2 KB, the paper's all-layer MoA (Lk = 30,
k_max = 1) 25 KB; so 3 M tokens take 3.5 / 12.6 / 76 GB. Never committed.

Layout of a cache directory (one data set, one target):
  layer_kv.npy   [N, Lk, kv_dim] float16  per-layer [k_h, v_h] (post-RoPE keys) of the target
                 layers `kv_layers` (ascending); Lk may be 0
  hidden.npy     [N, k_max + 1, D] float16  residual streams entering layers L-k_max .. L-1,
                 then the post-norm final hidden state
  lse.npy        [N] float32  log-sum-exp of the full-vocabulary logits of the fp16 final state
  argmax.npy     [N] int32  the argmax of those logits (the target's next token)
  index.json     offsets per record, the data key, the target fingerprint, what is stored,
                 progress, `complete`
Building is resumable (progress is saved every few sequences) and the cache refuses data or a
target it was not built from.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from moaspec.atomic_files import write_file_atomically
from moaspec.errors import MoaspecError
from moaspec.targets.hf import HFTarget
from moaspec.train.features import TargetFeatures, TrainSample, target_summary

CACHE_VERSION = 2
INDEX = "index.json"
ARRAYS = ("layer_kv", "hidden", "lse", "argmax")
SAVE_EVERY = 16  # sequences between progress saves while building
# an all-layer cache keeps the residual stream entering the last layer as well (TLI 1): SmolLM2,
# 1.2 KB a token beside the layers' 23 KB
ALL_LAYER_CACHE_TLI = 1


def data_key(samples: list[TrainSample]) -> str:
    """A digest of the token ids and response starts of `samples`, in order."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(np.asarray(sample.spans(), dtype=np.int64).tobytes())
        digest.update(sample.input_ids.to(torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


class FeatureCache:
    """Read side: FeatureSource over a complete cache directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = json.loads((directory / INDEX).read_text())
        if index.get("version") != CACHE_VERSION:
            raise MoaspecError(
                f"feature cache {directory} was written by another moaspec version; use another directory"
            )
        if not index.get("complete"):
            raise MoaspecError(f"feature cache {directory} is incomplete; rerun the same command to finish it")
        self.index = index
        self.offsets = index["offsets"]  # [N_records + 1]
        self.tli_max = index["tli_max"]
        self.kv_layers: list[int] = index["kv_layers"]
        self.num_layers = index["num_layers"]
        self.num_kv_heads, self.head_dim = index["num_kv_heads"], index["head_dim"]
        self.layer_kv, self.hidden, self.lse, self.argmax = (
            np.load(directory / f"{name}.npy", mmap_mode="r") for name in ARRAYS
        )

    def check(self, samples: list[TrainSample], fingerprint: str, tli_layers: int, kv_layers: tuple[int, ...]) -> None:
        """Refuse a cache built from other data, for another target, or without the TLI depth or
        the layers' keys/values needed."""
        if self.index["data_key"] != data_key(samples) or self.index["num_records"] != len(samples):
            raise MoaspecError(f"feature cache {self.directory} was built from other data; use another --feature-cache directory")
        if self.index["target_fingerprint"] != fingerprint:
            raise MoaspecError(f"feature cache {self.directory} was built for another target")
        if tli_layers > self.tli_max:
            raise MoaspecError(
                f"feature cache {self.directory} holds TLI depths up to {self.tli_max}, not {tli_layers}; "
                "use another --feature-cache"
            )
        missing = sorted((set(kv_layers) | set(tli_kv_layers(self.num_layers, tli_layers))) - set(self.kv_layers))
        if missing:
            raise MoaspecError(
                f"feature cache {self.directory} lacks the keys/values of target layers {missing}; "
                "use another --feature-cache"
            )

    def features(self, sample: TrainSample, tli_layers: int, kv_layers: tuple[int, ...]) -> TargetFeatures:
        start, end = self.offsets[sample.index], self.offsets[sample.index + 1]
        if end - start != sample.input_ids.numel():
            raise MoaspecError(f"feature cache {self.directory} does not match record {sample.index}")
        hidden = torch.from_numpy(np.array(self.hidden[start:end])).float()  # [T, k_max + 1, D]
        wanted = list(kv_layers) + tli_kv_layers(self.num_layers, tli_layers)
        rows = [self.kv_layers.index(layer) for layer in wanted]
        kv = torch.from_numpy(np.array(self.layer_kv[start:end][:, rows])).float() if rows else torch.empty(0)
        tli_kv = []
        for position in range(len(kv_layers), len(wanted)):
            per_head = kv[:, position].view(end - start, self.num_kv_heads, 2, self.head_dim)  # [T, Hkv, 2, d]
            tli_kv.append((per_head[:, :, 0].transpose(0, 1).contiguous(), per_head[:, :, 1].transpose(0, 1).contiguous()))
        return TargetFeatures(
            layer_kv=kv[:, : len(kv_layers)] if kv_layers else torch.empty(0),
            final_hidden=hidden[:, -1],
            target_logsumexp=torch.from_numpy(np.array(self.lse[start:end])),
            target_argmax=torch.from_numpy(np.array(self.argmax[start:end])).long(),
            tli_kv=tli_kv,
            tli_hidden=hidden[:, self.tli_max - tli_layers] if tli_layers else None,
        )

    def batch_features(self, samples: list[TrainSample], tli_layers: int, kv_layers: tuple[int, ...]) -> list[TargetFeatures]:
        return [self.features(sample, tli_layers, kv_layers) for sample in samples]


def cached_tli_depth(num_layers: int, tli_layers: int, kv_layers: tuple[int, ...]) -> int:
    """The TLI depth a new cache stores for a run of TLI depth `tli_layers` reading `kv_layers`:
    that depth, or ALL_LAYER_CACHE_TLI for a cache of every layer's keys/values, so that MoA TLI 0,
    MoA TLI 1 and EAGLE-2 share it in any order (the README's training steps)."""
    every_layer = set(kv_layers) >= set(range(num_layers))
    return max(tli_layers, ALL_LAYER_CACHE_TLI) if every_layer else tli_layers


def tli_kv_layers(num_layers: int, tli_layers: int) -> list[int]:
    """The target layers whose keys/values TLI k reads: L-k .. L-1."""
    return list(range(num_layers - tli_layers, num_layers))


def _previous_build(directory: Path, index: dict) -> dict | None:
    """The index of a build begun in `directory` (complete or not) when it is of the same version,
    data and target and holds at least `index`'s layers and TLI depth; None when none was begun;
    a MoaspecError naming the directory for any other."""
    index_path = directory / INDEX
    if not index_path.is_file():
        return None
    previous = json.loads(index_path.read_text())
    if previous.get("version") != CACHE_VERSION:
        raise MoaspecError(f"feature cache {directory} was written by another moaspec version; use another directory")
    if previous.get("complete"):
        return previous
    compared = ("version", "data_key", "target_fingerprint")
    same = {name: previous.get(name) for name in compared} == {name: index[name] for name in compared}
    # a partial build holding more than asked (an all-layer cache's TLI stream) is finished as it was begun
    covers = previous.get("tli_max", -1) >= index["tli_max"] and set(previous.get("kv_layers", ())) >= set(index["kv_layers"])
    if not (same and covers):
        raise MoaspecError(
            f"{directory} holds a feature cache of other data, target, layers or TLI depth; use another directory"
        )
    return previous


def _store_features(
    target: HFTarget, ids: torch.Tensor, hidden_layers: tuple[int, ...], stored: list[int], arrays: dict,
    start: int, end: int,
) -> None:
    """One sample's features (ids [T]) from a fresh prefill into rows start:end of the cache's arrays."""
    target.reset()
    out = target.prefill(ids, hidden_layers)
    hidden = out.hidden.to(torch.float16).cpu()  # [T, k_max + 1, D]
    if stored:
        arrays["layer_kv"][start:end] = target.layer_kv(0, ids.numel(), stored).to(torch.float16).cpu().numpy()
    arrays["hidden"][start:end] = hidden.numpy()
    lse, argmax = target_summary(hidden[:, -1].float().to(target.device), target.lm_head.weight)
    arrays["lse"][start:end] = lse.cpu().numpy()
    arrays["argmax"][start:end] = argmax.to(torch.int32).cpu().numpy()


@torch.no_grad()
def build_feature_cache(
    target: HFTarget,
    samples: list[TrainSample],
    directory: Path,
    fingerprint: str,
    tli_max: int,
    kv_layers: tuple[int, ...],
    progress: bool = True,
) -> FeatureCache:
    """Run the target once over every sample and store its features in `directory`: the
    keys/values of `kv_layers` and the TLI streams up to depth `tli_max` (with their layers'
    keys/values); resumes a partial build of the same data. A complete cache is returned as it
    is: call `FeatureCache.check` to see that it fits."""
    from tqdm import tqdm

    index_path = directory / INDEX
    index = _new_index(target, samples, fingerprint, tli_max, kv_layers)
    offsets, num_layers, hidden_size = index["offsets"], index["num_layers"], target.hidden_size
    kv_width = 2 * index["num_kv_heads"] * index["head_dim"]
    stored = index["kv_layers"]
    previous = _previous_build(directory, index)
    if previous is not None and previous["complete"]:
        return FeatureCache(directory)
    if previous is not None:  # a partial build, finished as it was begun
        index = previous
        tli_max, stored = index["tli_max"], index["kv_layers"]
    else:
        directory.mkdir(parents=True, exist_ok=True)
    shapes = {
        "layer_kv": ((offsets[-1], len(stored), kv_width), np.float16),
        "hidden": ((offsets[-1], tli_max + 1, hidden_size), np.float16),
        "lse": ((offsets[-1],), np.float32),
        "argmax": ((offsets[-1],), np.int32),
    }
    fresh = index["done"] == 0
    arrays = {
        name: np.lib.format.open_memmap(directory / f"{name}.npy", mode="w+" if fresh else "r+", dtype=dtype, shape=shape)
        for name, (shape, dtype) in shapes.items()
    }
    if fresh:
        write_file_atomically(index_path, json.dumps(index) + "\n")
    hidden_layers = tuple(range(num_layers - tli_max, num_layers + 1))
    started, wall_before = time.perf_counter(), index.get("build_wall_s", 0.0)
    bar = tqdm(total=offsets[-1], initial=offsets[index["done"]], unit="tok", desc="target features", disable=not progress)
    with bar:  # closed on an interrupt too, so the CLI's last line starts on a line of its own
        for position in range(index["done"], len(samples)):
            start, end = offsets[position], offsets[position + 1]
            _store_features(target, samples[position].input_ids, hidden_layers, stored, arrays, start, end)
            bar.update(end - start)
            if (position + 1) % SAVE_EVERY == 0 or position + 1 == len(samples):
                for array in arrays.values():
                    array.flush()
                index["done"] = position + 1
                index["complete"] = position + 1 == len(samples)
                index["build_wall_s"] = round(wall_before + time.perf_counter() - started, 1)
                write_file_atomically(index_path, json.dumps(index) + "\n")
    target.reset()
    del arrays
    return FeatureCache(directory)


def _new_index(
    target: HFTarget, samples: list[TrainSample], fingerprint: str, tli_max: int, kv_layers: tuple[int, ...]
) -> dict:
    """The index (INDEX) a fresh build of `samples` starts from: where each record's tokens start,
    the layers whose keys/values it stores (`kv_layers` and those of TLI up to `tli_max`), nothing
    done yet."""
    lengths = [sample.input_ids.numel() for sample in samples]
    config = target.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "version": CACHE_VERSION, "data_key": data_key(samples), "target_fingerprint": fingerprint,
        "num_records": len(samples), "offsets": np.concatenate([[0], np.cumsum(lengths)]).tolist(),
        "tli_max": tli_max, "kv_layers": sorted(set(kv_layers) | set(tli_kv_layers(target.num_layers, tli_max))),
        "num_layers": target.num_layers, "num_kv_heads": config.num_key_value_heads, "head_dim": head_dim,
        "done": 0, "complete": False, "build_wall_s": 0.0,
    }
