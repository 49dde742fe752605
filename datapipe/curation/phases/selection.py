"""Selection between tokenize and shards: diversity sampling, then mixture reweighting.

Both need each document's token count, so they run on the tokenized blocks: the result is, for
every block, how many times each row is written (0 = dropped, 2 = repeated once), in a file per block
(`work/select/<block>.arrow`, read through `RowCopies`). Every per-document decision is made in tasks
over blocks; the driver holds per-domain (and per-cluster) totals only:

1. count     one task per block: training documents and tokens per domain;
2. centroids (diversity) a seeded sample of at most `fit_docs` documents per sampled domain, taken by
             one task per block and sent by domain, fits the k-means centroids in one task per domain
             (their records carry the centroids to the driver); one task per block assigns
             every document to its nearest centroid (`work/diversity/<block>.arrow`);
3. histogram (diversity) one task per block writes its documents' (cluster, rank bucket) counts and
             tokens; the driver adds them up one block at a time into each cluster's quota (spread
             evenly over the clusters, `stages.diversity.water_fill`) and the rank bucket where the
             quota runs out; the documents of that one bucket per cluster (1/4096 of them) come back
             to the driver, which finds the last one a cluster keeps. A cluster keeps its documents in
             seeded-rank order while its running total stays within the quota (a token quota filled: the
             document that crosses it kept too): the same rule as `stages.diversity.select` over the whole
             domain, decided exactly;
4. select    one task per block: diversity's choice, then the mixture's copies (`stages.mixture`:
             per-document from a per-domain rate planned on the tokens left after diversity), the
             dropped documents' records, the copies file, and the counters' changes.

Everything is seeded and ordered by block, so the choice is the same on any number of workers. Rows
held out of training (the eval split of `eval_split.py` and the copies of its documents) get 0
copies, and neither step sees them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from datapipe.curation.counters import Counters
from datapipe.core.shards import atomic_write_table
from datapipe.core.exchange import Received, Shuffle, routed, run_maps
from datapipe.core.workfiles import read_work_table, write_work_table
from datapipe.core.storage import Location, location
from datapipe.curation.phase import record_in
from datapipe.curation.plan import Plan, token_file
from datapipe.curation.config import SelectionConfig
from datapipe.curation.phases.model_selection import select_by_model
from datapipe.curation.cuts import ASSIGN_SCHEMA, Budget, Cut, RowCopies, assigned, cuts, held_rows
from datapipe.curation.blocks import block_file
from stages import diversity, mixture
from stages.sampling import in_sample, seeded_rank

COPIES_DIR = "select"  # work/select/<block>.arrow: column `copies`


@dataclass(frozen=True)
class CountTask:
    """What the count tasks share: the run's work folder and the rows that are not training data (held out: 0
    copies, never sampled nor counted)."""

    folder: str
    held_out: RowCopies | None


@dataclass(frozen=True)
class SampleTask:
    """What diversity's sample tasks share: the work folder, the rows held out, diversity's config and the training
    documents per domain (what sets each domain's sampling rate)."""

    folder: str
    held_out: RowCopies | None
    config: diversity.DiversityConfig
    doc_counts: dict[str, int]


@dataclass(frozen=True)
class FitTask:
    """What the fit tasks share: the work folder (their records), diversity's config, the training documents per
    domain (what sizes its clusters) and where the sample's files were routed."""

    folder: str
    config: diversity.DiversityConfig
    doc_counts: dict[str, int]
    sample: Received


@dataclass(frozen=True)
class AssignTask:
    """What the assign tasks share: the work folder, diversity's config and each sampled domain's centroids."""

    folder: str
    config: diversity.DiversityConfig
    centroids: dict[str, np.ndarray]


@dataclass(frozen=True)
class SelectTask:
    """What the select tasks share: the work folder, the rows held out, the output folder (the dropped documents'
    records), diversity's cut per domain and the mixture's rate per domain (None: no mixture) and seed."""

    folder: str
    held_out: RowCopies | None
    out_dir: str
    cuts: dict[str, Cut]
    mix_plan: dict[str, dict[str, Any]] | None
    seed: int


def count_task(task: CountTask, block: str) -> dict[str, list[int]]:
    """Per domain of the block's rows (in order of first appearance, held-out rows included): training
    [documents, tokens]."""
    work, held_out = location(task.folder), task.held_out
    table = read_work_table(token_file(work, block)).select(["domain", "num_tokens"])
    domains = np.array(table.column("domain").to_pylist(), dtype=object)
    tokens = table.column("num_tokens").to_numpy()
    training = ~held_rows(held_out, block, table.num_rows)
    out: dict[str, list[int]] = {}
    names, first = np.unique(domains, return_index=True) if len(domains) else ([], [])
    for d in [names[i] for i in np.argsort(first)]:
        rows = (domains == d) & training
        out[d] = [int(rows.sum()), int(tokens[rows].sum())]
    return out


SAMPLE_SCHEMA = pa.schema([("tokens", pa.large_list(pa.uint32()))])


def sample_exchange(work: Location, config: diversity.DiversityConfig) -> Shuffle:
    """Diversity's sample: every block's part (`work/diversity/sample/<block>.shuffle`), partitioned by domain (its
    index among the sampled domains), to one fit per domain."""
    return Shuffle("diversity sample", str(work / "diversity" / "sample"), len(config.domains),
                   records=str(work / "diversity" / "records"), sender_record="sample-", map_step="", schema=SAMPLE_SCHEMA)


def sample_rows(task: SampleTask, block: str) -> tuple[pa.Table, np.ndarray, dict[str, int]]:
    """The block's part of the seeded sample that fits the centroids: per sampled domain, the tokens of its training
    rows whose seeded rank falls below `fit_docs` / the domain's documents, by domain."""
    work, config, doc_counts, held_out = location(task.folder), task.config, task.doc_counts, task.held_out
    table = read_work_table(token_file(work, block)).select(["id", "domain", "tokens"])
    domains = table.column("domain").to_pylist()
    rank = seeded_rank(table.column("id").to_pylist(), config.seed)
    held = held_rows(held_out, block, table.num_rows)
    index = {d: i for i, d in enumerate(config.domains)}
    by_domain = np.array(domains, dtype=object)
    chosen = np.zeros(table.num_rows, dtype=bool)
    for d in index:  # each sampled domain at its own rate: fit_docs of its documents
        mine = np.flatnonzero(by_domain == d)
        chosen[mine] = in_sample(rank[mine], config.fit_docs / max(doc_counts.get(d, 1), 1))
    rows = np.flatnonzero(chosen & ~held).tolist()  # in row order
    parts = [index[domains[i]] for i in rows]
    tokens = table.column("tokens").combine_chunks().take(pa.array(rows, pa.int64())).cast(SAMPLE_SCHEMA.field("tokens").type)
    return pa.table({"tokens": tokens}), np.array(parts, np.int64), {"documents": len(rows)}


def fit_task(task: FitTask, index: int) -> dict[str, Any]:
    """One sampled domain's k-means centroids, fit on its sample (every block's, in block order), as lists (a
    record is JSON: float32 values come back exactly); none without a sample."""
    sample_files, config, doc_counts = task.sample, task.config, task.doc_counts
    d = list(config.domains)[index]
    sample = sample_files.read(index, SAMPLE_SCHEMA)
    column = sample.column("tokens").combine_chunks()
    values, offsets = column.values.to_numpy(), column.offsets.to_numpy()
    toks = [values[offsets[i]:offsets[i + 1]] for i in range(len(column))]
    if not toks:
        return {"domain": d, "centroids": None}
    k = config.clusters or diversity.default_clusters(doc_counts.get(d, len(toks)))
    return {"domain": d, "centroids": diversity.kmeans(diversity.features(toks, config.dims), k, config.iterations,
                                                       config.seed).tolist()}


def fit_centroids(run_tasks: Callable[..., list[Any]], work: Location, blocks: list[str], config: diversity.DiversityConfig,
                  doc_counts: dict[str, int], held_out: RowCopies | None = None) -> dict[str, np.ndarray]:
    """Per sampled domain: k-means centroids fit on at most `fit_docs` documents (seeded choice, taken by one task per
    block, `sample_rows`), never on `held_out` rows; the blocks' sample files routed (`sample_exchange`), one task per
    domain fits (`fit_task`)."""
    spec = sample_exchange(work, config)
    sent = run_maps(run_tasks, spec, sample_rows, SampleTask(str(work), held_out, config, doc_counts), [(b,) for b in blocks])
    fit = FitTask(str(work), config, doc_counts, routed(run_tasks, spec, blocks, sent))
    fits = run_tasks(fit_task, fit, [(i,) for i in range(len(config.domains))],
                     "diversity fit", record=record_in("diversity/records", "fit"))
    return {f["domain"]: np.asarray(f["centroids"], dtype=np.float32) for f in fits if f["centroids"] is not None}


def assign_task(task: AssignTask, block: str) -> dict[str, str]:
    """Cluster of every row of a sampled domain in one block -> work/diversity/<block>.arrow."""
    work, config, centroids = location(task.folder), task.config, task.centroids
    out = block_file(work, "diversity", block)
    table = read_work_table(token_file(work, block)).select(["id", "domain", "tokens", "num_tokens"])
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
            "rank": seeded_rank(sub.column("id").to_pylist(), config.seed),
            "num_tokens": sub.column("num_tokens"),
        }, schema=ASSIGN_SCHEMA))
    write_work_table(out, pa.concat_tables(parts) if parts else ASSIGN_SCHEMA.empty_table())
    return {"path": f"diversity/{block}.arrow"}  # in work/: a record names no absolute path


def _diversity_cuts(run_tasks: Callable[..., list[Any]], work: Location, names: list[str], div_config: diversity.DiversityConfig,
                    centroids: dict[str, np.ndarray], held_out: RowCopies | None) -> tuple[dict[str, Cut], dict[str, Any], dict[str, int]]:
    """Each sampled domain's cut, its report entry (a token budget's with the budget and the tokens kept), and the
    tokens its kept rows hold. A token budget is filled, as selection by a model fills its own: a cluster keeps the
    document that crosses its quota, so one long document does not end the domain's share early."""
    budgets = {d: Budget(b, by_tokens=b > 1, clusters=len(centroids[d]), fill=b > 1)
               for d, b in div_config.domains.items() if d in centroids}
    domain_cuts, report, kept_tokens = cuts(run_tasks, work, "diversity", names, budgets, held_out)
    for d, entry in report.items():
        if budgets[d].by_tokens:
            entry.update(budget_tokens=budgets[d].value, tokens_kept=kept_tokens[d])
    return domain_cuts, report, kept_tokens


def select_task(task: SelectTask, block: str, index: int, input_index: int) -> dict[str, Any]:
    """One block's selection: diversity's cut, then the mixture's copies; writes the copies file and the
    dropped documents' records; returns the counters' changes, the tokens written per domain and the
    block's largest copy count."""
    work, out_dir, held_out, cuts, mix_plan, seed = (location(task.folder), location(task.out_dir), task.held_out, task.cuts,
                                                     task.mix_plan, task.seed)
    t = read_work_table(token_file(work, block)).select(["id", "domain", "num_tokens"])
    copies = np.ones(t.num_rows, dtype=np.int64)
    copies[held_rows(held_out, block, t.num_rows)] = 0
    reasons: list[tuple[np.ndarray, str, str]] = []
    if cuts:
        part = assigned(work, "diversity", block, held_out)
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
        if len(rows):
            parts.append(counters.selection_drops(input_index, t.take(pa.array(rows)), stage, reason))
    if parts:
        atomic_write_table(out_dir / "dropped" / f"select-{block}.parquet", pa.concat_tables(parts), format="parquet",
                           published=True)
    write_work_table(block_file(work, COPIES_DIR, block), pa.table({"copies": copies}))
    return {"counters": counters.to_json(), "written": written, "max_copies": int(copies.max()) if len(copies) else 0}


def _totals(run_tasks: Callable[..., list[Any]], work: Location, names: list[str], held_out: RowCopies | None) -> dict[str, list[int]]:
    """Domain -> training [documents, tokens], in order of first appearance."""
    totals: dict[str, list[int]] = {}
    for part in run_tasks(count_task, CountTask(str(work), held_out), [(b,) for b in names], "select count"):
        for d, (n, k) in part.items():
            entry = totals.setdefault(d, [0, 0])
            entry[0] += n
            entry[1] += k
    return totals


def select(run_tasks: Callable[..., list[Any]], plan: Plan, blocks: list[tuple[str, int]], counters: Counters,
           held_out: RowCopies | None = None) -> tuple[RowCopies | None, dict[str, Any]]:
    """Copies per row of every block (None when no step is enabled and nothing is held out) and a report for the
    manifest and stats, by the plan's `selection`, `diversity` and `mixture`. `blocks` are (block name, input
    index) in order. Updates `counters` (dropped documents leave `kept`). `held_out` (per row, > 0) marks rows that
    are not training data (the eval split and its copies): they get 0 copies here, are neither sampled nor counted
    in the mixture, and are recorded by whoever held them out."""
    work, out_dir, div_config, mix_config = plan.work, plan.out, plan.cfg.diversity, plan.cfg.mixture
    by_model = plan.cfg.selection if plan.cfg.selection.enabled else None
    if not (div_config.enabled or mix_config.enabled or held_out or by_model):
        return None, {}
    names = [b for b, _ in blocks]
    totals = _totals(run_tasks, work, names, held_out)
    report: dict[str, Any] = {}
    if by_model is not None:  # first: diversity and the mixture see only what the model keeps
        held_out, report["model_selection"] = select_by_model(run_tasks, plan, blocks, totals, counters, held_out)
        totals = _totals(run_tasks, work, names, held_out)
    cuts: dict[str, Cut] = {}
    natural = {d: k for d, (_, k) in totals.items()}  # the mixture's tokens: after diversity sampling
    if div_config.enabled and div_config.domains:
        doc_counts = {d: n for d, (n, _) in totals.items() if n}
        centroids = fit_centroids(run_tasks, work, names, div_config, doc_counts, held_out)
        run_tasks(assign_task, AssignTask(str(work), div_config, centroids), [(b,) for b in names], "diversity",
                  record=record_in("diversity", first_item_only=True))
        cuts, report["diversity"], kept_tokens = _diversity_cuts(run_tasks, work, names, div_config, centroids, held_out)
        natural.update(kept_tokens)
    mix_plan = mixture.plan(natural, mix_config) if mix_config.enabled else None
    items = [(b, i, input_index) for i, (b, input_index) in enumerate(blocks)]
    results = run_tasks(select_task, SelectTask(str(work), held_out, str(out_dir), cuts, mix_plan, mix_config.seed), items, "select",
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
