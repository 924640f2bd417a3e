"""A model drafter built in the background while the target decodes plainly (drafters/background.py):
plain steps until it is built, then it joins with the whole verified context; the same greedy
tokens whenever it joins; sampled steps wait for it; what the build raised reaches the caller;
which drafters qualify; the CLI's first token comes before torch is imported."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

from moaspec.config import GenerationConfig, SamplingConfig, TreeConfig
from moaspec.drafters.background import PLAIN_STEPS_FIRST, BackgroundDrafter, can_build_in_background
from moaspec.drafters.base import VerifiedUpdate
from moaspec.errors import MoaspecError
from moaspec.tree import DraftTree

GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=0.7)


class CapturingTarget:
    runtime = "llama.cpp"

    def __init__(self) -> None:
        self.kept: list[int] | None = None

    def keep_layer_kv(self, layers) -> None:
        self.kept = list(layers)


class RecordingDrafter:
    """Records what it is told; proposes the root and one child."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def reset(self) -> None:
        self.calls.append(("reset",))

    def accept(self, update: VerifiedUpdate) -> None:
        self.calls.append(("accept", update.token_ids.tolist(), update.start_pos))

    def propose(self, root_id, sampling, generator) -> DraftTree:
        self.calls.append(("propose", root_id))
        return DraftTree([root_id, 7], [-1, 0])


def gated(drafter, release: threading.Event, threads: list[str] | None = None, error: Exception | None = None):
    def build():
        if threads is not None:
            threads.append(threading.current_thread().name)
        release.wait(30)
        if error is not None:
            raise error
        return drafter

    return build


def update(ids: list[int], start: int) -> VerifiedUpdate:
    return VerifiedUpdate(np.array(ids, dtype=np.int64), start, None, None)


def test_plain_steps_until_built_then_the_drafter_joins_with_the_whole_context() -> None:
    target, built, release, threads = CapturingTarget(), RecordingDrafter(), threading.Event(), []
    drafter = BackgroundDrafter(gated(built, release, threads), target, range(26, 30), TreeConfig(), "checkpoint")
    assert target.kept == [26, 27, 28, 29]  # captured from the prompt on
    drafter.reset()
    drafter.accept(update([1, 2, 3], 0))
    for step in range(PLAIN_STEPS_FIRST):  # the first text goes out before the build starts
        assert drafter.propose(4 + step, GREEDY, None).num_nodes == 1 and not drafter.building
        drafter.accept(update([4 + step], 3 + step))
    assert drafter.propose(9, GREEDY, None).num_nodes == 1 and drafter.building  # started, not built
    drafter.accept(update([9], 3 + PLAIN_STEPS_FIRST))
    assert built.calls == []  # nothing reaches it before it joins
    release.set()
    drafter._thread.join(30)
    assert threads == ["moaspec-drafter-build"]
    tree = drafter.propose(11, GREEDY, None)
    verified = [1, 2, 3, *range(4, 4 + PLAIN_STEPS_FIRST), 9]
    assert built.calls == [("reset",), ("accept", verified, 0), ("propose", 11)]
    assert tree.token_ids.tolist() == [11, 7] and drafter.joined is built
    drafter.accept(update([11, 7], len(verified)))
    drafter.reset()
    assert built.calls[-2:] == [("accept", [11, 7], len(verified)), ("reset",)]


def test_a_sampled_step_waits_for_the_drafter() -> None:
    """A seed's text must not depend on when the build finishes: sampled steps draft with it."""
    built, release = RecordingDrafter(), threading.Event()
    drafter = BackgroundDrafter(gated(built, release), CapturingTarget(), range(2), TreeConfig(), "checkpoint")
    drafter.reset()
    drafter.accept(update([1, 2], 0))
    threading.Timer(0.2, release.set).start()
    assert drafter.propose(3, SAMPLED, None).num_nodes == 2
    assert built.calls == [("reset",), ("accept", [1, 2], 0), ("propose", 3)]


def test_what_the_build_raised_reaches_the_step_that_finds_it() -> None:
    release = threading.Event()
    release.set()
    drafter = BackgroundDrafter(
        gated(None, release, error=MoaspecError("drafter broken")), CapturingTarget(), range(2), TreeConfig(), "checkpoint"
    )
    drafter.reset()
    drafter.accept(update([1], 0))
    with pytest.raises(MoaspecError, match="drafter broken"):
        drafter.propose(2, SAMPLED, None)
    with pytest.raises(ValueError, match="expected 1"):
        drafter.accept(update([5], 3))


def test_the_stats_line_says_how_much_was_decoded_plainly() -> None:
    """`generate`'s stats line: its tau and tokens/s include the plain steps before the drafter joined."""
    from moaspec.cli import _background_note

    target, built, release = CapturingTarget(), RecordingDrafter(), threading.Event()
    drafter = BackgroundDrafter(gated(built, release), target, range(2), TreeConfig(), "checkpoint")
    assert "every step plain" in _background_note(drafter, 3)
    drafter.reset()
    drafter.accept(update([1, 2, 3], 0))  # the prompt; its first new token is the next root
    for step in range(PLAIN_STEPS_FIRST + 1):
        drafter.propose(4 + step, GREEDY, None)
        drafter.accept(update([4 + step], 3 + step))
    release.set()
    drafter._thread.join(30)
    drafter.propose(20, GREEDY, None)  # root: new token PLAIN_STEPS_FIRST + 2; its child the first draft
    assert f"drafted from token {PLAIN_STEPS_FIRST + 3} on" in _background_note(drafter, 3)
    assert _background_note(built, 3) == ""


def test_which_drafters_are_built_in_the_background(monkeypatch) -> None:
    """Shipped MoA checkpoints (no hidden state read) on llama.cpp; not EAGLE-2 (it reads hidden
    states at every step), not a checkpoint directory (checked against the target first), not on
    transformers, not when MOASPEC_NO_BACKGROUND_DRAFTER is set."""
    monkeypatch.delenv("MOASPEC_NO_BACKGROUND_DRAFTER", raising=False)
    for spec in ("moa", "moa+ngram", "moa-tli1", "moa-tli1+ngram"):
        assert can_build_in_background(spec, "smollm2-135m", "llama.cpp"), spec
    from moaspec.drafters import SHIPPED_DIR

    assert not can_build_in_background("eagle", "smollm2-135m", "llama.cpp")
    assert not can_build_in_background(str(SHIPPED_DIR / "smollm2-135m" / "moa"), "smollm2-135m", "llama.cpp")
    assert not can_build_in_background("moa", "smollm2-135m", "transformers")
    assert not can_build_in_background("moa", "another-target", "llama.cpp")
    monkeypatch.setenv("MOASPEC_NO_BACKGROUND_DRAFTER", "1")
    assert not can_build_in_background("moa", "smollm2-135m", "llama.cpp")


@pytest.fixture(scope="module")
def llama_target():
    from moaspec.api import load_target

    return load_target("smollm2-135m", runtime="llama.cpp", threads=2)


@pytest.mark.parametrize("spec", ["moa", "moa-tli1"])
def test_the_shipped_moa_joining_mid_generation_gives_plain_decodings_tokens_and_its_own_state(llama_target, spec: str) -> None:
    """On llama.cpp with a shipped MoA: the drafter is released after 12 plain steps and joins;
    the tokens equal plain decoding's, later steps draft trees, and the joined drafter's memory
    equals that of the same drafter told every verified token as it came (the keys/values it read
    at once were captured, in numpy, while it was being built). The layers captured from its
    record are the ones its context encoder reads (a build asking for others would remake the
    target's context under the decoding thread)."""
    from moaspec.chat import encode_chat_prompt
    from moaspec.drafters import make_drafter
    from moaspec.drafters.background import context_layers_of, shipped_record
    from moaspec.drafters.none import NoDrafter
    from moaspec.engine import Engine, GenerationResult

    target = llama_target
    prompt = encode_chat_prompt(target.tokenizer, "Write the days of the week, then the months of the year.")
    generation = GenerationConfig(max_new_tokens=64)
    plain = Engine(target, NoDrafter()).generate(prompt, GREEDY, generation).token_ids
    release, built = threading.Event(), make_drafter(spec, target, None)
    layers = context_layers_of(shipped_record(spec, target.name))
    assert layers == built.context_encoder.layers
    drafter = BackgroundDrafter(gated(built, release), target, layers, TreeConfig(), "checkpoint")
    result = GenerationResult()
    for step, _ in enumerate(Engine(target, drafter).stream(prompt, GREEDY, generation, result=result)):
        if step == 12:
            release.set()
            drafter._thread.join(60)
    assert result.token_ids == plain
    joined = drafter.joined
    assert joined is not None and result.stats.drafted_nodes > 0
    reference = make_drafter(spec, target, None)
    Engine(target, reference).generate(prompt, GREEDY, generation)
    # the last verification may accept past the limit, differently for the two: their common part
    shared = min(len(joined.history), len(reference.history))
    assert shared > len(prompt) + 12 and joined.history[:shared] == reference.history[:shared]
    assert len(joined.tli_cache) == len(reference.tli_cache) == (1 if spec == "moa-tli1" else 0)
    pairs = [joined.memory_kv, *joined.tli_cache], [reference.memory_kv, *reference.tli_cache]
    for mine, theirs in zip(*pairs):  # the memory's and each TLI layer's (keys, values): [Hkv, n, d]
        for a, b in zip(mine, theirs):
            assert bool(np.allclose(a[:, :shared].numpy(), b[:, :shared].numpy(), atol=1e-5))


_FIRST_TOKEN_PROBE = """
import json, sys
from moaspec import text_stream
from moaspec.cli import main

seen = []
put = text_stream.TokenCollector.put
def recording_put(self, ids):
    seen.append("torch" in sys.modules)
    return put(self, ids)
text_stream.TokenCollector.put = recording_put
code = main(json.loads(sys.argv[1]))
print()
print(json.dumps([code, seen]))
"""


def _generate(drafter: str, env: dict | None = None) -> tuple[dict, list[bool]]:
    """`moaspec generate --drafter DRAFTER --json` in a fresh interpreter -> (its record, whether
    torch was loaded at each streamed put: the prompt, then every step's tokens)."""
    import os

    argv = ["generate", "--prompt", "Write the days of the week.", "--max-new-tokens", "48", "--json", "--drafter", drafter]
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_TOKEN_PROBE, json.dumps(argv)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    code, seen = json.loads(lines[-1])
    assert code == 0
    return json.loads(lines[0]), seen


def test_generate_with_the_shipped_moa_streams_its_first_tokens_before_torch_loads() -> None:
    """`generate --drafter moa` on llama.cpp: the first tokens come from plain steps while torch
    and the drafter load in the background; the text is plain decoding's. Built first
    (MOASPEC_NO_BACKGROUND_DRAFTER=1), torch is there before the first token, which shows the
    probe sees it."""
    plain, _ = _generate("none")
    record, seen = _generate("moa")
    assert record["drafter"] == "moa" and record["token_ids"] == plain["token_ids"]
    # the prompt, the prefill's token, then the plain steps before the build starts
    assert seen[: PLAIN_STEPS_FIRST + 2] == [False] * (PLAIN_STEPS_FIRST + 2)
    record, seen = _generate("moa", {"MOASPEC_NO_BACKGROUND_DRAFTER": "1"})
    assert record["token_ids"] == plain["token_ids"] and seen[0]
