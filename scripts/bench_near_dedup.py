"""Benchmark near-dedup (MinHash-LSH): quality against brute force, and speed; prints one JSON object.

usage: python -m scripts.bench_near_dedup [--corpus ../shared/data/corpus.jsonl.gz]
           [--datatrove-python /tmp/dt-venv/bin/python] [--baseline-tree DIR] [--rounds 3]

datatrove runs in a virtual environment of its own (it is not a dependency of datapipe):
    python -m venv /tmp/dt-venv && /tmp/dt-venv/bin/pip install datatrove spacy tokenizers orjson regex "xxhash<4"
(datatrove 0.10.1 hashes `str` shingles, which xxhash 4 refuses; spacy is its English word tokenizer.)

**Quality**, on a set built from the corpus: ORIGINALS documents (man pages and code of 300-2,000
words, seeded choice), each with two planted copies edited to an exact Jaccard level in 0.70-0.95
(line insertions, word swaps, a boilerplate header or truncation: `datapipe.testing.synthetic.plant`),
plus every license text (natural near-duplicates), shuffled. The truth is brute-force exact Jaccard of
the word 5-gram sets >= 0.8 over all pairs, clustered by connected components. For each method:
precision and recall of the pairs it puts in one cluster (against the pairs of one true cluster), of
the documents it removes (keeping the first document of each cluster, for every method alike), and
the share of planted pairs put together, by level. Methods, at threshold 0.8 on word 5-grams:
- datapipe, the default `dedup.minhash` (`hash: vector`); beside it `hash: xxh3` (the same words,
  each hashed by xxh3 in Python), `candidate_recall` 0.9 and 0.999, no exact check
  (`exact_margin: 0`) and `bucket_window: 1`; and with `--baseline-tree` that tree's default
  (the previous commit's: 9 x 13 bands, star edges verified by the estimate alone);
- datasketch `MinHashLSH` (128 permutations; every document inserted, then queried; components of the
  candidate pairs, as datasketch leaves them unverified);
- datatrove's MinHash (14 x 8, its own text normalisation and tokenizer; signatures, buckets,
  clusters), run with `--datatrove-python` (a separate virtual environment with datatrove and spacy).

**Speed**: the near-dedup stage alone (the map half over 8 MB blocks of 2,000-document batches, the
resolve, the drops) on the whole corpus, one fresh process per run. CPU seconds are user + system of
the whole process (`RUSAGE_CHILDREN`, the tree: nothing here starts further processes), and of the
stage itself (`process_time` around it): CPU seconds, not wall time, so that other jobs on the
machine slow the runs little (the load average before and after is reported). MB are the corpus's
UTF-8 text. A first, untimed run of this tree's stage over 500 documents compiles the loops of
`stages/minhash_kernels.py` where the checkout has not yet cached them (once per installation; its process
CPU is reported as `warm_up`). The runs alternate, A B C E [D] then again, `--rounds` times:
- A datasketch at its best: `MinHash(128).update_batch(shingles)` (SHA-1, its default hash) and
  `MinHashLSH` query-then-insert;
- B datapipe with `hash: sha1` (the same shingles, the same hash: like for like);
- C datapipe's default (`hash: vector`);
- E datapipe with `hash: xxh3` (the previous default: the same words, hashed one by one in Python);
- D (with `--baseline-tree`) C's config on another source tree, e.g. the previous commit's:
  `git archive <commit> | tar -x -C /tmp/datapipe-old`. Its default config is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from scripts.corpus import load_docs
from datapipe.testing.synthetic import EDITS, components, plant, removed_by_components, true_pairs
from stages.minhash import MinHashConfig

THRESHOLD = 0.8
ORIGINALS = 300
LEVELS = (0.70, 0.75, 0.78, 0.80, 0.82, 0.85, 0.90, 0.95)
# datapipe settings measured beside the default on the quality set: the trade-off `dedup.minhash` exposes
TRADE_OFFS = [("hash", "xxh3"), ("candidate_recall", 0.9), ("candidate_recall", 0.999), ("exact_margin", 0.0), ("bucket_window", 1)]
REPO = Path(__file__).resolve().parent.parent
WARM_UP_DOCS = 500  # the untimed first run of this tree's stage: it compiles the kernels a fresh checkout lacks

# The near-dedup stage on its own, in a fresh process: argv = tree, input jsonl, work folder, config json.
# Works with this tree's GlobalStage API and with the previous one (MinHashStage + near_dedup.resolve).
_STAGE = r"""
import inspect, json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np, orjson, pyarrow as pa, pyarrow.compute as pc
from pathlib import Path
from datapipe.core.config import from_dict
from datapipe.core.schema import DOC_SCHEMA
from datapipe.core.shards import atomic_write_table, read_table
try:  # work tables carry a check trailer since the work files are verified on read
    from datapipe.core.workfiles import read_work_table as read_table, write_work_table as atomic_write_table
except ImportError:  # an older checkout (the baseline of a side-by-side run)
    pass
from datapipe.curation.executors import LocalExecutor
from stages.minhash import MinHashConfig, MinHashStage
try:  # a read block keeps each text as its own frame, read by range in the exact check
    from datapipe.curation.blocks import block_documents, write_read_block
except ImportError:  # an older checkout (the baseline of a side-by-side run)
    write_read_block = None
try:
    import datapipe.curation.phases.near_dedup as nd
except ImportError:  # an older checkout (the baseline of a side-by-side run)
    import datapipe.curation.near_dedup as nd
docs = [orjson.loads(line) for line in open(sys.argv[2], "rb")]
work, config = Path(sys.argv[3]), from_dict(MinHashConfig, json.loads(sys.argv[4]))
table = pa.table({"id": [d["id"] for d in docs], "domain": [d["domain"] for d in docs],
                  "text": pa.array([d["text"] for d in docs], pa.large_string()),
                  "order": np.arange(len(docs), dtype=np.int64), "lang": pa.nulls(len(docs), pa.string()),
                  "lang_score": pa.nulls(len(docs), pa.float32())}, schema=DOC_SCHEMA)
del docs
sizes = pc.binary_length(table.column("text")).to_numpy()
cuts = np.searchsorted(np.cumsum(sizes), np.arange(8 << 20, int(sizes.sum()) + (8 << 20), 8 << 20), side="right")
t0 = time.process_time()
stage = nd.NearDedupStage(config) if hasattr(nd, "NearDedupStage") else MinHashStage(config)
folder = work / "minhash"
start = 0
import stages.base as stage_base
# the map half: this tree's near dedup sends its kinds itself; an older tree's stages.base wrote them
try:
    from datapipe.curation.map_stages import by_kind, send_kinds
    write_keys = lambda stage, table, folder, sender: send_kinds(stage.keys, by_kind(stage, folder), table, sender)  # noqa: E731
except ImportError:  # an older checkout (the baseline of a side-by-side run)
    write_keys = getattr(nd, "send_kinds", None) or getattr(stage_base, "write_keys", None)
senders, largest = [], {}
for b, end in enumerate(list(np.unique(np.r_[cuts, len(sizes)]))):
    block = table.slice(start, int(end) - start); start = int(end)
    if block.num_rows == 0:
        continue
    if write_read_block is not None:  # a read block (a frame per text) and keys that locate each text in it
        write_read_block(work, f"b{b:05d}", block, "zstd")
        sizes = write_keys(stage, block_documents(work, "read", f"b{b:05d}", locate=True), folder, f"b{b:05d}")
        largest = {k: max(largest.get(k, 0), v) for k, v in (sizes or {}).items()}  # what the exchanges are sized by
        senders.append(f"read/b{b:05d}")
        continue
    if write_keys is not None:  # one shuffle file per kind and block; the block's text stays where it is
        atomic_write_table(work / "seg" / f"b{b:05d}.arrow", block)
        write_keys(stage, block, folder, f"b{b:05d}")
        senders.append(f"seg/b{b:05d}")
        continue
    emitted = [stage.keys(batch) for batch in block.to_batches(max_chunksize=2000)]
    for kind in emitted[0]:
        keys = pa.concat_tables([e[kind] for e in emitted])
        parts = keys.column("partition").to_numpy()
        unique = np.unique(parts)
        for p in unique:  # as the runner writes a global stage's keys
            atomic_write_table(folder / kind / f"p{p:03d}" / f"b{b:05d}.arrow", keys if len(unique) == 1 else keys.filter(pa.array(parts == p)))
map_cpu = time.process_time() - t0
phases = {}
def run_tasks(fn, shared, items, desc, _local=LocalExecutor(), **_):  # CPU per resolve step ("minhash components round 3"
    t = time.process_time()  # -> "minhash components"); a fresh folder each run: records (record=) are not needed
    out = _local.run_tasks(fn, shared, items, desc)
    step = desc.split(" r")[0]
    phases[step] = phases.get(step, 0.0) + time.process_time() - t
    return out
if senders and "largest" in inspect.signature(stage.resolve).parameters:  # and its exchanges by the measured files
    summary = stage.resolve(run_tasks, folder, work, senders, table.num_rows, largest)
elif senders and "documents" in inspect.signature(stage.resolve).parameters:  # the resolve sizes its tasks by them
    summary = stage.resolve(run_tasks, folder, work, senders, table.num_rows)
elif senders:
    summary = stage.resolve(run_tasks, folder, work, senders)
else:
    summary = stage.resolve(run_tasks, folder, work) if hasattr(stage, "resolve") else nd.resolve(run_tasks, folder, stage, work)
losers = pa.concat_tables([read_table(f) for f in sorted(folder.glob("losers-[pt]*.arrow"))])
kept = table.filter(pc.invert(pc.is_in(table.column("order"), value_set=losers.column("order"))))
stage_cpu = time.process_time() - t0
clusters = {r["id"]: r["cluster_id"] for r in __import__("pyarrow.parquet").parquet.read_table(work / "near_duplicates" / "clusters").to_pylist()}
phases = {"map": map_cpu, **phases}
print(json.dumps({"stage_cpu_seconds": stage_cpu, "phase_cpu_seconds": phases, "summary": summary, "kept": kept.num_rows, "clusters": clusters}))
"""

# datasketch at its best, in a fresh process: argv = tree, input jsonl, mode (stream | components).
_DATASKETCH = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import orjson
from datasketch import MinHash, MinHashLSH
from stages.minhash import MinHashConfig, shingles
docs = [orjson.loads(line) for line in open(sys.argv[2], "rb")]
cfg = MinHashConfig(threshold=0.8, num_perm=128, ngram=5)
t0 = time.process_time()
lsh = MinHashLSH(threshold=0.8, num_perm=128)
removed, pairs = 0, []
if sys.argv[3] == "stream":  # query-then-insert: what a one-pass dedup loop does
    for i, d in enumerate(docs):
        m = MinHash(num_perm=128)
        m.update_batch(shingles(d["text"], cfg))
        if lsh.query(m):
            removed += 1
        else:
            lsh.insert(i, m)
else:  # insert all, then query each: every candidate pair
    sigs = []
    for i, d in enumerate(docs):
        m = MinHash(num_perm=128)
        m.update_batch(shingles(d["text"], cfg))
        lsh.insert(i, m)
        sigs.append(m)
    pairs = sorted({(min(i, j), max(i, j)) for i, m in enumerate(sigs) for j in lsh.query(m) if j != i})
print(json.dumps({"stage_cpu_seconds": time.process_time() - t0, "removed": removed, "pairs": pairs}))
"""

# datatrove's MinHash pipeline, with its own interpreter: argv = input jsonl, work folder.
_DATATROVE = r"""
import json, struct, sys, time
from pathlib import Path
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.dedup import MinhashDedupSignature, MinhashDedupBuckets, MinhashDedupCluster
from datatrove.pipeline.dedup.minhash import MinhashConfig
inp, work = sys.argv[1], Path(sys.argv[2])
cfg = MinhashConfig()  # 5-grams, 14 buckets x 8 hashes, 64-bit xxhash
t0 = time.process_time()
LocalPipelineExecutor(pipeline=[JsonlReader(str(Path(inp).parent), glob_pattern=Path(inp).name),
                                MinhashDedupSignature(output_folder=str(work / "sigs"), config=cfg)],
                      tasks=1, logging_dir=str(work / "logs1"), skip_completed=False).run()
LocalPipelineExecutor(pipeline=[MinhashDedupBuckets(input_folder=str(work / "sigs"), output_folder=str(work / "buckets"), config=cfg)],
                      tasks=cfg.num_buckets, workers=1, logging_dir=str(work / "logs2"), skip_completed=False).run()
LocalPipelineExecutor(pipeline=[MinhashDedupCluster(input_folder=str(work / "buckets"), output_folder=str(work / "out"), config=cfg, save_cluster_id=True)],
                      tasks=1, logging_dir=str(work / "logs3"), skip_completed=False).run()
raw = (work / "out" / "000000.clusters").read_bytes() if (work / "out" / "000000.clusters").exists() else b""
pairs = struct.unpack(f"<{len(raw) // 4}I", raw)
print(json.dumps({"seconds": time.process_time() - t0, "cluster_of": dict(zip(map(str, pairs[0::2]), pairs[1::2]))}))
"""


def _run(args: list[str]) -> tuple[dict[str, Any], float]:
    """Run a fresh process in a neutral folder (the repository's `tokenizers/` folder would shadow
    the package of that name); (its last stdout line as JSON, CPU seconds of it and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(args, capture_output=True, text=True, cwd=tempfile.gettempdir())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{args[:2]} failed:\n{proc.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(proc.stdout.strip().splitlines()[-1]), cpu


def run_datapipe(tree: Path, jsonl: Path, work: Path, config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    return _run([sys.executable, "-c", _STAGE, str(tree), str(jsonl), str(work), json.dumps(config)])


def run_datasketch(jsonl: Path, mode: str) -> tuple[dict[str, Any], float]:
    return _run([sys.executable, "-c", _DATASKETCH, str(REPO), str(jsonl), mode])


# ---------------------------------------------------------------- quality


def quality_set(docs: list[dict], seed: int = 0) -> tuple[list[dict], list[tuple[int, int, float, float, str]]]:
    """(documents, planted pairs as (original index, copy index, level, exact Jaccard, edit kind))."""
    rng = random.Random(seed)
    cfg = MinHashConfig()
    licenses = [d for d in docs if d["domain"] == "license"]
    pool = [d for d in docs if d["domain"] != "license" and 300 <= len(d["text"].split()) <= 2000]
    originals = rng.sample(pool, ORIGINALS)
    filler = [line for d in rng.sample(pool, 200) for line in d["text"].split("\n") if len(line.split()) >= 4]
    items: list[tuple[str, dict, tuple | None]] = []  # (key, doc, (original key, level, J, kind))
    for i, d in enumerate(originals):
        items.append((f"o{i}", d, None))
        for c, (level, kind) in enumerate([(LEVELS[i % 8], EDITS[i % 4]), (LEVELS[(3 * i + 5) % 8], EDITS[(i + 1 + i // 8) % 4])]):
            text, j = plant(d["text"], level, kind, rng, cfg, filler)
            items.append((f"o{i}c{c}", {"id": f"o{i}c{c}", "domain": d["domain"], "text": text}, (f"o{i}", level, j, kind)))
    items += [(f"l{i}", d, None) for i, d in enumerate(licenses)]
    rng.shuffle(items)
    index = {key: n for n, (key, _, _) in enumerate(items)}
    out = [{"id": str(n), "domain": d["domain"], "text": d["text"]} for n, (_, d, _) in enumerate(items)]
    planted = [(index[p[0]], index[key], p[1], p[2], p[3]) for key, _, p in items if p is not None]
    return out, planted


def _pairs_of(labels: list[int]) -> set[tuple[int, int]]:
    groups: dict[int, list[int]] = {}
    for doc, label in enumerate(labels):
        groups.setdefault(label, []).append(doc)
    return {(a, b) for members in groups.values() for i, a in enumerate(members) for b in members[i + 1 :]}


def _pr(found: set, truth: set) -> dict[str, float]:
    hit = len(found & truth)
    return {"precision": round(hit / len(found), 4) if found else 1.0, "recall": round(hit / len(truth), 4) if truth else 1.0}


def score(labels: list[int], truth_labels: list[int], planted: list[tuple], licenses: set[int]) -> dict[str, Any]:
    """Pair and removed-document precision/recall of a clustering, the same for the pairs of two
    license texts (natural near-duplicates), and planted pairs put together by level."""
    pairs, truth = _pairs_of(labels), _pairs_of(truth_labels)
    natural = {p for p in pairs if p[0] in licenses and p[1] in licenses}
    natural_truth = {p for p in truth if p[0] in licenses and p[1] in licenses}
    together: dict[str, list[int]] = {}
    for a, b, level, _j, _kind in planted:
        together.setdefault(f"{level:.2f}", [0, 0])
        together[f"{level:.2f}"][0] += labels[a] == labels[b]
        together[f"{level:.2f}"][1] += 1
    return {
        "pairs": _pr(pairs, truth),
        "license_pairs": _pr(natural, natural_truth),
        "removed_docs": {**_pr(removed_by_components(labels), removed_by_components(truth_labels)),
                         "removed": len(removed_by_components(labels))},
        "planted_together_by_level": {k: round(v[0] / v[1], 3) for k, v in sorted(together.items())},
    }


def _labels_from_ids(n: int, cluster_of: dict[str, Any]) -> list[int]:
    """Cluster labels (smallest member) from {document index as str: cluster key}."""
    first: dict[Any, int] = {}
    for doc in sorted(int(d) for d in cluster_of):
        first.setdefault(cluster_of[str(doc)], doc)
    return [first[cluster_of[str(i)]] if str(i) in cluster_of else i for i in range(n)]


def quality(docs: list[dict], tmp: Path, datatrove_python: str | None, baseline_tree: Path | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    qdocs, planted = quality_set(docs)
    build_seconds = time.perf_counter() - t0
    jsonl = tmp / "quality" / "docs.jsonl"
    jsonl.parent.mkdir(parents=True)
    jsonl.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in qdocs))
    texts = [d["text"] for d in qdocs]
    t0 = time.perf_counter()
    truth = true_pairs(texts, MinHashConfig(), THRESHOLD)
    truth_seconds = time.perf_counter() - t0
    truth_labels = components(len(texts), truth)
    result: dict[str, Any] = {
        "docs": len(qdocs),
        "planted_pairs": len(planted),
        "planted_levels": {f"{lv:.2f}": sum(1 for p in planted if p[2] == lv) for lv in LEVELS},
        "planted_exact_jaccard_range": [round(min(p[3] for p in planted), 4), round(max(p[3] for p in planted), 4)],
        "license_texts": sum(1 for d in qdocs if d["domain"] == "license"),
        "true_pairs": len(truth),
        "true_clusters": len({truth_labels[i] for pair in truth for i in pair}),
        "docs_in_true_clusters": len({i for pair in truth for i in pair}),
        "pairs_in_true_clusters": len(_pairs_of(truth_labels)),
        "build_seconds": round(build_seconds, 1),
        "brute_force_seconds": round(truth_seconds, 1),
    }
    methods: dict[str, Any] = {}
    licenses = {i for i, d in enumerate(qdocs) if d["domain"] == "license"}
    runs = [("datapipe", REPO, {})] + [(f"datapipe_{k}_{v}", REPO, {k: v}) for k, v in TRADE_OFFS]
    runs += [("baseline_tree_default", baseline_tree, {})] if baseline_tree else []
    for name, tree, config in runs:
        out, cpu = run_datapipe(tree, jsonl, tmp / "quality" / name, {"threshold": THRESHOLD, **config})
        methods[name] = {**score(_labels_from_ids(len(texts), out["clusters"]), truth_labels, planted, licenses),
                         "summary": out["summary"], "process_cpu_seconds": round(cpu, 1)}
    out, cpu = run_datasketch(jsonl, "components")
    labels = components(len(texts), [tuple(p) for p in out["pairs"]])
    methods["datasketch_lsh"] = {**score(labels, truth_labels, planted, licenses), "candidate_pairs": len(out["pairs"]),
                                 "process_cpu_seconds": round(cpu, 1)}
    if datatrove_python:
        out, cpu = _run([datatrove_python, "-c", _DATATROVE, str(jsonl), str(tmp / "quality" / "datatrove")])
        methods["datatrove"] = {**score(_labels_from_ids(len(texts), out["cluster_of"]), truth_labels, planted, licenses),
                                "process_cpu_seconds": round(cpu, 1)}
    else:
        methods["datatrove"] = "not run: give --datatrove-python (an interpreter with datatrove and spacy installed)"
    result["methods"] = methods
    return result


# ---------------------------------------------------------------- speed


def speed(docs: list[dict], tmp: Path, rounds: int, baseline_tree: Path | None) -> dict[str, Any]:
    jsonl = tmp / "speed" / "all.jsonl"
    jsonl.parent.mkdir(parents=True)
    jsonl.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
    megabytes = sum(len(d["text"].encode()) for d in docs) / 1e6
    # a checkout's first near dedup compiles its loops (numba caches them beside the module): once per
    # installation, not per run, so one run over a few documents first, its process CPU reported on its own
    warm = tmp / "speed" / "warm.jsonl"
    warm.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs[:WARM_UP_DOCS]))
    warm_up = {"docs": WARM_UP_DOCS, "process_cpu_seconds": round(run_datapipe(REPO, warm, tmp / "speed" / "warm", {"enabled": True})[1], 2)}
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in range(rounds):
        plan: list[tuple[str, Any]] = [
            ("A_datasketch_sha1_update_batch", lambda: run_datasketch(jsonl, "stream")),
            ("B_datapipe_sha1", lambda: run_datapipe(REPO, jsonl, tmp / "speed" / f"b{r}", {"enabled": True, "hash": "sha1"})),
            ("C_datapipe_default", lambda: run_datapipe(REPO, jsonl, tmp / "speed" / f"c{r}", {"enabled": True})),
            ("E_datapipe_xxh3", lambda: run_datapipe(REPO, jsonl, tmp / "speed" / f"e{r}", {"enabled": True, "hash": "xxh3"})),
        ]
        if baseline_tree is not None:
            plan.append(("D_baseline_tree_default", lambda: run_datapipe(baseline_tree, jsonl, tmp / "speed" / f"d{r}", {"enabled": True})))
        for name, fn in plan:
            out, cpu = fn()
            phases = {k: round(v, 2) for k, v in out.get("phase_cpu_seconds", {}).items()}
            runs.setdefault(name, []).append({"process_cpu_seconds": round(cpu, 2),
                                              "stage_cpu_seconds": round(out["stage_cpu_seconds"], 2),
                                              **({"phase_cpu_seconds": phases} if phases else {}),
                                              "removed": out.get("removed", len(docs) - out.get("kept", len(docs)))})
    table = {}
    for name, rs in runs.items():
        cpu = [x["process_cpu_seconds"] for x in rs]
        stage = [x["stage_cpu_seconds"] for x in rs]
        table[name] = {"runs": rs, "process_cpu_mean": round(sum(cpu) / len(cpu), 2), "process_cpu_spread": [min(cpu), max(cpu)],
                       "stage_cpu_mean": round(sum(stage) / len(stage), 2), "stage_cpu_spread": [min(stage), max(stage)],
                       "docs_per_stage_cpu_second": round(len(docs) / (sum(stage) / len(stage)), 1),
                       "mb_per_stage_cpu_second": round(megabytes / (sum(stage) / len(stage)), 2)}
    a, b, c = (table[k]["stage_cpu_mean"] for k in ("A_datasketch_sha1_update_batch", "B_datapipe_sha1", "C_datapipe_default"))
    ratios = {"like_for_like_sha1_vs_datasketch": round(a / b, 2), "default_vs_datasketch": round(a / c, 2)}
    pa_, pb, pc_ = (table[k]["process_cpu_mean"] for k in ("A_datasketch_sha1_update_batch", "B_datapipe_sha1", "C_datapipe_default"))
    ratios.update({"like_for_like_process_cpu": round(pa_ / pb, 2), "default_process_cpu": round(pa_ / pc_, 2)})
    e = table["E_datapipe_xxh3"]["stage_cpu_mean"]
    ratios.update({"xxh3_vs_datasketch": round(a / e, 2), "default_vs_xxh3": round(e / c, 2)})
    if baseline_tree is not None:
        d = table["D_baseline_tree_default"]["stage_cpu_mean"]
        ratios["default_throughput_vs_baseline_tree"] = round(d / c, 2)
    return {"docs": len(docs), "megabytes": round(megabytes, 1), "rounds": rounds, "order": "A B C E [D] per round", "warm_up": warm_up,
            "load_average_before_after": [round(x, 2) for x in load_before + os.getloadavg()], "runs": table, "ratios": ratios}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    p.add_argument("--datatrove-python", default=None, help="an interpreter with datatrove and spacy installed")
    p.add_argument("--baseline-tree", type=Path, default=None, help="another source tree to time the default stage of")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip", choices=["quality", "speed"], default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    docs = load_docs(args.corpus)
    from importlib.metadata import version  # a baseline's speed moves with its release (and ours with numpy's)

    results: dict[str, Any] = {"corpus_docs": len(docs), "cpus": os.cpu_count(),
                               "versions": {name: version(name) for name in ("datasketch", "numpy", "numba", "pyarrow")}}
    with tempfile.TemporaryDirectory(prefix="bench-near-") as t:
        tmp = Path(t)
        if args.skip != "quality":
            results["quality"] = quality(docs, tmp, args.datatrove_python, args.baseline_tree)
        if args.skip != "speed":
            results["speed"] = speed(docs, tmp, args.rounds, args.baseline_tree)
    results["wall_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
