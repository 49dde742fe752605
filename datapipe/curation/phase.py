"""A phase: one step of curation, as the run loop (`datapipe.curation.run_loop`) runs it.

A `Phase` is tasks over items, planned in the driver (`items`, `shared`), each run in a worker
(`task(shared, *item)`, which writes its outputs atomically and returns a JSON-able result), their results back in
the driver. A task with a `record` leaves its result there once its outputs are written (`recorded_task`), so a
resumed run skips it; the run loop is the only caller of `recorded_task`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from datapipe.core.storage import Location, location, spread
from datapipe.core.workfiles import read_record, write_record

RunTasks = Callable[..., list[Any]]


@dataclass
class Phase:
    stage: str  # the user-level stage it belongs to: one progress line and one `phase_seconds` entry each
    step: str  # what its tasks do ("near dedup pairs"): a line of its own only with --verbose
    task: Callable[..., Any]
    shared: Any
    items: Sequence[tuple]
    record: Callable[..., Location] | None = None  # record(shared, *item): where a finished task's record is
    memory: int | None = None  # bytes one task needs (Ray's `memory=`), from its input


def recorded_task(parts: tuple[Callable[..., Any], Callable[..., Location], Any], *item: Any) -> tuple[Any, bool]:
    """In a worker: the task's recorded result if its record is there and sound, else the task run and its record
    written (after its outputs). With whether it was found done."""
    task, record, shared = parts
    path = record_location(record, shared, *item)
    if (done := read_record(path)) is not None:
        return done, True
    result = task(shared, *item)
    write_record(path, result)
    return result, False


def record_location(record: Callable[..., Location], shared: Any, *item: Any) -> Location:
    """Where a task's record is kept: `record(shared, *item)`, below a hashed key prefix on an object store (`spread`:
    a phase writes one a task, thousands at once at scale)."""
    return spread(record(shared, *item))


def record_in(folder: str, step: str = "", *, first_item_only: bool = False) -> Callable[..., Location]:
    """A `record` for tasks whose shared value is a folder or names one (`.folder`): `<that folder>/<folder>/<step>-<item>.json`
    (`<item>.json` without a step; with `first_item_only`, named by the item's first value alone)."""
    return functools.partial(_record_in, folder, step, first_item_only)


def _record_in(folder: str, step: str, first_item_only: bool, shared: Any, *item: Any) -> Location:
    base = location(shared if isinstance(shared, str) else shared.folder)
    named = [str(x) for x in (item[:1] if first_item_only else item)]
    return base / folder / ("-".join([step, *named] if step else named) + ".json")

