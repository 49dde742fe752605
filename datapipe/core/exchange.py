"""The one exchange: how the senders' shuffle files of a global step reach its receivers.

Every global decision of a run moves rows the same way, through one contract that owns both ends, `Shuffle`: a step's
M sending tasks each write one shuffle file (`Shuffle.send`: `datapipe.core.shuffle`) holding its rows of all P
partitions and return its measured size; R receiving tasks then read their partitions (`run_reduces`, or `routed`
for a receiver of the caller's own). `map_reduce` runs both ends and names every file and record. Where the
receivers read is decided in one place, `route` (by the senders' largest file, as measured):

- **directly**, each receiver reading its range of every sender's file, where that is few files a receiver and few
  requests: at most RECEIVER_FILES senders and 2 M R <= 4 (M + R) (or where no two senders' files fit one merge);
- else **combined**: combine tasks merge the senders, as many to a group as fit one task's COMBINE_BYTES (each
  sender's file read whole, in one request), into at most RECEIVER_FILES groups; a receiver reads one file per
  group. Where a group's files do not fit a task whole, they are first merged whole into batches of as many as fit
  (a level more), and the batches' groups are cut into partition ranges, one task each: a receiver reads one file of
  its range per group. Requests grow as M + batches x ranges + R x groups, not M x R, and a combine task holds at
  most COMBINE_BYTES. Each level's senders' files go once its combines are done.

Either way the receivers read the same rows in the same order, so the outputs do not depend on the choice. The
combine tasks are recorded through `run_tasks` (the run loop checks the records), so a resumed run skips them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.shuffle import SUFFIX, read_shuffle, shuffle_bytes, shuffle_files, write_shuffle
from datapipe.core.storage import Location, location, remove_files, spread

# sender files one combine task merges, at most, unless more are needed for RECEIVER_FILES: its reads are
# S3_CONNECTIONS in flight, so COMBINE_SENDERS / S3_CONNECTIONS rounds of a request's latency; and groups this large
# keep the exchanges of 1 TB's layout within 4 x (senders + receivers) where its files are small, even one its
# receivers read twice (tests/scripts/test_cost_model.py)
COMBINE_SENDERS = 4096
COMBINE_BYTES = 1 << 30  # bytes of sender files one combine task holds at most (its senders' ranges, then their merge)
RECEIVER_FILES = 64  # files a receiver reads, at most: the senders are merged into this many groups or fewer


@dataclass(frozen=True)
class Exchange:
    """One exchange as its sending step planned it: `senders` (names) each wrote `folder/<name>.shuffle` of
    `partitions`, the largest `largest_bytes` (measured by the senders, or estimated where they do not say).
    `spans`: the partitions a receiver's span starts at, where a receiver reads several adjacent partitions
    (default: a receiver per partition). `source_column`: an int32 column of that name gives each row's sender
    (its index in `senders`). `records`: where the combine tasks' records go (default `<folder's parent>/records`,
    outside any folder deleted while they count)."""

    desc: str
    folder: str
    senders: tuple[str, ...]
    partitions: int
    largest_bytes: int
    spans: tuple[int, ...] | None = None
    source_column: str | None = None
    records: str | None = None

    @property
    def receivers(self) -> int:
        return len(set(self.spans)) if self.spans is not None else self.partitions


@dataclass(frozen=True)
class SenderFiles:
    """The senders' own shuffle files, read directly by every receiver."""

    folder: str
    names: tuple[str, ...]
    partitions: int
    source_column: str | None = None

    def read(self, p: int, schema: pa.Schema | None = None, **kwargs: Any) -> pa.Table | None:
        """`read_shuffle` of partition p (or p to `through` - 1) of every sender's file."""
        return read_shuffle(shuffle_files(self.folder, self.names), p, self.partitions, schema,
                            source_column=self.source_column, **kwargs)


@dataclass(frozen=True)
class Combined:
    """Where the receivers of a combined exchange read: the senders, `per_file` to a group, merged into one file per
    group and partition range. A range is a run of adjacent partitions (`starts[r]` up to the next start); with one
    range a file holds every partition. A receiver of partition p reads the files of p's range, one per group."""

    folder: str
    partitions: int
    senders: int
    per_file: int
    starts: tuple[int, ...] = (0,)
    prefix: str = "combined"  # the files' names ("batch": a first level's, `plan`)

    @property
    def groups(self) -> int:
        return -(-self.senders // self.per_file)

    def range_of(self, p: int) -> int:
        return bisect.bisect_right(self.starts, p) - 1

    def bounds(self, r: int) -> tuple[int, int]:
        return self.starts[r], self.starts[r + 1] if r + 1 < len(self.starts) else self.partitions

    def name(self, r: int, k: int) -> str:
        return f"{self.prefix}-{k:05d}" if len(self.starts) == 1 else f"{self.prefix}-r{r:03d}-{k:05d}"

    def files(self, r: int) -> list[Location]:
        """The files of range r, one per group."""
        return shuffle_files(self.folder, [self.name(r, k) for k in range(self.groups)])

    def read(self, p: int, schema: pa.Schema | None = None, *, through: int | None = None, **kwargs: Any) -> pa.Table | None:
        """`read_shuffle` of partition p (or p to `through` - 1) from the files holding it: one range of each file of
        its range, file by file (a span over several ranges: range by range; an exchange's `spans` avoid that)."""
        end = p + 1 if through is None else through
        tables = []
        for r in range(self.range_of(p), self.range_of(end - 1) + 1):
            lo, hi = self.bounds(r)
            tables.append(read_shuffle(self.files(r), max(p, lo), self.partitions, schema, through=min(end, hi), **kwargs))
        return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")


Received = Combined | SenderFiles  # where an exchange's receivers read: both `.read(p, schema, through=...)`


def _fit(largest_bytes: int) -> int:
    """Sender files of `largest_bytes` one combine task holds whole: three times over (the ranges read, the merged
    table, its bytes) within COMBINE_BYTES."""
    return COMBINE_BYTES // (3 * max(int(largest_bytes), 1))


def combine_layout(folder: str | Location, senders: int, partitions: int, largest_bytes: int,
                   spans: Sequence[int] | None = None) -> Combined:
    """How `senders` files of at most `largest_bytes` each are merged. As many senders to a group as fit one combine
    task's COMBINE_BYTES whole (three times over: the ranges read, the merged table, its bytes), but never fewer
    than make RECEIVER_FILES groups; where a group's files do not fit whole, its combine is cut into partition
    ranges, one task each, so a task holds COMBINE_BYTES at most (the partitions are hashes: a range holds its
    share of the bytes). `spans`: the partitions a receiver's span may start at (default: any), which the
    ranges' starts are taken from, so a receiver's span lies in one range."""
    largest = max(int(largest_bytes), 1)
    fit = _fit(largest)
    per_file = max(-(-senders // RECEIVER_FILES), min(max(senders, 1), COMBINE_SENDERS, max(1, fit)))
    cuts = sorted(set(spans)) if spans is not None else list(range(partitions))
    ranges = max(1, min(len(cuts), -(-3 * per_file * largest // COMBINE_BYTES)))
    starts = tuple(cuts[i * len(cuts) // ranges] for i in range(ranges)) if ranges > 1 else (0,)
    return Combined(str(folder), partitions, senders, per_file, starts)


def _one_level(exchange: Exchange) -> Received:
    """The senders' own files where a receiver reads few of them and the requests stay within 4 x (senders +
    receivers), or where no two senders' files fit one combine task; else the combined files."""
    m, r = len(exchange.senders), exchange.receivers
    combined = combine_layout(exchange.folder, m, exchange.partitions, exchange.largest_bytes, exchange.spans)
    if (m <= RECEIVER_FILES and 2 * m * r <= 4 * (m + r)) or combined.per_file < 2:
        return SenderFiles(exchange.folder, exchange.senders, exchange.partitions, exchange.source_column)
    return combined


def plan(exchange: Exchange) -> tuple[list[tuple[Exchange, Combined]], Received]:
    """The combines `exchange` needs, in order (each level's exchange and how it is combined), and where its receivers
    read. Where a group's senders do not fit one combine task whole, each sender's file would be read by every partition
    range's task (2 x senders x ranges requests): the senders are first merged whole into batches of as many as fit a
    task (each file read once, in one request), and the batches' files are then exchanged as any senders' are."""
    received = _one_level(exchange)
    fit = _fit(exchange.largest_bytes)
    if not isinstance(received, Combined) or len(received.starts) == 1 or fit < 2:
        return ([(exchange, received)] if isinstance(received, Combined) else []), received
    m = len(exchange.senders)
    batches = Combined(exchange.folder, exchange.partitions, m, min(fit, m), prefix="batch")
    merged = Exchange(f"{exchange.desc} batches", exchange.folder, tuple(batches.name(0, k) for k in range(batches.groups)),
                      exchange.partitions, batches.per_file * int(exchange.largest_bytes), exchange.spans,
                      records=exchange.records)  # the sender column, where asked for, is in the batches' rows
    then, received = plan(merged)
    return [(exchange, batches), *then], received


def layout(exchange: Exchange) -> Received:
    """Where `exchange`'s receivers will read (`route` decides by this, the cost model counts by it): `plan`'s."""
    return plan(exchange)[1]


def route(run_tasks: Callable[..., list], exchange: Exchange) -> Received:
    """Where `exchange`'s receivers read (`layout`), once the combine tasks it needs have run (`plan`: one per group of
    senders and partition range, each recorded, level after level) and the senders' files each level merged are
    deleted."""
    combines, received = plan(exchange)
    for level, combined in combines:
        _combine(run_tasks, level, combined)
    return received


def _combine(run_tasks: Callable[..., list], exchange: Exchange, combined: Combined) -> None:
    groups = [list(exchange.senders[i : i + combined.per_file]) for i in range(0, len(exchange.senders), combined.per_file)]
    records = location(exchange.records) if exchange.records is not None else location(exchange.folder).parent / "records"
    items = [(r, k, g) for r in range(len(combined.starts)) for k, g in enumerate(groups)]
    run_tasks(combine_task, CombineTask(combined, exchange.source_column, str(records)), items, f"{exchange.desc} combine",
              record=combine_record)
    # every combine task has left its record: the senders' files are read by no one now (a resume skips the combines)
    remove_files([spread(p) for p in shuffle_files(exchange.folder, exchange.senders)])


def largest_sent(results: Sequence[dict[str, Any]], key: str = "bytes") -> int:
    """The largest sender file among the senders' results (each names its file's size under `key`)."""
    return max((int(r[key]) for r in results if key in r), default=0)


def rows_bytes(table: pa.Table) -> int:
    """The bytes `table`'s rows take in a shuffle file, measured: its file less an empty one's (one partition)."""
    one = np.zeros(table.num_rows, np.int64)
    return len(shuffle_bytes(table, one, 1)) - len(shuffle_bytes(table.slice(0, 0), one[:0], 1))


def average_sender_bytes(documents: int, senders: int, bytes_per_document: int) -> int:
    """The average sender's bytes: `documents` over `senders`, `bytes_per_document` each (an exchange's estimate
    where its senders do not report their files' bytes)."""
    return max(1, documents // max(senders, 1)) * bytes_per_document


@dataclass(frozen=True)
class CombineTask:
    """What an exchange's combine tasks share: the layout they write, the column naming each row's sender (or
    None), and the folder of their records."""

    layout: Combined
    source_column: str | None
    records: str


def combine_task(task: CombineTask, r: int, k: int, names: list[str]) -> dict[str, int]:
    """Merge range r of the shuffle files `folder/<name>.shuffle` (group k's senders) into one file with the same
    partitions (those outside the range empty): each sender's range is read whole (one range after its header),
    and within a partition the rows keep the senders' order, so a receiver of one partition reads exactly the rows
    it read from the senders. With `source_column`, an int32 column of that name holds each row's sender: its
    index among all senders."""
    layout_, source_column = task.layout, task.source_column
    lo, hi = layout_.bounds(r)
    table = read_shuffle(shuffle_files(layout_.folder, names), lo, layout_.partitions, through=hi,
                         partition_column="partition", source_column=source_column)
    if source_column is not None:
        first = pa.scalar(k * layout_.per_file, pa.int32())
        at = table.schema.get_field_index(source_column)
        table = table.set_column(at, source_column, pc.add(table.column(source_column), first))
    part = table.column("partition").to_numpy().astype(np.int64)
    write_shuffle(location(layout_.folder) / f"{layout_.name(r, k)}{SUFFIX}", table.drop(["partition"]), part,
                  layout_.partitions)
    return {"rows": table.num_rows}


def combine_record(task: CombineTask, r: int, k: int, *_: object) -> Location:
    """In the records folder of the exchange (not in the combined folder: a phase may delete a consumed folder
    whole, and its combine stays done)."""
    combined = task.layout
    return location(task.records) / f"combine-{location(combined.folder).name}-{combined.name(r, k).removeprefix('combined-')}.json"


@dataclass(frozen=True)
class Shuffle:
    """One exchange as a contract that owns both ends: its senders' files, how they are routed, its receivers' reads
    and every task's record. A map (`send`, in any task, or `run_maps`' tasks) writes one file per sender,
    `folder/<sender>.shuffle`, of `partitions`; `run_reduces` routes the files by the sizes the maps measured
    (`route`) and runs one reduce task per receiver, which gets its rows (`routed`: where they read, for a receiver
    of the caller's own). A receiver reads one partition, or with
    `spans` (the partitions the receivers start at) its run of adjacent ones, with a `partition` column.
    Records: a map task's `records/<sender_record><sender>.json`, a reduce task's `records/<receiver_name>.json`
    (formatted with the receiver's index). `schema`: what a receiver of no rows gets (default: the senders' files' schema). Steps,
    as progress shows them: `<desc> <map_step>`, `<desc> combine`, `<desc> <reduce_step>` (`step`)."""

    desc: str
    folder: str
    partitions: int
    records: str
    receiver_name: str = "p{:03d}"
    sender_record: str = ""
    map_step: str = "send"
    reduce_step: str = "receive"
    spans: tuple[int, ...] | None = None
    schema: pa.Schema | None = None
    source_column: str | None = None  # an int32 column of this name gives each received row's sender (its index)
    combine_records: str | None = None  # the combine tasks' records (default: `<folder's parent>/records`)

    def file(self, sender: str) -> Location:
        return location(self.folder) / f"{sender}{SUFFIX}"

    def send(self, sender: str, table: pa.Table, partition: np.ndarray) -> int:
        """The map side: `table`'s rows as the sender's file, row i to partition `partition[i]`; its bytes."""
        return write_shuffle(self.file(sender), table, np.asarray(partition, np.int64), self.partitions)

    def read_sent(self, sender: str, p: int) -> pa.Table:
        """Partition p of one sender's file (a receiver that is not a reduce task, reading one file)."""
        return read_shuffle([self.file(sender)], p, self.partitions, self.schema)

    def receiver_spans(self) -> list[tuple[int, int]]:
        """Each receiver's partitions [p0, p1)."""
        starts = sorted(set(self.spans)) if self.spans is not None else list(range(self.partitions))
        return list(zip(starts, [*starts[1:], self.partitions]))

    def record(self, stem: str) -> Location:
        return location(self.records) / f"{stem}.json"

    def step(self, name: str) -> str:
        """A step's name as progress shows it: `<desc> <name>` (the desc alone for an empty name)."""
        return f"{self.desc} {name}" if name else self.desc


# a map: map(shared, sender, *args) -> (rows, each row's partition) or (rows, partitions, more of its result)
MapFn = Callable[..., tuple]
# a reduce: reduce(shared, first partition, rows) -> its JSON-able result (it writes its own outputs)
ReduceFn = Callable[[Any, int, pa.Table], dict]


@dataclass(frozen=True)
class MapTask:
    spec: Shuffle
    fn: MapFn
    shared: Any


def map_task(task: MapTask, sender: str, *args: Any) -> dict[str, Any]:
    """One map: its rows sent as the sender's file; its result, with the file's `bytes`."""
    table, partition, *more = task.fn(task.shared, sender, *args)
    return {**(more[0] if more else {}), "bytes": task.spec.send(sender, table, partition)}


def map_record(task: MapTask, sender: str, *_: Any) -> Location:
    return task.spec.record(f"{task.spec.sender_record}{sender}")


def run_maps(run_tasks: Callable[..., list], spec: Shuffle, fn: MapFn, shared: Any,
             items: Sequence[tuple]) -> list[dict[str, Any]]:
    """One map task per item (`(sender, *args)`), each recorded: their results, each with its file's `bytes`."""
    return run_tasks(map_task, MapTask(spec, fn, shared), list(items), spec.step(spec.map_step), record=map_record)


@dataclass(frozen=True)
class ReduceTask:
    spec: Shuffle
    fn: ReduceFn
    shared: Any
    received: Received


def reduce_task(task: ReduceTask, receiver: int) -> dict[str, Any]:
    """One receiver: its partition's (or span's) rows of every sender, as routed, given to the reduce."""
    spec = task.spec
    p0, p1 = spec.receiver_spans()[receiver]
    span = {"through": p1, "partition_column": "partition"} if spec.spans is not None else {}
    rows = task.received.read(p0, spec.schema, **span)
    if rows is None:
        raise ValueError(f"{spec.desc}: no sender and no schema: nothing says what its receivers' rows are")
    return task.fn(task.shared, p0, rows)


def reduce_record(task: ReduceTask, receiver: int) -> Location:
    return task.spec.record(task.spec.receiver_name.format(receiver))


def run_reduces(run_tasks: Callable[..., list], spec: Shuffle, fn: ReduceFn, shared: Any, senders: Sequence[str],
                sent: Sequence[dict[str, Any]], memory: int | None = None) -> list[dict[str, Any]]:
    """The senders' files (`sent`: the maps' results, each naming its file's `bytes`) routed by their measured sizes
    (`route`), then one reduce task per receiver, each recorded: their results in receiver order."""
    received = routed(run_tasks, spec, senders, sent)
    receivers = [(r,) for r in range(len(spec.receiver_spans()))]
    return run_tasks(reduce_task, ReduceTask(spec, fn, shared, received), receivers, spec.step(spec.reduce_step),
                     record=reduce_record, **({"memory": memory} if memory is not None else {}))


def planned(spec: Shuffle, senders: Sequence[str], sent: Sequence[dict[str, Any]]) -> Exchange:
    """The exchange of `spec` from `senders` whose files' sizes are `sent` (the maps' results, each naming its
    file's `bytes`; or one estimate, `[{"bytes": n}]`)."""
    return Exchange(spec.desc, spec.folder, tuple(senders), spec.partitions, largest_sent(sent), spec.spans,
                    spec.source_column, spec.combine_records)


def routed(run_tasks: Callable[..., list], spec: Shuffle, senders: Sequence[str], sent: Sequence[dict[str, Any]]) -> Received:
    """Where `spec`'s receivers read the senders' files, routed by their sizes (`planned`, `route`): for receivers
    that are not reduce tasks (one that fits a model on a sample with its own memory, a step of near dedup's)."""
    return route(run_tasks, planned(spec, senders, sent))


def laid_out(spec: Shuffle, senders: Sequence[str], sent: Sequence[dict[str, Any]]) -> Received:
    """Where `routed` put (or will put) the receivers' reads, without running anything (`layout`)."""
    return layout(planned(spec, senders, sent))


def map_reduce(run_tasks: Callable[..., list], spec: Shuffle, map_fn: MapFn, map_shared: Any, items: Sequence[tuple],
               reduce_fn: ReduceFn, reduce_shared: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`run_maps` then `run_reduces`: (the maps' results, the reduces')."""
    sent = run_maps(run_tasks, spec, map_fn, map_shared, items)
    return sent, run_reduces(run_tasks, spec, reduce_fn, reduce_shared, [item[0] for item in items], sent)
