"""Importance resampling toward a target (DSIR, Xie et al. 2023).

Two bag-of-hashed-n-grams models: one of the target documents, one of the raw corpus (a seeded sample of it),
each the smoothed frequencies of the `buckets` unigram+bigram buckets (`_ngrams`). A document's
importance weight is the likelihood ratio of its n-grams under the two, log w = sum over its n-grams of
log p_target - log p_raw. Resampling keeps the documents with the largest log w + Gumbel noise, seeded by
the document id: the Gumbel-top-k trick draws k documents without replacement with probability
proportional to w (here until a token budget is filled; the cut itself is the selection phase's).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import xxhash

from stages.selection._ngrams import count_matrix

SMOOTHING = 1.0  # added to every bucket's count (Laplace)


def _log_frequencies(texts: list[str], buckets: int) -> np.ndarray:
    counts = np.asarray(count_matrix(texts, buckets).sum(0)).ravel() + SMOOTHING
    return np.log(counts / counts.sum())


def gumbel(ids: list[str], seed: int) -> np.ndarray:
    """Standard Gumbel noise per document, a function of its id and `seed` only."""
    u = (np.array([xxhash.xxh3_64_intdigest(i.encode(), seed) for i in ids], dtype=np.float64) + 0.5) / 2.0**64
    return -np.log(-np.log(u))


@dataclass(frozen=True)
class ImportanceModel:
    log_ratio: np.ndarray  # (buckets,): log p_target - log p_raw per bucket

    @classmethod
    def fit(cls, target: list[str], raw: list[str], *, buckets: int = 1 << 16) -> "ImportanceModel":
        return cls(_log_frequencies(target, buckets) - _log_frequencies(raw, buckets))

    def log_weights(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.empty(0, np.float64)
        return count_matrix(texts, len(self.log_ratio)) @ self.log_ratio

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, kind="importance", log_ratio=self.log_ratio)
        return buffer.getvalue()

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "ImportanceModel":
        return cls(arrays["log_ratio"])
