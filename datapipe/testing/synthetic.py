"""Planted near-duplicates for measuring near-dedup: mutations of real documents, and brute-force
exact Jaccard on the same shingles the MinHash stage uses (the ground truth)."""

from __future__ import annotations

import itertools
import random
from typing import Iterable

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
    """Every pair (i < j) whose exact shingle Jaccard is at least `threshold` (brute force)."""
    sets = [set(shingles(t, config)) for t in texts]
    out = set()
    for i, j in itertools.combinations(range(len(texts)), 2):
        union = len(sets[i] | sets[j])
        if union and len(sets[i] & sets[j]) / union >= threshold:
            out.add((i, j))
    return out


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
