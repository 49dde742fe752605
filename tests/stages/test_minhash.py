"""MinHash-LSH pure parts: signatures equal datasketch's, LSH parameters as datasketch derives them,
connected components equal a union-find, the keep rules."""

from __future__ import annotations

import random

import numpy as np
import orjson
import pyarrow as pa
import pytest
from datasketch import MinHash, MinHashLSH

from helpers import ASSETS
from datapipe.core.config import ConfigError, from_dict
from stages.minhash import (
    MinHashConfig,
    MinHasher,
    MinHashStage,
    candidate_edges,
    choose_kept,
    labels,
    large_star,
    partition_of,
    shingle_hash32,
    shingles,
    small_star,
)

DOCS = [orjson.loads(line)["text"] for line in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()]


@pytest.mark.parametrize("unit", ["word", "char"])
@pytest.mark.parametrize("hash_name", ["sha1", "xxh3"])
def test_signatures_equal_datasketch(unit, hash_name):
    cfg = MinHashConfig(shingle=unit, hash=hash_name, ngram=5 if unit == "word" else 9, num_perm=64, seed=7)
    sig, has = MinHasher(cfg).signatures(DOCS[:12] + ["one two"])  # the last one is shorter than a shingle
    assert has.all()
    for text, row in zip(DOCS[:12] + ["one two"], sig):
        kwargs = {} if hash_name == "sha1" else {"hashfunc": lambda b: shingle_hash32(b, shingle_unit=unit)}
        ref = MinHash(num_perm=64, seed=7, **kwargs)
        ref.update_batch(shingles(text, cfg))
        assert np.array_equal(ref.hashvalues, row)


def test_lsh_parameters_derived_like_datasketch():
    for threshold, num_perm in [(0.8, 128), (0.5, 128), (0.9, 256)]:
        cfg = MinHashConfig(threshold=threshold, num_perm=num_perm)
        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        assert cfg.lsh_params() == (lsh.b, lsh.r)
    assert MinHashConfig().lsh_params() == (9, 13)
    assert MinHashConfig(bands=16, rows=8).lsh_params() == (16, 8)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="dedup.minhash.bands and rows must be given together"):
        from_dict(MinHashConfig, {"bands": 4}, key="dedup.minhash")
    with pytest.raises(ConfigError, match=r"bands x rows must be <= num_perm \(64\), got 9 x 13"):
        from_dict(MinHashConfig, {"num_perm": 64, "bands": 9, "rows": 13}, key="dedup.minhash")
    with pytest.raises(ConfigError, match=r"threshold must be in \(0, 1\), got 1.5"):
        from_dict(MinHashConfig, {"threshold": 1.5}, key="dedup.minhash")


def _union_find(edges):
    parent = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in list(parent)}


def _distributed_components(edges, partitions):
    """Large-star / small-star rounds as the runner runs them: each partition sees only the
    directed edges of its own source nodes."""
    a = np.array([e[0] for e in edges], dtype=np.int64)
    b = np.array([e[1] for e in edges], dtype=np.int64)
    previous, r = None, 0
    while True:
        src, dst = np.concatenate([a, b]), np.concatenate([b, a])
        part = partition_of(src, partitions)
        pairs = np.unique(np.stack([src, dst], 1), axis=0)
        if r % 2 == 0:
            if previous is not None and np.array_equal(previous, pairs):
                break
            previous = pairs
        step = large_star if r % 2 == 0 else small_star
        outs = [step(src[part == p], dst[part == p]) for p in range(partitions)]
        a = np.concatenate([o[0] for o in outs])
        b = np.concatenate([o[1] for o in outs])
        r += 1
    nodes, label = labels(np.concatenate([a, b]), np.concatenate([b, a]))
    return dict(zip(nodes.tolist(), label.tolist())), r


def test_connected_components_equal_union_find_on_random_graphs():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(2, 80)
        edges = [(rng.randrange(n), rng.randrange(n)) for _ in range(rng.randint(1, 100))]
        edges = [(x, y) for x, y in edges if x != y]
        if not edges:
            continue
        got, rounds = _distributed_components(edges, partitions=rng.randint(1, 5))
        assert got == _union_find(edges)
        assert rounds < 40


def test_long_chain_converges():
    chain = [(i, i + 1) for i in range(500)]
    got, rounds = _distributed_components(chain, partitions=4)
    assert set(got.values()) == {0} and rounds < 40


def _batch(texts):
    from datapipe.core.schema import DOC_SCHEMA

    rows = [{"id": f"d{i}", "domain": "d", "text": t, "order": i} for i, t in enumerate(texts)]
    return pa.RecordBatch.from_pylist(rows, schema=DOC_SCHEMA)


def test_candidates_are_verified_by_estimated_jaccard():
    base = max(DOCS, key=len)
    words = base.split()
    near = " ".join(words[:-3] + ["changed", "words", "here"])  # Jaccard of 5-grams ~0.99
    far = min(DOCS, key=len)
    stage = MinHashStage(MinHashConfig(partitions=1))
    keys = stage.keys(_batch([base, near, far, base]))
    a, b = candidate_edges(keys["buckets"], stage.config)
    assert list(zip(a.tolist(), b.tolist())) == [(0, 1), (0, 3)]
    assert keys["nodes"].column("id").to_pylist() == ["d0", "d1", "d2", "d3"]


def test_keep_first_and_longest():
    members = pa.table({"order": [5, 2, 9, 7], "label": [2, 2, 2, 7], "id": ["e", "b", "i", "g"], "length": [10, 3, 30, 1]})
    losers, clusters = choose_kept(members, "first")
    assert sorted(zip(losers.column("order").to_pylist(), losers.column("kept_id").to_pylist())) == [(5, "b"), (9, "b")]
    losers, clusters = choose_kept(members, "longest")
    assert sorted(zip(losers.column("order").to_pylist(), losers.column("kept_id").to_pylist())) == [(2, "i"), (5, "i")]
    assert set(losers.column("reason").to_pylist()) == {"near_duplicate"}
    rows = {r["id"]: r for r in clusters.to_pylist()}
    assert rows["i"]["kept"] and rows["i"]["cluster_id"] == "b" and rows["g"]["cluster_id"] == "g"
