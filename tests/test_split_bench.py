"""`moaspec bench --client-server` on tiny random float64 targets over loopback: the CLI writes
valid results with all four cases, bad flags stop before the target loads, the streamed baselines
report sane numbers, and the pooled metrics are computed as documented (moaspec/bench/client_server_runner.py)."""

from __future__ import annotations

import json

import pytest
from openai_helpers import tiny_chat_target
from test_bench import bench_args, tiny_bench  # noqa: F401  (tiny_bench is a fixture)

from moaspec.bench.client_server_cases import CaseRun
from moaspec.bench.client_server_runner import (
    CaseRecord,
    ClientServerData,
    NamedPrompt,
    run_client_server,
    summarize,
    text_mismatches,
)
from moaspec.bench.schema import CLIENT_SERVER_SCHEMA, CLIENT_SERVER_SCHEMA_VERSION, validate
from moaspec.cli import main
from moaspec.config import GenerationConfig, SamplingConfig
from moaspec.drafters.ngram import NgramDrafter
from moaspec.drafters.none import NoDrafter
from moaspec.engine import Engine
from moaspec.targets.hf import HFTarget


def save_random_checkpoint(directory, method: str, target) -> str:
    from conftest import make_random_drafter_net

    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.eagle import EagleConfig, EagleDrafterNet
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    net_class, config = (MoADrafterNet, MoAConfig) if method == "moa" else (EagleDrafterNet, EagleConfig)
    net = make_random_drafter_net(net_class, config.for_target(target.config), target)
    return str(save_checkpoint(directory, method, net, target, {"depth": 3, "top_k": 2, "budget": 4}))


def test_cli_writes_valid_results_with_all_four_cases(tmp_path, tiny_bench, capsys) -> None:  # noqa: F811
    """(a) MoA split, (b) EAGLE-2 split, (c) plain and (d) speculative server streams on one
    profile, plus the disconnection experiment; every greedy text equals the plain stream's."""
    moa = save_random_checkpoint(tmp_path / "moa", "moa", tiny_bench)
    eagle = save_random_checkpoint(tmp_path / "eagle", "eagle", tiny_bench)
    out = tmp_path / "res"
    argv = bench_args(
        out,
        "--client-server",
        "--network",
        "lan",
        "--categories",
        "math",
        "--limit",
        "1",
        "--methods",
        f"moa={moa},eagle={eagle}",
        "--disconnect-after",
        "3",
        "--offline-tokens",
        "3",
    )
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    results = json.loads((out / "results.json").read_text())
    validate(results, CLIENT_SERVER_SCHEMA)
    assert results["schema_version"] == CLIENT_SERVER_SCHEMA_VERSION == 2
    cases = {(row["method"], row["mode"]) for row in results["client_server"]}
    assert cases == {("none", "server"), ("moa", "split"), ("moa", "server"), ("eagle", "split"), ("eagle", "server")}
    assert {row["profile"] for row in results["client_server"]} == {"lan"} and results["mismatches"] == []
    assert all(row["new_tokens"] == 6 and row["tokens_per_s"] > 0 for row in results["client_server"])
    assert [row["drafter"] for row in results["disconnection"]] == ["moa", "eagle"]
    assert all(row["num_offline"] == 3 for row in results["disconnection"])  # random drafters always guess
    assert results["config"]["networks"]["lan"]["rtt_s"] == 0.001 and results["kind"] == "client_server"
    assert results["config"]["runtime"] == "transformers" and "on the transformers runtime" in captured.out
    assert captured.out == (out / "results.md").read_text() and "## lan (1 ms RTT" in captured.out
    assert sorted(p.name for p in out.iterdir()) == ["client_server.png", "results.json", "results.md"]
    assert (out / "client_server.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_disconnection_minimum_probability_reaches_the_clients(tmp_path, tiny_bench, capsys) -> None:  # noqa: F811
    """--offline-min-prob 1: a random drafter is never certain, so it writes nothing alone; the
    value is recorded in the config and named in the report."""
    moa = save_random_checkpoint(tmp_path / "moa", "moa", tiny_bench)
    out = tmp_path / "res"
    argv = bench_args(
        out, "--client-server", "--network", "lan", "--categories", "math", "--limit", "1", "--methods", f"moa={moa}",
        "--disconnect-after", "3", "--offline-tokens", "3", "--offline-min-prob", "1",
    )
    assert main(argv) == 0
    captured = capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["offline_min_prob"] == 1.0
    assert [(row["drafter"], row["num_offline"]) for row in results["disconnection"]] == [("moa", 0)]
    assert "falls below 1)" in captured.out


def test_adaptive_split_cases_size_their_trees_and_give_the_drafter_back(tmp_path, tiny_bench, capsys) -> None:  # noqa: F811
    """--adaptive: the split clients run with an AdaptiveTree (recorded in the config, named in the
    report, greedy text still the plain stream's), and each case restores the shared client
    drafter's fixed tree when it closes, so the next network starts from it."""
    from moaspec.bench.client_server_cases import LoopbackServers
    from moaspec.config import TreeConfig
    from moaspec.drafters import make_drafter
    from moaspec.serving.limits import ServerLimits
    from moaspec.split.generator import SplitOptions

    moa = save_random_checkpoint(tmp_path / "moa", "moa", tiny_bench)
    out = tmp_path / "res"
    argv = bench_args(out, "--client-server", "--network", "lan", "--categories", "math", "--limit", "1",
                      "--methods", f"moa={moa}", "--adaptive")
    assert main(argv) == 0
    captured = capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["adaptive"] is True and results["mismatches"] == []
    assert "size their trees from measured costs (`--adaptive`)" in captured.out

    with LoopbackServers(tiny_bench, {"moa": lambda target: make_drafter(moa, target)}, ServerLimits()) as servers:
        split = next(case for case in servers.cases("lan", SplitOptions(adaptive=True)) if case.mode == "split")
        fixed = split.drafter.tree_config
        assert split.generator.adaptive is not None
        split.drafter.tree_config = TreeConfig(depth=9, top_k=1, budget=9)  # as AdaptiveTree.choose() sets it
        split.close()
    assert split.drafter.tree_config == fixed


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--client-server", "--network", "4g,wifi"], "unknown network profile wifi"),
        (["--network", "4g"], "--network needs --client-server"),
        (["--disconnect-after", "4"], "--disconnect-after needs --client-server"),
        (["--client-server", "--offline-tokens", "4"], "--offline-tokens needs --disconnect-after"),
        (["--client-server", "--disconnect-after", "0"], "--disconnect-after must be >= 1"),
        (["--client-server", "--offline-min-prob", "0.5"], "--offline-min-prob needs --disconnect-after"),
        (["--client-server", "--disconnect-after", "4", "--offline-min-prob", "2"], "--offline-min-prob must be in [0, 1]"),
        (["--offline-min-prob", "0.5"], "--offline-min-prob needs --client-server"),
        (["--adaptive"], "--adaptive needs --client-server"),
        (["--client-server", "--methods", "none,hf"], "'hf' has no client-server form"),
        (["--client-server", "--temperature", "3"], "--temperature in [0, 2]"),
    ],
)
def test_bad_flags_fail_with_one_line_before_loading(tmp_path, tiny_bench, monkeypatch, capsys, extra, message) -> None:  # noqa: F811
    import moaspec.api

    monkeypatch.setattr(moaspec.api, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    assert main(bench_args(tmp_path / "res", *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("moaspec: error: ") and message in err and err.count("\n") == 1


def test_streamed_baselines_report_sane_values() -> None:
    """The plain stream comes from a server whose drafter is `none` (NoDrafter's context encoder is
    empty, so SplitServer takes it): its text is in-process plain decoding's, tau is 1, and every
    streamed generation is one server call; the speculative stream (ngram) is one call too."""
    target = tiny_chat_target()
    prompts = [
        NamedPrompt(f"p/{i}", tuple(target.tokenizer(text)["input_ids"]))
        for i, text in enumerate(["abc abc ab", "hello hello he"])
    ]
    data = run_client_server(target, {"ngram": NgramDrafter.for_target}, prompts, ("lan",), SamplingConfig(), 8)
    rows = {(row.method, row.mode): row for row in summarize(data)}
    assert set(rows) == {("none", "server"), ("ngram", "split"), ("ngram", "server")} and data.mismatches == []
    plain, speculative = rows[("none", "server")], rows[("ngram", "server")]
    for row in (plain, speculative):
        assert row.new_tokens == 16 and row.num_generations == 2
        assert row.server_calls_per_100_tokens == 12.5  # 2 requests for 16 tokens
        assert 100 < row.bytes_per_token < 2000  # one SSE chunk (~300 bytes) per token, plus the request
        assert 0 < row.time_to_first_token_s <= row.wall_s / row.num_generations
    assert plain.tau == 1.0 and plain.speedup == 1.0 and speculative.tau >= 1.0
    assert rows[("ngram", "split")].server_calls_per_100_tokens >= 100 * 4 / 16  # open + close per generation, at least
    reference = Engine(HFTarget(target.model, target.tokenizer, target.name), NoDrafter())
    for prompt in prompts:
        expected = reference.generate(list(prompt.prompt_ids), generation=GenerationConfig(max_new_tokens=8)).token_ids
        streamed = next(r.run for r in data.records if (r.prompt, r.method, r.mode) == (prompt.name, "none", "server"))
        assert streamed.text == target.tokenizer.decode(expected, skip_special_tokens=True)


def test_later_turns_follow_the_plain_streams_answer() -> None:
    """A prompt's second user turn runs after its first, on the conversation extended by the plain
    stream's answer, for every case; a turn that no longer fits the context is skipped, named."""
    from moaspec.chat import encode_chat_messages

    target = tiny_chat_target(max_positions=128)
    first = [{"role": "user", "content": "abc abc ab"}]
    ids = tuple(encode_chat_messages(target.tokenizer, first))
    prompts = [
        NamedPrompt("p/0", ids, (), tuple(first), ("abc again",)),
        NamedPrompt("p/1", ids, (), tuple(first), ("x" * 120, "never asked")),
    ]
    data = run_client_server(target, {"ngram": NgramDrafter.for_target}, prompts, ("lan",), SamplingConfig(), 8)
    assert data.mismatches == [] and data.skipped == ["lan p/1 turn 2"]
    names = [record.prompt for record in data.records]
    assert names == ["p/0"] * 3 + ["p/0 turn 2"] * 3 + ["p/1"] * 3
    answer = next(r.run.text for r in data.records if (r.prompt, r.method, r.mode) == ("p/0", "none", "server"))
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "abc again"}]
    reference = Engine(HFTarget(target.model, target.tokenizer, target.name), NoDrafter())
    expected = reference.generate(encode_chat_messages(target.tokenizer, second), generation=GenerationConfig(max_new_tokens=8))
    for record in data.records[3:6]:
        assert record.run.text == target.tokenizer.decode(expected.token_ids, skip_special_tokens=True)


def _run(new_tokens: int, wall_s: float, calls: int, num_bytes: int, forwards: int, text: str = "x") -> CaseRun:
    return CaseRun(text, new_tokens, wall_s, wall_s / 4, calls, num_bytes, forwards, new_tokens)


def test_rows_pool_generations_as_documented() -> None:
    data = ClientServerData(
        [
            CaseRecord("4g", "p/0", "none", "server", _run(10, 1.0, 1, 3000, 10)),
            CaseRecord("4g", "p/1", "none", "server", _run(10, 1.0, 1, 3000, 10)),
            CaseRecord("4g", "p/0", "moa", "split", _run(12, 0.5, 6, 2400, 4)),
            CaseRecord("4g", "p/1", "moa", "split", _run(8, 1.5, 4, 1600, 6)),
        ]
    )
    plain, split = summarize(data)
    assert (plain.tokens_per_s, plain.speedup, plain.server_calls_per_100_tokens, plain.bytes_per_token) == (
        10.0,
        1.0,
        10.0,
        300.0,
    )
    assert (split.new_tokens, split.tokens_per_s, split.speedup, split.tau) == (20, 10.0, 1.0, 2.0)
    assert (split.server_calls_per_100_tokens, split.bytes_per_token, split.time_to_first_token_s) == (
        50.0,
        200.0,
        0.25,
    )
    runs = {("none", "server"): _run(1, 1, 1, 1, 1, "same text"), ("moa", "split"): _run(1, 1, 1, 1, 1, "same test")}
    assert [(m.method, m.first_divergence) for m in text_mismatches("4g", "p/0", runs)] == [("moa", 7)]


def test_disconnection_scores_answers_against_references(monkeypatch) -> None:
    """Task F1 of verified + offline text and of the target's own answer of the same length, the
    first-token agreement, and no score for a prompt without references."""
    import moaspec.bench.client_server_runner as client_server_runner
    from moaspec.bench.client_server_runner import run_disconnection
    from moaspec.bench.task_score import normalized_words, token_f1

    target = tiny_chat_target()
    prompt_ids = tuple(target.tokenizer("Where is the cat?")["input_ids"])
    offline = target.tokenizer("cat sat mat")["input_ids"]
    monkeypatch.setattr(client_server_runner, "_offline_continuation", lambda *args: ([], list(offline)))
    reference = Engine(HFTarget(target.model, target.tokenizer, target.name), NoDrafter())
    own = reference.generate(list(prompt_ids), generation=GenerationConfig(max_new_tokens=len(offline))).token_ids
    own_text = target.tokenizer.decode(own, skip_special_tokens=True)
    assert normalized_words(own_text), "the tiny target's answer should hold words"
    prompts = [NamedPrompt("qa/0", prompt_ids, ("The cat sat.", own_text)), NamedPrompt("qa/1", prompt_ids)]
    drafters = {"ngram": NgramDrafter.for_target}
    (row,) = run_disconnection(target, drafters, prompts, cut_after=2, offline_tokens=len(offline))
    assert (row.num_generations, row.num_offline, row.num_scored) == (2, 2 * len(offline), 1)
    assert row.task_f1 == round(max(0.8, token_f1("cat sat mat", [own_text])), 4)
    assert row.target_task_f1 == 1.0
    assert row.first_token_agreement == float(offline[0] == own[0])
    unscored = run_disconnection(target, drafters, prompts[1:], 2, len(offline))[0]
    assert unscored.num_scored == 0 and unscored.task_f1 is None and unscored.target_task_f1 is None
    # bug (a user's audit): nothing drafted alone was reported as agreement 0.00, not as no figure
    monkeypatch.setattr(client_server_runner, "_offline_continuation", lambda *args: ([], []))
    silent = run_disconnection(target, drafters, prompts[1:], 2, len(offline))[0]
    assert (silent.num_offline, silent.agreement, silent.first_token_agreement) == (0, None, 0.0)


def test_stream_case_reconnects_after_the_server_closed_an_idle_connection() -> None:
    """Between two prompts of one streamed case the other cases run; a server that closed the
    kept-alive connection meanwhile (its keep-alive timeout) costs a new connection, not the run."""
    import time

    from moaspec.bench.client_server_cases import LoopbackServers
    from moaspec.serving.limits import ServerLimits

    target = tiny_chat_target()
    prompt = tuple(target.tokenizer("abc abc ab")["input_ids"])
    with LoopbackServers(target, {}, ServerLimits(keepalive_timeout_s=0.05)) as servers:
        (stream,) = servers.cases("lan")
        try:
            texts = []
            for _ in range(3):
                texts.append(stream.run(prompt, SamplingConfig(), 6, 0).text)
                time.sleep(0.5)  # well past the keep-alive timeout
        finally:
            stream.close()
    assert len(set(texts)) == 1 and texts[0]
