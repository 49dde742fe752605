"""The held-out eval split: documents set aside before selection and the mixture, with every copy of them removed from training.

With `eval.enabled: true`, `datapipe curate` writes `OUT/eval/`, a curated folder of its own (`shards/` and
`manifest.json` in the usual format, so the loader, the trainer and `datapipe stats` read it like any curated
folder), and names it in the main manifest under `splits.eval`. The trainer evaluates on it by default.

1. choose  per domain, the documents whose seeded hash of their id falls below `eval.fraction`,
           taken lowest hash first into `eval.max_tokens_per_domain` tokens (one that would overflow it is
           skipped, so a single huge document cannot leave the domain's split nearly empty). One task
           per block sends its candidates (hash below the fraction) by domain (`candidate_rows`); one
           task per domain partition applies the token budget (`choose`), so the candidates stay in
           tasks and the driver reads the chosen documents only. One task per block then marks its eval
           rows and drops its training copies (steps 2-3), into work/eval/rows/<block>.arrow.
           It runs on the tokenized blocks (a token budget needs the token counts): after dedup and the
           filters, before diversity sampling and the mixture. So eval documents are never sampled away
           and never repeated, and with dedup on they are the winners of their duplicate clusters.
2. exact   one task per block hashes every document's tokens (xxh3-128). A training document whose
           tokens equal an eval document's is dropped (stage `eval_split`, reason `eval_duplicate`,
           `kept_id` the eval document). With exact dedup on there are none; the check makes sure of
           it, and it is what protects a raw arm of an ablation (dedup off).
3. near    (`eval.decontaminate: near`) a training document that shares an LSH bucket with an eval
           document and is its near-duplicate by near dedup's own rule (`dedup.minhash`: the signature
           estimate, or the exact Jaccard near the threshold) is dropped (`eval_near_duplicate`). Every
           member of a bucket meets the first `bucket_window` eval documents in it, so a pair near dedup
           left apart in a crowded bucket is still caught and the work is bounded by members x window. The
           keys are near dedup's own (`work/minhash/`) when it ran, else computed here (one task per block)
           with the `dedup.minhash` settings; one match task per bucket partition, then near dedup's own
           verification (`near_dedup.verify_pairs`).

With `eval.source` (another run's eval split, e.g. the raw arm's of an ablation), step 1 chooses nothing: that
folder's documents are the split (copied to OUT/eval/), and steps 2-3 compare this run's training documents with
them (their MinHash keys from their decoded tokens; a training document with the same id is dropped too). So every
arm of an ablation, whatever its filters and dedup, evaluates on the same documents and trains on none of them.

The choice depends only on ids, token counts and input order, and every task writes its output atomically and
then its record, so the split is the same on any number of workers and blocks, and after a resume.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.core.schema import DOC_SCHEMA, DROPPED_SCHEMA, order_key
from datapipe.core.shards import atomic_write_table
from datapipe.core.workfiles import read_work_table, write_work_table
from datapipe.curation.config import EvalSplitConfig
from datapipe.curation.counters import Counters
from datapipe.core.exchange import Shuffle, run_maps, run_reduces
from datapipe.curation.map_stages import by_kind, send_kinds
from datapipe.curation.phases import near_dedup
from datapipe.curation.blocks import block_documents, block_file
from datapipe.curation.phase import record_in
from datapipe.curation.plan import EVAL_DIR, Plan, token_file
from datapipe.curation.phases.near_dedup import KeySource
from datapipe.curation.cuts import RowCopies
from datapipe.core.storage import Location, location
from stages.minhash import MinHashConfig, MinHashStage, partition_of, unique_pairs

STAGE = "eval_split"  # the stage name of the training documents dropped as copies of eval documents
PAIR_SCHEMA = pa.schema([("order", pa.int64()), ("eval_order", pa.int64())])
SOURCE_UNIT = (1 << 23) - 1  # the input unit of `eval.source` documents in the order key: after every real input


RECORDS = f"{EVAL_DIR}/records"  # work/eval/records/<step>-<item>.json: the split's task records
ROWS_DIR = "rows"  # work/eval/rows/<block>.arrow: per row `eval` (held out for eval) and `held_out` (not for training)
HELD = f"{EVAL_DIR}/held.arrow"  # work/eval/held.arrow: the eval documents' order, id and token hash, in input order
NEAR = f"{EVAL_DIR}/near.arrow"  # work/eval/near.arrow: each near copy's order and the eval document it copies


@dataclass(frozen=True)
class BucketTask:
    """Near dedup's map half on the last segment's blocks (`segment`), where near dedup did not run."""

    folder: str  # the run's work folder (the tasks' records go below it, as every task's here)
    minhash: MinHashConfig
    segment: str


@dataclass(frozen=True)
class SourceBucketTask:
    """The map half on `eval.source`'s documents, tokenized back to text with the run's `tokenizer`."""

    folder: str
    config: EvalSplitConfig
    minhash: MinHashConfig
    tokenizer: str


@dataclass(frozen=True)
class MatchTask:
    """One match task per near-dedup group: the keys the eval documents are matched against."""

    folder: str
    minhash: MinHashConfig
    source: KeySource


@dataclass(frozen=True)
class NearTask:
    """The one task naming the near copies: where it reads the edges."""

    folder: str
    minhash: MinHashConfig
    edges: Received


@dataclass(frozen=True)
class CandidateTask:
    """The candidates' map: the last segment's folder (the documents' order, row for row with the tokens) and the
    domain partitions they are sent by."""

    folder: str
    config: EvalSplitConfig
    segment: str
    partitions: int


@dataclass(frozen=True)
class ChooseTask:
    """The choose tasks, one per domain partition (`partitions` of them)."""

    folder: str
    config: EvalSplitConfig
    partitions: int


@dataclass(frozen=True)
class SourceTask:
    """`eval.source`'s documents held out as they are."""

    folder: str
    config: EvalSplitConfig


@dataclass(frozen=True)
class HeldTask:
    """The one task gathering every choose task's documents."""

    folder: str
    partitions: int


@dataclass(frozen=True)
class FinishTask:
    """One block's copies of the eval documents taken out of training: the last segment's folder, the output folder
    (their drop records, with their text when `keep_text`), and whether the near copies were looked for."""

    folder: str
    config: EvalSplitConfig
    segment: str
    out_dir: str
    near_checked: bool
    keep_text: bool


@dataclass
class Split:
    """The outcome: per block, in files under `folder` (`work/eval/rows/`), the rows held out for eval
    and the rows not for training (those and the training rows dropped as their copies); a report."""

    folder: str
    eval_docs: int
    report: dict[str, Any]

    def not_for_training(self) -> RowCopies:
        return RowCopies(self.folder, "held_out")

    def eval_rows(self) -> RowCopies:
        """The eval split's rows, written once each (no pass when the split is empty)."""
        return RowCopies(self.folder, "eval", 1 if self.eval_docs else 0)


def eval_rank(ids: list[str], seed: int) -> np.ndarray:
    """The seeded hash (uint64) that chooses eval documents. Salted, so that it is independent of the
    mixture's and diversity sampling's hashes of the same ids under the same seed (otherwise the eval
    split would take exactly the documents a down-sampling mixture keeps first)."""
    return np.fromiter((xxhash.xxh64_intdigest(b"eval-split\0" + i.encode(), seed=seed) for i in ids),
                       dtype=np.uint64, count=len(ids))


def _rank_below(config: EvalSplitConfig) -> np.uint64:
    """A document is a candidate when its seeded hash falls below this: `fraction` of the hash space."""
    return np.uint64(min(int(config.fraction * 2**64), 2**64 - 1))


def chosen_mask(rank: np.ndarray, domain: np.ndarray, tokens: np.ndarray, position: np.ndarray,
                config: EvalSplitConfig) -> np.ndarray:
    """Of some candidates (every candidate of each domain present): the mask of those chosen, per domain lowest
    hash first (ties by `position`, input order) into `max_tokens_per_domain` tokens."""
    chosen = np.zeros(len(rank), dtype=bool)
    for d in np.unique(domain):
        rows = np.flatnonzero(domain == d)
        rows = rows[np.lexsort((position[rows], rank[rows]))]  # lowest hash first
        if config.max_tokens_per_domain is not None:
            # a document that would overflow the budget is skipped, not an end: one huge document early
            # in hash order must not leave the domain's split nearly empty
            left, fits = config.max_tokens_per_domain, np.zeros(len(rows), dtype=bool)
            for i, n in enumerate(tokens[rows].tolist()):
                if n <= left:
                    fits[i], left = True, left - n
            rows = rows[fits]
        chosen[rows] = True
    return chosen


# ---------------------------------------------------------------- tasks


def _hashes_file(work: str | Location, block: str) -> Location:
    """A block's token hashes (`hash_task`), read by its candidates and its finish tasks."""
    return block_file(work, f"{EVAL_DIR}/hashes", block)


def hash_task(work: str, block: str) -> dict[str, str]:
    """xxh3-128 of each row's token bytes -> work/eval/hashes/<block>.arrow (one column `hash`)."""
    out = _hashes_file(work, block)
    tokens = read_work_table(token_file(work, block)).column("tokens").combine_chunks()
    values, offsets = tokens.values.to_numpy(), tokens.offsets.to_numpy()
    digests = [xxhash.xxh3_128_digest(values[offsets[i] : offsets[i + 1]].tobytes()) for i in range(len(tokens))]
    write_work_table(out, pa.table({"hash": pa.array(digests, pa.binary(16))}))
    return {"path": f"{EVAL_DIR}/hashes/{block}.arrow"}  # in work/: a record names no absolute path


def bucket_task(task: BucketTask, block: str) -> dict[str, int]:
    """Near dedup's map half on a block of the last segment (used when near dedup did not run): its
    keys, laid out as the runner lays out a global stage's, under work/eval/<kind>/<block>.shuffle."""
    work, segment, config = location(task.folder), task.segment, task.minhash
    table = block_documents(work, segment, block, locate=True)  # the exact check reads a few texts by range
    stage = MinHashStage(config)
    send_kinds(stage.keys, by_kind(stage, work / EVAL_DIR), table, block)
    return {"rows": table.num_rows}


def match_task(task: MatchTask, g: int) -> dict[str, int]:
    """The candidate pairs (training document, eval document) of the bucket partitions of group g
    (`source.groups`): every member of a bucket with each of the first `bucket_window` eval documents in
    it (input order), so the work is bounded by members x window however crowded a bucket is. Written (as
    u, v) to work/eval/pairs-u/gNNN.shuffle, partitioned by the training document, for
    `near_dedup.verify_pairs`; without `verify` every candidate is a match, written to work/eval/edges/ directly."""
    work, config, source = location(task.folder), task.minhash, task.source
    eval_orders = read_work_table(work / HELD).column("order").to_numpy()
    lo, hi = source.groups.range(g)
    rows = source.read("buckets", lo, config.partitions, through=hi)
    u = v = np.empty(0, np.int64)
    if rows is not None and rows.num_rows and len(eval_orders):
        is_eval = pc.is_in(rows.column("order"), value_set=pa.array(eval_orders, pa.int64()))
        ev = rows.filter(is_eval).sort_by([("bucket", "ascending"), ("order", "ascending")])
        bucket = ev.column("bucket").to_numpy()
        starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]]) if len(bucket) else np.empty(0, np.int64)
        rank = np.arange(len(bucket)) - np.repeat(starts, np.diff(np.r_[starts, len(bucket)]))
        ev = ev.filter(pa.array(rank < config.bucket_window)).rename_columns(["bucket", "eval_order"])
        joined = rows.filter(pc.invert(is_eval)).join(ev, "bucket", join_type="inner")
        if joined.num_rows:
            # a pair sharing several buckets, once
            u, v = unique_pairs(joined.column("order").to_numpy(), joined.column("eval_order").to_numpy())
    table = pa.table({"u": u, "v": v}, schema=near_dedup.PAIR_SCHEMA)
    if config.verify:
        size = near_dedup.step_files(work / EVAL_DIR / "pairs-u", config.partitions).send(f"g{g:03d}", table,
                                                                                         partition_of(u, config.partitions))
    else:
        size = near_dedup.send_edges(work / EVAL_DIR / "edges", u, v, config.partitions, f"g{g:03d}")
    return {"candidates": int(len(u)), "bytes": size}


def near_copies(run_tasks: Callable[..., list[Any]], work: Location, config: MinHashConfig, source: KeySource) -> int:
    """The training documents that are near-duplicates of an eval document (work/eval/held.arrow) by near dedup's
    own rule (the signature estimate, then the exact Jaccard near the threshold): `match_task`'s candidates, decided
    by `near_dedup.verify_pairs`, named by `near_task` in work/eval/near.arrow; how many."""
    found = run_tasks(match_task, MatchTask(str(work), config, source), source.groups.items(), "eval_split near",
                      record=record_in(RECORDS, "match"))
    sizes = found
    if config.verify:  # the candidates exchanged as near dedup's are (combined past a few groups)
        pairs = near_dedup.PairsStep(str(work / EVAL_DIR), config, source, str(work / EVAL_DIR))
        sizes = [{"bytes": near_dedup.verify_pairs(run_tasks, pairs, work / EVAL_DIR / "edges", "eval_split near",
                                                   found)["largest_bytes"]}]
    # one task reads every group's edges: combined first, so that it reads a few files, not one per group
    spec = near_dedup.group_files(source.groups, work / EVAL_DIR / "edges", "eval_split near edges", records=work / RECORDS)
    edges = near_dedup.exchange_groups(run_tasks, spec, source.groups, sizes)
    return run_tasks(near_task, NearTask(str(work), config, edges.files(work / EVAL_DIR / "edges")), [()],
                     "eval_split near copies", record=record_in(RECORDS, "near"))[0]["copies"]


def near_task(task: NearTask) -> dict[str, int]:
    """work/eval/near.arrow: (order, eval_order, eval_id) of each training document near an eval document, from
    the edges, with the first eval document in input order named."""
    work, partitions, files = location(task.folder), task.minhash.partitions, task.edges
    edges = files.read(0, near_dedup.EDGE_SCHEMA, through=partitions)
    held = read_work_table(work / HELD)
    eval_orders = held.column("order").to_numpy()
    is_eval = np.isin(edges.column("dst").to_numpy(), eval_orders) & ~np.isin(edges.column("src").to_numpy(), eval_orders)
    edges = edges.filter(pa.array(is_eval))
    pairs = pa.table({"order": edges.column("src"), "eval_order": edges.column("dst")}, schema=PAIR_SCHEMA)
    pairs = pairs.sort_by([("order", "ascending"), ("eval_order", "ascending")]).combine_chunks()
    order_col = pairs.column("order").to_numpy()
    pairs = pairs.filter(pa.array(np.r_[True, order_col[1:] != order_col[:-1]] if len(order_col) else np.zeros(0, bool)))
    eval_id = held.column("id").take(pc.index_in(pairs.column("eval_order"), value_set=held.column("order")))
    write_work_table(work / NEAR, pairs.append_column("eval_id", eval_id))
    return {"copies": pairs.num_rows}


# ---------------------------------------------------------------- another run's split (eval.source)


def read_source(source: str) -> tuple[dict[str, Any], pa.Table]:
    """The manifest and the documents (id, domain, tokens, num_tokens; shard order) of `eval.source`."""
    try:
        manifest = shards.read_manifest(source)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"eval.source: {source!r} is not a curated folder ({exc}); give another run's eval split, "
                          "e.g. RUN/eval of a run curated with eval.enabled: true") from None
    tables = [shards.open_shard(source, s["path"]).select(["id", "domain", "tokens", "num_tokens"]) for s in manifest["shards"]]
    if not tables or sum(t.num_rows for t in tables) == 0:
        raise ConfigError(f"eval.source: {source!r} holds no document; give a non-empty eval split")
    return manifest, pa.concat_tables(tables).combine_chunks()


def copy_source(source: str, out_dir: Location) -> list[shards.ShardInfo]:
    """OUT/eval/shards/: `eval.source`'s shards, rewritten (checksums recomputed) so the run's folder stands alone."""
    manifest = shards.read_manifest(source)
    return [shards.write_shard(out_dir, i, shards.open_shard(source, s["path"])) for i, s in enumerate(manifest["shards"])]


def check_source_tokenizer(source: str, manifest: dict[str, Any], sha256: str) -> None:
    theirs = manifest.get("tokenizer", {}).get("sha256")
    if theirs != sha256:
        raise ConfigError(f"eval.source: {source!r} was tokenized with another tokenizer (sha256 {str(theirs)[:12]}…, "
                          f"this run's is {sha256[:12]}…); its documents cannot be compared with this run's. Use the "
                          "tokenizer of that run (tokenizer.path), or curate the eval split again with this one")


SOURCE_BLOCK = "source"  # eval.source's documents: work/eval/source.arrow, their keys work/eval/<kind>/source.shuffle


def source_bucket_task(task: SourceBucketTask, part: int) -> dict[str, int]:
    """The MinHash keys of `eval.source`'s documents (their text decoded from the tokens), laid out like
    bucket_task's, as block `source` of work/eval/, its documents in work/eval/source.arrow."""
    from tokenizers import Tokenizer  # only this task decodes

    work, source, tokenizer_path, config = location(task.folder), task.config.source, task.tokenizer, task.minhash
    _, docs = read_source(source)
    tokenizer = Tokenizer.from_str(location(tokenizer_path).read_text())  # the output folder may be a URL
    tokens = docs.column("tokens").chunk(0)
    values, offsets = tokens.values.to_numpy().tolist(), tokens.offsets.to_numpy()
    texts = tokenizer.decode_batch([values[offsets[i]:offsets[i + 1]] for i in range(len(tokens))], skip_special_tokens=True)
    table = pa.table({
        "id": docs.column("id").chunk(0), "domain": docs.column("domain").chunk(0), "text": pa.array(texts, pa.large_string()),
        "order": pa.array([order_key(SOURCE_UNIT, i) for i in range(docs.num_rows)], pa.int64()),
        "lang": pa.nulls(docs.num_rows, pa.string()), "lang_score": pa.nulls(docs.num_rows, pa.float32()),
    }, schema=DOC_SCHEMA)
    write_work_table(block_file(work, EVAL_DIR, SOURCE_BLOCK), table)  # the text the exact check reads
    stage = MinHashStage(config)
    send_kinds(stage.keys, by_kind(stage, work / EVAL_DIR), table, SOURCE_BLOCK)
    return {"rows": docs.num_rows}


# ---------------------------------------------------------------- the whole split


CANDIDATE_SCHEMA = pa.schema([("order", pa.int64()), ("rank", pa.uint64()), ("id", pa.string()),
                              ("domain", pa.string()), ("num_tokens", pa.int64()), ("hash", pa.binary(16))])
CANDIDATE_BYTES = 96  # a candidate's row, about: what sizes a choose task's memory
CHOOSE_TASKS = 64  # domain partitions, at most: every candidate of a domain meets in one choose task


CHOOSE_BASE_BYTES = 256 << 20  # a choose task's memory besides its candidates (4 x their rows' bytes)


def _domain_partition(domains: pa.Array, partitions: int) -> np.ndarray:
    return np.fromiter((xxhash.xxh64_intdigest((d or "").encode()) % partitions for d in domains.to_pylist()),
                       dtype=np.int64, count=len(domains))


def candidates_exchange(work: Location, partitions: int) -> Shuffle:
    """Every block's candidates (`work/eval/candidates/<block>.shuffle`), by domain partition, to one choose task per
    partition (so every candidate of a domain meets in one), which writes `work/eval/chosen/pNNN.arrow`."""
    return Shuffle("eval_split", str(work / EVAL_DIR / "candidates"), partitions, records=str(work / RECORDS),
                   sender_record="candidates-", receiver_name="choose-{}", map_step="candidates", reduce_step="choose",
                   schema=CANDIDATE_SCHEMA)


def candidate_rows(task: CandidateTask, block: str) -> tuple[pa.Table, np.ndarray, dict[str, Any]]:
    """The block's candidates for the split (rows whose seeded hash of the id falls below `fraction`), with their
    order, hash rank, id, domain, token count and token hash (`hash_task`), by domain partition."""
    work, segment, config, partitions = location(task.folder), task.segment, task.config, task.partitions
    meta = read_work_table(token_file(work, block)).select(["id", "domain", "num_tokens"])
    rank = eval_rank(meta.column("id").to_pylist(), config.seed)
    rows = pa.array(np.flatnonzero(rank < _rank_below(config)))
    orders = block_documents(work, segment, block, ["order"]).column("order").take(rows)
    hashes = read_work_table(_hashes_file(work, block)).column("hash").take(rows)
    table = pa.table([orders, pa.array(rank).take(rows), *meta.take(rows).columns, hashes], schema=CANDIDATE_SCHEMA)
    partition = _domain_partition(table.column("domain").combine_chunks(), partitions)
    return table, partition, {"candidates": table.num_rows,
                              "by_partition": np.bincount(partition, minlength=partitions).tolist()}


def choose(task: ChooseTask, p: int, table: pa.Table) -> dict[str, int]:
    """The eval documents of the domains of partition p, from their candidates: chosen by `chosen_mask`, written to
    work/eval/chosen/pNNN.arrow (order, id, domain, num_tokens, hash)."""
    work, config = location(task.folder), task.config
    table = table.sort_by([("order", "ascending")])
    mask = chosen_mask(table.column("rank").to_numpy(), np.array(table.column("domain").to_pylist(), dtype=object),
                       table.column("num_tokens").to_numpy(), table.column("order").to_numpy(), config)
    chosen = table.filter(pa.array(mask)).drop(["rank"])
    write_work_table(work / EVAL_DIR / "chosen" / f"p{p:03d}.arrow", chosen)
    return {"chosen": chosen.num_rows, "domains": _domains(chosen)}


def finish_task(task: FinishTask, block: str, input_index: int) -> dict[str, Any]:
    """One block's training copies of eval documents: exact (identical tokens; with another run's split,
    also the same id) and near (`near`: order and eval id of every near copy). Writes the dropped
    documents' records (with their text when `keep_text`: output.keep_dropped_text) and
    work/eval/rows/<block>.arrow; returns the counters' changes and the counts."""
    work, out_dir, segment = location(task.folder), location(task.out_dir), task.segment
    by_id, near_checked, keep_text = bool(task.config.source), task.near_checked, task.keep_text
    held = read_work_table(work / HELD)  # the eval documents (one read a block: a small file)
    eval_hashes, eval_ids = held.column("hash").combine_chunks(), held.column("id").combine_chunks()
    near = read_work_table(work / NEAR) if near_checked else pa.table({"order": pa.array([], pa.int64()),
                                                                         "eval_id": pa.array([], pa.string())})
    meta = read_work_table(token_file(work, block)).select(["id", "domain", "num_tokens"])
    # the text only when it is kept with the dropped records (a view's rows are joined to the read block's text)
    documents = block_documents(work, segment, block, None if keep_text else ["order"])
    orders = documents.column("order").to_numpy()
    if len(orders) != meta.num_rows:  # a bug, never bad input
        raise RuntimeError(f"eval split: the token blocks and the {segment} blocks differ in rows")
    is_eval = np.isin(orders, held.column("order").to_numpy())  # (none for `eval.source`: its orders follow every input's)
    hashes = read_work_table(_hashes_file(work, block)).column("hash").combine_chunks()
    where = pc.index_in(hashes, value_set=eval_hashes)
    if by_id:
        where = pc.coalesce(pc.index_in(meta.column("id").combine_chunks(), value_set=eval_ids), where)
    is_exact = where.is_valid().to_numpy(zero_copy_only=False) & ~is_eval
    exact_of = eval_ids.take(where)
    near_where = pc.index_in(pa.array(orders), value_set=near.column("order").combine_chunks())
    is_near = near_where.is_valid().to_numpy(zero_copy_only=False) & ~is_eval & ~is_exact
    near_of = near.column("eval_id").combine_chunks().take(near_where)
    counters = Counters()
    removed_counts = {"eval_duplicate": 0, "eval_near_duplicate": 0}
    parts = []
    for mask, reason, kept_id in ((is_exact, "eval_duplicate", exact_of), (is_near, "eval_near_duplicate", near_of)):
        rows = np.flatnonzero(mask)
        if len(rows) == 0:
            continue
        sub = meta.take(pa.array(rows))
        n = len(rows)
        parts.append(pa.table({
            "id": sub.column("id"), "domain": sub.column("domain"), "order": pa.array(orders[rows], pa.int64()),
            "stage": pa.array([STAGE] * n, pa.string()), "reason": pa.array([reason] * n, pa.string()),
            "kept_id": kept_id.take(pa.array(rows)),
            "text": documents.column("text").take(pa.array(rows)) if keep_text else pa.nulls(n, pa.large_string()),
        }, schema=DROPPED_SCHEMA))
        for d, k in zip(sub.column("domain").to_pylist(), sub.column("num_tokens").to_pylist()):
            counters.kept[(input_index, d)][0] -= 1
            counters.kept[(input_index, d)][1] -= k
        counters.count_dropped(input_index, parts[-1])
        removed_counts[reason] += n
    if parts:
        atomic_write_table(out_dir / "dropped" / f"{STAGE}-{block}.parquet", pa.concat_tables(parts), format="parquet",
                           published=True)
    write_work_table(block_file(work, f"{EVAL_DIR}/{ROWS_DIR}", block),
                       pa.table({"eval": is_eval, "held_out": is_eval | is_exact | is_near}))
    return {"counters": counters.to_json(), "removed": removed_counts}


def split(run_tasks: Callable[..., list[Any]], plan: Plan, blocks: list[tuple[str, int]], counters: Counters,
          tokenizer: tuple[str, str] = ("", ""), near_dedup_groups: dict[str, int] | None = None) -> Split:
    """Choose the eval split (the plan's `eval`) and find the training documents that copy it (see the module
    docstring). `blocks` are (block name, input index) in input order, row for row with the last segment's folder
    (the documents' text and `order`) and the token blocks. Writes the dropped copies to out/dropped/ (with their
    text when `output.keep_dropped_text`) and takes them out of `counters.kept` (eval documents stay kept: they are
    written). `near_dedup_groups`: near dedup's grouping (its summary's), whose keys the near check reads. Every
    per-document step runs in tasks, through files in work/eval/ (the eval documents in `held.arrow`, their near
    copies in `near.arrow`); the driver adds up counts."""
    work, out_dir, segment, config = plan.work, plan.out, plan.segments[-1].name, plan.cfg.eval
    minhash, keep_text = plan.cfg.dedup.minhash, plan.cfg.output.keep_dropped_text
    names = [b for b, _ in blocks]
    run_tasks(hash_task, str(work), [(b,) for b in names], "eval_split exact", record=record_in(RECORDS, "hashes"))
    domains = _from_source(run_tasks, work, config, tokenizer) if config.source else _chosen(run_tasks, work, names, segment, config)
    near_checked = config.decontaminate == "near" and bool(names)
    if near_checked:
        source = _near_source(run_tasks, plan, names, near_dedup_groups, tokenizer)
        near_copies(run_tasks, work, minhash, source)
    finish = FinishTask(str(work), config, segment, str(out_dir), near_checked, keep_text)
    removed_counts: dict[str, int] = {"eval_duplicate": 0, "eval_near_duplicate": 0}
    by_block = record_in(f"{EVAL_DIR}/{ROWS_DIR}", first_item_only=True)
    for r in run_tasks(finish_task, finish, list(blocks), "eval_split remove", record=by_block):
        counters.merge(Counters.from_json(r["counters"]))
        for reason, n in r["removed"].items():
            removed_counts[reason] += n
    report = {"path": EVAL_DIR, "fraction": config.fraction, "max_tokens_per_domain": config.max_tokens_per_domain,
              "seed": config.seed, "source": config.source, "decontaminate": config.decontaminate,
              "domains": domains, "removed_from_train": removed_counts}
    return Split(str(work / EVAL_DIR / ROWS_DIR), 0 if config.source else sum(d["docs"] for d in domains.values()), report)


def _from_source(run_tasks: Callable[..., list[Any]], work: Location, config: EvalSplitConfig,
                 tokenizer: tuple[str, str]) -> dict[str, dict[str, int]]:
    """Another run's split: nothing is chosen here; its documents are held out as they are (`source_held_task`).
    Per domain, its documents and tokens."""
    check_source_tokenizer(config.source, shards.read_manifest(config.source), tokenizer[1])
    return run_tasks(source_held_task, SourceTask(str(work), config), [()], "eval_split source",
                     record=record_in(RECORDS, "source"))[0]["domains"]


def source_held_task(task: SourceTask) -> dict[str, Any]:
    """work/eval/held.arrow from `eval.source`'s documents (orders after every input); per domain, their counts."""
    work, source = location(task.folder), task.config.source
    _, docs = read_source(source)
    tokens = docs.column("tokens").chunk(0)
    values, offsets = tokens.values.to_numpy(), tokens.offsets.to_numpy()
    hashes = pa.array([xxhash.xxh3_128_digest(values[offsets[i]:offsets[i + 1]].tobytes()) for i in range(len(tokens))],
                      pa.binary(16))
    orders = pa.array([order_key(SOURCE_UNIT, i) for i in range(docs.num_rows)], pa.int64())
    write_work_table(work / HELD, pa.table({"order": orders, "id": docs.column("id"), "hash": hashes}))
    return {"domains": _domains(docs)}


def _chosen(run_tasks: Callable[..., list[Any]], work: Location, names: list[str], segment: str,
            config: EvalSplitConfig) -> dict[str, dict[str, int]]:
    """The documents chosen by the seeded hash of their id (see `chosen_mask`): each block's candidates sent by domain
    (`candidate_rows`), routed (`candidates_exchange`), one task per domain partition choosing (`choose`), one
    gathering the chosen into work/eval/held.arrow (`held_task`). Per domain, the chosen documents and tokens."""
    partitions = max(1, min(CHOOSE_TASKS, len(names)))
    spec = candidates_exchange(work, partitions)
    found = run_maps(run_tasks, spec, candidate_rows, CandidateTask(str(work), config, segment, partitions),
                     [(b,) for b in names])
    largest = int(np.sum([f["by_partition"] for f in found], axis=0).max()) if found else 0  # a domain's share
    chosen = run_reduces(run_tasks, spec, choose, ChooseTask(str(work), config, partitions), names, found,
                         memory=CHOOSE_BASE_BYTES + 4 * largest * CANDIDATE_BYTES)
    run_tasks(held_task, HeldTask(str(work), partitions), [()], "eval_split held", record=record_in(RECORDS, "held"),
              memory=CHOOSE_BASE_BYTES + 4 * sum(c["chosen"] for c in chosen) * CANDIDATE_BYTES)
    return dict(sorted((d, c) for r in chosen for d, c in r["domains"].items()))


def held_task(task: HeldTask) -> dict[str, int]:
    """work/eval/held.arrow: every choose task's documents (order, id, hash), in input order."""
    work, partitions = location(task.folder), task.partitions
    held = pa.concat_tables([read_work_table(work / EVAL_DIR / "chosen" / f"p{p:03d}.arrow") for p in range(partitions)])
    write_work_table(work / HELD, held.sort_by([("order", "ascending")]).select(["order", "id", "hash"]))
    return {"held": held.num_rows}


def _domains(meta: pa.Table) -> dict[str, dict[str, int]]:
    domains: dict[str, dict[str, int]] = {}
    for d, k in zip(meta.column("domain").to_pylist(), meta.column("num_tokens").to_pylist()):
        entry = domains.setdefault(d, {"docs": 0, "tokens": 0})
        entry["docs"] += 1
        entry["tokens"] += k
    return dict(sorted(domains.items()))


def _near_source(run_tasks: Callable[..., list[Any]], plan: Plan, names: list[str], near_dedup_groups: dict[str, int] | None,
                 tokenizer: tuple[str, str]) -> KeySource:
    """The MinHash keys to match the eval documents against: near dedup's own (still in work/minhash/, its nodes
    gathered by its groups, `near_dedup_groups` from its summary), or, when near dedup did not run (or the split
    is another run's), keys made here."""
    work, segment, config, minhash = plan.work, plan.segments[-1].name, plan.cfg.eval, plan.cfg.dedup.minhash
    near = next((seg for seg in plan.segments if isinstance(seg.global_stage, MinHashStage)), None)
    near_dedup_segment = near.name if near is not None else None
    if near_dedup_segment is not None and near_dedup_groups is not None and not config.source:
        return near_dedup.as_routed(near_dedup.KeySource(str(work / "minhash"), str(work),
                                                         tuple(f"{near_dedup_segment}/{b}" for b in names), gathered=True,
                                                         groups=near_dedup.Groups(**near_dedup_groups)))
    source = near_dedup.KeySource(str(work / EVAL_DIR), str(work), tuple(f"{segment}/{b}" for b in names))
    buckets = run_tasks(bucket_task, BucketTask(str(work), minhash, segment), [(b,) for b in names],
                        "eval_split minhash", record=record_in(RECORDS, "buckets"))
    documents = sum(r["rows"] for r in buckets)
    if config.source:  # its documents' keys next to this run's, under orders after every input
        documents += run_tasks(source_bucket_task, SourceBucketTask(str(work), config, minhash, tokenizer[0]), [(0,)],
                               "eval_split source minhash", record=record_in(RECORDS, "buckets-source"))[0]["rows"]
        source = dataclasses.replace(source, senders=(*source.senders, f"{EVAL_DIR}/{SOURCE_BLOCK}"))
    return dataclasses.replace(source, groups=near_dedup.resolve_groups(minhash.partitions, documents))
