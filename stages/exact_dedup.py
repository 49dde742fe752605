"""Exact dedup: a 128-bit hash of the (normalized) text, resolved globally.

A global stage (`stages.base.GlobalStage`). Its map half, `keys(batch)`, computes each document's
hash and hash partition. Its resolve half runs one task per partition: `partition_losers(keys)`
decides, for the keys of one partition (gathered from every input file, worker and node by the
run's shuffle), which documents lose: within each hash, the first document by global input
`order` is kept and every other one is dropped with reason `exact_duplicate` and the kept id. The
winner does not depend on how many workers or partitions were used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import pyarrow as pa
import xxhash

from datapipe.core.config import check, note
from datapipe.core.workfiles import write_work_table
from datapipe.core.storage import Location, location
from datapipe.core.exchange import Exchange, Received, average_sender_bytes, route
from stages.base import LOSER_SCHEMA, GlobalStage, RunTasks

MIN_PARTITIONS = 16  # `partitions: auto` never goes below this

KEY_SCHEMA = pa.schema(
    [("hash", pa.binary(16)), ("partition", pa.uint32()), ("order", pa.int64()), ("id", pa.string())]
)
KEY_BYTES = 64  # a document's key, about (its 16-byte hash, order and id): what sizes a combine task's share


@dataclass(frozen=True, kw_only=True)
class ExactDedupConfig:
    enabled: bool = note(True, help="drop exact duplicates of the normalized text, globally (first by input order wins)")
    partitions: int | Literal["auto"] = note(
        "auto", help="hash partitions of the global dedup shuffle (and of the unique-ids one); auto = from the input's "
        "size, so that no partition's task needs more than ray.task_memory_gib (at least 16)")

    def __post_init__(self) -> None:
        check(self.partitions == "auto" or self.partitions > 0, f"partitions must be > 0 or 'auto', got {self.partitions!r}")


class ExactDedupStage(GlobalStage):
    name = "exact_dedup"

    def __init__(self, config: ExactDedupConfig) -> None:
        if config.partitions == "auto":  # the run sizes it from the input; used on its own, the floor
            config = dataclasses.replace(config, partitions=MIN_PARTITIONS)
        self.config = config

    def keys(self, batch: pa.RecordBatch) -> dict[str, pa.Table]:
        """`keys`: each document's hash, hash partition, order and id."""
        digests = [xxhash.xxh3_128_digest(t.encode()) for t in batch.column("text").to_pylist()]
        # The partition comes from the first 4 hash bytes; any stable function of the hash would do.
        partition = [int.from_bytes(d[:4], "little") % self.config.partitions for d in digests]
        keys = pa.table(
            [pa.array(digests, pa.binary(16)), pa.array(partition, pa.uint32()), batch.column("order"), batch.column("id")],
            schema=KEY_SCHEMA,
        )
        return {"keys": keys}

    @property
    def partitions(self) -> int:
        return self.config.partitions

    def resolve(self, run_tasks: RunTasks, folder: Location, out_dir: Location, senders: Sequence[str],
                documents: int = 0) -> dict[str, Any]:
        """The senders' key files (`folder/keys/<block>.shuffle`) routed to the partitions (`exchange.route`: requests
        grow as blocks + partitions), then one task per partition: `folder/losers-tNNN.arrow` from partition p of
        the received files."""
        items = [(p,) for p in range(self.config.partitions)]
        names = tuple(s.rsplit("/", 1)[-1] for s in senders)
        keys = route(run_tasks, Exchange(self.name, str(folder / "keys"), names, self.config.partitions,
                                         average_sender_bytes(documents, len(senders), KEY_BYTES)))
        done = run_tasks(partition_task, PartitionTask(str(folder), keys), items, f"{self.name} resolve",
                         record=partition_record)
        return {"removed": sum(r["losers"] for r in done)}

    @staticmethod
    def partition_losers(keys: pa.Table) -> pa.Table:
        """Losers among `keys` (all keys of one partition): every non-first document of each hash."""
        if keys.num_rows == 0:
            return LOSER_SCHEMA.empty_table()
        keys = keys.sort_by([("hash", "ascending"), ("order", "ascending")])
        col = keys.column("hash").combine_chunks()
        words = np.frombuffer(col.buffers()[1], dtype=np.uint64, count=2 * (col.offset + len(col)))[2 * col.offset :]
        words = words.reshape(-1, 2)
        is_loser = np.zeros(len(words), dtype=bool)
        is_loser[1:] = (words[1:] == words[:-1]).all(axis=1)
        # Index of each row's group head (the winner): the last non-loser at or before it.
        head = np.maximum.accumulate(np.where(is_loser, 0, np.arange(len(words))))
        loser_rows = np.flatnonzero(is_loser)
        ids = keys.column("id")
        return pa.table(
            [
                keys.column("order").take(loser_rows),
                pa.array(["exact_duplicate"] * len(loser_rows), pa.string()),
                ids.take(head[loser_rows]),
            ],
            schema=LOSER_SCHEMA,
        )


@dataclass(frozen=True)
class PartitionTask:
    """What the resolve's partition tasks share: the stage's work folder and where its keys were routed."""

    folder: str
    keys: Received


def partition_record(task: PartitionTask, partition: int) -> Location:
    """Where a partition task's record goes (the run loop checks it): `folder/losers-tNNN.json`."""
    return location(task.folder) / f"losers-t{partition:03d}.json"


def partition_task(task: PartitionTask, partition: int) -> dict[str, int]:
    """The losers of one partition (its rows of every key file, as routed), written to `folder/losers-tNNN.arrow`
    (t = the partition); their count."""
    folder, keys = task.folder, task.keys.read(partition)
    losers = ExactDedupStage.partition_losers(keys) if keys is not None else LOSER_SCHEMA.empty_table()
    write_work_table(location(folder) / f"losers-t{partition:03d}.arrow", losers)
    return {"losers": losers.num_rows}
