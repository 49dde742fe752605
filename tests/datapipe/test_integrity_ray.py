"""Damaged work files on the Ray executor: a task that finds one stops the run with the one paragraph (the file,
what is wrong, the recovery command), never a worker's traceback, and the recovery gives the same shards.

One reference run and one killed run for the module (killed in the filters' segment, where a resume reads every
kind of file the read phase left); each case damages a copy of the killed folder and resumes it on Ray."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

import helpers
from helpers import STALL_S, CrashAfter, Interrupted, PassThrough, small_config
from datapipe.core.config import RunStopped
from datapipe.core.shards import read_manifest
from datapipe.curate.executors import LocalExecutor, RayExecutor
from datapipe.curate.run import curate


def _run(cfg, executor, stage):
    return curate(cfg, executor=executor, progress=False, log=lambda _: None, extra_stages=[stage])


def _checksums(out: Path) -> list[str]:
    return [s["sha256"] for s in read_manifest(out)["shards"]]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, ray_local):
    """(reference output, killed output): the reference finished, the other killed in the filters' segment (its
    work files written by the local executor: the same files Ray's tasks write)."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(helpers)  # the test stages go to Ray's workers by value
    base = tmp_path_factory.mktemp("integrity-ray")
    slice_input = {"path": str(helpers.ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}
    ref, out = base / "ref", base / "killed"
    _run(small_config(ref, [slice_input]), LocalExecutor(), PassThrough())
    with pytest.raises(Interrupted):
        _run(small_config(out, [slice_input]), LocalExecutor(), CrashAfter(0))
    return ref, out


def _copy(killed_out: Path, to: Path) -> Path:
    """A copy of the killed output folder: its config written for the copy's own path."""
    shutil.copytree(killed_out, to)
    return to


def _resume_on_ray(out: Path, slice_input: dict) -> None:
    _run(small_config(out, [slice_input]), RayExecutor(progress=False, stall_timeout_s=STALL_S), PassThrough())


def _assert_paragraph(message: str, damaged: Path, work: Path) -> None:
    assert f"work file {damaged} is damaged" in message and f"rm -r {work}" in message
    assert "Traceback" not in message and "RayTaskError" not in message and "\n" not in message


def test_a_damaged_read_block_found_in_a_ray_task_is_the_paragraph(killed, tmp_path, slice_input) -> None:
    ref, killed_out = killed
    out = _copy(killed_out, tmp_path / "out")
    damaged = out / "work" / "read" / "u000000-b00001.arrow"
    damaged.write_bytes(damaged.read_bytes()[:100])  # cut: the segment task that reads it finds it
    with pytest.raises(RunStopped) as info:
        _resume_on_ray(out, slice_input)
    assert type(info.value) is RunStopped  # the run's paragraph, not the task's exception nor Ray's wrapper
    _assert_paragraph(str(info.value), damaged, out / "work")
    shutil.rmtree(out / "work")  # the recovery it names
    _resume_on_ray(out, slice_input)
    assert _checksums(out) == _checksums(ref)
