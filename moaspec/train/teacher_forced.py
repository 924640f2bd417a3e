"""Teacher-forced training data: whole ShareGPT conversations, every assistant turn a loss span.

`moaspec data distill` has the target write its own answers (on-policy, ~100 generated tokens/s
here). This is the other source EAGLE-1 trained on: the conversations as people had them, all
turns through the target's chat template, no generation at all (a tokenizer pass, thousands of
conversations a minute). The target still provides the labels: training runs it over the whole
sequence and learns its soft distribution and features at every assistant position, so the
drafter learns what the target would say after each real context, not the recorded text.

Records: {"id", "input_ids", "loss_spans": [[start, end], ...], "mode": "teacher-forced"}; a span
[start, end) holds the tokens of one assistant turn (its template markers included, cut after
the first end-of-sequence token); the sequence is cut at `max_seq_len` tokens and spans with
fewer than 2 tokens inside the cut are dropped. Conversations the template does not encode
prefix-stably (the encoding of the first k turns is not a prefix of the first k + 1) are skipped
and counted, so a span never covers a user's words.

Resume: the records are a pure function of (data, tokenizer, config), and the manifest says
`complete: false` until every shard is written, so the same command continues an interrupted run
(`moaspec data stats` and `train --data` say it is incomplete meanwhile).
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moaspec.atomic_files import write_file_atomically
from moaspec.errors import MoaspecError
from moaspec.train.distill import MANIFEST, ShardWriter, check_resume, found_done, log_progress, read_shards

if TYPE_CHECKING:
    from moaspec.train.sharegpt import Conversation

MODE = "teacher-forced"


@dataclass(frozen=True)
class TeacherForcedConfig:
    """Settings of a `moaspec data sharegpt` run (a rerun must use the same ones)."""

    max_seq_len: int = 768
    num_conversations: int | None = None  # None: every usable conversation
    shard_size: int = 1000
    seed: int = 0
    skip_conversations: int = 0  # usable conversations passed over first (a disjoint next data set)

    def __post_init__(self) -> None:
        if self.max_seq_len < 8:
            raise MoaspecError("--max-seq-len must be >= 8")
        if self.shard_size < 1:
            raise MoaspecError("--shard-size must be >= 1")
        if self.num_conversations is not None and self.num_conversations < 1:
            raise MoaspecError("--num-conversations must be >= 1")
        if self.skip_conversations < 0:
            raise MoaspecError("--skip-conversations must be >= 0")
        if not 0 <= self.seed < 2**63:
            raise MoaspecError("--seed must be in [0, 2**63)")

    def settings(self, target: str) -> dict[str, Any]:
        """What a manifest records and a rerun must repeat; `skip_conversations` only when set,
        so data sets written before the option existed still resume."""
        settings = {"kind": MODE, "target": target, **asdict(self)}
        if not self.skip_conversations:
            del settings["skip_conversations"]
        return settings


def _encode(tokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])


def encode_conversation(
    tokenizer: Any, turns: list[dict[str, str]], max_seq_len: int, eos_id: int | None
) -> tuple[list[int], list[tuple[int, int]]] | None:
    """(input_ids [<= max_seq_len], assistant spans) of a conversation, or None when the chat
    template is not prefix-stable on it or no span of >= 2 tokens fits."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for k, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        prefix = _encode(tokenizer, turns[:k], generation_prompt=True)
        full = _encode(tokenizer, turns[: k + 1], generation_prompt=False)
        if full[: len(prefix)] != prefix or (ids and prefix[: len(ids)] != ids):
            return None
        end = len(full)
        if eos_id is not None and eos_id in full[len(prefix) :]:
            end = full.index(eos_id, len(prefix)) + 1
        ids = full
        start, end = len(prefix), min(end, max_seq_len)
        if end - start >= 2:
            spans.append((start, end))
        if len(ids) >= max_seq_len:
            break
    if not spans:
        return None
    return ids[:max_seq_len], spans


def build_records(
    conversations: list[Conversation], tokenizer: Any, config: TeacherForcedConfig, progress: bool = True
) -> tuple[list[dict], dict]:
    """The records of the first `num_conversations` usable conversations after a seed shuffle,
    passing over the first `skip_conversations` usable ones (so the same seed with `skip = N`
    continues exactly where `num_conversations = N` stopped)."""
    from tqdm import tqdm

    order = list(range(len(conversations)))
    random.Random(config.seed).shuffle(order)
    wanted = config.num_conversations or len(order)
    records, seen, skipped = [], set(), {"not_prefix_stable_or_empty": 0, "duplicate_id": 0}
    bar = tqdm(total=wanted, unit="conv", desc="encode conversations", disable=not progress, file=sys.stderr)
    with bar:  # closed on an interrupt too: "moaspec: interrupted" on a line of its own
        for position in order:
            if len(records) == wanted:
                break
            conversation = conversations[position]
            if conversation.id in seen:
                skipped["duplicate_id"] += 1
                continue
            encoded = encode_conversation(tokenizer, conversation.turns, config.max_seq_len, tokenizer.eos_token_id)
            if encoded is None:
                skipped["not_prefix_stable_or_empty"] += 1
                continue
            seen.add(conversation.id)
            if len(seen) <= config.skip_conversations:
                continue
            ids, spans = encoded
            records.append({"id": conversation.id, "input_ids": ids, "loss_spans": [list(s) for s in spans], "mode": MODE})
            bar.update(1)
    return records, skipped


def summarize_teacher_forced(records: list[dict]) -> dict[str, Any]:
    """Counts and token totals (for the manifest and `moaspec data stats`)."""
    tokens = sum(len(r["input_ids"]) for r in records)
    loss_tokens = sum(end - start for r in records for start, end in r["loss_spans"])
    return {
        "num_records": len(records),
        "num_teacher_forced": len(records),
        "tokens": tokens,
        "assistant_tokens": loss_tokens,
        "assistant_spans": sum(len(r["loss_spans"]) for r in records),
        "mean_tokens": tokens / len(records) if records else 0.0,
    }


def run_teacher_forced(target: str, out_dir: str | Path, config: TeacherForcedConfig, command: str) -> dict[str, Any]:
    """The `moaspec data sharegpt` pipeline: conversations, tokenizer, records, manifest.

    The manifest is written first with `complete: false`, then the shards, then the manifest
    again. The records are a pure function of (data, tokenizer, config), so a rerun of an
    interrupted run rebuilds them, checks the shards on disk are their prefix and writes the
    rest; a rerun of a complete one finds it done."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    settings = config.settings(target)
    previous = check_resume(out_dir, settings, TeacherForcedConfig) if out_dir.is_dir() else None
    if found_done(previous):
        log_progress(f"{out_dir} is complete already: nothing to write")
        return previous
    from moaspec.targets.load import target_tokenizer
    from moaspec.train.sharegpt import load_training_conversations

    name, tokenizer = target_tokenizer(target)
    if not getattr(tokenizer, "chat_template", None):
        raise MoaspecError(f"target {name} has no chat template: teacher-forced conversations need one")
    conversations, data_counts = load_training_conversations(log_progress)
    records, skipped = build_records(conversations, tokenizer, config)
    if not records:
        raise MoaspecError(f"no conversations to write: --skip-conversations {config.skip_conversations} passes over every usable one")
    out_dir.mkdir(parents=True, exist_ok=True)  # only now: a refused target or selection leaves no directory
    existing = read_shards(out_dir)
    if existing and [r["id"] for r in existing] != [r["id"] for r in records[: len(existing)]]:
        raise MoaspecError(f"{out_dir} holds other records than these settings give now; use a new --out directory")
    manifest = {
        "command": command,
        "target": name,
        "settings": settings,
        "counts": {**data_counts, **skipped, "selected": len(records)},
        "complete": False,
        "wall_s_total": previous.get("wall_s_total", 0.0) if previous else 0.0,
    }
    write_file_atomically(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    written = False
    try:
        ShardWriter(out_dir, config.shard_size).add(records[len(existing) :])
        written = True
    finally:  # interrupted too: what the shards hold now, still `complete: false`
        manifest.update(
            complete=written,
            wall_s_total=round(manifest["wall_s_total"] + time.perf_counter() - started, 1),
            totals=summarize_teacher_forced(records if written else read_shards(out_dir)),
        )
        write_file_atomically(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest
