"""`scripts/recipe` end to end at toy size: distill with the real SmolLM2, train a MoA drafter,
tune its tree (dry run: the user's cache is left alone), and a rerun resumes (nothing is
retrained). Marked slow (a minute or two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TUNE_ARGS = "--dry-run --repeats 1 --calibration-prompts 1 --calibration-tokens 8"
TRAIN_ARGS = ("--val-conversations", "1", "--val-every", "2", "--ckpt-every", "2", "--batch-size", "2")


def _recipe(out: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONVERSATIONS="3", STEPS="2", TUNE_ARGS=TUNE_ARGS)
    return subprocess.run(
        [str(ROOT / "scripts" / "recipe"), str(out), *TRAIN_ARGS],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def test_recipe_distills_trains_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "recipe"
    first = _recipe(out)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Traceback" not in first.stderr
    assert f"## {out / 'drafter' / 'checkpoint'}:" in first.stdout  # tune's table of trees
    assert "done in " in first.stdout and str(out / "drafter" / "checkpoint") in first.stdout
    records = [line for shard in sorted((out / "data").glob("*.jsonl")) for line in shard.read_text().splitlines()]
    assert len(records) == 3
    config = json.loads((out / "drafter" / "checkpoint" / "config.json").read_text())
    assert config["method"] == "moa"
    assert config["training"]["step"] == 2
    assert (out / "drafter" / "checkpoint" / "model.safetensors").stat().st_size > 0
    weights = (out / "drafter" / "checkpoint" / "model.safetensors").read_bytes()

    second = _recipe(out)
    assert second.returncode == 0, second.stderr[-2000:]
    assert (out / "drafter" / "checkpoint" / "model.safetensors").read_bytes() == weights


def test_recipe_needs_an_output_directory() -> None:
    proc = subprocess.run([str(ROOT / "scripts" / "recipe")], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "usage: scripts/recipe OUT_DIR" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--bogus-flag"], {}, "unrecognized arguments: --bogus-flag"),
        (["--steps", "x"], {}, "argument --steps: invalid int value"),
        ([], {"TUNE_ARGS": "--no-such-tune-flag"}, "unrecognized arguments: --no-such-tune-flag"),
        # bug (a user's audit): values were checked only after the distillation
        ([], {"STEPS": "0"}, "--steps must be >= 1"),
        (["--lr", "-1"], {}, "--lr must be > 0, got -1"),
        (["--device", "cuda:7"], {}, "--device cuda:7"),
        ([], {"TUNE_ARGS": "--repeats 0"}, "--repeats must be >= 1, got 0"),
    ],
)
def test_recipe_checks_the_flags_it_passes_on_before_distilling(tmp_path: Path, argv, env, message) -> None:
    """Bug: a bad train or tune flag failed only after the distillation (half an hour by default)."""
    out = tmp_path / "recipe"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "recipe"), str(out), *argv], capture_output=True, text=True, timeout=600,
        env=dict(os.environ, **env),
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()  # nothing distilled, nothing written


@pytest.mark.parametrize("script", ["recipe", "campaign", "gpu_campaign"])
def test_scripts_print_what_they_do_for_help(script: str) -> None:
    proc = subprocess.run([str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and f"scripts/{script}" in proc.stdout and len(proc.stdout.splitlines()) > 5


def test_gpu_campaign_refuses_an_unknown_run_before_writing(tmp_path) -> None:
    out = tmp_path / "runs"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_campaign"), "300", str(out)], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, RUNS="moa bogus"),
    )
    assert proc.returncode == 2 and "RUNS names 'bogus'; the runs are moa, moa-wide and eagle" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("steps", ["0", "12x", "-5"])
def test_gpu_campaign_refuses_a_bad_step_count_before_writing(tmp_path, steps: str) -> None:
    out = tmp_path / "runs"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_campaign"), "300", str(out)], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, STEPS=steps),
    )
    assert proc.returncode == 2 and f"STEPS must be a positive whole number, not '{steps}'" in proc.stderr
    assert not out.exists()


def fake_trainer(tmp_path: Path, steps_done: str = "$steps") -> tuple[Path, Path]:
    """A stand-in `moaspec` that records its arguments and saves a checkpoint whose config says it
    trained `steps_done` steps (default: the --steps asked for). -> (it, the file of its calls)."""
    calls = tmp_path / "calls.txt"
    fake_moaspec = tmp_path / "moaspec"
    fake_moaspec.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$@" >> {calls}\n'
        'while [ $# -gt 0 ]; do case $1 in --out) out=$2;; --steps) steps=$2;; esac; shift; done\n'
        f'mkdir -p "$out/checkpoint" && echo "{{\\"training\\": {{\\"step\\": {steps_done}}}}}" > "$out/checkpoint/config.json"\n'
    )
    fake_moaspec.chmod(0o755)
    return fake_moaspec, calls


def run_gpu_campaign_steps(tmp_path: Path, fake_moaspec: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(ROOT / "scripts" / "gpu_campaign"), "300", str(tmp_path / "runs")], capture_output=True, text=True,
        timeout=60, env=dict(os.environ, STEPS="602", RUNS="eagle moa", MOASPEC=str(fake_moaspec),
                             PYTHON=sys.executable, DATA="data/x", DEVICE="cpu", INIT_EAGLE="ck/e", INIT_MOA="ck/m"),
    )


def test_gpu_campaign_with_steps_fails_when_the_time_box_cut_a_run_short(tmp_path) -> None:
    """Bug (a review of the GPU procedure): a STEPS pass stopped by the time box saved fewer steps
    and the campaign still succeeded, so an 'equal steps' comparison could silently be unequal."""
    fake_moaspec, _ = fake_trainer(tmp_path, steps_done="400")
    proc = run_gpu_campaign_steps(tmp_path, fake_moaspec)
    assert proc.returncode == 1
    assert "STEPS=602 not reached (the time box stopped them): eagle at step 400; moa at step 400" in proc.stderr


def test_gpu_campaign_with_steps_trains_each_run_that_many_steps_without_a_probe(tmp_path) -> None:
    fake_moaspec, calls = fake_trainer(tmp_path)
    proc = run_gpu_campaign_steps(tmp_path, fake_moaspec)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(calls.read_text().splitlines())
    assert len(lines) == 2 and not any("probe" in line for line in lines)
    for line, method, start in zip(lines, ["eagle", "moa"], ["ck/e", "ck/m"]):
        argv = line.split()
        assert argv[argv.index("--method") + 1] == method and argv[argv.index("--init-from") + 1] == start
        assert argv[argv.index("--steps") + 1] == "602" and argv[argv.index("--val-every") + 1] == "602"
