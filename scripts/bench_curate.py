"""Benchmark the curation pipeline on the shared corpus; prints one JSON object.

usage: python -m scripts.bench_curate [--corpus ../shared/data/corpus.jsonl.gz] [--docs N] [--workers 1,2]
       python -m scripts.bench_curate --quickstart [--corpus ...] [--workers 1,2] [--repeats R] [--set KEY=VALUE ...]

--quickstart: what a user does first, `datapipe curate configs/quickstart.yaml --input CORPUS` (the shipped
recipe, its `auto` blocks and shards), once per worker count (`--set ray.num_cpus=N`), each in a fresh
process: wall seconds, CPU seconds of the whole process tree (the CLI, Ray's daemons and workers: read from
/proc every 0.1 s, so a process's last <0.1 s can be missed), stats.json's `seconds` and `phase_seconds`
(work/ clean-up included), shard count, and whether the shards are identical across worker counts. For each
worker count after the first: the speedup, the bound the run's CPU sets on it (first wall / (CPU / workers)) and
the machine's ceiling (the quality filters run by that many processes at once against one after the other).
With `--repeats R` the worker counts run R times, interleaved; each count's fastest run is the one reported.

Reports, in one run on the same documents:
- per stage: documents/s and MB/s, each stage timed alone in this process on the same batches;
- the whole pipeline on an embedded Ray with 1 and with 2 workers (wall time and the scaling ratio);
- tokenize-and-write (the pipeline's tokenize + shard phases, 2 workers) against the raw
  `Tokenizer.encode_batch` on the same texts with the same tokenizer (the ratio to that limit).
Absolute seconds depend on the machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import orjson
import yaml
import pyarrow as pa

from scripts.corpus import curate_in_fresh_process, load_docs, run_measured

from datapipe.curation.config import CurateConfig
from datapipe.core.config import from_dict
from datapipe.core.schema import DOC_SCHEMA
from datapipe.curation.blocks import block_documents
from stages.base import FilterStage
from stages.exact_dedup import ExactDedupConfig, ExactDedupStage
from stages.normalize import NormalizeConfig, NormalizeStage
from stages.quality import build_filters
from stages.tokenize import TokenizeStage, TokenizerConfig

# The quickstart recipe's filters: the same per-domain settings a user starts from.
FILTERS = yaml.safe_load((Path(__file__).parents[1] / "configs" / "quickstart.yaml").read_text())["filters"]


def stage_throughput(docs: list[dict], tokenizer_json: str) -> dict[str, dict]:
    batches = []
    for i in range(0, len(docs), 2000):
        rows = [{**d, "order": i + k} for k, d in enumerate(docs[i : i + 2000])]
        batches.append(pa.RecordBatch.from_pylist(rows, schema=DOC_SCHEMA))
    n_bytes = sum(len(d["text"].encode()) for d in docs)
    per_domain, default = build_filters(FILTERS)
    dedup = ExactDedupStage(ExactDedupConfig())
    stages = {
        "normalize": NormalizeStage(NormalizeConfig()),
        "exact_dedup_hash": lambda b: dedup.keys(b),
        "filters": FilterStage(per_domain, default),
        "tokenize": TokenizeStage(tokenizer_json, TokenizerConfig()),
    }
    out = {}
    for name, stage in stages.items():
        t0 = time.perf_counter()
        for b in batches:
            stage(b)
        dt = time.perf_counter() - t0
        out[name] = {"seconds": round(dt, 3), "docs_per_s": round(len(docs) / dt, 1), "MB_per_s": round(n_bytes / dt / 1e6, 2)}
    return out


def run_pipeline(jsonl: Path, out: Path, workers: int, tokenizer: Path | None) -> dict:
    cfg = {
        "inputs": [{"path": str(jsonl), "domain_field": "domain"}],
        "read": {"block_bytes": 4 * 2**20},
        "filters": FILTERS,
        "tokenizer": {"path": str(tokenizer)} if tokenizer else {"train": {"vocab_size": 8192, "sample_bytes": 8_000_000}},
        "output": {"dir": str(out), "shard_bytes": 32 * 2**20, "keep_work": True},
        "ray": {"num_cpus": workers},
    }
    return curate_in_fresh_process(cfg)[0]


def raw_encode_seconds(tokenizer_json: str, texts: list[str]) -> float:
    """The limit: `encode_batch` alone on the same texts (tokenizers' own thread pool, all cores)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    t0 = time.perf_counter()
    for i in range(0, len(texts), 512):
        tok.encode_batch(texts[i : i + 512], add_special_tokens=False)
    return time.perf_counter() - t0


def kept_texts(out: Path) -> list[str]:
    """The documents that reached the tokenizer in a run kept with `output.keep_work`."""
    folders = sorted(p for p in (out / "work").glob("seg*") if p.is_dir())
    texts = []
    for f in sorted(folders[-1].glob("*.arrow")):
        texts += block_documents(out / "work", folders[-1].name, f.stem, ["text"]).column("text").to_pylist()
    return texts


def quickstart_run(corpus: Path, out: Path, workers: int, overrides: list[str]) -> dict:
    """`datapipe curate configs/quickstart.yaml --input CORPUS` with `workers` CPUs, in a fresh process tree."""
    import sys

    repo = Path(__file__).parents[1]
    cmd = [sys.executable, "-m", "datapipe.cli", "curate", str(repo / "configs" / "quickstart.yaml"),
           "--input", str(corpus), "--output", str(out), "--set", f"ray.num_cpus={workers}", "--no-progress",
           # the shared corpus names each record's domain in `source` (code, license, man): without this every
           # document lands in `default` and none of the recipe's per-domain filters runs
           "--set", "inputs.0.domain_field=source"]
    cmd += [arg for o in overrides for arg in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": str(repo)}  # this checkout's code, in the CLI and in every Ray worker
    returncode, err, wall, cpu = run_measured(cmd, repo, env)
    if returncode != 0:
        raise RuntimeError(f"curate failed:\n{err.decode()[-4000:]}")
    stats = json.loads((out / "stats.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    run = json.loads((out / "run.json").read_text())
    return {
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "stats_seconds": stats["seconds"],
        "phase_seconds_sum": round(sum(stats["phase_seconds"].values()), 1),
        "phase_seconds": stats["phase_seconds"],
        "block_bytes": run["work_layout"]["read.block_bytes"],
        "shards": manifest["num_shards"],
        "docs": manifest["total_docs"],
        "tokens": manifest["total_tokens"],
        "sha256": [s["sha256"] for s in manifest["shards"]],
        "load_before": os.getloadavg()[0],
    }


_KERNEL: tuple = ()


def _kernel_setup(corpus: str, docs: int) -> None:
    """The pipeline's heaviest stage (the recipe's quality filters) on the corpus's first `docs` documents."""
    global _KERNEL
    rows = [{**d, "order": i} for i, d in enumerate(load_docs(Path(corpus), docs))]
    _KERNEL = (pa.RecordBatch.from_pylist(rows, schema=DOC_SCHEMA), FilterStage(*build_filters(FILTERS)))


def _kernel(_: int) -> float:
    batch, stage = _KERNEL
    t = time.perf_counter()
    stage(batch)
    return time.perf_counter() - t


def machine_ceiling(corpus: Path, workers: int, docs: int = 3000, repeats: int = 3) -> dict:
    """What this machine gives `workers` processes running the same CPU work at once, against running it one after
    another: the quality filters on `docs` documents (memory traffic and all), once per repeat. Cloud vCPUs that
    share caches, memory bandwidth or a host give less than `workers`, and a pipeline of such work no more."""
    import multiprocessing

    ratios = []
    with multiprocessing.get_context("fork").Pool(workers, _kernel_setup, (str(corpus), docs)) as pool:
        for _ in range(2):  # every process warm (lazy set-up, caches) before timing
            pool.map(_kernel, range(workers), chunksize=1)
        for _ in range(repeats):
            alone = sum(pool.apply(_kernel, (0,)) for _ in range(workers))
            t = time.perf_counter()
            pool.map(_kernel, range(workers), chunksize=1)
            ratios.append(round(alone / (time.perf_counter() - t), 3))
    return {"kernel": f"quality filters on {docs} documents", "speedups": ratios}


def quickstart(corpus: Path, workers: list[int], overrides: list[str], repeats: int = 1) -> dict:
    """Each worker count `repeats` times, interleaved (1, 2, 1, 2, ...) so that a drift of the machine's speed
    touches every count alike; each count's fastest run is reported (with every run's wall), and the ratios
    are of the fastest runs."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-quickstart-"))
    try:
        runs: dict[int, dict] = {}
        walls: dict[int, list[float]] = {w: [] for w in workers}
        hashes = set()
        for repeat in range(repeats):
            for w in workers:
                load = os.getloadavg()
                run = quickstart_run(corpus.resolve(), tmp / f"w{w}-{repeat}", w, overrides)
                shutil.rmtree(tmp / f"w{w}-{repeat}", ignore_errors=True)
                run["load_avg_1min_before_after"] = [round(load[0], 2), round(os.getloadavg()[0], 2)]
                del run["load_before"]
                hashes.add(tuple(run.pop("sha256")))
                walls[w].append(run["wall_seconds"])
                if w not in runs or run["wall_seconds"] < runs[w]["wall_seconds"]:
                    runs[w] = run
        for w, r in runs.items():
            r["wall_seconds_of_every_run"] = walls[w]
            # what no number of workers shortens: Ray's start (the read runs in it) and its shutdown
            r["ray_start_and_shutdown_seconds"] = round(r["phase_seconds"]["start"] + r["phase_seconds"]["shutdown"], 2)
        first = min(runs)
        for w, r in runs.items():
            if w != first:
                r["speedup"] = round(runs[first]["wall_seconds"] / r["wall_seconds"], 3)
                # With w cores the wall time is at least the tree's CPU seconds / w: the speedup that even a
                # perfect spread of this run's CPU work over its cores could not pass.
                r["speedup_bound_from_cpu"] = round(runs[first]["wall_seconds"] / (r["cpu_seconds"] / w), 3)
                if first == 1:  # w processes at once against one
                    r["machine_ceiling"] = machine_ceiling(corpus, w)
        extra = "".join(f" --set {o}" for o in overrides)
        return {"command": f"datapipe curate configs/quickstart.yaml --input {corpus} --set inputs.0.domain_field=source --set ray.num_cpus=N{extra}",
                "cpus": os.cpu_count(), "repeats": repeats, "runs": {f"{w}_workers": r for w, r in runs.items()},
                "identical_shards": len(hashes) == 1}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    p.add_argument("--docs", type=int, default=None, help="use the first N documents (default: all)")
    p.add_argument("--workers", default="1,2")
    p.add_argument("--quickstart", action="store_true", help="time the shipped quickstart recipe on the corpus (see above)")
    p.add_argument("--repeats", type=int, default=1, help="with --quickstart: runs per worker count, interleaved (the fastest counts)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="with --quickstart: a config override, e.g. read.block_bytes=16384 (the former recipe's)")
    args = p.parse_args()
    if args.quickstart:
        print(json.dumps(quickstart(Path(args.corpus), [int(w) for w in args.workers.split(",")], args.overrides, args.repeats),
                         indent=1))
        return

    docs = load_docs(Path(args.corpus), args.docs)
    tmp = Path(tempfile.mkdtemp(prefix="bench-curate-"))
    try:
        jsonl = tmp / "input.jsonl"
        jsonl.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
        results: dict = {"docs": len(docs), "MB": round(jsonl.stat().st_size / 1e6, 1), "cpus": os.cpu_count()}
        # Train the tokenizer once (first run), then every run loads it: runs differ only in workers.
        first = run_pipeline(jsonl, tmp / "first", max(int(w) for w in args.workers.split(",")), None)
        tokenizer = tmp / "first" / "tokenizer.json"
        runs = {}
        for w in [int(x) for x in args.workers.split(",")]:
            runs[w] = run_pipeline(jsonl, tmp / f"w{w}", w, tokenizer)
        results["pipeline"] = {f"{w}_workers": {"seconds": round(r["seconds"], 2), "docs_written": r["docs"],
                                                "tokens": r["tokens"], "phase_seconds": r["phases"]}
                               for w, r in runs.items()}
        ws = sorted(runs)
        if len(ws) > 1:
            results["pipeline"]["scaling_ratio"] = round(runs[ws[0]]["seconds"] / runs[ws[-1]]["seconds"], 2)
            results["pipeline"]["identical_shards"] = len({tuple(r["sha256"]) for r in runs.values()}) == 1
        # Tokenize-and-write (tokenize + shards phases, most workers) vs raw encode_batch on the same texts.
        w = ws[-1]
        texts = kept_texts(tmp / f"w{w}")
        n_bytes = sum(len(t.encode()) for t in texts)
        raw = raw_encode_seconds(tokenizer.read_text(), texts)
        pipe = runs[w]["phases"]["tokenize"] + runs[w]["phases"]["shards"]
        results["tokenize_and_write"] = {
            "docs": len(texts),
            "MB": round(n_bytes / 1e6, 1),
            "raw_encode_batch_MB_per_s": round(n_bytes / raw / 1e6, 2),
            f"pipeline_{w}_workers_MB_per_s": round(n_bytes / pipe / 1e6, 2),
            "ratio_to_raw": round(raw / pipe, 3),
        }
        results["stages_single_process"] = stage_throughput(docs, tokenizer.read_text())
        del first
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
