"""`moaspec bench` on a tiny random target with a character tokenizer: the protocol, the files,
the results.json schema, greedy-mismatch detection and the up-front flag checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_tiny_target

from moaspec.bench import schema
from moaspec.bench.method_run import MethodRun
from moaspec.bench.methods import MethodSpec, check_available, parse_methods
from moaspec.bench.prompts import CATEGORIES, load_prompts
from moaspec.cli import main
from moaspec.errors import MoaspecError

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_tokenizer():
    """97 ids: <unk>, printable ASCII and newline, with a minimal chat template."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture
def tiny_bench(monkeypatch):
    """Make `moaspec bench --target tiny` load a tiny Llama (context 2048) with a char tokenizer."""
    import moaspec.api
    import moaspec.model_store

    target = make_tiny_target("llama", max_position_embeddings=2048)
    target.tokenizer = char_tokenizer()
    monkeypatch.setattr(moaspec.model_store, "resolve_target", lambda spec: ("tiny-llama", Path("unused")))
    monkeypatch.setattr(moaspec.model_store, "target_name", lambda spec: "tiny-llama")
    monkeypatch.setattr(moaspec.api, "load_target", lambda name, dtype=None, attn_implementation=None, **kwargs: target)
    return target


def bench_args(out: Path, *extra: str) -> list[str]:
    return [
        "bench",
        "--out",
        str(out),
        "--target",
        "tiny",
        "--limit",
        "2",
        "--max-new-tokens",
        "6",
        "--no-progress",
        *extra,
    ]


def test_tiny_end_to_end_writes_valid_results_and_plots(tmp_path, tiny_bench, capsys) -> None:
    out = tmp_path / "res"
    code = main(bench_args(out, "--categories", "mt_bench,translation", "--methods", "none,hf,hf-pld,ngram"))
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    assert results["schema_version"] == 1
    assert [row["method"] for row in results["summary"]] == ["none", "hf", "hf-pld", "ngram"]
    baseline = results["summary"][0]
    assert baseline["speedup"] == pytest.approx(1.0) and baseline["tau"] == pytest.approx(1.0)
    assert results["mismatches"] == []
    # MT-bench asks both turns: 2 prompts x 2 turns x 4 methods; translation: 2 x 1 x 4
    assert len(results["runs"]) == 2 * 2 * 4 + 2 * 4
    assert {run["turn"] for run in results["runs"] if run["category"] == "mt_bench"} == {1, 2}
    assert all(run["new_tokens"] == 6 for run in results["runs"])  # no stop token in the tiny vocabulary
    hf_row = next(r for r in results["categories"][0]["rows"] if r["method"] == "hf")
    assert hf_row["tau"] == pytest.approx(1.0) and hf_row["time_s"] is None
    markdown = (out / "results.md").read_text()
    assert "## mt_bench" in markdown and "## Mean over categories" in markdown and "| ngram |" in markdown
    # the runtime the target ran on, its setting beside it (llama.cpp: its threads; the header said
    # only torch's, a user's audit found)
    assert results["config"]["threads"] is None and "Target `tiny-llama` on transformers (float32), " in markdown
    assert "Fastest per category" in markdown and "## Relative to `hf`" in markdown
    for name in ("speedup.png", "tau.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md", "speedup.png", "tau.png"]
    assert "| none |" in capsys.readouterr().out
    # a rerun without plots leaves none of the old ones beside its results, nor the other kind of
    # bench's (an audit found a --client-server run's plot kept beside a single-device run's results)
    (out / "client_server.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    assert main(bench_args(out, "--categories", "translation", "--methods", "none", "--no-plots")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]


def test_checkpoint_drafter_is_lossless_and_reports_acceptance(tmp_path, tiny_bench, capsys) -> None:
    """A (random) MoA checkpoint given as LABEL=DIR runs through the engine; greedy output equals none's."""
    from conftest import make_random_drafter_net

    from moaspec.nn.checkpoint import save_checkpoint
    from moaspec.nn.moa import MoAConfig, MoADrafterNet

    net = make_random_drafter_net(MoADrafterNet, MoAConfig.for_target(tiny_bench.config), tiny_bench)
    checkpoint = save_checkpoint(tmp_path / "moa-ckpt", "moa", net, tiny_bench, {"depth": 3, "top_k": 2, "budget": 4})
    out = tmp_path / "res"
    code = main(bench_args(out, "--categories", "math", "--methods", f"none,mymoa={checkpoint}", "--no-plots"))
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    row = results["categories"][0]["rows"][1]
    assert row["method"] == "mymoa" and len(row["acceptance_per_depth"]) == 3
    assert set(row["time_s"]) == {"prefill", "draft", "verify", "other"} and row["time_s"]["draft"] > 0
    assert results["config"]["method_sources"]["mymoa"] == str(checkpoint) and results["mismatches"] == []

    fixed = tmp_path / "fixed"
    tree_flags = ["--tree-depth", "6", "--tree-top-k", "4", "--tree-budget", "16"]
    code = main(bench_args(fixed, "--categories", "math", "--methods", f"ngram,mymoa={checkpoint}", "--no-plots", *tree_flags))
    assert code == 0, capsys.readouterr().err
    trees = json.loads((fixed / "results.json").read_text())["config"]["method_trees"]
    assert trees["mymoa"] == {"depth": 6, "top_k": 4, "budget": 16, "sampled": False, "source": "explicit"}
    assert trees["ngram"] is None  # the flags reach model drafters only


def test_sampled_run_skips_the_greedy_check(tmp_path, tiny_bench, capsys) -> None:
    out = tmp_path / "res"
    code = main(
        bench_args(
            out,
            "--categories",
            "mt_bench",
            "--limit",
            "1",
            "--methods",
            "none,hf,hf-pld,ngram",
            "--temperature",
            "0.7",
            "--no-plots",
        )
    )
    assert code == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["temperature"] == 0.7 and results["mismatches"] == []
    assert "Sampled run" in (out / "results.md").read_text()


class FlipLastToken:
    """A deliberately broken 'lossless' method: the baseline's output with its last token changed."""

    def __init__(self, label: str, target) -> None:
        from moaspec.bench.methods import EngineMethod
        from moaspec.drafters.none import NoDrafter

        self.label = label
        self.inner = EngineMethod(label, target, NoDrafter(), target.stop_ids)

    def run(self, prompt_ids, sampling, max_new_tokens, seed) -> MethodRun:
        run = self.inner.run(prompt_ids, sampling, max_new_tokens, seed)
        run.token_ids[-1] = (run.token_ids[-1] + 1) % 97
        return run


def test_greedy_mismatch_is_reported_loudly(tmp_path, tiny_bench, monkeypatch, capsys) -> None:
    from moaspec.bench import methods

    real_build = methods.build_method
    monkeypatch.setattr(
        methods,
        "build_method",
        lambda spec, target, *rest: (
            FlipLastToken(spec.label, target) if spec.label == "ngram" else real_build(spec, target, *rest)
        ),
    )
    out = tmp_path / "res"
    code = main(bench_args(out, "--categories", "translation", "--methods", "none,ngram", "--no-plots"))
    assert code == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "ngram differs from none on translation/" in err
    results = json.loads((out / "results.json").read_text())
    assert [(m["method"], m["first_divergence"]) for m in results["mismatches"]] == [("ngram", 5), ("ngram", 5)]
    assert results["summary"][1]["num_mismatches"] == 2
    assert "MISMATCHES" in (out / "results.md").read_text()


def test_ignore_eos_writes_every_answer_to_the_limit(tmp_path, tiny_bench, monkeypatch, capsys) -> None:
    """With a third of the vocabulary as stop tokens answers end early; with --ignore-eos every
    method (ours, transformers' generate) writes all --max-new-tokens, still checked lossless."""
    stops = frozenset(range(0, tiny_bench.vocab_size, 3))
    monkeypatch.setattr(type(tiny_bench), "stop_ids", property(lambda self: stops))
    results = {}
    for name, flags in (("stopping", []), ("ignoring", ["--ignore-eos"])):
        out = tmp_path / name
        code = main(bench_args(out, "--categories", "mt_bench,translation", "--methods", "none,hf,ngram", *flags))
        assert code == 0, capsys.readouterr().err
        results[name] = json.loads((out / "results.json").read_text())
        schema.validate(results[name])
    assert not results["stopping"]["config"]["ignore_eos"] and results["ignoring"]["config"]["ignore_eos"]
    assert any(run["new_tokens"] < 6 for run in results["stopping"]["runs"])
    assert all(run["new_tokens"] == 6 for run in results["ignoring"]["runs"])
    assert results["ignoring"]["mismatches"] == []
    assert "stop tokens ignored" in (tmp_path / "ignoring" / "results.md").read_text()


def test_schema_rejects_missing_and_mistyped_fields(tmp_path, tiny_bench) -> None:
    main(bench_args(tmp_path / "res", "--categories", "math", "--methods", "none", "--no-plots", "--limit", "1"))
    results = json.loads((tmp_path / "res" / "results.json").read_text())
    schema.validate(results)
    assert results["config"]["tree_limit"] == {"max_nodes": None, "chains_only": False}  # transformers: any tree
    broken = json.loads(json.dumps(results))
    del broken["summary"][0]["tau"]
    with pytest.raises(ValueError, match=r"summary\[0\]: missing key 'tau'"):
        schema.validate(broken)
    broken = json.loads(json.dumps(results))
    broken["summary"][0]["speedup"] = "fast"
    with pytest.raises(ValueError, match=r"summary\[0\].speedup: expected int or float, got str"):
        schema.validate(broken)


def test_no_partial_files_when_the_report_fails(tmp_path, tiny_bench, monkeypatch) -> None:
    import moaspec.bench.plots

    def explode(results):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(moaspec.bench.plots, "render_plots", explode)
    out = tmp_path / "res"
    with pytest.raises(RuntimeError):
        main(bench_args(out, "--categories", "math", "--methods", "none", "--limit", "1"))
    assert not out.exists() or list(out.iterdir()) == []


def test_the_report_compares_every_method_with_the_runtimes_own_generation() -> None:
    from moaspec.bench.report import render_markdown

    def row(method: str, rates: dict[str, float]) -> dict:
        per = {c: {"speedup": rate / 100.0, "tau": 1.0, "tokens_per_s": rate} for c, rate in rates.items()}
        return {"method": method, "speedup": 1.0, "tau": 1.0, "tokens_per_s": 0.0, "per_category": per}

    results = {
        "config": {"target": "t", "temperature": 0.0, "max_new_tokens": 8, "seed": 0},
        "machine": {"description": "m"}, "command": "c", "mismatches": [], "agreement": [], "skipped": [],
        "categories": [{"category": "qa", "num_prompts": 1, "num_generations": 1, "rows": []},
                       {"category": "math", "num_prompts": 1, "num_generations": 1, "rows": []}],
        "summary": [row("none", {"qa": 100.0, "math": 100.0}), row("llama.cpp", {"qa": 80.0, "math": 125.0}),
                    row("ngram", {"qa": 120.0, "math": 50.0})],
    }
    markdown = render_markdown(results)
    assert "Fastest per category (speedup over `none`): qa `ngram` (1.20×), math `llama.cpp` (1.25×)." in markdown
    relative = markdown[markdown.index("## Relative to `llama.cpp`"):]
    # none: 100/80 = 1.25 and 100/125 = 0.80, mean 1.025; ngram: 1.50 and 0.40, mean 0.95
    assert "| none | 1.02× | 1.25× | 0.80× |" in relative and "| ngram | 0.95× | 1.50× | 0.40× |" in relative
    assert "## Relative to `hf`" not in markdown  # only for a runtime's generation the run has


def test_the_report_says_when_the_target_verified_only_short_chains() -> None:
    """A K-quant GGUF on llama.cpp verifies chains of a few nodes here: a method's tree
    (`moa@ref`, say) was cut to them, which its results alone would not show."""
    from moaspec.bench.report import render_markdown

    results = {
        "config": {"target": "t", "temperature": 0.0, "max_new_tokens": 8, "seed": 0,
                   "tree_limit": {"max_nodes": 3, "chains_only": True}},
        "machine": {"description": "m"}, "command": "c", "mismatches": [], "agreement": [], "skipped": [],
        "categories": [], "summary": [],
    }
    assert "Trees: the target verifies chains of at most 3 nodes exactly here" in render_markdown(results)
    results["config"]["tree_limit"] = {"max_nodes": 1, "chains_only": True}  # Gemma-3's Q4_K_M here
    assert "Trees: the target verifies no drafted token exactly here" in render_markdown(results)
    results["config"]["tree_limit"] = {"max_nodes": 128, "chains_only": False}
    assert "Trees:" not in render_markdown(results)
    assert render_markdown(results).splitlines()[2].startswith("Target `t`, greedy")  # written before runtimes were
    results["config"].update(runtime="llama.cpp", dtype=None, threads=1)
    assert render_markdown(results).splitlines()[2].startswith("Target `t` on llama.cpp (1 thread), greedy")


def test_a_bench_scripts_json_appears_whole_or_not_at_all(tmp_path) -> None:
    from moaspec.bench.output import write_json

    path = tmp_path / "new" / "figures.json"
    assert write_json(path, {"a": [1, 2]}) == path and json.loads(path.read_text()) == {"a": [1, 2]}
    with pytest.raises(TypeError):  # not serialisable: the earlier file stays, nothing else is left
        write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": [1, 2]} and [p.name for p in path.parent.iterdir()] == ["figures.json"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--categories", "mt_bench,poetry"], "unknown category poetry"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--methods", "none,moa"], "no shipped 'moa' drafter"),
        (["--methods", "none,warp"], "unknown drafter 'warp'"),
        (["--methods", "ngram,ngram"], "names a method twice"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--max-new-tokens", "0"], "max-new-tokens must be >= 1"),
        (["--ignore-eos", "--client-server"], "--ignore-eos applies to the single-device bench"),
        (["--tree-depth", "0"], "--tree-depth must be in [1, 32], got 0"),
        (["--tree-budget", "100000"], "--tree-budget must be in [1, 256], got 100000"),
        # bug: ignored without a word when no method has a tree (generate refuses them there)
        (["--methods", "ngram", "--tree-depth", "3"], "--tree-* settings set the tree of model-drafter methods"),
        (["--out", ""], "--out is empty"),
        (["--client-server", "--network", ""], "--network is empty"),
        # bug: an empty item (a name left out) was dropped without a word
        (["--categories", "math,,qa"], "--categories has an empty item: 'math,,qa'"),
        (["--categories", "math,"], "--categories has an empty item"),
        (["--categories", " "], "--categories is empty"),
        (["--methods", "ngram,,moa"], "--methods has an empty item"),
        (["--methods", ""], "--methods is empty"),
    ],
)
def test_bad_flags_fail_with_one_line_before_loading(tmp_path, tiny_bench, monkeypatch, capsys, extra, message) -> None:
    import moaspec.api

    monkeypatch.setattr(moaspec.api, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    assert main(bench_args(tmp_path / "res", *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("moaspec: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("module, extra, message", [
    ("jsonschema", ["--no-plots"], "validating results.json needs jsonschema"),
    ("matplotlib", [], "plotting needs matplotlib"),
])
def test_a_missing_bench_extra_fails_before_loading(tmp_path, tiny_bench, monkeypatch, capsys, module, extra, message) -> None:
    """Bug: without jsonschema (the `bench` extra) the whole benchmark ran, then failed to write
    results.json, losing every measurement; --no-plots did not help."""
    import sys

    import moaspec.api

    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ImportError
    monkeypatch.setattr(moaspec.api, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    assert main(bench_args(tmp_path / "res", *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("moaspec: error: ") and message in err and "moaspec[bench]" in err and err.count("\n") == 1
    assert not (tmp_path / "res").exists()


def test_parse_methods_adds_the_baseline_and_labels_directories(tmp_path) -> None:
    assert parse_methods("ngram,hf") == (
        MethodSpec("none", "none"),
        MethodSpec("ngram", "ngram"),
        MethodSpec("hf", "hf"),
    )
    specs = parse_methods(f"none,mine={tmp_path}")
    assert specs[1] == MethodSpec("mine", str(tmp_path)) and specs[1].drafter == str(tmp_path)
    assert MethodSpec("x", "hf-pld").drafter is None
    with pytest.raises(MoaspecError, match="reserved"):
        parse_methods("none=ngram")
    lookup = parse_methods(f"moa+ngram,mine+={tmp_path}+ngram")
    assert lookup[1:] == (MethodSpec("moa+ngram", "moa+ngram"), MethodSpec("mine+", f"{tmp_path}+ngram"))
    check_available(lookup[:2], "smollm2-135m")  # the shipped moa checkpoint + lookup
    with pytest.raises(MoaspecError, match="has no config.json"):
        check_available(lookup, "smollm2-135m")


def test_reference_tree_methods_sit_beside_the_tuned_ones(tmp_path) -> None:
    """`moa@ref` is the same checkpoint drafting with the fixed reference tree, whatever --tree-*."""
    from moaspec.bench.methods import REFERENCE_TREE, drafter_tree

    specs = parse_methods(f"moa,moa@ref,mine={tmp_path}@ref")
    assert specs[1:] == (
        MethodSpec("moa", "moa"), MethodSpec("moa@ref", "moa", True), MethodSpec("mine", str(tmp_path), True)
    )
    assert specs[2].described == "moa@ref" and specs[1].described == "moa"
    given = {"depth": 2, "top_k": None, "budget": None}
    assert drafter_tree(specs[2], given) == REFERENCE_TREE == {"depth": 6, "top_k": 4, "budget": 16}
    assert drafter_tree(specs[1], given) == given and drafter_tree(MethodSpec("ngram", "ngram"), given) is None
    for bad in ("ngram@ref", "hf@ref", "default@ref"):
        with pytest.raises(MoaspecError, match="model drafters only"):
            parse_methods(bad)


def test_every_category_loads_with_enough_prompts() -> None:
    prompts = load_prompts(CATEGORIES, None)
    assert len(prompts["mt_bench"]) == 80 and all(len(p.turns) == 2 for p in prompts["mt_bench"])
    assert len(prompts["humaneval"]) == 164 and "def has_close_elements" in prompts["humaneval"][0].turns[0]
    assert len(prompts["qa"]) == 80
    for item in prompts["qa"]:  # the document opens the conversation, single-turn or not
        first = item.history[0]["content"] if item.history else item.turns[0]
        assert first.startswith("Answer the question using the document below.")
    for category in ("translation", "summarization", "math"):
        assert len(prompts[category]) >= 20
        assert len({p.prompt_id for p in prompts[category]}) == len(prompts[category])
    qa = prompts["qa"][3]
    assert [m["role"] for m in qa.history] == ["user", "assistant"] * (len(qa.history) // 2)
    count = len(prompts["math"])
    assert [p.prompt_id for p in load_prompts(("math",), 3)["math"]] == [
        prompts["math"][i].prompt_id for i in (0, count // 3, 2 * count // 3)
    ]  # evenly spaced


def test_limit_draws_from_every_mt_bench_subcategory() -> None:
    """Regression: `--limit 20` used to take MT-bench ids 81-100, writing and roleplay only."""
    twenty = load_prompts(("mt_bench",), 20)["mt_bench"]
    subcategories = [p.subcategory for p in twenty]
    assert set(subcategories) == {
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"
    }
    assert max(subcategories.count(name) for name in subcategories) == 3  # 20 = 8 + 8 + 4
    assert len({p.prompt_id for p in twenty}) == 20
    assert [p.prompt_id for p in load_prompts(("mt_bench",), None)["mt_bench"]][:2] == ["81", "82"]
    # a partial round is spread too (an audit, session 50: `--limit 2` took writing and roleplay,
    # the two highest-entropy sub-categories, and `--limit 20` the first four of its third round)
    assert [p.subcategory for p in load_prompts(("mt_bench",), 2)["mt_bench"]] == ["writing", "coding"]
    assert [p.subcategory for p in load_prompts(("mt_bench",), 3)["mt_bench"]] == ["writing", "reasoning", "extraction"]
    assert [p.subcategory for p in twenty[16:]] == ["writing", "reasoning", "coding", "stem"]


def test_default_methods_include_the_default_drafter() -> None:
    from moaspec.bench.methods import default_methods

    assert default_methods("smollm2-135m") == "none,hf,hf-pld,ngram,moa,moa-tli1,eagle,moa+ngram,default"
    assert default_methods("some-other-target") == "none,hf,hf-pld,ngram,default"


def test_schema_specs_are_json_schema_and_refuse_bools_for_numbers() -> None:
    """Issue 19 item 6: results.json is checked by jsonschema against a real JSON Schema (draft
    2020-12) generated from the compact specs; a bool is not a number there either, and the first
    wrong value is named. Deterministic: fixed documents."""
    from jsonschema import Draft202012Validator

    for spec in (schema.RESULTS_SCHEMA, schema.CLIENT_SERVER_SCHEMA):
        Draft202012Validator.check_schema(schema.json_schema(spec))
    with pytest.raises(ValueError, match=r"results.schema_version: expected int, got bool"):
        schema.validate({"schema_version": True})
    with pytest.raises(ValueError, match=r"results.config.networks.lan.rtt_s: expected int or float, got str"):
        schema.validate({"config": {"networks": {"lan": {"rtt_s": "fast"}}}}, schema.CLIENT_SERVER_SCHEMA)



def test_committed_results_follow_the_schema_of_their_kind_and_version() -> None:
    """An audit (session 50): the committed client-server results.json (version 1) failed its own
    schema version, the disconnection scores having been made required without a new version.
    The client-server kind is at version 2 now, and every committed `moaspec bench` document is
    checked against the schema of its kind and version; one of another version is refused."""
    import json
    from pathlib import Path

    results_dir = Path(__file__).resolve().parents[1] / "bench" / "results"
    documents = [json.loads(path.read_text()) for path in sorted(results_dir.rglob("results.json"))]
    written = [doc for doc in documents if isinstance(doc, dict) and "schema_version" in doc]
    assert {doc.get("kind") for doc in written} == {None, "client_server"}
    for doc in written:
        schema.validate(doc, schema.schema_of(doc))
    old = next(doc for doc in written if doc.get("kind") == "client_server" and doc["schema_version"] == 1)
    assert schema.schema_of(old) is schema.CLIENT_SERVER_SCHEMA_V1
    with pytest.raises(ValueError, match=r"results.disconnection\[0\]: missing key 'first_token_agreement'"):
        schema.validate(old, schema.schema_of({**old, "schema_version": schema.CLIENT_SERVER_SCHEMA_VERSION}))
    for version in (0, 3, True, "2"):
        with pytest.raises(ValueError, match="results.schema_version: .* is not one of"):
            schema.schema_of({**old, "schema_version": version})

def test_results_name_the_cpu_as_the_calibration_does() -> None:
    """Speed depends on the CPU (the machines of this project differ): results.json's machine names
    /proc/cpuinfo's model and the kernel-relevant flags, not just the architecture."""
    from moaspec.bench.machine import machine_info
    from moaspec.calibration.machine import cpu_description

    machine = machine_info()
    assert machine["cpu"] == cpu_description() and machine["description"].startswith(cpu_description() + ", ")


class SlowedOnce:
    """`none`, whose generation on the second prompt reports steps 50x as slow (a busy machine)."""

    def __init__(self, inner) -> None:
        self.inner, self.label, self.lossless, self.calls = inner, inner.label, inner.lossless, 0

    def run(self, prompt_ids, sampling, max_new_tokens, seed) -> MethodRun:
        run = self.inner.run(prompt_ids, sampling, max_new_tokens, seed)
        self.calls += 1
        if self.calls == 3:  # the warm-up, the first prompt, then this one
            slower = 49 * (run.stats.draft_s + run.stats.verify_s)
            run.stats.verify_s += slower
            run.wall_s += slower
        return run


def test_a_baseline_slowed_by_a_busy_machine_is_reported(tmp_path, tiny_bench, monkeypatch, capsys) -> None:
    """An audit got 173x speedups from a run beside other work, printed without a word: the
    baseline's generation whose steps ran far from its median is listed and warned about."""
    from moaspec.bench import methods

    real_build = methods.build_method
    monkeypatch.setattr(
        methods, "build_method",
        lambda spec, target, *rest: SlowedOnce(real_build(spec, target, *rest)) if spec.label == "none" else real_build(spec, target, *rest),
    )
    out = tmp_path / "res"
    code = main(bench_args(out, "--categories", "translation,math", "--methods", "none,ngram", "--no-plots", "--max-new-tokens", "12"))
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    slowed = [item for item in results["irregular_timings"] if item["step_ms"] > 10 * item["median_step_ms"]]
    assert [(item["category"], item["turn"]) for item in slowed] == [("translation", 1)]
    assert slowed[0]["prompt_id"] == results["runs"][2]["prompt_id"]
    assert "**Timings:**" in (out / "results.md").read_text()
    assert "moaspec: warning: " in capsys.readouterr().err


def timed_record(method: str, step_s: float, steps: int = 10, split: bool = True):
    from moaspec.bench.runner import RunRecord
    from moaspec.metrics import SpecStats

    stats = SpecStats(num_verifications=steps, verify_s=step_s * steps * 0.9, draft_s=step_s * steps * 0.1)
    return RunRecord("qa", f"p{step_s}", 1, method, MethodRun([1] * steps, 1.0, stats, split), 0, 0)


def test_irregular_steps_flags_only_generations_far_from_the_median() -> None:
    from moaspec.bench.timing_check import irregular_steps, irregular_timing_line

    regular = [timed_record("none", step) for step in (0.010, 0.012, 0.011, 0.025, 0.005)]  # within 3x of 0.011
    assert irregular_steps(regular, "none") == [] and irregular_timing_line([], "none") is None
    records = [*regular, timed_record("none", 0.050), timed_record("none", 0.003), timed_record("ngram", 0.5)]
    records += [timed_record("none", 0.9, steps=3), timed_record("none", 0.9, split=False)]  # too short / not timed: not judged
    flagged = irregular_steps(records, "none")
    assert [item["step_ms"] for item in flagged] == [50.0, 3.0]
    assert {item["median_step_ms"] for item in flagged} == {11.0}
    line = irregular_timing_line(flagged, "none")
    assert line.startswith("2 `none` generations ran steps over 3x off") and "qa/p0.05 turn 1: 50.0 ms against 11.0 ms" in line


def test_irregular_steps_at_its_edges() -> None:
    """MIN_STEPS steps are judged and fewer are not; two generations suffice to compare; the
    warning names the generation furthest off either way; zero-second steps flag nothing."""
    from moaspec.bench.timing_check import MIN_STEPS, irregular_steps, irregular_timing_line

    assert [item["step_ms"] for item in irregular_steps([timed_record("none", 0.01, steps=MIN_STEPS), timed_record("none", 0.01), timed_record("none", 0.01),
                                                         timed_record("none", 0.1, steps=MIN_STEPS)], "none")] == [100.0]
    assert irregular_steps([timed_record("none", 0.01), timed_record("none", 0.01), timed_record("none", 0.1, steps=MIN_STEPS - 1)], "none") == []
    pair = irregular_steps([timed_record("none", 0.01), timed_record("none", 0.1)], "none")
    assert [item["step_ms"] for item in pair] == [10.0]  # median 55 ms: 10 ms is over 3x off, 100 ms not
    fast_and_slow = [timed_record("none", step) for step in (0.010, 0.010, 0.010, 0.041, 0.001)]
    line = irregular_timing_line(irregular_steps(fast_and_slow, "none"), "none")
    assert "worst qa/p0.001 turn 1: 1.0 ms against 10.0 ms" in line  # 10x too fast beats 4.1x too slow
    assert irregular_steps([timed_record("none", 0.0) for _ in range(3)], "none") == []
