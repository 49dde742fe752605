"""Selection between tokenize and shards: diversity sampling, then mixture reweighting.

Both need each document's token count, so they run on the tokenized blocks: the result is, for
every block, how many times each row is written (0 = dropped, 2 = repeated once), in a file per block
(`work/select/<block>.arrow`, read through `RowCopies`). Every per-document decision is made in tasks
over blocks; the driver holds per-domain (and per-cluster) totals only:

1. count     one task per block: training documents and tokens per domain;
2. centroids (diversity) a seeded sample of at most `fit_docs` documents per sampled domain, taken by
             one task per block, fits the k-means centroids in the driver; one task per block assigns
             every document to its nearest centroid (`work/diversity/<block>.arrow`);
3. histogram (diversity) one task per block writes its documents' (cluster, rank bucket) counts and
             tokens; the driver adds them up one block at a time into each cluster's quota (spread
             evenly over the clusters, `stages.diversity.water_fill`) and the rank bucket where the
             quota runs out; the documents of that one bucket per cluster (1/4096 of them) come back
             to the driver, which finds the last one a cluster keeps. A cluster keeps its documents in
             seeded-rank order while its running total stays within the quota: the same rule as
             `stages.diversity.select` over the whole domain, decided exactly;
4. select    one task per block: diversity's choice, then the mixture's copies (`stages.mixture`:
             per-document from a per-domain rate planned on the tokens left after diversity), the
             dropped documents' records, the copies file, and the counters' changes.

Everything is seeded and ordered by block, so the choice is the same on any number of workers. Rows
held out of training (the eval split of `eval_split.py` and the copies of its documents) get 0
copies, and neither step sees them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.curate.counters import Counters
from datapipe.core.schema import DROPPED_SCHEMA
from datapipe.core.shards import atomic_write_bytes, atomic_write_table
from datapipe.core.workfiles import read_work_table, write_work_table
from datapipe.core.storage import Location, location
from datapipe.curate.phase import record_in
from stages import diversity, mixture

ASSIGN_SCHEMA = pa.schema([("row", pa.int64()), ("domain", pa.string()), ("cluster", pa.int32()),
                           ("rank", pa.uint64()), ("num_tokens", pa.int64())])


HIST_SCHEMA = pa.schema([("domain", pa.string()), ("key", pa.int64()), ("docs", pa.int64()), ("tokens", pa.int64())])
BUCKET_BITS = 12  # rank buckets per cluster in the histograms: 4096
BUCKETS = 1 << BUCKET_BITS
COPIES_DIR = "select"  # work/select/<block>.arrow: column `copies`


@dataclass(frozen=True)
class RowCopies:
    """How many times each row of every block is written: one file per block, `folder/<block>.arrow`,
    its column `column` (a bool column reads as 0/1); `passes` is the largest count of any row."""

    folder: str
    column: str
    passes: int = 1

    def of(self, block: str) -> np.ndarray:
        values = read_work_table(location(self.folder) / f"{block}.arrow").column(self.column)
        return values.to_numpy(zero_copy_only=False).astype(np.int64)


def _token_file(work: Location, block: str) -> Location:
    return work / "tokens" / f"{block}.arrow"


def _held(held_out: RowCopies | None, block: str, rows: int) -> np.ndarray:
    """Bool per row: not training data."""
    return held_out.of(block) > 0 if held_out is not None else np.zeros(rows, dtype=bool)


def count_task(shared: tuple[str, RowCopies | None], block: str) -> dict[str, list[int]]:
    """Per domain of the block's rows (in order of first appearance, held-out rows included): training
    [documents, tokens]."""
    work, held_out = location(shared[0]), shared[1]
    table = read_work_table(_token_file(work, block)).select(["domain", "num_tokens"])
    domains = np.array(table.column("domain").to_pylist(), dtype=object)
    tokens = table.column("num_tokens").to_numpy()
    training = ~_held(held_out, block, table.num_rows)
    out: dict[str, list[int]] = {}
    names, first = np.unique(domains, return_index=True) if len(domains) else ([], [])
    for d in [names[i] for i in np.argsort(first)]:
        rows = (domains == d) & training
        out[d] = [int(rows.sum()), int(tokens[rows].sum())]
    return out


def sample_task(shared: tuple[str, diversity.DiversityConfig, dict[str, int], RowCopies | None], block: str) -> dict[str, list[np.ndarray]]:
    """The block's part of the seeded sample that fits the centroids: per sampled domain, the tokens of
    its training rows whose seeded rank falls below `fit_docs` / the domain's documents."""
    work, config, doc_counts, held_out = location(shared[0]), shared[1], shared[2], shared[3]
    table = read_work_table(_token_file(work, block)).select(["id", "domain", "tokens"])
    domains = table.column("domain").to_pylist()
    rank = diversity.seeded_rank(table.column("id").to_pylist(), config.seed)
    held = _held(held_out, block, table.num_rows)
    tokens = table.column("tokens")
    sample: dict[str, list[np.ndarray]] = {}
    for i, d in enumerate(domains):
        if d in config.domains and not held[i]:
            rate = config.fit_docs / max(doc_counts.get(d, 1), 1)
            if rate >= 1.0 or int(rank[i]) < int(rate * 2**64):
                sample.setdefault(d, []).append(tokens[i].values.to_numpy())
    return sample


def fit_centroids(run_tasks: Callable[..., list[Any]], work: Location, blocks: list[str], config: diversity.DiversityConfig,
                  doc_counts: dict[str, int], held_out: RowCopies | None = None) -> dict[str, np.ndarray]:
    """Per sampled domain: k-means centroids fit on at most `fit_docs` documents (seeded choice, taken
    by one task per block), never on `held_out` rows."""
    saved = work / "diversity" / "centroids.npz"
    if saved.exists():
        with np.load(io.BytesIO(saved.read_bytes())) as f:
            return {k: f[k] for k in f.files}
    sample: dict[str, list[np.ndarray]] = {d: [] for d in config.domains}
    for part in run_tasks(sample_task, (str(work), config, doc_counts, held_out), [(b,) for b in blocks], "diversity sample"):
        for d, toks in part.items():
            sample[d] += toks
    centroids = {}
    for d, toks in sample.items():
        if not toks:
            continue
        k = config.clusters or diversity.default_clusters(doc_counts.get(d, len(toks)))
        centroids[d] = diversity.kmeans(diversity.features(toks, config.dims), k, config.iterations, config.seed)
    buffer = io.BytesIO()  # the output folder may be a URL (datapipe.core.storage): written whole, atomically
    np.savez(buffer, **centroids)
    atomic_write_bytes(saved, buffer.getvalue())
    return centroids


def assign_task(shared: tuple[str, diversity.DiversityConfig, dict[str, np.ndarray]], block: str) -> dict[str, str]:
    """Cluster of every row of a sampled domain in one block -> work/diversity/<block>.arrow."""
    work, config, centroids = location(shared[0]), shared[1], shared[2]
    out = work / "diversity" / f"{block}.arrow"
    table = read_work_table(_token_file(work, block)).select(["id", "domain", "tokens", "num_tokens"])
    domains = np.array(table.column("domain").to_pylist(), dtype=object)
    parts = []
    for d, c in centroids.items():
        rows = np.flatnonzero(domains == d)
        if len(rows) == 0:
            continue
        sub = table.take(pa.array(rows))
        toks = [sub.column("tokens")[i].values.to_numpy() for i in range(len(rows))]
        clusters = diversity.assign_clusters(diversity.features(toks, config.dims), c)
        parts.append(pa.table({
            "row": rows.astype(np.int64), "domain": [d] * len(rows), "cluster": clusters.astype(np.int32),
            "rank": diversity.seeded_rank(sub.column("id").to_pylist(), config.seed),
            "num_tokens": sub.column("num_tokens"),
        }, schema=ASSIGN_SCHEMA))
    write_work_table(out, pa.concat_tables(parts) if parts else ASSIGN_SCHEMA.empty_table())
    return {"path": str(out)}


def _assigned(work: Location, block: str, held_out: RowCopies | None) -> pa.Table:
    """The block's cluster assignments, training rows only."""
    part = read_work_table(work / "diversity" / f"{block}.arrow")
    if held_out is not None and part.num_rows:  # held-out rows are never sampled
        part = part.filter(pa.array(~(held_out.of(block) > 0)[part.column("row").to_numpy()]))
    return part


def _bucket(rank: np.ndarray) -> np.ndarray:
    return (rank >> np.uint64(64 - BUCKET_BITS)).astype(np.int64)


def hist_task(shared: tuple[str, RowCopies | None], block: str) -> dict[str, str]:
    """Documents and tokens of the block's training rows per (domain, cluster, rank bucket) ->
    work/diversity/hist/<block>.arrow (`key` = cluster * BUCKETS + bucket)."""
    work, held_out = location(shared[0]), shared[1]
    out = work / "diversity" / "hist" / f"{block}.arrow"
    part = _assigned(work, block, held_out)
    key = part.column("cluster").to_numpy().astype(np.int64) * BUCKETS + _bucket(part.column("rank").to_numpy())
    table = pa.table({"domain": part.column("domain"), "key": key, "docs": np.ones(len(key), np.int64),
                      "tokens": part.column("num_tokens").to_numpy().astype(np.int64)})
    table = table.group_by(["domain", "key"], use_threads=False).aggregate([("docs", "sum"), ("tokens", "sum")])
    table = table.select(["domain", "key", "docs_sum", "tokens_sum"]).rename_columns(HIST_SCHEMA.names).cast(HIST_SCHEMA)
    write_work_table(out, table)
    return {"path": str(out)}


MERGE_GROUP = 256  # histogram files summed per task


def hist_merge_task(_: None, files: list[str]) -> pa.Table:
    """The sum of some blocks' histograms (`hist_task`'s files), per (domain, key): at most one row per
    rank bucket of each cluster, whatever the number of blocks."""
    table = pa.concat_tables([read_work_table(f) for f in files]) if files else HIST_SCHEMA.empty_table()
    table = table.group_by(["domain", "key"], use_threads=False).aggregate([("docs", "sum"), ("tokens", "sum")])
    return table.select(["domain", "key", "docs_sum", "tokens_sum"]).rename_columns(HIST_SCHEMA.names).cast(HIST_SCHEMA)


@dataclass
class _Cut:
    """Where one sampled domain's clusters stop: cluster c keeps its rows of rank buckets below
    `bucket[c]`, and of bucket `bucket[c]` those at or before (rank, block, row) `last[c]` (none when
    `has_last[c]` is false)."""

    bucket: np.ndarray
    last_rank: np.ndarray
    last_block: np.ndarray
    last_row: np.ndarray
    has_last: np.ndarray

    def keep(self, cluster: np.ndarray, rank: np.ndarray, block: int | np.ndarray, row: np.ndarray) -> np.ndarray:
        bucket, edge = _bucket(rank), self.bucket[cluster]
        lr, lb, lw = self.last_rank[cluster], self.last_block[cluster], self.last_row[cluster]
        at_or_before = (rank < lr) | ((rank == lr) & ((block < lb) | ((block == lb) & (row <= lw))))
        return (bucket < edge) | ((bucket == edge) & self.has_last[cluster] & at_or_before)


def boundary_task(shared: tuple[str, RowCopies | None, dict[str, np.ndarray]], block: str, index: int) -> dict[str, np.ndarray]:
    """Per sampled domain, the block's training rows that fall in their cluster's boundary bucket:
    columns cluster, rank, block (index), row, tokens."""
    work, held_out, edges = location(shared[0]), shared[1], shared[2]
    part = _assigned(work, block, held_out)
    domains = np.array(part.column("domain").to_pylist(), dtype=object)
    cluster, rank = part.column("cluster").to_numpy().astype(np.int64), part.column("rank").to_numpy()
    out = {}
    for d, edge in edges.items():
        mine = domains == d
        mine[mine] = _bucket(rank[mine]) == edge[cluster[mine]]
        rows = np.flatnonzero(mine)
        out[d] = np.stack([cluster[rows], rank[rows].view(np.int64), np.full(len(rows), index, np.int64),
                           part.column("row").to_numpy()[rows], part.column("num_tokens").to_numpy()[rows].astype(np.int64)], axis=1)
    return out


def _diversity_cuts(run_tasks: Callable[..., list[Any]], work: Location, names: list[str], div_config: diversity.DiversityConfig,
                    centroids: dict[str, np.ndarray], held_out: RowCopies | None) -> tuple[dict[str, _Cut], dict[str, Any], dict[str, int]]:
    """Each sampled domain's cut, its report entry, and the tokens its kept rows hold."""
    files = [r["path"] for r in run_tasks(hist_task, (str(work), held_out), [(b,) for b in names], "diversity histogram",
                                          record=record_in("diversity/hist", first_item_only=True))]
    # the blocks' histograms summed by tasks, a group of files each: the driver opens no file
    groups = [(files[i : i + MERGE_GROUP],) for i in range(0, len(files), MERGE_GROUP)]
    merged = run_tasks(hist_merge_task, None, groups, "diversity histogram merge")
    docs = {d: np.zeros(len(c) * BUCKETS, np.int64) for d, c in centroids.items()}
    tokens = {d: np.zeros(len(c) * BUCKETS, np.int64) for d, c in centroids.items()}
    for table in merged:  # one group's sums at a time
        for d in np.unique(np.array(table.column("domain").to_pylist(), dtype=object)) if table.num_rows else []:
            sub = table.filter(pc.equal(table.column("domain"), d))
            np.add.at(docs[d], sub.column("key").to_numpy(), sub.column("docs").to_numpy())
            np.add.at(tokens[d], sub.column("key").to_numpy(), sub.column("tokens").to_numpy())
    plans: dict[str, dict[str, Any]] = {}
    for d, budget in div_config.domains.items():
        if d not in docs or docs[d].sum() == 0:
            continue
        by_tokens = budget > 1
        per_doc = docs[d].reshape(-1, BUCKETS)
        k = int(np.flatnonzero(per_doc.sum(1))[-1]) + 1  # clusters up to the last one holding a document
        weight = (tokens[d] if by_tokens else docs[d]).reshape(-1, BUCKETS)[:k]
        n = int(per_doc.sum())
        sizes = weight.sum(1).astype(np.float64)
        quota = diversity.water_fill(sizes, budget if by_tokens else budget * n)
        limit = quota if by_tokens else np.round(quota)
        running = np.cumsum(weight, axis=1)
        over = running > limit[:, None] + 1e-9
        edge = np.where(over.any(1), over.argmax(1), BUCKETS)  # BUCKETS: the whole cluster is kept
        before = np.where(edge > 0, running[np.arange(k), np.maximum(edge - 1, 0)], 0)
        plans[d] = {"k": k, "n": n, "limit": limit, "edge": edge, "before": before}
    edges = {d: p["edge"] for d, p in plans.items()}
    found = run_tasks(boundary_task, (str(work), held_out, edges), [(b, i) for i, b in enumerate(names)], "diversity boundary") if edges else []
    cuts, report, kept_tokens = {}, {}, {}
    for d, p in plans.items():
        k, edge = p["k"], p["edge"]
        rows = np.concatenate([f[d] for f in found] + [np.empty((0, 5), np.int64)])
        cut = _Cut(edge, np.zeros(k, np.uint64), np.zeros(k, np.int64), np.zeros(k, np.int64), np.zeros(k, bool))
        per_doc, per_tok = docs[d].reshape(-1, BUCKETS)[:k], tokens[d].reshape(-1, BUCKETS)[:k]
        full = np.arange(BUCKETS)[None, :] < edge[:, None]
        kept_docs, kept_tok = int(per_doc[full].sum()), int(per_tok[full].sum())
        weights = rows[:, 4] if div_config.domains[d] > 1 else np.ones(len(rows), np.int64)  # tokens, or documents
        for c in np.unique(rows[:, 0]):
            mine = rows[rows[:, 0] == c]
            w = weights[rows[:, 0] == c]
            order = np.lexsort((mine[:, 3], mine[:, 2], mine[:, 1].view(np.uint64)))  # by rank, then block and row
            within = p["before"][c] + np.cumsum(w[order])
            chosen = order[within <= p["limit"][c] + 1e-9]  # a prefix: the running total only grows
            if len(chosen):
                last = mine[chosen[-1]]
                cut.last_rank[c], cut.last_block[c], cut.last_row[c], cut.has_last[c] = np.uint64(last[1].view(np.uint64)), last[2], last[3], True
                kept_docs += len(chosen)
                kept_tok += int(mine[chosen, 4].sum())
        cuts[d] = cut
        kept_tokens[d] = kept_tok
        report[d] = {"docs_in": p["n"], "docs_kept": kept_docs, "clusters": k}
    return cuts, report, kept_tokens


def select_task(shared: tuple[str, str, RowCopies | None, dict[str, _Cut], dict[str, dict[str, Any]] | None, int],
                block: str, index: int, input_index: int) -> dict[str, Any]:
    """One block's selection: diversity's cut, then the mixture's copies; writes the copies file and the
    dropped documents' records; returns the counters' changes, the tokens written per domain and the
    block's largest copy count."""
    work, out_dir, held_out, cuts, mix_plan, seed = location(shared[0]), location(shared[1]), *shared[2:]
    t = read_work_table(_token_file(work, block)).select(["id", "domain", "num_tokens"])
    copies = np.ones(t.num_rows, dtype=np.int64)
    copies[_held(held_out, block, t.num_rows)] = 0
    reasons: list[tuple[np.ndarray, str, str]] = []
    if cuts:
        part = _assigned(work, block, held_out)
        domains = np.array(part.column("domain").to_pylist(), dtype=object)
        for d, cut in cuts.items():
            mine = np.flatnonzero(domains == d)
            if len(mine) == 0:
                continue
            row = part.column("row").to_numpy()[mine]
            keep = cut.keep(part.column("cluster").to_numpy()[mine].astype(np.int64), part.column("rank").to_numpy()[mine], index, row)
            copies[row[~keep]] = 0
            reasons.append((row[~keep], "diversity", "diversity_sampling"))
    written: dict[str, int] = {}
    if mix_plan is not None:
        domains = np.array(t.column("domain").to_pylist(), dtype=object)
        ids = t.column("id").to_pylist()
        tokens = t.column("num_tokens").to_numpy()
        for d, p in mix_plan.items():
            rows = np.flatnonzero((domains == d) & (copies > 0))
            if len(rows) == 0:
                continue
            c = mixture.copies([ids[r] for r in rows], p["rate"], seed)
            copies[rows] = c
            reasons.append((rows[c == 0], "mixture", "mixture_downsampled"))
            written[d] = written.get(d, 0) + int((c * tokens[rows]).sum())
    # dropped documents: recorded like every stage's, and taken out of the kept counts
    counters = Counters()
    parts = []
    for rows, stage, reason in reasons:
        if len(rows) == 0:
            continue
        sub = t.take(pa.array(rows))
        n = len(rows)
        parts.append(pa.table({
            "id": sub.column("id"), "domain": sub.column("domain"), "order": pa.nulls(n, pa.int64()),
            "stage": pa.array([stage] * n, pa.string()), "reason": pa.array([reason] * n, pa.string()),
            "kept_id": pa.nulls(n, pa.string()), "text": pa.nulls(n, pa.large_string()),
        }, schema=DROPPED_SCHEMA))
        for d, k in zip(sub.column("domain").to_pylist(), sub.column("num_tokens").to_pylist()):
            counters.kept[(input_index, d)][0] -= 1
            counters.kept[(input_index, d)][1] -= k
        counters.count_dropped(input_index, parts[-1])
    if parts:
        atomic_write_table(out_dir / "dropped" / f"select-{block}.parquet", pa.concat_tables(parts), format="parquet")
    write_work_table(work / COPIES_DIR / f"{block}.arrow", pa.table({"copies": copies}))
    return {"counters": counters.to_json(), "written": written, "max_copies": int(copies.max()) if len(copies) else 0}


def select(
    run_tasks: Callable[..., list[Any]],
    work: Location,
    out_dir: Location,
    blocks: list[tuple[str, int]],
    div_config: diversity.DiversityConfig,
    mix_config: mixture.MixtureConfig,
    counters: Counters,
    held_out: RowCopies | None = None,
) -> tuple[RowCopies | None, dict[str, Any]]:
    """Copies per row of every block (None when no step is enabled and nothing is held out) and a
    report for the manifest and stats. `blocks` are (block name, input index) in order. Updates
    `counters` (dropped documents leave `kept`). `held_out` (per row, > 0) marks rows that are not
    training data (the eval split and its copies): they get 0 copies here, are neither sampled nor
    counted in the mixture, and are recorded by whoever held them out."""
    if not (div_config.enabled or mix_config.enabled or held_out):
        return None, {}
    names = [b for b, _ in blocks]
    totals: dict[str, list[int]] = {}  # domain -> training [documents, tokens], in order of first appearance
    for part in run_tasks(count_task, (str(work), held_out), [(b,) for b in names], "select count"):
        for d, (n, k) in part.items():
            entry = totals.setdefault(d, [0, 0])
            entry[0] += n
            entry[1] += k
    report: dict[str, Any] = {}
    cuts: dict[str, _Cut] = {}
    natural = {d: k for d, (_, k) in totals.items()}  # the mixture's tokens: after diversity sampling
    if div_config.enabled and div_config.domains:
        doc_counts = {d: n for d, (n, _) in totals.items() if n}
        centroids = fit_centroids(run_tasks, work, names, div_config, doc_counts, held_out)
        run_tasks(assign_task, (str(work), div_config, centroids), [(b,) for b in names], "diversity",
                  record=record_in("diversity", first_item_only=True))
        cuts, report["diversity"], kept_tokens = _diversity_cuts(run_tasks, work, names, div_config, centroids, held_out)
        natural.update(kept_tokens)
    mix_plan = mixture.plan(natural, mix_config) if mix_config.enabled else None
    items = [(b, i, input_index) for i, (b, input_index) in enumerate(blocks)]
    results = run_tasks(select_task, (str(work), str(out_dir), held_out, cuts, mix_plan, mix_config.seed), items, "select",
                        record=record_in(COPIES_DIR, first_item_only=True))
    written: dict[str, int] = {}
    for r in results:
        counters.merge(Counters.from_json(r["counters"]))
        for d, k in r["written"].items():
            written[d] = written.get(d, 0) + k
    if mix_plan is not None:
        report["mixture"] = {"method": mix_config.method, "domains": mixture.realised(mix_plan, written)}
    passes = max([r["max_copies"] for r in results] or [0])
    return RowCopies(str(work / COPIES_DIR), "copies", passes), report
