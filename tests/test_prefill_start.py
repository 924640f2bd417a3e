"""From which prompt length the llama.cpp runtime prefills in float32 (llamacpp_prefill.py): the
start from the two paths' timings, what a saved record may hold, and the measuring loop on a fake
clock (no model: every prefill costs what a line in the prompt's length says)."""

from __future__ import annotations

import pytest

from moaspec.targets import llamacpp_prefill
from moaspec.targets.llamacpp_prefill import (
    BFLOAT16_MARGIN,
    COMPUTE_TOKENS,
    FLOAT_MARGIN,
    FLOAT_PREFILL_LONG_TOKENS,
    FLOAT_PREFILL_MIN_TOKENS,
    MEASURE_ROUNDS,
    NEVER,
    compute_from_timings,
    measure_float_compute,
    measure_float_prefill_start,
    start_from_timings,
    valid_compute,
    valid_start,
)


def llama_s(tokens: int) -> float:
    return tokens / 1000


def float_s(tokens: int, fixed: float) -> float:
    return fixed + tokens / 2000


def timings(tokens: int, fixed: float) -> tuple[float, float]:
    return llama_s(tokens), float_s(tokens, fixed)


def test_float_paying_at_the_shortest_prompt_starts_there() -> None:
    assert start_from_timings(timings(FLOAT_PREFILL_MIN_TOKENS, 0.0), None) == FLOAT_PREFILL_MIN_TOKENS
    # exactly at the margin pays; a hair over does not
    assert start_from_timings((1.0, FLOAT_MARGIN), None) == FLOAT_PREFILL_MIN_TOKENS
    assert start_from_timings((1.0, FLOAT_MARGIN + 1e-9), None) == NEVER


def test_float_paying_only_for_longer_prompts_starts_where_the_lines_meet_at_the_margin() -> None:
    """llama.cpp 1 ms a token, float 41 ms plus 0.5 ms a token: 0.041 + n/2000 = 0.9 n/1000 at
    n = 102.5, so first turns of 103 tokens or more take the float path."""
    fixed = 0.041
    start = start_from_timings(timings(FLOAT_PREFILL_MIN_TOKENS, fixed), timings(FLOAT_PREFILL_LONG_TOKENS, fixed))
    assert start == 103
    assert float_s(start, fixed) <= FLOAT_MARGIN * llama_s(start)
    assert float_s(start - 1, fixed) > FLOAT_MARGIN * llama_s(start - 1)


def test_float_that_does_not_pay_at_the_long_prompt_either_is_never_taken() -> None:
    fixed = 0.2  # 0.2 + 0.128 > 0.9 * 0.256
    long = timings(FLOAT_PREFILL_LONG_TOKENS, fixed)
    assert start_from_timings(timings(FLOAT_PREFILL_MIN_TOKENS, fixed), long) == NEVER
    assert start_from_timings(timings(FLOAT_PREFILL_MIN_TOKENS, fixed), None) == NEVER


def test_a_start_just_short_of_the_long_prompt_is_capped_there() -> None:
    """Float pays at the long prompt by a hair: the meeting point rounds up to it, never past."""
    long = (1.0, FLOAT_MARGIN - 1e-6)
    assert start_from_timings((0.25, 0.3), long) == FLOAT_PREFILL_LONG_TOKENS


@pytest.mark.parametrize(
    ("value", "valid"),
    [(NEVER, True), (FLOAT_PREFILL_MIN_TOKENS, True), (FLOAT_PREFILL_LONG_TOKENS, True), (100, True),
     (FLOAT_PREFILL_MIN_TOKENS - 1, False), (FLOAT_PREFILL_LONG_TOKENS + 1, False), (True, False),
     ("64", False), (64.0, False), (None, False), (-1, False)],
)
def test_a_saved_start_is_read_only_where_this_module_could_have_answered_it(value, valid) -> None:
    assert valid_start(value) is valid


class FakeTarget:
    """What measure_float_prefill_start uses of a LlamaCppTarget; each prefill advances `clock`
    by its path's line in the prompt's length (the first of each path at the shortest prompt costs
    10 s more, as a cold start would)."""

    vocab_size = 1000
    value_cache_type = 1

    def __init__(self, fixed_float_s: float) -> None:
        self.fixed_float_s = fixed_float_s
        self.clock = 0.0
        self.calls: list[tuple[int, bool]] = []
        self.cells: list[int] = []
        self.freed = 0

    def new_measuring_context(self, cells: int, value_type: int) -> str:
        self.cells.append(cells)
        return "ctx"

    def clear_measuring_context(self, ctx) -> None:
        pass

    def free_measuring_context(self, ctx) -> None:
        self.freed += 1

    def measure_prefill(self, ctx, prompt: list[int], through_float: bool) -> None:
        length = len(prompt)
        first = (length, through_float) not in self.calls
        self.calls.append((length, through_float))
        cost = float_s(length, self.fixed_float_s) if through_float else llama_s(length)
        self.clock += cost + (10.0 if first and length == FLOAT_PREFILL_MIN_TOKENS else 0.0)


@pytest.fixture
def fake_clock(monkeypatch):
    def use(target: FakeTarget) -> None:
        monkeypatch.setattr(llamacpp_prefill.time, "perf_counter", lambda: target.clock)

    return use


def test_measuring_stops_at_the_shortest_prompt_where_float_pays_there(fake_clock) -> None:
    target = FakeTarget(fixed_float_s=0.0)
    fake_clock(target)
    assert measure_float_prefill_start(target) == FLOAT_PREFILL_MIN_TOKENS
    assert {length for length, _ in target.calls} == {FLOAT_PREFILL_MIN_TOKENS}
    assert len(target.calls) == 2 * (MEASURE_ROUNDS + 1)  # both paths, the warm-up round included
    assert target.cells == [2 * FLOAT_PREFILL_LONG_TOKENS] and target.freed == 1


def test_measuring_times_the_long_prompt_where_float_does_not_pay_at_the_shortest(fake_clock) -> None:
    """The long prompt is timed MEASURE_ROUNDS times per path, taking turns, with no warm-up of its
    own; the start comes out of the fake's lines exactly (the short prompt's warm-up not in it)."""
    target = FakeTarget(fixed_float_s=0.041)
    fake_clock(target)
    assert measure_float_prefill_start(target) == 103
    long_calls = [call for call in target.calls if call[0] == FLOAT_PREFILL_LONG_TOKENS]
    assert sorted(long_calls) == [(FLOAT_PREFILL_LONG_TOKENS, False)] * MEASURE_ROUNDS + [
        (FLOAT_PREFILL_LONG_TOKENS, True)] * MEASURE_ROUNDS
    assert [through for _, through in target.calls[: 2]] == [False, True]  # the paths take turns
    assert target.freed == 1


def test_a_context_llama_cpp_cannot_make_means_never(fake_clock) -> None:
    from moaspec.errors import MoaspecError

    class ShortContext(FakeTarget):
        def new_measuring_context(self, cells: int, value_type: int) -> str:
            raise MoaspecError("too short")

    target = ShortContext(fixed_float_s=0.0)
    fake_clock(target)
    assert measure_float_prefill_start(target) == NEVER and target.freed == 0


def test_bfloat16_products_are_taken_only_where_they_save_the_margin() -> None:
    """bfloat16 rounds more than float32: taken where it takes at most BFLOAT16_MARGIN of float32's
    time (exactly at the margin included), else float32; a saved answer is read only if it is one
    of the two."""
    assert compute_from_timings(1.0, BFLOAT16_MARGIN) == "bfloat16"
    assert compute_from_timings(1.0, BFLOAT16_MARGIN + 1e-9) == "float32"
    assert compute_from_timings(1.0, 3.0) == "float32"  # a CPU without native bfloat16 products
    assert valid_compute("bfloat16") and valid_compute("float32")
    assert not valid_compute("float16") and not valid_compute(None) and not valid_compute(1)


class FakeForwards:
    """What measure_float_compute uses of a LlamaCppTarget: each float forward advances `clock` by
    its product type's seconds (the first of each 10 s more, as a cold start would)."""

    vocab_size = 1000

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.clock, self.calls = seconds, 0.0, []

    def measure_float_forward(self, prompt: list[int], compute: str) -> None:
        self.clock += self.seconds[compute] + (10.0 if compute not in [c for _, c in self.calls] else 0.0)
        self.calls.append((len(prompt), compute))


@pytest.mark.parametrize(("bfloat16_s", "chosen"), [(0.6, "bfloat16"), (0.85, "float32"), (2.5, "float32")])
def test_measuring_the_products_times_both_in_turns_after_a_warm_up(monkeypatch, bfloat16_s, chosen) -> None:
    """COMPUTE_TOKENS-token prompts, the two types taking turns (the order rotated each round) over
    MEASURE_ROUNDS counted rounds after an uncounted one, whose cold start (10 s on the fake clock)
    must not decide."""
    target = FakeForwards({"float32": 1.0, "bfloat16": bfloat16_s})
    monkeypatch.setattr(llamacpp_prefill.time, "perf_counter", lambda: target.clock)
    monkeypatch.setattr(llamacpp_prefill, "load_library_held", lambda: None)
    assert measure_float_compute(target) == chosen
    pair = [(COMPUTE_TOKENS, "float32"), (COMPUTE_TOKENS, "bfloat16")]
    assert target.calls == [call for round_ in range(MEASURE_ROUNDS + 1) for call in (pair[::-1] if round_ % 2 else pair)]
