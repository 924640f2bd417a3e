"""The argparse types of the bench/ scripts: bad values are usage errors before anything loads."""

from __future__ import annotations

import argparse

import pytest

from moaspec.bench.script_args import (
    category_list,
    dtype_list,
    existing_file,
    help_description,
    non_negative_int,
    non_negative_ints,
    output_directory,
    output_file,
    positive_int,
    positive_ints,
    run_script,
    script_parser,
)
from moaspec.errors import MoaspecError


def test_values_are_checked_with_a_usage_message(tmp_path, capsys) -> None:
    assert positive_int("3") == 3 and non_negative_int("0") == 0 and positive_ints("128, 256") == [128, 256]
    assert category_list("math,qa") == ("math", "qa") and existing_file(__file__).is_file()
    assert dtype_list("float32,bfloat16") == ["float32", "bfloat16"]
    for parse, text, says in [
        (positive_int, "0", "must be >= 1, got 0"), (non_negative_int, "-1", "must be >= 0"),
        (positive_ints, "abc", "not an integer"), (positive_ints, "", "the list is empty"),
        (positive_ints, "1,,2", "the list has an empty item: '1,,2'"), (dtype_list, "float32,", "has an empty item"),
        (category_list, "math,,qa", "--categories has an empty item"),
        (category_list, "nosuch", "unknown category nosuch"), (dtype_list, "float8", "unknown precision float8"), (existing_file, str(tmp_path / "no"), "no file"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse(text)
    parser = argparse.ArgumentParser(prog="draft_cost.py")
    parser.add_argument("--rounds", type=positive_int, default=15)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--rounds", "0"])
    assert exit_info.value.code == 2 and "argument --rounds: must be >= 1, got 0" in capsys.readouterr().err


def test_outputs_are_checked_before_the_run(tmp_path) -> None:
    """Bug: --out was first used at the end of a run (its work lost to a traceback: a directory
    named as the JSON file, a folder that could not be made)."""
    assert output_file(str(tmp_path / "new" / "r.json")) == tmp_path / "new" / "r.json"  # its folder can be made
    assert output_directory(str(tmp_path / "out")) == tmp_path / "out"
    assert non_negative_ints("8192, 0") == [8192, 0]
    for parse, text, says in [
        (output_file, str(tmp_path), "is a directory"),
        (output_file, str(tmp_path / "a" / "b" / "r.json"), "does not exist"),
        (output_directory, str(tmp_path / "a" / "b"), "does not exist"),
        (non_negative_ints, "8192,-1", "must be >= 0"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse(text)


def test_library_errors_end_a_script_in_one_line(capsys, monkeypatch) -> None:
    """Bug: a MoaspecError found once loading began (a bad target, method or drafter) was a traceback."""
    monkeypatch.setattr("sys.argv", ["verify_curves.py"])

    def failing() -> int:
        raise MoaspecError("unknown target 'bogus'")

    with pytest.raises(SystemExit) as exit_info:
        run_script(failing)
    assert exit_info.value.code == 2 and capsys.readouterr().err == "verify_curves.py: error: unknown target 'bogus'\n"
    with pytest.raises(SystemExit) as exit_info:
        run_script(lambda: 0)
    assert exit_info.value.code == 0
    doc = "First line of a sentence\nthat goes on.\n\nDetails."
    assert help_description(doc) == "First line of a sentence that goes on."


def test_a_bad_argument_ends_a_script_in_one_line_without_the_usage(capsys, monkeypatch) -> None:
    """Bug (sessions 34-36's notes): the bench scripts printed argparse's usage dump above the
    error, unlike the moaspec command; every script builds its parser with script_parser."""
    from pathlib import Path

    monkeypatch.setattr("sys.argv", ["draft_cost.py", "--rounds", "0"])

    def main() -> int:
        parser = script_parser("Time the drafters.\n\nDetails.")
        parser.add_argument("--rounds", type=positive_int, default=15)
        parser.parse_args()
        return 0

    with pytest.raises(SystemExit) as exit_info:
        run_script(main)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "draft_cost.py: error: argument --rounds: must be >= 1, got 0\n"
    scripts = sorted(Path(__file__).parents[1].joinpath("bench").glob("*.py"))
    assert scripts and all("argparse.ArgumentParser(" not in script.read_text() for script in scripts)


@pytest.mark.parametrize(
    ("script", "argv", "says"),
    [
        ("acceptance_profile", ["--drafters", "moa,nosuch"], "argument --drafters: unknown shipped drafter nosuch (known: "),
        ("draft_vocab_size", ["--drafters", "eagle,,moa"], "argument --drafters: the list has an empty item: 'eagle,,moa'"),
        ("llamacpp_probes", ["--items", "1,7"], "argument --items: unknown item 7 (known: 1, 2, 3, 4, 5, 6)"),
        ("mtbench_top1", ["--drafters", "moa,"], "argument --drafters: the list has an empty item: 'moa,'"),
        ("offline_confidence", ["--drafters", ""], "argument --drafters: the list is empty"),
        ("reduced_precision", ["--methods", "none,,moa"], "argument --methods: the list has an empty item"),
        ("train_throughput", ["--micro-batches", "1,0", "--", "--method", "moa"], "argument --micro-batches: must be >= 1, got 0"),
        ("train_throughput", ["--steps", "1", "--", "--method", "moa"], "argument --steps: must be >= 2, got 1"),
    ],
)
def test_the_scripts_lists_refuse_an_empty_or_unknown_item(script: str, argv: list[str], says: str, monkeypatch, capsys) -> None:
    """Their comma-separated flags were split by hand, each its own way: an empty item went on as a
    drafter named '' (found once the target had loaded, or not at all), and each script worded its
    own refusals. Each is argparse's one-line usage error now, before anything loads, in the words
    of script_args."""
    from conftest import load_bench_script

    monkeypatch.setattr("sys.argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        load_bench_script(script).main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{script}.py: error: ") and says in err and err.count("\n") == 1, err
