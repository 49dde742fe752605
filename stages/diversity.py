"""Diversity sampling: choose a subset of a domain that covers its variety better than a random
subset of the same size.

Method (CPU-only, scales out): each document becomes a hashed bag of token n-grams (unigrams and
bigrams of its token ids, feature hashing into `dims` buckets, sublinear tf, L2-normalised). k-means
(k-means++ seeding, Lloyd iterations, seeded) runs on a deterministic sample of at most
`fit_docs` documents of the domain; every document is then assigned to its nearest centroid; the
budget (a fraction of the documents, or a number of tokens) is spread evenly over the clusters by
water-filling — each cluster gets the same share, small clusters give their leftovers to the
others — and inside a cluster documents are taken in a seeded hash order (a random sample of the
cluster); a token quota is filled, the document that crosses it kept too (so a domain holds at least
its token budget: one long document never ends a cluster's share early). Rare kinds of documents thus
keep their place instead of being outnumbered.

The diversity of a set is measured by the Vendi score (Friedman & Dieng, 2023) with the cosine
kernel on the same features: exp of the entropy of the eigenvalues of K/n — the effective number
of distinct documents. `distinct_ngram_ratio` is a second, model-free measure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from datapipe.core.config import check, note
from stages.sampling import seeded_rank  # noqa: F401 - the order inside a cluster (and `select`'s callers)


@dataclass(frozen=True, kw_only=True)
class DiversityConfig:
    enabled: bool = note(False, help="diversity-sample the domains listed in `domains`")
    domains: dict[str, float] = note(
        {}, help="domain -> budget: a fraction of its documents (<= 1.0) or a number of tokens (> 1)"
    )
    clusters: int | None = note(None, help="k-means clusters per domain (null = about sqrt(documents / 2), at most 256)")
    dims: int = note(1024, help="feature-hashing dimensions of the n-gram vectors")
    fit_docs: int = note(20000, help="at most this many documents (a seeded sample) fit the centroids")
    iterations: int = note(25, help="Lloyd iterations of k-means")
    seed: int = note(0, help="seed of the sample, the k-means initialisation and the order inside clusters")

    def __post_init__(self) -> None:
        for domain, budget in self.domains.items():
            check(budget > 0, f"domains.{domain} must be > 0 (a fraction <= 1 or a token count), got {budget!r}")
        check(self.dims >= 16, f"dims must be >= 16, got {self.dims!r}")
        if self.clusters is not None:
            check(self.clusters >= 1, f"clusters must be >= 1, got {self.clusters!r}")
        check(self.fit_docs >= 1, f"fit_docs must be >= 1, got {self.fit_docs!r}")
        check(self.iterations >= 1, f"iterations must be >= 1, got {self.iterations!r}")


def features(token_lists: list[np.ndarray], dims: int) -> np.ndarray:
    """Hashed unigram + bigram bags of token ids, sublinear tf, L2-normalised: (n, dims) float32."""
    out = np.zeros((len(token_lists), dims), dtype=np.float32)
    for i, toks in enumerate(token_lists):
        t = np.asarray(toks, dtype=np.uint64)
        if t.size == 0:
            continue
        with np.errstate(over="ignore"):
            grams = np.concatenate([t * np.uint64(0x9E3779B97F4A7C15), t[:-1] * np.uint64(0xC2B2AE3D27D4EB4F) + t[1:]])
            buckets = ((grams ^ (grams >> np.uint64(29))) * np.uint64(0xBF58476D1CE4E5B9) >> np.uint64(40)) % np.uint64(dims)
        counts = np.bincount(buckets.astype(np.int64), minlength=dims).astype(np.float32)
        out[i] = np.log1p(counts)
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return out / np.maximum(norms, 1e-12)


def kmeans(x: np.ndarray, k: int, iterations: int, seed: int) -> np.ndarray:
    """Centroids (k, d) by k-means++ seeding and Lloyd iterations on cosine-normalised rows."""
    rng = np.random.default_rng(seed)
    n = len(x)
    k = max(1, min(k, n))
    centroids = [x[rng.integers(n)]]
    dist = np.full(n, np.inf, dtype=np.float64)
    for _ in range(1, k):
        dist = np.minimum(dist, ((x - centroids[-1]) ** 2).sum(axis=1))
        total = dist.sum()
        centroids.append(x[rng.choice(n, p=dist / total)] if total > 0 else x[rng.integers(n)])
    c = np.stack(centroids)
    for _ in range(iterations):
        assign = assign_clusters(x, c)
        sums = np.zeros_like(c)
        np.add.at(sums, assign, x)
        counts = np.bincount(assign, minlength=len(c))[:, None]
        moved = np.where(counts > 0, sums / np.maximum(counts, 1), c)
        if np.allclose(moved, c):
            break
        c = moved
    return c.astype(np.float32)


def assign_clusters(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Nearest centroid of each row (squared Euclidean distance; the first of equals), the same on every machine
    (`diversity_kernels.squared_distances`: no BLAS)."""
    from stages.diversity_kernels import squared_distances  # numba, imported where a stage computes it

    x = np.ascontiguousarray(x, dtype=np.float32)
    return squared_distances(x, np.ascontiguousarray(centroids, dtype=np.float32)).argmin(axis=1)


def water_fill(sizes: np.ndarray, total: float) -> np.ndarray:
    """Equal shares of `total` over clusters, each capped at its size; leftovers go to the others."""
    quota = np.zeros(len(sizes), dtype=np.float64)
    open_ = sizes > 0
    remaining = float(min(total, sizes.sum()))
    while remaining > 1e-9 and open_.any():
        share = remaining / open_.sum()
        room = sizes - quota
        add = np.where(open_, np.minimum(room, share), 0.0)
        quota += add
        remaining -= add.sum()
        open_ &= (sizes - quota) > 1e-9
    return quota


def select(clusters: np.ndarray, rank: np.ndarray, tokens: np.ndarray, budget: float) -> np.ndarray:
    """Boolean mask of the chosen documents of one domain. `budget` <= 1 is a fraction of the
    documents, > 1 a number of tokens (each cluster's quota filled: its crossing document kept);
    either is spread evenly over the clusters."""
    n = len(clusters)
    keep = np.zeros(n, dtype=bool)
    if n == 0:
        return keep
    by_tokens = budget > 1
    weight = tokens.astype(np.float64) if by_tokens else np.ones(n)
    total = budget if by_tokens else budget * n
    k = int(clusters.max()) + 1
    sizes = np.bincount(clusters, weights=weight, minlength=k)
    quota = water_fill(sizes, total)
    order = np.lexsort((rank, clusters))  # by cluster, then seeded rank inside it
    sorted_clusters = clusters[order]
    cumulative = np.cumsum(weight[order])
    starts = np.searchsorted(sorted_clusters, np.arange(k))
    before = np.where(starts > 0, cumulative[np.maximum(starts - 1, 0)], 0.0)
    within = cumulative - before[sorted_clusters]
    # take a cluster's documents in rank order while its running total stays within its quota; a token quota is
    # filled: the document that crosses it is kept too, so one long document never leaves the cluster short
    limit = quota if by_tokens else np.round(quota)
    if by_tokens:
        chosen = within - weight[order] < limit[sorted_clusters] - 1e-9
    else:
        chosen = within <= limit[sorted_clusters] + 1e-9
    keep[order[chosen]] = True
    return keep


def default_clusters(n: int) -> int:
    return int(max(1, min(256, round((n / 2) ** 0.5))))


def vendi_score(x: np.ndarray) -> float:
    """Vendi score of the rows of x (L2-normalised features) with the cosine kernel."""
    n = len(x)
    if n == 0:
        return 0.0
    k = (x @ x.T) / n
    eig = np.linalg.eigvalsh(k.astype(np.float64))
    eig = eig[eig > 1e-12]
    return float(np.exp(-(eig * np.log(eig)).sum()))


def distinct_ngram_ratio(token_lists: list[np.ndarray], n: int = 3) -> float:
    """Distinct token n-grams over all n-grams of a set of documents."""
    total, seen = 0, set()
    for toks in token_lists:
        t = np.asarray(toks, dtype=np.int64)
        if len(t) < n:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(t, n)
        total += len(windows)
        seen.update(map(bytes, windows))
    return len(seen) / total if total else 0.0
