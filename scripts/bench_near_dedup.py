"""Benchmark near-dedup (MinHash-LSH) on the shared corpus; prints one JSON object.

usage: python -m scripts.bench_near_dedup [--corpus ../shared/data/corpus.jsonl.gz] [--fractions 0.1,0.25,0.5,1]

Side by side, on the same documents:
- datapipe's whole near-dedup stage (signatures, bucket shuffle, connected components, keep rule,
  applying the drops) on an embedded Ray with 1 worker and with 2, against the loop most users write:
  datasketch `MinHash` + `MinHashLSH` query-then-insert per document in one process. Documents/s per
  core, and the ratio.
- how time and peak memory per worker grow from a fraction of the corpus to all of it;
- on the license texts (many natural near-duplicates): clusters found by datapipe vs connected
  components of brute-force exact Jaccard >= 0.8 on the same shingles, and pair precision/recall.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import orjson

from scripts.corpus import curate_in_fresh_process, load_docs
from datapipe.testing.synthetic import cluster_pairs, precision_recall, true_pairs
from stages.minhash import MinHashConfig, shingles

MINHASH = {"enabled": True, "threshold": 0.8, "num_perm": 128, "ngram": 5}


def datasketch_loop(docs: list[dict]) -> dict:
    from datasketch import MinHash, MinHashLSH

    cfg = MinHashConfig(**{k: v for k, v in MINHASH.items() if k != "enabled"}, hash="sha1")
    lsh = MinHashLSH(threshold=0.8, num_perm=128)
    removed = 0
    t0 = time.process_time()
    for d in docs:
        m = MinHash(num_perm=128)
        for s in shingles(d["text"], cfg):
            m.update(s)
        if lsh.query(m):
            removed += 1
        else:
            lsh.insert(d["id"], m)
    cpu = time.process_time() - t0
    return {"cpu_seconds": round(cpu, 2), "docs_per_s_per_core": round(len(docs) / cpu, 1), "removed": removed}


class PeakRSS:
    """Samples the resident memory of Ray worker processes (named `ray::...`) every 0.2 s."""

    def __init__(self) -> None:
        self.peak_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["ps", "-eo", "rss=,args="], capture_output=True, text=True).stdout
            for line in out.splitlines():
                rss, _, args = line.strip().partition(" ")
                if args.startswith("ray::") and "Agent" not in args:
                    self.peak_kb = max(self.peak_kb, int(rss))
            time.sleep(0.2)

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def datapipe_run(jsonl: Path, out: Path, workers: int) -> dict:
    cfg = {
        "inputs": [{"path": str(jsonl), "domain_field": "domain"}],
        "read": {"block_bytes": 4 * 2**20},
        "normalize": {"enabled": False},
        "dedup": {"exact": {"enabled": False}, "minhash": MINHASH},
        "tokenizer": {"train": {"vocab_size": 300, "sample_bytes": 100_000}},
        "output": {"dir": str(out), "keep_work": False},
        "ray": {"num_cpus": workers},
    }
    with PeakRSS() as mem:
        r, _ = curate_in_fresh_process(cfg)
    p = r["phases"]
    # the near-dedup stage: signatures + keys (seg0, which has no other stage here), the resolve
    # (edges, rounds, keep rule) and applying its drops (seg1)
    seconds = p["seg0"] + p["minhash_resolve"] + p["seg1"]
    return {"seconds": round(seconds, 2), "phases": p, "summary": r["global_stages"]["minhash"], "docs_kept": r["docs"],
            "peak_worker_rss_mb": round(mem.peak_kb / 1024, 1), "sha256": r["sha256"]}


def license_clusters(docs: list[dict], tmp: Path) -> dict:
    from datapipe.curate.executors import LocalExecutor
    from datapipe.curate.config import CurateConfig
    from datapipe.core.config import from_dict
    from datapipe.curate.runner import curate
    import pyarrow.parquet as pq

    lic = [d for d in docs if d["domain"] == "license"]
    path = tmp / "license.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": str(i), "text": d["text"]}) + b"\n" for i, d in enumerate(lic)))
    cfg = from_dict(CurateConfig, {
        "inputs": [{"path": str(path), "domain": "license"}],
        "normalize": {"enabled": False},
        "dedup": {"exact": {"enabled": False}, "minhash": MINHASH},
        "tokenizer": {"train": {"vocab_size": 300, "sample_bytes": 100_000}},
        "output": {"dir": str(tmp / "license-out")},
    })
    curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    rows = pq.read_table(tmp / "license-out" / "near_duplicates" / "clusters.parquet").to_pylist()
    found = {int(r["id"]): r["cluster_id"] for r in rows}
    mh = MinHashConfig(**{k: v for k, v in MINHASH.items() if k != "enabled"})
    t0 = time.perf_counter()
    truth = true_pairs([d["text"] for d in lic], mh, 0.8)
    brute_seconds = time.perf_counter() - t0
    # brute-force clusters: connected components of the true pairs
    parent = list(range(len(lic)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j in truth:
        parent[find(j)] = find(i)
    brute_clusters = {find(i) for pair in truth for i in pair}
    precision, recall = precision_recall(cluster_pairs(found), truth)
    return {
        "docs": len(lic),
        "datapipe_clusters": len(set(found.values())),
        "datapipe_docs_in_clusters": len(found),
        "brute_force_clusters": len(brute_clusters),
        "brute_force_docs_in_clusters": len({i for p in truth for i in p}),
        "true_pairs": len(truth),
        "pair_precision": round(precision, 4),
        "pair_recall": round(recall, 4),
        "brute_force_seconds": round(brute_seconds, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    p.add_argument("--fractions", default="0.1,0.25,0.5,1")
    args = p.parse_args()
    docs = load_docs(args.corpus)
    results: dict = {"docs": len(docs)}
    with tempfile.TemporaryDirectory(prefix="bench-near-") as t:
        tmp = Path(t)
        jsonl = tmp / "all.jsonl"
        jsonl.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
        baseline = datasketch_loop(docs)
        one = datapipe_run(jsonl, tmp / "w1", 1)
        two = datapipe_run(jsonl, tmp / "w2", 2)
        per_core = len(docs) / one["seconds"]
        results["whole_corpus"] = {
            "datasketch_loop_1_core": baseline,
            "datapipe_1_worker": {k: v for k, v in one.items() if k != "sha256"},
            "datapipe_2_workers": {k: v for k, v in two.items() if k != "sha256"},
            "datapipe_docs_per_s_per_core": round(per_core, 1),
            "speedup_per_core_vs_datasketch": round(per_core / baseline["docs_per_s_per_core"], 2),
            "same_shards_1_and_2_workers": one["sha256"] == two["sha256"],
        }
        growth = []
        for frac in [float(x) for x in args.fractions.split(",")]:
            part = tmp / f"part-{frac}.jsonl"
            part.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs[: int(len(docs) * frac)]))
            r = datapipe_run(part, tmp / f"frac-{frac}", 1)
            growth.append({"fraction": frac, "docs": int(len(docs) * frac), "seconds": r["seconds"],
                           "peak_worker_rss_mb": r["peak_worker_rss_mb"]})
        results["growth_1_worker"] = growth
        results["license_texts"] = license_clusters(docs, tmp)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
