"""Project a curate run at internet scale from measured per-document costs; prints one JSON object.

usage: python -m scripts.cost_model --scale SCALE.json [--s3 S3.json] [--docs 1e9] [--text-bytes 1e12]
                                    [--cores 256] [--latency-ms 30] [--concurrency 16] [--bandwidth-mbs 80]

Inputs are measurements, not guesses about the code:
- `--scale`: `scripts.bench_driver_memory`'s JSON (its largest scale): per phase, the wall seconds on
  `workers` CPUs (stats.json's `phase_seconds`), the whole process tree's CPU seconds, work bytes per
  document, the driver's peak memory;
- `--s3`: `scripts.bench_s3_requests`'s JSON: requests per document by folder (phase), counted by a real S3
  API server.

The model, per phase p (its assumptions are in BENCHMARKS.md, "Cost model"):
- CPU: the phase's measured seconds x the workers it ran on, per document, times the documents, over the
  cores. A phase that ran in the driver alone or in one task (`tokenizer` training, a one-task step) is
  counted as serial: its measured seconds, not divided.
- Requests: requests per document of the phase's folders x documents, each taking `latency` seconds,
  `concurrency` in flight per core (fsspec's `cat_ranges` and Ray's many tasks overlap them).
- Bytes: work bytes per document x documents, written once and read about twice, at `bandwidth` per core.
- The phase takes the largest of the three; the run, the sum over phases (phases are barriers). The critical
  path is the phase with the largest share, with the bound that sets it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# The folders of the S3 request counts that each phase's requests fall in (bench_s3_requests `_folder`).
FOLDERS = {
    "read": ("in (input reads)", "work/read", "quarantine"),
    "unique_ids": ("work/ids",),
    "exact_dedup": ("work/seg0",),
    "exact_dedup resolve": ("work/exact_dedup",),
    "filters+minhash": ("work/seg1",),
    "minhash resolve": ("work/minhash", "near_duplicates"),
    "minhash drop": ("work/seg2",),
    "tokenizer": ("tokenizer.json (file)",),
    "tokenize": ("work/tokens", "work/lengths"),
    "eval_split": ("work/eval", "eval"),
    "select": ("work/select", "work/diversity"),
    "shards": ("shards", "work/shards", "dropped"),
}
SERIAL = {"start", "tokenizer", "write", "shutdown"}  # the driver's own steps, or one task: not divided by cores


def project(scale: dict[str, Any], s3: dict[str, Any] | None, docs: float, text_bytes: float, cores: int, latency_s: float,
            concurrency: int, bandwidth: float) -> dict[str, Any]:
    largest = list(scale["scales"].values())[-1]
    workers = scale["workers"]
    # Costs per document where they go with documents (keys, signatures), per byte where they go with text
    # (shingles, tokens, blocks): the larger of the two ratios, so the projection errs on the slow side.
    growth = max(docs / largest["corpus"]["docs"], text_bytes / largest["corpus"]["bytes"])
    per_doc_requests: dict[str, float] = {}  # requests of each phase at the scale run's size
    if s3 is not None:
        s3_docs = s3["corpus"]["docs"]
        for phase, folders in FOLDERS.items():
            n = sum(sum(v.values()) for k, v in s3["requests_by_folder"].items() if k in folders)
            per_doc_requests[phase] = n / s3_docs * largest["corpus"]["docs"]  # at the scale run's size
    work_bytes = largest["work_bytes_per_doc"] * largest["corpus"]["docs"] * growth
    phases = {}
    for phase, seconds in largest["phase_seconds"].items():
        if phase == "clean_up":
            continue
        serial = phase in SERIAL
        cpu = seconds if serial else seconds * workers * growth / cores
        key = next((k for k in FOLDERS if phase.startswith(k)), None)
        requests = per_doc_requests.get(key, 0.0) * growth if key else 0.0
        request_s = requests * latency_s / (cores * concurrency)
        phases[phase] = {"cpu_s": round(cpu, 1), "requests": int(requests), "request_s": round(request_s, 1),
                         "serial": serial}
    # Work bytes: written once and read about twice, spread over the phases by their CPU share.
    cpu_total = sum(p["cpu_s"] for p in phases.values() if not p["serial"]) or 1.0
    for p in phases.values():
        p["byte_s"] = 0.0 if p["serial"] else round(3 * work_bytes * p["cpu_s"] / cpu_total / (cores * bandwidth), 1)
        bounds = {"cpu": p["cpu_s"], "requests": p["request_s"], "bytes": p["byte_s"]}
        p["bound"] = max(bounds, key=bounds.get)
        p["seconds"] = max(bounds.values())
    total = sum(p["seconds"] for p in phases.values())
    critical = max(phases, key=lambda k: phases[k]["seconds"])
    return {
        "projected_wall_seconds": round(total, 1),
        "projected_wall_hours": round(total / 3600, 3),
        "critical_path": {"phase": critical, "bound": phases[critical]["bound"], "seconds": phases[critical]["seconds"],
                          "share": round(phases[critical]["seconds"] / total, 3)},
        "phases": phases,
        "work_bytes_total": int(work_bytes),
        "requests_total": int(sum(p["requests"] for p in phases.values())),
        "driver_peak_rss_mib_measured": largest["driver_peak_rss_mib"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", required=True, help="scripts.bench_driver_memory's JSON")
    parser.add_argument("--s3", default=None, help="scripts.bench_s3_requests's JSON")
    parser.add_argument("--docs", type=float, default=1e9)
    parser.add_argument("--text-bytes", type=float, default=1e12, help="only reported: the per-document costs carry it")
    parser.add_argument("--cores", type=int, default=256)
    parser.add_argument("--latency-ms", type=float, default=30.0, help="per request, first byte (S3: 10-100 ms)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per core")
    parser.add_argument("--bandwidth-mbs", type=float, default=80.0, help="object-store throughput per core, MB/s")
    args = parser.parse_args()
    scale = json.loads(Path(args.scale).read_text())
    s3 = json.loads(Path(args.s3).read_text()) if args.s3 else None
    largest = list(scale["scales"].values())[-1]
    result = {
        "assumptions": {"docs": args.docs, "text_bytes": args.text_bytes, "cores": args.cores, "latency_ms": args.latency_ms,
                        "concurrency_per_core": args.concurrency, "bandwidth_mb_s_per_core": args.bandwidth_mbs,
                        "measured_at_docs": largest["corpus"]["docs"], "measured_on_workers": scale["workers"],
                        "text_bytes_per_doc_measured": round(largest["corpus"]["bytes"] / largest["corpus"]["docs"], 1)},
        **project(scale, s3, args.docs, args.text_bytes, args.cores, args.latency_ms / 1000, args.concurrency, args.bandwidth_mbs * 1e6),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
