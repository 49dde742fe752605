"""Hashed word n-grams: the features the model-based selectors share (`_classifier`,
`_importance`, `_perplexity`).

A document's words are the runs of word characters of its lower-cased text (`\\w+`), each hashed with
xxh3-64 (seedless, so the same on every machine and process). Unigrams and bigrams are folded into
`buckets` hash buckets, as fastText's and DSIR's featurizers do: no vocabulary to build or ship, and a
model is a few arrays.
"""

from __future__ import annotations

import re

import numpy as np
import xxhash

WORD = re.compile(r"\w+")
_MIX = np.uint64(0x9E3779B97F4A7C15)
_CACHE_LIMIT = 1 << 20  # words whose hash a process keeps: a corpus's vocabulary mostly fits
_hashes: dict[str, int] = {}


def word_hashes(text: str) -> np.ndarray:
    """The xxh3-64 hash of each word of `text`, in order (uint64)."""
    out = []
    for word in WORD.findall(text.lower()):
        h = _hashes.get(word)
        if h is None:
            h = xxhash.xxh3_64_intdigest(word.encode())
            if len(_hashes) < _CACHE_LIMIT:
                _hashes[word] = h
        out.append(h)
    return np.array(out, dtype=np.uint64)


def unigram_buckets(words: np.ndarray, buckets: int) -> np.ndarray:
    return (words % np.uint64(buckets)).astype(np.int64)


def bigram_buckets(words: np.ndarray, buckets: int) -> np.ndarray:
    """Bucket of each (previous word, word) pair; empty for fewer than two words."""
    with np.errstate(over="ignore"):
        pairs = words[:-1] * _MIX + words[1:]
        pairs ^= pairs >> np.uint64(31)
    return (pairs % np.uint64(buckets)).astype(np.int64)


def ngram_buckets(words: np.ndarray, buckets: int) -> np.ndarray:
    """Unigram and bigram buckets of one document."""
    return np.concatenate([unigram_buckets(words, buckets), bigram_buckets(words, buckets)])


def count_matrix(texts: list[str], buckets: int) -> "scipy.sparse.csr_matrix":  # noqa: F821
    """(documents, buckets) counts of each document's unigrams and bigrams."""
    import scipy.sparse as sp  # here, not at import: scipy costs every process that imports the curation phases ~0.5 s

    indptr, indices = [0], []
    for text in texts:
        grams = ngram_buckets(word_hashes(text), buckets)
        indices.append(grams)
        indptr.append(indptr[-1] + len(grams))
    flat = np.concatenate(indices) if indices else np.empty(0, np.int64)
    matrix = sp.csr_matrix((np.ones(len(flat), np.float64), flat, np.array(indptr)), shape=(len(texts), buckets))
    matrix.sum_duplicates()
    return matrix
