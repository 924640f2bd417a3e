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
    monkeypatch.setattr(script, "plot", lambda curves: b"png")
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
    # bug (a user's audit): a damaged file to merge with gave a traceback
    import pytest

    from moaspec.errors import MoaspecError

    out.with_suffix(".json").write_text("[{")
    with pytest.raises(MoaspecError, match="is not a readable JSON file"):
        script.main(["--out", str(out), "--merge", str(tmp_path / "runs" / "moa-a")])


def test_runs_are_named_by_label_and_one_name_twice_is_refused(tmp_path, monkeypatch) -> None:
    """Two machines' runs often share a folder name (runs/moa): --merge would keep only one."""
    import pytest

    script = load_bench_script("learning_curves")
    monkeypatch.setattr(script, "plot", lambda curves: b"png")
    first = fake_run(tmp_path / "a" / "moa", "moa", 0.4)
    second = fake_run(tmp_path / "b" / "moa", "moa", 0.5)
    out = tmp_path / "curves"
    with pytest.raises(SystemExit, match="two runs named 'moa'.*LABEL=RUN_DIR"):
        script.main(["--out", str(out), str(first), str(second)])
    assert not out.with_suffix(".json").exists()
    assert script.main(["--out", str(out), str(first), f"moa-b={second}"]) == 0
    curves = json.loads(out.with_suffix(".json").read_text())
    assert [curve["name"] for curve in curves] == ["moa", "moa-b"] and curves[1]["depth1"] == [0.75]
    with pytest.raises(SystemExit, match="is not RUN_DIR or LABEL=RUN_DIR"):
        script.main(["--out", str(out), f"={second}"])
