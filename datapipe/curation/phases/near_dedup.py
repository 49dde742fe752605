"""The distributed resolution of near-dedup (MinHash-LSH): shuffles and rounds as tasks.

`NearDedupStage` is near dedup as a global stage of steps (`stages.base.ResolvingStage`): the map half is
`stages.minhash.MinHashStage.keys`, the resolve half is `resolve` below.

The map side wrote, per block, one shuffle file per kind (`datapipe.core.shuffle`): `buckets/<block>`
(bucket key and order, 16 bytes a document and band, partitioned by bucket) and `nodes/<block>`
(order, id, length and the 16-bit signature, once per document, partitioned by order). The block's
documents themselves stay in the segment's block file (`<work>/<segment>/<block>.arrow`), the only
copy of their text. Then, each step one task per group of adjacent partitions (`Groups`: a group per
GROUP_DOCS documents, never more groups than partitions, fixed by the first run in `records/groups.json`),
each writing one shuffle file:

1. pairs       the candidate pairs of its buckets (`stages.minhash.bucket_pairs`, windowed), sent to the
               partition of their first document (`pairs-u/`); without `verify`, the buckets' star edges
               go straight to `cc/r000/`; then `gather` reads every block's nodes of group g once into
               `nodes-by-group/gNNN.arrow` (the block files go), for the three steps that look nodes up;
2. attach      each pair joined with its first document's signature and block, sent to the partition of
               its second document (`pairs-v/`);
3. decide      joined with the second's: decided by the estimated Jaccard (`estimate_masks`): the sure edges and
               the pairs too near the threshold to tell kept in `decided/gNNN.arrow`, the documents of those pairs
               sent to their blocks (`wanted/`, partitioned by block);
   fetch       one task per run of blocks (`Fetches`, sized by the wanted frames' bytes) reads every wanted frame of
               its blocks once, in a few merged ranges, for every group (`read_frames`; each task's record holds its
               wall), and sends the frames on by group (`frames/`);
   check       the near pairs by the exact Jaccard of shingle sets recomputed from those frames (`exact_edges`);
               the sure and exact edges to `cc/r000/`;
4. components  in one task when there are at most `one_task_edges` edges (a choice the first run records:
               `first_run_choice_task`) (large-star and small-star
               steps in memory until nothing changes), else in rounds of one task per group,
               large-star and small-star alternately, each reading the directed edges of its
               partition's nodes and sending its output edges on (`cc/rNNN/`), until a large-star +
               small-star pair leaves the edge set unchanged (compared by an order-independent
               checksum of each partition's input). Either way each node ends up linked to the
               smallest node of its component;
5. members     each node's component label (the component's first document) joined with its id and
               length, sent to the partition of its label;
6. winners     one document kept per component; the others become `losers-tNNN.arrow` with reason
               `near_duplicate` and the kept id, which the next segment drops like any global stage's;
               each group's cluster members (`clusters/gNNN`, cut into ranges of input order: `OrderRanges`);
7. clusters    one task per order range merges that range of every group's file by order into
               `near_duplicates/clusters/part-NNNNN.parquet` (`clusters_task`): the parts, in name order,
               are the clusters in input order. The driver only adds up the tasks' counts.

No step lists a folder: senders are known (the blocks, or the groups). Objects per step: one per
task plus its record. A step's input shuffle is deleted once every task that reads it has left its record
(`pairs-u/`, `pairs-v/`, `wanted/`, `decided/`, `frames/`, `cc/`, `members/`), so the resolve's disk use is that of one or two steps, and a
resumed run skips those tasks by their records. Memory per task is bounded by the partition count (and `one_task_edges`), not by
the corpus. Every task writes its output atomically and then a record, so a resumed run replays the
same steps to the same files.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import zstandard

from datapipe.core.schema import ROW_BITS, example_documents
from datapipe.core.shards import CLUSTERS_DIR, note_published, replacing, table_bytes
from datapipe.core.workfiles import read_work_table, write_work_table
from datapipe.core.exchange import (Combined, Exchange, Received, SenderFiles, Shuffle, average_sender_bytes, laid_out, planned,
                                     routed, rows_bytes)
from datapipe.core.storage import Location, location, remove_tree
from datapipe.curation.blocks import (block_documents, decompress_frames, frame_ranges, read_block_path,
                                      read_blocks_frames, text_frames)
from datapipe.curation.phase import record_in
from stages.base import LOSER_SCHEMA, ResolvingStage, RunTasks
from stages.minhash import (
    CLUSTER_SCHEMA,
    MinHashConfig,
    MinHashStage,
    bucket_pairs,
    choose_kept,
    connected_components,
    estimate_masks,
    exact_edges,
    fmix,
    labels,
    large_star,
    partition_of,
    shingle_sets,
    signature_values,
    small_star,
    star_edges,
    unique_pairs,
)

EDGE_SCHEMA = pa.schema([("src", pa.int64()), ("dst", pa.int64())])
PAIR_SCHEMA = pa.schema([("u", pa.int64()), ("v", pa.int64())])


@dataclass(frozen=True)
class KeySource:
    """Where the map side's keys are and where the documents' text is: `keys/<kind>/<name>.shuffle`
    for each sender, whose documents are in `work/<sender>.arrow` (a sender is a path below the work
    folder: `seg2/u000000-b00000`, the block file the keys were computed from)."""

    keys: str  # folder holding buckets/ and nodes/
    work: str
    senders: tuple[str, ...]
    gathered: bool = False  # the nodes were gathered into one file per group (`gather_nodes_task`)
    groups: "Groups | None" = None  # the resolve's tasks (`resolve_groups`)
    received: tuple[tuple[str, Received], ...] = ()  # where the exchange put each kind's keys (`route_keys`)

    def key_spec(self, kind: str, desc: str = "near dedup keys") -> Shuffle:
        """The exchange of the keys of `kind` to the groups (the nodes keep each row's sender, which the exact check
        needs)."""
        return step_files(location(self.keys) / kind, self.groups.partitions, f"{desc} {kind}", spans=self.groups.starts(),
                          source_column="sender" if kind == "nodes" else None)

    def sender_names(self) -> list[str]:
        return [s.rsplit("/", 1)[-1] for s in self.senders]

    def largest(self, kind: str) -> list[dict[str, int]]:
        """The largest sender file of `kind`, as the block tasks measured it (the groups' record keeps it)."""
        groups = self.groups
        return [{"bytes": (groups.bucket_bytes or groups.key_bytes) if kind == "buckets" else groups.key_bytes}]

    def key_exchange(self, kind: str, desc: str = "near dedup keys") -> Exchange:
        """The exchange of the keys of `kind` as planned (`exchange.planned`)."""
        return planned(self.key_spec(kind, desc), self.sender_names(), self.largest(kind))

    def key_files(self, kind: str, partitions: int) -> Received:
        """The key files of `kind` a receiver reads: where the exchange put them (`route_keys`), else one per sender."""
        if (received := dict(self.received).get(kind)) is not None:
            return received
        return SenderFiles(str(location(self.keys) / kind), tuple(s.rsplit("/", 1)[-1] for s in self.senders), partitions,
                           "sender" if kind == "nodes" else None)

    def read(self, kind: str, p: int, partitions: int, **kwargs: Any) -> pa.Table | None:
        return self.key_files(kind, partitions).read(p, **kwargs)

    def nodes(self, g: int) -> pa.Table:
        """Group g's nodes (`groups`), with each row's `sender` (its index in `senders`): one file when
        gathered, else one range of every sender's file (the group's partitions are adjacent)."""
        if self.gathered:
            return read_work_table(location(self.keys) / GATHERED / f"g{g:03d}.arrow")
        lo, hi = self.groups.range(g)
        nodes = self.read("nodes", lo, self.groups.partitions, through=hi)
        if nodes is None:
            raise RuntimeError("near dedup: no nodes files in the work folder")
        return nodes


@dataclass(frozen=True)
class Groups:
    """The resolve's tasks: the `partitions` hash partitions taken in `count` contiguous groups, one task
    (one output file, one record) per group and step. A task reads its group's range of each input file
    and handles the group's partitions together: every step's rows of one partition are independent of
    another's (a bucket, a node's edges, a cluster live in one partition), so the outputs do not depend on
    the grouping, only the number of tasks and objects does."""

    partitions: int
    count: int
    key_bytes: int = 0  # the map side's largest node file, estimated: what lays out the nodes' exchange (`route_keys`)
    bucket_bytes: int = 0  # and its largest bucket file (0, a run recorded before: `key_bytes`, as that run laid them out)
    # the step folders (by name) whose group files were combined, and where to (`exchange_groups`)
    combined: tuple[tuple[str, Combined], ...] = ()

    def range(self, g: int) -> tuple[int, int]:
        return g * self.partitions // self.count, (g + 1) * self.partitions // self.count

    def starts(self) -> list[int]:
        """Each group's first partition: a combine's ranges start at these, so a group reads one range."""
        return [self.range(g)[0] for g in range(self.count)]

    def names(self) -> list[str]:
        return [f"g{g:03d}" for g in range(self.count)]

    def items(self) -> list[tuple[int]]:
        return [(g,) for g in range(self.count)]

    def read(self, folder: Location, g: int, schema: pa.Schema | None = None) -> pa.Table | None:
        """Group g's rows of every group's shuffle file in `folder` (one range of each), or of the files they
        were combined into (`exchange_groups`)."""
        lo, hi = self.range(g)
        return self.files(folder).read(lo, schema, through=hi)

    def files(self, folder: Location, partitions: int | None = None) -> Received:
        """The shuffle files of a step's folder its readers read: the combined ones, or one per group (of
        `partitions` partitions where not the groups')."""
        combined = dict(self.combined).get(folder.name)
        return combined or SenderFiles(str(folder), tuple(self.names()), partitions or self.partitions)

    def record(self) -> dict[str, int]:
        """What `records/groups.json` keeps: the grouping, fixed by a resolve's first run (not its combines)."""
        return {"partitions": self.partitions, "count": self.count, "key_bytes": self.key_bytes,
                "bucket_bytes": self.bucket_bytes}


def step_files(folder: Location, partitions: int, desc: str = "near dedup", *, spans: Sequence[int] | None = None,
               source_column: str | None = None, records: Location | None = None) -> Shuffle:
    """The exchange of one step's files (`folder/<sender>.shuffle`, one per group task, block or fetch, of
    `partitions`): how its tasks send and how the next step's readers are routed to them."""
    return Shuffle(desc, str(folder), partitions, records=str(location(folder).parent / "records"),
                   spans=None if spans is None else tuple(spans), source_column=source_column,
                   combine_records=None if records is None else str(records))


def group_files(groups: Groups, folder: Location, desc: str, partitions: int | None = None,
                records: Location | None = None) -> Shuffle:
    """The exchange of a step whose G tasks (`groups`) each wrote one shuffle file in `folder`, to the next step's
    readers. `partitions`: the files' own, where not the groups' (the clusters' order ranges, read one at a time;
    else a group reads its partitions as one range); `records`: the combine tasks' (`cc/rNNN/`'s go to the
    resolve's: `cc/` is deleted whole after the members)."""
    spans = None if partitions else groups.starts()
    return step_files(folder, partitions or groups.partitions, desc, spans=spans, records=records)


def exchange_groups(run_tasks: RunTasks, spec: Shuffle, groups: Groups, results: Sequence[dict[str, Any]]) -> Groups:
    """The exchange `spec` (`group_files`) routed by the group tasks' `results` (their files' `bytes`): the groups
    the next step's readers then use."""
    files = routed(run_tasks, spec, groups.names(), results)
    if not isinstance(files, Combined):
        return groups
    combined = dict(groups.combined)
    combined[location(spec.folder).name] = files
    return dataclasses.replace(groups, combined=tuple(sorted(combined.items())))


GROUP_DOCS = 16_384  # documents per resolve task, at least: a small corpus makes few tasks whatever its partitions


def key_bytes(config: MinHashConfig, documents: int, senders: int, kind: str = "nodes") -> int:
    """A sender's key file of `kind`, its bytes estimated (`exchange.average_sender_bytes`) from the stage's own rows:
    `keys` of example documents, measured. What lays out that kind's exchange where no file is written yet (the cost
    model); a run lays its exchanges out by the files its block tasks measured."""
    return average_sender_bytes(documents, senders, _document_key_bytes(config, kind))


@functools.lru_cache(maxsize=8)
def _document_key_bytes(config: MinHashConfig, kind: str) -> int:
    batch = example_documents(256)
    batch = batch.append_column("text_at", pa.array(np.zeros(batch.num_rows, np.int64))).append_column(
        "text_bytes", pa.array(np.zeros(batch.num_rows, np.int64)))  # where each text lies, as the run's nodes carry
    keys = MinHashStage(config).keys(batch)[kind]
    return -(-rows_bytes(keys.drop(["partition"])) // batch.num_rows)


def route_keys(run_tasks: RunTasks, source: KeySource, desc: str) -> KeySource:
    """The map side's buckets and nodes through the exchange to the groups (`exchange.route`): a receiver then reads
    at most RECEIVER_FILES files, not M. The source that reads them where they went."""
    return dataclasses.replace(source, received=tuple(
        (kind, routed(run_tasks, source.key_spec(kind, desc), source.sender_names(), source.largest(kind))) for kind in KEY_KINDS))


def as_routed(source: KeySource) -> KeySource:
    """The source of keys that `route_keys` routed in an earlier step (the eval split reads near dedup's)."""
    return dataclasses.replace(source, received=tuple(
        (kind, laid_out(source.key_spec(kind), source.sender_names(), source.largest(kind))) for kind in KEY_KINDS))


KEY_KINDS = ("buckets", "nodes")


def resolve_groups(partitions: int, documents: int) -> Groups:
    """The resolve's tasks for `documents` near-dedup inputs: one per GROUP_DOCS documents, never more than
    the partitions (whose count `auto` sizes to the task memory budget: a group then is one partition). So
    the objects a resolve writes follow the data, not the partition count (a small corpus with
    `partitions: 32` writes as few as with 4), and each task has work enough to pay for its start."""
    return Groups(partitions, max(1, min(partitions, -(-max(documents, 0) // GROUP_DOCS))))


GATHERED = "nodes-by-group"  # keys/nodes-by-group/gNNN.arrow: every sender's nodes of group g


@dataclass(frozen=True)
class Step:
    """What the tasks of a resolve step share; their records go to `folder/records/`. The steps that need more say
    so by their own kind (`PairsStep`, `FetchStep`, `CheckStep`, `ClusterStep`): every field is given."""

    folder: str  # the stage's work folder: records/, cc/, members/, clusters/ and the losers files
    config: MinHashConfig
    source: KeySource  # the keys, the documents' text and the grouping (`groups`) the step's readers use

    @property
    def groups(self) -> Groups:
        return self.source.groups

    def with_groups(self, groups: Groups) -> "Step":
        return dataclasses.replace(self, source=dataclasses.replace(self.source, groups=groups))


@dataclass(frozen=True)
class PairsStep(Step):
    """The exact check's attach and decide steps: where the candidate pairs are (pairs-u/, pairs-v/, decided/,
    wanted/ and frames/; the eval split's: its own)."""

    pairs_folder: str


@dataclass(frozen=True)
class FetchStep(PairsStep):
    """The fetch tasks: where they read the wanted documents, and which blocks each reads."""

    wanted: Received
    fetches: "Fetches"


@dataclass(frozen=True)
class CheckStep(PairsStep):
    """The check tasks: where the checked edges go (the components' input) and where they read their frames (None:
    no group wants any)."""

    edges_folder: str
    frames: Received | None


@dataclass(frozen=True)
class ClusterStep(Step):
    """The winners and the clusters merge: the clusters' order ranges and the run's output folder
    (near_duplicates/clusters/)."""

    ranges: "OrderRanges"
    out_dir: str


@dataclass(frozen=True)
class Choice:
    """A choice a resolve's first run makes and its record keeps (`first_run_choice_task`)."""

    folder: str
    proposed: dict[str, Any]


def gather_nodes_task(step: Step, g: int) -> dict[str, int]:
    """Group g's nodes of every sender, read once (one range of each of M files) into one file, so that
    the three steps that look nodes up (attach, verify, members) read one file each instead of M ranges each."""
    source = step.source
    nodes = source.nodes(g)
    write_work_table(location(source.keys) / GATHERED / f"g{g:03d}.arrow", nodes)
    orders = nodes.column("order").to_numpy()
    return {"nodes": nodes.num_rows, "units": int(orders.max() >> ROW_BITS) + 1 if len(orders) else 0}


def send_edges(folder: Location, a: np.ndarray, b: np.ndarray, partitions: int, sender: str) -> int:
    """Write undirected edges (a, b) as directed edges in both directions, partitioned by source:
    one shuffle file `folder/<sender>.shuffle`; its bytes."""
    src = np.concatenate([a, b]).astype(np.int64)
    dst = np.concatenate([b, a]).astype(np.int64)
    return step_files(folder, partitions).send(sender, pa.table({"src": src, "dst": dst}, schema=EDGE_SCHEMA),
                                               partition_of(src, partitions))


def _directed(folder: Location, groups: Groups, g: int) -> tuple[np.ndarray, np.ndarray]:
    table = groups.read(folder, g, EDGE_SCHEMA)
    if table.num_rows == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return unique_pairs(table.column("src").to_numpy(), table.column("dst").to_numpy())


def _checksum(src: np.ndarray, dst: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        mixed = fmix(src.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + dst.astype(np.uint64), 64)
        return int(np.add.reduce(mixed, dtype=np.uint64))


def _lookup(nodes: pa.Table, orders: np.ndarray, columns: Sequence[str]) -> pa.Table:
    """The `columns` of `nodes` (all nodes of one group) at each of `orders`, in that order."""
    node_orders = nodes.column("order").to_numpy()
    by_order = np.argsort(node_orders, kind="stable")
    at = by_order[np.minimum(np.searchsorted(node_orders[by_order], orders), max(len(by_order) - 1, 0))]
    if len(orders) and (len(node_orders) == 0 or (node_orders[at] != orders).any()):  # a bug, never bad input
        raise RuntimeError(f"near dedup: documents {orders[:5].tolist()} have no node row in the work folder")
    return nodes.select([c for c in columns if c in nodes.column_names]).take(pa.array(at, pa.int64()))


def _locators(table: pa.Table, suffix: str = "") -> tuple[np.ndarray, np.ndarray]:
    """The `text_at`/`text_bytes` columns (of a node lookup or a pair's first document) as arrays, -1 where
    the document's block holds its text itself (its nodes carry no locator)."""
    names = [f"text_at{suffix}", f"text_bytes{suffix}"]
    if names[0] not in table.column_names:
        return np.full(table.num_rows, -1, np.int64), np.full(table.num_rows, -1, np.int64)
    return tuple(pc.fill_null(table.column(n), -1).to_numpy().astype(np.int64) for n in names)


def pairs_task(step: Step, g: int) -> dict[str, Any]:
    """Candidate pairs of the bucket partitions of group g -> `pairs-u/gNNN` by their first document (or,
    without `verify`, star edges -> `cc/r000/gNNN`)."""
    source, config = step.source, step.config
    root, groups = location(step.folder), source.groups
    lo, hi = groups.range(g)
    buckets = source.read("buckets", lo, config.partitions, through=hi)
    if buckets is None:
        buckets = pa.table({"bucket": pa.array([], pa.uint64()), "order": pa.array([], pa.int64())})
    if not config.verify:
        a, b = star_edges(buckets)
        size = send_edges(root / "cc" / "r000", a, b, config.partitions, f"g{g:03d}")
        return {"edges": int(len(a)), "candidates": int(len(a)), "bytes": size}
    u, v = bucket_pairs(buckets, config.bucket_window)  # a bucket lives in one partition: as if one by one
    size = step_files(root / "pairs-u", config.partitions).send(f"g{g:03d}", pa.table({"u": u, "v": v}, schema=PAIR_SCHEMA),
                                                               partition_of(u, config.partitions))
    return {"edges": 0, "candidates": int(len(u)), "bytes": size}


def attach_task(step: PairsStep, g: int) -> dict[str, Any]:
    """The pairs of `pairs_folder/pairs-u/` whose first document is in group g, joined with that
    document's signature and sender -> `pairs-v/gNNN` by their second document."""
    source, config = step.source, step.config
    pairs_root, groups = location(step.pairs_folder), source.groups
    pairs = groups.read(pairs_root / "pairs-u", g, PAIR_SCHEMA)
    # a pair that shares buckets of several partitions, once
    u, v = unique_pairs(pairs.column("u").to_numpy(), pairs.column("v").to_numpy())
    found = _lookup(source.nodes(g), u, ["signature", "sender", "text_at", "text_bytes"])
    at, nbytes = _locators(found)
    table = pa.table({"u": pa.array(u, pa.int64()), "v": pa.array(v, pa.int64()), "sig_u": found.column("signature"),
                      "sender_u": found.column("sender"), "text_at_u": at, "text_bytes_u": nbytes})
    size = step_files(pairs_root / "pairs-v", config.partitions).send(f"g{g:03d}", table, partition_of(v, config.partitions))
    return {"pairs": len(u), "bytes": size}


def _not_yet_connected(edge_u: np.ndarray, edge_v: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Mask of the pairs (u[i], v[i]) whose ends the edges do not already connect (a union-find over the edges)."""
    if len(u) == 0 or len(edge_u) == 0:
        return np.ones(len(u), dtype=bool)
    nodes, index = np.unique(np.concatenate([edge_u, edge_v, u, v]), return_inverse=True)
    parent = np.arange(len(nodes))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    n = len(edge_u)
    for a, b in zip(index[:n].tolist(), index[n : 2 * n].tolist()):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    pu, pv = index[2 * n : 2 * n + len(u)], index[2 * n + len(u) :]
    return np.fromiter((find(a) != find(b) for a, b in zip(pu.tolist(), pv.tolist())), dtype=bool, count=len(u))


DECIDED_SCHEMA = pa.schema([("u", pa.int64()), ("v", pa.int64()), ("near", pa.bool_())])
# a document a group's exact check wants: its block (`sender`: index into `KeySource.senders`), where its frame is in
# the block's read block (-1: the block holds its text itself) and the group that wants it
WANTED_SCHEMA = pa.schema([("order", pa.int64()), ("sender", pa.int32()), ("text_at", pa.int64()),
                           ("text_bytes", pa.int64()), ("group", pa.int32())])
# a wanted document's text on its way to its group: the zstd frame as its read block stores it (`blocks.text_frames`),
# the smallest form of it (shingle sets of 64-bit hashes are larger than the text itself); its group decompresses it,
# which checks the frame's checksum, naming the read block (`sender`) when it does not hold
FRAME_SCHEMA = pa.schema([("order", pa.int64()), ("sender", pa.int32()), ("frame", pa.large_binary())])
DECIDED, WANTED, FRAMES = "decided", "wanted", "frames"  # the exact check's folders, beside pairs-v/


def decide_task(step: PairsStep, g: int) -> dict[str, Any]:
    """The pairs whose second document is in group g, decided by the signatures: the sure edges and the pairs too
    near the threshold to tell (less those the sure edges already connect) -> `decided/gNNN.arrow`; the documents of
    those pairs -> `wanted/gNNN.shuffle`, partitioned by the block that holds their text (its sender index)."""
    source, config = step.source, step.config
    pairs_root, groups = location(step.pairs_folder), source.groups
    decided, wanted, checked, connected = DECIDED_SCHEMA.empty_table(), WANTED_SCHEMA.empty_table(), 0, 0
    pairs = groups.read(pairs_root / "pairs-v", g)
    if pairs is not None and pairs.num_rows:
        u, v = pairs.column("u").to_numpy(), pairs.column("v").to_numpy()
        found = _lookup(source.nodes(g), v, ["signature", "sender", "text_at", "text_bytes"])
        edge, near = estimate_masks(signature_values(pairs.column("sig_u"), config.num_perm),
                                    signature_values(found.column("signature"), config.num_perm), config)
        # a near pair whose documents this task's sure edges already connect needs no exact check: its
        # edge could not change the components (dense clusters of near-identical pages are mostly such)
        rows = np.flatnonzero(near)
        rows = rows[_not_yet_connected(u[edge], v[edge], u[rows], v[rows])]
        checked, connected = len(rows), int(near.sum() - len(rows))
        decided = pa.table({"u": np.r_[u[edge], u[rows]], "v": np.r_[v[edge], v[rows]],
                            "near": np.r_[np.zeros(int(edge.sum()), bool), np.ones(len(rows), bool)]}, schema=DECIDED_SCHEMA)
        wanted = _wanted(pairs, found, rows, g)
    write_work_table(pairs_root / DECIDED / f"g{g:03d}.arrow", decided)
    size = step_files(pairs_root / WANTED, len(source.senders)).send(f"g{g:03d}", wanted, wanted.column("sender").to_numpy())
    nbytes = wanted.column("text_bytes").to_numpy()
    return {"checked": checked, "near_connected": connected, "wanted": wanted.num_rows,
            "wanted_bytes": int(nbytes[nbytes > 0].sum()), "bytes": size}


def _wanted(pairs: pa.Table, found: pa.Table, rows: np.ndarray, g: int) -> pa.Table:
    """The distinct documents of the pairs at `rows` (first documents from `pairs`, second from their node rows
    `found`), with their frames' places and the group that wants them."""
    at_u, bytes_u = _locators(pairs, "_u")
    at_v, bytes_v = _locators(found)
    orders = np.r_[pairs.column("u").to_numpy()[rows], pairs.column("v").to_numpy()[rows]]
    senders = np.r_[pairs.column("sender_u").to_numpy()[rows], found.column("sender").to_numpy()[rows]]
    at, nbytes = np.r_[at_u[rows], at_v[rows]], np.r_[bytes_u[rows], bytes_v[rows]]
    first = np.unique(orders, return_index=True)[1]
    return pa.table({"order": orders[first], "sender": senders[first].astype(np.int32), "text_at": at[first],
                     "text_bytes": nbytes[first], "group": np.full(len(first), g, np.int32)}, schema=WANTED_SCHEMA)


@dataclass(frozen=True)
class Fetches:
    """The exact check's fetch tasks: the `blocks` (the key senders, in their order) in `count` runs of adjacent
    blocks, one task each, so that a block's wanted frames are read once, by one task, for every group."""

    blocks: int
    count: int

    def range(self, f: int) -> tuple[int, int]:
        return f * self.blocks // self.count, (f + 1) * self.blocks // self.count

    def starts(self) -> list[int]:
        return [self.range(f)[0] for f in range(self.count)]

    def names(self) -> list[str]:
        return [f"f{f:05d}" for f in range(self.count)]


FETCH_BYTES = 64 << 20  # wanted frames a fetch task sends on, about: what a task holds, and few tasks when little is wanted
FETCH_GAP = 1 << 20  # a fetch reads across gaps up to this between wanted frames: skipping fewer bytes than a request
# could carry in its latency saves less than the request costs, and a fetch serves every group at once


EXACT_READ_BYTES = 64 << 20  # ranges one batched read holds at most: the frames a fetch task holds at once stay
# bounded, while a batch still has far more ranges than the connection pool when many are wanted


def fetch_frames(run_tasks: RunTasks, step: PairsStep, decided: Sequence[dict[str, Any]],
                 desc: str) -> tuple[Received | None, list[dict[str, Any]]]:
    """The wanted documents (`decide_task`) exchanged to fetch tasks by block, each block's frames read once in a few
    ranges (`fetch_task`), and sent on to the groups that want them: where the groups read their frames (None when
    no group wants any) and the fetch tasks' results (their reads)."""
    pairs_root, source = location(step.pairs_folder), step.source
    wanted_bytes = sum(x.get("wanted_bytes", 0) for x in decided)
    if not any(x.get("wanted", 0) for x in decided):
        remove_tree(pairs_root / WANTED)
        return None, []
    blocks = len(source.senders)
    fetches = Fetches(blocks, max(1, min(blocks, -(-wanted_bytes // FETCH_BYTES))))
    wanted = routed(run_tasks, step_files(pairs_root / WANTED, blocks, f"{desc} wanted", spans=fetches.starts()),
                    source.groups.names(), decided)
    fetched = run_tasks(fetch_task, FetchStep(step.folder, step.config, step.source, step.pairs_folder, wanted, fetches),
                        [(f,) for f in range(fetches.count)], f"{desc} fetch", record=record_in("records", "fetch"))
    remove_tree(pairs_root / WANTED)  # consumed: every fetch task's record is written
    frames = routed(run_tasks, step_files(pairs_root / FRAMES, source.groups.count, f"{desc} frames"), fetches.names(),
                    fetched)
    return frames, fetched


def fetch_task(step: FetchStep, f: int) -> dict[str, Any]:
    """The frames wanted from fetch f's blocks, each distinct document's read once (`read_frames`) -> one row per
    group that wants it in `frames/fNNNNN.shuffle`, partitioned by group. Its record holds its wall and its reads'."""
    started = time.perf_counter()
    pairs_folder, source, wanted_files, fetches = step.pairs_folder, step.source, step.wanted, step.fetches
    lo, hi = fetches.range(f)
    wanted = wanted_files.read(lo, WANTED_SCHEMA, through=hi)
    orders = wanted.column("order").to_numpy()
    _, first, inverse = np.unique(orders, return_index=True, return_inverse=True)  # a document wanted by many groups
    frames, read = read_frames(source, wanted.take(pa.array(first, pa.int64())))
    table = pa.table({"order": orders, "sender": wanted.column("sender"),
                      "frame": pa.array(frames, pa.large_binary()).take(pa.array(inverse.reshape(-1), pa.int64()))},
                     schema=FRAME_SCHEMA)
    size = step_files(location(pairs_folder) / FRAMES, source.groups.count).send(fetches.names()[f], table,
                                                                                 wanted.column("group").to_numpy())
    # the task's wall beside its reads' (`read_seconds`) and requests (`ranges_read`), in its record only: the
    # resolve's summary holds what every run of the same input repeats
    return {**read, "rows": table.num_rows, "bytes": size, "seconds": round(time.perf_counter() - started, 6)}


def read_frames(source: KeySource, wanted: pa.Table) -> tuple[list[bytes], dict[str, Any]]:
    """The frame of each of `wanted`'s documents (distinct, `WANTED_SCHEMA`). Located ones by ranges of their read
    blocks (`read_blocks_frames`, merged across gaps up to FETCH_GAP), many blocks in one batched read (all in flight
    at once on an object store), a batch per EXACT_READ_BYTES of ranges; the others (a block that holds its text
    itself: an `eval.source` block) by one read of their block file, their texts made frames. Also the reads: the
    bytes of the ranges, the bytes of the texts, the documents, the requests and `read_seconds`, their wall."""
    senders, at = wanted.column("sender").to_numpy(), wanted.column("text_at").to_numpy()
    nbytes, orders = wanted.column("text_bytes").to_numpy(), wanted.column("order").to_numpy()
    frames: list[bytes] = [b""] * wanted.num_rows
    read = {"bytes_read": 0, "text_bytes": 0, "documents_read": wanted.num_rows, "ranges_read": 0}
    started = time.perf_counter()
    located, whole = _by_block(senders, at)
    for batch in _by_range_bytes(located, at, nbytes, read):
        blocks = [(_block_name(source, s), at[rows], nbytes[rows]) for s, rows in batch]
        for (_, rows), got in zip(batch, read_blocks_frames(location(source.work), blocks, gap=FETCH_GAP, waste=math.inf)):
            for i, frame in zip(rows.tolist(), got):
                frames[i] = frame
    read["text_bytes"] += sum(zstandard.frame_content_size(frames[i]) for _, rows in located for i in rows.tolist())
    for s, rows in whole:
        folder, name = source.senders[s].rsplit("/", 1)
        table = block_documents(location(source.work), folder, name, ["order", "text"])
        texts = table.column("text").take(pc.index_in(pa.array(orders[rows], pa.int64()), value_set=table.column("order")))
        values = [t.encode() for t in texts.to_pylist()]
        for i, frame in zip(rows.tolist(), text_frames(values)):
            frames[i] = frame
        read["ranges_read"] += 1
        read["bytes_read"] += int(pc.sum(pc.binary_length(table.column("text"))).as_py() or 0)
        read["text_bytes"] += sum(map(len, values))
    read["read_seconds"] = round(time.perf_counter() - started, 6)
    return frames, read


def _by_block(senders: np.ndarray, at: np.ndarray) -> tuple[list[tuple[int, np.ndarray]], list[tuple[int, np.ndarray]]]:
    """The rows of each block, in block order: (those whose frames are located, those of blocks read whole)."""
    by_sender = np.argsort(senders, kind="stable")
    bounds = np.flatnonzero(np.r_[True, senders[by_sender][1:] != senders[by_sender][:-1], True])
    located, whole = [], []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        rows = by_sender[a:b]
        (located if (at[rows] >= 0).all() else whole).append((int(senders[rows[0]]), rows))
    return located, whole


def _by_range_bytes(located: list[tuple[int, np.ndarray]], at: np.ndarray, nbytes: np.ndarray,
                    read: dict[str, Any]) -> list[list[tuple[int, np.ndarray]]]:
    """`located` cut into runs of blocks whose ranges (as the fetch merges them) hold at most EXACT_READ_BYTES (a
    block at least); the ranges and their bytes counted into `read`."""
    parts: list[list[tuple[int, np.ndarray]]] = []
    held = 0
    for block in located:
        _, starts, ends = frame_ranges(at[block[1]], nbytes[block[1]], FETCH_GAP, math.inf)
        size = int((ends - starts).sum())
        read["ranges_read"] += len(starts)
        read["bytes_read"] += size
        if not parts or held + size > EXACT_READ_BYTES:
            parts.append([])
            held = 0
        parts[-1].append(block)
        held += size
    return parts


def _block_name(source: KeySource, s: int) -> str:
    return source.senders[s].rsplit("/", 1)[1]


def check_task(step: CheckStep, g: int) -> dict[str, Any]:
    """Group g's decided pairs (`decide_task`): the sure edges, and the near pairs whose exact Jaccard of shingle
    sets, recomputed from the frames the fetch tasks sent (`frames/`), reaches the threshold. Edges ->
    `edges_folder/gNNN`."""
    source, config, frames = step.source, step.config, step.frames
    decided = read_work_table(location(step.pairs_folder) / DECIDED / f"g{g:03d}.arrow")
    u, v = decided.column("u").to_numpy(), decided.column("v").to_numpy()
    near = decided.column("near").to_numpy(zero_copy_only=False)
    near_u, near_v = u[near], v[near]
    if len(near_u):
        sets = _shingle_sets(source, frames.read(g, FRAME_SCHEMA), config)
        near_u, near_v = exact_edges(near_u, near_v, lambda wanted: {o: sets[o] for o in wanted.tolist()}, config.threshold)
    a, b = np.r_[u[~near], near_u], np.r_[v[~near], near_v]
    size = send_edges(location(step.edges_folder), a, b, config.partitions, f"g{g:03d}")
    return {"edges": int(len(a)), "near": int(len(near_u)), "bytes": size}


def _shingle_sets(source: KeySource, frames: pa.Table, config: MinHashConfig) -> dict[int, np.ndarray]:
    """Each document's shingle set (by order) from its frame; a frame that does not decompress names its read block."""
    work = location(source.work)
    senders = frames.column("sender").to_pylist()
    blocks = {s: read_block_path(work, _block_name(source, s)) for s in set(senders)}  # a few blocks, many frames
    texts = decompress_frames(frames.column("frame").to_pylist(), [blocks[s] for s in senders])
    return dict(zip(frames.column("order").to_pylist(), shingle_sets(pa.array(texts, pa.large_string()), config)))


def verify_pairs(run_tasks: RunTasks, step: PairsStep, edges_folder: Location, desc: str,
                 sent: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """Decide the candidate pairs in `step.pairs_folder/pairs-u/` (one shuffle file per group of
    `step.source.groups`, by first document; `sent`: the results of the tasks that wrote them, with their
    `bytes`, for the exchange): `attach_task`, `decide_task`, the fetch tasks (`fetch_frames`), then `check_task`
    (their records in `step.folder/records/`); the edges end in `edges_folder` (one shuffle file per group, partitioned
    by source). Returns the counts and `largest_bytes`, the largest edges file."""
    pairs_root, source, config = location(step.pairs_folder), step.source, step.config
    groups = exchange_groups(run_tasks, group_files(source.groups, pairs_root / "pairs-u", f"{desc} pairs"), source.groups, sent)
    parts = source.groups.items()
    attached = run_tasks(attach_task, step.with_groups(groups), parts, f"{desc} attach", record=record_in("records", "attach"))
    remove_tree(pairs_root / "pairs-u")  # consumed: every attach task's record is written
    groups = exchange_groups(run_tasks, group_files(groups, pairs_root / "pairs-v", f"{desc} attach"), groups, attached)
    decided = run_tasks(decide_task, step.with_groups(groups), parts, f"{desc} decide", record=record_in("records", "decide"))
    remove_tree(pairs_root / "pairs-v")  # consumed (its signatures are the resolve's largest files)
    frames, fetched = fetch_frames(run_tasks, step, decided, desc)
    checked = run_tasks(check_task, CheckStep(step.folder, config, source, step.pairs_folder, str(edges_folder), frames), parts,
                        f"{desc} check",
                        record=record_in("records", "check"))
    remove_tree(pairs_root / DECIDED)  # consumed, as the frames are
    remove_tree(pairs_root / FRAMES)
    return _edges_summary(checked, decided, fetched)


def _edges_summary(results: Sequence[dict[str, Any]], decided: Sequence[dict[str, Any]] = (),
                   fetched: Sequence[dict[str, Any]] = ()) -> dict[str, int]:
    """What the tasks that wrote the components' input edges report (`results`): the edges and the largest file;
    the exact check's pairs (`decided`) and its reads (`fetched`: the frames' ranges, beside the bytes of the texts
    they held; none without verification)."""
    total = lambda rows, key: sum(x.get(key, 0) for x in rows)
    return {"edges": total(results, "edges"), "exact_checked": total(decided, "checked"),
            "exact_bytes_read": total(fetched, "bytes_read"), "exact_text_bytes": total(fetched, "text_bytes"),
            "exact_documents_read": total(fetched, "documents_read"), "exact_ranges_read": total(fetched, "ranges_read"),
            "largest_bytes": max((x.get("bytes", 0) for x in results), default=0)}


def components_task(step: Step) -> dict[str, Any]:
    """All edges in one task: components in memory, written as the converged rounds would be."""
    config, groups, root = step.config, step.groups, location(step.folder)
    table = groups.files(root / "cc" / "r000", config.partitions).read(0, EDGE_SCHEMA, through=config.partitions)
    src, dst = table.column("src").to_numpy(), table.column("dst").to_numpy()
    keep = src < dst  # each undirected edge once
    a, b, rounds = connected_components(src[keep], dst[keep], config.max_rounds)
    names = groups.names()
    size = send_edges(root / "cc" / "one-task", a, b, config.partitions, names[0])
    for name in names[1:]:  # every sender of the folder exists, as after the rounds
        send_edges(root / "cc" / "one-task", np.empty(0, np.int64), np.empty(0, np.int64), config.partitions, name)
    return {"rounds": rounds, "bytes": size}


def round_task(step: Step, r: int, g: int) -> dict[str, Any]:
    config, groups, root = step.config, step.groups, location(step.folder)
    src, dst = _directed(root / "cc" / f"r{r:03d}", groups, g)
    step = large_star if r % 2 == 0 else small_star
    a, b = step(src, dst)  # a node's edges live in its partition: the group's partitions at once, as one by one
    size = send_edges(root / "cc" / f"r{r + 1:03d}", a, b, config.partitions, f"g{g:03d}")
    return {"input_edges": int(len(src)), "checksum": _checksum(src, dst), "bytes": size}


MEMBER_SCHEMA = pa.schema([("order", pa.int64()), ("label", pa.int64()), ("id", pa.string()), ("length", pa.int64())])


def members_task(step: Step, converged: str, g: int) -> dict[str, Any]:
    """Labels from the converged edges in `cc/<converged>/`, joined with the nodes' ids and lengths."""
    config, source, root = step.config, step.source, location(step.folder)
    node, label = labels(*_directed(root / "cc" / converged, source.groups, g))
    members = MEMBER_SCHEMA.empty_table()
    if len(node):
        longest = config.keep == "longest"
        found = _lookup(source.nodes(g), node, ["id"] + (["length"] if longest else []))
        ids = found.column("id").cast(pa.string())
        length = found.column("length") if longest else pa.array(np.zeros(len(node), np.int64))
        members = pa.table({"order": node, "label": label, "id": ids, "length": length}, schema=MEMBER_SCHEMA)
    size = step_files(root / "members", config.partitions).send(f"g{g:03d}", members,
                                                                partition_of(members.column("label").to_numpy(), config.partitions))
    return {"members": members.num_rows, "bytes": size}


@dataclass(frozen=True)
class OrderRanges:
    """The clusters' rows cut into `count` contiguous ranges of input order (by input unit: `units` of them), so
    that `clusters_task` merges one range of every group's file at a time."""

    units: int
    count: int

    def of(self, orders: np.ndarray) -> np.ndarray:
        return (orders >> ROW_BITS) * self.count // max(self.units, 1)


MERGE_RANGES = 256  # order ranges of the clusters merge, at most (one per input unit below that)


def order_ranges(units: int) -> OrderRanges:
    """The clusters merge's order ranges (a task each) for `units` input units: one a unit, at most MERGE_RANGES."""
    return OrderRanges(units, max(1, min(MERGE_RANGES, units)))


def winners_task(step: ClusterStep, g: int) -> dict[str, Any]:
    config, groups, ranges, root = step.config, step.groups, step.ranges, location(step.folder)
    members = groups.read(root / "members", g, MEMBER_SCHEMA)
    if members.num_rows == 0:
        losers, clusters = LOSER_SCHEMA.empty_table(), CLUSTER_SCHEMA.empty_table()
    else:
        losers, clusters = choose_kept(members, config.keep)
    # By order within each range, so that `clusters_task` merges a range without sorting more than it.
    clusters = clusters.sort_by([("order", "ascending")])
    size = step_files(root / "clusters", ranges.count).send(f"g{g:03d}", clusters, ranges.of(clusters.column("order").to_numpy()))
    write_work_table(root / f"losers-t{g:03d}.arrow", losers)
    # A cluster lives in one partition (members go to the partition of their label): counts add up.
    n_clusters = len(pc.unique(clusters.column("cluster_id"))) if clusters.num_rows else 0
    return {"losers": losers.num_rows, "clusters": n_clusters, "bytes": size}


def clusters_part(out_dir: str | Location, r: int) -> Location:
    return location(out_dir) / CLUSTERS_DIR / f"part-{r:05d}.parquet"


def clusters_task(step: ClusterStep, r: int) -> dict[str, Any]:
    """`out_dir/near_duplicates/clusters/part-<r>.parquet`: order range r of every group's clusters merged by
    order (an empty part where the range has none, so the parts are every range's). A task holds one range of every
    group's file (`OrderRanges`): memory is the clusters' bytes over the ranges, and the ranges run in parallel."""
    folder, groups, ranges = location(step.folder), step.groups, step.ranges
    schema = CLUSTER_SCHEMA.remove(CLUSTER_SCHEMA.get_field_index("order"))
    rows = groups.files(folder / "clusters", ranges.count).read(r, CLUSTER_SCHEMA)
    data = table_bytes(rows.sort_by([("order", "ascending")]).drop(["order"]).cast(schema), "parquet")
    part = clusters_part(step.out_dir, r)
    with replacing(part, False) as tmp, tmp.open("wb") as sink:  # a temporary key on an object store too
        sink.write(data)
    note_published(part, len(data), hashlib.sha256(data).hexdigest())
    return {"rows": rows.num_rows}


class NearDedupStage(MinHashStage, ResolvingStage):
    """Near dedup as a global stage: `MinHashStage`'s keys, resolved by this module's tasks."""

    locates_text = True  # the exact check reads its documents' text by range (`read_frames`)

    def tasks(self, documents: int) -> int:
        return resolve_groups(self.config.partitions, documents).count

    def resolve(self, run_tasks: RunTasks, folder: Location, out_dir: Location, senders: Sequence[str],
                documents: int, largest: dict[str, int]) -> dict[str, Any]:
        return resolve(run_tasks, self, out_dir, KeySource(str(folder), str(folder.parent), tuple(senders)), documents,
                       largest)


def first_run_choice_task(choice: Choice) -> dict[str, Any]:
    """A choice as this run proposes it (the grouping; one task or rounds for the components); its record keeps
    the first run's for every resume, whose files follow that choice."""
    return choice.proposed


def resolve(run_tasks: RunTasks, stage: MinHashStage, out_dir: Location, keys: KeySource, documents: int,
            largest: dict[str, int]) -> dict[str, Any]:
    """Run the whole resolution with `run_tasks(fn, shared, items, desc)` (an executor's: it calls
    `fn(shared, *item)` for each item); `keys` are the map side's, in the stage's work folder (its senders: blocks
    below the work folder, `keys.work`), holding `documents` documents in all (what sizes the groups), the largest
    file of each kind `largest` bytes (as the block tasks measured). Writes `out_dir/near_duplicates/clusters/` and
    `<its folder>/losers-tNNN.arrow` (one per group); returns a summary for the stats."""
    config, folder = stage.config, location(keys.keys)
    proposed = dataclasses.replace(resolve_groups(config.partitions, documents), key_bytes=largest["nodes"],
                                   bucket_bytes=largest["buckets"])
    # fixed by the first run (the task's record, `records/groups.json`): a resume keeps its grouping
    first = run_tasks(first_run_choice_task, Choice(str(folder), proposed.record()), [()], f"{stage.name} groups",
                      record=record_in("records", "groups"))[0]
    groups = Groups(**first)
    parts = groups.items()
    source = route_keys(run_tasks, dataclasses.replace(keys, groups=groups), stage.name)
    step = Step(str(folder), config, source)
    found = run_tasks(pairs_task, step, parts, f"{stage.name} pairs", record=record_in("records", "pairs"))
    # the nodes, read by three later steps, are gathered once by group; the senders' files then go
    gathered = run_tasks(gather_nodes_task, step, parts, f"{stage.name} gather", record=record_in("records", "gather"))
    units = max((x.get("units", 0) for x in gathered), default=0)
    remove_tree(folder / "nodes")
    source = dataclasses.replace(source, gathered=True)
    step, ranges = Step(str(folder), config, source), order_ranges(units)
    # the verified edges are the components' input, as the pairs step's star edges are without verification
    verified = (verify_pairs(run_tasks, PairsStep(str(folder), config, source, str(folder)), folder / "cc" / "r000",
                             stage.name, found)
                if config.verify else _edges_summary(found))
    edges = verified["edges"]
    # fixed by the first run (the task's record): a resume with another `one_task_edges` keeps the branch whose
    # files it has; every step below is recorded, so a resume after `cc/` is deleted runs none of them again
    branch = run_tasks(first_run_choice_task, Choice(str(folder), {"one_task": edges <= config.one_task_edges}), [()],
                       f"{stage.name} components branch", record=record_in("records", "components-branch"))[0]
    edge_files = group_files(groups, folder / "cc" / "r000", f"{stage.name} edges", records=folder / "records")
    groups = exchange_groups(run_tasks, edge_files, groups, [{"bytes": verified["largest_bytes"]}])
    if branch["one_task"]:
        one = run_tasks(components_task, step.with_groups(groups), [()], f"{stage.name} components",
                        record=record_in("records", "components"))
        rounds, converged = one[0]["rounds"], "one-task"
        components = group_files(groups, folder / "cc" / converged, f"{stage.name} components", records=folder / "records")
        groups = exchange_groups(run_tasks, components, groups, one)
    else:
        rounds, groups = _component_rounds(run_tasks, step.with_groups(groups))
        converged = f"r{rounds - 1:03d}"  # the input of the last round
    member_rows = run_tasks(members_task, step.with_groups(groups), [(converged, g) for (g,) in parts],
                            f"{stage.name} members", record=record_in("records", "members"))
    remove_tree(folder / "cc")  # consumed: the members carry the labels on
    largest = [{"bytes": max((x.get("bytes", 0) for x in member_rows), default=0)}]
    groups = exchange_groups(run_tasks, group_files(groups, folder / "members", f"{stage.name} members"), groups, largest)
    clustering = ClusterStep(str(folder), config, source, ranges, str(out_dir))
    kept = run_tasks(winners_task, clustering.with_groups(groups), parts, f"{stage.name} keep",
                     record=record_in("records", "winners"))
    remove_tree(folder / "members")  # consumed
    groups = exchange_groups(run_tasks, group_files(groups, folder / "clusters", f"{stage.name} keep", ranges.count), groups, kept)
    run_tasks(clusters_task, clustering.with_groups(groups), [(r,) for r in range(ranges.count)],
              f"{stage.name} clusters", record=record_in("records", "clusters"))
    losers, n_clusters = sum(x["losers"] for x in kept), sum(x["clusters"] for x in kept)
    return {
        "candidate_pairs": sum(x["candidates"] for x in found),  # distinct within each bucket partition
        "exact_checked": verified["exact_checked"],
        "exact_bytes_read": verified["exact_bytes_read"],  # the exact check's reads (the documents' frames)
        "exact_text_bytes": verified["exact_text_bytes"],  # and the bytes of the texts they held
        "exact_documents_read": verified["exact_documents_read"],  # once per fetch task: for every group that wants it
        "exact_ranges_read": verified["exact_ranges_read"],  # its requests: a block's wanted frames share a few
        "edges": edges,
        "rounds": rounds,
        "groups": groups.record(),  # the grouping (the eval split's near check reads its keys by it)
        "clusters": n_clusters,
        "removed": losers,
        "tasks": groups.count,
    }


def _component_rounds(run_tasks: RunTasks, step: Step) -> tuple[int, Groups]:
    """Distributed large-star / small-star rounds until convergence; the number of rounds run (the
    last one's input, `cc/r<rounds-1>/`, is the converged edge set) and the groups that read it."""
    checksums: list[tuple[int, int]] = []
    cc, r = location(step.folder) / "cc", 0
    while True:
        results = run_tasks(round_task, step, [(r, g) for (g,) in step.groups.items()], f"minhash components round {r}",
                            record=record_in("records", "round"))
        checksums.append((sum(x["input_edges"] for x in results), sum(x["checksum"] for x in results) % 2**64))
        # A large-star round whose input equals the previous large-star round's input: converged.
        if r % 2 == 0 and r >= 2 and checksums[r] == checksums[r - 2]:
            return r + 1, step.groups
        spec = group_files(step.groups, cc / f"r{r + 1:03d}", f"minhash components round {r + 1}",
                           records=location(step.folder) / "records")
        step = step.with_groups(exchange_groups(run_tasks, spec, step.groups, results))
        if r >= 2:  # the input of the round before (not r000): no later round reads it, and this one was not the last
            remove_tree(cc / f"r{r - 1:03d}")
        r += 1
        if r >= step.config.max_rounds:
            raise RuntimeError(
                f"near-dedup connected components did not converge in {step.config.max_rounds} rounds "
                "(dedup.minhash.max_rounds)"
            )
