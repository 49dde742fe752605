"""Unique document ids: a document whose id an earlier document of the run already has is renamed.

The rule, in global input order (the `order` key, so the same on every run, resume and executor):
the first document with id `x` keeps it, the second becomes `x#2`, the third `x#3`, and so on. When
the new name is itself an id of the run (an input that already holds an `x#2`) the number goes up to
the next free one. Renamed documents then go through every stage like the others: an exact copy
(same id, same text) is still dropped by exact dedup, as a duplicate of the first.

Why rename rather than refuse: duplicate ids are common in real inputs (ids that restart in every
file, concatenated dumps), and refusing would stop a whole run for a problem that has one
deterministic fix; every id in the shards, `dropped/` and `datapipe stats --why` then names one
document. `stats.json` counts the renamed documents (`duplicate_ids`).

How, without holding every id in one place: the read task writes each block's (id, order, hash)
keys as one shuffle file (`datapipe.core.shuffle`), the hash being of the id's base (the id without trailing `#N` suffixes, so `x`, `x#2` and
`x#2#3` meet in one partition); one task per hash partition names the renames of its ids; the
first segment task of each block applies its unit's renames before any stage runs.

A partition writes a renames file only for the units it renames in, so a unit's folder alone cannot say that a
file of it is missing (deleted, or lost with a power cut): the driver keeps the list of every file the tasks
wrote (`RENAME_FILES`, from their records), and a file on that list that is gone is a `DamagedWorkFile`.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from datapipe.core.schema import ROW_BITS
from datapipe.core.workfiles import read_work_table, write_work_table
from datapipe.core.exchange import Shuffle, run_reduces
from datapipe.core.storage import Location

KEY_SCHEMA = pa.schema([("id", pa.string()), ("order", pa.int64()), ("hash", pa.uint64())])
RENAME_SCHEMA = pa.schema([("order", pa.int64()), ("id", pa.string()), ("new_id", pa.string())])
FOLDER = "ids"
# The renames files the partitions wrote, (unit, file name in the unit's folder): one row per file, so at most
# units x partitions rows, and as few as there are units with duplicate ids.
RENAME_FILES = "rename-files.arrow"
RENAME_FILES_SCHEMA = pa.schema([("unit", pa.int64()), ("file", pa.string())])
_SUFFIXES = re.compile(r"(#\d+)+$")


def base_of(doc_id: str) -> str:
    """The id without trailing `#N` suffixes: every name the rule can give `x` shares x's base."""
    return _SUFFIXES.sub("", doc_id) if "#" in doc_id else doc_id


def ids_exchange(work: Location, partitions: int) -> Shuffle:
    """The renames' exchange: every block's id keys (`ids/keys/<block>.shuffle`) to one task per hash partition."""
    return Shuffle("unique_ids", str(work / FOLDER / "keys"), partitions, records=str(work / FOLDER),
                   receiver_name=f"resolved-p{{:03d}}-of-{partitions:03d}", schema=KEY_SCHEMA,
                   reduce_step="")


def send_keys(work: Location, block: str, table: pa.Table, partitions: int) -> int:
    """Send the (id, order, hash of the id's base) keys of one block's documents, partitioned by hash % partitions;
    the file's bytes."""
    ids = table.column("id")
    hashes = np.fromiter((xxhash.xxh64_intdigest(base_of(i).encode()) for i in ids.to_pylist()), np.uint64, count=len(ids))
    keys = pa.table([ids, table.column("order"), pa.array(hashes, pa.uint64())], schema=KEY_SCHEMA)
    return ids_exchange(work, partitions).send(block, keys, (hashes % np.uint64(partitions)).astype(np.int64))


def resolve(shared: tuple[Location, int], partition: int, keys: pa.Table) -> dict[str, Any]:
    """Name the renames of one hash partition of the ids (its rows of every block's key file): write them per input
    unit and return {"renamed": n, "examples": [[id, new_id, order], ...] (the first few by order), "units": [the
    units renamed in]}."""
    work, partitions = shared
    renames = _renames(keys)
    units = pc.shift_right(renames.column("order"), ROW_BITS) if renames.num_rows else pa.array([], pa.int64())
    renamed_units = sorted(pc.unique(units).to_pylist())
    for u in renamed_units:
        part = renames.filter(pc.equal(units, u))
        write_work_table(work / FOLDER / "renames" / f"u{u:06d}" / _renames_file(partition, partitions), part)
    examples = [[r["id"], r["new_id"], r["order"]] for r in renames.slice(0, 10).to_pylist()]
    return {"renamed": renames.num_rows, "examples": examples, "units": renamed_units}


def _renames_file(partition: int, partitions: int) -> str:
    return f"p{partition:03d}-of-{partitions:03d}.arrow"


def resolve_ids(run_tasks: Callable[..., list[Any]], work: Location, blocks: list[str], partitions: int,
                largest_bytes: int) -> list[dict[str, Any]]:
    """Part of reading: the blocks' key files (the largest of `largest_bytes`, as the read tasks measured) routed to
    the partitions, then one task per hash partition of the ids names its renames (applied as segment 0 reads)."""
    results = run_reduces(run_tasks, ids_exchange(work, partitions), resolve, (work, partitions), blocks,
                          [{"bytes": largest_bytes}])
    # Written on every run from the records (a resumed run's too): a lost or damaged list is made again.
    files = sorted((u, _renames_file(p, partitions)) for p, r in enumerate(results) for u in r["units"])
    write_work_table(work / FOLDER / RENAME_FILES,
                     pa.table([[u for u, _ in files], [f for _, f in files]], schema=RENAME_FILES_SCHEMA))
    return results


def _renames(keys: pa.Table) -> pa.Table:
    """For all keys of one partition: (order, id, new_id) of every document that is not the first
    (by order) with its id, sorted by order."""
    if keys.num_rows == 0:
        return RENAME_SCHEMA.empty_table()
    counts = keys.group_by("id").aggregate([("order", "count")])
    repeated = counts.filter(pc.greater(counts.column("order_count"), 1)).column("id")
    if len(repeated) == 0:
        return RENAME_SCHEMA.empty_table()
    rows = keys.filter(pc.is_in(keys.column("id"), value_set=repeated)).sort_by([("order", "ascending")])
    # Names already taken: every id of the partition that could clash with a new `x#N` name.
    bases = {base_of(i) for i in repeated.to_pylist()}
    suffixed = keys.column("id").filter(pc.match_substring(keys.column("id"), "#"))
    taken = {i for i in suffixed.to_pylist() if base_of(i) in bases}
    seen: dict[str, int] = {}
    orders, ids, new_ids = [], [], []
    for order, doc_id in zip(rows.column("order").to_pylist(), rows.column("id").to_pylist()):
        n = seen.get(doc_id, 0) + 1
        seen[doc_id] = n
        if n == 1:
            continue  # the first keeps its id
        k = n
        while f"{doc_id}#{k}" in taken:
            k += 1
        new = f"{doc_id}#{k}"
        taken.add(new)
        seen[doc_id] = k  # the next copy numbers on from here
        orders.append(order)
        ids.append(doc_id)
        new_ids.append(new)
    return pa.table([pa.array(orders, pa.int64()), pa.array(ids, pa.string()), pa.array(new_ids, pa.string())],
                    schema=RENAME_SCHEMA)


def apply(work: Location, unit_index: int, table: pa.Table) -> pa.Table:
    """`table` (documents of one block of input unit `unit_index`) with its renamed ids replaced: the unit's renames
    files that `RENAME_FILES` lists, each of them (one that is gone is a DamagedWorkFile, never no renames)."""
    if table.num_rows == 0:
        return table
    listed = read_work_table(work / FOLDER / RENAME_FILES)
    files = listed.filter(pc.equal(listed.column("unit"), unit_index)).column("file").to_pylist()
    if not files:
        return table
    folder = work / FOLDER / "renames" / f"u{unit_index:06d}"
    renames = pa.concat_tables([read_work_table(folder / f) for f in files])
    where = pc.index_in(table.column("order"), value_set=renames.column("order"))
    if pc.all(pc.is_null(where)).as_py():
        return table
    new_ids = pc.coalesce(renames.column("new_id").take(where), table.column("id"))
    return table.set_column(table.schema.get_field_index("id"), table.schema.field("id"), new_ids)


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The `duplicate_ids` entry of stats.json from the partitions' results."""
    examples = sorted((e for r in results for e in r["examples"]), key=lambda e: e[2])[:10]
    return {"renamed": sum(r["renamed"] for r in results),
            "rule": "the 2nd document with id X (in input order) becomes X#2, the 3rd X#3, ...",
            "examples": [{"id": i, "renamed_to": n} for i, n, _ in examples]}
