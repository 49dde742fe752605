"""A global stage's losers, routed to the blocks that drop them.

A global stage's resolve leaves its losers in `folder/losers-tNNN.arrow`, one file per resolve task, each holding
documents of any input unit. Every block task of the next segment needs its own unit's losers, and no process
should hold them all. Two steps of tasks route them (`route_losers`):
1. one task per losers file cuts it by input unit into one shuffle file (`split_losers_task`);
2. one task per group of units gathers the group's range of every such file into one file (`gather_losers_task`),
so a block task reads one range of one file (`unit_losers`), not a range of every losers file.
The split files reach the groups through the one exchange (`datapipe.core.exchange.route`), so requests grow as
losers files + groups + blocks, not losers files x groups or x blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa

from datapipe.core.schema import ROW_BITS
from datapipe.core.exchange import Exchange, Received, largest_sent, route
from datapipe.core.shuffle import SUFFIX as SHUFFLE_SUFFIX, read_shuffle, write_shuffle
from datapipe.core.storage import Location, location
from datapipe.core.workfiles import read_work_table
from stages.base import LOSER_SCHEMA

LOSERS_BY_UNIT = "losers-by-unit"  # work/<global stage>/losers-by-unit/: losers-tNNN.shuffle by unit, gNNNNN.shuffle by group
UNIT_GROUPS = 256  # the losers of at most this many groups of input units: one file each (`gather_losers_task`)


LOSER_BYTES = 48  # a loser's row, about (order, reason, kept id): what the cost model sizes their exchange by


def route_losers(run_tasks: Callable[..., list], folder: Location, tasks: int, units: int, stage: str) -> None:
    """Route the losers of the `tasks` files in `folder` (a global stage's work folder) to the `units` input units.
    The split files reach the groups through the exchange (`exchange.route`), so that a group reads a few files,
    not one per resolve task."""
    files = [f"losers-t{t:03d}" for t in range(tasks)]  # one per resolve task, always
    split = run_tasks(split_losers_task, LosersTask(str(folder), units), [(f,) for f in files], f"{stage} losers by unit",
                      record=_split_record)
    groups = -(-units // _unit_group(units))
    # a group's span starts at its first unit: it reads one range of each file
    split_files = route(run_tasks, Exchange(f"{stage} losers", str(folder / LOSERS_BY_UNIT), tuple(files), units,
                                            largest_sent(split), spans=tuple(_unit_range(g, units)[0] for g in range(groups))))
    run_tasks(gather_losers_task, LosersTask(str(folder), units, split_files), [(g,) for g in range(groups)],
              f"{stage} losers by unit group", record=_gather_record)


@dataclass(frozen=True)
class LosersTask:
    """What the routing's tasks share: the global stage's work folder, the input units, and (for the gather) where
    the split files were routed."""

    folder: str
    units: int
    split: Received | None = None


def _split_record(task: LosersTask, stem: str) -> Location:
    return location(task.folder) / LOSERS_BY_UNIT / f"{stem}.json"


def split_losers_task(task: LosersTask, stem: str) -> dict[str, int]:
    """Cut one losers file of a global stage (`folder/<stem>.arrow`) by input unit: one shuffle file
    `folder/losers-by-unit/<stem>.shuffle` whose partition u holds unit u's losers."""
    root, units = location(task.folder), task.units
    losers = read_work_table(root / f"{stem}.arrow").sort_by([("order", "ascending")])
    unit = (losers.column("order").to_numpy() >> ROW_BITS).astype(np.int64)
    size = write_shuffle(root / LOSERS_BY_UNIT / f"{stem}{SHUFFLE_SUFFIX}", losers, unit, units)
    return {"losers": losers.num_rows, "bytes": size}


def _unit_group(units: int) -> int:
    """Input units per group: contiguous ranges, so a group's units are adjacent partitions of every file."""
    return -(-units // min(units, UNIT_GROUPS))


def _unit_range(group: int, units: int) -> tuple[int, int]:
    """The input units [u0, u1) of a group."""
    size = _unit_group(units)
    return group * size, min(units, (group + 1) * size)


def _gather_record(task: LosersTask, group: int) -> Location:
    return location(task.folder) / LOSERS_BY_UNIT / f"g{group:05d}.json"


def gather_losers_task(task: LosersTask, group: int) -> dict[str, int]:
    """The losers of one group of input units, from the group's range of every split file as routed (one read each:
    its units are adjacent partitions) into one file `losers-by-unit/gNNNNN.shuffle`, partitioned by the unit
    within the group."""
    split_files, units = task.split, task.units
    root = location(task.folder) / LOSERS_BY_UNIT
    u0, u1 = _unit_range(group, units)
    losers = split_files.read(u0, LOSER_SCHEMA, through=u1, partition_column="unit").sort_by([("order", "ascending")])
    unit = losers.column("unit").to_numpy().astype(np.int64) - u0
    write_shuffle(root / f"g{group:05d}{SHUFFLE_SUFFIX}", losers.drop(["unit"]), unit, u1 - u0)
    return {"losers": losers.num_rows}


def unit_losers(folder: Location, unit_index: int, units: int) -> pa.Table:
    """The losers of input unit `unit_index`: its range of its group's file (`gather_losers_task`)."""
    group = unit_index // _unit_group(units)
    u0, u1 = _unit_range(group, units)
    return read_shuffle([folder / LOSERS_BY_UNIT / f"g{group:05d}{SHUFFLE_SUFFIX}"], unit_index - u0, u1 - u0, LOSER_SCHEMA)
