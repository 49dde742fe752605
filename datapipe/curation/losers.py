"""A global stage's losers, routed to the blocks that drop them.

A global stage's decision leaves its losers in `folder/losers-tNNN.arrow`, one file per decision task, each holding
documents of any input unit. Every block task of the next segment needs its own unit's losers, and no process
should hold them all. One exchange routes them (`route_losers`, `by_unit`): its map cuts each losers file by input
unit (`split_losers`), its reduce gathers each group of units' range of every such file into one file
(`gather_losers`), so a block task reads one range of one file (`unit_losers`), not a range of every losers file.
Requests grow as losers files + groups + blocks, not losers files x groups or x blocks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from datapipe.core.schema import ROW_BITS
from datapipe.core.exchange import Shuffle, map_reduce
from datapipe.core.storage import Location, location
from datapipe.core.workfiles import read_work_table
from stages.base import LOSER_SCHEMA, RunTasks

LOSERS_BY_UNIT = "losers-by-unit"  # work/<global stage>/losers-by-unit/: losers-tNNN.shuffle by unit, gNNNNN.shuffle by group
UNIT_GROUPS = 256  # the losers of at most this many groups of input units: one file each (`gather_losers`)


def by_unit(folder: Location, units: int, stage: str) -> Shuffle:
    """The exchange of a global stage's losers files (`folder/losers-tNNN.arrow`) to the groups of input units: a
    group's span starts at its first unit, so it reads one range of each file."""
    spans = tuple(_unit_range(g, units)[0] for g in range(-(-units // _unit_group(units))))
    root = str(location(folder) / LOSERS_BY_UNIT)
    return Shuffle(f"{stage} losers", root, units, records=root, receiver_name="g{:05d}", spans=spans, schema=LOSER_SCHEMA,
                   map_step="by unit", reduce_step="by unit group")


def by_group(folder: Location, group: int, units: int) -> Shuffle:
    """One group's losers, partitioned by the unit within the group: `losers-by-unit/gNNNNN.shuffle`, read by the
    blocks of its units (`unit_losers`)."""
    u0, u1 = _unit_range(group, units)
    root = str(location(folder) / LOSERS_BY_UNIT)
    return Shuffle("losers of a group of units", root, u1 - u0, records=root, schema=LOSER_SCHEMA)


def route_losers(run_tasks: RunTasks, folder: Location, tasks: int, units: int, stage: str) -> None:
    """Route the losers of the `tasks` files in `folder` (a global stage's work folder) to the `units` input units:
    each file cut by unit (`split_losers`), each group of units gathered into one file (`gather_losers`)."""
    files = [(f"losers-t{t:03d}",) for t in range(tasks)]  # one per decision task, always
    map_reduce(run_tasks, by_unit(folder, units, stage), split_losers, str(folder), files, gather_losers, (str(folder), units))


def split_losers(folder: str, stem: str) -> tuple[pa.Table, np.ndarray, dict[str, int]]:
    """One losers file of a global stage (`folder/<stem>.arrow`) by input unit."""
    losers = read_work_table(location(folder) / f"{stem}.arrow").sort_by([("order", "ascending")])
    return losers, (losers.column("order").to_numpy() >> ROW_BITS).astype(np.int64), {"losers": losers.num_rows}


def _unit_group(units: int) -> int:
    """Input units per group: contiguous ranges, so a group's units are adjacent partitions of every file."""
    return -(-units // min(units, UNIT_GROUPS))


def _unit_range(group: int, units: int) -> tuple[int, int]:
    """The input units [u0, u1) of a group."""
    size = _unit_group(units)
    return group * size, min(units, (group + 1) * size)


def gather_losers(shared: tuple[str, int], u0: int, losers: pa.Table) -> dict[str, int]:
    """The losers of the group of units starting at u0 (its range of every split file, with each row's unit as
    `partition`) into the group's one file."""
    folder, units = shared
    group = u0 // _unit_group(units)
    losers = losers.sort_by([("order", "ascending")])
    unit = losers.column("partition").to_numpy().astype(np.int64) - u0
    by_group(location(folder), group, units).send(f"g{group:05d}", losers.drop(["partition"]), unit)
    return {"losers": losers.num_rows}


def unit_losers(folder: Location, unit_index: int, units: int) -> pa.Table:
    """The losers of input unit `unit_index`: its range of its group's file (`gather_losers`)."""
    group = unit_index // _unit_group(units)
    return by_group(folder, group, units).read_sent(f"g{group:05d}", unit_index - _unit_range(group, units)[0])
