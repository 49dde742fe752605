"""Planted near-duplicates for measuring near-dedup: mutations of real documents, and brute-force
exact Jaccard on the same shingles the MinHash stage uses (the ground truth).

`mutate` edits a rate of words or paragraphs; `plant` edits a document until its exact Jaccard with
the original is at a chosen level (line insertions, word swaps, a boilerplate header, truncation).
`true_pairs` is brute force over every pair (a sparse intersection count, so a few thousand
documents take seconds), `components` turns pairs into clusters as near dedup does.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Iterable, Sequence

import numpy as np

from stages.minhash import MinHashConfig, shingles

MUTATIONS = ("substitute", "insert", "delete", "reorder")


def mutate(text: str, rate: float, rng: random.Random, kind: str) -> str:
    """A copy of `text` with about `rate` of its words substituted, inserted or deleted, or its
    paragraphs reordered (`rate` = the fraction of paragraph boundaries swapped)."""
    if kind == "reorder":
        paras = text.split("\n\n")
        for _ in range(max(1, int(rate * len(paras)))):
            if len(paras) > 1:
                i = rng.randrange(len(paras) - 1)
                paras[i], paras[i + 1] = paras[i + 1], paras[i]
        return "\n\n".join(paras)
    words = text.split(" ")
    n = max(1, int(rate * len(words)))
    for _ in range(n):
        i = rng.randrange(len(words))
        if kind == "substitute":
            words[i] = f"w{rng.randrange(10**6)}"
        elif kind == "insert":
            words.insert(i, f"w{rng.randrange(10**6)}")
        elif kind == "delete" and len(words) > 1:
            del words[i]
    return " ".join(words)


def exact_jaccard(a: str, b: str, config: MinHashConfig) -> float:
    sa, sb = set(shingles(a, config)), set(shingles(b, config))
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def true_pairs(texts: list[str], config: MinHashConfig, threshold: float) -> set[tuple[int, int]]:
    """Every pair (i < j) whose exact shingle Jaccard is at least `threshold` (brute force: every
    pair's intersection size, counted as a sparse product of the document x shingle matrix)."""
    from scipy.sparse import csr_matrix

    ids: dict[bytes, int] = {}
    sets = [np.unique(np.fromiter((ids.setdefault(x, len(ids)) for x in shingles(t, config)), dtype=np.int64)) for t in texts]
    sizes = np.array([len(s) for s in sets], dtype=np.int64)
    cols = np.concatenate(sets) if sets else np.empty(0, np.int64)
    rows = np.repeat(np.arange(len(texts)), sizes)
    m = csr_matrix((np.ones(len(cols), dtype=np.int32), (rows, cols)), shape=(len(texts), len(ids)))
    inter = (m @ m.T).tocoo()
    i, j, common = inter.row, inter.col, inter.data.astype(np.int64)
    upper = i < j
    i, j, common = i[upper], j[upper], common[upper]
    union = sizes[i] + sizes[j] - common
    hit = common / union >= threshold  # a pair with no common shingle is never a hit (threshold > 0)
    return set(zip(i[hit].tolist(), j[hit].tolist()))


def components(n: int, pairs: Iterable[tuple[int, int]]) -> list[int]:
    """The cluster of each of n documents: the smallest document connected to it by `pairs`."""
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [find(x) for x in range(n)]


def removed_by_components(labels: Sequence[int]) -> set[int]:
    """The documents a keep-the-first rule removes: every one that is not its cluster's smallest."""
    return {i for i, label in enumerate(labels) if label != i}


EDITS = ("line_insert", "word_swap", "header", "truncate")

BOILERPLATE = (
    "This page is part of the documentation set distributed with the package. It was generated automatically "
    "from the source files; do not edit it by hand, edit the sources and rebuild instead. Copyright the authors "
    "and contributors, all rights reserved, see the accompanying license file for the terms of use, copying and "
    "redistribution. Report errors in this page to the issue tracker of the project, quoting its version number."
).split()


def _edit(text: str, kind: str, k: int, plan: list, filler: Sequence[str]) -> str:
    """`text` with the first k edits of `plan` (drawn by `plant`) applied."""
    if kind == "line_insert":
        lines = text.split("\n")
        for position, line in sorted(plan[:k], key=lambda x: -x[0]):
            lines.insert(position, line)
        return "\n".join(lines)
    if kind == "word_swap":
        parts = re.split(r"(\s+)", text)  # words at even indices, whitespace kept in between
        words = list(range(0, len(parts), 2))
        for w in plan[:k]:
            a, b = words[w], words[w + 1]
            parts[a], parts[b] = parts[b], parts[a]
        return "".join(parts)
    if kind == "header":
        header = " ".join(BOILERPLATE[i % len(BOILERPLATE)] + ("" if i < len(BOILERPLATE) else str(i)) for i in range(k))
        return f"{header}\n\n{text}" if k else text
    if kind == "truncate":
        starts = [m.start() for m in re.finditer(r"\S+", text)]
        return text if k == 0 else text[: starts[len(starts) - k]].rstrip()
    raise ValueError(f"unknown edit kind {kind!r}; one of {EDITS}")


def plant(text: str, target: float, kind: str, rng: random.Random, config: MinHashConfig,
          filler: Sequence[str] = ()) -> tuple[str, float]:
    """A near-duplicate of `text` made with `kind` edits (`EDITS`), as many as keep its exact Jaccard
    with `text` at or above `target` (bisection over the number of edits): (the copy, its exact
    Jaccard). `filler` gives the lines that `line_insert` inserts."""
    n_words = len(text.split())
    if kind == "line_insert":
        lines = text.count("\n") + 1
        plan = [(rng.randrange(lines + 1), rng.choice(filler)) for _ in range(4 * n_words)] if filler else []
    elif kind == "word_swap":
        plan = [rng.randrange(max(1, n_words - 1)) for _ in range(4 * n_words)]
    else:
        plan = []
    most = {"line_insert": len(plan), "word_swap": len(plan), "header": 20 * n_words, "truncate": n_words - 1}[kind]
    lo, hi = 0, max(most, 0)  # J(lo) >= target; find the largest such number of edits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if exact_jaccard(text, _edit(text, kind, mid, plan, filler), config) >= target:
            lo = mid
        else:
            hi = mid - 1
    copy = _edit(text, kind, lo, plan, filler)
    return copy, exact_jaccard(text, copy, config)


def cluster_pairs(cluster_of: dict[int, str]) -> set[tuple[int, int]]:
    """All pairs of documents put in the same cluster."""
    groups: dict[str, list[int]] = {}
    for doc, cluster in cluster_of.items():
        groups.setdefault(cluster, []).append(doc)
    return {(i, j) for members in groups.values() for i, j in itertools.combinations(sorted(members), 2)}


def precision_recall(predicted: Iterable[tuple[int, int]], truth: set[tuple[int, int]]) -> tuple[float, float]:
    predicted = set(predicted)
    hit = len(predicted & truth)
    return (hit / len(predicted) if predicted else 1.0, hit / len(truth) if truth else 1.0)
