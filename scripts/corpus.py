"""The shared corpus (../shared/data/corpus.jsonl.gz) as documents, for the benchmark scripts."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson

DEFAULT = "../shared/data/corpus.jsonl.gz"


def load_docs(corpus: str | Path = DEFAULT, limit: int | None = None) -> list[dict]:
    """The first `limit` documents (all by default) as {id, domain (the source), text}."""
    docs = []
    with gzip.open(corpus, "rb") as f:
        for line in f:
            rec = orjson.loads(line)
            docs.append({"id": rec["id"], "domain": rec["source"], "text": rec["text"]})
            if limit and len(docs) >= limit:
                break
    return docs


_CURATE = (
    "import json,sys,time; from datapipe.curate.config import CurateConfig; from datapipe.core.config import from_dict;"
    "from datapipe.curate.run import curate; import datapipe.curate.executors as ex;"
    "cfg=from_dict(CurateConfig, json.loads(sys.argv[1])); e=ex.RayExecutor(num_cpus=cfg.ray.num_cpus, progress=False);"
    "t=time.perf_counter(); r=curate(cfg, executor=e, progress=False, log=lambda _: None); dt=time.perf_counter()-t;"
    "print(json.dumps({'seconds': dt, 'docs': r.manifest['total_docs'], 'tokens': r.manifest['total_tokens'],"
    "'phases': r.stats['phase_seconds'], 'global_stages': r.stats['global_stages'],"
    "'sha256': [s['sha256'] for s in r.manifest['shards']]}))"
)


def curate_in_fresh_process(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Run `datapipe.curate.run.curate` on plain config data in a new Python process, so Ray starts with
    exactly `ray.num_cpus` CPUs and timings share no caches. Returns (summary, the run's stderr)."""
    proc = subprocess.run([sys.executable, "-c", _CURATE, json.dumps(cfg)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"curate failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
