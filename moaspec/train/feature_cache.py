"""Target features cached on disk as memory-mapped float16 arrays, shared by every training run.

Why (measured on this 2-core machine, SmolLM2-135M, MoA TLI 0, 8192-token draft vocabulary):
computing the features online costs about half of every training step (12 s of 24.5 s for 3,191
tokens: the target's prefill plus its full-vocabulary LM head for the teacher). A data set is
trained on for several epochs and by three drafters (MoA TLI 0, MoA TLI k, EAGLE-2), so running
the target once per token and reading fp16 features back from the page cache is the better deal.
Size: (L * kv_dim + (k_max + 1) * D) * 2 bytes + 4 per token, 25 KB for SmolLM2, so 6 GB for the
240k tokens of the shipped data: fine on disk, never committed.

Layout of a cache directory (one data set, one target):
  layer_kv.npy   [N, L, kv_dim] float16  per-layer [k_h, v_h] of every token (post-RoPE keys)
  hidden.npy     [N, k_max + 1, D] float16  residual streams entering layers L-k_max .. L-1,
                 then the post-norm final hidden state
  lse.npy        [N] float32  log-sum-exp of the full-vocabulary logits of the fp16 final state
  index.json     offsets per record, the data key, the target fingerprint, progress, `complete`
Building is resumable (progress is saved every few sequences) and the cache refuses data or a
target it was not built from.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from moaspec.errors import MoaspecError
from moaspec.target import HFTarget
from moaspec.train.features import TargetFeatures, TrainSample, logsumexp_of_logits

CACHE_VERSION = 1
INDEX = "index.json"
ARRAYS = ("layer_kv", "hidden", "lse")
SAVE_EVERY = 16  # sequences between progress saves while building


def data_key(samples: list[TrainSample]) -> str:
    """A digest of the token ids and response starts of `samples`, in order."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(np.int64(sample.response_start).tobytes())
        digest.update(sample.input_ids.to(torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def _write_json_atomic(path: Path, payload: dict) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(json.dumps(payload) + "\n")
    os.replace(staging, path)


class FeatureCache:
    """Read side: FeatureSource over a complete cache directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = json.loads((directory / INDEX).read_text())
        if not index.get("complete"):
            raise MoaspecError(f"feature cache {directory} is incomplete; rerun the same command to finish it")
        self.index = index
        self.offsets = index["offsets"]  # [N_records + 1]
        self.tli_max = index["tli_max"]
        self.num_kv_heads, self.head_dim = index["num_kv_heads"], index["head_dim"]
        self.layer_kv, self.hidden, self.lse = (np.load(directory / f"{name}.npy", mmap_mode="r") for name in ARRAYS)

    def check(self, samples: list[TrainSample], fingerprint: str, tli_layers: int) -> None:
        """Refuse a cache built from other data, for another target, or without the TLI depth needed."""
        if self.index["data_key"] != data_key(samples) or self.index["num_records"] != len(samples):
            raise MoaspecError(f"feature cache {self.directory} was built from other data; use another --feature-cache directory")
        if self.index["target_fingerprint"] != fingerprint:
            raise MoaspecError(f"feature cache {self.directory} was built for another target")
        if tli_layers > self.tli_max:
            raise MoaspecError(f"feature cache {self.directory} holds TLI depths up to {self.tli_max}, not {tli_layers}")

    def features(self, sample: TrainSample, tli_layers: int, layer_kv: bool) -> TargetFeatures:
        start, end = self.offsets[sample.index], self.offsets[sample.index + 1]
        if end - start != sample.input_ids.numel():
            raise MoaspecError(f"feature cache {self.directory} does not match record {sample.index}")
        hidden = torch.from_numpy(np.array(self.hidden[start:end])).float()  # [T, k_max + 1, D]
        kv = torch.from_numpy(np.array(self.layer_kv[start:end])).float() if layer_kv or tli_layers else torch.empty(0)
        tli_kv = []
        num_layers = kv.shape[1] if tli_layers else 0
        for layer in range(num_layers - tli_layers, num_layers):
            per_head = kv[:, layer].view(end - start, self.num_kv_heads, 2, self.head_dim)  # [T, Hkv, 2, d]
            tli_kv.append((per_head[:, :, 0].transpose(0, 1).contiguous(), per_head[:, :, 1].transpose(0, 1).contiguous()))
        return TargetFeatures(
            layer_kv=kv if layer_kv else torch.empty(0),
            final_hidden=hidden[:, -1],
            teacher_logsumexp=torch.from_numpy(np.array(self.lse[start:end])),
            tli_kv=tli_kv,
            tli_hidden=hidden[:, self.tli_max - tli_layers] if tli_layers else None,
        )


@torch.no_grad()
def build_feature_cache(
    target: HFTarget, samples: list[TrainSample], directory: Path, fingerprint: str, tli_max: int, progress: bool = True
) -> FeatureCache:
    """Run the target once over every sample and store its features in `directory`; resumes a
    partial build of the same data. A complete cache is returned as it is: call
    `FeatureCache.check` to see that it fits."""
    from tqdm import tqdm

    key = data_key(samples)
    index_path = directory / INDEX
    lengths = [sample.input_ids.numel() for sample in samples]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    config = target.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    index = {
        "version": CACHE_VERSION, "data_key": key, "target_fingerprint": fingerprint, "num_records": len(samples),
        "offsets": offsets, "tli_max": tli_max, "num_kv_heads": config.num_key_value_heads, "head_dim": head_dim,
        "done": 0, "complete": False, "build_wall_s": 0.0,
    }
    if index_path.is_file():
        previous = json.loads(index_path.read_text())
        if previous.get("complete"):
            return FeatureCache(directory)
        same = {name: previous.get(name) for name in ("version", "data_key", "target_fingerprint", "tli_max")}
        if same != {name: index[name] for name in same}:
            raise MoaspecError(f"{directory} holds a feature cache of other data, target or TLI depth; use another directory")
        index = previous
    else:
        directory.mkdir(parents=True, exist_ok=True)
    num_layers, hidden_size = target.num_layers, target.hidden_size
    shapes = {
        "layer_kv": ((offsets[-1], num_layers, 2 * config.num_key_value_heads * head_dim), np.float16),
        "hidden": ((offsets[-1], tli_max + 1, hidden_size), np.float16),
        "lse": ((offsets[-1],), np.float32),
    }
    fresh = index["done"] == 0
    arrays = {
        name: np.lib.format.open_memmap(directory / f"{name}.npy", mode="w+" if fresh else "r+", dtype=dtype, shape=shape)
        for name, (shape, dtype) in shapes.items()
    }
    if fresh:
        _write_json_atomic(index_path, index)
    hidden_layers = tuple(range(num_layers - tli_max, num_layers + 1))
    started, wall_before = time.perf_counter(), index.get("build_wall_s", 0.0)
    bar = tqdm(total=offsets[-1], initial=offsets[index["done"]], unit="tok", desc="target features", disable=not progress)
    for position in range(index["done"], len(samples)):
        ids = samples[position].input_ids
        start, end = offsets[position], offsets[position + 1]
        target.reset()
        out = target.prefill(ids, hidden_layers)
        hidden = out.hidden.to(torch.float16)  # [T, k_max + 1, D]
        arrays["layer_kv"][start:end] = target.layer_kv(0, ids.numel()).to(torch.float16).numpy()
        arrays["hidden"][start:end] = hidden.numpy()
        arrays["lse"][start:end] = logsumexp_of_logits(hidden[:, -1].float(), target.lm_head.weight).numpy()
        bar.update(end - start)
        if (position + 1) % SAVE_EVERY == 0 or position + 1 == len(samples):
            for array in arrays.values():
                array.flush()
            index["done"] = position + 1
            index["complete"] = position + 1 == len(samples)
            index["build_wall_s"] = round(wall_before + time.perf_counter() - started, 1)
            _write_json_atomic(index_path, index)
    target.reset()
    bar.close()
    del arrays
    return FeatureCache(directory)
