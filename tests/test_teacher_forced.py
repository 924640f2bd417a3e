"""Teacher-forced conversations: assistant spans from the chat template, cut and skipped exactly."""

from __future__ import annotations

import json

import pytest

from moaspec.errors import MoaspecError
from moaspec.train.sharegpt import Conversation
from moaspec.train.teacher_forced import TeacherForcedConfig, build_records, encode_conversation

ROLE = {"user": 1, "assistant": 2}
END, NEWLINE, START = 3, 4, 5


class ChatMLTokenizer:
    """ChatML over characters: <start> role content <end> \\n; the generation prompt is <start> assistant."""

    eos_token_id = END
    chat_template = "chatml"

    def __init__(self, rewrites_history: bool = False) -> None:
        self.rewrites_history = rewrites_history

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        ids = []
        for number, message in enumerate(messages):
            content = message["content"]
            if self.rewrites_history and number < len(messages) - 1:
                content = content[:1]  # a template that shortens earlier turns: not prefix-stable
            ids += [START, ROLE[message["role"]], *(ord(c) for c in content), END, NEWLINE]
        if add_generation_prompt:
            ids += [START, ROLE["assistant"]]
        return {"input_ids": ids}


def turns(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": text} for i, text in enumerate(texts)]


def test_spans_cover_each_assistant_turn_up_to_its_end_token() -> None:
    ids, spans = encode_conversation(ChatMLTokenizer(), turns("hi", "hello", "why", "because"), 100, END)
    assert spans == [(8, 14), (24, 32)]
    assert ids[8:14] == [ord(c) for c in "hello"] + [END]  # the newline after <end> is not learned
    assert ids[6:8] == [START, ROLE["assistant"]] and ids[24:32] == [ord(c) for c in "because"] + [END]


def test_cut_conversations_keep_the_spans_inside_and_drop_short_ones() -> None:
    tokenizer = ChatMLTokenizer()
    ids, spans = encode_conversation(tokenizer, turns("hi", "hello", "why", "because"), 26, END)
    assert len(ids) == 26 and spans == [(8, 14), (24, 26)]
    ids, spans = encode_conversation(tokenizer, turns("hi", "hello", "why", "because"), 25, END)
    assert spans == [(8, 14)]  # one token of the second answer fits: nothing to learn from it
    assert encode_conversation(tokenizer, turns("hi", "hello"), 9, END) is None


def test_templates_that_rewrite_earlier_turns_are_skipped_and_counted() -> None:
    assert encode_conversation(ChatMLTokenizer(rewrites_history=True), turns("hi", "hello", "why", "x"), 100, END) is None
    conversations = [Conversation(str(i), turns("hi", "hello", "why", "because")) for i in range(5)]
    records, skipped = build_records(conversations, ChatMLTokenizer(), TeacherForcedConfig(num_conversations=3), False)
    assert len(records) == 3 and skipped["not_prefix_stable_or_empty"] == 0
    assert all(r["mode"] == "teacher-forced" and r["loss_spans"] == [[8, 14], [24, 32]] for r in records)
    records, skipped = build_records(conversations, ChatMLTokenizer(True), TeacherForcedConfig(), False)
    assert records == [] and skipped["not_prefix_stable_or_empty"] == 5


def test_skip_continues_exactly_where_a_smaller_data_set_stopped() -> None:
    conversations = [Conversation(str(i), turns("hi", f"hello {i}", "why", "because")) for i in range(9)]
    conversations.insert(4, Conversation("3", turns("hi", "a duplicate id", "why", "x")))
    tokenizer = ChatMLTokenizer()
    every, _ = build_records(conversations, tokenizer, TeacherForcedConfig(), False)
    first, _ = build_records(conversations, tokenizer, TeacherForcedConfig(num_conversations=4), False)
    rest, skipped = build_records(conversations, tokenizer, TeacherForcedConfig(skip_conversations=4), False)
    assert [r["id"] for r in first + rest] == [r["id"] for r in every] and len(every) == 9
    assert skipped["duplicate_id"] == 1
    assert TeacherForcedConfig(skip_conversations=4).settings("t")["skip_conversations"] == 4
    assert "skip_conversations" not in TeacherForcedConfig().settings("t")  # older manifests still resume
    with pytest.raises(MoaspecError, match="skip-conversations"):
        TeacherForcedConfig(skip_conversations=-1)


def test_a_small_data_set_is_found_done_on_rerun_and_fine_tunes_a_shipped_drafter(tmp_path, capsys) -> None:
    """`moaspec data sharegpt` run twice with the same settings finds its work done (it used to
    refuse, naming no changed setting), and `train --init-from moa` on so few conversations keeps
    the checkpoint's draft vocabulary (it used to size the new one by the data's tokens first,
    then refuse the checkpoint for not fitting it)."""
    from moaspec.cli import main

    data = tmp_path / "tf"
    make = ["data", "sharegpt", "--out", str(data), "--num-conversations", "6", "--max-seq-len", "128"]
    assert main(make) == 0
    shards = {path.name: path.read_bytes() for path in data.glob("shard-*.jsonl")}
    assert main(make) == 0, capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in data.glob("shard-*.jsonl")} == shards
    run = tmp_path / "run"
    train = ["train", "--method", "moa", "--memory-layers", "4", "--anchor-every", "2", "6", "--data", str(data),
             "--steps", "1", "--batch-size", "1", "--val-conversations", "1", "--max-seq-len", "128",
             "--init-from", "moa", "--out", str(run)]
    assert main(train) == 0, capsys.readouterr().err
    record = json.loads((run / "checkpoint" / "config.json").read_text())
    assert record["config"]["draft_vocab_size"] == 8192 and record["training"]["init_from"]["path"]


def test_a_selection_left_empty_is_an_error_and_leaves_no_directory(tmp_path, capsys, monkeypatch) -> None:
    """Bug: `data sharegpt --skip-conversations` beyond every usable conversation wrote an empty
    data set marked complete and exited 0."""
    import moaspec.train.sharegpt
    from moaspec.cli import main

    few = [Conversation(str(i), turns("hi", f"hello {i}")) for i in range(3)]
    monkeypatch.setattr(moaspec.train.sharegpt, "load_training_conversations", lambda log: (few, {}))
    out = tmp_path / "tf"
    assert main(["data", "sharegpt", "--out", str(out), "--skip-conversations", "10"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("moaspec: error:")]
    assert len(errors) == 1 and "no conversations to write" in errors[0] and not out.exists()


@pytest.mark.parametrize("command", ["sharegpt", "distill"])
def test_a_target_whose_tokenizer_cannot_be_read_is_one_line(tmp_path, capsys, command: str) -> None:
    """Bug (session 50): `data sharegpt` on a target directory whose tokenizer.json is damaged
    ended in a traceback; both data commands now read the tokenizer alone first and say which
    target cannot be loaded, before anything is written."""
    import shutil

    from moaspec.cli import main
    from moaspec.model_store import resolve_target

    _, model_dir = resolve_target("smollm2-135m")
    broken = tmp_path / "broken-target"
    broken.mkdir()
    for name in ("config.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(model_dir / name, broken / name)
    (broken / "tokenizer.json").write_text("{not a tokenizer")
    out = tmp_path / "data"
    assert main(["data", command, "--target", str(broken), "--out", str(out)]) != 0
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("moaspec: error:")]
    assert "Traceback" not in err and len(errors) == 1 and f"cannot read the tokenizer of target {broken}" in errors[0], err
    assert not out.exists()
