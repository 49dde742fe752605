"""The exact check's reads (one fetch task's) on an S3 API server with a latency: wall, requests, requests in flight.

usage: python -m scripts.bench_exact_check [--corpus ../shared/data/corpus.jsonl.gz] [--blocks 512]
           [--documents-per-block 40] [--wanted 512] [--latency 0.03] [--baseline-tree /tmp/datapipe-old] [--rounds 2]

Writes `--blocks` read blocks of the corpus's documents (`--documents-per-block` each, in corpus order) to a
moto S3 server (a separate process, as the tests' `s3_server`), behind a proxy that holds every request
`--latency` seconds and counts the range reads in flight (`datapipe.testing.latency_proxy`). Then, in a fresh
process, one fetch task's reads: `near_dedup.read_frames` for `--wanted` documents drawn at random (seeded) from
the blocks. Reports
the call's wall, its process's CPU seconds, the requests the server saw and the most in flight at once. With
`--baseline-tree` (a checkout of an earlier commit, `git archive <commit> | tar -x -C DIR`) the same call from that
tree runs beside this one's, on the same blocks and documents, the trees alternating `--rounds` times after an
untimed run of each (which compiles a fresh tree's numba loops). Before the timed call the task's S3 client is
made and connected (one HEAD request), as a worker's is by the task's earlier reads. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np

from datapipe.testing.latency_proxy import LatencyProxy
from scripts.corpus import DEFAULT, load_docs

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bench-exact-check"

# One fetch task's reads in a fresh process: argv = tree, work URL, senders, orders, at, nbytes (JSON lists). A tree
# from before the fetch tasks has no `read_frames`: its verify task's reads (`text_shingle_sets`) are timed instead.
_TASK = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import pyarrow as pa
from datapipe.curation.phases import near_dedup
from stages.minhash import MinHashConfig
work, senders, orders, at, nbytes = sys.argv[2], json.loads(sys.argv[3]), *(np.array(json.loads(a), np.int64) for a in sys.argv[4:7])
source = near_dedup.KeySource(work, work, tuple(senders))
blocks = np.array([o // 10**6 for o in orders.tolist()])
from datapipe.core.storage import location
location(work).fs.info(location(work).path + "/read")  # the client made and connected, as a worker's is by a task's first read
started = time.perf_counter()
if hasattr(near_dedup, "read_frames"):
    wanted = pa.table({"order": orders, "sender": blocks.astype(np.int32), "text_at": at, "text_bytes": nbytes,
                       "group": np.zeros(len(orders), np.int32)}, schema=near_dedup.WANTED_SCHEMA)
    found, read = near_dedup.read_frames(source, wanted)
else:
    found, read = near_dedup.text_shingle_sets(source, orders, blocks, at, nbytes, MinHashConfig())
wall = time.perf_counter() - started
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"wall_s": round(wall, 3), "process_cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
                  "documents": len(found), **read}))
"""


def start_moto() -> tuple[subprocess.Popen, str]:
    server = shutil.which("moto_server")
    if server is None:
        raise SystemExit("moto_server is not installed: pip install 'moto[server]'")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"moto_server did not start on {endpoint}")
            time.sleep(0.1)


def write_blocks(work: str, corpus: str, blocks: int, per_block: int) -> tuple[np.ndarray, np.ndarray]:
    """The read blocks `b0`... of the corpus's first documents (orders block * 10**6 + row); their frames by order."""
    from datapipe.core.storage import location
    from datapipe.testing.read_blocks import write_read_blocks

    texts = [d["text"] for d in load_docs(corpus, blocks * per_block)]
    by_block = [texts[b * per_block : (b + 1) * per_block] for b in range(blocks)]
    at, nbytes = write_read_blocks(location(work), by_block)
    return at.reshape(blocks, per_block), nbytes.reshape(blocks, per_block)


def run_task(tree: Path, work: str, senders: list[str], orders: np.ndarray, at: np.ndarray, nbytes: np.ndarray,
             proxy: LatencyProxy) -> dict:
    proxy.reset()
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint, "PYTHONPATH": str(tree)}
    args = [json.dumps(senders), *(json.dumps(a.tolist()) for a in (orders, at, nbytes))]
    proc = subprocess.run([sys.executable, "-c", _TASK, str(tree), work, *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the task failed ({tree}):\n{proc.stderr[-3000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "server_range_requests": proxy.ranges,
            "server_most_in_flight": proxy.most_in_flight}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default=DEFAULT)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--documents-per-block", type=int, default=40)
    parser.add_argument("--wanted", type=int, default=512, help="documents the task checks, drawn from all blocks")
    parser.add_argument("--latency", type=float, default=0.03, help="seconds the proxy holds each request")
    parser.add_argument("--baseline-tree", default=None)
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each tree, alternating")
    args = parser.parse_args()
    trees = {"this": ROOT, **({"baseline": Path(args.baseline_tree).resolve()} if args.baseline_tree else {})}
    moto, endpoint = start_moto()
    try:
        os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                           "AWS_DEFAULT_REGION": "us-east-1"})
        import s3fs

        s3fs.S3FileSystem().mkdir(BUCKET)
        work = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/work"
        at, nbytes = write_blocks(work, args.corpus, args.blocks, args.documents_per_block)
        picked = np.random.default_rng(0).choice(args.blocks * args.documents_per_block, args.wanted, replace=False)
        block, row = picked // args.documents_per_block, picked % args.documents_per_block
        orders = block * 10**6 + row  # the task script recovers each document's block (sender) from its order
        senders = [f"read/b{b}" for b in range(args.blocks)]
        report = {"corpus": args.corpus, "blocks": args.blocks, "documents_per_block": args.documents_per_block,
                  "wanted": args.wanted, "blocks_wanted": int(len(np.unique(block))), "latency_s": args.latency, "runs": {}}
        with LatencyProxy(endpoint, args.latency) as proxy:
            for name, tree in trees.items():  # untimed: a fresh tree compiles its numba loops once
                run_task(tree, work, senders, orders[:8], at[block, row][:8], nbytes[block, row][:8], proxy)
            for r in range(args.rounds):
                for name, tree in trees.items():
                    result = run_task(tree, work, senders, orders, at[block, row], nbytes[block, row], proxy)
                    report["runs"].setdefault(name, []).append(result)
                    print(f"{name} round {r + 1}: {result}", file=sys.stderr, flush=True)
    finally:
        moto.terminate()
        moto.wait(timeout=10)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
