"""Project a curate run at internet scale from measured costs and the work layout; prints one JSON object.

usage: python -m scripts.cost_model --scale SCALE.json [--s3 S3.json] [--docs 1e9] [--text-bytes 1e12]
           [--cores 256] [--near-share 0.005] [--latency-ms 30] [--concurrency 16] [--connections 64] ...

Inputs (both kept in benchmarks/, with the commands that made them in BENCHMARKS.md):
- `--scale`: `scripts.bench_driver_memory`'s JSON. From its largest scale: each phase's measured seconds on
  `workers` CPUs (stats.json's `phase_seconds`), the work bytes per document, near dedup's candidate pairs,
  edges and rounds per document.
- `--s3`: `scripts.bench_s3_requests`'s JSON: the request formula below is checked against a real S3 API
  server's count at that run's own layout, and every count is scaled by the server's count over the formula's.

The model (its assumptions are flags, listed in BENCHMARKS.md, "Cost model"):
- **Layout** as the runner chooses it: blocks M = text / `auto_block_bytes`, partitions by `auto_partitions`,
  near dedup's groups G (`resolve_groups`: one per partition at scale), every exchange laid out as the run's one
  exchange lays it out (`exchange.layout`: the senders' own files where a receiver reads few and the requests stay
  within 4 x (senders + receivers), else merged into at most RECEIVER_FILES groups, each cut into partition ranges
  where its files do not fit a combine task whole), losers gathered by at most 256 groups of input units.
- **CPU**: each parallel phase's measured CPU (seconds x workers) grows with the larger of the document and
  byte ratios and spreads over the cores, then **wave tails**: T tasks on C cores run in ceil(T/C) waves, and
  the last task of a phase takes `--straggler` x a mean task. Serial: Ray's start, the driver's writes, the
  **tokenizer's training** (`--tokenizer-sample-mb` at the `--cpu-run`'s own training rate, else at
  `--tokenizer-mb-s`). The **clusters merge** is a task per order range of the input (`MERGE_RANGES` at most),
  each reading its range of every group's cluster rows.
- **Requests** (`requests`): per phase, on objects below hashed prefixes (`storage.spread`: PREFIXES per folder:
  shuffle files, read blocks, every per-block work file and every task record) and on the others (the input's
  ranges, per-partition and per-group files, the files every block reads: one prefix per folder). A phase's requests take the longest of: latency x requests / (cores x in flight), in flight per
  core = min(`--concurrency`, `--connections`: the S3 client's pool, one worker process per core); and
  **S3's per-prefix rate** (`--prefix-rate` requests a second per prefix) over the prefixes used.
  Counted explicitly: **component rounds** (measured rounds per run), the **exact check** (`--near-share` of
  documents in pairs decided by the exact Jaccard, each wanted by two groups: the wanted documents exchanged to
  fetch tasks by block, each block's frames read in a few merged ranges, `fetch_reads`, the frames exchanged on to
  the groups), the **members' ids** (none: they travel in the nodes).
- **Bytes**: work bytes per document x documents, written once and read about twice, `bandwidth` per core,
  plus the exact check's: the fetch tasks' ranges and the frames' exchange (`exact_check_bytes`).
- A phase's tasks each read, compute and write in turn, so its CPU, its requests' latency and its bytes **add**
  (nothing overlaps them); S3's per-prefix rate, shared by all tasks, is a floor under that sum. Phases are
  barriers, so the run is their sum. The critical path is the phase with the largest share and its largest term.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pyarrow as pa

from datapipe.core import exchange
from datapipe.core.exchange import Combined, Exchange, Shuffle, average_sender_bytes, planned, rows_bytes
from datapipe.core.schema import example_documents
from datapipe.core.shuffle import range_requests
from datapipe.core.storage import PREFIXES
from datapipe.curation.config import auto_block_bytes, auto_partitions
from datapipe.curation.phases.eval_split import CANDIDATE_BYTES, CHOOSE_TASKS as EVAL_CHOOSE_TASKS
from datapipe.curation.phases.near_dedup import FETCH_BYTES, FETCH_GAP, GROUP_DOCS, key_bytes, order_ranges
from stages.base import LOSER_SCHEMA
from stages.exact_dedup import ExactDedupConfig, ExactDedupStage
from stages.minhash import MinHashConfig

# a key and a loser as the run's own stage writes them (no copied constant): exact dedup's `keys` of example documents
# (ids of 24 characters), and the losers those documents would be, measured
_DOCUMENTS = example_documents(1000)
KEY_BYTES = -(-rows_bytes(ExactDedupStage(ExactDedupConfig()).keys(_DOCUMENTS).drop(["partition"])) // 1000)
LOSER_BYTES = -(-rows_bytes(pa.table({"order": _DOCUMENTS.column("order"), "reason": ["exact_duplicate"] * 1000,
                                      "kept_id": _DOCUMENTS.column("id")}, schema=LOSER_SCHEMA)) // 1000)

SERIAL = {"start", "tokenizer", "write", "shutdown", "clean_up", "clean up"}  # the driver's own steps, or one task
UNIT_GROUPS = 256  # exchange.UNIT_GROUPS: the losers are gathered by at most this many groups of input units
INPUT_RANGE = 5 * 2**20  # s3fs reads an input file in blocks of this size: one GET each
PAIR_BYTES = {"pairs-u": 16, "pairs-v": 16 + 256 + 8 + 16, "edges": 32}  # a candidate pair's row in each shuffle
WANTED_BYTES = 32  # a wanted document's row (order, block, its frame's place, the group): near_dedup.WANTED_SCHEMA
MEMBER_BYTES = 48  # a cluster member's row (order, label, id, length)
TOKENIZER_SAMPLE_BYTES = 200e6  # configs/web.yaml's tokenizer.train.sample_bytes: what sizes the sample's combine
LOSER_SHARE = 0.1  # documents a global stage drops, about (the scale corpus: 5% exact, 10% near copies)
EVAL_FRACTION = 0.001  # configs/web.yaml's eval.fraction


def layout(docs: float, text_bytes: float, units: int | None = None, blocks: int | None = None,
           partitions: int | None = None, groups: int | None = None) -> dict[str, int]:
    """The work layout the runner chooses for the input (or the one given: a measured run's)."""
    budget = 4 * 2**30
    block = auto_block_bytes(int(text_bytes))
    m = blocks or -(-int(text_bytes) // block)
    p_exact = partitions or auto_partitions(int(text_bytes), "exact", budget)
    p_near = partitions or auto_partitions(int(text_bytes), "minhash", budget)
    g = groups or max(1, min(p_near, -(-int(docs) // GROUP_DOCS)))
    return {"blocks": m, "block_bytes": int(text_bytes // m), "partitions_exact": p_exact, "partitions_near": p_near,
            "groups": g, "units": units or m, "shards": int(text_bytes * 0.5 // (64 * 2**20)) + 1,
            "near_keys_bytes": key_bytes(MinHashConfig(), int(docs), m),  # a block's nodes (signatures)
            "near_bucket_bytes": key_bytes(MinHashConfig(), int(docs), m, "buckets"),
            "exact_keys_bytes": average_sender_bytes(int(docs), m, KEY_BYTES)}


def _exchange_of(senders: int, receivers: int, largest_bytes: float, partitions: int | None = None) -> Exchange:
    """An exchange of `senders` files of `largest_bytes` each to `receivers` (each a span of adjacent partitions where
    there are more `partitions` than receivers)."""
    partitions = partitions or receivers
    spans = tuple(i * partitions // receivers for i in range(receivers)) if receivers != partitions else None
    spec = Shuffle("x", "x", partitions, records="x", spans=spans)  # the spec a run's exchange is planned from
    return planned(spec, [str(i) for i in range(senders)], [{"bytes": int(largest_bytes)}])


def _layout(senders: int, receivers: int, largest_bytes: float, partitions: int | None = None) -> Any:
    """`exchange.layout` of that exchange: where its receivers read."""
    return exchange.layout(_exchange_of(senders, receivers, largest_bytes, partitions))


def _exchange(senders: int, receivers: int, largest_bytes: float, partitions: int | None = None) -> dict[str, int]:
    """Requests of an exchange laid out as `exchange.plan` lays it out: each sender's file written once; each level of
    combines reading its senders' files (whole, one request, where a group fits a task; else a header and a range by
    each range's task) and writing its files (and their records); each receiver reading a header and a range of each
    file of its range, or of every sender's file where nothing is combined."""
    partitions = partitions or receivers
    combines, received = exchange.plan(_exchange_of(senders, receivers, largest_bytes, partitions))
    spread, plain = senders, 0
    for _, lay in combines:
        ranges = len(lay.starts)
        spread += (lay.senders if ranges == 1 else range_requests(partitions) * lay.senders * ranges) + lay.groups * ranges
        plain += 2 * lay.groups * ranges
    files = received.groups if isinstance(received, Combined) else len(received.names)
    reads = 1 if receivers == 1 else range_requests(partitions)  # a receiver of every partition reads a file whole
    return {"spread": spread + reads * files * receivers, "plain": plain}


def _step_bytes(step_bytes: float, senders: int) -> float:
    """A step's largest sender file, taken as 1.5 x the mean (what its exchange is laid out by)."""
    return 1.5 * step_bytes / senders


def _add(*parts: dict[str, int]) -> dict[str, int]:
    return {k: int(sum(p.get(k, 0) for p in parts)) for k in ("spread", "plain")}


def fetch_reads(lay: dict[str, int], docs: float, near_share: float, frame_ratio: float = 0.5) -> dict[str, float]:
    """The exact check's reads of one block, by its fetch task (`near_dedup.read_frames`): the block's documents near
    the threshold (k = share x documents a block, each read once for every group that wants it) spread uniformly over
    its frames; a frame joins the range before it when the gap between them is at most FETCH_GAP. With exponential
    gaps of mean g: ranges = P(any) + (k - 1) exp(-FETCH_GAP / g); bytes = the frames plus the gaps merged (at most
    the block's frames). Near copies that sit together in the input merge more: measure them (`exact_ranges_read`)."""
    per_block = docs / lay["blocks"]
    k = near_share * per_block
    frames = frame_ratio * lay["block_bytes"]
    frame = frames / per_block
    if k <= 0:
        return {"ranges_per_block": 0.0, "bytes_per_block": 0.0}
    gap = max(frames - k * frame, 0.0) / k  # mean gap between two wanted frames
    split = math.exp(-FETCH_GAP / gap) if gap > 0 else 0.0
    merged = gap - (gap + FETCH_GAP) * split if gap > 0 else 0.0  # mean bytes of a gap read through
    ranges = (1 - math.exp(-k)) + max(k - 1, 0.0) * split
    return {"ranges_per_block": round(ranges, 4),
            "bytes_per_block": min(frames, k * frame + max(k - 1, 0.0) * merged)}


def exact_check_requests(lay: dict[str, int], docs: float, near_share: float, frame_ratio: float = 0.5) -> dict[str, int]:
    """Near dedup's exact check after the decide step (`near_dedup.verify_pairs`): each group writes its decided pairs
    and its wanted documents; the wanted exchanged to the fetch tasks by block (F of them, sized by FETCH_BYTES of
    frames); each block's frames read in a few ranges (`fetch_reads`), each fetch task's frames exchanged to the
    groups; each group reads its decided pairs and writes its record."""
    m, g = lay["blocks"], lay["groups"]
    wanted = 2 * near_share * docs  # a document near the threshold is wanted by the two groups of its pairs
    if wanted < 1:
        return _add({"plain": 2 * g, "spread": g}, {"spread": 2 * g})  # decided, wanted written; check's read; record
    frame_bytes = wanted * (lay["block_bytes"] * m / docs) * frame_ratio
    f = max(1, min(m, math.ceil(frame_bytes / FETCH_BYTES)))
    reads = fetch_reads(lay, docs, near_share, frame_ratio)
    return _add({"plain": g},  # the decided pairs written
                _exchange(g, f, _step_bytes(wanted * WANTED_BYTES, g), m),  # wanted: written, combined, read by block
                {"spread": int(m * reads["ranges_per_block"]) + 2 * f},  # the fetch tasks' reads, records
                _exchange(f, g, _step_bytes(frame_bytes, f)),  # the frames, to their groups
                {"plain": g, "spread": 2 * g})  # the check: the decided pairs read, the record


def exact_check_bytes(lay: dict[str, int], docs: float, text_bytes: float, near_share: float, frame_ratio: float) -> float:
    """The exact check's bytes: each block's ranges read by its fetch task, and the frames' exchange (written, read)."""
    fetched = lay["blocks"] * fetch_reads(lay, docs, near_share, frame_ratio)["bytes_per_block"]
    return fetched + 2 * (2 * near_share * text_bytes * frame_ratio)


def requests(lay: dict[str, int], docs: float, near: dict[str, float], near_share: float,
             frame_ratio: float = 0.5, eval_split: bool = False) -> dict[str, dict[str, int]]:
    """Requests per phase of a run with exact and near dedup (verification on). A task reads its inputs and
    writes its outputs and its record, after an existence check of the record (HEAD). `near`: measured per
    document: candidate pairs, edges; and rounds of connected components. `frame_ratio`: a document's frame over its
    text (what sizes the exact check's fetch tasks and their ranges: `exact_check_requests`)."""
    m, pe, g, u = lay["blocks"], lay["partitions_exact"], lay["groups"], min(lay["units"], UNIT_GROUPS)
    losers = lambda senders: _add(  # split by unit, combined, gathered by unit group (`exchange.route_losers`)
        {"spread": senders}, _exchange(senders, u, average_sender_bytes(int(LOSER_SHARE * docs), senders, LOSER_BYTES)),
        {"spread": u + 2 * (senders + u)})  # + the records
    pairs = near["candidate_pairs"] * docs
    k_u, k_v = _step_bytes(pairs * PAIR_BYTES["pairs-u"], g), _step_bytes(pairs * PAIR_BYTES["pairs-v"], g)
    k_e = _step_bytes(near["edges"] * docs * PAIR_BYTES["edges"], g)
    k_m = _step_bytes(near["edges"] * docs * MEMBER_BYTES, g)
    step = lambda largest: _add(_exchange(g, g, largest), {"spread": 3 * g})  # + each task's nodes, records
    rounds = max(1, int(near.get("rounds", 1)))
    phases = {
        # the input's ranges are the user's keys (plain); every per-block work file and every record is spread
        "read": _add({"spread": m, "plain": m * (math.ceil(lay["block_bytes"] / INPUT_RANGE) + 1)}, {"spread": 2 * m}),
        "unique ids": _add(_exchange(m, pe, lay["exact_keys_bytes"]), {"spread": 2 * pe, "plain": pe}),
        "exact_dedup": _add({"spread": 4 * m}, {"spread": 2 * m}),  # read block; view; keys; record
        "exact_dedup resolve": _add(_exchange(m, pe, lay["exact_keys_bytes"]), {"spread": 2 * pe, "plain": pe}, losers(pe)),
        "filters+minhash": _add({"spread": 3 * m + 4 * m}, {"spread": 2 * m}),  # + buckets, nodes
        "minhash resolve": _add(
            _exchange(m, g, lay["near_bucket_bytes"]), _exchange(m, g, lay["near_keys_bytes"]),  # pairs; gather
            step(k_u), step(k_v),  # attach, decide
            exact_check_requests(lay, docs, near_share, frame_ratio),  # wanted, fetch, frames, check
            *[step(k_e) for _ in range(rounds)],  # component rounds
            step(k_m), step(k_m), {"spread": g},  # members (ids in the nodes: no reads), winners
            losers(g)),
        # the winners' cluster rows sent to the merge tasks, each writing its part (OUT's, one prefix: a temporary
        # key, its copy to the part's name and its deletion) and its record
        "minhash clusters": _add(_exchange(g, merge_ranges(lay), k_m), {"spread": 2 * merge_ranges(lay),
                                                                        "plain": 3 * merge_ranges(lay)}),
        "minhash drop": _add({"spread": 4 * m}, {"spread": 2 * m}),
        # the tokenizer's sample (a block and its view read, the sample written and combined, one training task),
        # then the tokenize tasks
        "tokenize": _add({"spread": 2 * m}, _exchange(m, 1, TOKENIZER_SAMPLE_BYTES / m),
                         {"spread": 2 * m, "plain": 2}, {"spread": 4 * m}, {"spread": 2 * m}),
        # the two block steps of selection (web.yaml's: no model, no diversity): a count task per block reading its
        # tokens' file, then a select task per block reading it again and writing the copies and its record (after
        # the record's existence check)
        "selection": {"spread": m + 4 * m},
        "shards": _add({"spread": 2 * m + 2 * lay["shards"], "plain": lay["shards"]}),  # the shards are OUT's
    }
    if eval_split:
        phases["eval split"] = eval_requests(lay, docs, near_share, frame_ratio, step)
    return phases


def eval_requests(lay: dict[str, int], docs: float, near_share: float, frame_ratio: float, step: Any,
                  fraction: float = EVAL_FRACTION) -> dict[str, int]:
    """The eval split's requests (`phases/eval_split.py`, decontamination `near` with verification): three tasks a
    block (candidates, token hashes, the rows it keeps), each a record (its check and write), its output and its
    block's inputs (the view, the tokens, the lengths, the hashes: about seven reads); the candidates exchanged to
    the choose tasks; one match task a near-dedup group reading its range of the buckets' combined files; the
    candidate pairs attached and decided as near dedup's (two steps, then the exact check's at the near share of
    the eval documents' partners); the edges combined for the one task that names the copies."""
    m, g = lay["blocks"], lay["groups"]
    choose = min(m, EVAL_CHOOSE_TASKS)
    candidates = max(1, int(fraction * docs / m)) * CANDIDATE_BYTES
    keys = _layout(m, g, lay["near_bucket_bytes"], lay["partitions_near"])
    buckets = 2 * g * min(g, keys.groups if isinstance(keys, Combined) else len(keys.names))
    # per block all spread but the two files every block reads (held.arrow, near.arrow: one key each)
    return _add({"spread": 3 * 3 * m + 5 * m, "plain": 2 * m}, {"spread": m}, _exchange(m, choose, candidates),
                {"spread": 2 * choose, "plain": choose + 3}, {"spread": buckets + 3 * g}, step(_step_bytes(1e3 * g, g)), step(_step_bytes(1e3 * g, g)),
                exact_check_requests(lay, docs, near_share * fraction, frame_ratio), _exchange(g, 1, 1000), {"plain": 3})


def measured_phases(run: dict[str, Any]) -> dict[str, float]:
    """The scale run's seconds by the model's phases: its executor steps (stats.json's `step_seconds`) grouped,
    and the driver's own stages (`phase_seconds`: start, write, clean up). The tokenizer's training (its own task,
    `tokenizer train`, since it left the driver) is modelled at web.yaml's settings instead."""
    out: dict[str, float] = {}
    for step, seconds in run["step_seconds"].items():
        if step == "tokenizer train":
            continue
        if step.startswith("unique_ids"):
            phase = "unique ids"
        elif step.startswith("eval_split"):
            phase = "eval split"
        elif step.startswith("select"):
            phase = "selection"
        elif step.startswith("exact_dedup "):
            phase = "exact_dedup resolve"
        elif step.startswith("tokenizer sample"):  # the sample and its exchange's combines (and batches)
            phase = "tokenize"
        elif step in ("minhash clusters", "minhash drop") or not step.startswith("minhash "):
            phase = {"shards cut": "shards", "shards plan": "shards"}.get(step, step)
        else:
            phase = "minhash resolve"
        out[phase] = out.get(phase, 0.0) + seconds
    for stage in ("start", "write", "clean up"):
        out[stage] = run["phase_seconds"].get(stage, 0.0)
    return out


def tokenizer_mb_s(args: argparse.Namespace, cpu_run: dict[str, Any] | None) -> float:
    """BPE training's MB of sample a second: the CPU run's own training task where it has one (its sample is the
    text that reached the tokenizer, up to web.yaml's sample_bytes), else `--tokenizer-mb-s`."""
    if cpu_run is None or not cpu_run["step_seconds"].get("tokenizer train"):
        return args.tokenizer_mb_s
    kept_mb = sum(d["bytes_out"] for d in cpu_run["funnel"][-1]["domains"].values()) / 1e6
    trained_mb = min(kept_mb, args.tokenizer_sample_mb)
    return trained_mb / cpu_run["step_seconds"]["tokenizer train"]


def merge_ranges(lay: dict[str, int]) -> int:
    """The clusters merge's tasks: the runner's order ranges for the layout's input units."""
    return order_ranges(lay["units"]).count


def _tasks(lay: dict[str, int], phase: str) -> int:
    if phase == "minhash clusters":
        return merge_ranges(lay)
    if "resolve" in phase:
        return lay["groups"] if "minhash" in phase else lay["partitions_exact"]
    return lay["partitions_exact"] if phase == "unique ids" else lay["blocks"]


def project(scale: dict[str, Any], docs: float, text_bytes: float, args: argparse.Namespace,
            calibration: float = 1.0, cpu_run: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run's phases, each bound by CPU, requests, prefixes or bytes. CPU from `cpu_run` (web.yaml on real text,
    `scripts.bench_layout --cpu`: per byte of input) where given, else from the scale run (per document or byte)."""
    largest = list(scale["scales"].values())[-1]
    growth = max(docs / largest["corpus"]["docs"], text_bytes / largest["corpus"]["bytes"])
    cpu_from, workers, cpu_growth = largest, scale["workers"], growth
    if cpu_run is not None:
        cpu_from, workers, cpu_growth = cpu_run, cpu_run["workers"], text_bytes / cpu_run["corpus"]["bytes"]
    lay = layout(docs, text_bytes)
    counted = requests(lay, docs, near_per_doc(largest), args.near_share, args.frame_ratio, eval_split=not args.no_eval)
    in_flight = args.cores * min(args.concurrency, args.connections)
    phases: dict[str, dict[str, Any]] = {}
    measured = measured_phases(cpu_from)
    for phase in counted:  # a phase with requests and no measured step (none in the CPU run) still counts them
        measured.setdefault(phase, 0.0)
    for phase, seconds in measured.items():
        serial = phase in SERIAL
        tasks = 1 if serial else _tasks(lay, phase)
        cpu = seconds if serial else seconds * workers * cpu_growth / args.cores
        if not serial:  # wave tails: whole waves, and the last task a straggler
            waves = math.ceil(tasks / args.cores)
            cpu = cpu * waves / (tasks / args.cores) + (args.straggler - 1) * cpu * args.cores / tasks
        n = {k: int(v * calibration) for k, v in counted.get(phase, {}).items()}
        total = sum(n.values())
        phases[phase] = {"cpu_s": round(cpu, 1), "tasks": tasks, "requests": total,
                         "request_s": round(total * args.latency_ms / 1000 / in_flight, 1),
                         "prefix_s": round(n.get("spread", 0) / (PREFIXES * args.prefix_rate)
                                           + n.get("plain", 0) / args.prefix_rate, 1), "serial": serial}
    phases["tokenizer"] = {"cpu_s": round(args.tokenizer_sample_mb / tokenizer_mb_s(args, cpu_run), 1), "requests": 0,
                           "request_s": 0.0, "prefix_s": 0.0, "serial": True, "tasks": 1}
    work_bytes = largest["work_bytes_per_doc"] * largest["corpus"]["docs"] * growth
    exact_bytes = exact_check_bytes(lay, docs, text_bytes, args.near_share, args.frame_ratio)
    cpu_total = sum(p["cpu_s"] for p in phases.values() if not p["serial"]) or 1.0
    for name, p in phases.items():
        extra = exact_bytes if name == "minhash resolve" else 0.0
        p["byte_s"] = 0.0 if p["serial"] else round((3 * work_bytes * p["cpu_s"] / cpu_total + extra)
                                                    / (args.cores * args.bandwidth_mbs * 1e6), 1)
        # a task reads, computes and writes in turn (nothing overlaps them): its CPU, its requests' latency and its
        # bytes add; S3's per-prefix rate is the bucket's, shared by all tasks: a floor under the sum
        in_series = {"cpu": p["cpu_s"], "requests": p["request_s"], "bytes": p["byte_s"]}
        p["in_series_s"] = round(sum(in_series.values()), 1)
        p["bound"] = "prefix" if p["prefix_s"] > p["in_series_s"] else max(in_series, key=in_series.get)
        p["seconds"] = max(p["in_series_s"], p["prefix_s"])
    stall = longest_tasks(phases, measured, workers * cpu_growth, args)
    if not args.warm_bucket:
        cold_bucket(phases, args)
    reads = fetch_reads(lay, docs, args.near_share, args.frame_ratio)
    return {**_summary(lay, phases, docs, work_bytes, exact_bytes), "exact_ranges_per_block": reads["ranges_per_block"],
            "stall": stall}


RUN_ORDER = ["start", "read", "unique ids", "exact_dedup", "exact_dedup resolve", "filters+minhash", "minhash resolve",
             "minhash clusters", "minhash drop", "tokenizer", "tokenize", "eval split", "selection", "shards", "write",
             "clean up"]


def cold_bucket(phases: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """A bucket (or a run's fresh key space) S3 has not split yet: it answers `--prefix-rate` requests a second in all
    and doubles that every `--cold-doubling-min` minutes of sustained load, up to PREFIXES prefixes' worth, answering
    what is over with 503 SlowDown (retried with backoff: the requests wait). Taken phase after phase in run order,
    from the run's start: a phase whose requests need longer at the capacity of its time is bound by it."""
    t = 0.0
    for name in sorted(phases, key=lambda k: RUN_ORDER.index(k) if k in RUN_ORDER else len(RUN_ORDER)):
        p = phases[name]
        if p["requests"] and not p["serial"]:
            served, dt, cap = 0.0, 0.0, args.prefix_rate * PREFIXES
            while served < p["requests"]:
                served += min(cap, args.prefix_rate * 2 ** ((t + dt) / (60 * args.cold_doubling_min)))
                dt += 1.0
            p["cold_s"] = dt
            if dt > p["seconds"]:
                p["seconds"], p["bound"] = dt, "cold bucket"
        t += p["seconds"]


def longest_tasks(phases: dict[str, dict[str, Any]], measured: dict[str, float], cpu_scale: float,
                  args: argparse.Namespace) -> dict[str, Any]:
    """Each phase's longest task (a mean task's CPU x `--straggler`; a phase of one task, its seconds) against the
    executor's stall timeout (`ray.stall_timeout_s`: a phase in which no task finishes for that long is stopped)."""
    longest = {}
    for name, p in phases.items():
        if p["serial"]:  # one task: its CPU
            longest[name] = p["cpu_s"]
        else:
            longest[name] = round(args.straggler * measured.get(name, 0.0) * cpu_scale / max(p["tasks"], 1), 1)
    worst = max(longest, key=longest.get)
    return {"timeout_s": args.stall_timeout_s, "longest_task_phase": worst, "longest_task_s": longest[worst],
            "within_timeout": longest[worst] < args.stall_timeout_s, "longest_task_s_by_phase": longest}


def _summary(lay: dict[str, int], phases: dict[str, Any], docs: float, work_bytes: float, exact_bytes: float) -> dict[str, Any]:
    total = sum(p["seconds"] for p in phases.values())
    critical = max(phases, key=lambda k: phases[k]["seconds"])
    return {
        "layout": lay,
        "projected_wall_seconds": round(total, 1),
        "projected_wall_hours": round(total / 3600, 3),
        "critical_path": {"phase": critical, "bound": phases[critical]["bound"], "seconds": phases[critical]["seconds"],
                          "share": round(phases[critical]["seconds"] / total, 3)},
        "requests_total": sum(p["requests"] for p in phases.values()),
        "requests_per_document": round(sum(p["requests"] for p in phases.values()) / docs, 4),
        "work_bytes_total": int(work_bytes),
        "exact_check_bytes": int(exact_bytes),
        "phases": phases,
    }


def near_per_doc(run: dict[str, Any]) -> dict[str, float]:
    """Near dedup's measured candidate pairs and edges per input document, and its rounds."""
    near, docs = run.get("near_dedup", {}), run["corpus"]["docs"]
    return {"candidate_pairs": near.get("candidate_pairs", 0) / docs, "edges": near.get("edges", 0) / docs,
            "rounds": near.get("rounds", 1)}


def check_against_server(s3: dict[str, Any], scale: dict[str, Any], near_share: float) -> dict[str, Any]:
    """The formula's total for the S3 run's own layout (its blocks, partitions and groups) beside the server's count."""
    docs, text = s3["corpus"]["docs"], s3["corpus"]["bytes"]
    seen = s3["layout"]["observed"]
    lay = layout(docs, text, seen.get("input_units"), seen.get("blocks"), seen.get("partitions_exact_and_ids"),
                 seen.get("near_dedup_resolve_groups"))
    lay["shards"] = seen.get("shards") or lay["shards"]
    near = near_per_doc(list(scale["scales"].values())[-1])
    with_eval = "eval split" in s3.get("phase_seconds", {})  # a bench_layout run (web.yaml) has it; bench_s3_requests' not
    formula = sum(sum(v.values()) for v in requests(lay, docs, near, near_share, eval_split=with_eval).values())
    return {"documents": docs, "layout": lay, "formula_requests": formula, "server_requests": s3["requests_total"],
            "server_over_formula": round(s3["requests_total"] / formula, 2)}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", required=True, help="scripts.bench_driver_memory's JSON")
    parser.add_argument("--s3", default=None, help="scripts.bench_s3_requests's JSON")
    parser.add_argument("--docs", type=float, default=1e9)
    parser.add_argument("--text-bytes", type=float, default=1e12)
    parser.add_argument("--cores", type=int, default=256)
    parser.add_argument("--near-share", type=float, default=0.05,
                        help="documents near the threshold, each wanted by the two groups of its pairs: 2 x share wanted "
                        "a document, each block's read once by its fetch task (measured, as wanted rows a document: 0.021 on "
                        "the scale benchmark's near-threshold corpus, 0.67 on the shared corpus)")
    parser.add_argument("--no-eval", action="store_true", help="leave out the eval split (configs/web.yaml ships it on)")
    parser.add_argument("--cpu-run", default=None, help="scripts.bench_layout --cpu's JSON: CPU per byte of web.yaml on real "
                        "text (default: the scale run's CPU)")
    parser.add_argument("--warm-bucket", action="store_true", help="a bucket S3 has already split (no cold start)")
    parser.add_argument("--cold-doubling-min", type=float, default=10.0,
                        help="minutes of sustained load in which a cold key space's request capacity doubles (assumed)")
    parser.add_argument("--stall-timeout-s", type=float, default=600.0, help="ray.stall_timeout_s")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="per request, first byte (S3: 10-100 ms)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests a core's tasks keep in flight")
    parser.add_argument("--connections", type=int, default=64, help="the S3 client's pool, per worker process")
    parser.add_argument("--prefix-rate", type=float, default=3500.0,
                        help="requests a second one key prefix serves (S3: 5,500 GET, 3,500 PUT)")
    parser.add_argument("--bandwidth-mbs", type=float, default=80.0, help="object-store throughput per core, MB/s")
    parser.add_argument("--straggler", type=float, default=1.5, help="a phase's last task over its mean task")
    parser.add_argument("--frame-ratio", type=float, default=0.5, help="a document's compressed frame over its text")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=200.0, help="configs/web.yaml: tokenizer.train.sample_bytes")
    parser.add_argument("--tokenizer-mb-s", type=float, default=7.3,
                        help="BPE training at 32,000 tokens, MB of sample a second (BENCHMARKS: 19.6 MB in 2.7 s)")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    scale = json.loads(Path(args.scale).read_text())
    largest = list(scale["scales"].values())[-1]
    result: dict[str, Any] = {"assumptions": {**{k: v for k, v in vars(args).items() if k not in ("scale", "s3", "cpu_run")},
                                              "measured_at_docs": largest["corpus"]["docs"],
                                              "measured_on_workers": scale["workers"], "task_memory_gib": 4,
                                              "prefixes_per_spread_folder": PREFIXES}}
    calibration = 1.0
    if args.s3:  # the formula misses some existence checks and listings: scale it by what the server counted
        check = check_against_server(json.loads(Path(args.s3).read_text()), scale, args.near_share)
        result["request_formula_check"] = check
        calibration = max(1.0, check["server_over_formula"])
    cpu_run = json.loads(Path(args.cpu_run).read_text()) if args.cpu_run else None
    result["assumptions"]["tokenizer_mb_s"] = round(tokenizer_mb_s(args, cpu_run), 2)
    result.update(project(scale, args.docs, args.text_bytes, args, calibration, cpu_run))
    # 1%, 5% and the shared corpus's share (14,018 of 20,856 documents read by its exact check: 0.336 x 2 reads)
    result["at_other_near_shares"] = {
        share: project(scale, args.docs, args.text_bytes, argparse.Namespace(**{**vars(args), "near_share": share}),
                       calibration, cpu_run)["projected_wall_hours"] for share in (0.01, 0.05, 0.336)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
