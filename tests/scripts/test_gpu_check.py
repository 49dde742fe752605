"""The GPU check's CPU dry run: every step of the device script runs here, on small shapes, and writes its JSON."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from datapipe.testing.shards import write_fake_shards
from scripts import gpu_check


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    rng = random.Random(0)
    out = tmp_path_factory.mktemp("gpu-data")
    docs = [[{"id": f"d{s}-{i}", "domain": "web", "tokens": [rng.randrange(1, 256) for _ in range(rng.randint(50, 400))] + [0]}
             for i in range(60)] for s in range(2)]
    write_fake_shards(out, docs, vocab_size=256)
    return out


def test_the_dry_run_measures_every_step_and_writes_it(shards: Path, tmp_path: Path):
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--data", str(shards), "--skip", "tests"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and all(report[k]["ok"] for k in ("device", "data", "train", "loader", "ddp"))
    for name in gpu_check.TRAIN_CONFIGS:
        trained = report["train"][name]
        for run in (trained["prefetch_on"], trained["prefetch_off"]):
            assert run["tokens_per_s"] > 0 and 0 <= run["data_wait_frac"] < 1 and run["mfu"] is None  # no peak on a CPU
        loader = report["loader"][name]
        assert loader["served_tokens_per_s"]["0"] > 0 and loader["workers_needed"] >= 1
    ddp = report["ddp"]
    assert ddp["backend"] == "gloo" and ddp["stopped_at"] == ddp["steps"] // 2 and ddp["resumed_continues"]


def test_a_failing_step_is_recorded_and_the_next_steps_still_run(shards: Path, tmp_path: Path, monkeypatch):
    def broken(*_):
        raise RuntimeError("a CUDA error")

    monkeypatch.setattr(gpu_check, "train_configs", broken)
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--data", str(shards), "--skip", "tests", "ddp"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not report["train"]["ok"] and "a CUDA error" in report["train"]["error"]
    assert report["loader"]["ok"]  # ran after the failed step


def test_a_folder_that_is_not_curated_is_named(tmp_path: Path):
    assert gpu_check.main(["--out", str(tmp_path), "--dry-run", "--data", str(tmp_path), "--skip", "tests"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert f"--data {tmp_path}: not a curated folder" in report["data"]["error"] and "train" not in report


def test_without_a_device_the_real_run_is_refused_naming_the_dry_run(tmp_path: Path):
    with pytest.raises(SystemExit, match="--dry-run"):
        gpu_check.main(["--out", str(tmp_path)])
