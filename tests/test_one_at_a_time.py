"""One generation at a time per engine / SpeculativeLM / split generator (moaspec/exclusive.py).

Bug: one object from `moaspec.load()` used by two threads gave wrong text silently (transformers
runtime) or aborted inside llama.cpp, and two streams of one engine advanced in turn from one
thread decoded from each other's context. Now generate() calls from threads run one after
another, and a generation superseded by a newer one raises instead of emitting wrong tokens.
"""

from __future__ import annotations

import threading

import pytest
from conftest import make_tiny_target
from openai_helpers import make_drafter, tiny_chat_target
from test_split import PROMPT as SPLIT_PROMPT
from test_split import SplitPair

from moaspec.api import SpeculativeLM
from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.drafters.ngram import NgramDrafter
from moaspec.engine import Engine
from moaspec.exclusive import GenerationSuperseded

PROMPTS = ([5, 17, 33, 2, 71, 5, 17], [9, 40, 2, 2, 61], [3, 14, 15, 92, 65, 35])
NO_STOP: frozenset[int] = frozenset()
LENGTH = GenerationConfig(max_new_tokens=24)


def test_a_stream_superseded_by_another_on_the_same_engine_raises_and_the_newer_is_right() -> None:
    target = make_tiny_target("llama")
    engine = Engine(target, NgramDrafter())
    expected = [engine.generate(prompt, generation=LENGTH, stop_ids=NO_STOP).token_ids for prompt in PROMPTS[:2]]
    first = engine.stream(PROMPTS[0], generation=LENGTH, stop_ids=NO_STOP)
    head = next(first)
    second = engine.stream(PROMPTS[1], generation=LENGTH, stop_ids=NO_STOP)
    assert [t for chunk in second for t in chunk] == expected[1]
    with pytest.raises(GenerationSuperseded, match="one generation at a time"):
        next(first)
    assert head == expected[0][: len(head)]
    assert engine.generate(PROMPTS[0], generation=LENGTH, stop_ids=NO_STOP).token_ids == expected[0]


@pytest.mark.parametrize("method", ["ngram", "moa"])
def test_generate_from_several_threads_equals_the_same_calls_one_after_another(method: str) -> None:
    target = tiny_chat_target()
    lm = SpeculativeLM(target, make_drafter(method, target))
    jobs = [(PROMPTS[i % 3], 0.0 if i % 2 else 0.9, i) for i in range(6)]
    expected = [lm.generate(list(p), max_new_tokens=20, temperature=t, seed=s).token_ids for p, t, s in jobs]
    got: list[list[int] | BaseException | None] = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def run(index: int) -> None:
        prompt, temperature, seed = jobs[index]
        start.wait()
        try:
            got[index] = lm.generate(list(prompt), max_new_tokens=20, temperature=temperature, seed=seed).token_ids
        except BaseException as exc:  # reported by the assertion below
            got[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert got == expected


def test_engine_streams_from_two_threads_are_right_or_superseded_never_wrong() -> None:
    """Without SpeculativeLM's serialisation, threads sharing an engine take it over from each
    other: a generation either completes with its own tokens or raises GenerationSuperseded."""
    target = make_tiny_target("llama")
    engine = Engine(target, NgramDrafter())
    sampling = SamplingConfig(temperature=0.8)
    expected = [engine.generate(prompt, sampling, LENGTH, NO_STOP).token_ids for prompt in PROMPTS[:2]]
    completed = 0
    for _ in range(3):
        got: list[tuple[list[int], bool]] = [([], False), ([], False)]

        def run(index: int) -> None:
            tokens: list[int] = []
            try:
                for chunk in engine.stream(PROMPTS[index], sampling, LENGTH, NO_STOP):
                    tokens += chunk
                got[index] = (tokens, False)
            except GenerationSuperseded:
                got[index] = (tokens, True)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        for index, (tokens, superseded) in enumerate(got):
            if superseded:
                assert tokens == expected[index][: len(tokens)]
            else:
                assert tokens == expected[index]
                completed += 1
    assert completed > 0


def test_a_split_stream_superseded_by_another_raises() -> None:
    made = SplitPair("moa")
    try:
        generator = made.generator()
        greedy, generation = SamplingConfig(), GenerationConfig(max_new_tokens=12)
        expected = made.reference(greedy, generation)
        first = generator.stream(SPLIT_PROMPT, greedy, generation)
        next(first)
        result = generator.generate(SPLIT_PROMPT, greedy, generation)
        assert result.token_ids == expected
        with pytest.raises(GenerationSuperseded, match="split generator") as superseded:
            next(first)
        # its session was closed when it raised, not left for whenever the exception (whose
        # traceback holds the generation's frame) is dropped
        assert made.server.server.sessions == {} and superseded.value
    finally:
        made.server.stop()


def test_a_generation_started_inside_another_ones_step_supersedes_it_at_once() -> None:
    """The lock is re-entrant: a generation started on the same thread from inside another's step
    (a drafter or callback calling the engine) takes the engine over, and the outer one raises
    right after that step instead of emitting tokens computed from the other's context."""
    target = make_tiny_target("llama")
    engine = Engine(target, NgramDrafter())
    expected = [engine.generate(prompt, generation=LENGTH, stop_ids=NO_STOP).token_ids for prompt in PROMPTS[:2]]
    propose, nested = engine.drafter.propose, []

    def propose_after_another_generation(*args, **kwargs):
        if not nested:  # once: the nested generation's own steps call this too
            nested.append(None)
            nested[0] = engine.generate(PROMPTS[1], generation=LENGTH, stop_ids=NO_STOP).token_ids
        return propose(*args, **kwargs)

    engine.drafter.propose = propose_after_another_generation
    got: list[int] = []
    with pytest.raises(GenerationSuperseded, match="during this one's step"):
        for chunk in engine.stream(PROMPTS[0], generation=LENGTH, stop_ids=NO_STOP):
            got += chunk
    assert nested == [expected[1]] and got == expected[0][: len(got)]
    engine.drafter.propose = propose
    assert engine.generate(PROMPTS[0], generation=LENGTH, stop_ids=NO_STOP).token_ids == expected[0]
