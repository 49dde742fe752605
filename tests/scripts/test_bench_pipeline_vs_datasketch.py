"""The whole-pipeline benchmark's CPU breakdown (`scripts/bench_pipeline_vs_datasketch.py`) and its trace
(`scripts/curate_traced.py`)."""

import json
import os

import pytest

from scripts import curate_traced
from scripts.bench_pipeline_vs_datasketch import TreeSampler, _kind, breakdown

DRIVER, RAYLET, WORKER = 10, 11, 12


def _sampler() -> TreeSampler:
    """A run of 10 s: the driver spends 1 CPU-s a second for 2 s, then 0.1 a second; the raylet 0.05 a second
    from t = 1; the worker starts at t = 2, spends 0.5 CPU-s before its first task, then 1 a second."""
    sampler = TreeSampler(DRIVER)
    sampler.commands = {DRIVER: "python -m scripts.curate_traced ...", RAYLET: "/ray/core/src/ray/raylet/raylet --x",
                        WORKER: "ray::IDLE"}
    times = [t / 10 for t in range(101)]
    sampler.series = {
        DRIVER: [(t, min(t, 2.0) + 0.1 * max(0.0, t - 2)) for t in times],
        RAYLET: [(t, 0.05 * (t - 1)) for t in times if t >= 1],
        WORKER: [(t, 0.5 * min(1.0, t - 2) + max(0.0, t - 3)) for t in times if t >= 2],
    }
    return sampler


def test_every_cpu_second_is_in_one_interval_and_tasks_are_split_from_the_rest():
    trace = [["imported", 0.3], ["begin", 1.0], ["lap", "start", 3.0],
             ["task", "filters", WORKER, 3.0, 5.0, 1.8], ["lap", "filters", 5.0],
             ["task", "tokenize", WORKER, 5.0, 6.0, 0.9], ["task", "tokenize", WORKER, 6.0, 8.0, 1.9],
             ["lap", "tokenize", 8.0], ["lap", "shutdown", 9.0], ["returned", 9.5]]
    sampler = _sampler()
    got = breakdown(sampler, trace, 0.0, 10.0)
    intervals = got["intervals"]
    assert list(intervals) == ["python_and_cli", "start", "filters", "tokenize", "shutdown", "report", "exit"]
    assert sum(row["cpu_s"] for row in intervals.values()) == pytest.approx(sampler.total(), abs=0.05)
    assert intervals["python_and_cli"] == pytest.approx(
        {"wall_s": 1.0, "cpu_s": 1.0, "driver_s": 1.0, "ray_daemons_s": 0.0, "workers_in_tasks_s": 0.0,
         "workers_outside_tasks_s": 0.0})
    # the worker's start-up (0.5) falls in "start"; in "filters" it spent 2.0, of which its task reported 1.8
    assert intervals["start"]["workers_outside_tasks_s"] == pytest.approx(0.5, abs=0.01)
    assert intervals["filters"]["workers_in_tasks_s"] == pytest.approx(1.8)
    assert intervals["filters"]["workers_outside_tasks_s"] == pytest.approx(0.2, abs=0.01)
    assert intervals["filters"]["ray_daemons_s"] == pytest.approx(0.1, abs=0.01)
    assert got["steps"]["tokenize"] == {"tasks": 2, "cpu_s": 2.8, "first_task_extra_cpu_s": 0.0}
    assert got["workers"] == {"count": 1, "ran_tasks": 1, "cpu_s": 7.5, "before_first_task_s": 0.5, "in_tasks_s": 4.6,
                              "rest_s": 2.4}
    assert got["processes"]["driver"]["cpu_s"] == pytest.approx(2.8)


def test_ray_processes_are_told_apart_by_their_command_line():
    assert _kind(1, 1, "python -m datapipe curate") == "driver"
    assert _kind(2, 1, "/x/ray/core/src/ray/raylet/raylet --python_worker_command=x default_worker.py") == "ray_raylet"
    assert _kind(3, 1, "/x/ray/core/src/ray/gcs/gcs_server --log_dir=x") == "ray_gcs_server"
    assert _kind(4, 1, "ray::DashboardAgent") == _kind(5, 1, "ray::RuntimeEnvAgent") == "ray_agents"
    assert _kind(6, 1, "python -u /x/ray/_private/log_monitor.py --session-dir=x") == "ray_log_monitor"
    assert _kind(7, 1, "ray::IDLE") == _kind(8, 1, "ray::segment_task") == "worker"
    assert _kind(9, 1, "python -c import ctypes /x/ray/_private/workers/default_worker.py") == "worker"


def test_a_traced_task_appends_its_line_and_keeps_its_name(tmp_path):
    path = str(tmp_path / "events.jsonl")

    def segment_task(shared, block):
        return shared + block

    task = curate_traced._timed(segment_task, "segments", path)
    assert task.__name__ == "segment_task" and task(1, 2) == 3
    (row,) = [json.loads(line) for line in open(path)]
    assert row[:3] == ["task", "segments", os.getpid()] and row[3] <= row[4] and row[5] >= 0
