"""Turn benchmark records into `results.json` (a dict, see schema.py) and `results.md`.

Aggregation, per category and method (all generations of that pair pooled):
- tokens_per_s = new tokens / wall seconds (wall around each whole call, prefill included);
- speedup = tokens_per_s / the baseline's tokens_per_s in the same category and run;
- tau = tokens produced per target forward (bonus and prefill included, metrics.py), pooled;
- acceptance_per_depth: among verifications whose tree reached depth d, the share accepting >= d;
- time_s: prefill / draft / verify / other (engine methods; null for transformers methods);
- peak_rss_mb / rss_growth_mb: the largest values over the pair's generations (memory.py).
The summary row of a method is the unweighted mean over categories of speedup, tau and tokens/s
(so a category with long answers does not dominate), plus the per-category values.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict

from moaspec.bench.methods import OWN_GENERATION_METHODS
from moaspec.bench.runner import BASELINE, BenchData, RunRecord
from moaspec.bench.timing_check import irregular_steps, irregular_timing_line
from moaspec.metrics import SpecStats

SCHEMA_VERSION = 1
MB = 1 << 20


def merge_stats(stats: list[SpecStats]) -> SpecStats:
    """Pool several generations' counters and times into one SpecStats."""
    merged = SpecStats()
    for item in stats:
        for name in ("new_tokens", "target_forwards", "forward_tokens", "num_verifications", "drafted_nodes"):
            setattr(merged, name, getattr(merged, name) + getattr(item, name))
        for name in ("prefill_s", "draft_s", "verify_s", "wall_s"):
            setattr(merged, name, getattr(merged, name) + getattr(item, name))
        for name in ("reached_depth", "accepted_depth"):
            total, extra = getattr(merged, name), getattr(item, name)
            total.extend([0] * (len(extra) - len(total)))
            for d, count in enumerate(extra):
                total[d] += count
    return merged


def category_row(records: list[RunRecord]) -> dict:
    """One method's aggregate over one category (speedup filled in by the caller)."""
    stats = merge_stats([record.run.stats for record in records])
    wall = sum(record.run.wall_s for record in records)
    timed = all(record.run.has_time_split for record in records)
    time_s = None
    if timed:
        inner = stats.prefill_s + stats.draft_s + stats.verify_s
        time_s = {
            "prefill": stats.prefill_s,
            "draft": stats.draft_s,
            "verify": stats.verify_s,
            "other": max(0.0, wall - inner),
        }
        time_s = {key: round(value, 4) for key, value in time_s.items()}
    return {
        "method": records[0].method,
        "num_generations": len(records),
        "new_tokens": stats.new_tokens,
        "wall_s": round(wall, 4),
        "tokens_per_s": round(stats.new_tokens / wall, 3) if wall > 0 else 0.0,
        "speedup": None,
        "tau": round(stats.tau, 4),
        "target_forwards": stats.target_forwards,
        "acceptance_per_depth": [round(a, 4) for a in stats.acceptance_per_depth],
        "time_s": time_s,
        "peak_rss_mb": round(max(record.peak_rss for record in records) / MB, 1),
        "rss_growth_mb": round(max(record.rss_growth for record in records) / MB, 1),
    }


def build_results(data: BenchData, methods: list[str], config: dict, machine: dict, command: str, created: str) -> dict:
    """The results.json document."""
    by_pair: dict[tuple[str, str], list[RunRecord]] = defaultdict(list)
    for record in data.records:
        by_pair[(record.category, record.method)].append(record)
    categories = []
    for category in config["categories"]:
        records = [r for r in data.records if r.category == category]
        if not records:
            continue
        rows = [category_row(by_pair[(category, method)]) for method in methods]
        base = next(row for row in rows if row["method"] == BASELINE)["tokens_per_s"]
        for row in rows:
            row["speedup"] = round(row["tokens_per_s"] / base, 4) if base > 0 else 0.0
        prompts = {r.prompt_id for r in records}
        categories.append(
            {
                "category": category,
                "num_prompts": len(prompts),
                "num_generations": len(records) // len(methods),
                "rows": rows,
            }
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "created": created,
        "command": command,
        "machine": machine,
        "config": config,
        "summary": [_summary_row(method, categories, data) for method in methods],
        "categories": categories,
        "mismatches": [asdict(mismatch) for mismatch in data.mismatches],
        # other programs' greedy outputs (llama-cpp-python's) against our plain decoding: not checked
        "agreement": [{**asdict(m), "identical": m.identical} for m in data.agreement],
        "skipped": list(data.skipped),
        # the baseline's generations whose steps ran far from its median step (timing_check.py)
        "irregular_timings": irregular_steps(data.records, BASELINE),
        "runs": [_run_row(record) for record in data.records],
    }


def _identical_share(method: str, data: BenchData) -> float | None:
    """For a method whose output is compared, not checked (another program): the share of its
    greedy generations identical to plain decoding's; None for the others."""
    compared = [m for m in data.agreement if m.method == method]
    return round(sum(m.identical for m in compared) / len(compared), 4) if compared else None


def _summary_row(method: str, categories: list[dict], data: BenchData) -> dict:
    rows = {c["category"]: next(r for r in c["rows"] if r["method"] == method) for c in categories}
    pooled = merge_stats([record.run.stats for record in data.records if record.method == method])

    def mean(key: str) -> float:
        return round(sum(row[key] for row in rows.values()) / len(rows), 4) if rows else 0.0

    return {
        "method": method,
        "speedup": mean("speedup"),
        "tau": mean("tau"),
        "tokens_per_s": mean("tokens_per_s"),
        "acceptance_per_depth": [round(a, 4) for a in pooled.acceptance_per_depth],
        "peak_rss_mb": max((row["peak_rss_mb"] for row in rows.values()), default=0.0),
        "num_mismatches": sum(1 for m in data.mismatches if m.method == method),
        "identical_to_none": _identical_share(method, data),
        "per_category": {
            category: {key: row[key] for key in ("speedup", "tau", "tokens_per_s")} for category, row in rows.items()
        },
    }


def _run_row(record: RunRecord) -> dict:
    run = record.run
    return {
        "category": record.category,
        "prompt_id": record.prompt_id,
        "turn": record.turn,
        "method": record.method,
        "new_tokens": len(run.token_ids),
        "wall_s": round(run.wall_s, 4),
        "tokens_per_s": round(len(run.token_ids) / run.wall_s, 3) if run.wall_s > 0 else 0.0,
        "tau": round(run.stats.tau, 4),
        "target_forwards": run.stats.target_forwards,
        "peak_rss_mb": round(record.peak_rss / MB, 1),
        "rss_growth_mb": round(record.rss_growth / MB, 1),
    }


# -- markdown -----------------------------------------------------------------------------------
def _calibration_lines(calibration: dict | None) -> list[str]:
    """What the machine calibration chose for the `default` method (none when it was off)."""
    if not calibration:
        return []
    parts = [f"drafter `{calibration['drafter']}`", f"{calibration['layout']}-major weights"]
    if calibration.get("tree"):
        tree = calibration["tree"]
        parts.append(f"tree depth {tree['depth']} / top-k {tree['top_k']} / budget {tree['budget']}")
    if calibration.get("lookup"):
        lookup = calibration["lookup"]
        shortest = f"{lookup['min_ngram']}+-grams, " if "min_ngram" in lookup else ""
        parts.append(f"lookup {shortest}{lookup['max_depth']} deep x {lookup['max_branches']}")
    speedup = calibration.get("predicted_speedup")
    predicted = f", predicted {speedup:.2f}x `none`" if speedup else ""
    return [f"Calibration (`default`, CPU {calibration['cpu']}): {', '.join(parts)}{predicted}."]


def _tree_limit_lines(limit: dict | None) -> list[str]:
    """Where the target verifies only short chains here, every method's trees were cut to them;
    where none, no drafts were verified."""
    if not limit or not limit.get("chains_only"):
        return []
    why = "(llama.cpp's batched kernels for this GGUF)"
    if limit["max_nodes"] == 1:
        return [f"Trees: the target verifies no drafted token exactly here {why}: `default` decoded plainly."]
    return [f"Trees: the target verifies chains of at most {limit['max_nodes']} nodes exactly here {why}; "
            "every method's drafts were cut to that."]


def render_markdown(results: dict) -> str:
    config = results["config"]
    decoding = decoding_phrase(config["temperature"])
    lines = [
        "# moaspec bench",
        "",
        (
            f"Target `{config['target']}`{_runtime_phrase(config)}, {decoding}, {_length_phrase(config)}, "
            f"seed {config['seed']}; methods interleaved prompt by prompt, warm-up excluded."
        ),
        f"Machine: {results['machine']['description']}. Command: `{results['command']}`.",
        *_calibration_lines(config.get("calibration")),
        *_tree_limit_lines(config.get("tree_limit")),
        "",
    ]
    for category in results["categories"]:
        count, generations = category["num_prompts"], category["num_generations"]
        lines += [
            f"## {category['category']} ({count} prompt{'s' * (count != 1)}, "
            f"{generations} generation{'s' * (generations != 1)} per method)",
            "",
        ]
        lines += _category_table(category["rows"])
    lines += ["## Mean over categories", "", *_summary_table(results), *_fastest_lines(results)]
    irregular = timing_warning(results)
    if irregular:
        lines += [f"**Timings:** {irregular}", ""]
    for reference in OWN_GENERATION_METHODS:
        lines += _relative_table(results, reference)
    lines += ["## Greedy check", ""]
    if config["temperature"] != 0:
        lines.append("Sampled run: outputs are not compared (only the distribution is preserved).")
    elif not results["mismatches"]:
        external = sorted({m["method"] for m in results.get("agreement", [])})
        scope = f" (other programs, compared below: {', '.join(external)})" if external else ""
        lines.append(f"Every method of our engine gives `{BASELINE}`'s tokens on every prompt{scope}.")
    else:
        lines.append(f"**{len(results['mismatches'])} MISMATCHES** (a lossless method changed the output):")
        lines += [
            f"- {m['method']}: {m['category']}/{m['prompt_id']} turn {m['turn']}, first divergence at new token {m['first_divergence']}"
            for m in results["mismatches"]
        ]
    for method in sorted({m["method"] for m in results.get("agreement", [])}):
        compared = [m for m in results["agreement"] if m["method"] == method]
        same = sum(m["identical"] for m in compared)
        agreeing = sum(m["first_divergence"] for m in compared) / max(1, sum(m["baseline_tokens"] for m in compared))
        lines.append(
            f"- `{method}` (another program, numerics of its own): {same}/{len(compared)} generations identical to "
            f"`{BASELINE}`'s; {agreeing:.0%} of `{BASELINE}`'s tokens before the first divergence."
        )
    if results["skipped"]:
        lines += ["", f"Skipped (prompt longer than the context): {', '.join(results['skipped'])}"]
    return "\n".join(lines) + "\n"


def timing_warning(results: dict) -> str | None:
    """The sentence on the baseline's irregular steps, or None (also for results written before
    they were checked)."""
    return irregular_timing_line(results.get("irregular_timings", []), BASELINE)


def _runtime_phrase(config: dict) -> str:
    """' on llama.cpp (2 threads)' / ' on transformers (float32)'; nothing for results written
    before the runtime was recorded."""
    runtime = config.get("runtime")
    if runtime is None:
        return ""
    setting = threads_phrase(config.get("threads")) or config.get("dtype")
    return f" on {runtime}" + (f" ({setting})" if setting else "")


def threads_phrase(threads: int | None) -> str:
    """'2 threads' / '1 thread' (llama.cpp's, config.threads), '' when not recorded."""
    return f"{threads} thread{'s' * (threads != 1)}" if threads else ""


def _length_phrase(config: dict) -> str:
    if config.get("ignore_eos"):
        return f"{config['max_new_tokens']} new tokens per answer (stop tokens ignored: --ignore-eos)"
    return f"at most {config['max_new_tokens']} new tokens"


def decoding_phrase(temperature: float) -> str:
    return "greedy" if temperature == 0 else f"temperature {temperature}"


def _category_table(rows: list[dict]) -> list[str]:
    header = "| method | tokens/s | speedup | τ | acceptance by depth | prefill / draft / verify / other | peak RSS MB | RSS growth MB |"
    out = [header, "|---|---:|---:|---:|---|---|---:|---:|"]
    for row in rows:
        acceptance = " / ".join(f"{a:.2f}" for a in row["acceptance_per_depth"]) or "–"
        split = "–"
        if row["time_s"] is not None and row["wall_s"] > 0:
            t = row["time_s"]
            split = " / ".join(
                f"{100 * t[key] / row['wall_s']:.0f}%" for key in ("prefill", "draft", "verify", "other")
            )
        out.append(
            f"| {row['method']} | {row['tokens_per_s']:.2f} | {row['speedup']:.2f}× | {row['tau']:.2f} | {acceptance} "
            f"| {split} | {row['peak_rss_mb']:.0f} | {row['rss_growth_mb']:.1f} |"
        )
    return [*out, ""]


def _fastest_lines(results: dict) -> list[str]:
    """The fastest method of each category, by tokens/s."""
    parts = []
    for category in (c["category"] for c in results["categories"]):
        best = max(results["summary"], key=lambda row: row["per_category"][category]["tokens_per_s"])
        parts.append(f"{category} `{best['method']}` ({best['per_category'][category]['speedup']:.2f}×)")
    return [f"Fastest per category (speedup over `{BASELINE}`): {', '.join(parts)}.", ""] if parts else []


def _relative_table(results: dict, reference: str) -> list[str]:
    """Every method's tokens/s over `reference`'s per category, and their mean, where the run has
    that method (a runtime's own generation: the speed a user gets without moaspec)."""
    rows = {row["method"]: row for row in results["summary"]}
    if reference not in rows:
        return []
    categories = [c["category"] for c in results["categories"]]
    base = rows[reference]["per_category"]
    out = [
        f"## Relative to `{reference}`",
        "",
        f"Tokens/s over `{reference}`'s in each category; the mean is the mean of those ratios.",
        "",
        "| method | mean | " + " | ".join(categories) + " |",
        "|---|---:|" + "---:|" * len(categories),
    ]
    for row in results["summary"]:
        ratios = [
            row["per_category"][c]["tokens_per_s"] / base[c]["tokens_per_s"] if base[c]["tokens_per_s"] > 0 else 0.0
            for c in categories
        ]
        mean = sum(ratios) / len(ratios) if ratios else 0.0
        out.append(f"| {row['method']} | {mean:.2f}× | " + " | ".join(f"{r:.2f}×" for r in ratios) + " |")
    return [*out, ""]


def _summary_table(results: dict) -> list[str]:
    categories = [c["category"] for c in results["categories"]]
    out = [
        "| method | mean speedup | mean τ | mean tokens/s | " + " | ".join(categories) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(categories),
    ]
    for row in results["summary"]:
        per = " | ".join(f"{row['per_category'][c]['speedup']:.2f}×" for c in categories)
        out.append(
            f"| {row['method']} | {row['speedup']:.2f}× | {row['tau']:.2f} | {row['tokens_per_s']:.2f} | {per} |"
        )
    return [*out, ""]
