"""The one seeded sample of the run: a document is in a sample at rate r when its seeded rank falls below r x 2^64.

The rank is xxh64 of the document's id under the seed: the same wherever and whenever it is computed, so a sample
does not depend on blocks, workers or resumes, and a sample at a lower rate is a subset of one at a higher rate.
The tokenizer's training sample (seed 0), selection by a model's fitting sample and diversity's centroid sample
(their configs' seeds) all draw by it; the mixture's extra copies and the order inside a diversity cluster use the
same rank.
"""

from __future__ import annotations

import numpy as np
import xxhash


def seeded_rank(ids: list[str], seed: int = 0) -> np.ndarray:
    """A seeded pseudo-random rank per id (uint64), the same wherever and whenever computed."""
    return np.fromiter((xxhash.xxh64_intdigest(i.encode(), seed=seed) for i in ids), dtype=np.uint64, count=len(ids))


def in_sample(rank: np.ndarray, rate: float) -> np.ndarray:
    """Which ranks fall in a sample at `rate`: every one at a rate of 1 or more."""
    if rate >= 1.0:
        return np.ones(len(rank), dtype=bool)
    return np.asarray(rank, dtype=np.uint64) < np.uint64(int(rate * 2**64))


def seeded_sample(ids: list[str], rate: float, seed: int = 0) -> np.ndarray:
    """The mask of `ids` in the seeded sample at `rate`."""
    return in_sample(seeded_rank(ids, seed), rate)
