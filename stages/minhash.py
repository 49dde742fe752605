"""Near-duplicate removal with MinHash-LSH: the pure parts (the runner distributes them).

1. **Signatures**, vectorised per batch. Each document's shingles (word n-grams of the lowercased,
   whitespace-split text, or character n-grams) are hashed to 32 bits; each hash goes through
   datasketch's own permutations (its `affine32` scheme: the MurmurHash3 finalizer, then
   `a * h + b mod 2**32`, with `a, b` drawn from `np.random.RandomState(seed)` exactly as
   `datasketch.MinHash` draws them), and the signature is the per-permutation minimum — computed as
   numpy arrays over all shingles of a batch, never one Python object per document. With
   `hash: sha1` the shingle hash is datasketch's default (`sha1_hash32` of the UTF-8 shingle), so the
   signatures equal `datasketch.MinHash(num_perm, seed).update(shingle)` exactly; the default
   `hash: xxh3` hashes each word (or character) once and combines n of them polynomially, which is
   several times faster and equals `datasketch.MinHash(..., hashfunc=shingle_hash32)`.
2. **LSH**: `bands × rows` of the signature (derived from `threshold` by datasketch's
   `_optimal_param` when not given); each band's rows hash to a bucket key. Documents sharing a
   bucket are candidates; with `verify`, a candidate pair is kept only when its estimated Jaccard
   (the fraction of equal signature values) reaches the threshold. Each bucket yields a star of
   edges from its first document (by input order) to every other member.
3. **Connected components** over the candidate edges by alternating *large-star* and *small-star*
   rounds (Kiveris et al., "Connected Components in MapReduce and Beyond", 2014). Each round is a
   pure function of the edges of one hash partition of nodes, so the runner runs a round as one task
   per partition with memory bounded by the partition count, not by the corpus. At convergence each
   node is linked to the smallest node of its component — the first document by input order.
4. **One document kept per cluster** (`first` by input order, or `longest` with ties to the first);
   every other member is dropped with reason `near_duplicate` and the id of the document kept.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash
from datasketch import MinHash
from datasketch.lsh import _optimal_param
from datasketch.minhash import _fmix

from datapipe.core.config import check, note

_POLY = np.uint64(0x9E3779B97F4A7C15)  # odd multiplier for combining unit hashes into a shingle hash
_U64 = np.uint64


@dataclass(frozen=True, kw_only=True)
class MinHashConfig:
    enabled: bool = note(False, help="remove near-duplicates globally with MinHash-LSH")
    shingle: Literal["word", "char"] = note("word", help="shingle unit: word n-grams or character n-grams")
    ngram: int = note(5, help="shingle size in units")
    lowercase: bool = note(True, help="lowercase the text before shingling")
    num_perm: int = note(128, help="number of permutations (signature length)")
    threshold: float = note(0.8, help="Jaccard similarity from which documents count as near-duplicates")
    bands: int | None = note(None, help="LSH bands; null = derived from threshold and num_perm as datasketch does")
    rows: int | None = note(None, help="rows per band; give both bands and rows, or neither")
    seed: int = note(1, help="seed of the permutations (datasketch's MinHash seed)")
    hash: Literal["xxh3", "sha1"] = note("xxh3", help="shingle hash: xxh3 (fast) or sha1 (datasketch's default)")
    verify: bool = note(True, help="keep a candidate pair only if its estimated Jaccard reaches the threshold")
    keep: Literal["first", "longest"] = note("first", help="which document of a cluster is kept")
    partitions: int = note(16, help="hash partitions for the bucket shuffle and the connected-components rounds")
    max_rounds: int = note(64, help="give up (an error) after this many connected-components rounds")

    def __post_init__(self) -> None:
        check(self.ngram >= 1, f"ngram must be >= 1, got {self.ngram!r}")
        check(1 <= self.num_perm <= 1024, f"num_perm must be in [1, 1024], got {self.num_perm!r}")
        check(0.0 < self.threshold < 1.0, f"threshold must be in (0, 1), got {self.threshold!r}")
        check((self.bands is None) == (self.rows is None), "bands and rows must be given together, or neither")
        if self.bands is not None and self.rows is not None:
            check(self.bands >= 1 and self.rows >= 1, f"bands and rows must be >= 1, got {self.bands!r} x {self.rows!r}")
            check(self.bands * self.rows <= self.num_perm,
                  f"bands x rows must be <= num_perm ({self.num_perm}), got {self.bands} x {self.rows}")
        check(self.partitions > 0, f"partitions must be > 0, got {self.partitions!r}")
        check(self.max_rounds > 1, f"max_rounds must be > 1, got {self.max_rounds!r}")

    def lsh_params(self) -> tuple[int, int]:
        """(bands, rows): as configured, or derived from the threshold the way datasketch does."""
        if self.bands is not None and self.rows is not None:
            return self.bands, self.rows
        return _optimal_param(self.threshold, self.num_perm, 0.5, 0.5)


# ------------------------------------------------------------------------------------- shingles


def _units(text: str, config: MinHashConfig) -> list[str] | str:
    if config.lowercase:
        text = text.lower()
    return text.split() if config.shingle == "word" else text


def _unit_hashes(units: list[str] | str, shingle: str) -> np.ndarray:
    if shingle == "word":
        return np.fromiter((xxhash.xxh3_64_intdigest(w.encode()) for w in units), dtype=_U64, count=len(units))
    codepoints = np.frombuffer(units.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(_U64)
    return _fmix(codepoints, 64)  # spread code points over 64 bits


def _combine(unit_hashes: np.ndarray, n: int) -> np.ndarray:
    """32-bit hashes of every window of n unit hashes (one window of all units if fewer than n)."""
    n = min(n, len(unit_hashes))
    if n == 0:
        return np.empty(0, dtype=np.uint32)
    count = len(unit_hashes) - n + 1
    acc = np.zeros(count, dtype=_U64)
    with np.errstate(over="ignore"):
        for j in range(n):
            acc = acc * _POLY + unit_hashes[j : j + count]
    return (acc >> _U64(32)).astype(np.uint32)


def shingle_hash32(shingle: bytes, *, shingle_unit: Literal["word", "char"] = "word") -> int:
    """The `xxh3` shingle hash of one shingle's bytes (words joined by spaces, or the characters):
    a reference for tests, and a `hashfunc` for `datasketch.MinHash` that reproduces our signatures."""
    text = shingle.decode("utf-8", "surrogatepass")
    units = text.split(" ") if shingle_unit == "word" else text
    hashes = _unit_hashes(units, shingle_unit)
    return int(_combine(hashes, len(hashes))[0])


def shingles(text: str, config: MinHashConfig) -> list[bytes]:
    """The shingles of a document as bytes (what `hash: sha1` hashes, and what datasketch sees)."""
    units = _units(text, config)
    n = min(config.ngram, len(units))
    if n == 0:
        return []
    if config.shingle == "word":
        return [" ".join(units[i : i + n]).encode() for i in range(len(units) - n + 1)]
    return [units[i : i + n].encode("utf-8", "surrogatepass") for i in range(len(units) - n + 1)]


def shingle_hashes(text: str, config: MinHashConfig) -> np.ndarray:
    """uint32 hashes of a document's shingles (duplicates allowed: the minimum does not care)."""
    if config.hash == "sha1":
        return np.fromiter(
            (int.from_bytes(hashlib.sha1(s).digest()[:4], "little") for s in shingles(text, config)), dtype=np.uint32
        )
    return _combine(_unit_hashes(_units(text, config), config.shingle), config.ngram)


# ------------------------------------------------------------------------------------- signatures


class MinHasher:
    """Computes MinHash signatures for many documents at once with datasketch's permutations."""

    # Shingles per vectorised step. Small enough that the CHUNK x num_perm block stays in cache:
    # 1,024 ran 2.6x faster than 65,536 on the shared corpus (memory traffic, not arithmetic, bounds it).
    CHUNK = 1 << 10

    def __init__(self, config: MinHashConfig) -> None:
        self.config = config
        a, b = MinHash(num_perm=config.num_perm, seed=config.seed).permutations
        self.a = np.asarray(a, dtype=np.uint32)
        self.b = np.asarray(b, dtype=np.uint32)

    def signatures(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(signatures of shape (n, num_perm) uint32, mask of documents that have shingles)."""
        per_doc = [shingle_hashes(t, self.config) for t in texts]
        counts = np.fromiter((len(h) for h in per_doc), dtype=np.int64, count=len(per_doc))
        sig = np.full((len(texts), self.config.num_perm), np.iinfo(np.uint32).max, dtype=np.uint32)
        has = counts > 0
        if not has.any():
            return sig, has
        flat = _fmix(np.concatenate(per_doc), 32)
        doc_of = np.repeat(np.arange(len(texts)), counts)
        buf = np.empty((self.CHUNK, self.config.num_perm), dtype=np.uint32)
        with np.errstate(over="ignore"):
            for start in range(0, len(flat), self.CHUNK):
                hv = flat[start : start + self.CHUNK]
                docs = doc_of[start : start + self.CHUNK]
                permuted = buf[: len(hv)]
                np.multiply(hv[:, None], self.a[None, :], out=permuted)  # wraps mod 2**32
                np.add(permuted, self.b[None, :], out=permuted)
                # minimum per document run inside this chunk, then into the signature
                starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
                mins = np.minimum.reduceat(permuted, starts, axis=0)
                idx = docs[starts]
                sig[idx] = np.minimum(sig[idx], mins)
        return sig, has


def band_keys(sig: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64 bucket keys: each band's rows combined into one 64-bit hash."""
    out = np.empty((sig.shape[0], bands), dtype=_U64)
    with np.errstate(over="ignore"):
        for k in range(bands):
            acc = np.full(sig.shape[0], _U64(k + 1), dtype=_U64)
            for j in range(k * rows, (k + 1) * rows):
                acc = acc * _POLY + sig[:, j].astype(_U64)
            out[:, k] = _fmix(acc, 64)
    return out


def partition_of(values: np.ndarray, partitions: int) -> np.ndarray:
    """A stable hash partition of int64/uint64 values."""
    with np.errstate(over="ignore"):
        return (_fmix(values.astype(_U64), 64) % _U64(partitions)).astype(np.uint32)


class MinHashStage:
    """The map side of near-dedup: signatures and bucket keys for each document of a batch."""

    name = "minhash"

    def __init__(self, config: MinHashConfig) -> None:
        self.config = config
        self.bands, self.rows = config.lsh_params()
        self.hasher = MinHasher(config)

    def keys(self, batch: pa.RecordBatch) -> dict[str, pa.Table]:
        """`buckets`: one row per (document, band), partitioned by bucket key; `nodes`: each
        document's id and length, partitioned by its order (for the join after clustering)."""
        sig, has = self.hasher.signatures(batch.column("text").to_pylist())
        order = batch.column("order").to_numpy()
        length = pc.utf8_length(batch.column("text")).to_numpy().astype(np.int64)
        nodes = pa.table(
            {
                "partition": partition_of(order, self.config.partitions),
                "order": order,
                "id": batch.column("id"),
                "length": length,
            }
        )
        keys = band_keys(sig[has], self.bands, self.rows)
        n = keys.shape[0]
        columns = {
            "partition": partition_of(keys.reshape(-1), self.config.partitions),
            "band": np.tile(np.arange(self.bands, dtype=np.uint16), n),
            "bucket": keys.reshape(-1),
            "order": np.repeat(order[has], self.bands),
        }
        if self.config.verify:
            sig_bytes = np.repeat(sig[has], self.bands, axis=0)
            columns["signature"] = pa.FixedSizeBinaryArray.from_buffers(
                pa.binary(4 * self.config.num_perm), len(sig_bytes), [None, pa.py_buffer(sig_bytes.tobytes())]
            )
        return {"buckets": pa.table(columns), "nodes": nodes}


# ------------------------------------------------------------------------------------- clustering


def candidate_edges(buckets: pa.Table, config: MinHashConfig) -> tuple[np.ndarray, np.ndarray]:
    """Edges (first member -> other member) of every bucket with two or more documents, verified by
    estimated Jaccard when configured. Returns undirected edges as (smaller, larger) order arrays."""
    if buckets.num_rows == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    buckets = buckets.sort_by([("band", "ascending"), ("bucket", "ascending"), ("order", "ascending")])
    band = buckets.column("band").to_numpy()
    bucket = buckets.column("bucket").to_numpy()
    order = buckets.column("order").to_numpy()
    new_group = np.r_[True, (band[1:] != band[:-1]) | (bucket[1:] != bucket[:-1])]
    head = np.maximum.accumulate(np.where(new_group, np.arange(len(order)), 0))
    member = ~new_group  # every row that is not its bucket's first
    u, v = order[head[member]], order[member]
    if config.verify and len(u):
        sig_col = buckets.column("signature").combine_chunks()
        sigs = np.frombuffer(sig_col.buffers()[1], dtype=np.uint32)[
            sig_col.offset * config.num_perm : (sig_col.offset + len(sig_col)) * config.num_perm
        ].reshape(-1, config.num_perm)
        rows_u, rows_v = head[member], np.flatnonzero(member)
        similarity = (sigs[rows_u] == sigs[rows_v]).mean(axis=1)
        keep = similarity >= config.threshold
        u, v = u[keep], v[keep]
    return _unique_edges(u, v)


def _unique_edges(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Canonical undirected edges (smaller, larger), without self loops or repeats."""
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    keep = lo != hi
    if not keep.any():
        return np.empty(0, np.int64), np.empty(0, np.int64)
    pairs = np.unique(np.stack([lo[keep], hi[keep]], axis=1), axis=0)
    return pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)


def _groups(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort directed edges by source; return (src, dst, index of each edge's group start)."""
    idx = np.lexsort((dst, src))
    src, dst = src[idx], dst[idx]
    starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
    return src, dst, starts


def large_star(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One large-star step over the directed edges of some source nodes (both directions of every
    undirected edge are present for each source): link every larger neighbour of u to the smallest
    node of u's closed neighbourhood. Returns undirected edges."""
    if len(src) == 0:
        return src, dst
    src, dst, starts = _groups(src, dst)
    group_min = np.minimum.reduceat(dst, starts)
    m = np.minimum(np.repeat(group_min, np.diff(np.r_[starts, len(src)])), src)
    larger = dst > src
    return _unique_edges(dst[larger], m[larger])


def small_star(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One small-star step: link u and every smaller neighbour of u to the smallest of them
    (all neighbours of a source are present, as in `large_star`). Returns undirected edges."""
    if len(src) == 0:
        return src, dst
    src, dst, _ = _groups(src, dst)
    smaller = dst <= src
    s_src, s_dst = src[smaller], dst[smaller]
    if len(s_src) == 0:  # no node has a smaller neighbour: nothing to link
        return np.empty(0, np.int64), np.empty(0, np.int64)
    starts = np.flatnonzero(np.r_[True, s_src[1:] != s_src[:-1]])
    group_min = np.minimum.reduceat(s_dst, starts)
    m = np.repeat(np.minimum(group_min, s_src[starts]), np.diff(np.r_[starts, len(s_src)]))
    # edges (v, m) for the smaller neighbours v, and (u, m) for u itself; u's edges to larger
    # neighbours are emitted by those neighbours, for which u is a smaller one
    a = np.concatenate([s_dst, s_src[starts]])
    b = np.concatenate([m, group_min])
    return _unique_edges(a, b)


def labels(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """After convergence: (node, smallest node of its component) for every source node."""
    if len(src) == 0:
        return src, dst
    src, dst, starts = _groups(src, dst)
    nodes = src[starts]
    return nodes, np.minimum(np.minimum.reduceat(dst, starts), nodes)


LOSER_SCHEMA = pa.schema([("order", pa.int64()), ("reason", pa.string()), ("kept_id", pa.string())])
CLUSTER_SCHEMA = pa.schema([("id", pa.string()), ("cluster_id", pa.string()), ("kept", pa.bool_()), ("order", pa.int64())])


def choose_kept(members: pa.Table, keep: Literal["first", "longest"]) -> tuple[pa.Table, pa.Table]:
    """Given cluster members (columns order, label, id, length), keep one per cluster.
    Returns (losers, clusters): losers carry reason `near_duplicate` and the kept id; clusters list
    every member with its cluster id (the id of the cluster's first document) and a kept flag."""
    if members.num_rows == 0:
        return LOSER_SCHEMA.empty_table(), CLUSTER_SCHEMA.empty_table()
    if keep == "first":
        members = members.sort_by([("label", "ascending"), ("order", "ascending")])
    else:
        members = members.append_column("neg_length", pc.negate(members.column("length")))
        members = members.sort_by([("label", "ascending"), ("neg_length", "ascending"), ("order", "ascending")])
    label = members.column("label").to_numpy()
    order = members.column("order").to_numpy()
    ids = members.column("id")
    head = np.flatnonzero(np.r_[True, label[1:] != label[:-1]])
    sizes = np.diff(np.r_[head, len(label)])
    winner_row = np.repeat(head, sizes)
    first_row_by_order = np.repeat(
        head + np.array([np.argmin(order[h : h + s]) for h, s in zip(head, sizes)], dtype=np.int64), sizes
    )
    kept_mask = np.zeros(len(label), dtype=bool)
    kept_mask[head] = True
    losers = pa.table(
        {
            "order": pa.array(order[~kept_mask], pa.int64()),
            "reason": pa.array(["near_duplicate"] * int((~kept_mask).sum()), pa.string()),
            "kept_id": ids.take(pa.array(winner_row[~kept_mask])),
        },
        schema=LOSER_SCHEMA,
    )
    clusters = pa.table(
        {
            "id": ids,
            "cluster_id": ids.take(pa.array(first_row_by_order)),
            "kept": pa.array(kept_mask),
            "order": pa.array(order, pa.int64()),
        },
        schema=CLUSTER_SCHEMA,
    )
    return losers, clusters
