"""The whole quickstart recipe's process-tree CPU against datasketch's near dedup alone, same corpus, side by side;
prints one JSON object, with where the recipe's CPU went.

    python -m scripts.bench_pipeline_vs_datasketch [--corpus ../shared/data/corpus.jsonl.gz] [--docs N] [--rounds 2]
                                                   [--workers 2]

Each round runs, one after the other, each a fresh process tree:
- `datapipe curate configs/quickstart.yaml --input CORPUS --set inputs.0.domain_field=domain --set ray.num_cpus=N`:
  everything a user's first run does (read, normalize, exact and near dedup, the recipe's filters, the tokenizer's
  training, tokenize, the eval split, shards), Ray's daemons and workers included: the tree's CPU read from /proc
  every 0.1 s, per process. It runs through `scripts.curate_traced` (the CLI's own code, plus a line per stage
  and per task: when it ran, its CPU), so that the CPU can be split by stage and by process (`breakdown`);
- datasketch's near dedup alone, at its best (`scripts.bench_near_dedup`'s: `MinHash(128).update_batch` over the
  same word 5-gram shingles, `MinHashLSH` at 0.8, query then insert, one pass): the process's CPU, its imports and
  its reading of the corpus included, as the pipeline's are.
The ratio is the pipeline's CPU over datasketch's (goal ≤ 1); each figure is the median over the rounds, and the
breakdown is the median round's.

`breakdown`: per interval of the run (`python_and_cli`: the interpreter's start, the CLI's imports and the config,
up to `curate`; then `stats.json`'s `phase_seconds` entries: "start" (the plan, Ray's start, the driver's early
read), each stage, "write", "clean up", "shutdown"; then `report`, the CLI's summary, and `exit`, the interpreter's)
its wall and the tree's CPU in it, split into the driver, Ray's daemons (GCS, raylet, agents, log monitor) and the
workers, theirs into in tasks and outside them (a worker's start-up before its first task, the imports a task's
code needs as Ray unpickles it, Ray's own threads between tasks); per step (`Phase.step`), its tasks' CPU and how
much more each worker's first task of it took than the step's median task (`first_task_extra_cpu_s`: the tables,
compiled kernels and tokenizer a worker builds or loads on first use); the workers' CPU before their first task, in
tasks and the rest; per process kind, its CPU and count. The sampling misses a process's last <0.1 s and any process
that lives less than 0.1 s (BENCHMARKS.md says how much).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from scripts.bench_near_dedup import run_datasketch
from scripts.corpus import load_docs, tree_cpu_seconds

REPO = Path(__file__).resolve().parents[1]


def _kind(pid: int, root: int, cmd: str) -> str:
    """What a process of the run's tree is, from its command line (Ray's Python processes rename themselves
    `ray::IDLE`, `ray::segment_task`, `ray::DashboardAgent`; the raylet's own names the worker's script)."""
    program = os.path.basename(cmd.split(" ")[0])
    if pid == root:
        return "driver"
    if program in ("gcs_server", "raylet"):
        return f"ray_{program}"
    if "Agent" in cmd or "agent" in program or "/agent" in cmd:
        return "ray_agents"
    if "log_monitor" in cmd:
        return "ray_log_monitor"
    if cmd.startswith("ray::") or "default_worker.py" in cmd:
        return "worker"
    return "other: " + program


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


class TreeSampler:
    """Every 0.1 s, the CPU seconds of each process under `root` (`series`: pid -> [(time, cpu)]) and its
    command line as last seen (`commands`). A process's last <0.1 s can be missed."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.series: dict[int, list[tuple[float, float]]] = {}
        self.commands: dict[int, str] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._done.is_set():
            now, cpu = time.time(), {}
            tree_cpu_seconds(self.root, cpu)
            for pid, seconds in cpu.items():
                self.series.setdefault(pid, []).append((now, seconds))
                if not self.commands.get(pid, "").startswith("ray::"):
                    self.commands[pid] = _command_line(pid) or self.commands.get(pid, "")
            self._done.wait(0.1)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()

    def cpu_at(self, pid: int, t: float) -> float:
        """The process's CPU seconds at time `t`, linear between samples (0 before its first sample's
        predecessor, its last sample's figure after it)."""
        points = self.series[pid]
        if t >= points[-1][0]:
            return points[-1][1]
        before = (points[0][0] - 0.1, 0.0)
        for point in points:
            if point[0] >= t:
                share = (t - before[0]) / (point[0] - before[0]) if point[0] > before[0] else 1.0
                return before[1] + max(0.0, min(1.0, share)) * (point[1] - before[1])
            before = point
        return points[-1][1]

    def total(self) -> float:
        return sum(points[-1][1] for points in self.series.values())


def pipeline_run(jsonl: Path, out: Path, workers: int) -> dict[str, Any]:
    """Wall, process-tree CPU and `breakdown` of the quickstart recipe on `jsonl`, in a fresh process tree."""
    events = out.with_suffix(".events.jsonl")
    cmd = [sys.executable, "-m", "scripts.curate_traced", str(events), str(REPO / "configs" / "quickstart.yaml"),
           "--input", str(jsonl), "--output", str(out), "--set", "inputs.0.domain_field=domain",
           "--set", f"ray.num_cpus={workers}"]
    spawned = time.time()
    proc = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    _, err = proc.communicate()
    ended = time.time()
    sampler.stop()
    if proc.returncode != 0:
        raise SystemExit(f"datapipe curate failed:\n{err.decode()[-3000:]}")
    trace = [json.loads(line) for line in events.read_text().splitlines()]
    return {"wall_s": ended - spawned, "cpu_s": sampler.total(),
            "breakdown": breakdown(sampler, trace, spawned, ended)}


def breakdown(sampler: TreeSampler, trace: list[list[Any]], spawned: float, ended: float) -> dict[str, Any]:
    """Where the tree's CPU went: per interval, per step, per process kind (the module docstring says how)."""
    kinds = {pid: _kind(pid, sampler.root, sampler.commands.get(pid, "")) for pid in sampler.series}
    tasks = [row for row in trace if row[0] == "task"]
    begin = next(row[1] for row in trace if row[0] == "begin")
    returned = next((row[1] for row in trace if row[0] == "returned"), ended)
    # (interval, its end) in time order; each lap names the interval it ends, as `Run.lap` charges it
    ends = [("python_and_cli", begin), *((row[1], row[2]) for row in trace if row[0] == "lap"), ("report", returned),
            ("exit", ended)]
    intervals: dict[str, dict[str, float]] = {}
    for (name, t1), t0 in zip(ends, [spawned, *(t for _, t in ends)]):
        row = intervals.setdefault(name, dict.fromkeys(("wall_s", "cpu_s", "driver_s", "ray_daemons_s",
                                                        "workers_in_tasks_s", "workers_outside_tasks_s"), 0.0))
        row["wall_s"] += t1 - t0
        for pid, kind in kinds.items():
            spent = sampler.cpu_at(pid, t1) - sampler.cpu_at(pid, t0)
            row["cpu_s"] += spent
            row[{"driver": "driver_s", "worker": "workers_outside_tasks_s"}.get(kind, "ray_daemons_s")] += spent
        in_tasks = sum(_overlap(task[3], task[4], t0, t1) * task[5] for task in tasks if task[2] in kinds)
        row["workers_in_tasks_s"] += in_tasks
        row["workers_outside_tasks_s"] -= in_tasks
    return {
        "intervals": {name: {k: round(v, 2) for k, v in row.items()} for name, row in intervals.items()},
        "steps": _steps(tasks),
        "workers": _workers(sampler, kinds, tasks),
        "processes": _processes(sampler, kinds),
    }


def _overlap(start: float, end: float, t0: float, t1: float) -> float:
    """The share of [start, end] inside [t0, t1]."""
    if end <= start:
        return 1.0 if t0 <= start < t1 else 0.0
    return max(0.0, min(end, t1) - max(start, t0)) / (end - start)


def _steps(tasks: list[list[Any]]) -> dict[str, dict[str, float]]:
    """Per step: tasks, their CPU, and the extra CPU of each worker's first task of it over the step's median."""
    out: dict[str, dict[str, float]] = {}
    for step in dict.fromkeys(task[1] for task in tasks):
        rows = sorted((task for task in tasks if task[1] == step), key=lambda task: task[3])
        median = statistics.median(task[5] for task in rows)
        firsts = {task[2]: task for task in reversed(rows)}.values()
        out[step] = {"tasks": len(rows), "cpu_s": round(sum(task[5] for task in rows), 2),
                     "first_task_extra_cpu_s": round(sum(max(0.0, task[5] - median) for task in firsts), 2)}
    return out


def _workers(sampler: TreeSampler, kinds: dict[int, str], tasks: list[list[Any]]) -> dict[str, float]:
    """The workers' CPU: before their first task (start-up, Ray's imports), in tasks, and the rest (between
    tasks and after the last: Ray's own threads, idle polling, exit)."""
    pids = [pid for pid, kind in kinds.items() if kind == "worker"]
    before = sum(sampler.cpu_at(pid, min((t[3] for t in tasks if t[2] == pid), default=float("inf"))) for pid in pids)
    in_tasks = sum(t[5] for t in tasks if t[2] in pids)
    total = sum(sampler.series[pid][-1][1] for pid in pids)
    return {"count": len(pids), "ran_tasks": len({t[2] for t in tasks if t[2] in pids}), "cpu_s": round(total, 2),
            "before_first_task_s": round(before, 2), "in_tasks_s": round(in_tasks, 2),
            "rest_s": round(total - before - in_tasks, 2)}


def _processes(sampler: TreeSampler, kinds: dict[int, str]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for pid, kind in kinds.items():
        row = out.setdefault(kind, {"count": 0, "cpu_s": 0.0})
        row["count"] += 1
        row["cpu_s"] = round(row["cpu_s"] + sampler.series[pid][-1][1], 2)
    return dict(sorted(out.items(), key=lambda item: -item[1]["cpu_s"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz")
    parser.add_argument("--docs", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    docs = load_docs(args.corpus, args.docs)
    tmp = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    try:
        jsonl = tmp / "input.jsonl"
        jsonl.write_bytes(b"".join(orjson.dumps(d) + b"\n" for d in docs))
        runs, datasketch = [], []
        for r in range(args.rounds):
            runs.append(pipeline_run(jsonl, tmp / f"out-{r}", args.workers))
            shutil.rmtree(tmp / f"out-{r}")
            result, ds_cpu = run_datasketch(jsonl, "stream")
            datasketch.append(ds_cpu)
        pipeline = [run["cpu_s"] for run in runs]
        median_round = sorted(range(len(runs)), key=lambda r: pipeline[r])[(len(runs) - 1) // 2]
        print(json.dumps({
            "documents": len(docs), "text_MB": round(sum(len(d["text"].encode()) for d in docs) / 1e6, 1),
            "workers": args.workers, "load_average": [round(x, 2) for x in os.getloadavg()],
            "pipeline_tree_cpu_s": [round(x, 1) for x in pipeline],
            "pipeline_wall_s": [round(run["wall_s"], 1) for run in runs],
            "datasketch_near_dedup_cpu_s": [round(x, 1) for x in datasketch],
            "datasketch_removed": result["removed"],
            "pipeline_over_datasketch": round(statistics.median(pipeline) / statistics.median(datasketch), 2),
            "breakdown_round": median_round + 1, "breakdown": runs[median_round]["breakdown"],
        }, indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
