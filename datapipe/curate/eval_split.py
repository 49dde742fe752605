"""The held-out eval split: documents set aside before selection and the mixture, with every copy of them removed from training.

With `eval.enabled: true`, `datapipe curate` writes `OUT/eval/`, a curated folder of its own (`shards/` and
`manifest.json` in the usual format, so the loader, the trainer and `datapipe stats` read it like any curated
folder), and names it in the main manifest under `splits.eval`. The trainer evaluates on it by default.

1. choose  per domain, the documents whose seeded hash of their id falls below `eval.fraction`,
           taken lowest hash first into `eval.max_tokens_per_domain` tokens (one that would overflow it is
           skipped, so a single huge document cannot leave the domain's split nearly empty). One task
           per block finds its candidates (hash below the fraction); the driver applies the token
           budget to the candidates only. One task per block then marks its eval rows and drops its
           training copies (steps 2-3), into work/eval/rows/<block>.arrow.
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
           member of a bucket meets every eval document in it, with no `bucket_window` limit, so a pair
           near dedup left apart in a crowded bucket is still caught. The keys are near dedup's own
           (`work/minhash/`) when it ran, else computed here (one task per block) with the
           `dedup.minhash` settings; one match task per bucket partition.

With `eval.source` (another run's eval split, e.g. the raw arm's of an ablation), step 1 chooses nothing: that
folder's documents are the split (copied to OUT/eval/), and steps 2-3 compare this run's training documents with
them (their MinHash keys from their decoded tokens; a training document with the same id is dropped too). So every
arm of an ablation, whatever its filters and dedup, evaluates on the same documents and trains on none of them.

The choice depends only on ids, token counts and block order, and every task writes its output atomically
and is skipped when that output exists, so the split is the same on any number of workers and after a resume.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from datapipe.core import shards
from datapipe.core.config import ConfigError, check, note
from datapipe.core.schema import DOC_SCHEMA, DROPPED_SCHEMA, order_key
from datapipe.core.shards import atomic_write_json, atomic_write_table, read_table
from datapipe.curate.counters import Counters
from datapipe.curate.near_dedup import ShingleStore, shingle_index_task
from datapipe.curate.selection import RowCopies
from datapipe.core.storage import Location, location
from stages.base import read_partition
from stages.minhash import MinHashConfig, MinHashStage, candidate_edges, exact_edges

EVAL_DIR = "eval"  # OUT/eval/: the split's curated folder
STAGE = "eval_split"  # the stage name of the training documents dropped as copies of eval documents
PAIR_SCHEMA = pa.schema([("order", pa.int64()), ("eval_order", pa.int64())])
SOURCE_UNIT = (1 << 23) - 1  # the input unit of `eval.source` documents in the order key: after every real input


@dataclass(frozen=True, kw_only=True)
class EvalSplitConfig:
    enabled: bool = note(
        False,
        help="write a held-out eval split to OUT/eval/, chosen before diversity sampling and the mixture (never "
        "sampled or repeated); copies of its documents are removed from training; the trainer evaluates on it",
    )
    fraction: float = note(0.01, help="share of each domain's documents held out: those whose seeded hash of the id falls below it")
    max_tokens_per_domain: int | None = note(
        None, help="at most this many eval tokens per domain (documents taken lowest hash first, one that would overflow is skipped); null = no cap"
    )
    seed: int = note(0, help="seed of the id hash that chooses the eval documents")
    source: str | None = note(
        None,
        help="another run's eval split (a curated folder such as RUN/eval) held out here instead of choosing one, so "
        "that every arm of an ablation evaluates on the same documents: its shards are copied to OUT/eval/ and every "
        "training copy of its documents (same id, identical tokens, or near with decontaminate: near) is removed. "
        "Needs the same tokenizer; fraction, max_tokens_per_domain and seed are then unused",
    )
    decontaminate: Literal["exact", "near"] = note(
        "near",
        help="drop from training the copies of eval documents: 'exact' (identical tokens) or 'near' (also MinHash-LSH "
        "near-duplicates, with dedup.minhash's settings and threshold, whether or not dedup.minhash is enabled)",
    )

    def __post_init__(self) -> None:
        check(self.enabled or self.source is None, f"source {self.source!r} is set but enabled is false; set eval.enabled: true to use it")
        check(0.0 < self.fraction < 1.0, f"fraction must be in (0, 1), got {self.fraction!r}")
        if self.max_tokens_per_domain is not None:
            check(self.max_tokens_per_domain > 0, f"max_tokens_per_domain must be > 0 or null, got {self.max_tokens_per_domain!r}")


ROWS_DIR = "rows"  # work/eval/rows/<block>.arrow: per row `eval` (held out for eval) and `held_out` (not for training)


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


def choose(meta: dict[str, pa.Table], config: EvalSplitConfig) -> dict[str, np.ndarray]:
    """Per block (columns id, domain, num_tokens; in input order): a bool mask of the rows held out."""
    names = list(meta)
    sizes = [meta[b].num_rows for b in names]
    if sum(sizes) == 0:
        return {b: np.zeros(0, dtype=bool) for b in names}
    rank = np.concatenate([eval_rank(meta[b].column("id").to_pylist(), config.seed) for b in names])
    domain = np.concatenate([np.array(meta[b].column("domain").to_pylist(), dtype=object) for b in names])
    tokens = np.concatenate([meta[b].column("num_tokens").to_numpy() for b in names])
    position = np.arange(len(rank))  # global input order: breaks ties between equal ids
    chosen = np.zeros(len(rank), dtype=bool)
    candidate = rank < np.uint64(min(int(config.fraction * 2**64), 2**64 - 1))
    for d in np.unique(domain[candidate]):
        rows = np.flatnonzero(candidate & (domain == d))
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
    return dict(zip(names, np.split(chosen, np.cumsum(sizes)[:-1])))


# ---------------------------------------------------------------- tasks


def hash_task(work: str, block: str) -> str:
    """xxh3-128 of each row's token bytes -> work/eval/hashes/<block>.arrow (one column `hash`)."""
    out = location(work) / EVAL_DIR / "hashes" / f"{block}.arrow"
    if out.exists():
        return str(out)
    tokens = read_table(location(work) / "tokens" / f"{block}.arrow").column("tokens").combine_chunks()
    values, offsets = tokens.values.to_numpy(), tokens.offsets.to_numpy()
    digests = [xxhash.xxh3_128_digest(values[offsets[i] : offsets[i + 1]].tobytes()) for i in range(len(tokens))]
    atomic_write_table(out, pa.table({"hash": pa.array(digests, pa.binary(16))}))
    return str(out)


def bucket_task(shared: tuple[str, str, MinHashConfig], block: str) -> int:
    """Near dedup's map half on a block of the last segment (used when near dedup did not run): its
    `buckets` (and `shingles`) rows, laid out as the runner lays out a global stage's keys, under
    work/eval/<kind>/pNNN/<block>.arrow."""
    work, segment, config = location(shared[0]), shared[1], shared[2]
    record = work / EVAL_DIR / "records" / f"buckets-{block}.json"
    if record.exists():
        return 0
    stage = MinHashStage(config)
    table = read_table(work / segment / f"{block}.arrow")
    emitted = [stage.keys(b) for b in table.to_batches() if b.num_rows]
    for kind in ("buckets", "shingles"):
        parts = [e[kind] for e in emitted if kind in e]
        if not parts:
            continue
        rows = pa.concat_tables(parts)
        partition = rows.column("partition").to_numpy()
        for p in np.unique(partition):
            atomic_write_table(work / EVAL_DIR / kind / f"p{p:03d}" / f"{block}.arrow", rows.filter(pa.array(partition == p)))
    atomic_write_json(record, {"rows": table.num_rows})
    return table.num_rows


def match_task(shared: tuple[str, str, np.ndarray, MinHashConfig, list[tuple[str, int]]], p: int) -> str:
    """(order, eval_order) of every document that shares a bucket of partition p with an eval document
    and is its near-duplicate -> OUT_FOLDER/near-pNNN.arrow. `shared`: the folder holding `buckets/`
    (and `shingles/`), the output folder, the eval documents' orders, the MinHash config and the
    shingle files' index (`near_dedup.ShingleStore.index`). Each pair is decided exactly as near
    dedup decides a pair (`stages.minhash.candidate_edges` by the signature estimate, then
    `exact_edges` for the pairs too close to the threshold to call), but every member of a bucket
    meets every eval document in it: no `bucket_window` limit."""
    keys_root, out_dir, eval_orders, config, shingle_index = location(shared[0]), location(shared[1]), shared[2], shared[3], shared[4]
    out = out_dir / f"near-p{p:03d}.arrow"
    if out.exists():
        return str(out)
    rows = read_partition(keys_root / "buckets" / f"p{p:03d}")
    pairs = PAIR_SCHEMA.empty_table()
    if rows is not None and len(eval_orders):
        rows = rows.combine_chunks()
        rows = rows.append_column("row", pa.array(np.arange(rows.num_rows, dtype=np.int64)))
        is_eval = pc.is_in(rows.column("order"), value_set=pa.array(eval_orders, pa.int64()))
        ev = rows.filter(is_eval).select(["band", "bucket", "order", "row"]).rename_columns(["band", "bucket", "eval_order", "eval_row"])
        joined = rows.filter(pc.invert(is_eval)).select(["band", "bucket", "order", "row"]).join(ev, ["band", "bucket"], join_type="inner")
        if joined.num_rows:
            found = np.stack([joined.column(c).to_numpy() for c in ("order", "eval_order", "row", "eval_row")], axis=1)
            _, first = np.unique(found[:, :2], axis=0, return_index=True)  # a pair sharing several buckets, once
            found = found[np.sort(first)]
            # each candidate pair as a bucket of its own two members, decided by near dedup's own rule
            member_rows = found[:, 2:].reshape(-1)
            members = rows.select(["order"] + (["signature"] if config.verify else [])).take(pa.array(member_rows))
            members = members.append_column("band", pa.array(np.zeros(len(member_rows), np.uint16)))
            members = members.append_column("bucket", pa.array(np.repeat(np.arange(len(found), dtype=np.uint64), 2)))
            decided = candidate_edges(members, config)  # by the signatures; pairs too close to call go to exact_edges
            near_u, near_v = exact_edges(decided.near_u, decided.near_v, ShingleStore(shingle_index), config.threshold)
            eval_set = set(eval_orders.tolist())
            kept = [(v, u) if u in eval_set else (u, v)
                    for u, v in zip(np.r_[decided.edge_u, near_u].tolist(), np.r_[decided.edge_v, near_v].tolist())]
            if kept:
                pairs = pa.table({"order": [k[0] for k in kept], "eval_order": [k[1] for k in kept]}, schema=PAIR_SCHEMA)
    atomic_write_table(out, pairs)
    return str(out)


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


def source_bucket_task(shared: tuple[str, str, str, MinHashConfig], part: int) -> int:
    """The MinHash keys of `eval.source`'s documents (their text decoded from the tokens), laid out like
    bucket_task's, as block `source` under work/eval/<kind>/pNNN/."""
    from tokenizers import Tokenizer  # only this task decodes

    work, source, tokenizer_path, config = location(shared[0]), shared[1], shared[2], shared[3]
    record = work / EVAL_DIR / "records" / "buckets-source.json"
    if record.exists():
        return 0
    _, docs = read_source(source)
    tokenizer = Tokenizer.from_str(location(tokenizer_path).read_text())  # the output folder may be a URL
    tokens = docs.column("tokens").chunk(0)
    values, offsets = tokens.values.to_numpy().tolist(), tokens.offsets.to_numpy()
    texts = tokenizer.decode_batch([values[offsets[i]:offsets[i + 1]] for i in range(len(tokens))], skip_special_tokens=True)
    batch = pa.RecordBatch.from_pydict({
        "id": docs.column("id").chunk(0), "domain": docs.column("domain").chunk(0), "text": pa.array(texts, pa.large_string()),
        "order": pa.array([order_key(SOURCE_UNIT, i) for i in range(docs.num_rows)], pa.int64()),
        "lang": pa.nulls(docs.num_rows, pa.string()), "lang_score": pa.nulls(docs.num_rows, pa.float32()),
    }, schema=DOC_SCHEMA)
    emitted = MinHashStage(config).keys(batch)
    for kind in ("buckets", "shingles"):
        if kind not in emitted:
            continue
        rows = emitted[kind]
        partition = rows.column("partition").to_numpy()
        for p in np.unique(partition):
            atomic_write_table(work / EVAL_DIR / kind / f"p{p:03d}" / "source.arrow", rows.filter(pa.array(partition == p)))
    atomic_write_json(record, {"rows": docs.num_rows})
    return docs.num_rows


# ---------------------------------------------------------------- the whole split


def candidate_task(shared: tuple[str, str, EvalSplitConfig], block: str) -> dict[str, Any]:
    """The block's candidates for the split (rows whose seeded hash of the id falls below `fraction`):
    their rows, ids, domains, token counts, token hashes (`hash_task`) and orders."""
    work, segment, config = location(shared[0]), shared[1], shared[2]
    meta = read_table(work / "tokens" / f"{block}.arrow").select(["id", "domain", "num_tokens"])
    rank = eval_rank(meta.column("id").to_pylist(), config.seed)
    rows = np.flatnonzero(rank < np.uint64(min(int(config.fraction * 2**64), 2**64 - 1)))
    take = pa.array(rows)
    return {"rows": rows, "meta": meta.take(take),
            "hash": read_table(work / EVAL_DIR / "hashes" / f"{block}.arrow").column("hash").take(take).combine_chunks(),
            "order": read_table(work / segment / f"{block}.arrow").column("order").to_numpy()[rows]}


def finish_task(shared: tuple[str, str, str, pa.Array, pa.Array, bool, pa.Table], block: str, input_index: int,
                eval_rows: np.ndarray) -> dict[str, Any]:
    """One block's training copies of eval documents: exact (identical tokens; with another run's split,
    also the same id) and near (`near`: order and eval id of every near copy). Writes the dropped
    documents' records and work/eval/rows/<block>.arrow; returns the counters' changes and the counts."""
    work, out_dir, segment, eval_hashes, eval_ids, by_id, near = location(shared[0]), location(shared[1]), *shared[2:]
    record = work / EVAL_DIR / ROWS_DIR / f"{block}.json"
    if record.exists():
        return json.loads(record.read_text())
    meta = read_table(work / "tokens" / f"{block}.arrow").select(["id", "domain", "num_tokens"])
    orders = read_table(work / segment / f"{block}.arrow").column("order").to_numpy()
    if len(orders) != meta.num_rows:  # a bug, never bad input
        raise RuntimeError(f"eval split: the token blocks and the {segment} blocks differ in rows")
    is_eval = np.zeros(meta.num_rows, dtype=bool)
    is_eval[eval_rows] = True
    hashes = read_table(work / EVAL_DIR / "hashes" / f"{block}.arrow").column("hash").combine_chunks()
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
            "kept_id": kept_id.take(pa.array(rows)), "text": pa.nulls(n, pa.large_string()),
        }, schema=DROPPED_SCHEMA))
        for d, k in zip(sub.column("domain").to_pylist(), sub.column("num_tokens").to_pylist()):
            counters.kept[(input_index, d)][0] -= 1
            counters.kept[(input_index, d)][1] -= k
        counters.count_dropped(input_index, parts[-1])
        removed_counts[reason] += n
    if parts:
        atomic_write_table(out_dir / "dropped" / f"{STAGE}-{block}.parquet", pa.concat_tables(parts), format="parquet")
    atomic_write_table(work / EVAL_DIR / ROWS_DIR / f"{block}.arrow",
                       pa.table({"eval": is_eval, "held_out": is_eval | is_exact | is_near}))
    result = {"counters": counters.to_json(), "removed": removed_counts}
    atomic_write_json(record, result)
    return result


def split(
    run_tasks: Callable[..., list[Any]],
    work: Location,
    out_dir: Location,
    blocks: list[tuple[str, int]],
    segment: str,
    config: EvalSplitConfig,
    minhash: MinHashConfig,
    near_dedup_ran: bool,
    counters: Counters,
    tokenizer: tuple[str, str] = ("", ""),
) -> Split:
    """Choose the eval split and find the training documents that copy it (see the module docstring).
    `blocks` are (block name, input index) in input order; `segment` names the last segment's folder (the
    documents' text and `order`, row for row with the token blocks). Writes the dropped copies to
    out_dir/dropped/ and takes them out of `counters.kept` (eval documents stay kept: they are written).
    Per-document work runs in tasks over blocks; the driver holds the eval documents (a `fraction` of
    the corpus: with a token cap, the candidates) and their near copies only."""
    names = [b for b, _ in blocks]
    run_tasks(hash_task, str(work), [(b,) for b in names], "eval_split exact")
    chosen: dict[str, np.ndarray] = {}
    domains: dict[str, dict[str, int]] = {}
    if config.source:  # another run's split: nothing is chosen here
        source_manifest, source_docs = read_source(config.source)
        check_source_tokenizer(config.source, source_manifest, tokenizer[1])
        tokens = source_docs.column("tokens").chunk(0)
        values, offsets = tokens.values.to_numpy(), tokens.offsets.to_numpy()
        eval_hashes = pa.array([xxhash.xxh3_128_digest(values[offsets[i]:offsets[i + 1]].tobytes()) for i in range(len(tokens))],
                               pa.binary(16))
        eval_ids = source_docs.column("id").chunk(0)
        eval_orders = np.array([order_key(SOURCE_UNIT, i) for i in range(source_docs.num_rows)], dtype=np.int64)
        held = [source_docs]
    else:
        found = run_tasks(candidate_task, (str(work), segment, config), [(b,) for b in names], "eval_split choose")
        picked = choose({b: f["meta"] for b, f in zip(names, found)}, config)  # candidates only: the same choice
        chosen = {b: f["rows"][picked[b]] for b, f in zip(names, found)}
        keep = [pa.array(picked[b]) for b in names]
        eval_hashes = pa.concat_arrays([f["hash"].filter(k) for f, k in zip(found, keep)]) if names else pa.array([], pa.binary(16))
        eval_ids = (pa.concat_arrays([f["meta"].column("id").combine_chunks().filter(k) for f, k in zip(found, keep)])
                    if names else pa.array([], pa.string()))
        eval_orders = np.concatenate([f["order"][picked[b]] for b, f in zip(names, found)] + [np.empty(0, np.int64)])
        held = [f["meta"].filter(k) for f, k in zip(found, keep)]
        del found
    for sub in held:
        for d, k in zip(sub.column("domain").to_pylist(), sub.column("num_tokens").to_pylist()):
            entry = domains.setdefault(d, {"docs": 0, "tokens": 0})
            entry["docs"] += 1
            entry["tokens"] += k

    # near: MinHash-LSH against the eval documents -> (order, eval id) of each near copy
    near = pa.table({"order": pa.array([], pa.int64()), "eval_id": pa.array([], pa.string())})
    if config.decontaminate == "near" and names:
        if near_dedup_ran and not config.source:  # its keys are still in work/minhash/ (buckets, and shingles when verifying exactly)
            keys_root = work / "minhash"
        else:
            keys_root = work / EVAL_DIR
            run_tasks(bucket_task, (str(work), segment, minhash), [(b,) for b in names], "eval_split minhash")
        if config.source:  # its documents' keys next to this run's, under orders after every input
            run_tasks(source_bucket_task, (str(work), config.source, tokenizer[0], minhash), [(0,)], "eval_split source minhash")
        shingle_index = (run_tasks(shingle_index_task, str(keys_root / "shingles" / "p000"), [(0,)], "eval_split shingles")[0]
                         if minhash.exact else [])
        files = run_tasks(match_task, (str(keys_root), str(work / EVAL_DIR), eval_orders, minhash, shingle_index),
                          [(p,) for p in range(minhash.partitions)], "eval_split near")
        pairs = pa.concat_tables([read_table(f) for f in files]).sort_by([("order", "ascending"), ("eval_order", "ascending")])
        if pairs.num_rows:
            order_col = pairs.column("order").to_numpy()
            first = np.r_[True, order_col[1:] != order_col[:-1]]  # one eval document named per copy: the first in input order
            pairs = pairs.filter(pa.array(first)).combine_chunks()
            eval_name = eval_ids.take(pc.index_in(pairs.column("eval_order").chunk(0), value_set=pa.array(eval_orders)))
            near = pa.table({"order": pairs.column("order").chunk(0), "eval_id": eval_name})

    shared = (str(work), str(out_dir), segment, eval_hashes, eval_ids, bool(config.source), near)
    items = [(b, input_index, chosen.get(b, np.empty(0, np.int64))) for b, input_index in blocks]
    removed_counts: dict[str, int] = {"eval_duplicate": 0, "eval_near_duplicate": 0}
    for r in run_tasks(finish_task, shared, items, "eval_split remove"):
        counters.merge(Counters.from_json(r["counters"]))
        for reason, n in r["removed"].items():
            removed_counts[reason] += n
    report = {"path": EVAL_DIR, "fraction": config.fraction, "max_tokens_per_domain": config.max_tokens_per_domain,
              "seed": config.seed, "source": config.source, "decontaminate": config.decontaminate, "domains": dict(sorted(domains.items())),
              "removed_from_train": removed_counts}
    eval_docs = 0 if config.source else len(eval_orders)
    return Split(str(work / EVAL_DIR / ROWS_DIR), eval_docs, report)
