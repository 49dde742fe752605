"""Diversity sampling: budgets honoured, deterministic, and more diverse than random on real text."""

from __future__ import annotations

import random

import numpy as np
import orjson
import pytest

from helpers import ASSETS
from datapipe.testing.synthetic import mutate
from stages import diversity
from stages.diversity import (
    default_clusters,
    distinct_ngram_ratio,
    features,
    kmeans,
    assign_clusters,
    seeded_rank,
    select,
    vendi_score,
    water_fill,
)


def test_water_fill_spreads_evenly_and_passes_leftovers_on():
    assert water_fill(np.array([10.0, 10.0, 10.0]), 9).tolist() == [3, 3, 3]
    assert water_fill(np.array([1.0, 10.0, 10.0]), 9).tolist() == [1, 4, 4]
    assert water_fill(np.array([1.0, 2.0]), 100).tolist() == [1, 2]


def test_fraction_and_token_budgets():
    rng = np.random.default_rng(0)
    clusters = rng.integers(0, 7, 1000)
    rank = rng.integers(0, 2**63, 1000).astype(np.uint64)
    tokens = rng.integers(10, 1000, 1000)
    keep = select(clusters, rank, tokens, 0.2)
    assert abs(keep.sum() - 200) <= 7  # rounding per cluster
    keep = select(clusters, rank, tokens, 50_000)
    # filled: each cluster's quota is reached, by its crossing document at most (under 1,000 tokens each)
    assert 50_000 <= tokens[keep].sum() < 50_000 + 7 * 1000
    assert np.array_equal(keep, select(clusters, rank, tokens, 50_000))


def _skewed_domain():
    """A domain dominated by near-copies of a few license texts, with a minority of varied pages."""
    rng = random.Random(1)
    rows = [orjson.loads(l) for name in ("corpus_slice.jsonl", "multilingual_sample.jsonl", "quality_sample.jsonl")
            for l in (ASSETS / name).read_bytes().splitlines()]
    licenses = [r["text"] for r in rows if r["source"] == "license"][:3]
    varied = [r["text"] for r in rows if r["source"] != "license"][:40]
    docs = [mutate(rng.choice(licenses), 0.05, rng, "substitute") for _ in range(160)] + varied
    return docs


def _tokens(docs):
    # byte values as token ids: features work on any id sequences
    return [np.frombuffer(d.encode(), dtype=np.uint8).astype(np.int64) for d in docs]


def test_diversity_sample_beats_random_on_real_text():
    toks = _tokens(_skewed_domain())
    x = features(toks, 512)
    centroids = kmeans(x, default_clusters(len(toks)), 25, seed=0)
    clusters = assign_clusters(x, centroids)
    ids = [f"d{i}" for i in range(len(toks))]
    keep = select(clusters, seeded_rank(ids, 0), np.array([len(t) for t in toks]), 0.2)
    n = int(keep.sum())
    ours = vendi_score(x[keep])
    randoms = [vendi_score(x[np.random.default_rng(s).choice(len(toks), n, replace=False)]) for s in range(10)]
    assert ours > max(randoms), (ours, randoms)
    chosen = [toks[i] for i in np.flatnonzero(keep)]
    random_ratio = np.mean([
        distinct_ngram_ratio([toks[i] for i in np.random.default_rng(s).choice(len(toks), n, replace=False)])
        for s in range(10)
    ])
    assert distinct_ngram_ratio(chosen) > random_ratio


def test_vendi_score_counts_effective_distinct_items():
    eye = np.eye(5, dtype=np.float32)
    assert vendi_score(eye) == pytest.approx(5.0)
    assert vendi_score(np.repeat(eye[:1], 5, axis=0)) == pytest.approx(1.0)


def test_the_distances_are_the_exact_formula_and_ties_go_to_the_first_centroid():
    """`diversity_kernels.squared_distances` against numpy's float64 difference form, on hashed n-gram features of
    real-looking bags (k = 7: the 4-wide passes and the rest), an empty document among them; equal centroids: the
    first wins, as numpy's argmin."""
    from stages.diversity_kernels import squared_distances

    rng = np.random.default_rng(1)
    toks = [rng.integers(0, 3000, size=n) for n in rng.integers(0, 300, size=60)] + [np.array([], np.int64)]
    x = diversity.features(toks, 64)
    c = x[rng.choice(len(x), size=7, replace=False)].copy()
    c[5] = c[2]
    got = squared_distances(x, c)
    want = ((x.astype(np.float64)[:, None, :] - c.astype(np.float64)[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert (diversity.assign_clusters(x, c) != 5).all()  # c[5] equals c[2]: never chosen over it
    assert (diversity.assign_clusters(x, c) == want.argmin(axis=1)).mean() > 0.95


def test_one_seeded_sample_is_nested_across_rates_and_the_same_in_any_block_order():
    """`stages.sampling`: a sample at a lower rate is a subset of one at a higher rate, a rate of 1 takes all, and a
    document's membership does not depend on which other ids are drawn with it."""
    from stages.sampling import in_sample, seeded_rank, seeded_sample

    ids = [f"doc-{i}" for i in range(5000)]
    low, high = seeded_sample(ids, 0.1, 7), seeded_sample(ids, 0.3, 7)
    assert (low <= high).all() and 350 < low.sum() < 650 and seeded_sample(ids, 1.0, 7).all()
    assert (seeded_sample(ids[::-1], 0.1, 7) == low[::-1]).all()
    assert (in_sample(seeded_rank(ids[:10], 7), 0.1) == low[:10]).all() and not (seeded_sample(ids, 0.1, 8) == low).all()
