"""Normalize, column-wise (Arrow's RE2, the stage today) against the former per-document Python rules (the stage at
git commit 6289e3c), on the same batches of the shared corpus in one process; prints one JSON object.

    python -m scripts.bench_normalize            # ../shared/data/corpus.jsonl.gz, best of 3 passes each, CPU seconds

Also checks that both give the same text for every document.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
import types

import orjson
import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA
from stages.normalize import NormalizeConfig, NormalizeStage

BEFORE = "6289e3c"  # the last commit with the per-document implementation


def main() -> None:
    old_src = subprocess.run(["git", "show", f"{BEFORE}:stages/normalize.py"], capture_output=True, text=True, check=True).stdout
    old = types.ModuleType("normalize_before")
    sys.modules[old.__name__] = old  # dataclasses look their module up
    exec(compile(old_src, "normalize_before", "exec"), old.__dict__)
    docs = [orjson.loads(line) for line in gzip.open("../shared/data/corpus.jsonl.gz")]
    batches = [pa.RecordBatch.from_pylist([{"id": d["id"], "domain": d["source"], "text": d["text"], "order": i + k}
                                           for k, d in enumerate(docs[i:i + 2000])], schema=DOC_SCHEMA) for i in range(0, len(docs), 2000)]
    mb = sum(len(d["text"].encode()) for d in docs) / 1e6
    out = {"docs": len(docs), "mb": round(mb, 1)}
    results = {}
    for name, stage in (("per_document_before", old.NormalizeStage(old.NormalizeConfig())), ("column_arrow", NormalizeStage(NormalizeConfig()))):
        best = None
        for _ in range(3):
            t = time.process_time()
            res = [stage(b) for b in batches]
            dt = time.process_time() - t
            best = dt if best is None else min(best, dt)
        results[name] = [r.kept.column("text").to_pylist() for r in res]
        out[name] = {"cpu_seconds": round(best, 2), "mb_per_cpu_s": round(mb / best, 1), "docs_per_s": round(len(docs) / best)}
    out["identical"] = results["per_document_before"] == results["column_arrow"]
    out["speedup"] = round(out["per_document_before"]["cpu_seconds"] / out["column_arrow"]["cpu_seconds"], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
