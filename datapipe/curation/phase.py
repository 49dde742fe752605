"""A phase: one step of curation, as the run loop (`datapipe.curation.run_loop`) runs it.

A `Phase` is tasks over items, planned in the driver (`items`, `shared`), each run in a worker
(`task(shared, *item)`, which writes its outputs atomically and returns a JSON-able result), their results back in
the driver. A task with a `record` leaves its result there once its outputs are written (`recorded_task`), so a
resumed run skips it; the run loop is the only caller of `recorded_task`.
"""

from __future__ import annotations

import functools
import posixpath
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from datapipe.core.shards import file_sha256, noting_outputs
from datapipe.core.storage import Location, location, size_of, spread
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


OUTPUTS = "published_outputs"  # a record's list of the files its task wrote outside the work folder


def recorded_task(parts: tuple[Callable[..., Any], Callable[..., Location], Any], *item: Any) -> tuple[Any, bool]:
    """In a worker: the task's recorded result if its record is there and sound and every output it published
    (outside the work folder: shards, dropped documents, scores, clusters) is as it wrote it, else the task run and
    its record written (after its outputs; with each published output's size and digest). With whether it was found
    done: a shard cut or deleted since its task finished is written again by that task."""
    task, record, shared = parts
    path = record_location(record, shared, *item)
    done = read_record(path)
    if isinstance(done, dict) and all(_as_written(path, output) for output in done.pop(OUTPUTS, [])):
        return done, True
    with noting_outputs() as outputs:
        result = task(shared, *item)
    if outputs and not isinstance(result, dict):
        raise TypeError(f"{getattr(task, '__name__', task)} published outputs and returned a {type(result).__name__}: "
                        "a task that publishes returns a dict, which its record extends with them")
    write_record(path, {**result, OUTPUTS: [{**o, "path": _relative(path, o["path"])} for o in outputs]} if outputs else result)
    return result, False


def _split_scheme(path: str) -> tuple[str, str]:
    scheme, sep, rest = path.partition("://")
    return (scheme + sep, rest) if sep else ("", path)


def _relative(record: Location, output: str) -> str:
    """`output` relative to the record's folder (so that a moved output folder still finds it)."""
    (scheme, rest), (its_scheme, its_rest) = _split_scheme(str(record)), _split_scheme(output)
    if scheme != its_scheme:
        return output
    return posixpath.relpath(its_rest, posixpath.dirname(rest))


def _as_written(record: Location, output: dict[str, Any]) -> bool:
    """Whether a published output is there with the size and digest its task recorded."""
    scheme, rest = _split_scheme(str(record))
    path = output["path"] if "://" in output["path"] else scheme + posixpath.normpath(
        posixpath.join(posixpath.dirname(rest), output["path"]))
    try:
        found = location(path)
        return size_of(found) == output["bytes"] and file_sha256(found) == output["sha256"]
    except (OSError, ValueError):  # gone, or unreadable: its task writes it again
        return False


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

