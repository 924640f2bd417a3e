"""Self-distillation: the target regenerates the responses to ShareGPT prompts.

A drafter learns best from the target's own distribution, so each selected conversation keeps
only its first user turn (through the chat template, as `SpeculativeLM.encode_prompt` does) and
the target writes the response with `model.generate`.

Invariants:
- The work plan is a pure function of (prompts, config): prompts are sorted by length so a batch
  pads little, cut into batches, and the batch order is shuffled with the seed. A whole batch is
  either greedy or sampled (temperature, per-batch seed), so greedy rows are exactly the target's
  greedy continuation, whatever else is in the batch.
- Resume: every finished batch rewrites the shards atomically (temp file + rename), so a killed
  run loses at most the batch in flight. A restart reads the shards, regenerates only batches
  with unfinished ids (whole, so their output is identical) and appends. The final records equal
  an uninterrupted run's, in the same order.
- Records are {"id", "prompt_ids", "response_ids", "mode", "seed"}: response_ids are new tokens
  only, cut after the first eos (eos kept); seed is null for greedy rows.

torch is imported inside the functions that need it, so the CLI can validate input first.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moaspec.atomic_files import write_file_atomically
from moaspec.chat import encode_chat_prompt
from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SHARD_PATTERN = "shard-{:05d}.jsonl"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class DistillConfig:
    """Settings of a distillation run; a resumed run must use the same ones."""

    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    batch_size: int = 16
    sampled_fraction: float = 0.5
    temperature: float = 0.7
    shard_size: int = 1000
    seed: int = 0
    num_conversations: int | None = None  # None: all
    skip_conversations: int = 0  # usable prompts of the shuffle passed over before the selection

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "shard_size"):
            if getattr(self, name) < 1:
                raise MoaspecError(f"{flag(name)} must be >= 1")
        if self.num_conversations is not None and self.num_conversations < 1:
            raise MoaspecError("--num-conversations must be >= 1")
        if self.skip_conversations < 0:
            raise MoaspecError("--skip-conversations must be >= 0")
        if not 0.0 <= self.sampled_fraction <= 1.0:  # also rejects nan
            raise MoaspecError("--sampled-fraction must be in [0, 1]")
        if not self.temperature > 0.0:
            raise MoaspecError("temperature must be > 0")  # no flag: fixed at 0.7 from the CLI
        if not 0 <= self.seed < 2**63:
            raise MoaspecError("--seed must be in [0, 2**63)")


def flag(setting: str) -> str:
    """The command-line spelling of a setting: num_conversations -> --num-conversations."""
    return "--" + setting.replace("_", "-")


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt_ids: list[int]


@dataclass(frozen=True)
class Batch:
    index: int
    prompts: list[Prompt]
    mode: str  # "greedy" | "sampled"
    seed: int | None


# ---------------------------------------------------------------------------------------------
# Prompts


def select_prompts(
    conversations: Iterable, tokenizer: Any, config: DistillConfig
) -> tuple[list[Prompt], dict[str, int]]:
    """The first `num_conversations` usable first-turn prompts after a `seed` shuffle, once the
    first `skip_conversations` usable ones are passed over.

    Duplicate prompts (same text up to case and whitespace) are kept once; prompts longer than
    `max_prompt_tokens` are skipped and the next ones taken, so exactly N come back when possible.
    With the same seed, skip S then N selects what `num_conversations` S + N adds to S's prompts.
    """
    from moaspec.train.sharegpt import normalize_text

    unique, seen_text, seen_ids = [], set(), set()
    for conversation in conversations:
        key = normalize_text(conversation.first_prompt)
        if key in seen_text:
            continue
        seen_text.add(key)
        conv_id, k = conversation.id, 1
        while conv_id in seen_ids:  # ShareGPT repeats a few ids for different conversations
            k += 1
            conv_id = f"{conversation.id}~{k}"
        seen_ids.add(conv_id)
        unique.append((conv_id, conversation.first_prompt))
    random.Random(config.seed).shuffle(unique)
    wanted = config.num_conversations or len(unique)
    prompts, too_long, passed_over = [], 0, 0
    for conv_id, text in unique:
        if len(prompts) == wanted:
            break
        ids = encode_chat_prompt(tokenizer, text)
        if len(ids) > config.max_prompt_tokens:
            too_long += 1
            continue
        if passed_over < config.skip_conversations:
            passed_over += 1
            continue
        prompts.append(Prompt(conv_id, ids))
    counts = {"unique_prompts": len(unique), "skipped_too_long": too_long, "selected": len(prompts)}
    if config.skip_conversations:
        counts["passed_over"] = passed_over
    return prompts, counts


def plan_batches(prompts: list[Prompt], config: DistillConfig) -> list[Batch]:
    """Length-sorted batches in seed-shuffled order, a `sampled_fraction` of them sampled."""
    ordered = sorted(prompts, key=lambda p: len(p.prompt_ids))  # stable: ties keep selection order
    chunks = [ordered[i : i + config.batch_size] for i in range(0, len(ordered), config.batch_size)]
    rng = random.Random(config.seed)
    sampled = set(rng.sample(range(len(chunks)), round(config.sampled_fraction * len(chunks))))
    seeds = [rng.getrandbits(63) for _ in chunks]
    order = list(range(len(chunks)))
    rng.shuffle(order)
    return [
        Batch(i, chunks[i], "sampled" if i in sampled else "greedy", seeds[i] if i in sampled else None) for i in order
    ]


# ---------------------------------------------------------------------------------------------
# Generation


def cut_response(new_ids: list[int], eos_ids: set[int]) -> list[int]:
    """New tokens up to and including the first eos (all of them if there is none)."""
    for i, token in enumerate(new_ids):
        if token in eos_ids:
            return new_ids[: i + 1]
    return new_ids


def generate_batch(
    model: PreTrainedModel, batch: Batch, config: DistillConfig, pad_id: int, eos_ids: set[int]
) -> list[dict]:
    """One left-padded `model.generate` call for the batch; returns its records in batch order."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p.prompt_ids) for p in batch.prompts)
    input_ids = torch.full((len(batch.prompts), width), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros_like(input_ids)  # [B, T]
    for row, prompt in enumerate(batch.prompts):
        input_ids[row, width - len(prompt.prompt_ids) :] = torch.tensor(prompt.prompt_ids)
        attention_mask[row, width - len(prompt.prompt_ids) :] = 1
    sampled = batch.mode == "sampled"
    # Explicit top_k=0 / top_p=1: sampled rows follow the target's full tempered distribution.
    generation = GenerationConfig(
        max_new_tokens=config.max_new_tokens,
        do_sample=sampled,
        temperature=config.temperature if sampled else None,
        top_k=0 if sampled else None,
        top_p=1.0 if sampled else None,
        pad_token_id=pad_id,
        eos_token_id=sorted(eos_ids),
    )
    # generate() draws from the global generator; fork it so the caller's RNG state is untouched.
    with torch.inference_mode(), torch.random.fork_rng(devices=[]):
        if sampled:
            torch.manual_seed(batch.seed)
        device = model.device
        out = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=generation
        )
    new_rows = out[:, width:].tolist()  # [B, new]
    return [
        {
            "id": prompt.id,
            "prompt_ids": prompt.prompt_ids,
            "response_ids": cut_response(new, eos_ids),
            "mode": batch.mode,
            "seed": batch.seed,
        }
        for prompt, new in zip(batch.prompts, new_rows)
    ]


# ---------------------------------------------------------------------------------------------
# Shards


def shard_files(out_dir: Path) -> list[Path]:
    return sorted(out_dir.glob("shard-*.jsonl"))


def read_shards(
    out_dir: str | Path, fields: dict[str, type] | Callable[[dict], dict[str, type]] | None = None
) -> list[dict]:
    """All records of a data directory, in write order; MoaspecError naming the file and line of
    one that is not UTF-8 JSON, not a JSON object, or lacks one of `fields` (name: type; or a
    function of the first record giving them for every record, as `record_fields`)."""
    records, wanted = [], fields
    for path in shard_files(Path(out_dir)):
        try:
            handle = path.open("rb")  # lines decoded one by one: a decoding error names its line
        except OSError as exc:  # a directory of that name, unreadable
            raise MoaspecError(f"cannot read {path}: {exc.strerror or exc}") from None
        with handle:
            for number, line in enumerate(handle, 1):
                try:
                    record = json.loads(line.decode("utf-8"))
                except UnicodeDecodeError:
                    raise MoaspecError(f"{path}:{number} is not UTF-8 text") from None
                except json.JSONDecodeError as exc:
                    raise MoaspecError(f"{path}:{number} is not valid JSON ({exc.msg})") from exc
                if not isinstance(record, dict):
                    found = type(record).__name__
                    raise MoaspecError(f"{path}:{number} is not a record (a JSON {found}, not an object)")
                if callable(wanted):
                    wanted = wanted(record)  # a directory holds one kind of data: the first record's
                wrong = [name for name, kind in (wanted or {}).items() if not isinstance(record.get(name), kind)]
                if wrong:
                    raise MoaspecError(
                        f"{path}:{number} is not a record of this data ({', '.join(wrong)} missing or mistyped)"
                    )
                records.append(record)
    return records


class ShardWriter:
    """Appends records; full shards are final, the tail shard is rewritten after every batch."""

    def __init__(self, out_dir: Path, shard_size: int) -> None:
        self.out_dir, self.shard_size = out_dir, shard_size
        for stale in out_dir.glob(".shard-*.tmp"):
            stale.unlink()
        existing = read_shards(out_dir, {"id": str})
        self.done_ids = {r["id"] for r in existing}
        self.num_records = len(existing)
        self.pending = existing[len(existing) // shard_size * shard_size :]

    def add(self, records: list[dict]) -> None:
        self.done_ids.update(r["id"] for r in records)
        self.num_records += len(records)
        self.pending.extend(records)
        shard = (self.num_records - len(self.pending)) // self.shard_size
        while len(self.pending) >= self.shard_size:
            self._write(shard, self.pending[: self.shard_size])
            self.pending = self.pending[self.shard_size :]
            shard += 1
        if self.pending:
            self._write(shard, self.pending)

    def _write(self, shard: int, records: list[dict]) -> None:
        text = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        write_file_atomically(self.out_dir / SHARD_PATTERN.format(shard), text)


# ---------------------------------------------------------------------------------------------
# The run


@dataclass
class DistillResult:
    num_records: int
    num_new_records: int
    new_tokens: int
    wall_s: float


def distill(
    model: PreTrainedModel,
    prompts: list[Prompt],
    config: DistillConfig,
    out_dir: str | Path,
    *,
    pad_id: int,
    eos_ids: set[int],
    on_batch: Callable[[int, list[dict]], None] | None = None,
    progress: bool = True,
) -> DistillResult:
    """Generate responses for `prompts` into `out_dir` shards, resuming whatever is already there.

    on_batch(k, records) is called after the k-th batch of this call is written (tests use it
    to interrupt a run).
    """
    from tqdm import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(exist_ok=True)
    writer = ShardWriter(out_dir, config.shard_size)
    wanted = {p.id for p in prompts}
    start, new_tokens, num_new, k = time.perf_counter(), 0, 0, 0
    bar = tqdm(
        total=len(prompts), initial=len(writer.done_ids & wanted), unit="conv", disable=not progress, file=sys.stderr
    )
    try:
        for batch in plan_batches(prompts, config):
            # 1. Skip finished batches; a partly finished one is regenerated whole (same output).
            todo = {p.id for p in batch.prompts} - writer.done_ids
            if not todo:
                continue
            # 2. Generate, 3. write, 4. report.
            records = [r for r in generate_batch(model, batch, config, pad_id, eos_ids) if r["id"] in todo]
            writer.add(records)
            num_new += len(records)
            new_tokens += sum(len(r["response_ids"]) for r in records)
            bar.update(len(records))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
            if on_batch is not None:
                on_batch(k, records)
            k += 1
    finally:
        bar.close()
    return DistillResult(writer.num_records, num_new, new_tokens, time.perf_counter() - start)


def summarize(records: list[dict], eos_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Counts and token totals of a list of records (for the manifest and `moaspec data stats`)."""
    eos = set(eos_ids)
    n = len(records)
    prompt_tokens = sum(len(r["prompt_ids"]) for r in records)
    response_tokens = sum(len(r["response_ids"]) for r in records)
    summary: dict[str, Any] = {
        "num_records": n,
        "num_greedy": sum(r["mode"] == "greedy" for r in records),
        "num_sampled": sum(r["mode"] == "sampled" for r in records),
        "prompt_tokens": prompt_tokens,
        "response_tokens": response_tokens,
        "mean_prompt_tokens": prompt_tokens / n if n else 0.0,
        "mean_response_tokens": response_tokens / n if n else 0.0,
    }
    if eos:
        ended = sum(bool(r["response_ids"]) and r["response_ids"][-1] in eos for r in records)
        summary["fraction_ended_with_eos"] = ended / n if n else 0.0
    return summary


def check_data_target(data_dirs: Iterable[Path], target_name: str) -> None:
    """Refuse data made by another target (its token ids, and for distilled data its answers,
    are that target's): MoaspecError naming both."""
    for directory in data_dirs:
        made_by = read_manifest(directory).get("target")
        if made_by is not None and made_by != target_name:
            raise MoaspecError(f"{directory} was made by target '{made_by}', not '{target_name}' (--target)")


# What a manifest's entries must be (those it has), what each kind's records hold (checked before
# a resume loads the target) and what each command reports from a complete manifest's totals.
_MANIFEST_TYPES = {
    "settings": (dict, "a JSON object"), "counts": (dict, "a JSON object"), "totals": (dict, "a JSON object"),
    "complete": (bool, "true or false"), "wall_s_total": ((int, float), "a number"), "target": (str, "a string"),
    "command": (str, "a string"), "eos_ids": (list, "a list of token ids"),
}
DISTILL_FIELDS = {"id": str, "prompt_ids": list, "response_ids": list, "mode": str}
TEACHER_FORCED_FIELDS = {"id": str, "input_ids": list, "loss_spans": list}
_KINDS = {  # settings["kind"] -> (command, record fields, totals reported)
    None: ("data distill", DISTILL_FIELDS, ("num_records", "response_tokens")),
    "teacher-forced": ("data sharegpt", TEACHER_FORCED_FIELDS, ("num_records", "tokens", "assistant_tokens")),
}


def record_fields(record: dict) -> dict[str, type]:
    """The fields of the kind of data `record` is: teacher-forced when its mode says so, else distilled."""
    return _KINDS["teacher-forced" if record.get("mode") == "teacher-forced" else None][1]


def read_manifest(directory: Path) -> dict:
    """A data directory's manifest.json ({} without one); MoaspecError naming it when unreadable
    or when an entry the commands read has the wrong type."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise MoaspecError(f"{path} is not readable JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise MoaspecError(f"{path} is not a data manifest (not a JSON object)")
    for key, (kind, what) in _MANIFEST_TYPES.items():
        if key not in manifest:
            continue
        value = manifest[key]
        right = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))  # true is no number
        if key == "eos_ids" and right:
            right = all(type(token) is int for token in value)
        if not right:
            raise MoaspecError(f"{path} is not a data manifest ({key} is {json.dumps(value)[:40]}, not {what})")
    return manifest


def _made_by(settings: dict[str, Any]) -> str:
    kind = settings.get("kind")
    if (kind is None or isinstance(kind, str)) and kind in _KINDS:
        return f"`moaspec {_KINDS[kind][0]}` data"
    return f"data of kind {json.dumps(kind)}"


def found_done(manifest: dict[str, Any] | None) -> bool:
    """Whether a data directory's manifest says its run finished: complete, with its totals."""
    return bool(manifest) and bool(manifest.get("complete")) and bool(manifest.get("totals"))


def check_resume(out_dir: Path, settings: dict[str, Any], config_type: type | None = None) -> dict[str, Any] | None:
    """The previous manifest, after checking it was written by the same command with the same
    settings (a setting of `config_type`, a dataclass, that the manifest lacks was added since, at
    its default), that its records are whole and, if it says complete, that it has its totals."""
    path = out_dir / MANIFEST
    if not path.is_file():
        if shard_files(out_dir):
            raise MoaspecError(f"{out_dir} holds shards but no {MANIFEST}; use an empty --out directory")
        others = sorted(entry.name for entry in out_dir.iterdir() if not entry.name.startswith("."))
        if others:  # hidden ones aside: a killed writer's temporaries (atomic_files.py)
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise MoaspecError(f"{out_dir} holds other files ({shown}), not moaspec data; use a new or empty --out directory")
        return None
    try:
        previous = read_manifest(out_dir)
    except MoaspecError as exc:
        raise MoaspecError(f"{exc}; use a new --out directory") from exc
    written_settings = previous.get("settings", {})
    if _made_by(written_settings) != _made_by(settings):
        raise MoaspecError(
            f"{out_dir} holds {_made_by(written_settings)}, not {_made_by(settings)}; use a new --out directory"
        )
    defaults = {f.name: f.default for f in fields(config_type or DistillConfig)}  # fields added since the run began
    written = {**{key: defaults[key] for key in settings if key in defaults}, **written_settings}
    if written != settings:
        changed = sorted(k for k in written.keys() | settings.keys() if written.get(k) != settings.get(k))
        raise MoaspecError(
            f"{out_dir} was written with different settings ({', '.join(flag(k) for k in changed)}); "
            "rerun with the same options to resume, or use a new --out directory"
        )
    _, kind_fields, reported = _KINDS[settings.get("kind")]
    missing = [key for key in reported if key not in previous.get("totals", {})]
    if found_done(previous):  # its shards are not read again
        if missing:
            raise MoaspecError(
                f"{path} says complete but its totals lack {', '.join(missing)}: delete its \"totals\" to have "
                "the same command count them again, or use a new --out directory"
            )
        return previous
    read_shards(out_dir, kind_fields)  # a damaged record is refused now, not after the target loads
    return previous


def run_distill(
    target: str, out_dir: str | Path, config: DistillConfig, command: str, device: str = "cpu"
) -> dict[str, Any]:
    """The `moaspec data distill` pipeline: data, target, prompts, generation (on `device`), manifest."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    settings = {"target": target, **asdict(config)}
    previous = check_resume(out_dir, settings) if out_dir.is_dir() else None  # before torch loads: fails fast
    if found_done(previous):
        log_progress(f"{out_dir} is complete already: nothing to distil")
        return previous  # no model loaded, nothing counted in the manifest's time

    from moaspec.api import load_target
    from moaspec.targets.load import target_tokenizer
    from moaspec.train.sharegpt import load_training_conversations

    conversations, data_counts = load_training_conversations(log_progress)
    # The prompts are chosen by the target's tokenizer alone (the one load_target reads), so a
    # selection of none is refused before the model loads.
    _, tokenizer = target_tokenizer(target)
    prompts, prompt_counts = select_prompts(conversations, tokenizer, config)
    if not prompts:
        raise no_prompts_error(conversations, tokenizer, config, prompt_counts)
    # sdpa, not the library's eager default: at batch 16 a decode step is ~20 % faster with sdpa
    # on 2 cores (eager only wins at batch 1).
    loaded = load_target(target, attn_implementation="sdpa", runtime="transformers")
    model = loaded.model.to(device)
    out_dir.mkdir(exist_ok=True)  # only now: a refused target or selection leaves no directory
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = {tokenizer.eos_token_id} | _as_set(model.generation_config.eos_token_id)
    eos_ids.discard(None)
    log_progress(f"distilling {len(prompts)} prompts with {loaded.name} into {out_dir}")
    manifest: dict[str, Any] = {
        "command": command,
        "target": loaded.name,
        "device": device,
        "settings": settings,
        "pad_id": pad_id,
        "eos_ids": sorted(eos_ids),
        "counts": {**data_counts, **prompt_counts},
        "complete": False,
        "wall_s_total": previous.get("wall_s_total", 0.0) if previous else 0.0,
    }
    write_file_atomically(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    result = None
    try:
        result = distill(model, prompts, config, out_dir, pad_id=pad_id, eos_ids=eos_ids)
    finally:
        wall = time.perf_counter() - start  # loading included; generation alone is result.wall_s
        records = read_shards(out_dir)
        manifest.update(
            complete=result is not None and len(records) == len(prompts),
            wall_s_last_run=wall,
            wall_s_total=manifest["wall_s_total"] + wall,
            generation_s_last_run=result.wall_s if result else None,
            new_tokens_per_s_last_run=(result.new_tokens / result.wall_s) if result and result.wall_s else None,
            totals=summarize(records, eos_ids),
        )
        write_file_atomically(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def no_prompts_error(
    conversations: list, tokenizer: Any, config: DistillConfig, counts: dict[str, int]
) -> MoaspecError:
    """Why `select_prompts` (which gave `counts`) selected nothing: no prompt fits
    --max-prompt-tokens (the shortest's length said), or --skip-conversations passes over all that do."""
    fitting = counts["unique_prompts"] - counts["skipped_too_long"]
    if counts["unique_prompts"] and not fitting:
        shortest = min(len(encode_chat_prompt(tokenizer, c.first_prompt)) for c in conversations)
        return MoaspecError(
            f"no prompts to distil: none of the {counts['unique_prompts']} distinct prompts fits --max-prompt-tokens "
            f"{config.max_prompt_tokens} (the shortest has {shortest} tokens)"
        )
    return MoaspecError(
        f"no prompts to distil: --skip-conversations {config.skip_conversations} passes over all {fitting} "
        f"distinct prompts within --max-prompt-tokens {config.max_prompt_tokens}"
    )


def log_progress(message: str) -> None:
    print(f"moaspec: {message}", file=sys.stderr, flush=True)


def _as_set(value) -> set:
    if value is None:
        return set()
    return set(value) if isinstance(value, (list, tuple, set)) else {value}
