"""`moaspec serve` / `moaspec generate --server`: bad input gets one line and exit status 2."""

from __future__ import annotations

import pytest

from moaspec.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve"], "an API key is required"),
        (["serve", "--api-key-file", "/nonexistent/key"], "cannot read the API key file"),
        (["serve", "--port", "70000"], "--port must be in"),
        (["serve", "--ssl-certfile", "cert.pem"], "both --ssl-certfile and --ssl-keyfile"),
        (["serve", "--max-tree-nodes", "0"], "--max-tree-nodes must be >= 1"),
        (["serve", "--max-connections", "0"], "--max-connections must be > 0"),
        (["serve", "--header-timeout-s", "-1"], "--header-timeout-s must be > 0"),
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:9"], "an API key is required"),
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:9", "--timeout", "0"], "--timeout must be > 0"),
    ],
)
def test_split_cli_bad_input(argv: list[str], message: str, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("MOASPEC_API_KEY", raising=False)
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))  # as on a fresh machine: no converted target yet
    if "--ssl-certfile" in argv or "--timeout" in argv or "--max-tree-nodes" in argv:
        monkeypatch.setenv("MOASPEC_API_KEY", "k")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moaspec: error: ") and message in err and "\n" not in err
