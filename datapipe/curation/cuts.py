"""Rank cuts over every block: keep each group's documents in rank order until its budget is spent.

Diversity sampling (a group is a k-means cluster of a domain, ranked by a seeded hash) and selection by a model
(a group is a domain or the whole corpus, ranked by the model's score) decide the same way, exactly and
without holding the documents in the driver:

1. every block's rows come as an assignment file `work/<folder>/<block>.arrow` (`ASSIGN_SCHEMA`: row, domain,
   cluster, rank, num_tokens); lower rank is kept first;
2. hist      one task per block: documents and tokens per (domain, cluster, rank bucket: the top 12 bits);
             tasks sum them a group of files at a time, and the driver adds the sums into each cluster's quota
             and the bucket where the quota runs out;
3. boundary  one task per block sends back that bucket's rows (1/4096 of them, for ranks spread evenly); the
             driver finds the last one each cluster keeps, by (rank, block, row).

A `Cut` then tells any task whether a row is kept, from its cluster, rank, block and row alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.storage import Location, location
from datapipe.core.workfiles import read_work_table, write_work_table
from datapipe.curation.phase import record_in
from datapipe.curation.blocks import block_file
from stages import diversity

ASSIGN_SCHEMA = pa.schema([("row", pa.int64()), ("domain", pa.string()), ("cluster", pa.int32()),
                           ("rank", pa.uint64()), ("num_tokens", pa.int64())])
HIST_SCHEMA = pa.schema([("domain", pa.string()), ("key", pa.int64()), ("docs", pa.int64()), ("tokens", pa.int64())])
BUCKET_BITS = 12  # rank buckets per cluster in the histograms: 4096
BUCKETS = 1 << BUCKET_BITS
MERGE_GROUP = 256  # histogram files summed per task


@dataclass(frozen=True)
class RowCopies:
    """How many times each row of every block is written: one file per block, `folder/<block>.arrow`,
    its column `column` (a bool column reads as 0/1); `passes` is the largest count of any row."""

    folder: str
    column: str
    passes: int = 1

    def file(self, block: str) -> Location:
        folder = location(self.folder)  # where the writer put it: `block_file` of the folder's parent and name
        return block_file(folder.parent, folder.name, block)

    def of(self, block: str) -> np.ndarray:
        values = read_work_table(self.file(block)).column(self.column)
        return values.to_numpy(zero_copy_only=False).astype(np.int64)


def held_rows(held_out: RowCopies | None, block: str, rows: int) -> np.ndarray:
    """Bool per row of the block: not training data (held out), from `held_out`'s counts."""
    return held_out.of(block) > 0 if held_out is not None else np.zeros(rows, dtype=bool)


@dataclass(frozen=True)
class Budget:
    """What a group (a domain's name in the assignment files) keeps: `value` tokens (`by_tokens`) or a fraction
    `value` of its documents, spread evenly over its `clusters` clusters by water-filling. `fill`: a cluster also
    keeps the document that crosses its quota, so it holds at least the quota (never short of it by one long
    document); without it, a cluster stops before that document."""

    value: float
    by_tokens: bool
    clusters: int = 1
    fill: bool = False


def assigned(work: Location, folder: str, block: str, held_out: RowCopies | None) -> pa.Table:
    """The block's assignments, training rows only."""
    part = read_work_table(block_file(work, folder, block))
    if held_out is not None and part.num_rows:  # held-out rows are never sampled
        part = part.filter(pa.array(~held_rows(held_out, block, 0)[part.column("row").to_numpy()]))
    return part


def rank_bucket(rank: np.ndarray) -> np.ndarray:
    return (rank >> np.uint64(64 - BUCKET_BITS)).astype(np.int64)


@dataclass(frozen=True)
class CutTask:
    """What the tasks of a cut share: the work folder (their records go below it), the step's folder in it
    (`diversity`, `model_select`) holding each block's assignment, the rows held out, and the boundary buckets."""

    folder: str
    step: str
    held_out: RowCopies | None
    edges: dict[str, np.ndarray] | None = None


def hist_task(task: CutTask, block: str) -> dict[str, str]:
    """Documents and tokens of the block's training rows per (domain, cluster, rank bucket) ->
    work/<folder>/hist/<block>.arrow (`key` = cluster * BUCKETS + bucket; `block_file`); its path in work/ (a record names no
    absolute path: a moved output folder resumes from its own files)."""
    work, folder, held_out = location(task.folder), task.step, task.held_out
    out = block_file(work, f"{folder}/hist", block)
    relative = str(out)[len(str(work)) + 1:]
    part = assigned(work, folder, block, held_out)
    key = part.column("cluster").to_numpy().astype(np.int64) * BUCKETS + rank_bucket(part.column("rank").to_numpy())
    table = pa.table({"domain": part.column("domain"), "key": key, "docs": np.ones(len(key), np.int64),
                      "tokens": part.column("num_tokens").to_numpy().astype(np.int64)})
    write_work_table(out, _summed(table))
    return {"path": relative}


def _summed(table: pa.Table) -> pa.Table:
    table = table.group_by(["domain", "key"], use_threads=False).aggregate([("docs", "sum"), ("tokens", "sum")])
    return table.select(["domain", "key", "docs_sum", "tokens_sum"]).rename_columns(HIST_SCHEMA.names).cast(HIST_SCHEMA)


def hist_merge_task(work: str, files: list[str]) -> pa.Table:
    """The sum of some blocks' histograms (`hist_task`'s files, in `work`), per (domain, key): at most one row per
    rank bucket of each cluster, whatever the number of blocks."""
    tables = [read_work_table(location(work) / f) for f in files]
    return _summed(pa.concat_tables(tables) if tables else HIST_SCHEMA.empty_table())


@dataclass
class Cut:
    """Where one group's clusters stop: cluster c keeps its rows of rank buckets below `bucket[c]`, and of bucket
    `bucket[c]` those at or before (rank, block, row) `last[c]` (none when `has_last[c]` is false)."""

    bucket: np.ndarray
    last_rank: np.ndarray
    last_block: np.ndarray
    last_row: np.ndarray
    has_last: np.ndarray

    def keep(self, cluster: np.ndarray, rank: np.ndarray, block: int | np.ndarray, row: np.ndarray) -> np.ndarray:
        bucket, edge = rank_bucket(rank), self.bucket[cluster]
        lr, lb, lw = self.last_rank[cluster], self.last_block[cluster], self.last_row[cluster]
        at_or_before = (rank < lr) | ((rank == lr) & ((block < lb) | ((block == lb) & (row <= lw))))
        return (bucket < edge) | ((bucket == edge) & self.has_last[cluster] & at_or_before)


def boundary_task(task: CutTask, block: str, index: int) -> dict[str, np.ndarray]:
    """Per group, the block's training rows that fall in their cluster's boundary bucket:
    columns cluster, rank, block (index), row, tokens."""
    work, folder, held_out, edges = location(task.folder), task.step, task.held_out, task.edges
    part = assigned(work, folder, block, held_out)
    domains = np.array(part.column("domain").to_pylist(), dtype=object)
    cluster, rank = part.column("cluster").to_numpy().astype(np.int64), part.column("rank").to_numpy()
    out = {}
    for d, edge in edges.items():
        mine = domains == d
        mine[mine] = rank_bucket(rank[mine]) == edge[cluster[mine]]
        rows = np.flatnonzero(mine)
        out[d] = np.stack([cluster[rows], rank[rows].view(np.int64), np.full(len(rows), index, np.int64),
                           part.column("row").to_numpy()[rows], part.column("num_tokens").to_numpy()[rows].astype(np.int64)], axis=1)
    return out


def _histograms(run_tasks: Callable[..., list[Any]], work: Location, folder: str, names: list[str], budgets: dict[str, Budget],
                held_out: RowCopies | None) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Documents and tokens per (cluster * BUCKETS + rank bucket) of each group, summed over every block."""
    files = [r["path"] for r in run_tasks(hist_task, CutTask(str(work), folder, held_out), [(b,) for b in names],
                                          f"{folder} histogram", record=record_in(f"{folder}/hist", first_item_only=True))]
    # the blocks' histograms summed by tasks, a group of files each: the driver opens no file
    groups = [(files[i : i + MERGE_GROUP],) for i in range(0, len(files), MERGE_GROUP)]
    merged = run_tasks(hist_merge_task, str(work), groups, f"{folder} histogram merge")
    docs = {d: np.zeros(b.clusters * BUCKETS, np.int64) for d, b in budgets.items()}
    tokens = {d: np.zeros(b.clusters * BUCKETS, np.int64) for d, b in budgets.items()}
    for table in merged:  # one group's sums at a time
        for d in np.unique(np.array(table.column("domain").to_pylist(), dtype=object)) if table.num_rows else []:
            if d not in docs:
                continue
            sub = table.filter(pc.equal(table.column("domain"), d))
            np.add.at(docs[d], sub.column("key").to_numpy(), sub.column("docs").to_numpy())
            np.add.at(tokens[d], sub.column("key").to_numpy(), sub.column("tokens").to_numpy())
    return docs, tokens


def cuts(run_tasks: Callable[..., list[Any]], work: Location, folder: str, names: list[str], budgets: dict[str, Budget],
         held_out: RowCopies | None) -> tuple[dict[str, Cut], dict[str, Any], dict[str, int]]:
    """Each group's cut over the assignment files `work/<folder>/<block>.arrow` of blocks `names` (in order), its
    report entry, and the tokens its kept rows hold."""
    docs, tokens = _histograms(run_tasks, work, folder, names, budgets, held_out)
    plans: dict[str, dict[str, Any]] = {}
    for d, budget in budgets.items():
        if docs[d].sum() == 0:
            continue
        per_doc = docs[d].reshape(-1, BUCKETS)
        k = int(np.flatnonzero(per_doc.sum(1))[-1]) + 1  # clusters up to the last one holding a document
        weight = (tokens[d] if budget.by_tokens else docs[d]).reshape(-1, BUCKETS)[:k]
        n = int(per_doc.sum())
        quota = diversity.water_fill(weight.sum(1).astype(np.float64), budget.value if budget.by_tokens else budget.value * n)
        limit = quota if budget.by_tokens else np.round(quota)
        running = np.cumsum(weight, axis=1)
        over = running > limit[:, None] + 1e-9
        edge = np.where(over.any(1), over.argmax(1), BUCKETS)  # BUCKETS: the whole cluster is kept
        before = np.where(edge > 0, running[np.arange(k), np.maximum(edge - 1, 0)], 0)
        plans[d] = {"k": k, "n": n, "limit": limit, "edge": edge, "before": before}
    edges = {d: p["edge"] for d, p in plans.items()}
    found = run_tasks(boundary_task, CutTask(str(work), folder, held_out, edges), [(b, i) for i, b in enumerate(names)],
                      f"{folder} boundary") if edges else []
    result, report, kept_tokens = {}, {}, {}
    for d, p in plans.items():
        rows = np.concatenate([f[d] for f in found] + [np.empty((0, 5), np.int64)])
        cut, kept_docs, kept_tok = _last_kept(p, rows, budgets[d], docs[d], tokens[d])
        result[d] = cut
        kept_tokens[d] = kept_tok
        report[d] = {"docs_in": p["n"], "docs_kept": kept_docs, "clusters": p["k"]}
    return result, report, kept_tokens


def _last_kept(p: dict[str, Any], rows: np.ndarray, budget: Budget, docs: np.ndarray, tokens: np.ndarray) -> tuple[Cut, int, int]:
    """One group's cut from its boundary rows: in each cluster, the prefix (by rank, then block and row) of its
    boundary bucket that stays within the quota (with `budget.fill`, that starts below it: the crossing document
    too). Also the documents and tokens the group keeps."""
    k, edge = p["k"], p["edge"]
    cut = Cut(edge, np.zeros(k, np.uint64), np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, bool))
    per_doc, per_tok = docs.reshape(-1, BUCKETS)[:k], tokens.reshape(-1, BUCKETS)[:k]
    full = np.arange(BUCKETS)[None, :] < edge[:, None]
    kept_docs, kept_tok = int(per_doc[full].sum()), int(per_tok[full].sum())
    weights = rows[:, 4] if budget.by_tokens else np.ones(len(rows), np.int64)  # tokens, or documents
    for c in np.unique(rows[:, 0]):
        mine = rows[rows[:, 0] == c]
        w = weights[rows[:, 0] == c]
        order = np.lexsort((mine[:, 3], mine[:, 2], mine[:, 1].view(np.uint64)))  # by rank, then block and row
        within = p["before"][c] + np.cumsum(w[order])
        if budget.fill:  # the documents that start below the quota: the crossing one is in this bucket (`edge`)
            chosen = order[within - w[order] < p["limit"][c] - 1e-9]
        else:
            chosen = order[within <= p["limit"][c] + 1e-9]  # a prefix: the running total only grows
        if len(chosen):
            last = mine[chosen[-1]]
            cut.last_rank[c], cut.last_block[c], cut.last_row[c], cut.has_last[c] = np.uint64(last[1].view(np.uint64)), last[2], last[3], True
            kept_docs += len(chosen)
            kept_tok += int(mine[chosen, 4].sum())
    return cut, kept_docs, kept_tok
