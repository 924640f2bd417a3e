"""The CLI's error contract: bad input -> one line `moaspec: error: ...` on stderr, exit 2.

No model loads here: every error must be caught before torch is even imported (checked in a
fresh interpreter, since this test process already imports torch through conftest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from moaspec.cli import EXIT_USAGE, main
from moaspec.cli_support import output_dir
from moaspec.errors import MoaspecError

PREFIX = "moaspec: error: "

# name -> (argv builder given a scratch directory, substring expected in the message)
Case = tuple[Callable[[Path], list[str]], str]


def _gen(*extra: str) -> list[str]:
    return ["generate", "--prompt", "hi", *extra]


def _gen_prompt(prompt: str) -> list[str]:
    return ["generate", "--prompt", prompt]


def _plain_file(tmp: Path) -> list[str]:
    notes = tmp / "notes.txt"
    notes.write_text("hello")
    return _gen("--target", str(notes))


def _not_gguf(tmp: Path) -> list[str]:
    fake = tmp / "fake.gguf"
    fake.write_bytes(b"\x00not a gguf file" * 8)
    return _gen("--target", str(fake))


BAD_INPUTS: dict[str, Case] = {
    "unknown target name": (lambda tmp: _gen("--target", "no-such-model"), "unknown target 'no-such-model'"),
    "missing path": (lambda tmp: _gen("--target", str(tmp / "missing" / "model")), "unknown target"),
    "dir without config.json": (lambda tmp: _gen("--target", str(tmp)), "has no config.json"),
    # bug: the runtime flags were checked first, against the default runtime of a name it did not know
    "unknown target with --threads": (lambda tmp: _gen("--target", "no-such-model", "--threads", "1"), "unknown target"),
    "dir without config.json with --threads": (lambda tmp: _gen("--target", str(tmp), "--threads", "1"),
                                                "has no config.json"),
    "file that is not a model": (_plain_file, "neither a model directory nor a .gguf file"),
    ".gguf without GGUF magic": (_not_gguf, "not a GGUF file"),
    "empty prompt": (lambda tmp: ["generate", "--prompt", ""], "the prompt is empty"),
    "whitespace prompt": (lambda tmp: ["generate", "--prompt", " \n\t  "], "the prompt is empty"),
    "negative temperature": (lambda tmp: _gen("--temperature", "-0.5"), "temperature must be >= 0"),
    "nan temperature": (lambda tmp: _gen("--temperature", "nan"), "temperature must be >= 0"),
    "top-p 0": (lambda tmp: _gen("--top-p", "0"), "top-p must be in (0, 1]"),
    "top-p 1.5": (lambda tmp: _gen("--top-p", "1.5"), "top-p must be in (0, 1]"),
    "negative top-k": (lambda tmp: _gen("--top-k", "-1"), "top-k must be >= 0"),
    "max-new-tokens 0": (lambda tmp: _gen("--max-new-tokens", "0"), "max-new-tokens must be >= 1"),
    "seed beyond 64 bits": (lambda tmp: _gen("--seed", str(2**64)), "seed must fit in 64 bits"),
    "unknown drafter": (lambda tmp: _gen("--drafter", "no-such-drafter"), "unknown drafter 'no-such-drafter'"),
    "lookup on an unknown drafter": (lambda tmp: _gen("--drafter", "nope+ngram"), "unknown drafter 'nope+ngram'"),
    "lookup on a model-free drafter": (lambda tmp: _gen("--drafter", "none+ngram"), "adds prompt lookup to a model drafter"),
    "missing --prompt": (lambda tmp: ["generate"], "--prompt"),
    "prompt that is not UTF-8": (lambda tmp: _gen_prompt("\udcff"), "the prompt is not valid UTF-8 text"),
    "infinite temperature": (lambda tmp: _gen("--temperature", "inf"), "temperature must be >= 0 and finite"),
    "tree depth 1000": (lambda tmp: _gen("--drafter", "moa", "--tree-depth", "1000"), "--tree-depth must be in [1, 32]"),
    "empty drafter": (lambda tmp: _gen("--drafter", ""), "--drafter is empty"),
    "empty target": (lambda tmp: _gen("--target", ""), "--target is empty"),
    "split flag without --server": (lambda tmp: _gen("--timeout", "-1"), "--timeout applies to generate --server"),
    "adaptive without --server": (lambda tmp: _gen("--adaptive"), "--adaptive applies to generate --server"),
    "non-integer flag value": (lambda tmp: _gen("--max-new-tokens", "ten"), "invalid int value: 'ten'"),
    "non-float flag value": (lambda tmp: _gen("--temperature", "warm"), "invalid float value: 'warm'"),
    "unknown flag": (lambda tmp: _gen("--beam-width", "4"), "unrecognized arguments"),
    "no subcommand": (lambda tmp: [], "command"),
    # bug: bench imported torch for its cheap checks (an early Ctrl-C was swallowed), and bench,
    # tune, generate and serve converted the target (~30 s) before refusing a flag
    "bench: unknown method": (lambda tmp: ["bench", "--out", str(tmp / "b"), "--methods", "bogus"], "unknown drafter 'bogus'"),
    "bench: limit 0": (lambda tmp: ["bench", "--out", str(tmp / "b"), "--limit", "0"], "--limit must be >= 1"),
    "tune: a model-free drafter": (lambda tmp: ["tune", "--drafters", "none"], "'none' has no draft tree to tune"),
    "tree flags on a model-free drafter": (lambda tmp: _gen("--drafter", "none", "--tree-depth", "2"),
                                           "--tree-* settings apply to model drafters only"),
    "unknown subcommand": (lambda tmp: ["no-such-command"], "invalid choice"),
    # an audit's: the default target was converted (~30 s on first use) before the data was refused
    "train on another target's data": (lambda tmp: _data_of_another_target(tmp), "was made by target 'qwen.gguf', not 'smollm2-135m'"),
    # an audit's: the refusal named 'ngram', which the user never gave (the default for a target without a shipped MoA)
    "tree flags where the target has no shipped model drafter": (
        lambda tmp: _gen("--target", str(_gguf_header_only(tmp)), "--tree-depth", "2"),
        "target 'other.gguf' has no shipped one: name a checkpoint with --drafter DIR"),
}


def _data_of_another_target(tmp: Path) -> list[str]:
    data = tmp / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text('{"prompt_ids": [1], "response_ids": [2]}\n')
    (data / "manifest.json").write_text('{"target": "qwen.gguf"}')
    return ["train", "--method", "eagle", "--data", str(data), "--out", str(tmp / "run"), "--steps", "4"]


def _gguf_header_only(tmp: Path) -> Path:
    other = tmp / "other.gguf"
    other.write_bytes(b"GGUF" + b"\x00" * 60)
    return other


def _subprocess_env(tmp: Path) -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", MOASPEC_CACHE=str(tmp / "cache"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here may touch the user's model cache."""
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_in_process(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    build, expected = BAD_INPUTS[name]
    rc = main(build(tmp_path))
    captured = capsys.readouterr()
    assert rc == EXIT_USAGE
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(PREFIX)
    assert expected in lines[0]
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_as_a_process(name: str, tmp_path: Path) -> None:
    """The real entry point (`python -m moaspec`): exit status 2, one stderr line, no traceback, empty stdout."""
    build, expected = BAD_INPUTS[name]
    proc = subprocess.run(
        [sys.executable, "-m", "moaspec", *build(tmp_path)],
        capture_output=True,
        text=True,
        env=_subprocess_env(tmp_path),
        timeout=120,
    )
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.endswith("\n")
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(PREFIX)
    assert expected in lines[0]


_TORCH_PROBE = """
import json, sys
from moaspec.cli import main
cases = json.loads(sys.argv[1])
report = {}
for name, argv in cases.items():
    rc = main(argv)
    report[name] = [rc, "torch" in sys.modules, "transformers" in sys.modules]
print(json.dumps(report))
"""


def test_errors_are_caught_before_torch_loads(tmp_path: Path) -> None:
    """All error paths run in one fresh interpreter; none may import torch or transformers.

    Cases run in order, so a case that imported torch shows up as the first one reporting it.
    """
    cases = {name: build(tmp_path) for name, (build, _) in BAD_INPUTS.items()}
    proc = subprocess.run(
        [sys.executable, "-c", _TORCH_PROBE, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=_subprocess_env(tmp_path),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report == {name: [EXIT_USAGE, False, False] for name in BAD_INPUTS}
    assert len(proc.stderr.splitlines()) == len(BAD_INPUTS)
    assert not (tmp_path / "cache" / "targets").exists()  # no target was converted (~30 s) to refuse them


def test_help_exits_zero_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["generate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    flags = ("--prompt", "--target", "--drafter", "--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed")
    for flag in (*flags, "--json", "--raw"):
        assert flag in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--method", "moa", "--data", "/no/such/dir", "--out", "run"], "not a directory with shard"),
        (["--method", "eagle", "--data", "/no/such/dir", "--out", "run", "--tli-layers", "1"], "--method moa only"),
        (["--method", "eagle", "--data", "/no/such/dir", "--out", "run", "--memory-hidden"], "--method moa only"),
        (["--method", "moa", "--data", "d", "--out", "run", "--anchor-every", "5", "2"], "--anchor-every needs 1 <= MIN <= MAX"),
        (["--method", "moa", "--data", "d", "--out", "run", "--ce-weight", "-1"], "--ce-weight and --feature-weight must be finite and >= 0"),
        (["--method", "moa", "--data", "d", "--out", "run", "--ce-weight", "0", "--feature-weight", "0"], "not both 0"),
        (["--method", "eagle", "--data", "d", "--out", "run", "--no-layer-attention"], "--method moa only"),
        (["--method", "eagle", "--data", "d", "--out", "run", "--no-cross-attention"], "--method moa only"),
        (["--method", "moa", "--data", "/no/such/dir", "--out", "run", "--steps", "0"], "--steps must be >= 1"),
        (["--method", "moa", "--data", "/no/such/dir", "--out", "run", "--micro-batch", "0"], "--micro-batch must be >= 1"),
        (["--method", "gpt", "--data", "d", "--out", "run"], "invalid choice"),
        (["--data", "d", "--out", "run"], "required: --method"),
        (["--method", "moa", "--data", "d", "--out", "run", "--staircase-fraction", "2"], "--staircase-fraction must be within"),
        (["--method", "moa", "--data", "d", "--out", "run", "--min-lr", "1"], "--min-lr must be in (0, --lr = 0.0005]"),
        (["--method", "moa", "--data", "d", "--out", "run", "--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
        (["--method", "moa", "--data", "d", "--out", "run", "--lr", "-1"], "--lr must be > 0, got -1"),
        (["--method", "moa", "--data", "d", "--out", "run", "--tli-layers", "-1"], "--tli-layers must be >= 0"),
        (["--method", "moa", "--data", "d", "--out", "run", "--intermediate-size", "-1"], "--intermediate-size must be >= 0"),
        (["--method", "eagle", "--data", "d", "--out", "run", "--intermediate-size", "1728"], "--method moa only"),
        # an audit's: internal names instead of flags, or values accepted that the rest refuses
        (["--method", "moa", "--data", "d", "--out", "run", "--anchor-loss-weight", "2"], "--anchor-loss-weight must be within [0, 1], got 2"),
        (["--method", "moa", "--data", "d", "--out", "run", "--feature-weight", "inf"], "must be finite and >= 0"),
        (["--method", "moa", "--data", "d", "--out", "run", "--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
        (["--method", "moa", "--data", "d", "--out", "run", "--seed", str(2**64)], "--seed must be in [0, 2**63)"),
        (["--method", "moa", "--data", "d", "--out", "run", "--tree-depth", "0"], "--tree-depth / --tree-top-k / --tree-budget: tree depth"),
    ],
)
def test_train_bad_input(flags: list[str], message: str, capsys) -> None:
    from moaspec.cli import main

    assert main(["train", *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moaspec: error:") and message in lines[0]
    assert captured.out == ""


def test_train_init_from_must_be_a_checkpoint(tmp_path, capsys) -> None:
    from moaspec.cli import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-00000.jsonl").write_text("")
    flags = ["--method", "moa", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "run")]
    assert main(["train", *flags, "--init-from", str(tmp_path / "nothing")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is not a drafter checkpoint" in lines[0]
    assert not (tmp_path / "run").exists()
    assert main(["train", *flags, "--init-from", "moa+ngram"]) == 2
    assert "--init-from takes a checkpoint: 'moa'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main(["train", *flags, "--init-from", "eagle"]) == 2  # an audit's: refused only once the target had loaded
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "holds a drafter of method 'eagle', not 'moa'" in lines[0]
    assert not (tmp_path / "run").exists()


def test_train_init_from_takes_the_checkpoints_architecture_unless_named(tmp_path, monkeypatch) -> None:
    """README: `--init-from moa` fine-tunes the shipped drafter. It was refused (memory_layers 4 vs
    0) unless the user guessed --memory-layers 4: MoA's shape flags not given are the checkpoint's."""
    import moaspec.train.allocator
    import moaspec.train.run
    from moaspec.cli import main

    configs = []
    monkeypatch.setattr(moaspec.train.allocator, "keep_freed_memory", lambda: True)
    monkeypatch.setattr(moaspec.train.run, "run_training", lambda spec, config, tree: configs.append(config) or tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-00000.jsonl").write_text("")
    flags = ["--data", str(tmp_path / "data"), "--out", str(tmp_path / "run")]
    assert main(["train", "--method", "moa", *flags, "--init-from", "moa"]) == 0
    assert main(["train", "--method", "moa", *flags, "--init-from", "moa-tli1"]) == 0
    assert main(["train", "--method", "moa", *flags, "--init-from", "moa", "--memory-layers", "0", "--no-cross-attention"]) == 0
    assert main(["train", "--method", "moa", *flags]) == 0
    assert main(["train", "--method", "eagle", *flags, "--init-from", "moa"]) == 2  # another method's: refused up front
    assert main(["train", "--method", "moa", *flags, "--init-from", "moa", "--intermediate-size", "1728"]) == 0
    shapes = [(c.memory_layers, c.tli_layers, c.cross_attention, c.intermediate_size) for c in configs]
    assert shapes == [(4, 0, True, 0), (4, 1, True, 0), (0, 0, False, 0), (0, 0, True, 0), (4, 0, True, 1728)]



@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", "/proc/moaspec-run"], "cannot write --out /proc/moaspec-run"),
        (["--out", "RUN", "--feature-cache", "/proc/moaspec-cache"], "cannot write --feature-cache"),
        (["--out", "RUN", "--time-limit-min", "0"], "--time-limit-min must be > 0"),
        (["--out", "RUN", "--time-limit-min", "-1"], "--time-limit-min must be > 0"),
    ],
)
def test_train_refuses_what_it_could_not_write_or_finish(extra: list[str], message: str, tmp_path, capsys) -> None:
    """An --out or --feature-cache that cannot be written (here under /proc) and a time limit that
    would stop before the first step are refused in one line before anything loads, and no
    directory is left behind."""
    from moaspec.cli import main

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-00000.jsonl").write_text("")
    extra = [str(tmp_path / "run") if flag == "RUN" else flag for flag in extra]
    assert main(["train", "--method", "moa", "--data", str(tmp_path / "data"), *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_default_drafter_is_moa_with_lookup_where_shipped() -> None:
    from moaspec.drafters import default_drafter

    assert default_drafter("smollm2-135m") == "moa+ngram"
    assert default_drafter("some-other-target") == "ngram"


@pytest.mark.parametrize("terminated", [False, True])
def test_ctrl_c_and_sigterm_exit_as_shells_report_them(terminated: bool, monkeypatch, capsys) -> None:
    """Ctrl-C exits 130 and SIGTERM 143 (128 + the signal), each saying which it was; both unwind
    as KeyboardInterrupt, so long jobs save their progress either way."""
    import moaspec.cli as cli

    def stopped(args):
        raise cli.Terminated if terminated else KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate", stopped)
    assert cli.main(["generate", "--prompt", "hi"]) == (143 if terminated else 130)
    assert capsys.readouterr().err == f"moaspec: {'terminated' if terminated else 'interrupted'}\n"


def test_an_error_of_the_machine_is_one_line_not_a_traceback(monkeypatch, capsys) -> None:
    """Bug: a $MOASPEC_CACHE that cannot be written (or any file the machine refuses) ended the
    command with a traceback; now one line and exit status 1."""
    import moaspec.cli as cli

    def refused(args):
        raise PermissionError(1, "Operation not permitted", "/sys/kernel/x")

    monkeypatch.setattr(cli, "_generate", refused)
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err == "moaspec: error: Operation not permitted: /sys/kernel/x\n"


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path, monkeypatch) -> None:
    from moaspec.model_store import builtin_gguf_path, ensure_converted

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("MOASPEC_CACHE", str(blocked))
    with pytest.raises(MoaspecError, match=r"cannot write the model cache .*a-file/targets: .*MOASPEC_CACHE"):
        ensure_converted(builtin_gguf_path("smollm2-135m"), "smollm2-135m")


def test_another_librarys_error_becomes_one_line() -> None:
    from moaspec.errors import first_line

    assert first_line(RuntimeError("size mismatch\n  at layer 3")) == "size mismatch"
    listed = OSError("Couldn't instantiate the backend tokenizer from one of:\n(1) a tokenizer.json\n(2) a slow one")
    assert first_line(listed) == "Couldn't instantiate the backend tokenizer from one of: (1) a tokenizer.json (2) a slow one"
    assert first_line(RuntimeError()) == first_line(RuntimeError(" \n ")) == "RuntimeError"
    assert first_line(ValueError(""), empty="refused") == "refused"
    assert first_line(ValueError("x" * 500), limit=10) == "x" * 10


def test_an_output_directory_under_a_file_is_named_as_such(tmp_path: Path) -> None:
    """Bug: `--out FILE/sub` said the parent directory does not exist, though it exists as a file."""
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(MoaspecError, match=r"the parent directory of --out .*notes.txt/sub is not a directory"):
        output_dir(str(tmp_path / "notes.txt" / "sub"))
    with pytest.raises(MoaspecError, match="does not exist"):
        output_dir(str(tmp_path / "nowhere" / "sub"))
    assert output_dir(str(tmp_path / "run")) == tmp_path / "run" and not (tmp_path / "run").exists()
    (tmp_path / "bench" / "speedup.png").mkdir(parents=True)  # an audit's: found only when the run ended
    with pytest.raises(MoaspecError, match=r"bench/speedup.png is not a file, and this run writes a file there"):
        output_dir(str(tmp_path / "bench"), files=("results.json", "speedup.png"))
    assert output_dir(str(tmp_path / "bench"), files=("results.json",)) == tmp_path / "bench"
    (tmp_path / "run" / "checkpoint").parent.mkdir()
    (tmp_path / "run" / "checkpoint").write_text("x")  # an audit's: `train` failed on it after its steps
    with pytest.raises(MoaspecError, match=r"run/checkpoint is not a directory, and this run writes a directory there"):
        output_dir(str(tmp_path / "run"), directories=("checkpoint",))


def test_train_refuses_an_out_whose_state_or_checkpoint_is_in_the_way_before_loading(tmp_path: Path, capsys) -> None:
    """`moaspec train --out RUN` where RUN/train_state.pt is a directory or RUN/checkpoint a file:
    refused in one line before the target loads (an audit's: found after the training)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text('{"id": "0", "prompt_ids": [1, 2], "response_ids": [3, 4], "mode": "greedy", "seed": 0}\n')
    for name, make in (("train_state.pt", Path.mkdir), ("checkpoint", lambda path: path.write_text("x"))):
        run = tmp_path / f"run-{name}"
        run.mkdir()
        make(run / name)
        assert main(["train", "--method", "moa", "--data", str(data), "--out", str(run), "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{run / name} is not a" in err, err


@pytest.mark.parametrize(("stdin", "message"), [
    (b" \n\t\n", "the prompt is empty"),
    (b"caf\xe9 au lait\n", "the prompt read from stdin is not valid UTF-8 text"),
])
def test_a_bad_prompt_on_stdin_is_one_line(stdin: bytes, message: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moaspec", "generate", "--prompt", "-"], input=stdin, capture_output=True,
        env=dict(os.environ, MOASPEC_CACHE=str(tmp_path / "cache")), timeout=120,
    )
    assert proc.returncode == EXIT_USAGE and proc.stdout == b""
    assert proc.stderr.decode() == PREFIX + message + "\n"


def test_the_wrapper_refuses_a_directory_on_stdin_in_one_line(tmp_path: Path) -> None:
    """`scripts/moaspec generate --prompt - < DIR` ended in CPython's fatal start-up dump (a
    directory cannot be sys.stdin); the wrapper says so in one line before Python starts."""
    wrapper = Path(__file__).resolve().parents[1] / "scripts" / "moaspec"
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        proc = subprocess.run([str(wrapper), "generate", "--prompt", "-"], stdin=directory, capture_output=True, timeout=60)
    finally:
        os.close(directory)
    assert proc.returncode == EXIT_USAGE and proc.stdout == b""
    assert proc.stderr.decode() == PREFIX + "standard input is a directory; give --prompt - a file or a pipe\n"


@pytest.mark.parametrize("terminated", [False, True])
def test_an_interrupted_json_generation_prints_the_tokens_verified_before(terminated: bool, monkeypatch, capsys) -> None:
    """Bug: Ctrl-C (or SIGTERM) during `generate --json` printed nothing: the tokens verified
    before it were lost. Now one JSON object with them and stop_reason `interrupted`, then the
    usual exit status."""
    import json
    from types import SimpleNamespace

    import moaspec.api
    import moaspec.cli as cli
    import moaspec.model_store

    loaded = SimpleNamespace(name="smollm2-135m", runtime="llama.cpp", max_positions=8192, serve_one_prompt=lambda: None)

    class InterruptedLM:
        target = loaded
        drafter_name = "ngram"
        tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))

        def generate(self, prompt, streamer=None, **settings):
            streamer.put([[1, 2, 3]])  # the prompt
            streamer.put([7, 8])
            streamer.put([9])
            raise cli.Terminated if terminated else KeyboardInterrupt

    monkeypatch.setattr(moaspec.model_store, "resolve_target", lambda name: ("smollm2-135m", None))  # no conversion
    monkeypatch.setattr(moaspec.model_store, "target_name", lambda name: "smollm2-135m")
    monkeypatch.setattr(moaspec.api, "load_target", lambda *args, **options: loaded)
    monkeypatch.setattr(moaspec.api, "prompt_token_ids", lambda target, prompt, raw: [1, 2, 3])
    monkeypatch.setattr(moaspec.api, "speculative_lm", lambda *args: InterruptedLM())
    assert cli.main(["generate", "--prompt", "hi", "--json", "--drafter", "ngram"]) == (143 if terminated else 130)
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"target": "smollm2-135m", "runtime": "llama.cpp", "drafter": "ngram",
                                        "text": "7 8 9", "token_ids": [7, 8, 9], "stop_reason": "interrupted"}
    assert captured.err == f"moaspec: {'terminated' if terminated else 'interrupted'}\n"


@pytest.mark.parametrize(("drafter", "extra"), [(None, []), ("moa", []), ("moa", ["--temperature", "0.7"])])
def test_a_json_generation_interrupted_while_loading_prints_an_empty_answer(drafter, extra, monkeypatch, capsys) -> None:
    """An audit: Ctrl-C while the target or drafter loaded (or the machine was calibrated) printed
    no JSON, where one a moment later printed an object with no tokens: a JSON reader got nothing.
    Now the object, with no tokens (`drafter` null where none was named: not chosen yet)."""
    import json

    import moaspec.api
    import moaspec.cli as cli
    import moaspec.model_store
    import moaspec.signals

    def interrupted(*args, **options):
        raise KeyboardInterrupt

    monkeypatch.setattr(moaspec.model_store, "resolve_target", lambda name: ("smollm2-135m", None))  # no conversion
    monkeypatch.setattr(moaspec.model_store, "target_name", lambda name: "smollm2-135m")
    monkeypatch.setattr(moaspec.api, "load_target", interrupted)
    monkeypatch.setattr(moaspec.signals, "load_library_held", interrupted)  # torch's import, first where sampled
    named = ["--drafter", drafter] if drafter else []
    assert cli.main(["generate", "--prompt", "hi", "--json", "--runtime", "llama.cpp", *named, *extra]) == 130
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"target": "smollm2-135m", "runtime": "llama.cpp", "drafter": drafter,
                                        "text": "", "token_ids": [], "stop_reason": "interrupted"}
    assert captured.err == "moaspec: interrupted\n"


def test_a_prompt_too_long_for_the_context_is_refused_before_the_calibration(tiny_llama, monkeypatch, capsys) -> None:
    """Bug (a user's audit): `generate` with a prompt longer than the context calibrated the
    machine first (205 s on a busy transformers runtime), then refused it. Now the prompt is
    checked as soon as the target is loaded, by the CLI and by the one-shot library call."""
    from test_bench import char_tokenizer

    import moaspec
    import moaspec.api
    import moaspec.calibration.plan
    import moaspec.cli as cli
    import moaspec.model_store

    def calibrated(*args, **kwargs):
        raise AssertionError("the calibration ran")

    tiny_llama.tokenizer = char_tokenizer()
    monkeypatch.setattr(moaspec.model_store, "resolve_target", lambda name: ("tiny", None))  # no conversion
    monkeypatch.setattr(moaspec.model_store, "target_name", lambda name: "tiny")
    monkeypatch.setattr(moaspec.api, "load_target", lambda *args, **kwargs: tiny_llama)
    monkeypatch.setattr(moaspec.calibration.plan, "drafter_for", calibrated)
    monkeypatch.delenv("MOASPEC_NO_CALIBRATION", raising=False)
    too_long = "x" * tiny_llama.max_positions
    assert cli.main(["generate", "--prompt", too_long, "--raw", "--runtime", "transformers"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"moaspec: error: the prompt has {len(too_long)} tokens") and err.count("\n") == 1
    with pytest.raises(moaspec.MoaspecError, match=f"the prompt has {len(too_long)} tokens"):
        moaspec.generate(too_long, target="tiny", raw=True)
    with pytest.raises(TypeError):  # before anything loads
        moaspec.generate("hi", target="no-such-model", bogus=1)


def test_train_refuses_doubled_data_and_directories_of_other_files(tmp_path, capsys) -> None:
    """Bugs (a user's audit): `--data D D` trained on every record twice, `--out` and
    `--feature-cache` wrote into folders of other files (a data directory, notes), and an unfinished
    distillation was trained on without a word."""
    from moaspec.cli import main
    from moaspec.train import feature_cache
    from moaspec.train.cli import FEATURE_CACHE_FILES

    assert set(FEATURE_CACHE_FILES) == {feature_cache.INDEX, *(f"{name}.npy" for name in feature_cache.ARRAYS)}
    data = tmp_path / "data"
    data.mkdir()
    (data / "shard-00000.jsonl").write_text("{}\n")
    (data / "manifest.json").write_text('{"complete": false}')
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    base = ["train", "--method", "eagle", "--data", str(data)]
    cases = [
        ([*base, str(data), "--out", str(tmp_path / "run")], f"--data names {data} twice"),
        ([*base, "--out", str(data)], "holds other files (manifest.json, shard-00000.jsonl), not a `moaspec train` run"),
        ([*base, "--out", str(tmp_path / "run"), "--feature-cache", str(notes)], "holds other files (notes.txt), not a feature cache"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1].startswith("moaspec: error: ") and message in lines[-1], lines
        assert lines[:-1] == [f"moaspec: note: {data} is not complete yet (`moaspec data stats {data}`): "
                              "training on the records it holds now"]
    assert (notes / "notes.txt").read_text() == "mine" and sorted(p.name for p in notes.iterdir()) == ["notes.txt"]


def test_closed_and_narrow_standard_streams_keep_messages_and_exit_statuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: with stderr closed (`2>&-`, which Python leaves as None) the error line fell back to
    stdout and the exit status became 1; with stdout closed `generate` failed on its flush; on a
    console whose encoding cannot show a character the answer stopped at it with a traceback."""
    import io

    from moaspec.cli import usable_standard_streams

    narrow = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", narrow)
    monkeypatch.setattr(sys, "stderr", None)
    usable_standard_streams()
    print("café", end="")
    print("an error line", file=sys.stderr)
    sys.stdout.flush()
    assert narrow.buffer.getvalue() == b"caf?"
    monkeypatch.setattr(sys, "stdout", None)
    usable_standard_streams()
    print("nowhere")
    sys.stdout.flush()


def test_an_error_with_stderr_closed_keeps_stdout_empty_and_its_status(tmp_path: Path) -> None:
    command = f'"{sys.executable}" -m moaspec generate --prompt "" 2>&-'
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=_subprocess_env(tmp_path), timeout=120)
    assert proc.returncode == EXIT_USAGE and proc.stdout == ""


def test_a_target_of_an_unknown_architecture_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An audit's: a model directory whose config.json names a model_type transformers does not
    know got a warning line, then an error about a missing tokenizer library."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "nonesuch"}')
    rc = main(_gen("--target", str(model), "--runtime", "transformers", "--drafter", "none"))
    lines = capsys.readouterr().err.splitlines()
    assert rc == EXIT_USAGE and len(lines) == 1, lines
    assert lines[0].startswith(PREFIX) and "model_type 'nonesuch'" in lines[0]


@pytest.mark.parametrize("as_json", [False, True])
def test_generate_ends_with_the_busy_machine_note_when_there_is_one(as_json: bool, monkeypatch, capsys) -> None:
    """The note of calibration/busy_machine.py comes on stderr after the answer (and after the
    stats line), with the generation's own stats; stdout keeps the text or the JSON object only."""
    import json

    import moaspec.cli as cli

    seen = []
    monkeypatch.setattr(cli, "busy_machine_note", lambda stats, calibration, target: seen.append(stats) or "slow here")
    extra = ["--json"] if as_json else []
    assert cli.main(["generate", "--prompt", "hi", "--drafter", "none", "--max-new-tokens", "4", *extra]) == 0
    captured = capsys.readouterr()
    assert captured.err.endswith("moaspec: note: slow here\n") and len(seen) == 1 and seen[0].new_tokens == 4
    if as_json:
        assert json.loads(captured.out)["new_tokens"] == 4
    else:
        assert "slow here" not in captured.out and "[moaspec] 4 tokens" in captured.err
