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
from moaspec.drafters.background import PLAIN_STEPS_FIRST, BackgroundDrafter, DrafterReads, can_build_in_background
from moaspec.drafters.base import VerifiedUpdate
from moaspec.errors import MoaspecError
from moaspec.tree import DraftTree

GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(temperature=0.7)


class CapturingTarget:
    runtime = "llama.cpp"

    def __init__(self) -> None:
        self.kept: list[int] | None = None
        self.keeps_hidden = False

    def keep_layer_kv(self, layers) -> None:
        self.kept = list(layers)

    def keep_final_hidden(self) -> None:
        self.keeps_hidden = True

    def verified_hidden(self, start: int, end: int):
        import torch

        return torch.arange(start, end, dtype=torch.float32)[:, None, None]  # [n, 1, 1]: its positions


KV_ONLY = DrafterReads((0, 1), False)


class RecordingDrafter:
    """Records what it is told (and the hidden states' rows, in `hidden`); proposes the root and one child."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.hidden: list[list[float] | None] = []

    def reset(self) -> None:
        self.calls.append(("reset",))

    def accept(self, update: VerifiedUpdate) -> None:
        self.calls.append(("accept", update.token_ids.tolist(), update.start_pos))
        self.hidden.append(None if update.hidden is None else update.hidden.flatten().tolist())

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
    reads = DrafterReads(tuple(range(26, 30)), False)
    drafter = BackgroundDrafter(gated(built, release, threads), target, reads, TreeConfig(), "checkpoint")
    assert target.kept == [26, 27, 28, 29] and not target.keeps_hidden  # captured from the prompt on
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
    assert built.hidden == [None, None]  # it reads no hidden state


def test_a_drafter_that_reads_hidden_states_gets_the_kept_rows_at_the_join_and_after() -> None:
    """EAGLE-2 (the final hidden state, no keys/values): the target keeps the hidden states from
    the prompt on; the join's accept carries those of the whole context, and every later one those
    of its tokens (the generation's session asks for none)."""
    target, built, release = CapturingTarget(), RecordingDrafter(), threading.Event()
    drafter = BackgroundDrafter(gated(built, release), target, DrafterReads((), True), TreeConfig(), "checkpoint")
    assert target.kept is None and target.keeps_hidden  # no key/value capture asked for
    drafter.reset()
    drafter.accept(update([1, 2, 3], 0))
    release.set()
    drafter.propose(4, SAMPLED, None)  # waits, joins
    drafter.accept(update([4, 7], 3))
    assert built.calls == [("reset",), ("accept", [1, 2, 3], 0), ("propose", 4), ("accept", [4, 7], 3)]
    assert built.hidden == [[0.0, 1.0, 2.0], [3.0, 4.0]]


def test_a_sampled_step_waits_for_the_drafter() -> None:
    """A seed's text must not depend on when the build finishes: sampled steps draft with it."""
    built, release = RecordingDrafter(), threading.Event()
    drafter = BackgroundDrafter(gated(built, release), CapturingTarget(), KV_ONLY, TreeConfig(), "checkpoint")
    drafter.reset()
    drafter.accept(update([1, 2], 0))
    threading.Timer(0.2, release.set).start()
    assert drafter.propose(3, SAMPLED, None).num_nodes == 2
    assert built.calls == [("reset",), ("accept", [1, 2], 0), ("propose", 3)]


def test_what_the_build_raised_reaches_the_step_that_finds_it() -> None:
    release = threading.Event()
    release.set()
    drafter = BackgroundDrafter(
        gated(None, release, error=MoaspecError("drafter broken")), CapturingTarget(), KV_ONLY, TreeConfig(), "checkpoint"
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
    drafter = BackgroundDrafter(gated(built, release), target, KV_ONLY, TreeConfig(), "checkpoint")
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


def test_which_drafters_are_built_in_the_background(monkeypatch, tmp_path) -> None:
    """MoA and EAGLE-2 checkpoints on llama.cpp, shipped or a directory (a checkpoint's or a
    training run's) with its weights; not a model-free drafter, not a directory without weights or
    record or with weights that would not load (truncated, a garbled header), not on transformers,
    not when MOASPEC_NO_BACKGROUND_DRAFTER is set."""
    import shutil

    monkeypatch.delenv("MOASPEC_NO_BACKGROUND_DRAFTER", raising=False)
    for spec in ("moa", "moa+ngram", "moa-tli1", "moa-tli1+ngram", "eagle", "eagle+ngram"):
        assert can_build_in_background(spec, "smollm2-135m", "llama.cpp"), spec
    from moaspec.drafters import SHIPPED_DIR

    shipped = SHIPPED_DIR / "smollm2-135m" / "moa"
    run = tmp_path / "run"
    shutil.copytree(shipped, run / "checkpoint")
    for spec in (str(shipped), f"{shipped}+ngram", str(run)):
        assert can_build_in_background(spec, "smollm2-135m", "llama.cpp"), spec
    damaged = tmp_path / "damaged"
    shutil.copytree(shipped, damaged)
    record = json.loads((damaged / "config.json").read_text())
    del record["config"]["num_target_layers"]  # an audit: a KeyError's traceback before the first token
    (damaged / "config.json").write_text(json.dumps(record))
    (run / "checkpoint" / "model.safetensors").unlink()
    truncated, garbled = tmp_path / "truncated", tmp_path / "garbled"
    for copy in (truncated, garbled):
        shutil.copytree(shipped, copy)
    weights = (shipped / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[:-1000])  # would fail mid-answer: built first
    (garbled / "model.safetensors").write_bytes(weights[:20] + b"\xff" * 30 + weights[50:])
    for spec in ("ngram", "none", str(run), str(tmp_path / "nowhere"), str(damaged), str(truncated), str(garbled)):
        assert not can_build_in_background(spec, "smollm2-135m", "llama.cpp"), spec
    assert not can_build_in_background("moa", "smollm2-135m", "transformers")
    assert not can_build_in_background("moa", "another-target", "llama.cpp")
    monkeypatch.setenv("MOASPEC_NO_BACKGROUND_DRAFTER", "1")
    assert not can_build_in_background("moa", "smollm2-135m", "llama.cpp")


def _hidden_by_position(drafter) -> dict[int, np.ndarray]:
    """Wraps `drafter.accept` to record the final hidden state [D] it is given for each position."""
    seen: dict[int, np.ndarray] = {}
    accept = drafter.accept

    def recording(update: VerifiedUpdate) -> None:
        assert update.hidden is not None and update.hidden.shape[0] == len(update.token_ids)
        for offset, row in enumerate(update.hidden[:, 0].numpy()):
            seen[update.start_pos + offset] = row.copy()
        accept(update)

    drafter.accept = recording
    return seen


@pytest.mark.parametrize("spec", ["moa", "moa-tli1", "eagle"])
def test_a_shipped_drafter_joining_mid_generation_gives_plain_decodings_tokens_and_its_own_state(
    llama_target, spec: str, monkeypatch
) -> None:
    """On llama.cpp with a shipped drafter: it is released after 12 plain steps and joins; the
    tokens equal plain decoding's, later steps draft trees, and the joined drafter's state equals
    that of the same drafter told every verified token as it came: MoA's memory (the keys/values it
    read at once were captured, in numpy, while it was being built), EAGLE-2's final hidden state
    of every position (kept, in numpy, unasked). What is kept from its record is what it reads (a
    build asking for other layers would remake the target's context under the decoding thread)."""
    from moaspec.chat import encode_chat_prompt
    from moaspec.drafters import make_drafter
    from moaspec.drafters.background import drafter_record, reads_of
    from moaspec.drafters.none import NoDrafter
    from moaspec.engine import Engine, GenerationResult

    target = llama_target
    monkeypatch.setattr(target, "keeps_hidden", False)  # restored after: the module's target is shared
    prompt = encode_chat_prompt(target.tokenizer, "Write the days of the week, then the months of the year.")
    generation = GenerationConfig(max_new_tokens=64)
    plain = Engine(target, NoDrafter()).generate(prompt, GREEDY, generation).token_ids
    release, built = threading.Event(), make_drafter(spec, target, None)
    reads = reads_of(drafter_record(spec, target.name))
    if spec == "eagle":
        assert reads == DrafterReads((), True) and built.hidden_layers == (target.num_layers,)
        joined_hidden = _hidden_by_position(built)
    else:
        assert reads == DrafterReads(tuple(built.context_encoder.layers), False) and built.hidden_layers == ()
    drafter = BackgroundDrafter(gated(built, release), target, reads, TreeConfig(), "checkpoint")
    result = GenerationResult()
    for step, _ in enumerate(Engine(target, drafter).stream(prompt, GREEDY, generation, result=result)):
        if step == 12:
            release.set()
            drafter._thread.join(60)
    assert result.token_ids == plain
    assert drafter.joined is built and result.stats.drafted_nodes > 0
    reference = make_drafter(spec, target, None)
    if spec == "eagle":
        reference_hidden = _hidden_by_position(reference)
    Engine(target, reference).generate(prompt, GREEDY, generation)
    # the last verification may accept past the limit, differently for the two: their common part
    shared = min(len(built.history), len(reference.history))
    assert shared > len(prompt) + 12 and built.history[:shared] == reference.history[:shared]
    if spec == "eagle":
        assert set(range(shared)) <= set(joined_hidden) & set(reference_hidden)
        for position in range(shared):
            assert np.array_equal(joined_hidden[position], reference_hidden[position]), position
        return
    assert len(built.tli_cache) == len(reference.tli_cache) == (1 if spec == "moa-tli1" else 0)
    pairs = [built.memory_kv, *built.tli_cache], [reference.memory_kv, *reference.tli_cache]
    for mine, theirs in zip(*pairs):  # the memory's and each TLI layer's (keys, values): [Hkv, n, d]
        for a, b in zip(mine, theirs):
            assert bool(np.allclose(a[:, :shared].numpy(), b[:, :shared].numpy(), atol=1e-5))


# Ends as the console script ends a generation (cli.entry: os._exit, no interpreter teardown): a
# build still running in its daemon thread when the interpreter tears down may be unwound inside
# torch's C++ code, which ends in std::terminate (llama.cpp's handler then prints a gdb backtrace
# onto stdout: seen once in CI, on a loaded machine, as the probe's last line).
_FIRST_TOKEN_PROBE = """
import json, os, sys
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
print(json.dumps([code, seen, "torch" in sys.modules]), flush=True)
sys.stderr.flush()
os._exit(0)
"""


def _run_generate(drafter: str, env: dict | None = None) -> tuple[int, list[str], list[bool], bool, str]:
    """`moaspec generate --drafter DRAFTER --json` in a fresh interpreter -> (its exit status, its
    stdout's lines but the probe's, whether torch was loaded at each streamed put (the prompt,
    then every step's tokens), whether at the end, its stderr)."""
    import os

    argv = ["generate", "--prompt", "Write the days of the week.", "--max-new-tokens", "48", "--json", "--drafter", drafter]
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_TOKEN_PROBE, json.dumps(argv)],
        check=False, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    code, seen, torch_at_the_end = json.loads(lines[-1])
    return code, lines[:-1], seen, torch_at_the_end, proc.stderr


def _generate(drafter: str, env: dict | None = None) -> tuple[dict, list[bool]]:
    """As _run_generate, for a generation that succeeds -> (its record, the puts' torch)."""
    code, lines, seen, _, stderr = _run_generate(drafter, env)
    assert code == 0, stderr
    return json.loads(lines[0]), seen


@pytest.mark.parametrize("spec", ["moa", "eagle", "a directory"])
def test_generate_with_a_model_drafter_streams_its_first_tokens_before_torch_loads(spec: str) -> None:
    """`generate --drafter moa` (or `eagle`, or a checkpoint directory) on llama.cpp: the first
    tokens come from plain steps while torch and the drafter load in the background; the text is
    plain decoding's. Built first (MOASPEC_NO_BACKGROUND_DRAFTER=1), torch is there before the
    first token, which shows the probe sees it."""
    from moaspec.drafters import SHIPPED_DIR

    if spec == "a directory":
        spec = str(SHIPPED_DIR / "smollm2-135m" / "moa")
    plain, _ = _generate("none")
    record, seen = _generate(spec)
    assert record["drafter"] == spec and record["token_ids"] == plain["token_ids"]
    # the prompt, the prefill's token, then the plain steps before the build starts
    assert seen[: PLAIN_STEPS_FIRST + 2] == [False] * (PLAIN_STEPS_FIRST + 2)
    if spec == "moa":
        record, seen = _generate(spec, {"MOASPEC_NO_BACKGROUND_DRAFTER": "1"})
        assert record["token_ids"] == plain["token_ids"] and seen[0]


def test_a_directory_made_for_another_target_is_refused_before_the_first_token_without_torch(tmp_path) -> None:
    """A checkpoint directory's check against the target (its fingerprint) reads the target's
    embedding file in numpy on llama.cpp: a drafter made for another target is refused in one line
    before anything is generated, torch never imported."""
    import shutil

    from moaspec.drafters import SHIPPED_DIR

    other = tmp_path / "other"
    shutil.copytree(SHIPPED_DIR / "smollm2-135m" / "moa", other)
    record = json.loads((other / "config.json").read_text())
    record["target"]["fingerprint"] = "0123456789abcdef"
    (other / "config.json").write_text(json.dumps(record))
    code, lines, seen, torch_at_the_end, stderr = _run_generate(str(other))
    assert code == 2 and lines == [] and seen == [] and not torch_at_the_end
    assert stderr.strip().count("\n") == 0 and "was trained for target" in stderr and "0123456789abcdef" in stderr


def test_a_directory_whose_weights_would_not_load_is_refused_before_the_first_token(tmp_path) -> None:
    """A checkpoint directory whose weights file is truncated is built first, so its one-line
    error comes before any text (built in the background, it came mid-answer: session 48's note)."""
    import shutil

    from moaspec.drafters import SHIPPED_DIR

    truncated = tmp_path / "truncated"
    shutil.copytree(SHIPPED_DIR / "smollm2-135m" / "moa", truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    code, lines, seen, _, stderr = _run_generate(str(truncated))
    assert code == 2 and lines == [] and seen == []
    assert stderr.strip().count("\n") == 0 and "the checkpoint is damaged" in stderr


def test_the_fingerprint_read_without_torch_equals_torchs(llama_target) -> None:
    """nn/fingerprint.py: on llama.cpp the embedding's sampled rows come from its file in numpy;
    the same bytes as torch's parts give, so the shipped checkpoints' recorded fingerprints hold."""
    from moaspec.drafters.background import drafter_record
    from moaspec.nn import fingerprint

    stored = fingerprint._stored_sample(llama_target)
    assert stored is not None and stored == fingerprint._torch_sample(llama_target)
    for spec in ("moa", "moa-tli1", "eagle"):
        assert fingerprint.target_fingerprint(llama_target) == drafter_record(spec, llama_target.name)["target"]["fingerprint"]
