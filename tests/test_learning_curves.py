"""bench/learning_curves.py: curves from a run's validation history, and --merge keeping the runs
of earlier machines."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import load_bench_script


def fake_run(directory: Path, method: str, accuracy: float) -> Path:
    directory.mkdir(parents=True)
    history = [{"step": 1, "loss": 2.0}, {"step": 50, "val_loss": 1.5, "val_tau": 2.0,
               **{f"acc_depth{d}": accuracy + d / 8 for d in range(1, 5)}}]
    torch.save({"config": {"method": method}, "history": history}, directory / "train_state.pt")
    return directory


def test_moa_draft_depth_is_the_trainers_next_depth_and_merge_keeps_other_runs(tmp_path, monkeypatch) -> None:
    script = load_bench_script("learning_curves")
    monkeypatch.setattr(script, "plot", lambda curves, path: path.write_bytes(b"png"))
    moa = script.run_curve(fake_run(tmp_path / "runs" / "moa-a", "moa", 0.4))
    eagle = script.run_curve(fake_run(tmp_path / "runs" / "eagle-a", "eagle", 0.4))
    assert moa["steps"] == [50] and moa["depth1"] == [0.65] and eagle["depth1"] == [0.525]

    out = tmp_path / "curves"
    out.with_suffix(".json").write_text(json.dumps([{"name": "old-run"}, {"name": "moa-a", "stale": True}]))
    assert script.main(["--out", str(out), "--merge", str(tmp_path / "runs" / "moa-a")]) == 0
    merged = json.loads(out.with_suffix(".json").read_text())
    assert [curve["name"] for curve in merged] == ["old-run", "moa-a"] and "stale" not in merged[1]
    assert script.main(["--out", str(out), str(tmp_path / "runs" / "eagle-a")]) == 0
    assert [curve["name"] for curve in json.loads(out.with_suffix(".json").read_text())] == ["eagle-a"]
