"""Many small curate runs in one driver on one embedded Ray: what Ray costs a run's phases; prints one JSON object.

usage: python -m scripts.bench_ray_phases [--runs 12] [--pairs 2]

Each arm is a fresh process (its Ray's processes included in its CPU, sampled from /proc) that starts a local Ray
with 2 CPUs and curates the tests' corpus slice `--runs` times into fresh folders, every switch on (exact and near
dedup, the eval split, diversity, the mixture, selection: ~50 phases and ~120 tasks a run), as the suite's Ray tests
do hundreds of times. The arms, alternating `--pairs` times:

- `current`: the executor as it is (one Ray function for each task function);
- `per_phase`: a Ray function made for every phase, as the executor did before: Ray stores each in its cluster and
  every worker loads it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from scripts.corpus import run_measured

REPO = Path(__file__).resolve().parents[1]
SLICE = REPO / "tests" / "assets" / "corpus_slice.jsonl"


def _config(out: Path) -> dict:
    return {
        "inputs": [{"path": str(SLICE), "domain_field": "source"}],
        "read": {"block_bytes": 16384, "batch_size": 16},
        "dedup": {"exact": {"enabled": True, "partitions": 2}, "minhash": {"enabled": True, "partitions": 2}},
        "filters": {"code": {"code": {}}},
        "eval": {"enabled": True, "fraction": 0.2, "max_tokens_per_domain": 3000},
        "diversity": {"enabled": True, "domains": {"man": 0.5}, "clusters": 2},
        "mixture": {"enabled": True},
        "selection": {"method": "random", "keep_fraction": 0.8},
        "tokenizer": {"train": {"vocab_size": 400, "sample_bytes": 200_000}},
        "output": {"dir": str(out), "shard_bytes": 8192},
    }


def arm(name: str, runs: int) -> None:
    """One arm, in this process (measured from outside: its wall and its process tree's CPU)."""
    import ray

    from datapipe import curate
    from datapipe.core.config import from_dict
    from datapipe.curation import run_loop
    from datapipe.curation.config import CurateConfig
    from datapipe.curation.executors import RayExecutor, _ray_executor

    if name == "per_phase":
        _ray_executor._remote_function = lambda ray_module, fn: ray_module.remote(fn)
        run_loop._named_after = run_loop._named_after.__wrapped__
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as folder:
        for i in range(runs):
            cfg = from_dict(CurateConfig, _config(Path(folder) / str(i)))
            curate(cfg, executor=RayExecutor(progress=False), progress=False, log=lambda _: None)
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--arm", choices=["current", "per_phase"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        arm(args.arm, args.runs)
        return
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}
    rows: dict[str, list[dict]] = {"current": [], "per_phase": []}
    for _ in range(args.pairs):
        for name in ("per_phase", "current"):
            code, err, wall, cpu = run_measured(
                [sys.executable, "-m", "scripts.bench_ray_phases", "--arm", name, "--runs", str(args.runs)], REPO, env)
            if code != 0:
                raise SystemExit(f"the {name} arm failed:\n{err.decode()[-3000:]}")
            rows[name].append({"process_wall_s": round(wall, 2), "tree_cpu_s": round(cpu, 2)})
    summary = {name: {"median_tree_cpu_s": statistics.median(r["tree_cpu_s"] for r in rs),
                      "median_process_wall_s": statistics.median(r["process_wall_s"] for r in rs), "arms": rs}
               for name, rs in rows.items()}
    saved = summary["per_phase"]["median_tree_cpu_s"] - summary["current"]["median_tree_cpu_s"]
    print(json.dumps({"runs_per_arm": args.runs, "pairs": args.pairs, **summary,
                      "cpu_s_saved_per_run": round(saved / args.runs, 3)}, indent=1))


if __name__ == "__main__":
    main()
