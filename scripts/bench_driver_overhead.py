"""The driver's bookkeeping on a run of many tiny blocks; prints one JSON object.

usage: python -m scripts.bench_driver_overhead [--blocks 100000] [--block-bytes 512] [--workers 2] [--keep DIR]

A synthetic corpus (the scale benchmark's generator: ~185-byte documents, 5% exact and 10% near copies, 16 JSONL
files) cut into `--blocks` blocks by a tiny `read.block_bytes`, curated in this process (the driver) on an embedded
Ray with `--workers` CPUs: exact and near dedup (verification on), no filters, a trained 2,048-token tokenizer,
`auto` partitions and shards. Every `run_tasks` call of the executor is timed (wall, and this
process's CPU), so the driver's time splits into

- *in phases*: submitting tasks and waiting for them (Ray's per-task cost on the driver's side is in here);
- *bookkeeping*: everything else the driver does: planning, merging the tasks' counters, listings, stats and the
  manifest. The issue's bound: under 1% of the run. Ray's start and shutdown (a few seconds, whatever the run's
  size) are reported beside it, not in it.

The whole process tree's CPU (Ray's workers and daemons included) is sampled from /proc, as in
`scripts/bench_driver_memory.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any


from datapipe.core.config import from_dict
from datapipe.curation.config import CurateConfig
from datapipe.curation.executors import RayExecutor
from datapipe import curate
from scripts.bench_driver_memory import TreeSampler, write_corpus


class TimedRayExecutor(RayExecutor):
    """A RayExecutor that adds up the wall and driver-CPU seconds spent inside its phase calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls, self.tasks, self.wall, self.cpu = 0, 0, 0.0, 0.0
        self.by_phase: dict[str, list[float]] = {}

    def _timed(self, desc: str, items: Any, call: Any) -> Any:
        w, c = time.perf_counter(), time.process_time()
        try:
            return call()
        finally:
            dw, dc = time.perf_counter() - w, time.process_time() - c
            self.calls += 1
            self.tasks += len(items)
            self.wall += dw
            self.cpu += dc
            entry = self.by_phase.setdefault(desc.split(" round")[0], [0, 0.0, 0.0])
            entry[0] += len(items)
            entry[1] += dw
            entry[2] += dc

    def run_tasks(self, fn: Any, shared: Any, items: Any, desc: str, **kwargs: Any) -> list[Any]:
        return self._timed(desc, items, lambda: super(TimedRayExecutor, self).run_tasks(fn, shared, items, desc, **kwargs))



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=100_000, help="blocks to cut the corpus into (about)")
    p.add_argument("--block-bytes", type=int, default=512, help="read.block_bytes (tiny: many blocks)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--keep", default=None, help="folder for the corpus and output (default: a temporary one, deleted)")
    args = p.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-driver-overhead-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        docs = args.blocks * args.block_bytes // 185  # ~185 bytes of text a document
        corpus = write_corpus(root / "corpus", docs)
        out = root / "out"
        shutil.rmtree(out, ignore_errors=True)
        cfg = from_dict(CurateConfig, {
            "inputs": [{"path": str(root / "corpus" / "*.jsonl"), "domain": "web"}],
            "read": {"block_bytes": args.block_bytes},
            "dedup": {"exact": {"enabled": True}, "minhash": {"enabled": True}},
            "filters": {},
            "tokenizer": {"train": {"vocab_size": 2048, "sample_bytes": 2_000_000}},
            "ray": {"num_cpus": args.workers},
            "output": {"dir": str(out)},
        })
        with TreeSampler(os.getpid()) as sampler:
            w0, c0 = time.perf_counter(), time.process_time()
            executor = TimedRayExecutor(num_cpus=args.workers, progress=False)
            started, started_cpu = time.perf_counter() - w0, time.process_time() - c0
            result = curate(cfg, executor=executor, progress=False, log=lambda _: None)
            s0, sc0 = time.perf_counter(), time.process_time()
            executor.shutdown()
            stopped, stopped_cpu = time.perf_counter() - s0, time.process_time() - sc0
            wall, driver_cpu = time.perf_counter() - w0, time.process_time() - c0
        stats = result.stats
        # Ray's start and shutdown are a fixed cost of the session (seconds, whatever the blocks), not bookkeeping
        bookkeeping_wall = wall - executor.wall - started - stopped
        bookkeeping_cpu = driver_cpu - executor.cpu - started_cpu - stopped_cpu
        tree_cpu = sum(sampler.cpu.values())
        print(json.dumps({
            "corpus": corpus,
            "blocks": executor.by_phase.get("tokenize", [0])[0],  # one tokenize call per block
            "tasks": executor.tasks,
            "phase_calls": executor.calls,
            "wall_seconds": round(wall, 1),
            "ray_start_seconds": round(started, 1),
            "ray_shutdown_seconds": round(stopped, 1),
            "in_phases_wall_seconds": round(executor.wall, 1),
            "bookkeeping_wall_seconds": round(bookkeeping_wall, 2),
            "bookkeeping_share_of_wall": round(bookkeeping_wall / wall, 4),
            "driver_cpu_seconds": round(driver_cpu, 1),
            "driver_cpu_in_phases_seconds": round(executor.cpu, 1),
            "bookkeeping_cpu_seconds": round(bookkeeping_cpu, 2),
            "tree_cpu_seconds": round(tree_cpu, 1),
            "bookkeeping_share_of_tree_cpu": round(bookkeeping_cpu / max(tree_cpu, 1e-9), 4),
            "driver_share_of_tree_cpu": round(driver_cpu / max(tree_cpu, 1e-9), 4),
            "by_phase": {k: {"tasks": v[0], "wall": round(v[1], 2), "driver_cpu": round(v[2], 2)} for k, v in executor.by_phase.items()},
            "driver_peak_rss_mib": round(sampler.driver_peak / 2**20, 1),
            "phase_seconds": stats["phase_seconds"],
            "kept_docs": result.manifest["total_docs"],
        }, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
