"""The shared corpus (../shared/data/corpus.jsonl.gz) as documents, for the benchmark scripts."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
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
    "import json,sys,time; from datapipe.curation.config import CurateConfig; from datapipe.core.config import from_dict;"
    "from datapipe import curate; import datapipe.curation.executors as ex;"
    "cfg=from_dict(CurateConfig, json.loads(sys.argv[1])); e=ex.RayExecutor(num_cpus=cfg.ray.num_cpus, progress=False);"
    "t=time.perf_counter(); r=curate(cfg, executor=e, progress=False, log=lambda _: None); dt=time.perf_counter()-t;"
    "print(json.dumps({'seconds': dt, 'docs': r.manifest['total_docs'], 'tokens': r.manifest['total_tokens'],"
    "'phases': r.stats['phase_seconds'], 'global_stages': r.stats['global_stages'],"
    "'sha256': [s['sha256'] for s in r.manifest['shards']]}))"
)


def curate_in_fresh_process(cfg: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Run `datapipe.curation.run.curate` on plain config data in a new Python process, so Ray starts with
    exactly `ray.num_cpus` CPUs and timings share no caches. Returns (summary, the run's stderr)."""
    proc = subprocess.run([sys.executable, "-c", _CURATE, json.dumps(cfg)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"curate failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def tree_cpu_seconds(root: int, seen: dict[int, float]) -> None:
    """Record the CPU seconds (user + system) of `root` and every process under it into `seen` {pid: s}."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])  # fields after "(comm)": state, ppid, ...; utime, stime at 11, 12
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    for pid in tree & set(times):
        seen[pid] = max(seen.get(pid, 0.0), times[pid])


def run_measured(cmd: list[str], cwd: str | Path, env: dict[str, str]) -> tuple[int, bytes, float, float]:
    """Run `cmd` as a fresh process tree: (its exit code, its stderr, wall seconds, the CPU seconds of the whole tree:
    read from /proc every 0.1 s, so a process's last <0.1 s can be missed)."""
    seen: dict[int, float] = {}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            tree_cpu_seconds(proc.pid, seen)
            done.wait(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    return proc.returncode, err, wall, sum(seen.values())
