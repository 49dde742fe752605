"""`datapipe curate` as the CLI runs it, leaving a trace of when each stage ran and what each task cost.

usage: python -m scripts.curate_traced EVENTS CURATE_ARGS...

Runs `datapipe curate CURATE_ARGS...` in this process (as `python -m datapipe curate` would) and appends JSON lines
to the file EVENTS, every time a `time.time()`:
- ["imported", t]: this module's start, before datapipe's CLI is imported (the interpreter's start is before it);
- ["begin", t]: `curate` starts (its `Run` is made after the plan and Ray's start: `t` is back-dated to `started`);
- ["lap", name, t]: each `Run.lap`, which charges the seconds since the last to `name` (`stats.json`'s
  `phase_seconds`: "start", each stage, "write", "shutdown");
- ["task", step, pid, start, end, cpu_s]: each task run on Ray, written by its worker (`process_time`: the
  worker's CPU while the task ran, its other threads included);
- ["returned", t]: the CLI has printed its summary and returns (the interpreter's exit is after it).
`scripts.bench_pipeline_vs_datasketch` reads it with the process tree's CPU to say where every CPU-second went.
The trace costs a line per task and per stage.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable


def _append(path: str, row: list[Any]) -> None:
    # one write() of one short line to a file opened O_APPEND: workers' lines do not interleave
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _timed(fn: Callable[..., Any], step: str, path: str) -> Callable[..., Any]:
    """`fn` appending its ["task", ...] line, in whichever process runs it."""

    def task(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.time(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _append(path, ["task", step, os.getpid(), start, time.time(), time.process_time() - cpu])

    task.__name__ = task.__qualname__ = getattr(fn, "__name__", "task")  # the name Ray shows
    return task


def install(path: str) -> None:
    """Hook the run loop's laps and the Ray executor's tasks to append to `path`."""
    from datapipe.curation import run_loop
    from datapipe.curation.executors import _ray_executor

    init, lap, run_tasks = run_loop.Run.__init__, run_loop.Run.lap, _ray_executor.RayExecutor.run_tasks

    def traced_init(self: Any, *args: Any, started: float, **kwargs: Any) -> None:
        _append(path, ["begin", time.time() - (time.perf_counter() - started)])
        init(self, *args, started=started, **kwargs)

    def traced_lap(self: Any, name: str) -> None:
        lap(self, name)
        _append(path, ["lap", name, time.time()])

    def traced_run_tasks(self: Any, fn: Callable[..., Any], shared: Any, items: Any, desc: str, **kwargs: Any) -> list[Any]:
        return run_tasks(self, _timed(fn, desc, path), shared, items, desc, **kwargs)

    run_loop.Run.__init__, run_loop.Run.lap = traced_init, traced_lap
    _ray_executor.RayExecutor.run_tasks = traced_run_tasks


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__.split("\n\n")[1])
    path = os.path.abspath(sys.argv[1])
    _append(path, ["imported", time.time()])
    install(path)
    from datapipe.cli import main as cli

    code = cli(["curate", *sys.argv[2:]])
    _append(path, ["returned", time.time()])
    return code


if __name__ == "__main__":
    from datapipe.cli import exit_process

    exit_process(main())  # as the CLI exits
