"""The distributed resolution of near-dedup (MinHash-LSH): shuffles and rounds as tasks.

`NearDedupStage` is near dedup as a global stage (`stages.base.GlobalStage`): the map half is
`stages.minhash.MinHashStage.keys`, the resolve half is `resolve` below.

After the map side (`stages.minhash.MinHashStage.keys`) has written every document's LSH bucket
keys into `work/minhash/buckets/pNNN/` (hash-partitioned by bucket), its id and length into
`work/minhash/nodes/pNNN/` (partitioned by document) and, for exact verification, its shingle
hashes into `work/minhash/shingles/p000/<block>.arrow` (one row per document, not shuffled), this
module runs:

1. edges       one task per bucket partition: the candidate pairs of its buckets, decided by the
               estimated Jaccard (`stages.minhash.candidate_edges`); edges go to the partitions of
               both their ends (`cc/r000/`), the pairs too near the threshold to tell to the
               partition of their first document (`exact/`);
2. exact       one task per partition: those pairs, each once, decided by the exact Jaccard of the
               two documents' shingle sets, read by order from the shingles files (`ShingleStore`);
               edges to `cc/r000/` as well;
3. components  in one task when there are at most `one_task_edges` edges (large-star and small-star
               steps in memory until nothing changes), else in rounds of one task per partition,
               large-star and small-star alternately, each reading the directed edges of its
               partition's nodes and sending its output edges on (`cc/rNNN/`), until a large-star +
               small-star pair leaves the edge set unchanged (compared by an order-independent
               checksum of each partition's input). Either way each node ends up linked to the
               smallest node of its component;
4. members     each node's component label (the component's first document) joined with its id and
               length, sent to the partition of its label;
5. winners     one document kept per component; the others become `losers-pNNN.arrow` with reason
               `near_duplicate` and the kept id, which the next segment drops like any global stage's;
               each partition's cluster members (`clusters-pNNN.arrow`, sorted by order);
6. clusters    one task merges those files by order into `near_duplicates/clusters.parquet`, a range
               of orders at a time (`clusters_task`). The driver only adds up the tasks' counts.

Memory per task is bounded by the partition count (and `one_task_edges`), not by the corpus. Every
task writes its output atomically and then a record, so a resumed run replays the same steps.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from datapipe.core.shards import atomic_write_json, atomic_write_table, read_table, replacing
from datapipe.core.storage import Location, location
from stages.base import LOSER_SCHEMA, GlobalStage, RunTasks, read_partition
from stages.minhash import (
    CLUSTER_SCHEMA,
    SHINGLES_SCHEMA,
    MinHashStage,
    candidate_edges,
    choose_kept,
    connected_components,
    distinct_sorted,
    exact_edges,
    fmix,
    labels,
    large_star,
    partition_of,
    small_star,
)

EDGE_SCHEMA = pa.schema([("src", pa.int64()), ("dst", pa.int64())])
PAIR_SCHEMA = pa.schema([("u", pa.int64()), ("v", pa.int64())])


def _send_edges(folder: Location, a: np.ndarray, b: np.ndarray, partitions: int, sender: str) -> None:
    """Write undirected edges (a, b) as directed edges in both directions to the partitions of
    their sources: `folder/pNNN/from-<sender>.arrow`."""
    src = np.concatenate([a, b])
    dst = np.concatenate([b, a])
    part = partition_of(src, partitions)
    for p in range(partitions):
        mask = part == p
        if mask.any():
            atomic_write_table(
                folder / f"p{p:03d}" / f"from-{sender}.arrow",
                pa.table({"src": src[mask], "dst": dst[mask]}, schema=EDGE_SCHEMA),
            )


def _directed(folder: Location) -> tuple[np.ndarray, np.ndarray]:
    table = read_partition(folder, EDGE_SCHEMA)
    if table.num_rows == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    pairs = np.unique(np.stack([table.column("src").to_numpy(), table.column("dst").to_numpy()], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def _checksum(src: np.ndarray, dst: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        mixed = fmix(src.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + dst.astype(np.uint64), 64)
        return int(np.add.reduce(mixed, dtype=np.uint64))


def _once(record: Location, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    if record.exists():
        return json.loads(record.read_text())
    result = work()
    atomic_write_json(record, result)
    return result


class ShingleStore:
    """The documents' shingle sets, read by order from the map side's `shingles` files (one row per
    document, `order` increasing within a file); `index` is each file's path and first order."""

    def __init__(self, index: list[tuple[str, int]]) -> None:
        self.paths = [path for path, _ in index]
        self.first = np.array([first for _, first in index], dtype=np.int64)

    @staticmethod
    def index(folder: Location) -> list[tuple[str, int]]:
        """(path, first order) of every shingles file under `folder`, by first order."""
        files = [(str(f), int(read_table(f).column("order")[0].as_py())) for f in sorted(folder.glob("*.arrow"))]
        return sorted(files, key=lambda x: x[1])

    def __call__(self, orders: np.ndarray) -> dict[int, np.ndarray]:
        """Sorted distinct shingle hashes of each of `orders`."""
        out: dict[int, np.ndarray] = {}
        which = np.searchsorted(self.first, orders, side="right") - 1
        for f in np.unique(which):
            wanted = orders[which == f]
            table = read_table(self.paths[f]) if f >= 0 else SHINGLES_SCHEMA.empty_table()
            file_orders = table.column("order").to_numpy()
            rows = np.minimum(np.searchsorted(file_orders, wanted), max(len(file_orders) - 1, 0))
            if len(file_orders) == 0 or (file_orders[rows] != wanted).any():  # a bug, never bad input
                raise RuntimeError(f"near dedup: shingles of documents {wanted.tolist()[:5]} not found in the work folder")
            picked = table.column("hashes").take(pa.array(rows)).combine_chunks()
            values = picked.flatten().to_numpy()
            ends = np.cumsum(pc.list_value_length(picked).to_numpy())
            for order, part in zip(wanted.tolist(), np.split(values, ends[:-1])):
                out[order] = distinct_sorted(part)
        return out


def shingle_index_task(folder: str, _: int = 0) -> list[tuple[str, int]]:
    """`ShingleStore.index(folder)` as a task: it opens every shingles file, which the driver does not."""
    return ShingleStore.index(location(folder))


def edges_task(shared: tuple[str, Any], p: int) -> dict[str, Any]:
    folder, stage = shared
    root = location(folder)

    def work() -> dict[str, Any]:
        buckets = read_partition(root / "buckets" / f"p{p:03d}")
        if buckets is None:
            return {"edges": 0, "candidates": 0, "near": 0}
        found = candidate_edges(buckets, stage.config)
        _send_edges(root / "cc" / "r000", found.edge_u, found.edge_v, stage.config.partitions, f"p{p:03d}")
        part = partition_of(found.near_u, stage.config.partitions)
        for q in np.unique(part):
            pairs = pa.table({"u": found.near_u[part == q], "v": found.near_v[part == q]}, schema=PAIR_SCHEMA)
            atomic_write_table(root / "exact" / f"p{q:03d}" / f"from-p{p:03d}.arrow", pairs)
        return {"edges": int(len(found.edge_u)), "candidates": found.pairs, "near": int(len(found.near_u))}

    return _once(root / "records" / f"edges-p{p:03d}.json", work)


def exact_task(shared: tuple[str, Any, list[tuple[str, int]]], p: int) -> dict[str, Any]:
    folder, stage, shingle_index = shared
    root = location(folder)

    def work() -> dict[str, Any]:
        pairs = read_partition(root / "exact" / f"p{p:03d}", PAIR_SCHEMA)
        if pairs.num_rows == 0:
            return {"edges": 0, "checked": 0}
        uv = np.unique(np.stack([pairs.column("u").to_numpy(), pairs.column("v").to_numpy()], axis=1), axis=0)
        a, b = exact_edges(uv[:, 0], uv[:, 1], ShingleStore(shingle_index), stage.config.threshold)
        _send_edges(root / "cc" / "r000", a, b, stage.config.partitions, f"exact-p{p:03d}")
        return {"edges": int(len(a)), "checked": int(len(uv))}

    return _once(root / "records" / f"exact-p{p:03d}.json", work)


def components_task(shared: tuple[str, Any]) -> dict[str, Any]:
    """All edges in one task: components in memory, written as the converged rounds would be."""
    folder, stage = shared
    root = location(folder)

    def work() -> dict[str, Any]:
        edges = _all_edges(root / "cc" / "r000")
        keep = edges[0] < edges[1]  # each undirected edge once
        a, b, rounds = connected_components(edges[0][keep], edges[1][keep], stage.config.max_rounds)
        _send_edges(root / "cc" / "one-task", a, b, stage.config.partitions, "components")
        return {"rounds": rounds}

    return _once(root / "records" / "components.json", work)


def _all_edges(folder: Location) -> tuple[np.ndarray, np.ndarray]:
    """The directed edges of every partition under `folder`."""
    tables = [read_partition(part, EDGE_SCHEMA) for part in sorted(folder.glob("p*"))]
    table = pa.concat_tables(tables) if tables else EDGE_SCHEMA.empty_table()
    return table.column("src").to_numpy(), table.column("dst").to_numpy()


def round_task(shared: tuple[str, Any], r: int, p: int) -> dict[str, Any]:
    folder, stage = shared
    root = location(folder)

    def work() -> dict[str, Any]:
        src, dst = _directed(root / "cc" / f"r{r:03d}" / f"p{p:03d}")
        step = large_star if r % 2 == 0 else small_star
        a, b = step(src, dst)
        _send_edges(root / "cc" / f"r{r + 1:03d}", a, b, stage.config.partitions, f"p{p:03d}")
        return {"input_edges": int(len(src)), "checksum": _checksum(src, dst)}

    return _once(root / "records" / f"round{r:03d}-p{p:03d}.json", work)


def members_task(shared: tuple[str, Any], converged: str, p: int) -> dict[str, Any]:
    """Labels from the converged edges in `cc/<converged>/`, joined with the nodes' ids and lengths."""
    folder, stage = shared
    root = location(folder)

    def work() -> dict[str, Any]:
        node, label = labels(*_directed(root / "cc" / converged / f"p{p:03d}"))
        nodes = read_partition(root / "nodes" / f"p{p:03d}")
        if len(node) == 0 or nodes is None:
            return {"members": 0}
        in_graph = pa.table({"order": node, "label": label})
        members = in_graph.join(nodes.select(["order", "id", "length"]), "order", join_type="inner")
        part = partition_of(members.column("label").to_numpy(), stage.config.partitions)
        for q in np.unique(part):
            atomic_write_table(root / "members" / f"p{q:03d}" / f"from-p{p:03d}.arrow", members.filter(pa.array(part == q)))
        return {"members": members.num_rows}

    return _once(root / "records" / f"members-p{p:03d}.json", work)


def winners_task(shared: tuple[str, Any], p: int) -> dict[str, Any]:
    folder, stage = shared
    root = location(folder)

    def work() -> dict[str, Any]:
        members = read_partition(root / "members" / f"p{p:03d}")
        if members is None:
            losers, clusters = LOSER_SCHEMA.empty_table(), CLUSTER_SCHEMA.empty_table()
        else:
            losers, clusters = choose_kept(members, stage.config.keep)
        # By order, so that `clusters_task` merges the partitions without sorting them all at once.
        clusters = clusters.sort_by([("order", "ascending")])
        atomic_write_table(root / f"clusters-p{p:03d}.arrow", clusters)
        atomic_write_table(root / f"losers-p{p:03d}.arrow", losers)
        # A cluster lives in one partition (members go to the partition of their label): counts add up.
        n_clusters = len(pc.unique(clusters.column("cluster_id"))) if clusters.num_rows else 0
        return {"losers": losers.num_rows, "clusters": n_clusters}

    return _once(root / "records" / f"winners-p{p:03d}.json", work)


MERGE_ROWS = 1 << 16  # rows taken from each partition's file per step of `clusters_task`'s merge


def clusters_task(shared: tuple[str, str], _: int = 0) -> dict[str, Any]:
    """`out_dir/near_duplicates/clusters.parquet`: every partition's clusters (each file sorted by order)
    merged by order, written a range of orders at a time: a step holds at most `MERGE_ROWS` rows of each
    partition, so memory is bounded by the partition count, not by the corpus."""
    folder, out_dir = location(shared[0]), location(shared[1])

    def work() -> dict[str, Any]:
        tables = [read_table(f) for f in sorted(folder.glob("clusters-p*.arrow"))]  # memory-mapped when local
        orders = [t.column("order").to_numpy() for t in tables]
        # Step boundaries: every MERGE_ROWS-th order of every file, so no step takes more from a file.
        bounds = np.unique(np.concatenate([o[::MERGE_ROWS] for o in orders] + [np.empty(0, np.int64)]))
        bounds = np.r_[bounds[1:], np.iinfo(np.int64).max] if len(bounds) else np.empty(0, np.int64)
        schema = CLUSTER_SCHEMA.remove(CLUSTER_SCHEMA.get_field_index("order"))
        rows, start = 0, [0] * len(tables)
        path = out_dir / "near_duplicates" / "clusters.parquet"
        with replacing(path, False) as tmp, tmp.open("wb") as sink, pq.ParquetWriter(sink, schema) as writer:
            for bound in bounds:
                parts = []
                for i, (t, o) in enumerate(zip(tables, orders)):
                    stop = int(np.searchsorted(o, bound, side="left")) if bound != np.iinfo(np.int64).max else len(o)
                    if stop > start[i]:
                        parts.append(t.slice(start[i], stop - start[i]))
                        start[i] = stop
                if parts:
                    step = pa.concat_tables(parts).sort_by([("order", "ascending")]).drop(["order"])
                    writer.write_table(step)
                    rows += step.num_rows
            if rows == 0:
                writer.write_table(schema.empty_table())
        return {"rows": rows}

    return _once(folder / "records" / "clusters.json", work)


class NearDedupStage(MinHashStage, GlobalStage):
    """Near dedup as a global stage: `MinHashStage`'s keys, resolved by this module's tasks."""

    def resolve(self, run_tasks: RunTasks, folder: Location, out_dir: Location) -> dict[str, Any]:
        return resolve(run_tasks, folder, self, out_dir)


def resolve(run_tasks: RunTasks, folder: Location, stage: MinHashStage, out_dir: Location) -> dict[str, Any]:
    """Run the whole resolution with `run_tasks(fn, shared, items, desc)` (an executor's: it calls
    `fn(shared, *item)` for each item); write
    `out_dir/near_duplicates/clusters.parquet`. Returns a summary for the stats."""
    config = stage.config
    partitions = range(config.partitions)
    shared = (str(folder), stage)
    found = run_tasks(edges_task, shared, [(p,) for p in partitions], f"{stage.name} edges")
    checked = []
    if sum(x["near"] for x in found):
        shingle_index = run_tasks(shingle_index_task, str(folder / "shingles" / "p000"), [(0,)], f"{stage.name} shingles")[0]
        checked = run_tasks(exact_task, (*shared, shingle_index), [(p,) for p in partitions], f"{stage.name} exact")
    edges = sum(x["edges"] for x in found) + sum(x["edges"] for x in checked)
    if edges <= config.one_task_edges:
        rounds = run_tasks(components_task, shared, [()], f"{stage.name} components")[0]["rounds"]
        converged = "one-task"
    else:
        rounds = _component_rounds(run_tasks, shared, config)
        converged = f"r{rounds - 1:03d}"  # the input of the last round
    run_tasks(members_task, shared, [(converged, p) for p in partitions], f"{stage.name} members")
    kept = run_tasks(winners_task, shared, [(p,) for p in partitions], f"{stage.name} keep")
    run_tasks(clusters_task, (str(folder), str(out_dir)), [(0,)], f"{stage.name} clusters")
    losers, n_clusters = sum(x["losers"] for x in kept), sum(x["clusters"] for x in kept)
    return {
        "candidate_pairs": sum(x["candidates"] for x in found),  # distinct within each bucket partition
        "exact_checked": sum(x["checked"] for x in checked),
        "edges": edges,
        "rounds": rounds,
        "clusters": n_clusters,
        "removed": losers,
    }


def _component_rounds(run_tasks: RunTasks, shared: tuple[str, Any], config: Any) -> int:
    """Distributed large-star / small-star rounds until convergence; the number of rounds run (the
    last one's input, `cc/r<rounds-1>/`, is the converged edge set)."""
    checksums: list[tuple[int, int]] = []
    r = 0
    while True:
        results = run_tasks(round_task, shared, [(r, p) for p in range(config.partitions)], f"{shared[1].name} components round {r}")
        checksums.append((sum(x["input_edges"] for x in results), sum(x["checksum"] for x in results) % 2**64))
        # A large-star round whose input equals the previous large-star round's input: converged.
        if r % 2 == 0 and r >= 2 and checksums[r] == checksums[r - 2]:
            return r + 1
        r += 1
        if r >= config.max_rounds:
            raise RuntimeError(
                f"near-dedup connected components did not converge in {config.max_rounds} rounds "
                "(dedup.minhash.max_rounds)"
            )
