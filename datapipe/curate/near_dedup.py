"""The distributed resolution of near-dedup (MinHash-LSH): shuffles and rounds as tasks.

After the map side (`stages.minhash.MinHashStage.keys`) has written every document's LSH bucket
keys into `work/minhash/buckets/pNNN/` (hash-partitioned by bucket) and its id and length into
`work/minhash/nodes/pNNN/` (partitioned by document), this module runs, one task per partition:

1. edges       candidate pairs per bucket (verified by estimated Jaccard), sent to the partitions of
               both their ends (`cc/r000/`);
2. rounds      large-star and small-star alternately, each reading the directed edges of its
               partition's nodes and sending its output edges on (`cc/rNNN/`), until a large-star +
               small-star pair leaves the edge set unchanged (compared by an order-independent
               checksum of each partition's input);
3. members     each node's component label (the component's first document) joined with its id and
               length, sent to the partition of its label;
4. winners     one document kept per component; the others become `losers-pNNN.arrow` with reason
               `near_duplicate` and the kept id, which the next segment drops like any global stage's.

Memory per task is bounded by the partition count, not by the corpus. Every task writes its output
atomically and then a record, so a resumed run replays the same rounds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.shards import atomic_write_json, atomic_write_table, read_table
from stages.minhash import CLUSTER_SCHEMA, LOSER_SCHEMA, choose_kept, candidate_edges, labels, large_star, partition_of, small_star
from stages.minhash import _fmix  # the same finalizer the signatures use, for the edge-set checksum

EDGE_SCHEMA = pa.schema([("src", pa.int64()), ("dst", pa.int64())])


def _read_all(folder: Path, schema: pa.Schema | None = None) -> pa.Table | None:
    files = sorted(folder.glob("*.arrow")) if folder.is_dir() else []
    if not files:
        return schema.empty_table() if schema is not None else None
    return pa.concat_tables([read_table(f) for f in files])


def _send_edges(folder: Path, a: np.ndarray, b: np.ndarray, partitions: int, sender: int) -> None:
    """Write undirected edges (a, b) as directed edges in both directions to the partitions of
    their sources: `folder/pNNN/from-pSSS.arrow`."""
    src = np.concatenate([a, b])
    dst = np.concatenate([b, a])
    part = partition_of(src, partitions)
    for p in range(partitions):
        mask = part == p
        if mask.any():
            atomic_write_table(
                folder / f"p{p:03d}" / f"from-p{sender:03d}.arrow",
                pa.table({"src": src[mask], "dst": dst[mask]}, schema=EDGE_SCHEMA),
            )


def _directed(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    table = _read_all(folder, EDGE_SCHEMA)
    if table.num_rows == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    pairs = np.unique(np.stack([table.column("src").to_numpy(), table.column("dst").to_numpy()], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def _checksum(src: np.ndarray, dst: np.ndarray) -> int:
    with np.errstate(over="ignore"):
        mixed = _fmix(src.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + dst.astype(np.uint64), 64)
        return int(np.add.reduce(mixed, dtype=np.uint64))


def _once(record: Path, work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    if record.exists():
        return json.loads(record.read_text())
    result = work()
    atomic_write_json(record, result)
    return result


def edges_task(shared: tuple[str, Any], p: int) -> dict[str, Any]:
    folder, stage = shared
    root = Path(folder)

    def work() -> dict[str, Any]:
        buckets = _read_all(root / "buckets" / f"p{p:03d}")
        if buckets is None:
            return {"edges": 0}
        a, b = candidate_edges(buckets, stage.config)
        _send_edges(root / "cc" / "r000", a, b, stage.config.partitions, p)
        return {"edges": int(len(a))}

    return _once(root / "records" / f"edges-p{p:03d}.json", work)


def round_task(shared: tuple[str, Any], r: int, p: int) -> dict[str, Any]:
    folder, stage = shared
    root = Path(folder)

    def work() -> dict[str, Any]:
        src, dst = _directed(root / "cc" / f"r{r:03d}" / f"p{p:03d}")
        step = large_star if r % 2 == 0 else small_star
        a, b = step(src, dst)
        _send_edges(root / "cc" / f"r{r + 1:03d}", a, b, stage.config.partitions, p)
        return {"input_edges": int(len(src)), "checksum": _checksum(src, dst)}

    return _once(root / "records" / f"round{r:03d}-p{p:03d}.json", work)


def members_task(shared: tuple[str, Any], r: int, p: int) -> dict[str, Any]:
    folder, stage = shared
    root = Path(folder)

    def work() -> dict[str, Any]:
        node, label = labels(*_directed(root / "cc" / f"r{r:03d}" / f"p{p:03d}"))
        nodes = _read_all(root / "nodes" / f"p{p:03d}")
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
    root = Path(folder)

    def work() -> dict[str, Any]:
        members = _read_all(root / "members" / f"p{p:03d}")
        if members is None:
            losers, clusters = LOSER_SCHEMA.empty_table(), CLUSTER_SCHEMA.empty_table()
        else:
            losers, clusters = choose_kept(members, stage.config.keep)
        atomic_write_table(root / f"clusters-p{p:03d}.arrow", clusters)
        atomic_write_table(root / f"losers-p{p:03d}.arrow", losers)
        return {"losers": losers.num_rows}

    return _once(root / "records" / f"winners-p{p:03d}.json", work)


def resolve(run_tasks: Callable[..., list[Any]], folder: Path, stage: Any, out_dir: Path) -> dict[str, Any]:
    """Run the whole resolution with `run_tasks(fn, shared, items, desc)` (an executor's: it calls
    `fn(shared, *item)` for each item); write
    `out_dir/near_duplicates/clusters.parquet`. Returns a summary for the stats."""
    partitions = range(stage.config.partitions)
    shared = (str(folder), stage)
    candidates = sum(r["edges"] for r in run_tasks(edges_task, shared, [(p,) for p in partitions], "minhash edges"))
    checksums: list[tuple[int, int]] = []
    r = 0
    while True:
        results = run_tasks(round_task, shared, [(r, p) for p in partitions], f"minhash cc r{r}")
        checksums.append((sum(x["input_edges"] for x in results), sum(x["checksum"] for x in results) % 2**64))
        # A large-star round whose input equals the previous large-star round's input: converged.
        if r % 2 == 0 and r >= 2 and checksums[r] == checksums[r - 2]:
            break
        r += 1
        if r >= stage.config.max_rounds:
            raise RuntimeError(
                f"near-dedup connected components did not converge in {stage.config.max_rounds} rounds "
                "(dedup.minhash.max_rounds)"
            )
    run_tasks(members_task, shared, [(r, p) for p in partitions], "minhash members")
    losers = sum(x["losers"] for x in run_tasks(winners_task, shared, [(p,) for p in partitions], "minhash keep"))
    clusters = [read_table(f) for f in sorted(folder.glob("clusters-p*.arrow"))]
    table = pa.concat_tables(clusters) if clusters else CLUSTER_SCHEMA.empty_table()
    table = table.sort_by([("order", "ascending")]).drop(["order"])
    atomic_write_table(out_dir / "near_duplicates" / "clusters.parquet", table, format="parquet")
    n_clusters = len(pc.unique(table.column("cluster_id"))) if table.num_rows else 0
    return {"candidate_pairs": candidates, "rounds": r + 1, "clusters": n_clusters, "removed": losers}

