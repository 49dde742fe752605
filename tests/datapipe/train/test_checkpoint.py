"""Checkpoint saves killed in the middle of their write (a real SIGKILL): the temporary file they leave is
removed when the run resumes or a run starts in the folder, and the checkpoint itself stays intact."""

from __future__ import annotations

from pathlib import Path

import pytest

from datapipe.train.checkpoint import load_checkpoint
from datapipe.train.loop import train
from helpers import killed_mid_write, tiny_cfg, write_train_source

# A checkpoint save whose torch.save stops half-way through writing the file: it prints the temporary
# file's name and waits there to be killed.
SAVE = r"""
import sys, time
from pathlib import Path
import torch
from datapipe.train import checkpoint

def save(obj, f):
    f.write(b"half a checkpoint " * 100_000)
    f.flush()
    print(f.name, flush=True)
    time.sleep(600)

torch.save = save
checkpoint.save_checkpoint(Path(sys.argv[1]), {"step": 99})
"""

SETS = ("data.holdout_shards=0", "train.steps=4", "train.ckpt_every=0", "train.ckpt_minutes=0")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_train_source(tmp_path_factory.mktemp("src"))


def temporaries(run: Path) -> list[str]:
    return sorted(p.name for p in run.rglob("*") if ".tmp-" in p.name)


def test_a_save_killed_mid_write_leaves_a_temporary_that_resume_removes(source: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_cfg(source, run, *SETS, "train.stop_at=2"))
    left = Path(killed_mid_write(SAVE, str(run / "checkpoint.pt")))
    assert left.parent == run and left.name.startswith(".checkpoint.pt.tmp-") and left.stat().st_size > 0
    assert load_checkpoint(run / "checkpoint.pt")["step"] == 2  # the kill left the checkpoint itself intact
    (run / ".checkpoint.pt.tmp-4242").write_bytes(b"half")  # the name a killed save of an older datapipe left
    assert len(temporaries(run)) == 2

    resumed = train(tiny_cfg(source, run, *SETS), resume=True)
    assert resumed["start_step"] == 2 and load_checkpoint(run / "checkpoint.pt")["step"] == 4
    assert temporaries(run) == []


def test_a_run_started_in_a_folder_a_killed_save_left_removes_its_temporary(source: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    left = Path(killed_mid_write(SAVE, str(run / "checkpoint.pt")))  # killed before any checkpoint was complete
    assert left.exists() and not (run / "checkpoint.pt").exists()
    train(tiny_cfg(source, run, *SETS))
    assert temporaries(run) == [] and load_checkpoint(run / "checkpoint.pt")["step"] == 4
