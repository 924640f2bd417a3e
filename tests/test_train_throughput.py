"""bench/train_throughput.py: `moaspec train` runs at each micro-batch size, interleaved by round,
the first step of each left out of the medians."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_bench_script


def test_runs_are_interleaved_and_the_warm_up_step_is_left_out(tmp_path, monkeypatch, capsys) -> None:
    script = load_bench_script("train_throughput")
    calls = []

    def fake_train(command: list[str]) -> int:
        size = int(command[command.index("--micro-batch") + 1])
        calls.append((size, command))
        out = Path(command[command.index("--out") + 1])
        out.mkdir(parents=True)
        history = [{"tokens_per_s": 1.0}, *({"tokens_per_s": 100.0 * size + step} for step in range(3))]
        torch.save({"history": history}, out / "train_state.pt")
        return 0

    monkeypatch.setattr(script, "moaspec_main", fake_train)
    out = tmp_path / "throughput.json"
    flags = ["--method", "moa", "--data", "d", "--batch-size", "8"]
    assert script.main(["--micro-batches", "1,4", "--steps", "4", "--rounds", "2", "--out", str(out), "--", *flags]) == 0
    assert [size for size, _ in calls] == [1, 4, 1, 4]
    assert all(command[:7] == ["train", *flags] and "--steps" in command for _, command in calls)
    results = json.loads(out.read_text())
    assert results["micro_batches"]["1"]["median"] == 101.0 and results["micro_batches"]["4"]["median"] == 401.0
    assert len(results["micro_batches"]["4"]["tokens_per_s"]) == 6  # 3 counted steps x 2 rounds
    assert "| 4 | 401 | 3.97× |" in capsys.readouterr().out


def test_the_profile_holds_the_operators_the_runs_issued(tmp_path, monkeypatch) -> None:
    script = load_bench_script("train_throughput")

    def fake_train(command: list[str]) -> int:
        torch.linalg.matrix_exp(torch.eye(4))  # an operator the profile must name
        out = Path(command[command.index("--out") + 1])
        out.mkdir(parents=True)
        torch.save({"history": [{"tokens_per_s": 1.0}, {"tokens_per_s": 2.0}]}, out / "train_state.pt")
        return 0

    monkeypatch.setattr(script, "moaspec_main", fake_train)
    profile = tmp_path / "profile.txt"
    argv = ["--micro-batches", "2", "--steps", "2", "--rounds", "1", "--profile", str(profile), "--", "--method", "eagle"]
    assert script.main(argv) == 0
    text = profile.read_text()
    assert text.startswith("moaspec train --method eagle; --micro-batch 2") and "aten::linalg_matrix_exp" in text


@pytest.mark.parametrize(
    "argv",
    [["--micro-batches", "0,4", "--", "--method", "moa"], ["--", "--method", "moa", "--out", "x"], ["--micro-batches", "a"], []],
)
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    script = load_bench_script("train_throughput")
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 2
