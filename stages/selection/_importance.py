"""Importance resampling toward a target (DSIR, Xie et al. 2023).

Two bag-of-hashed-n-grams models: one of the target documents, one of the raw corpus (a seeded sample of it),
each the smoothed frequencies of the `buckets` unigram+bigram buckets (`_ngrams`). The paper weighs fixed-length
chunks of text (the likelihood ratio of a chunk's n-grams under the two models); a document here weighs as a
chunk of CHUNK_WORDS words with its own mean n-gram ratio:
log w = CHUNK_WORDS / words * sum over its n-grams of (log p_target - log p_raw).
Summed over a whole document instead, the weight grows with its length, the Gumbel noise stops mattering for
long documents and the choice becomes a top-k by length. Resampling keeps the documents with the largest
log w + Gumbel noise, seeded by the document id: the Gumbel-top-k trick draws k documents without replacement
with probability proportional to w (here until a token budget is filled; the cut itself is the selection phase's).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import xxhash

from stages.selection._ngrams import count_matrix

SMOOTHING = 1.0  # added to every bucket's count (Laplace)
CHUNK_WORDS = 128  # the paper's unit of selection: its Pile runs weigh 128-word chunks


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
        """Each document's log importance weight as a chunk of CHUNK_WORDS words (0 for a document without words)."""
        if not texts:
            return np.empty(0, np.float64)
        counts = count_matrix(texts, len(self.log_ratio))
        grams = np.asarray(counts.sum(1)).ravel()
        words = (grams + 1) // 2  # w words hold w unigrams and w - 1 bigrams
        return np.where(words > 0, counts @ self.log_ratio * CHUNK_WORDS / np.maximum(words, 1), 0.0)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, kind="importance", log_ratio=self.log_ratio)
        return buffer.getvalue()

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "ImportanceModel":
        return cls(arrays["log_ratio"])
