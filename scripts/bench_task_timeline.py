"""Where a curation run waits: each phase's wall in the driver against its tasks' own clocks; prints one JSON object.

usage: python -m scripts.bench_task_timeline [--corpus ../shared/data/corpus.jsonl.gz] [--workers 2] [--set KEY=VALUE ...]

Runs `datapipe curate configs/quickstart.yaml --input CORPUS` (domains from `source`) in this process on an
embedded Ray, with every task wrapped to record, in the worker, its start, wall and CPU seconds. Per phase
(`run_tasks` call): the driver's wall, the tasks' count, wall and CPU sums, when the first task started after
the phase was submitted (`first_start_delay_s`: a worker process starting or importing), and the idle share
(1 - task wall / (driver wall x workers)). Also Ray's start and shutdown, and the worker processes seen.
This is how the waits named in BENCHMARKS.md ("Re-measured after the fixed costs were cut") were found.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from datapipe.curation import executors
from datapipe.curation.config import load_config
from datapipe import curate

REPO = Path(__file__).parents[1]


def _timed(fn: Any, desc: str, folder: str) -> Any:
    """`fn` recording (desc, start, wall, cpu) into a file per worker process under `folder`."""

    def task(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.time(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps([desc, start, time.time() - start, time.process_time() - cpu]) + "\n")

    task.__name__ = getattr(fn, "__name__", "task")
    return task


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-timeline-"))
    events = tmp / "events"
    events.mkdir()
    phases: list[dict[str, Any]] = []
    ray_seconds: dict[str, float] = {}
    run_tasks, init, shutdown = executors.RayExecutor.run_tasks, executors.RayExecutor.__init__, executors.RayExecutor.shutdown

    def timed_run_tasks(self: Any, fn: Any, shared: Any, items: Any, desc: str, **kwargs: Any) -> list[Any]:
        start = time.time()
        try:
            return run_tasks(self, _timed(fn, desc, str(events)), shared, items, desc, **kwargs)
        finally:
            phases.append({"phase": desc, "submitted": start, "driver_s": time.time() - start, "tasks": len(items)})

    def timed_init(self: Any, *a: Any, **kw: Any) -> None:
        start = time.time()
        init(self, *a, **kw)
        ray_seconds["start"] = round(time.time() - start, 3)

    def timed_shutdown(self: Any) -> None:
        start = time.time()
        shutdown(self)
        ray_seconds["shutdown"] = round(time.time() - start, 3)

    executors.RayExecutor.run_tasks, executors.RayExecutor.__init__ = timed_run_tasks, timed_init
    executors.RayExecutor.shutdown = timed_shutdown
    try:
        overrides = ["inputs.0.domain_field=source", f"ray.num_cpus={args.workers}", *args.overrides]
        cfg = load_config(REPO / "configs" / "quickstart.yaml", overrides=overrides, inputs=[str(Path(args.corpus).resolve())],
                          output=str(tmp / "out"))
        t0 = time.time()
        result = curate(cfg, progress=False, log=lambda _: None)
        wall = time.time() - t0
        # every task's record, written by its worker on this machine
        task_rows = [json.loads(line) + [f.stem] for f in events.glob("*.jsonl") for line in f.read_text().splitlines()]
        out = []
        for ph in phases:
            rows = [r for r in task_rows if r[0] == ph["phase"] and ph["submitted"] <= r[1] <= ph["submitted"] + ph["driver_s"]]
            task_wall = sum(r[2] for r in rows)
            out.append({
                "phase": ph["phase"], "tasks": ph["tasks"], "driver_s": round(ph["driver_s"], 3),
                "task_wall_s": round(task_wall, 3), "task_cpu_s": round(sum(r[3] for r in rows), 3),
                "first_start_delay_s": round(min(r[1] for r in rows) - ph["submitted"], 3) if rows else None,
                "idle_share": round(1 - task_wall / (ph["driver_s"] * args.workers), 3) if ph["driver_s"] > 0 else None,
            })
        print(json.dumps({
            "command": f"datapipe curate configs/quickstart.yaml --input {args.corpus} --set " + " --set ".join(overrides),
            "wall_seconds": round(wall, 2), "ray_seconds": ray_seconds, "phase_seconds": result.stats["phase_seconds"],
            "worker_processes": len({r[4] for r in task_rows}), "phases": out,
        }, indent=1))
    finally:
        executors.RayExecutor.run_tasks, executors.RayExecutor.__init__ = run_tasks, init
        executors.RayExecutor.shutdown = shutdown
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
