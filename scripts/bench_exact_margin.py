"""Near dedup's `exact_margin` against brute force: what each margin finds, and what its exact check reads.

usage: python -m scripts.bench_exact_margin [--corpus ../shared/data/corpus.jsonl.gz] [--limit N]
                                           [--margins 0,0.02,0.04,0.06,0.08,0.1,0.12,0.15,0.2,1]
                                           [--threshold 0.8] [--num-perm 128]

A candidate pair (two documents that share an LSH bucket) whose estimated Jaccard (the share of equal stored
signature values) is within `exact_margin` of the threshold is decided by the exact Jaccard of the two
documents' shingle sets, which the run recomputes from their text: the margin trades the documents the exact
check reads against the true pairs the estimate alone would lose (or the false ones it would keep).

On the corpus (exact duplicates dropped first, as the recipes' exact dedup does; the default `dedup.minhash`
config otherwise, or its `--threshold` and `--num-perm`: word 5-grams, 128 permutations, 16 x 6 bands, threshold
0.8, bucket window 32):
- the truth: every pair whose exact Jaccard of shingle sets (`stages.minhash.shingle_sets`, what the exact check
  compares) reaches the threshold, by brute force (all pairs; prefix filtering finds every pair that can reach
  it, then each one's exact Jaccard), and its clusters (connected components);
- the candidates as the run makes them (`band_keys`, `bucket_pairs`), decided as the verify step decides them
  (`estimate_masks` on the 16-bit stored signatures, then the exact Jaccard for the `near` ones), per margin.
For each margin: the clusters' pair precision and recall and the removed documents' precision and recall
against the truth's (keeping each cluster's first document), the candidate pairs decided wrongly, and the
exact check's cost: the pairs it checks and the distinct documents it reads (an upper bound: the run skips a
near pair whose documents its sure edges already join). Margin 1 checks every candidate exactly: the ceiling
the candidates allow. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import numpy as np
import pyarrow as pa
from scipy.sparse import coo_matrix, csr_matrix
from scipy.sparse.csgraph import connected_components

from scripts.corpus import DEFAULT, load_docs
from stages.minhash import (MinHashConfig, MinHasher, band_keys, bucket_pairs, estimate_masks, pair_jaccards,
                            shingle_sets)

BATCH = 2000  # documents hashed at a time


def distinct_texts(corpus: str, limit: int | None) -> list[str]:
    """The corpus's texts, each exact duplicate after the first dropped (exact dedup runs before near dedup)."""
    seen: set[str] = set()
    texts = []
    for doc in load_docs(corpus, limit):
        if doc["text"] not in seen:
            seen.add(doc["text"])
            texts.append(doc["text"])
    return texts


def all_shingle_sets(texts: list[str], config: MinHashConfig) -> list[np.ndarray]:
    return [s for i in range(0, len(texts), BATCH) for s in shingle_sets(pa.array(texts[i : i + BATCH], pa.large_string()), config)]


def brute_force_pairs(sets: list[np.ndarray], threshold: float) -> tuple[np.ndarray, np.ndarray]:
    """Every pair (i < j) whose exact Jaccard reaches `threshold`. Prefix filtering: with each set's shingles in
    one global order (rarest first), two sets of Jaccard >= t share one of the first s - ceil(t s) + 1 shingles of
    each (s its size), so the pairs sharing a prefix shingle hold every such pair; each is then measured exactly."""
    sizes = np.fromiter(map(len, sets), np.int64, len(sets))
    doc = np.repeat(np.arange(len(sets)), sizes)
    shingle, column, df = np.unique(np.concatenate(sets), return_inverse=True, return_counts=True)
    rank = np.empty(len(shingle), np.int64)
    rank[np.lexsort((np.arange(len(shingle)), df))] = np.arange(len(shingle))
    by_rank = np.lexsort((rank[column], doc))
    doc, ranked = doc[by_rank], rank[column][by_rank]
    position = np.arange(len(doc)) - np.r_[0, np.cumsum(sizes)[:-1]][doc]
    prefix = sizes - np.ceil(threshold * sizes - 1e-9).astype(np.int64) + 1
    keep = position < prefix[doc]
    m = csr_matrix((np.ones(int(keep.sum()), np.int32), (doc[keep], ranked[keep])), shape=(len(sets), len(shingle)))
    shared = (m @ m.T).tocoo()
    upper = shared.row < shared.col
    i, j = shared.row[upper].astype(np.int64), shared.col[upper].astype(np.int64)
    hit = pair_jaccards(sets, i, j) >= threshold
    return i[hit], j[hit]


def candidates(texts: list[str], config: MinHashConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The run's candidate pairs (u < v) and each end's stored (16-bit) signature."""
    hasher, (bands, rows) = MinHasher(config), config.lsh_params()
    sigs, has = zip(*(hasher.signatures(pa.array(texts[i : i + BATCH], pa.large_string())) for i in range(0, len(texts), BATCH)))
    sig, has = np.concatenate(sigs), np.concatenate(has)
    order = np.arange(len(texts))[has]
    keys = band_keys(sig[has], bands, rows).reshape(-1)
    u, v = bucket_pairs(pa.table({"bucket": keys, "order": np.repeat(order, bands)}), config.bucket_window)
    stored = sig.astype(np.uint16)  # the low bits the nodes keep (`stored_signatures`)
    return u, v, stored[u], stored[v]


def cluster_labels(n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Each document's cluster (connected components of the pairs), named by its first document."""
    _, label = connected_components(coo_matrix((np.ones(len(u)), (u, v)), shape=(n, n)), directed=False)
    first = np.full(label.max() + 1, n, np.int64)
    np.minimum.at(first, label, np.arange(n))
    return first[label]


def agreement(found: np.ndarray, truth: np.ndarray) -> dict[str, float]:
    """Pair precision and recall of the clusters (pairs put together), and of the documents removed when each
    cluster keeps its first, against the truth's."""
    together = lambda counts: int((counts * (counts - 1) // 2).sum())
    both = together(np.unique(np.stack([found, truth]), axis=1, return_counts=True)[1])
    found_pairs, true_pairs = together(np.bincount(found)), together(np.bincount(truth))
    removed, truly = found != np.arange(len(found)), truth != np.arange(len(truth))
    hit = int((removed & truly).sum())
    return {"pair_precision": round(both / max(found_pairs, 1), 5), "pair_recall": round(both / max(true_pairs, 1), 5),
            "removed_precision": round(hit / max(int(removed.sum()), 1), 5),
            "removed_recall": round(hit / max(int(truly.sum()), 1), 5), "removed": int(removed.sum())}


def by_margin(config: MinHashConfig, margin: float, n: int, u, v, sig_u, sig_v, exact, truth, text_bytes) -> dict:
    edge, near = estimate_masks(sig_u, sig_v, dataclasses.replace(config, exact_margin=margin))
    decided = edge | (near & (exact >= config.threshold))
    read = np.unique(np.r_[u[near], v[near]])
    return {
        "exact_margin": margin,
        **agreement(cluster_labels(n, u[decided], v[decided]), truth),
        "candidates_decided_wrong": {"true_pairs_lost": int((~decided & (exact >= config.threshold)).sum()),
                                     "false_pairs_kept": int((decided & (exact < config.threshold)).sum())},
        "exact_pairs_checked": int(near.sum()),
        "exact_documents_read": int(len(read)),
        "exact_document_share": round(len(read) / n, 4),
        "exact_text_share": round(int(text_bytes[read].sum()) / int(text_bytes.sum()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=DEFAULT)
    parser.add_argument("--limit", type=int, default=None, help="the first N documents only")
    parser.add_argument("--margins", default="0,0.02,0.04,0.06,0.08,0.1,0.12,0.15,0.2,1")
    parser.add_argument("--threshold", type=float, default=MinHashConfig.threshold)
    parser.add_argument("--num-perm", type=int, default=MinHashConfig.num_perm)
    args = parser.parse_args()
    config, started = MinHashConfig(threshold=args.threshold, num_perm=args.num_perm), time.perf_counter()
    texts = distinct_texts(args.corpus, args.limit)
    sets = all_shingle_sets(texts, config)
    true_u, true_v = brute_force_pairs(sets, config.threshold)
    truth = cluster_labels(len(texts), true_u, true_v)
    u, v, sig_u, sig_v = candidates(texts, config)
    exact = pair_jaccards(sets, u, v)
    text_bytes = np.fromiter((len(t.encode()) for t in texts), np.int64, len(texts))
    rows = [by_margin(config, float(m), len(texts), u, v, sig_u, sig_v, exact, truth, text_bytes)
            for m in args.margins.split(",")]
    print(json.dumps({
        "corpus": args.corpus, "documents": len(texts), "config": {"threshold": config.threshold, "num_perm": config.num_perm,
                                                                   "bands_rows": config.lsh_params(), "bucket_window": config.bucket_window},
        "true_pairs": len(true_u), "true_removed": int((truth != np.arange(len(texts))).sum()),
        "candidate_pairs": len(u), "candidates_at_or_above_threshold": int((exact >= config.threshold).sum()),
        "margins": rows, "seconds": round(time.perf_counter() - started, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
