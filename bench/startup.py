"""Start-up of `moaspec generate` as a user meets it: seconds from launching the console script to
the first byte of generated text on stdout, to the process's exit, and its peak RSS, for several
drafter choices run in interleaved rounds (warm caches: one untimed run first, which also writes
moaspec's compiled bytecode as a user's installation holds it; PYTHONDONTWRITEBYTECODE, set on some
machines, is left out of the runs' environment, since it makes every start compile ~70 modules).

    .venv/bin/python bench/startup.py --out bench/results/startup.json
    .venv/bin/python bench/startup.py --bench-prompt summarization --max-new-tokens 32 \
        --cases default llama.cpp-prefill      # a long prompt: the float prefill against llama.cpp's

Run it on an idle machine: every process competes for the same cores. Prints a markdown table.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moaspec.bench.prompts import CATEGORIES, load_prompts
from moaspec.bench.script_args import output_file, run_script, script_parser

PROMPT = "Name three colours."
CASES = {  # label -> extra arguments of `moaspec generate`
    "default": [],
    "none": ["--drafter", "none"],
    "ngram": ["--drafter", "ngram"],
    # a model drafter, as the calibration chooses on CPUs where it pays (--cases picks; not run by default)
    "moa+ngram": ["--drafter", "moa+ngram"],
    "moa+ngram-built-first": ["--drafter", "moa+ngram"],
    "eagle": ["--drafter", "eagle"],
    "eagle-built-first": ["--drafter", "eagle"],
    "llama.cpp-prefill": [],  # the default, every prompt prefilled by llama.cpp (no torch on that path)
}
CASE_ENV = {  # label -> environment variables of its runs
    # on llama.cpp a shipped model drafter is built in the background (drafters/background.py); these build it first
    "moa+ngram-built-first": {"MOASPEC_NO_BACKGROUND_DRAFTER": "1"},
    "eagle-built-first": {"MOASPEC_NO_BACKGROUND_DRAFTER": "1"},
    "llama.cpp-prefill": {"MOASPEC_LLAMA_PREFILL": "llama.cpp"},
}
DEFAULT_CASES = ("default", "none", "ngram")
RUN_ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


def run_once(moaspec: str, case: str, max_new_tokens: int, prompt: str = PROMPT) -> dict[str, float]:
    """One `moaspec generate` of `case`: {first_byte_s, exit_s, peak_rss_mb}; raises when it fails."""
    command = [moaspec, "generate", "--prompt", prompt, "--max-new-tokens", str(max_new_tokens), *CASES[case]]
    with tempfile.TemporaryFile() as err:  # a file, not a pipe: stderr can never block the child
        begin = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, env={**RUN_ENV, **CASE_ENV.get(case, {})})
        first = os.read(proc.stdout.fileno(), 1)
        first_byte = time.perf_counter() - begin
        rest = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        exit_s = time.perf_counter() - begin
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0 or not (first + rest).strip():
            err.seek(0)
            raise SystemExit(f"startup: {' '.join(command)} failed ({proc.returncode}): {err.read().decode().strip()[-300:]}")
    return {"first_byte_s": first_byte, "exit_s": exit_s, "peak_rss_mb": usage.ru_maxrss / 1024}


def main() -> int:
    parser = script_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds over the cases (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="tokens generated per run (default 8)")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES))
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompt", default=PROMPT, help=f"the prompt (default {PROMPT!r})")
    prompts.add_argument("--bench-prompt", metavar="CATEGORY", choices=list(CATEGORIES),
                         help="the first prompt of this benchmark category instead (e.g. summarization: 149 tokens)")
    parser.add_argument("--out", type=output_file, default=None, help="write the results here as JSON")
    args = parser.parse_args()
    if args.rounds < 1 or args.max_new_tokens < 1:
        parser.error("--rounds and --max-new-tokens must be >= 1")
    moaspec = shutil.which("moaspec", path=str(Path(sys.executable).parent)) or shutil.which("moaspec")
    if moaspec is None:
        parser.error("no `moaspec` console script beside this Python or on PATH")

    from moaspec.bench.output import write_json
    from moaspec.calibration.machine import cpu_description

    prompt = args.prompt if args.bench_prompt is None else load_prompts((args.bench_prompt,), 1)[args.bench_prompt][0].turns[0]
    for case in dict.fromkeys(args.cases):  # warm the page cache and each setting's saved choices
        run_once(moaspec, case, args.max_new_tokens, prompt)
    samples: dict[str, list[dict[str, float]]] = {case: [] for case in args.cases}
    for round_index in range(args.rounds):
        for case in args.cases:
            samples[case].append(run_once(moaspec, case, args.max_new_tokens, prompt))
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    fields = ("first_byte_s", "exit_s", "peak_rss_mb")
    summary = {
        case: {
            field: {"median": round(statistics.median(s[field] for s in runs), 3),
                    "min": round(min(s[field] for s in runs), 3), "max": round(max(s[field] for s in runs), 3)}
            for field in fields
        }
        for case, runs in samples.items()
    }
    result = {
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "cpu": cpu_description(),
        "moaspec": moaspec,
        "prompt": prompt,
        "max_new_tokens": args.max_new_tokens,
        "cases": {case: CASES[case] for case in args.cases},
        "case_env": {case: CASE_ENV[case] for case in args.cases if case in CASE_ENV},
        "summary": summary,
        "runs": samples,
    }
    lines = ["| drafter | first token (s), median [min-max] | exit (s) | peak RSS (MB) |", "|---|---|---|---:|"]
    for case, per in summary.items():
        first, done, rss = (per[f] for f in fields)
        lines.append(
            f"| {case} | {first['median']:.2f} [{first['min']:.2f}-{first['max']:.2f}] | "
            f"{done['median']:.2f} [{done['min']:.2f}-{done['max']:.2f}] | {rss['max']:.0f} |"
        )
    print("\n".join(lines))
    if args.out is not None:
        write_json(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    run_script(main)
