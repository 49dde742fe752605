"""The curation ablation's data-constrained pool: sampled by duplicate cluster, every cluster whole."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from scripts.experiment_curation import duplicate_clusters, write_pool


def _curated_near_arm(folder: Path) -> None:
    """What a curated `near` arm leaves: near-duplicate clusters, and exact copies among the drops."""
    (folder / "near_duplicates" / "clusters").mkdir(parents=True)
    (folder / "dropped").mkdir()
    members = [(f"n{c}-{k}", f"n{c}-0") for c in range(40) for k in range(3)]  # 40 clusters of 3
    pq.write_table(pa.table({"id": [m for m, _ in members], "cluster_id": [c for _, c in members],
                             "kept": [m == c for m, c in members]}), folder / "near_duplicates" / "clusters" / "part-00000.parquet")
    # exact copies: of a near cluster's member, and of a document in no near cluster
    copies = [(f"x{c}", f"n{c}-1") for c in range(40)] + [(f"y{i}", f"solo{i}") for i in range(40)]
    pq.write_table(pa.table({"id": [a for a, _ in copies], "domain": ["d"] * 80, "order": list(range(80)),
                             "stage": ["exact_dedup"] * 80, "reason": ["exact_duplicate"] * 80,
                             "kept_id": [b for _, b in copies], "text": pa.nulls(80, pa.large_string())}),
                   folder / "dropped" / "seg0-u000000-b00000.parquet")


def test_the_pool_keeps_every_duplicate_cluster_whole(tmp_path):
    _curated_near_arm(tmp_path / "near")
    clusters = duplicate_clusters(tmp_path / "near")
    assert clusters["x3"] == clusters["n3-2"] == "n3-0"  # an exact copy joins its original's near cluster
    assert clusters["y5"] == clusters["solo5"] == "solo5"
    ids = list(clusters) + [f"single{i}" for i in range(400)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "text": "t"}) + "\n" for i in ids))

    pools = []
    for name in ("a", "b"):
        n = write_pool("unused.yaml", str(corpus), 300, tmp_path / name / "pool.jsonl.gz", seed=3, clusters=clusters)
        pools.append([json.loads(line)["id"] for line in gzip.open(tmp_path / name / "pool.jsonl.gz")])
        assert n == len(pools[-1])
    assert pools[0] == pools[1]  # seeded
    picked = set(pools[0])
    for cluster in set(clusters.values()):
        members = {i for i, c in clusters.items() if c == cluster}
        assert members <= picked or not members & picked  # whole or not at all
    assert any(len({i for i, c in clusters.items() if c == cl}) > 1 for cl in {clusters[i] for i in picked if i in clusters})
    # each cluster kept with probability 300 / 760: about 300 documents
    assert 200 < len(picked) < 400
    # the document sample (no clusters) keeps exactly the asked number
    n = write_pool("unused.yaml", str(corpus), 300, tmp_path / "docs" / "pool.jsonl.gz", seed=3)
    assert n == 300
