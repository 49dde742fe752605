"""Map stages over a block: run back to back over its batches, their drops counted and written (`OUT/dropped/`); and a
global stage's map half, by kind of key (`send_kinds`).

Used by the read task (normalize, which rewrites the text before the block is written once) and by every segment
task (language id, the filters, a user's stages)."""

from __future__ import annotations

from typing import Callable

import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA, DROPPED_SCHEMA
from datapipe.core.exchange import Shuffle
from datapipe.core.shards import atomic_write_table
from datapipe.core.storage import Location
from datapipe.curation.counters import Counters
from datapipe.curation.plan import Plan
from datapipe.curation.user_stages import UserStageFailed
from stages.base import ResolvingStage, Stage
from stages.minhash import MinHashStage


def write_dropped(plan: Plan, stage_name: str, block: str, parts: list[pa.RecordBatch]) -> None:
    """The drops of a block's stage (its non-empty parts) as `OUT/dropped/<stage>-<block>.parquet`."""
    parts = [p for p in parts if p.num_rows]
    if parts:
        table = pa.Table.from_batches(parts, schema=DROPPED_SCHEMA)
        atomic_write_table(plan.out / "dropped" / f"{stage_name}-{block}.parquet", table, format="parquet",
                           published=True)


def run_stages(plan: Plan, stages: list[Stage], table: pa.Table, counters: Counters, dropped_parts: list[pa.RecordBatch]) -> pa.Table:
    """Map stages back to back over `table`'s batches: the documents they keep; their drops are counted
    and added to `dropped_parts`. A user's stage that fails says where its documents lie in the inputs."""
    out_batches = []
    for batch in table.to_batches(max_chunksize=plan.cfg.read.batch_size):
        for stage in stages:
            try:
                result = stage(batch)
            except UserStageFailed as failed:
                raise failed.located(plan.units) from None
            counters.count_stage(stage.name, batch, result.kept)
            dropped_parts.append(result.dropped)
            batch = result.kept
        out_batches.append(batch)
    return pa.Table.from_batches(out_batches, schema=DOC_SCHEMA)


def send_kinds(keys_of: Callable[[pa.RecordBatch], dict[str, pa.Table]], spec_of: Callable[[str], Shuffle],
               table: pa.Table, sender: str) -> dict[str, int]:
    """A global stage's map half over `table`: the key rows of each kind (`keys_of(batch)`, each with a `partition`
    column) as the sender's one file of that kind's exchange (`spec_of(kind)`). Every kind's file is written, empty
    or not: the receivers read the files of known senders, no listing. Their sizes by kind."""
    batches = [b for b in table.to_batches() if b.num_rows] or [pa.RecordBatch.from_pylist([], schema=DOC_SCHEMA)]
    emitted = [keys_of(b) for b in batches]  # an empty block still gives each kind's schema
    sizes = {}
    for kind in emitted[0]:
        keys = pa.concat_tables([e[kind] for e in emitted])
        sizes[kind] = spec_of(kind).send(sender, keys.drop(["partition"]), keys.column("partition").to_numpy())
    return sizes


def by_kind(stage: MinHashStage | ResolvingStage, folder: Location) -> Callable[[str], Shuffle]:
    """The exchange of each kind of a stage's keys: `folder/<kind>/<sender>.shuffle`."""
    return lambda kind: Shuffle(f"{stage.name} {kind}", str(folder / kind), stage.partitions, records=str(folder / "records"))
