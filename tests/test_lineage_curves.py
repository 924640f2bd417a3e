"""bench/lineage_curves.py: sequences seen summed over a checkpoint's chain of continued runs,
wall time per device, and the points written from mtbench_top1's result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import load_bench_script

from moaspec.errors import MoaspecError


def chain() -> dict:
    """A checkpoint's training record: a GPU run continuing a CPU run continuing a default-batch one."""
    first = {"step": 400, "command": "moaspec train --method moa --steps 400", "train_wall_s": 100.0}
    second = {"step": 300, "command": "moaspec train --batch-size 4 --batch-size 16 --steps 300", "train_wall_s": 50.0,
              "init_from": first}
    return {"step": 600, "command": "moaspec train --batch-size 32 --device cuda:1 --steps 600", "train_wall_s": 20.5,
            "init_from": second}


def test_the_lineage_sums_steps_times_batch_and_wall_time_per_device() -> None:
    script = load_bench_script("lineage_curves")
    assert [(run["steps"], run["batch"], run["device"]) for run in script.lineage(chain())] == [
        (400, 8, "cpu"), (300, 16, "cpu"), (600, 32, "gpu")]
    assert script.lineage_totals(chain()) == {"sequences": 400 * 8 + 300 * 16 + 600 * 32, "runs": 3,
                                              "cpu_wall_s": 150.0, "gpu_wall_s": 20.5}
    broken = chain()
    del broken["init_from"]["step"]
    with pytest.raises(MoaspecError, match="without its steps or command"):
        script.lineage_totals(broken)


def checkpoint(directory: Path, training: dict) -> str:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"method": "moa", "training": training}))
    return str(directory)


def test_points_come_from_the_top1_file_and_its_checkpoints(tmp_path, monkeypatch) -> None:
    script = load_bench_script("lineage_curves")
    monkeypatch.setattr(script, "plot", lambda points: b"png")
    later = checkpoint(tmp_path / "later", chain())
    earlier = checkpoint(tmp_path / "earlier", chain()["init_from"])
    top1 = {"command": "bench/mtbench_top1.py ...", "drafters": [
        {"label": "later", "source": later, "method": "moa", "by_category": {"all": {"depth1": 0.5, "depth2": 0.4, "depth3": 0.3}}},
        {"label": "eagle", "source": earlier, "method": "eagle", "by_category": {"all": {"depth1": 0.45}}},
        {"label": "earlier", "source": earlier, "method": "moa", "by_category": {"all": {"depth1": 0.4, "depth2": 0.3, "depth3": 0.2}}},
    ]}
    top1_path = tmp_path / "top1.json"
    top1_path.write_text(json.dumps(top1))
    out = tmp_path / "curves" / "lineage"
    assert script.main(["--top1", str(top1_path), "--out", str(out)]) == 0
    written = json.loads(out.with_suffix(".json").read_text())["points"]
    assert [p["label"] for p in written] == ["eagle", "earlier", "later"]  # by method, then sequences
    assert written[1]["sequences"] == 400 * 8 + 300 * 16 and written[2]["sequences"] == written[1]["sequences"] + 600 * 32
    assert written[0]["depth1"] == 0.45 and written[0]["depth2"] is None and written[2]["depth3"] == 0.3
    assert out.with_suffix(".png").read_bytes() == b"png"

    top1["drafters"][0]["source"] = str(tmp_path / "gone")
    top1_path.write_text(json.dumps(top1))
    with pytest.raises(MoaspecError, match="later: no checkpoint at"):
        script.main(["--top1", str(top1_path), "--out", str(tmp_path / "other")])
    top1_path.write_text(json.dumps({"drafters": []}))
    with pytest.raises(MoaspecError, match="holds no drafters"):
        script.main(["--top1", str(top1_path), "--out", str(tmp_path / "other")])
    assert not (tmp_path / "other.json").exists()
