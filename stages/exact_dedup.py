"""Exact dedup: a 128-bit hash of the (normalized) text, decided globally (`stages.base.GlobalStage`).

`keys` gives each document's hash and hash partition; `decide` gets every key of one partition, from every
input file, worker and node, and within each hash keeps the first document by global input `order`: every
other one is dropped with reason `exact_duplicate` and the kept id. The winner does not depend on how many
workers or partitions were used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import xxhash

from datapipe.core.config import check, note
from stages.base import LOSER_SCHEMA, GlobalStage

MIN_PARTITIONS = 16  # `partitions: auto` never goes below this
KEY_SCHEMA = pa.schema([("hash", pa.binary(16)), ("partition", pa.uint32()), ("order", pa.int64()), ("id", pa.string())])


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
        self.config, self.partitions = config, config.partitions

    def keys(self, batch: pa.RecordBatch) -> pa.Table:
        digests = [xxhash.xxh3_128_digest(t.encode()) for t in batch.column("text").to_pylist()]
        # the partition comes from the first 4 hash bytes; any stable function of the hash would do
        partition = [int.from_bytes(d[:4], "little") % self.partitions for d in digests]
        return pa.table([pa.array(digests, pa.binary(16)), pa.array(partition, pa.uint32()), batch.column("order"),
                         batch.column("id")], schema=KEY_SCHEMA)

    def decide(self, keys: pa.Table) -> pa.Table:
        """Every non-first document (by order) of each hash: sorted by (hash, order), a row equal to the one before
        loses to its group's head."""
        keys = keys.sort_by([("hash", "ascending"), ("order", "ascending")])
        col = keys.column("hash").combine_chunks()
        words = np.frombuffer(col.buffers()[1], np.uint64, count=2 * (col.offset + len(col)))[2 * col.offset :].reshape(-1, 2)
        is_loser = np.zeros(len(words), dtype=bool)
        is_loser[1:] = (words[1:] == words[:-1]).all(axis=1)
        head = np.maximum.accumulate(np.where(is_loser, 0, np.arange(len(words))))  # each row's winner
        rows = np.flatnonzero(is_loser)
        return pa.table([keys.column("order").take(rows), pa.array(["exact_duplicate"] * len(rows), pa.string()),
                         keys.column("id").take(head[rows])], schema=LOSER_SCHEMA)
