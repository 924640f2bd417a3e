"""bench/openai_load.py's argument checks: bad input is named before any output."""

from __future__ import annotations

import pytest
from conftest import load_bench_script


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--drafters", "ngram,no-such-drafter"], "no-such-drafter"),
        (["--clients", "1,two"], "argument --clients: not an integer: 'two'"),
        (["--clients", "0"], "argument --clients: must be >= 1, got 0"),
        (["--clients", "1,,2"], "argument --clients: the list has an empty item: '1,,2'"),
        (["--drafters", "ngram,"], "argument --drafters: the list has an empty item: 'ngram,'"),
        (["--requests", "0"], "argument --requests: must be >= 1, got 0"),
    ],
)
def test_bad_input_is_refused_before_the_table(argv: list[str], message: str, capsys) -> None:
    script = load_bench_script("openai_load")
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and "| drafter |" not in captured.err and captured.out == ""
