"""Project a curate run at internet scale from measured costs and the work layout; prints one JSON object.

usage: python -m scripts.cost_model --scale SCALE.json [--s3 S3.json] [--docs 1e9] [--text-bytes 1e12]
           [--cores 256] [--latency-ms 30] [--concurrency 16] [--bandwidth-mbs 80] [--block-bytes auto]

Inputs:
- `--scale`: `scripts.bench_driver_memory`'s JSON. From its largest scale: each phase's measured seconds on
  `workers` CPUs (stats.json's `phase_seconds`), the work bytes per document, the driver's peak memory.
- `--s3`: `scripts.bench_s3_requests`'s JSON, for the check that the request formula below matches a real
  S3 API server's count at 1 M documents (reported side by side).

The model (its assumptions are in BENCHMARKS.md, "Cost model"):
- **Layout** as the runner chooses it for the projected input: blocks M = text / `read.block_bytes`
  (`auto_block_bytes`), partitions P = `auto_partitions` for exact dedup (and ids) and near dedup.
- **CPU**: each parallel phase's measured CPU (seconds x workers) grows with the larger of the document and
  the byte ratios and spreads over the cores; a serial phase (Ray's start, the tokenizer's training, the
  driver's writes) keeps its seconds.
- **Requests**, counted from the layout (`requests`): every task reads its inputs and writes its output and
  record; every shuffle read is two requests (a header, a range) per sender and receiver, M x P for the
  map-side keys, P x P for the resolve's own steps. At `latency` each, `concurrency` in flight per core.
- **Bytes**: work bytes per document x documents, written once and read about twice, `bandwidth` per core.
- With `--s3`, every request count is multiplied by the server's count over the formula's for that run
  (the formula leaves out existence checks and listings), never by less than 1.
- A phase takes the largest of its three; phases are barriers, so the run is their sum. The critical path is
  the phase with the largest share and the bound that sets it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from datapipe.curate.config import auto_block_bytes, auto_partitions

SERIAL = {"start", "tokenizer", "write", "shutdown", "clean_up"}  # the driver's own steps, or one task


def requests(blocks: int, p_exact: int, p_near: int, shards: int, units: int | None = None) -> dict[str, int]:
    """Requests per phase of a run with exact and near dedup (verification on), from its layout: a task
    reads its input objects and writes its output and its record (3); a shuffle read costs 2 per sender
    and receiver. `rounds` of connected components are counted as one (one task up to `one_task_edges`)."""
    m, pe, pn = blocks, p_exact, p_near
    groups = min(units or m, 256)  # the losers are gathered by group of input units (exchange.gather_losers_task)
    return {
        "read": 3 * m + 2 * m,  # the input range, the block, the ids' keys, the record
        "unique_ids": 2 * m * pe + 3 * pe,
        "exact_dedup": 4 * m,  # the read block, the view, the keys, the record
        "exact_dedup resolve": 2 * m * pe + 3 * pe + 3 * pe + 2 * pe * groups + groups,  # keys; losers split, gathered
        "filters+minhash": 2 * m + 6 * m,  # each block reads its unit's range of its group's losers file
        "minhash resolve": (2 * m * pn + 3 * pn)  # pairs: the buckets
        + (2 * m * pn + 2 * pn)  # gather: every block's nodes, once, into one file per partition
        + 2 * (2 * pn * pn + 4 * pn)  # attach, verify: pairs and the gathered nodes
        + (2 * pn * pn + 4 * pn)  # members: the converged edges and the gathered nodes (ids from views)
        + (2 * pn * pn + 4 * pn)  # keep
        + 3 * pn + 2 * pn * groups + groups,  # losers split by unit, gathered by group of units
        "minhash drop": 2 * m + 5 * m,
        "tokenize": 5 * m,
        "shards": 2 * m + 3 * shards,
    }


def project(scale: dict[str, Any], docs: float, text_bytes: float, cores: int, latency_s: float, concurrency: int,
            bandwidth: float, block_bytes: int | None, calibration: float = 1.0) -> dict[str, Any]:
    largest = list(scale["scales"].values())[-1]
    workers = scale["workers"]
    growth = max(docs / largest["corpus"]["docs"], text_bytes / largest["corpus"]["bytes"])
    budget = 4 * 2**30
    block = block_bytes or auto_block_bytes(int(text_bytes))
    layout = {"blocks": -(-int(text_bytes) // block), "block_bytes": block,
              "partitions_exact": auto_partitions(int(text_bytes), "exact", budget),
              "partitions_near": auto_partitions(int(text_bytes), "minhash", budget),
              "shards": int(text_bytes * 0.5 // (64 * 2**20)) + 1}
    counted = requests(layout["blocks"], layout["partitions_exact"], layout["partitions_near"], layout["shards"])
    work_bytes = largest["work_bytes_per_doc"] * largest["corpus"]["docs"] * growth
    phases: dict[str, dict[str, Any]] = {}
    for phase, seconds in largest["phase_seconds"].items():
        serial = phase in SERIAL
        cpu = seconds if serial else seconds * workers * growth / cores
        n = int(counted.get(phase, 0) * calibration)
        phases[phase] = {"cpu_s": round(cpu, 1), "requests": n, "request_s": round(n * latency_s / (cores * concurrency), 1),
                         "serial": serial}
    cpu_total = sum(p["cpu_s"] for p in phases.values() if not p["serial"]) or 1.0
    for p in phases.values():
        p["byte_s"] = 0.0 if p["serial"] else round(3 * work_bytes * p["cpu_s"] / cpu_total / (cores * bandwidth), 1)
        bounds = {"cpu": p["cpu_s"], "requests": p["request_s"], "bytes": p["byte_s"]}
        p["bound"] = max(bounds, key=bounds.get)
        p["seconds"] = max(bounds.values())
    total = sum(p["seconds"] for p in phases.values())
    critical = max(phases, key=lambda k: phases[k]["seconds"])
    return {
        "layout": layout,
        "projected_wall_seconds": round(total, 1),
        "projected_wall_hours": round(total / 3600, 3),
        "critical_path": {"phase": critical, "bound": phases[critical]["bound"], "seconds": phases[critical]["seconds"],
                          "share": round(phases[critical]["seconds"] / total, 3)},
        "requests_total": sum(p["requests"] for p in phases.values()),
        "requests_per_document": round(sum(p["requests"] for p in phases.values()) / docs, 4),
        "work_bytes_total": int(work_bytes),
        "phases": phases,
    }


def check_against_server(s3: dict[str, Any]) -> dict[str, Any]:
    """The formula's total for the S3 run's own layout beside the server's count."""
    docs, text = s3["corpus"]["docs"], s3["corpus"]["bytes"]
    budget = 4 * 2**30
    m = -(-text // auto_block_bytes(text))
    formula = sum(requests(m, auto_partitions(text, "exact", budget), auto_partitions(text, "minhash", budget), 4).values())
    return {"documents": docs, "blocks": m, "formula_requests": formula, "server_requests": s3["requests_total"],
            "server_over_formula": round(s3["requests_total"] / formula, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", required=True, help="scripts.bench_driver_memory's JSON")
    parser.add_argument("--s3", default=None, help="scripts.bench_s3_requests's JSON")
    parser.add_argument("--docs", type=float, default=1e9)
    parser.add_argument("--text-bytes", type=float, default=1e12)
    parser.add_argument("--cores", type=int, default=256)
    parser.add_argument("--latency-ms", type=float, default=30.0, help="per request, first byte (S3: 10-100 ms)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight per core")
    parser.add_argument("--bandwidth-mbs", type=float, default=80.0, help="object-store throughput per core, MB/s")
    parser.add_argument("--block-bytes", default="auto", help="read.block_bytes (auto: as the runner chooses)")
    args = parser.parse_args()
    scale = json.loads(Path(args.scale).read_text())
    largest = list(scale["scales"].values())[-1]
    block = None if args.block_bytes == "auto" else int(args.block_bytes)
    result = {
        "assumptions": {"docs": args.docs, "text_bytes": args.text_bytes, "cores": args.cores, "latency_ms": args.latency_ms,
                        "concurrency_per_core": args.concurrency, "bandwidth_mb_s_per_core": args.bandwidth_mbs,
                        "measured_at_docs": largest["corpus"]["docs"], "measured_on_workers": scale["workers"],
                        "task_memory_gib": 4},
        **project(scale, args.docs, args.text_bytes, args.cores, args.latency_ms / 1000, args.concurrency,
                  args.bandwidth_mbs * 1e6, block),
    }
    if args.s3:  # the formula misses existence checks and listings: scale it by what the server counted
        check = check_against_server(json.loads(Path(args.s3).read_text()))
        result = {**result, **project(scale, args.docs, args.text_bytes, args.cores, args.latency_ms / 1000, args.concurrency,
                                      args.bandwidth_mbs * 1e6, block, max(1.0, check["server_over_formula"]))}
        result["request_formula_check"] = check
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
