"""The benchmark protocol: every method on the same prompts, interleaved prompt by prompt.

1. Warm-up: each method generates once (the first prompt, at most WARMUP_TOKENS tokens); not recorded.
2. For prompt i (all categories in order, then prompts in order), the methods run in the order of
   the method list rotated by i, so no method always runs first (CPU frequency and cache effects
   spread evenly). Every method of prompt i gets the same seed, `seed + i`.
3. Multi-turn items (MT-bench): turn t + 1 is asked after the *baseline's* (`none`) answer to
   turn t, for every method. So the prompts are identical across methods whatever the
   temperature; in greedy runs every lossless method's answer equals the baseline's anyway.
4. Greedy runs compare every method's tokens with the baseline's; a difference is a bug in a
   lossless method: it is printed at once on stderr, listed under `mismatches`, and `moaspec
   bench` exits with status 1 after writing the results. Sampled runs are not compared (only
   the distribution is preserved, not the draws).
5. A prompt longer than the target's context is skipped for every method, with a warning.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moaspec.bench.memory import RssMonitor
from moaspec.chat import encode_chat_messages

if TYPE_CHECKING:
    from moaspec.bench.method_run import Method, MethodRun
    from moaspec.bench.prompts import BenchPrompt
    from moaspec.config import SamplingConfig
    from moaspec.targets.base import Target

BASELINE = "none"
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class RunRecord:
    """One method's generation for one turn of one prompt."""

    category: str
    prompt_id: str
    turn: int  # 1-based
    method: str
    run: MethodRun
    peak_rss: int  # bytes, see memory.py
    rss_growth: int


@dataclass(frozen=True)
class Mismatch:
    category: str
    prompt_id: str
    turn: int
    method: str
    first_divergence: int  # index of the first differing new token
    baseline_tokens: int
    method_tokens: int

    @property
    def identical(self) -> bool:
        return self.first_divergence == self.baseline_tokens == self.method_tokens


@dataclass
class BenchData:
    records: list[RunRecord] = field(default_factory=list)
    mismatches: list[Mismatch] = field(default_factory=list)
    agreement: list[Mismatch] = field(default_factory=list)  # other programs' outputs vs the baseline
    skipped: list[str] = field(default_factory=list)  # "category/prompt_id"


def run_benchmark(
    target: Target,
    methods: list[Method],
    prompts: dict[str, list[BenchPrompt]],
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int,
    progress: bool = True,
) -> BenchData:
    """Run the protocol in the module docstring; `methods` must include the baseline."""
    from tqdm import tqdm

    if BASELINE not in [method.label for method in methods]:
        raise ValueError(f"the methods must include the baseline '{BASELINE}'")
    items = [prompt for category in prompts.values() for prompt in category]
    data = BenchData()
    monitor = RssMonitor()
    total = sum(len(prompt.turns) for prompt in items) * len(methods)
    bar = tqdm(total=total, desc="moaspec bench", unit="gen", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    try:
        if items:
            warm_ids = encode_chat_messages(target.tokenizer, [*items[0].history, _user(items[0].turns[0])])
            for method in methods:
                method.run(warm_ids[: target.max_positions - 1], sampling, min(WARMUP_TOKENS, max_new_tokens), seed)
        for index, prompt in enumerate(items):
            order = methods[index % len(methods) :] + methods[: index % len(methods)]
            _run_prompt(target, order, prompt, sampling, max_new_tokens, seed + index, data, monitor, bar)
    finally:
        bar.close()
        monitor.close()
    return data


def _run_prompt(
    target: Target,
    order: list[Method],
    prompt: BenchPrompt,
    sampling: SamplingConfig,
    max_new_tokens: int,
    seed: int,
    data: BenchData,
    monitor: RssMonitor,
    bar,
) -> None:
    messages = list(prompt.history)
    for turn, text in enumerate(prompt.turns, start=1):
        messages.append(_user(text))
        prompt_ids = encode_chat_messages(target.tokenizer, messages)
        if len(prompt_ids) >= target.max_positions:
            data.skipped.append(f"{prompt.category}/{prompt.prompt_id}")
            _warn(
                bar,
                f"moaspec: warning: skipping {prompt.category}/{prompt.prompt_id}: {len(prompt_ids)} prompt tokens "
                f"do not fit the target's context ({target.max_positions})",
            )
            bar.update(len(order) * (len(prompt.turns) - turn + 1))
            return
        runs: dict[str, MethodRun] = {}
        for method in order:
            monitor.begin()
            run = method.run(prompt_ids, sampling, max_new_tokens, seed)
            peak, growth = monitor.end()
            runs[method.label] = run
            data.records.append(RunRecord(prompt.category, prompt.prompt_id, turn, method.label, run, peak, growth))
            bar.update(1)
        if sampling.greedy:
            external = {method.label for method in order if not getattr(method, "lossless", True)}
            data.agreement.extend(
                m for m in compare_to_baseline(prompt, turn, runs) if m.method in external
            )
            checked = {label: run for label, run in runs.items() if label not in external}
            for mismatch in find_mismatches(prompt, turn, checked):
                data.mismatches.append(mismatch)
                _warn(
                    bar,
                    f"moaspec: MISMATCH (a lossless method changed the greedy output, this is a bug): "
                    f"{mismatch.method} differs from {BASELINE} on {mismatch.category}/{mismatch.prompt_id} "
                    f"turn {turn} at new token {mismatch.first_divergence}",
                )
        answer = target.tokenizer.decode(_until_stop(runs[BASELINE].token_ids, target.stop_ids), skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})


def _until_stop(token_ids: list[int], stop_ids: frozenset[int]) -> list[int]:
    """The answer a chat keeps: up to the first stop token (--ignore-eos writes on past it)."""
    for index, token in enumerate(token_ids):
        if token in stop_ids:
            return token_ids[:index]
    return token_ids


def find_mismatches(prompt: BenchPrompt, turn: int, runs: dict[str, MethodRun]) -> list[Mismatch]:
    """Every method whose greedy tokens differ from the baseline's."""
    return [m for m in compare_to_baseline(prompt, turn, runs) if not m.identical]


def compare_to_baseline(prompt: BenchPrompt, turn: int, runs: dict[str, MethodRun]) -> list[Mismatch]:
    """Every method but the baseline with where its greedy tokens leave the baseline's (equal
    outputs: first_divergence = their length)."""
    expected = runs[BASELINE].token_ids
    return [
        Mismatch(prompt.category, prompt.prompt_id, turn, label, first_divergence(expected, run.token_ids),
                 len(expected), len(run.token_ids))
        for label, run in runs.items()
        if label != BASELINE
    ]


def first_divergence(expected: Sequence, actual: Sequence) -> int:
    """Index of the first differing item; the shorter length when one is a prefix of the other
    (so it is also the number of leading items that agree)."""
    return next((i for i, (a, b) in enumerate(zip(expected, actual)) if a != b), min(len(expected), len(actual)))


def _warn(bar, message: str) -> None:
    """A line on stderr that does not break the progress bar."""
    bar.write(message, file=sys.stderr)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}
