"""The curation scale benchmark: driver memory, work files, objects and CPU per phase.

usage: python -m scripts.bench_driver_memory [--base 625000] [--scales 1,4,16] [--workers 2] [--partitions auto]
           [--no-verify] [--keep DIR]

For each scale s, a synthetic corpus of s x BASE short documents (by default 100-300 bytes of text: 15-45 words;
`--doc-words 150,200` gives ~1 KB, the size of 1 TB / 1 B documents) drawn from a 20,000-word vocabulary, Zipf-like) in 16 JSONL files, with planted duplicates: 5% exact
copies of an earlier document and 10% near copies (an earlier document with one word added at its
end or one word dropped from it: word 5-gram Jaccard >= 0.9), all seeded. `--near-threshold-share 0.01` plants
1% more copies at Jaccard 0.76-0.84, near the 0.8 threshold, which near dedup's exact check decides (the report's
`exact_check`: pairs checked, the bytes read for them and the bytes of their texts). Then the whole pipeline,
`datapipe curate` with exact and near dedup (no filters, a trained 2,048-token tokenizer, `auto`
blocks and shards) on the embedded Ray with `--workers` CPUs, as a fresh process tree; the same
config at every scale (`--partitions`, default `auto`: chosen from the input's size; with a fixed count a worker's share of a partition grows
with the corpus, the driver's share must not). `--no-verify` sets `dedup.minhash.verify: false`:
candidates are not checked against the threshold, so no signature is stored. (Before this layout every
bucket row held the document's 128-value signature, 16 bands: several KB of work files a document, which
for 10 M documents was more than this machine's free disk; now the signature is stored once, 16 bits a
value, and shingles are recomputed from the text for the pairs near the threshold.)

The run keeps its work folder (`output.keep_work: true`) so that the script can count it: per top folder
of work/ (a phase: read, seg0, exact_dedup, minhash, tokens, ...) its bytes, its files and its task
records (`.json`: one per task), the bytes per input document, and work bytes over input text bytes.

Every 0.5 s the script reads /proc: the RSS of the CLI process (the driver) and of every process under
it (Ray's workers, raylet, GCS...), and their CPU seconds. It reports per scale: the driver's peak RSS
(sampled, and the kernel's high-water mark `VmHWM` read at the last sample), the largest peak RSS of any
one Ray worker process, the peak of the whole tree's RSS (driver excluded), wall and CPU seconds
(user + system of the tree), the documents and near duplicates removed, and stats.json's phase seconds.
Prints one JSON object; `driver_rss_growth_1x_to_max` is the driver's peak at the largest scale over
the one at the smallest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

FILES = 16
VOCAB = 20_000
EXACT_SHARE, NEAR_SHARE = 0.05, 0.10


NGRAM = 5  # near dedup's default shingle: word 5-grams
NEAR_THRESHOLD_J = (0.76, 0.84)  # the Jaccard a near-threshold copy is made for (the threshold is 0.8)


def near_threshold_copy(words: list[str], target_j: float, serial: int) -> list[str]:
    """`words` with c of them replaced by fresh words ("zSERIALk"), spread at least NGRAM apart, so that the copy's
    word 5-gram Jaccard with the original is (N - 5c) / (N + 5c) for N shingles, c chosen to land nearest `target_j`."""
    n = len(words) - NGRAM + 1
    c = max(1, round(n * (1 - target_j) / (NGRAM * (1 + target_j))))
    copy = list(words)
    for k, at in enumerate(np.linspace(NGRAM, len(words) - NGRAM - 1, c).astype(int).tolist()):
        copy[at] = f"z{serial}x{k}"
    return copy


def shingle_jaccard(a: list[str], b: list[str]) -> float:
    sa = {tuple(a[i:i + NGRAM]) for i in range(len(a) - NGRAM + 1)}
    sb = {tuple(b[i:i + NGRAM]) for i in range(len(b) - NGRAM + 1)}
    return len(sa & sb) / max(len(sa | sb), 1)


def write_corpus(folder: Path, docs: int, seed: int = 0, doc_words: tuple[int, int] = (15, 45),
                 near_threshold_share: float = 0.0) -> dict[str, Any]:
    """`docs` short documents in FILES JSONL files under `folder`; returns counts of what was planted. With
    `near_threshold_share`, that share of the documents are copies of an earlier one whose word 5-gram Jaccard
    with it is drawn from NEAR_THRESHOLD_J (`near_threshold_copy`): near dedup's exact check decides them."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    words = np.array([f"w{i}" for i in range(VOCAB)], dtype=object)
    weights = 1.0 / np.arange(1, VOCAB + 1) ** 0.8
    weights /= weights.sum()
    per_file = -(-docs // FILES)
    texts: list[str] = []  # recent originals only (copies point back at most this far): bounded memory
    planted: dict[str, Any] = {"exact": 0, "near": 0, "near_threshold": 0}
    jaccards: list[float] = []
    n = 0
    for f in range(FILES):
        count = min(per_file, docs - n)
        lengths = rng.integers(doc_words[0], doc_words[1] + 1, size=count)
        drawn = rng.choice(VOCAB, size=int(lengths.sum()), p=weights)
        kind = rng.random(count)
        lines = []
        start = 0
        for i in range(count):
            text = " ".join(words[drawn[start:start + lengths[i]]])
            start += lengths[i]
            if texts and kind[i] >= 1 - near_threshold_share:
                base = texts[int(rng.integers(len(texts)))].split(" ")
                copy = near_threshold_copy(base, float(rng.uniform(*NEAR_THRESHOLD_J)), n + i)
                jaccards.append(shingle_jaccard(base, copy))
                text = " ".join(copy)
                planted["near_threshold"] += 1
            elif texts and kind[i] < EXACT_SHARE:
                text = texts[int(rng.integers(len(texts)))]
                planted["exact"] += 1
            elif texts and kind[i] < EXACT_SHARE + NEAR_SHARE:
                base = texts[int(rng.integers(len(texts)))]
                text = base + " extra" if kind[i] < EXACT_SHARE + NEAR_SHARE / 2 else base.rsplit(" ", 1)[0]
                planted["near"] += 1
            else:
                texts.append(text)
                if len(texts) > 50_000:
                    texts = texts[-25_000:]
            lines.append(orjson.dumps({"id": f"d{n + i}", "text": text}))
        (folder / f"part-{f:02d}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
        n += count
    if jaccards:
        j = np.array(jaccards)
        planted["near_threshold_jaccard"] = {"min": round(float(j.min()), 4), "median": round(float(np.median(j)), 4),
                                             "max": round(float(j.max()), 4),
                                             "share_in_0.75_0.85": round(float(((j >= 0.75) & (j <= 0.85)).mean()), 4)}
    return {"docs": docs, "files": FILES, "bytes": sum(p.stat().st_size for p in folder.glob("*.jsonl")), "planted": planted}


def _proc_table() -> dict[int, tuple[int, float, int, str]]:
    """pid -> (ppid, CPU seconds, RSS bytes, command name) of every process."""
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            comm = stat[stat.index("(") + 1: stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
        # fields after "(comm)": state, ppid, ...; utime, stime at 11, 12; rss (pages) at 21
        out[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, int(fields[21]) * page, comm)
    return out


def _hwm(pid: int) -> int:
    """The kernel's peak RSS of `pid` (VmHWM), bytes; 0 when gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreeSampler:
    """Samples the RSS and CPU seconds of a process and everything under it every `every_s` seconds."""

    def __init__(self, root: int, every_s: float = 0.5) -> None:
        self.root, self.every_s = root, every_s
        self.driver_peak = self.driver_hwm = self.tree_peak = 0
        self.worker_peak: dict[str, int] = {}  # command name -> the largest RSS of one such process
        self.cpu: dict[int, float] = {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        table = _proc_table()
        tree, frontier = {self.root}, [self.root]
        while frontier:
            parent = frontier.pop()
            for pid, (ppid, *_rest) in table.items():
                if ppid == parent and pid not in tree:
                    tree.add(pid)
                    frontier.append(pid)
        total = 0
        for pid in tree & set(table):
            _, cpu, rss, comm = table[pid]
            self.cpu[pid] = max(self.cpu.get(pid, 0.0), cpu)
            if pid == self.root:
                self.driver_peak = max(self.driver_peak, rss)
                self.driver_hwm = max(self.driver_hwm, _hwm(pid))
            else:
                total += rss
                self.worker_peak[comm] = max(self.worker_peak.get(comm, 0), rss)
        self.tree_peak = max(self.tree_peak, total)

    def _run(self) -> None:
        while not self.done.is_set():
            self._sample()
            self.done.wait(self.every_s)

    def __enter__(self) -> "TreeSampler":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.thread.join()


def work_files(work: Path) -> dict[str, dict[str, int]]:
    """Per top folder of work/ (and "total"): bytes, files, and task records (`.json` files: a task writes
    one, last); objects per task = files / records."""
    out: dict[str, dict[str, int]] = {}
    for dirpath, _dirs, files in os.walk(work):
        parts = Path(dirpath).relative_to(work).parts
        entry = out.setdefault(parts[0] if parts else ".", {"bytes": 0, "files": 0, "records": 0})
        for name in files:
            entry["bytes"] += (Path(dirpath) / name).stat().st_size
            entry["files"] += 1
            entry["records"] += name.endswith(".json")
    out["total"] = {k: sum(v[k] for v in out.values()) for k in ("bytes", "files", "records")}
    return dict(sorted(out.items()))


def run_scale(corpus: Path, out: Path, workers: int, partitions: int | str, verify: bool) -> dict[str, Any]:
    repo = Path(__file__).parents[1]
    config = {
        "inputs": [{"path": str(corpus / "*.jsonl"), "domain": "web"}],
        "dedup": {"exact": {"enabled": True, "partitions": partitions},
                  "minhash": {"enabled": True, "partitions": partitions, "verify": verify}},
        "filters": {},
        "tokenizer": {"train": {"vocab_size": 2048, "sample_bytes": 2_000_000}},
        "ray": {"num_cpus": workers},
        "output": {"dir": str(out), "keep_work": True},
    }
    recipe = out.parent / f"{out.name}.json"
    recipe.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "datapipe.cli", "curate", str(recipe), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(repo)}  # this checkout's code, in the CLI and in every Ray worker
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with TreeSampler(proc.pid) as sampler:
        _, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"curate failed:\n{err.decode()[-4000:]}")
    stats = json.loads((out / "stats.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    workers_rss = {k: v for k, v in sampler.worker_peak.items() if k.startswith("ray::")}
    mib = 1 << 20
    work = work_files(out / "work")
    read_docs = sum(row["read"] for row in stats["inputs"])
    text_bytes = sum(d["bytes_out"] for f in stats["funnel"] if f["stage"] == "read" for d in f["domains"].values())
    return {
        "work_bytes_per_doc": round(work["total"]["bytes"] / max(read_docs, 1), 1),
        "work_over_text": round(work["total"]["bytes"] / max(text_bytes, 1), 3),
        "work_by_phase": work,
        "driver_peak_rss_mib": round(sampler.driver_peak / mib, 1),
        "driver_vmhwm_mib": round(sampler.driver_hwm / mib, 1),
        "worker_peak_rss_mib": round(max(workers_rss.values(), default=0) / mib, 1),
        "worker_peak_rss_by_name_mib": {k: round(v / mib, 1) for k, v in sorted(workers_rss.items())},
        "ray_daemons_peak_rss_mib": {k: round(v / mib, 1) for k, v in sorted(sampler.worker_peak.items())
                                     if not k.startswith("ray::") and v > 50 * mib},
        "tree_peak_rss_mib_without_driver": round(sampler.tree_peak / mib, 1),
        "wall_seconds": round(wall, 1),
        "cpu_seconds": round(sum(sampler.cpu.values()), 1),
        "phase_seconds": stats["phase_seconds"],
        "step_seconds": stats.get("step_seconds", {}),  # the executor's steps within the stages (the cost model's input)
        "kept_docs": manifest["total_docs"],
        "shards": manifest["num_shards"],
        "removed": {name: s.get("removed") for name, s in stats["global_stages"].items()},
        "exact_check": _exact_check(stats["global_stages"].get("minhash", {})),
        "near_dedup": stats["global_stages"].get("minhash", {}),  # candidate pairs, edges, rounds, clusters, tasks
        "blocks": sum(1 for _ in (out / "work" / "read").glob("*.arrow")),
    }


def _exact_check(minhash: dict[str, Any]) -> dict[str, Any]:
    """Near dedup's exact-Jaccard check: pairs checked, bytes read for it and the bytes of the texts read."""
    read, text = minhash.get("exact_bytes_read", 0), minhash.get("exact_text_bytes", 0)
    return {"pairs_checked": minhash.get("exact_checked", 0), "bytes_read": read, "text_bytes": text,
            "read_over_text": round(read / text, 3) if text else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=int, default=625_000, help="documents at scale 1 (default 625,000: 16x = 10 M)")
    p.add_argument("--scales", default="1,4,16")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--partitions", default="auto", help="dedup.exact.partitions and dedup.minhash.partitions (auto: the default)")
    p.add_argument("--doc-words", default="15,45", help="MIN,MAX words a document (15,45: ~185 bytes; 150,200: ~1 KB, "
                   "the size of 1 TB / 1 B documents)")
    p.add_argument("--no-verify", action="store_true", help="dedup.minhash.verify: false (much smaller work files)")
    p.add_argument("--near-threshold-share", type=float, default=0.0,
                   help="share of documents planted as copies at word 5-gram Jaccard 0.76-0.84 (the exact check decides them)")
    p.add_argument("--keep", default=None, help="folder for the corpora and outputs (default: a temporary one, deleted)")
    args = p.parse_args()
    args.partitions = args.partitions if args.partitions == "auto" else int(args.partitions)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-driver-memory-"))
    results: dict[str, Any] = {
        "command": f"python -m scripts.bench_driver_memory --base {args.base} --scales {args.scales} --workers {args.workers}"
                   + f" --partitions {args.partitions} --doc-words {args.doc_words}" + (" --no-verify" if args.no_verify else "")
                   + (f" --near-threshold-share {args.near_threshold_share}" if args.near_threshold_share else ""),
        "minhash_verify": not args.no_verify,
        "cpus": os.cpu_count(), "workers": args.workers, "load_avg_1min_at_start": round(os.getloadavg()[0], 2), "scales": {},
    }
    try:
        for scale in [int(s) for s in args.scales.split(",")]:
            corpus = root / f"corpus-{scale}x"
            t0 = time.perf_counter()
            planted = write_corpus(corpus, scale * args.base, doc_words=tuple(int(x) for x in args.doc_words.split(",")),
                                   near_threshold_share=args.near_threshold_share)
            entry = {"corpus": planted, "generate_seconds": round(time.perf_counter() - t0, 1)}
            entry.update(run_scale(corpus, root / f"out-{scale}x", args.workers, args.partitions, not args.no_verify))
            entry["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
            results["scales"][f"{scale}x"] = entry
            print(json.dumps({f"{scale}x": entry}), file=sys.stderr, flush=True)
            if not args.keep:
                shutil.rmtree(corpus, ignore_errors=True)
                shutil.rmtree(root / f"out-{scale}x", ignore_errors=True)
        runs = list(results["scales"].values())
        results["driver_rss_growth_1x_to_max"] = round(runs[-1]["driver_peak_rss_mib"] / runs[0]["driver_peak_rss_mib"], 3)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
