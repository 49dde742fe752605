"""Selection between tokenize and shards: diversity sampling, then mixture reweighting.

Both need each document's token count, so they run on the tokenized blocks: the result is, for
every block, how many times each row is written (0 = dropped, 2 = repeated once). The centroids
of diversity sampling are fit once per domain on a seeded sample (in the driver); assigning every
document to a cluster is one task per block; choosing the documents is per domain and needs only
(cluster, rank, tokens) per document, so memory stays small. Everything is seeded and ordered by
block, so the choice is the same on any number of workers. Rows held out of training (the eval split
of `eval_split.py` and the copies of its documents) get 0 copies, and neither step sees them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.curate.counters import Counters
from datapipe.core.schema import DROPPED_SCHEMA
from datapipe.core.shards import atomic_write_table, read_table
from stages import diversity, mixture

ASSIGN_SCHEMA = pa.schema([("row", pa.int64()), ("domain", pa.string()), ("cluster", pa.int32()),
                           ("rank", pa.uint64()), ("num_tokens", pa.int64())])


def _token_file(work: Path, block: str) -> Path:
    return work / "tokens" / f"{block}.arrow"


def fit_centroids(work: Path, blocks: list[str], config: diversity.DiversityConfig, doc_counts: dict[str, int],
                  held_out: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Per sampled domain: k-means centroids fit on at most `fit_docs` documents (seeded choice),
    never on `held_out` rows."""
    saved = work / "diversity" / "centroids.npz"
    if saved.exists():
        with np.load(saved) as f:
            return {k: f[k] for k in f.files}
    sample: dict[str, list[np.ndarray]] = {d: [] for d in config.domains}
    for block in blocks:
        table = read_table(_token_file(work, block)).select(["id", "domain", "tokens"])
        domains = table.column("domain").to_pylist()
        ids = table.column("id").to_pylist()
        rank = diversity.seeded_rank(ids, config.seed)
        tokens = table.column("tokens")
        for i, d in enumerate(domains):
            if d in sample and not (held_out and held_out[block][i]):
                rate = config.fit_docs / max(doc_counts.get(d, 1), 1)
                if rate >= 1.0 or int(rank[i]) < int(rate * 2**64):
                    sample[d].append(tokens[i].values.to_numpy())
    centroids = {}
    for d, toks in sample.items():
        if not toks:
            continue
        k = config.clusters or diversity.default_clusters(doc_counts.get(d, len(toks)))
        centroids[d] = diversity.kmeans(diversity.features(toks, config.dims), k, config.iterations, config.seed)
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_suffix(".tmp.npz")
    np.savez(tmp, **centroids)
    tmp.replace(saved)
    return centroids


def assign_task(shared: tuple[str, diversity.DiversityConfig, dict[str, np.ndarray]], block: str) -> str:
    """Cluster of every row of a sampled domain in one block -> work/diversity/<block>.arrow."""
    work, config, centroids = Path(shared[0]), shared[1], shared[2]
    out = work / "diversity" / f"{block}.arrow"
    if out.exists():
        return str(out)
    table = read_table(_token_file(work, block)).select(["id", "domain", "tokens", "num_tokens"])
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
    atomic_write_table(out, pa.concat_tables(parts) if parts else ASSIGN_SCHEMA.empty_table())
    return str(out)


def select(
    run_tasks: Callable[..., list[Any]],
    work: Path,
    out_dir: Path,
    blocks: list[tuple[str, int]],
    div_config: diversity.DiversityConfig,
    mix_config: mixture.MixtureConfig,
    counters: Counters,
    held_out: dict[str, np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray] | None, dict[str, Any]]:
    """Copies per row of every block (None when no step is enabled and nothing is held out) and a
    report for the manifest and stats. `blocks` are (block name, input index) in order. Updates
    `counters` (dropped documents leave `kept`). `held_out` (bool per row) marks rows that are not
    training data (the eval split and its copies): they get 0 copies here, are neither sampled nor
    counted in the mixture, and are recorded by whoever held them out."""
    if not (div_config.enabled or mix_config.enabled or held_out):
        return None, {}
    names = [b for b, _ in blocks]
    meta = {b: read_table(_token_file(work, b)).select(["id", "domain", "num_tokens"]) for b in names}
    copies = {b: np.ones(t.num_rows, dtype=np.int64) for b, t in meta.items()}
    if held_out:
        for b in names:
            copies[b][held_out[b]] = 0
    reasons: dict[str, list[tuple[np.ndarray, str, str]]] = {b: [] for b in names}
    report: dict[str, Any] = {}

    if div_config.enabled and div_config.domains:
        doc_counts: dict[str, int] = {}
        for b, t in meta.items():
            training = np.array(t.column("domain").to_pylist(), dtype=object)[copies[b] > 0]
            for d, n in zip(*np.unique(training, return_counts=True)):
                doc_counts[d] = doc_counts.get(d, 0) + int(n)
        centroids = fit_centroids(work, names, div_config, doc_counts, held_out)
        files = run_tasks(assign_task, (str(work), div_config, centroids), [(b,) for b in names], "diversity")
        assigned = []
        for i, f in enumerate(files):
            part = read_table(Path(f))
            if held_out:  # held-out rows are never sampled
                part = part.filter(pa.array(~held_out[names[i]][part.column("row").to_numpy()]))
            assigned.append(part.append_column("block", pa.array(np.full(part.num_rows, i, dtype=np.int32))))
        table = pa.concat_tables(assigned) if assigned else ASSIGN_SCHEMA.empty_table()
        report["diversity"] = {}
        for d, budget in div_config.domains.items():
            sub = table.filter(pc.equal(table.column("domain"), d))
            if sub.num_rows == 0:
                continue
            keep = diversity.select(sub.column("cluster").to_numpy(), sub.column("rank").to_numpy(),
                                    sub.column("num_tokens").to_numpy(), budget)
            blk, row = sub.column("block").to_numpy(), sub.column("row").to_numpy()
            for i in np.unique(blk):
                drop_rows = row[(blk == i) & ~keep]
                copies[names[i]][drop_rows] = 0
                reasons[names[i]].append((drop_rows, "diversity", "diversity_sampling"))
            report["diversity"][d] = {"docs_in": sub.num_rows, "docs_kept": int(keep.sum()),
                                      "clusters": int(sub.column("cluster").to_numpy().max()) + 1}

    if mix_config.enabled:
        natural: dict[str, int] = {}
        for b, t in meta.items():
            toks = t.column("num_tokens").to_numpy() * (copies[b] > 0)
            for d, n in zip(t.column("domain").to_pylist(), toks):
                natural[d] = natural.get(d, 0) + int(n)
        mix_plan = mixture.plan(natural, mix_config)
        written: dict[str, int] = {}
        for b, t in meta.items():
            domains = np.array(t.column("domain").to_pylist(), dtype=object)
            ids = t.column("id").to_pylist()
            tokens = t.column("num_tokens").to_numpy()
            for d, p in mix_plan.items():
                rows = np.flatnonzero((domains == d) & (copies[b] > 0))
                if len(rows) == 0:
                    continue
                c = mixture.copies([ids[r] for r in rows], p["rate"], mix_config.seed)
                copies[b][rows] = c
                reasons[b].append((rows[c == 0], "mixture", "mixture_downsampled"))
                written[d] = written.get(d, 0) + int((c * tokens[rows]).sum())
        report["mixture"] = {"method": mix_config.method, "domains": mixture.realised(mix_plan, written)}

    # dropped documents: recorded like every stage's, and taken out of the kept counts
    for (b, input_index) in blocks:
        t = meta[b]
        parts = []
        for rows, stage, reason in reasons[b]:
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
            atomic_write_table(out_dir / "dropped" / f"select-{b}.parquet", pa.concat_tables(parts), format="parquet")
    return copies, report
