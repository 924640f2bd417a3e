"""The argparse types of the bench/ scripts: bad values are usage errors before anything loads."""

from __future__ import annotations

import argparse

import pytest

from moaspec.bench.script_args import (
    category_list, dtype_list, existing_file, non_negative_int, positive_int, positive_ints,
)


def test_values_are_checked_with_a_usage_message(tmp_path, capsys) -> None:
    assert positive_int("3") == 3 and non_negative_int("0") == 0 and positive_ints("128, 256") == [128, 256]
    assert category_list("math,qa") == ("math", "qa") and existing_file(__file__).is_file()
    assert dtype_list("float32,bfloat16") == ["float32", "bfloat16"]
    for parse, text, says in [
        (positive_int, "0", "must be >= 1, got 0"), (non_negative_int, "-1", "must be >= 0"),
        (positive_ints, "abc", "not an integer"), (positive_ints, ",", "an empty list"),
        (category_list, "nosuch", "unknown category nosuch"), (dtype_list, "float8", "unknown precision float8"), (existing_file, str(tmp_path / "no"), "no file"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            parse(text)
    parser = argparse.ArgumentParser(prog="draft_cost.py")
    parser.add_argument("--rounds", type=positive_int, default=15)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--rounds", "0"])
    assert exit_info.value.code == 2 and "argument --rounds: must be >= 1, got 0" in capsys.readouterr().err
