"""The whole quickstart recipe's process-tree CPU against datasketch's near dedup alone, same corpus, side by side;
prints one JSON object.

    python -m scripts.bench_pipeline_vs_datasketch [--corpus ../shared/data/corpus.jsonl.gz] [--docs N] [--rounds 2]
                                                   [--workers 2]

Each round runs, one after the other, each a fresh process tree:
- `datapipe curate configs/quickstart.yaml --input CORPUS --set inputs.0.domain_field=domain --set ray.num_cpus=N`:
  everything a user's first run does (read, normalize, exact and near dedup, the recipe's filters, the tokenizer's
  training, tokenize, the eval split, shards), Ray's daemons and workers included (`scripts.corpus.run_measured`:
  the tree's CPU read from /proc every 0.1 s);
- datasketch's near dedup alone, at its best (`scripts.bench_near_dedup`'s: `MinHash(128).update_batch` over the
  same word 5-gram shingles, `MinHashLSH` at 0.8, query then insert, one pass): the process's CPU, its imports and
  its reading of the corpus included, as the pipeline's are.
The ratio is the pipeline's CPU over datasketch's (goal ≤ 1); each figure is the median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import orjson

from scripts.bench_near_dedup import run_datasketch
from scripts.corpus import load_docs, run_measured

REPO = Path(__file__).resolve().parents[1]


def pipeline_cpu(jsonl: Path, out: Path, workers: int) -> tuple[float, float]:
    """(wall, process-tree CPU) of the quickstart recipe on `jsonl`, in a fresh process."""
    cmd = [sys.executable, "-m", "datapipe", "curate", str(REPO / "configs" / "quickstart.yaml"), "--input", str(jsonl),
           "--output", str(out), "--set", "inputs.0.domain_field=domain", "--set", f"ray.num_cpus={workers}"]
    code, err, wall, cpu = run_measured(cmd, cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": str(REPO)})
    if code != 0:
        raise SystemExit(f"datapipe curate failed:\n{err.decode()[-3000:]}")
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    parser.add_argument("--docs", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    docs = load_docs(args.corpus, args.docs)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    try:
        jsonl = tmp / "input.jsonl"
        jsonl.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
        pipeline, datasketch, walls = [], [], []
        for r in range(args.rounds):
            wall, cpu = pipeline_cpu(jsonl, tmp / f"out-{r}", args.workers)
            shutil.rmtree(tmp / f"out-{r}")
            pipeline.append(cpu)
            walls.append(wall)
            result, ds_cpu = run_datasketch(jsonl, "stream")
            datasketch.append(ds_cpu)
        print(json.dumps({
            "documents": len(docs), "text_MB": round(sum(len(d["text"].encode()) for d in docs) / 1e6, 1),
            "workers": args.workers, "load_average": [round(x, 2) for x in os.getloadavg()],
            "pipeline_tree_cpu_s": [round(x, 1) for x in pipeline], "pipeline_wall_s": [round(x, 1) for x in walls],
            "datasketch_near_dedup_cpu_s": [round(x, 1) for x in datasketch],
            "datasketch_removed": result["removed"],
            "pipeline_over_datasketch": round(statistics.median(pipeline) / statistics.median(datasketch), 2),
        }, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
