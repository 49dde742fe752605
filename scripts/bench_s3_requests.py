"""Requests and objects a curate run makes on object storage, per phase and per document; prints one JSON object.

usage: python -m scripts.bench_s3_requests [--docs 1000000] [--workers 2] [--keep-work]

A real S3 API server on localhost (moto's server mode, `moto_server`, a separate process speaking HTTP, as
the tests use) logs every request it answers. The script writes the scale benchmark's synthetic corpus
(`scripts.bench_driver_memory.write_corpus`: short documents, 5% exact and 10% near copies, 16 JSONL files),
uploads it to `s3://bench/in/`, then runs `datapipe curate` as a fresh process with input and output on the
server (`--output s3://bench/run`, exact and near dedup with verification, the scale benchmark's recipe) and
counts the requests of the run from the server's log: by HTTP method and by the top folder of the key they
name (`work/read`, `work/minhash`, `shards`, `in` for the input reads, ...), and per input document. With
`--keep-work` it also lists what work/ holds at the end (objects per folder). The server's requests are what
a real S3 bucket would be billed for and would answer at its per-request latency (`scripts/cost_model.py`).
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
from pathlib import Path

from scripts.bench_driver_memory import write_corpus

REPO = Path(__file__).resolve().parents[1]
BUCKET = "bench"
# werkzeug's access log line: "METHOD /bucket/key?query HTTP/1.1" STATUS
_LINE = re.compile(r'"(GET|PUT|POST|HEAD|DELETE) (/[^ ?"]*)(\?[^ "]*)? HTTP/[0-9.]+" (\d{3})')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _folder(key: str) -> str:
    """The phase a key belongs to: `run/work/minhash/buckets/x` -> work/minhash, `run/shards/...` -> shards."""
    parts = key.split("/")
    if parts[0] == "in":
        return "in (input reads)"
    parts = parts[1:]  # below run/
    if not parts or not parts[0]:
        return "run (listing)"
    if parts[0] == "work" and len(parts) > 2:
        return f"work/{parts[1]}"
    return parts[0] if len(parts) > 1 else f"{parts[0]} (file)"


def count_requests(log: Path, start: int) -> dict[str, Counter]:
    by_folder: dict[str, Counter] = {}
    with open(log, "rb") as f:
        f.seek(start)
        for raw in f:
            m = _LINE.search(raw.decode("utf-8", "replace"))
            if not m:
                continue
            method, path = m.group(1), m.group(2).lstrip("/")
            key = path[len(BUCKET) + 1:] if path.startswith(BUCKET + "/") else ""
            folder = _folder(key) if key else ("bucket (list)" if method == "GET" else "bucket")
            by_folder.setdefault(folder, Counter())[method] += 1
    return by_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--keep-work", action="store_true")
    args = parser.parse_args()
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
        corpus = write_corpus(root / "corpus", args.docs)
        for f in sorted((root / "corpus").glob("*.jsonl")):
            fs.put_file(str(f), f"{BUCKET}/in/{f.name}")
        config = {
            "inputs": [{"path": f"s3://{BUCKET}/in/*.jsonl", "domain": "web"}],
            "dedup": {"exact": {"enabled": True}, "minhash": {"enabled": True}},
            "filters": {},
            "tokenizer": {"train": {"vocab_size": 2048, "sample_bytes": 2_000_000}},
            "ray": {"num_cpus": args.workers},
            "output": {"dir": f"s3://{BUCKET}/run", "keep_work": args.keep_work},
        }
        recipe = root / "recipe.json"
        recipe.write_text(json.dumps(config))
        log.flush()
        start = log_path.stat().st_size
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "datapipe.cli", "curate", str(recipe), "--no-progress"], cwd=REPO, env=env,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if run.returncode != 0:
            raise SystemExit(f"curate failed:\n{run.stderr[-4000:]}")
        time.sleep(0.5)
        log.flush()
        by_folder = count_requests(log_path, start)
        total = sum(sum(c.values()) for c in by_folder.values())
        stats = json.loads(fs.cat_file(f"{BUCKET}/run/stats.json"))
        objects = Counter()
        if args.keep_work:
            for key in fs.find(f"{BUCKET}/run/work"):
                objects[_folder(key[len(BUCKET) + 1:])] += 1
        report = {
            "command": f"python -m scripts.bench_s3_requests --docs {args.docs} --workers {args.workers}"
                       + (" --keep-work" if args.keep_work else ""),
            "server": "moto_server (localhost)",
            "corpus": corpus,
            "wall_seconds": round(wall, 1),
            "phase_seconds": stats["phase_seconds"],
            "requests_total": total,
            "requests_per_document": round(total / args.docs, 5),
            "requests_by_folder": {k: dict(v) for k, v in sorted(by_folder.items())},
            "puts_per_document": round(sum(c["PUT"] + c["POST"] for c in by_folder.values()) / args.docs, 5),
            **({"work_objects_by_folder": dict(sorted(objects.items()))} if objects else {}),
        }
        print(json.dumps(report, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
