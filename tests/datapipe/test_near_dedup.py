"""Near-dedup through the runner: planted near-duplicates of real documents are found with
precision and recall >= 0.9 against brute-force exact Jaccard; the result is the same in one
process and on Ray with 2 workers; every removal names the document kept."""

from __future__ import annotations

import random

import orjson
import pyarrow.parquet as pq
import pytest

from helpers import ASSETS, small_config
from datapipe.curate.executors import LocalExecutor, RayExecutor
from datapipe.curate.runner import curate
from datapipe.core.shards import read_manifest
from datapipe.testing.synthetic import MUTATIONS, cluster_pairs, mutate, precision_recall, true_pairs
from stages.minhash import MinHashConfig


def _corpus(tmp_path):
    """Real documents (long enough to carry 5-grams) plus mutated copies at many similarities."""
    rng = random.Random(42)
    originals = []
    for name in ("corpus_slice.jsonl", "quality_sample.jsonl"):
        for line in (ASSETS / name).read_bytes().splitlines():
            rec = orjson.loads(line)
            if len(rec["text"].split()) >= 150:
                originals.append(rec["text"])
    texts = list(originals)
    for i, text in enumerate(originals):
        for kind in rng.sample(MUTATIONS, 2):
            texts.append(mutate(text, rng.choice([0.005, 0.02, 0.05, 0.1, 0.3]), rng, kind))
    rng.shuffle(texts)
    path = tmp_path / "planted.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"doc{i}", "text": t}) + b"\n" for i, t in enumerate(texts)))
    return path, texts


def _minhash_run(out, path, executor, **minhash):
    cfg = small_config(
        out,
        [{"path": str(path), "domain": "web"}],
        dedup={"exact": {"enabled": False}, "minhash": {"enabled": True, "partitions": 3, **minhash}},
        filters={},
    )
    return curate(cfg, executor=executor, progress=False, log=lambda _: None)


def test_planted_near_duplicates_precision_and_recall(tmp_path, capsys):
    path, texts = _corpus(tmp_path)
    result = _minhash_run(tmp_path / "out", path, LocalExecutor())
    clusters = pq.read_table(tmp_path / "out" / "near_duplicates" / "clusters.parquet").to_pylist()
    cluster_of = {int(r["id"][3:]): r["cluster_id"] for r in clusters}
    truth = true_pairs(texts, MinHashConfig(), 0.8)
    precision, recall = precision_recall(cluster_pairs(cluster_of), truth)
    with capsys.disabled():
        print(f"\nplanted near-dups: {len(texts)} docs, {len(truth)} true pairs (J>=0.8), "
              f"precision {precision:.3f}, recall {recall:.3f}")
    assert len(truth) >= 20  # the planted set really has pairs on both sides of the threshold
    assert precision >= 0.9 and recall >= 0.9
    # every removed document names the document kept, which is in the shards
    kept_ids = {r["id"] for r in clusters if r["kept"]}
    dropped = [r for f in (tmp_path / "out" / "dropped").glob("*.parquet") for r in pq.read_table(f).to_pylist()]
    near = [d for d in dropped if d["reason"] == "near_duplicate"]
    assert len(near) == sum(1 for r in clusters if not r["kept"]) > 0
    assert all(d["kept_id"] in kept_ids and d["stage"] == "minhash" for d in near)
    summary = result.stats["global_stages"]["minhash"]
    assert summary["removed"] == len(near) and summary["clusters"] == len({r["cluster_id"] for r in clusters})


def test_keep_longest_keeps_the_longest_member(tmp_path):
    base = max((orjson.loads(l)["text"] for l in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()), key=len)
    texts = [base, base + " one more sentence at the end.", base[: len(base) - 40]]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"d{i}", "text": t}) + b"\n" for i, t in enumerate(texts)))
    _minhash_run(tmp_path / "out", path, LocalExecutor(), keep="longest")
    rows = pq.read_table(tmp_path / "out" / "near_duplicates" / "clusters.parquet").to_pylist()
    assert {r["id"]: r["kept"] for r in rows} == {"d0": False, "d1": True, "d2": False}
    assert {r["cluster_id"] for r in rows} == {"d0"}


def test_same_result_in_one_process_and_on_ray(tmp_path, ray_local):
    path, _ = _corpus(tmp_path)
    _minhash_run(tmp_path / "local", path, LocalExecutor())
    _minhash_run(tmp_path / "ray", path, RayExecutor(progress=False))
    assert read_manifest(tmp_path / "ray") == read_manifest(tmp_path / "local")
    a = pq.read_table(tmp_path / "local" / "near_duplicates" / "clusters.parquet")
    b = pq.read_table(tmp_path / "ray" / "near_duplicates" / "clusters.parquet")
    assert a.equals(b)
