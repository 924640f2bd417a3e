"""argparse types and parser for the measurement scripts under bench/: a bad value is a one-line
usage error (exit status 2) before anything loads, not a traceback after minutes of work."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from moaspec.cli_support import comma_items, known_items
from moaspec.errors import MoaspecError

Parsed = TypeVar("Parsed")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _at_least(text, 1)


def int_at_least(low: int) -> Callable[[str], int]:
    """The argparse type of an integer >= low."""
    return lambda text: _at_least(text, low)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    return _at_least(text, 0)


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 ("128,256")."""
    return _int_list(text, positive_int)


def non_negative_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 0 ("8192,16384,0")."""
    return _int_list(text, non_negative_int)


def _int_list(text: str, parse: Callable[[str], int]) -> list[int]:
    return [parse(part) for part in text_items(text)]


def text_items(text: str) -> list[str]:
    """A list flag's comma-separated items ("ngram,moa"); an empty list or item is argparse's
    usage error."""
    return _usage_error(comma_items, text, "the list")


def category_list(text: str) -> tuple[str, ...]:
    """Benchmark category names, as `moaspec bench --categories` takes them."""
    from moaspec.bench.prompts import parse_categories

    return _usage_error(parse_categories, text)


def known_names(text: str, known: Sequence[str], what: str) -> list[str]:
    """Comma-separated names ("a,b"; duplicates dropped), each one of `known`; `what` names one
    in the error."""
    return _usage_error(known_items, text, "the list", known, what)


def _usage_error(parse: Callable[..., Parsed], *args: Any) -> Parsed:
    """parse(*args), its MoaspecError as argparse's usage error (the same one line)."""
    try:
        return parse(*args)
    except MoaspecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dtype_list(text: str) -> list[str]:
    """Target precisions by name, as `--dtype` takes them ("float32,bfloat16")."""
    from moaspec.targets.options import DTYPES

    return known_names(text, DTYPES, "precision")


def existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no file {text}")
    return path


def read_json(path: Path) -> Any:
    """A JSON document a script reads (a results.json, a curves file): MoaspecError, one line
    through run_script, when it cannot be read or is not JSON."""
    import json

    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise MoaspecError(f"{path} is not a readable JSON file ({str(exc).splitlines()[0]})") from None


def output_file(text: str) -> Path:
    """--out FILE: not a directory, in a folder that exists or can be made (checked before the
    run, so its work is not lost to an unwritable path at the end)."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name the file to write")
    _writable_folder(str(path.parent))  # "." for a bare file name
    return path


def output_directory(text: str) -> Path:
    """--out DIR: a directory that exists or can be made, and can be written."""
    return _writable_folder(text)


def _writable_folder(text: str) -> Path:
    from moaspec.cli_support import output_dir

    try:
        return output_dir(text)
    except MoaspecError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--out ", "")) from None


def _at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


class ScriptParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, `SCRIPT: error: ...` with status 2, as the
    moaspec command's are: no usage dump."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def script_parser(doc: str | None, **kwargs: Any) -> ScriptParser:
    """A bench script's parser, its --help description from its docstring (help_description)."""
    return ScriptParser(description=help_description(doc), **kwargs)


def help_description(doc: str | None) -> str:
    """A script's --help description: its docstring's first paragraph as one line (its first line
    alone stopped mid-sentence)."""
    return " ".join((doc or "").split("\n\n")[0].split())


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """A bench script's entry: main()'s status, or for a library error (a bad target, method or
    drafter found once loading began) one line `SCRIPT: error: ...` and status 2, for Ctrl-C 130,
    instead of a traceback."""
    name = Path(sys.argv[0]).name
    try:
        status = main()
    except MoaspecError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    raise SystemExit(status or 0)
