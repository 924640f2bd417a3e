"""`moaspec serve` / `moaspec generate --server`: bad input gets one line and exit status 2."""

from __future__ import annotations

import pytest

from moaspec.cli import main
from moaspec.errors import MoaspecError


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
        # bugs: a port out of range, not a number or 0 (taken as 80), and a broken IPv6 URL ended in a traceback
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:99999"], "a port of 1-65535"),
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:abc"], "a port of 1-65535"),
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:0"], "a port of 1-65535"),
        (["generate", "--prompt", "hi", "--server", "http://[::1"], "--server must be an http:// or https:// URL"),
        (["generate", "--prompt", "hi", "--server", "ftp://127.0.0.1:9"], "--server must be an http:// or https:// URL"),
        (["generate", "--prompt", "hi", "--server", "http://:8080"], "--server must be an http:// or https:// URL"),
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:9", "--timeout", "0"], "--timeout must be > 0"),
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:9", "--offline-deadline-s", "-1"],
         "--offline-deadline-s must be >= 0"),
        # an audit (session 50): the range error named no flag, and --cafile was ignored over http
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:9", "--offline-min-prob", "2"],
         "--offline-min-prob must be in [0, 1], got 2"),
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:9", "--offline-min-prob", "nan"],
         "--offline-min-prob must be in [0, 1], got nan"),
        (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:9", "--cafile", "ca.pem"],
         "--cafile applies to an https:// server"),
    ],
)
def test_split_cli_bad_input(argv: list[str], message: str, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("MOASPEC_API_KEY", raising=False)
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))  # as on a fresh machine: no converted target yet
    given_key = ("--ssl-certfile", "--timeout", "--max-tree-nodes", "--offline-deadline-s", "--offline-min-prob", "--cafile")
    if any(flag in argv for flag in given_key):
        monkeypatch.setenv("MOASPEC_API_KEY", "k")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moaspec: error: ") and message in err and "\n" not in err


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_the_url_a_server_announces_is_one_a_client_takes(host: str) -> None:
    """Bug: `serve --host ::1` announced http://::1:PORT, which `generate --server` refuses."""
    from moaspec.split.address import server_address, server_url

    assert server_address(server_url("http", host, 18707)) == ("http", host, 18707)
    assert server_address(server_url("https", host, 443)) == ("https", host, 443)


def test_a_server_url_without_a_port_takes_its_schemes() -> None:
    from moaspec.split.address import server_address

    assert server_address("https://example.test") == ("https", "example.test", 443)
    assert server_address("http://example.test/") == ("http", "example.test", 80)


def test_a_server_that_is_down_is_announced_and_given_up_on_at_the_deadline(capsys, monkeypatch) -> None:
    """Bug: a split client whose server refused connections printed nothing for two minutes (a
    fixed retry deadline), then failed. Now it says at once that it retries, for how long
    (--offline-deadline-s), and gives up then."""
    import socket
    import time

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("MOASPEC_API_KEY", "k" * 16)
    started = time.monotonic()
    argv = ["generate", "--prompt", "hi", "--drafter", "ngram", "--server", f"http://127.0.0.1:{port}",
            "--offline-deadline-s", "0.5"]
    assert main(argv) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert time.monotonic() - started < 60
    assert lines[0].startswith("[moaspec] ") and "retrying for up to 0.5 s" in lines[0]
    assert lines[-1].startswith("moaspec: error: ") and "unreachable" in lines[-1] and len(lines) == 2


@pytest.mark.parametrize("flags, expected", [
    ([], {"runtime": "llama.cpp", "threads": None, "device": "cpu"}),
    (["--runtime", "transformers", "--dtype", "bfloat16"], {"runtime": "transformers", "dtype": "bfloat16"}),
    (["--threads", "1"], {"runtime": "llama.cpp", "threads": 1}),
])
def test_the_split_client_loads_its_target_with_the_runtime_flags(flags, expected, monkeypatch) -> None:
    """Bug: `generate --server` checked --runtime/--device/--dtype/--threads and then loaded the
    client's target (its drafter's tokenizer and borrowed parts) on the default runtime anyway."""
    import moaspec.api
    from moaspec.targets.options import llama_cpp_available

    if not llama_cpp_available():
        pytest.skip("the default runtime of a GGUF target is llama.cpp only when llama-cpp-python is installed")
    seen = {}

    def recorded(target, **kwargs):
        seen.update(kwargs)
        raise MoaspecError("recorded")  # stop before anything loads or connects

    monkeypatch.setenv("MOASPEC_API_KEY", "k" * 16)
    monkeypatch.setattr(moaspec.api, "load_target", recorded)
    assert main(["generate", "--prompt", "hi", "--drafter", "ngram", "--server", "http://127.0.0.1:9", *flags]) == 2
    assert seen["light_tokenizer"] is True
    assert {key: seen[key] for key in expected} == expected


@pytest.mark.parametrize("argv, module", [
    (["serve"], "aiohttp"),
    (["serve"], "prometheus_client"),
    (["generate", "--prompt", "hi", "--server", "http://127.0.0.1:9"], "msgpack"),
])
def test_a_missing_serve_extra_is_named_in_one_line(argv, module, capsys, monkeypatch) -> None:
    """Bug: without the `serve` extra, `moaspec serve` ended in an ImportError traceback."""
    import sys

    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    monkeypatch.setenv("MOASPEC_API_KEY", "k" * 16)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moaspec: error: ") and module in err and "pip install 'moaspec[serve]'" in err and "\n" not in err


def test_bench_client_server_names_the_missing_serve_extra(monkeypatch, capsys, tmp_path) -> None:
    """`bench --client-server` runs split servers (aiohttp) but checks only jsonschema /
    matplotlib first: without the `serve` extra it ends in a ModuleNotFoundError traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "aiohttp", None)
    rc = main(["bench", "--client-server", "--target", "smollm2-135m", "--limit", "1", "--no-plots",
               "--max-new-tokens", "4", "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "pip install 'moaspec[serve]'" in capsys.readouterr().err


def test_a_tls_file_that_cannot_be_loaded_is_named_in_one_line(tmp_path) -> None:
    from moaspec.split.commands import check_tls

    not_pem = tmp_path / "cert.pem"
    not_pem.write_text("not a certificate")
    for certfile, detail in ((tmp_path / "missing.pem", "No such file or directory"), (not_pem, "PEM")):
        with pytest.raises(MoaspecError) as info:
            check_tls(str(certfile), str(not_pem))
        message = str(info.value)
        assert f"cannot load the TLS certificate {certfile} / key {not_pem}" in message
        assert detail in message and "\n" not in message


@pytest.mark.parametrize("where", ["loading", "connecting"])
def test_a_split_json_generation_interrupted_before_it_starts_prints_an_empty_answer(where: str, monkeypatch, capsys) -> None:
    """An audit: Ctrl-C while the split client loaded its drafter, or waited for a server that was
    down (up to 120 s), printed no JSON. Now the object with no tokens, the server's runtime null
    (not reached), and the link's counts once the client was made."""
    import json
    from types import SimpleNamespace

    import moaspec.api
    import moaspec.cli as cli
    import moaspec.drafters
    import moaspec.model_store
    import moaspec.split.client
    import moaspec.split.generator

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setenv("MOASPEC_API_KEY", "k" * 16)
    monkeypatch.setattr(moaspec.model_store, "target_name", lambda name: "smollm2-135m")
    monkeypatch.setattr(moaspec.split.client, "SplitClient", lambda *args, **kwargs: SimpleNamespace(
        stats=SimpleNamespace(calls=0, bytes_sent=0, bytes_received=0)))
    if where == "loading":
        monkeypatch.setattr(moaspec.api, "load_target", interrupted)
    else:
        monkeypatch.setattr(moaspec.api, "load_target", lambda target, **kwargs: SimpleNamespace(name="smollm2-135m"))
        monkeypatch.setattr(moaspec.drafters, "make_drafter", lambda name, target, overrides: SimpleNamespace(accept_context=None))
        monkeypatch.setattr(moaspec.api, "SpeculativeLM", lambda target, drafter: SimpleNamespace(encode_prompt=lambda p, raw: [1]))
        monkeypatch.setattr(moaspec.split.generator, "SplitGenerator", interrupted)
    argv = ["generate", "--prompt", "hi", "--json", "--drafter", "ngram", "--server", "http://127.0.0.1:9"]
    assert cli.main(argv) == 130
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert {key: record[key] for key in ("target", "runtime", "drafter", "text", "token_ids", "stop_reason")} == {
        "target": "smollm2-135m", "runtime": None, "drafter": "ngram", "text": "", "token_ids": [], "stop_reason": "interrupted"}
    assert record["split"]["server_calls"] == 0
    assert captured.err == "moaspec: interrupted\n"


@pytest.mark.parametrize("terminated", [False, True])
def test_an_interrupted_split_json_generation_prints_the_tokens_verified_before(terminated: bool, monkeypatch, capsys) -> None:
    """Bug: Ctrl-C (or SIGTERM) during `generate --server URL --json` printed nothing: the tokens
    the server had verified were lost (local generation prints them since session 33). Now one JSON
    object with them, stop_reason `interrupted` and the link's counts, then the usual exit status."""
    import json
    from types import SimpleNamespace

    import moaspec.api
    import moaspec.cli as cli
    import moaspec.drafters
    import moaspec.split.client
    import moaspec.split.generator

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))

    class InterruptedGenerator:
        info = {"runtime": "llama.cpp"}

        def __init__(self, client, drafter, options) -> None:
            pass

        def stream(self, prompt_ids, sampling, generation, stop_ids, result):
            for ids in ([7, 8], [9]):
                result.token_ids.extend(ids)
                yield SimpleNamespace(kind="verified", token_ids=ids)
            raise cli.Terminated if terminated else KeyboardInterrupt

    monkeypatch.setenv("MOASPEC_API_KEY", "k" * 16)
    monkeypatch.setattr(moaspec.api, "load_target",
                        lambda target, **kwargs: SimpleNamespace(name="smollm2-135m", stop_ids=frozenset()))
    monkeypatch.setattr(moaspec.drafters, "make_drafter", lambda name, target, overrides: SimpleNamespace(accept_context=None))
    monkeypatch.setattr(moaspec.api, "SpeculativeLM", lambda target, drafter: SimpleNamespace(
        target=target, tokenizer=tokenizer, encode_prompt=lambda prompt, raw: [1, 2]))
    monkeypatch.setattr(moaspec.split.client, "SplitClient", lambda *args, **kwargs: SimpleNamespace(
        stats=SimpleNamespace(calls=2, bytes_sent=300, bytes_received=100)))
    monkeypatch.setattr(moaspec.split.generator, "SplitGenerator", InterruptedGenerator)
    argv = ["generate", "--prompt", "hi", "--json", "--drafter", "ngram", "--server", "http://127.0.0.1:9"]
    assert cli.main(argv) == (143 if terminated else 130)
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert {key: record[key] for key in ("target", "runtime", "drafter", "text", "token_ids", "stop_reason")} == {
        "target": "smollm2-135m", "runtime": "llama.cpp", "drafter": "ngram",
        "text": "7 8 9", "token_ids": [7, 8, 9], "stop_reason": "interrupted"}
    assert (record["split"]["server_calls"], record["split"]["bytes_per_token"]) == (2, round(400 / 3, 1))
    assert captured.err == f"moaspec: {'terminated' if terminated else 'interrupted'}\n"
