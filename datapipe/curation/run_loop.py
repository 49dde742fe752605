"""The one run loop: `Run.execute(phase)` runs a `Phase` (`datapipe.curation.phase`) on an executor.

It is the only place that
- checks task records: a task with a `record` is skipped when its record is there and sound (`recorded_task`),
  and its record is written after its outputs, so a killed run resumes to the same output (the early reader's
  tasks in the driver too: `in_this_process`);
- counts the tasks a resumed run found done;
- tells the executor the memory a task declares;
- times the run by user-level stage (`stats.json`'s `phase_seconds`) and shows progress: in a terminal a live bar
  per stage (read, exact dedup, filters, near dedup, tokenize, eval split, selection, shards: tasks done / total,
  rate, ETA), else one line per stage when it ends; the sub-steps only verbose.

Phases never import it: a global stage's resolve and the multi-step phases (near dedup, the eval split,
selection) get `Run.tasks(stage)`, a plain `run_tasks(fn, shared, items, desc, *, record=, memory=)`.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable, Sequence

from datapipe.core.storage import Location
from datapipe.curation.executors import StageBar
from datapipe.curation.phase import Phase, RunTasks, recorded_task


@functools.cache
def _named_after(task: Callable[..., Any]) -> Callable[..., tuple[Any, bool]]:
    """`recorded_task` under the task's own name, which Ray shows (`ray::segment_task`) and a stall error names;
    one for each task function, so that an executor sends each to its workers once (`RayExecutor.run_tasks`)."""

    def recorded(parts: tuple[Callable[..., Any], Callable[..., Location], Any], *item: Any) -> tuple[Any, bool]:
        return recorded_task(parts, *item)

    recorded.__name__ = recorded.__qualname__ = getattr(task, "__name__", "task")
    return recorded


def in_this_process(task: Callable[..., Any], record: Callable[..., Location], shared: Any) -> Callable[..., tuple[Any, bool]]:
    """A phase's task run in the driver's process (the early reader's, while Ray starts): `fn(*item)` gives its
    (result, found done), its record checked and written as `Run.execute` does."""
    return functools.partial(recorded_task, (task, record, shared))


class StageLines:
    """One progress line per user-level stage, printed when the stage ends: its tasks and seconds; every line goes
    to the run's log too (`log_line`: OUT/run.log), printed or not."""

    def __init__(self, enabled: bool, log_line: Callable[[str], None] = lambda _: None) -> None:
        self.enabled, self.log_line = enabled, log_line
        self.live = enabled and sys.stderr.isatty()  # a live bar per stage in a terminal, one line otherwise
        self.bar: StageBar | None = None
        self.stage: str | None = None
        self.tasks = 0
        self.start = time.perf_counter()

    def phase(self, stage: str, tasks: int) -> None:
        if stage != self.stage:
            self.close()
            self.stage, self.tasks, self.start = stage, 0, time.perf_counter()
            self.bar = StageBar(stage) if self.live else None
        self.tasks += tasks
        if self.bar is not None:
            self.bar.add(tasks)

    def close(self) -> None:
        if self.stage is not None:
            seconds = time.perf_counter() - self.start
            line = f"{self.stage}: {self.tasks:,} task{'s' * (self.tasks != 1)} in {seconds:.1f} s"
            self.log_line(line)
            if self.bar is not None:  # the bar stays on the screen as the stage's line
                self.bar.close()
            elif self.enabled:
                print(line, file=sys.stderr, flush=True)
        self.stage, self.bar = None, None


class Run:
    """The run loop over an executor (`datapipe.curation.executors`): see the module docstring."""

    def __init__(self, executor: Any, *, progress: bool, resumed: bool, started: float,
                 log_line: Callable[[str], None] = lambda _: None) -> None:
        self.executor = executor
        self.lines = StageLines(progress, log_line)
        self.resuming = resumed  # the output folder held this run's work already
        self.resumed: dict[str, list[int]] = {}  # stage -> [tasks found done, tasks]
        self.seconds: dict[str, float] = {}  # stage (or "start", "write", ...) -> seconds, adding up to the run's
        self.step_seconds: dict[str, float] = {}  # a stage's steps (`Phase.step`, rounds as one) -> seconds
        self.clock = started

    def execute(self, phase: Phase) -> list[Any]:
        self.lines.phase(phase.stage, len(phase.items))
        started = time.perf_counter()
        if phase.record is None:
            results = self.executor.run_tasks(phase.task, phase.shared, phase.items, phase.step, memory=phase.memory)
        else:
            pairs = self.executor.run_tasks(_named_after(phase.task), (phase.task, phase.record, phase.shared), phase.items,
                                            phase.step, memory=phase.memory)
            results = [result for result, _ in pairs]
            self.count_resumed(phase.stage, sum(done for _, done in pairs), len(pairs))
        step = phase.step.split(" round ")[0]  # "minhash components round 3" -> "minhash components"
        self.step_seconds[step] = round(self.step_seconds.get(step, 0.0) + time.perf_counter() - started, 3)
        self.lap(phase.stage)
        return results

    def count_resumed(self, stage: str, done: int, tasks: int) -> None:
        if self.resuming:
            counts = self.resumed.setdefault(stage, [0, 0])
            counts[0] += done
            counts[1] += tasks

    def tasks(self, stage: str, memory: int | None = None) -> RunTasks:
        """A plain `run_tasks(fn, shared, items, desc, *, record=None, memory=None)` whose phases belong to `stage`
        (and whose tasks declare `memory` unless a call says otherwise)."""
        default = memory

        def run_tasks(fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str, *,
                      record: Callable[..., Location] | None = None, memory: int | None = None) -> list[Any]:
            return self.execute(Phase(stage, desc, fn, shared, items, record, memory if memory is not None else default))

        return run_tasks

    def lap(self, name: str) -> None:
        """Charge the seconds since the last lap to `name`: every second of the run is in some entry."""
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self.clock, 3)
        self.clock = now

    def resumed_line(self) -> str | None:
        """'resumed: N of M tasks were already done (read 1/1, ...)', or None when nothing was."""
        if not (done := self.resumed_tasks):
            return None
        parts = ", ".join(f"{stage} {d}/{n}" for stage, (d, n) in self.resumed.items())
        return f"resumed: {done:,} of {sum(n for _, n in self.resumed.values()):,} tasks were already done ({parts})"

    @property
    def resumed_tasks(self) -> int:
        return sum(d for d, _ in self.resumed.values())
