"""Requests and objects a curate run makes on object storage, per phase and per document; prints one JSON object.

usage: python -m scripts.bench_s3_requests [--docs 1000000] [--workers 2] [--keep-work] [--save-log PATH]
       python -m scripts.bench_s3_requests --count-log PATH      # count a saved server log, run nothing

A real S3 API server on localhost (moto's server mode, `moto_server`, a separate process speaking HTTP, as
the tests use) logs every request it answers. The script writes the scale benchmark's synthetic corpus
(`scripts.bench_driver_memory.write_corpus`: short documents, 5% exact and 10% near copies, 16 JSONL files),
uploads it to `s3://bench/in/`, then runs `datapipe curate` as a fresh process with input and output on the
server (`--output s3://bench/run`, exact and near dedup with verification, the scale benchmark's recipe) and
counts the requests of the run from the server's log.

The log is werkzeug's access log, one line a request: `127.0.0.1 - - [date] "GET /bench/key HTTP/1.1" 206 -`.
werkzeug colours the request of every line whose status is not 200 with ANSI escape codes (`"\\x1b[35m\\x1b[1mGET
... HTTP/1.1\\x1b[0m" 206`: a range read; yellow for a 404), and whether the codes reach the file depends on the
environment (colorama, when installed, strips them from a stream that is not a terminal), so the codes are
removed before a line is matched (`parse_line`). Counted:
- by HTTP method and status (`GET 206` is a range read, `HEAD 404` an existence check that found nothing);
- by phase, the folder below the run's `work/` the key names (`work/read`, `work/ids`, `work/exact_dedup`,
  `work/seg0`, `work/minhash`, `work/tokens`, ...; a listing counts for the folder of its `prefix=`), the
  output files (`shards`, `dropped`, ...) and the input reads (`in`); per phase its method/status counts, its
  listings, the objects it wrote, its task records (`.json` written below work/: one per task), its shuffle
  files written (`.shuffle`: one per sending task) and its range reads;
- by folder, one level further (`work/minhash/buckets`, `work/minhash/records`, ...), where for a shuffle the
  sending tasks (its `.shuffle` files) and the range reads per sending file are given. The receiving tasks
  are not in the log (every request comes from 127.0.0.1); their task records are counted where they have
  them (e.g. `work/ids/resolved-pNNN-of-MMM.json`, one per receiving partition);
- per input document: requests, PUTs, range reads.
The layout of the run (blocks, input units, partitions, the near-dedup resolve's groups, shards) is read from
the keys and stats.json, beside what the runner's `auto` rules give for the same input; `scripts.cost_model
--s3` checks its request formula against this count at this layout (`server_over_formula`, the calibration
factor it applies). Each shuffle folder's requests are held against 4 x (sending + receiving tasks).
With `--keep-work` it also lists what work/ holds at the end (objects per folder). The server's requests are
what a real S3 bucket would be billed for and would answer at its per-request latency (`scripts/cost_model.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, unquote

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench"
RUN = "run"  # the run's output folder in the bucket: s3://bench/run
# ANSI escape sequences (CSI: ESC [ params letter), as werkzeug's `_ansi_style` writes them
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# werkzeug's access log line, after the codes are gone: "METHOD /bucket/key?query HTTP/1.1" STATUS SIZE
_LINE = re.compile(r'"([A-Z]+) (/[^ ?"]*)(\?[^ "]*)? HTTP/[0-9.]+" (\d{3})\b')
_DIGITS = re.compile(r"\d+")
_SPREAD = re.compile(r"[0-9a-f]{2}")  # a hashed key prefix (`datapipe.core.storage.spread`)


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # /bucket/key, as logged
    query: str  # without the "?", "" if none
    status: int


def strip_ansi(line: str) -> str:
    return _ANSI.sub("", line)


def parse_line(line: str) -> Request | None:
    """One request of a werkzeug access-log line, with or without its colour codes; None for other lines."""
    m = _LINE.search(strip_ansi(line))
    if not m:
        return None
    return Request(m.group(1), m.group(2), (m.group(3) or "")[1:], int(m.group(4)))


def classify(req: Request, bucket: str = BUCKET, run: str = RUN) -> tuple[str, str, str]:
    """(phase, folder, key) of a request: the phase is `work/<name>` for a key below the run's work/, the top
    name below the run for an output (`shards`, `dropped`, `manifest.json`, ...), `in` for the input; a
    listing counts for its prefix's phase and folder. The folder is one level below the phase, its digits as N
    (`work/minhash/buckets`; a file directly in the phase's folder: `work/exact_dedup/losers-tN.arrow`)."""
    path = unquote(req.path).lstrip("/")
    if path != bucket and not path.startswith(bucket + "/"):
        return "other", "other", path
    key = path[len(bucket) + 1:]
    if not key:  # a request on the bucket: a listing names its prefix
        prefix = parse_qs(req.query).get("prefix", [None])[0]
        if prefix is None:
            kind = "batch delete" if "delete" in parse_qs(req.query, keep_blank_values=True) else "bucket"
            return f"bucket ({kind})", f"bucket ({kind})", ""
        key = prefix
    parts = key.split("/")
    if parts[0] == "in":
        return "in", "in", key
    if parts[0] != run:
        return "other", "other", key
    parts = parts[1:]
    if not parts or not parts[0]:
        return "run (top)", "run (top)", key
    if parts[0] == "work":
        if len(parts) < 2 or not parts[1]:
            return "work (top)", "work (top)", key
        phase = f"work/{parts[1]}"
        if len(parts) < 3 or not parts[2]:
            return phase, phase, key
        if phase == "work/read" and _SPREAD.fullmatch(parts[2]) and len(parts) == 4 and parts[3]:  # a read block
            # below its hashed prefix (`storage.spread`)
            return phase, f"{phase}/blocks", key
        return phase, f"{phase}/{_DIGITS.sub('N', parts[2])}", key
    return parts[0], parts[0], key


@dataclass
class Tally:
    by_status: Counter = field(default_factory=Counter)  # "GET 206" -> n
    listings: int = 0
    written: set = field(default_factory=set)  # keys PUT
    range_read: Counter = field(default_factory=Counter)  # key -> range reads (206)

    def add(self, req: Request, key: str, listing: bool) -> None:
        self.by_status[f"{req.method} {req.status}"] += 1
        if listing:
            self.listings += 1
        elif req.method == "PUT" and req.status == 200:
            self.written.add(key)
        elif req.method == "GET" and req.status == 206:
            self.range_read[key] += 1

    @property
    def requests(self) -> int:
        return sum(self.by_status.values())

    def summary(self, shuffle_detail: bool = False) -> dict[str, Any]:
        # a task's record lies in a phase's folder below work/ (work/run.json, the run's identity, is not one)
        records = sorted(k for k in self.written if k.endswith(".json") and "/work/" in f"/{k}"
                         and "/" in f"/{k}".split("/work/", 1)[1])
        senders = sorted(k for k in self.written | set(self.range_read) if k.endswith(".shuffle"))
        shuffle_reads = sum(n for k, n in self.range_read.items() if k.endswith(".shuffle"))
        kinds = Counter(_DIGITS.sub("N", k.split("/work/", 1)[1].split("/", 1)[1]) for k in records)
        out: dict[str, Any] = {
            "requests": self.requests,
            "by_method_status": dict(sorted(self.by_status.items())),
            "listings": self.listings,
            "objects_written": len(self.written),
            "task_records_written": len(records),  # one per task: the tasks of the step, by record name
            "task_records_by_name": dict(sorted(kinds.items())),
            "shuffle_files": len(senders),  # one per sending task
            "range_reads": sum(self.range_read.values()),
            "objects_range_read": len(self.range_read),
        }
        if shuffle_detail and senders:
            out["range_reads_of_shuffle_files"] = shuffle_reads
            out["range_reads_per_shuffle_file"] = round(shuffle_reads / len(senders), 2)
        return {k: v for k, v in out.items() if v or k == "requests"}  # zeros left out


@dataclass
class Count:
    total: Tally = field(default_factory=Tally)
    phases: dict[str, Tally] = field(default_factory=dict)
    folders: dict[str, Tally] = field(default_factory=dict)
    unmatched_request_lines: int = 0  # lines that look like a request ('" NNN ') but did not parse: should be 0

    def add(self, req: Request) -> None:
        phase, folder, key = classify(req)
        listing = req.method == "GET" and req.path.strip("/") == BUCKET and "prefix=" in req.query
        for tally in (self.total, self.phases.setdefault(phase, Tally()), self.folders.setdefault(folder, Tally())):
            tally.add(req, key, listing)


def count_lines(lines: Iterable[str]) -> Count:
    count = Count()
    for line in lines:
        req = parse_line(line)
        if req is not None:
            count.add(req)
        elif re.search(r'" \d{3} ', strip_ansi(line)):
            count.unmatched_request_lines += 1
    return count


def count_requests(log: Path, start: int = 0) -> Count:
    """The requests in the server's log from byte `start` on."""
    with open(log, "rb") as f:
        f.seek(start)
        return count_lines(raw.decode("utf-8", "replace") for raw in f)


def _layout(count: Count, corpus: dict[str, Any], stats: dict[str, Any] | None, workers: int) -> dict[str, Any]:
    """What the run's keys say of its layout, beside what the runner's `auto` rules give for the corpus."""
    read = count.phases.get("work/read", Tally()).written
    ids = count.phases.get("work/ids", Tally()).written
    of = {int(m.group(1)) for k in ids if (m := re.search(r"resolved-p\d+-of-(\d+)\.json$", k))}
    observed = {
        "input_units": sum(1 for k in read if re.search(r"/u\d+\.json$", k)),
        "blocks": sum(1 for k in read if k.endswith(".arrow")),
        "partitions_exact_and_ids": max(of) if of else None,
        "near_dedup_resolve_groups": (stats or {}).get("global_stages", {}).get("minhash", {}).get("tasks"),
        "shards": sum(1 for k in count.phases.get("shards", Tally()).written if k.endswith(".arrow")),
        "workers": workers,
    }
    try:
        from datapipe.curation.config import auto_block_bytes, auto_partitions
        text, budget = corpus["bytes"], 4 * 2**30
        modelled = {"blocks": -(-text // auto_block_bytes(text)), "block_bytes": int(auto_block_bytes(text)),
                    "partitions_exact": int(auto_partitions(text, "exact", budget)),
                    "partitions_near": int(auto_partitions(text, "minhash", budget))}
    except Exception as exc:  # the config module is elsewhere mid-refactor: say so, count the rest
        modelled = {"error": repr(exc)}
    return {"observed": observed, "auto_rules_for_the_corpus": modelled}


def _receivers(folder: str, layout: dict[str, Any]) -> int | None:
    """The tasks of the step that reads a shuffle folder (besides its combine tasks), from the run's layout."""
    parts, groups = layout.get("partitions_exact_and_ids"), layout.get("near_dedup_resolve_groups")
    if folder in ("work/ids/keys", "work/exact_dedup/keys"):
        return parts
    if folder.startswith("work/minhash/") and folder.rsplit("/", 1)[1] in ("buckets", "nodes", "pairs-u", "pairs-v", "members", "cc"):
        return groups
    if folder.endswith("/losers-by-unit"):  # two exchanges: to the unit groups' gather tasks, then to the blocks
        units, blocks = layout.get("input_units"), layout.get("blocks")
        return min(units, 256) + blocks if units and blocks else None
    return None


def shuffle_bounds(count: Count, layout: dict[str, Any]) -> dict[str, Any]:
    """Per shuffle folder: its requests beside 4 x (sending tasks + receiving tasks). Senders: the shuffle files
    written (one per sending task: the map side's or a step's tasks, and the combine tasks, which send again);
    receivers: the combine tasks and the reading step's tasks (`_receivers`)."""
    out = {}
    for folder, tally in sorted(count.folders.items()):
        files = {k for k in tally.written if k.endswith(".shuffle")}
        receivers = _receivers(folder, layout)
        if not files or receivers is None:
            continue
        combines = sum(1 for k in files if k.rsplit("/", 1)[-1].startswith("combined-"))
        senders, receiving = len(files), receivers + combines
        out[folder] = {"requests": tally.requests, "sending_tasks": senders, "receiving_tasks": receiving,
                       "bound_4x_senders_plus_receivers": 4 * (senders + receiving),
                       "within_bound": tally.requests <= 4 * (senders + receiving)}
    return out


def report(count: Count, docs: int | None, corpus: dict[str, Any] | None = None, stats: dict[str, Any] | None = None,
           workers: int = 0) -> dict[str, Any]:
    total = count.total.requests
    per_doc = (lambda n: round(n / docs, 5)) if docs else (lambda n: None)
    puts = sum(n for k, n in count.total.by_status.items() if k.startswith(("PUT ", "POST ")))
    ranges = count.total.by_status.get("GET 206", 0)
    out: dict[str, Any] = {
        "requests_total": total,
        "requests_per_document": per_doc(total),
        "puts_per_document": per_doc(puts),
        "range_reads_per_document": per_doc(ranges),
        "by_method_status": dict(sorted(count.total.by_status.items())),
        "listings": count.total.listings,
        "unmatched_request_lines": count.unmatched_request_lines,
        "phases": {k: v.summary() for k, v in sorted(count.phases.items())},
        "folders": {k: v.summary(shuffle_detail=True) for k, v in sorted(count.folders.items())},
    }
    if corpus is not None:
        out["layout"] = _layout(count, corpus, stats, workers)
        out["shuffle_requests_against_bound"] = shuffle_bounds(count, out["layout"]["observed"])
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `datapipe curate RECIPE --no-progress` with near_dedup.GROUP_DOCS set (argv: the value, the recipe). The groups
# are decided in the driver (`resolve_groups`) and carried to the tasks, so the driver's module is enough.
_WITH_GROUP_DOCS = """
import sys
import datapipe.curation.phases.near_dedup as near_dedup
near_dedup.GROUP_DOCS = int(sys.argv[1])
from datapipe.cli import main
sys.argv = ["datapipe", "curate", sys.argv[2], "--no-progress"]
sys.exit(main())
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep-work", action="store_true")
    parser.add_argument("--save-log", default=None, help="copy the server's log of the run (its lines only) here")
    parser.add_argument("--count-log", default=None, help="count this saved log and print the counts; run nothing")
    parser.add_argument("--block-bytes", type=int, default=None, help="read.block_bytes (default: auto) to force many blocks")
    parser.add_argument("--partitions", type=int, default=None,
                        help="dedup.exact and dedup.minhash partitions (default: auto) to force many receivers")
    parser.add_argument("--group-docs", type=int, default=None,
                        help="near dedup's documents per resolve task (near_dedup.GROUP_DOCS) to force many groups")
    args = parser.parse_args()
    if args.count_log:
        print(json.dumps(report(count_requests(Path(args.count_log)), None), indent=1))
        return
    from scripts.bench_driver_memory import write_corpus

    recipe = {
        "dedup": {"exact": {"enabled": True, "partitions": args.partitions or "auto"},
                  "minhash": {"enabled": True, "partitions": args.partitions or "auto"}},
        "read": {"block_bytes": args.block_bytes or "auto"},
        "filters": {},
        "tokenizer": {"train": {"vocab_size": 2048, "sample_bytes": 2_000_000}},
    }
    command = (f"python -m scripts.bench_s3_requests --docs {args.docs} --workers {args.workers}"
               + (" --keep-work" if args.keep_work else "")
               + "".join(f" --{k.replace('_', '-')} {v}" for k, v in
                         (("block_bytes", args.block_bytes), ("partitions", args.partitions), ("group_docs", args.group_docs)) if v))
    result = run_on_server(recipe, lambda folder: write_corpus(folder, args.docs), args.docs, workers=args.workers,
                           keep_work=args.keep_work, group_docs=args.group_docs, save_log=args.save_log)
    for private in ("stats", "step_seconds"):
        result.pop(private, None)
    print(json.dumps({"command": command, **result}, indent=1))


def run_on_server(recipe: dict[str, Any], write: Callable[[Path], dict[str, Any]], docs: int, *, workers: int,
                  keep_work: bool = False, group_docs: int | None = None, save_log: str | None = None,
                  input_options: dict[str, Any] | None = None, folder_tallies: bool = False) -> dict[str, Any]:
    """Start a moto server, write the corpus (`write(folder)`: its counts) and upload it, run `datapipe curate` on
    `recipe` (inputs and output set here: on the server; `input_options` beside the input's path, default the
    domain `web`) as a fresh process, and count what the server answered. The driver's resident memory is sampled
    while it runs (`driver_peak_rss_mb`). With `folder_tallies`, each folder's `Tally` too (`folder_tallies`)."""
    server = shutil.which("moto_server")
    if server is None:
        sys.exit("moto_server is not installed: pip install 'moto[server]'")
    import s3fs

    root = Path(tempfile.mkdtemp(prefix="bench-s3-"))
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log_path = root / "moto.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "PYTHONPATH": str(REPO)}
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        fs.mkdir(BUCKET)
        corpus = write(root / "corpus")
        for f in sorted((root / "corpus").glob("*.jsonl")):
            fs.put_file(str(f), f"{BUCKET}/in/{f.name}")
        config = {**recipe, "inputs": [{"path": f"s3://{BUCKET}/in/*.jsonl", **(input_options or {"domain": "web"})}],
                  "ray": {**recipe.get("ray", {}), "num_cpus": workers},
                  "output": {**recipe.get("output", {}), "dir": f"s3://{BUCKET}/{RUN}", "keep_work": keep_work}}
        recipe_path = root / "recipe.json"
        recipe_path.write_text(json.dumps(config))
        time.sleep(0.5)  # the uploads' lines are in the log before the run's first
        log.flush()
        start = log_path.stat().st_size
        t0 = time.perf_counter()
        cli = [sys.executable, "-m", "datapipe.cli", "curate", str(recipe_path), "--no-progress"]
        if group_docs:  # the resolve's tasks are sized in the driver and in every worker from this module
            cli = [sys.executable, "-c", _WITH_GROUP_DOCS, str(group_docs), str(recipe_path)]
        returncode, stderr, peak_rss = _run_watching_memory(cli, env)
        wall = time.perf_counter() - t0
        if returncode != 0:
            raise SystemExit(f"curate failed:\n{stderr[-4000:]}")
        time.sleep(0.5)
        log.flush()
        count = count_requests(log_path, start)
        if save_log:
            with open(log_path, "rb") as src, open(save_log, "wb") as dst:
                src.seek(start)
                shutil.copyfileobj(src, dst)
        stats = json.loads(fs.cat_file(f"{BUCKET}/{RUN}/stats.json"))
        objects = Counter()
        if keep_work:
            for key in fs.find(f"{BUCKET}/{RUN}/work"):
                objects[classify(Request("GET", "/" + key, "", 200))[1]] += 1
        return {
            "server": "moto_server (localhost)",
            "corpus": corpus,
            "wall_seconds": round(wall, 1),
            "driver_peak_rss_mb": round(peak_rss / 2**20, 1),
            "phase_seconds": stats["phase_seconds"],
            "step_seconds": stats.get("step_seconds", {}),
            "stats": stats,
            **report(count, docs, corpus, stats, workers),
            **({"work_objects_by_folder": dict(sorted(objects.items()))} if objects else {}),
            **({"folder_tallies": count.folders} if folder_tallies else {}),
        }
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a busy server slow to stop must not lose the run's result
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def _run_watching_memory(cli: list[str], env: dict[str, str]) -> tuple[int, str, int]:
    """Run `cli` in REPO; its exit code, its stderr and the most resident memory its own process held (the kernel's
    high-water mark, VmHWM, read every 0.2 s while it runs: the driver, not the Ray processes it starts)."""
    with tempfile.TemporaryFile() as err:
        child = subprocess.Popen(cli, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
        peak = 0
        while child.poll() is None:
            try:
                status = Path(f"/proc/{child.pid}/status").read_text()
                peak = max(peak, int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024)
            except (OSError, AttributeError):
                pass
            time.sleep(0.2)
        err.seek(0)
        return child.returncode, err.read().decode("utf-8", "replace"), peak


if __name__ == "__main__":
    main()
