"""The user's path without a traceback: progress as one line per stage, a dead Ray worker
as one line, `datapipe run` on a finished folder, and the README's own curate command writing only
under its output folder."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from helpers import ASSETS, small_config
from datapipe.cli import main
from datapipe.curation import embedded
from datapipe.curation.executors import LocalExecutor, WorkerDeathFilter
from datapipe import curate

REPO = Path(__file__).resolve().parents[2]


STAGE_LINE = re.compile(r"^(?P<name>[^:]+): [\d,]+ tasks? in [\d.]+ s$")


def _every_switch(out):
    return small_config(out, [{"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}],
                        dedup={"exact": {"partitions": 3}, "minhash": {"enabled": True}}, langid={"enabled": True},
                        eval={"enabled": True, "fraction": 0.2})


def test_progress_is_one_line_per_stage_of_the_funnel(tmp_path, capsys):
    curate(_every_switch(tmp_path / "out"), executor=LocalExecutor(), log=lambda _: None)
    lines = capsys.readouterr().err.splitlines()  # not a terminal: plain lines
    names = [m["name"] for line in lines if (m := STAGE_LINE.match(line))]
    assert len(names) == len(lines)  # nothing but the stage lines
    # the stages a user thinks in, each once, in the funnel's order: no sub-step, no segment folder
    # (selection runs whenever rows are held out for eval: they get no copies)
    assert names == ["read", "exact dedup", "language id + filters", "near dedup", "tokenize", "eval split", "selection",
                     "shards", "clean up"]


def test_verbose_progress_shows_the_steps_of_each_stage(tmp_path, capsys):
    curate(_every_switch(tmp_path / "out"), executor=LocalExecutor(progress=True), verbose=True, log=lambda _: None)
    lines = capsys.readouterr().err.splitlines()
    steps = {line.split(":")[0] for line in lines if not STAGE_LINE.match(line)}
    assert {"exact_dedup decide", "minhash pairs", "minhash decide", "minhash fetch", "minhash check", "minhash drop", "eval_split exact"} <= steps
    assert len(lines) > 30


def test_the_cli_logs_curation_in_a_few_lines(tmp_path):
    """`datapipe curate` on the quickstart slice, in a log: one line per stage, then the summary tables on stdout."""
    done = subprocess.run(["datapipe", "curate", "configs/quickstart.yaml", "--executor", "local", "--output",
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert 5 <= len(done.stderr.splitlines()) <= 15, done.stderr
    assert "shards," in done.stdout.splitlines()[-1]  # the summary: shards, documents, tokens, seconds


def _batch(pid, *lines, is_err=True):
    return {"pid": pid, "lines": list(lines), "is_err": is_err}


def test_a_dead_worker_is_one_line_and_other_lines_pass():
    printed, said = [], []
    phase = ["tokenize"]
    f = WorkerDeathFilter(lambda data, *_: printed.extend(data["lines"]), said.append, lambda: phase[0], wait_s=0.2)
    f(_batch(111, "tokenizer.json: encoding with tokenizers (slower): not provably equivalent"), True)
    # the raylet's message comes first, the dump that names the signal a moment later
    f(_batch("raylet", "A worker died or was killed while executing a task by an unexpected system error. ... "
                       "Worker PID: 222 Worker exit type: SYSTEM_ERROR ...",
             "Task tokenize_task failed. There are 3 retries remaining, so the task will be retried. Error: ",
             is_err=False))
    f(_batch(222, "[mutex.cc : 1416] RAW: Check (v & (kMuWait | kMuWrWait)) != kMuWrWait failed: Lock: Mutex corrupt: "
                  "waiting writer with no waiters: 0x55", "*** SIGABRT received at time=1796101595 on cpu 0 ***",
             "PC: @     0x7fbdbcca8eec  (unknown)  (unknown)"))
    f(_batch(222, "[2026-12-01 05:06:35,939 E 222 222] logging.cc:474:     @     0x7fbdbcc5a050  (unknown)",
             "Fatal Python error: Aborted", "Extension modules: msgpack._cmsgpack, ..."))
    time.sleep(0.5)
    phase[0] = "shards"  # a worker killed without a dump (the OOM killer): the raylet's message only
    f(_batch("raylet", "A worker died or was killed while executing a task by an unexpected system error. "
                       "Worker PID: 333 ...", is_err=False))
    f(_batch(444, "*** SIGTERM received at time=1796101600 on cpu 1 ***", "PC: @ 0x7f"))  # shutdown: nothing to say
    time.sleep(0.5)
    assert printed == ["tokenizer.json: encoding with tokenizers (slower): not provably equivalent"]
    assert said == ["tokenize: a Ray worker (pid 222) died (Lock: Mutex corrupt: waiting writer with no waiters: 0x55)",
                    "shards: a Ray worker (pid 333) died (it exited unexpectedly)"]


def _tiny_embedded_corpus(tmp_path: Path, monkeypatch) -> None:
    """`datapipe run` on three small domain files instead of the embedded corpus (minutes to build)."""
    rows = [json.loads(line) for line in (ASSETS / "corpus_slice.jsonl").read_text().splitlines()]
    files = {}
    for domain, source in (("code", "code"), ("prose", "license"), ("manual", "man")):
        files[domain] = tmp_path / f"{domain}.jsonl"
        files[domain].write_text("".join(json.dumps({"id": r["id"], "text": r["text"]}) + "\n"
                                         for r in rows if r["source"] == source))
    monkeypatch.setattr(embedded, "prepare", lambda n: files)


def test_run_on_a_finished_folder_says_it_reuses_it(tmp_path, monkeypatch, capsys):
    _tiny_embedded_corpus(tmp_path, monkeypatch)
    out = tmp_path / "run"
    args = ["run", "--output", str(out), "--executor", "local", "--no-progress", "--train-steps", "0",
            "--set", "tokenizer.train.vocab_size=400", "--set", "diversity.enabled=false"]
    assert main(args) == 0
    assert "finished run" not in capsys.readouterr().out
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"{out} is a finished run of the same config: reusing it (nothing to do)" in printed
    # other settings: refused, the differing key named, nothing touched
    manifest = (out / "manifest.json").read_bytes()
    assert main([*args, "--set", "eval.fraction=0.2"]) == 2
    assert "eval.fraction" in capsys.readouterr().err
    assert (out / "manifest.json").read_bytes() == manifest


def test_run_reuses_a_finished_training_too(tmp_path, monkeypatch, capsys):
    _tiny_embedded_corpus(tmp_path, monkeypatch)
    out = tmp_path / "run"
    args = ["run", "--output", str(out), "--executor", "local", "--no-progress", "--train-steps", "2",
            "--set", "tokenizer.train.vocab_size=400", "--set", "diversity.enabled=false"]
    assert main(args) == 0
    metrics = (tmp_path / "run-train" / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert f"{out} is a finished run of the same config" in printed
    assert f"{tmp_path / 'run-train'} is a finished training run of 2 steps: reusing it (nothing to train)" in printed
    assert (tmp_path / "run-train" / "metrics.jsonl").read_bytes() == metrics  # not trained again


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file of the checkout (size, mtime), but git's own and Python's caches."""
    skip = {".git", "__pycache__", ".pytest_cache", ".import_linter_cache"}
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if skip & set(rel.parts) or rel.parts[0].endswith(".egg-info") or not path.is_file():
            continue
        st = path.stat()
        out[str(rel)] = (st.st_size, st.st_mtime_ns)
    return out


def _git_status() -> str | None:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        return None
    return subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=REPO, capture_output=True, text=True).stdout


def test_the_readme_quickstart_writes_only_under_its_output_folder(tmp_path, monkeypatch, capsys):
    tokenizer = REPO / "tokenizers" / "quickstart" / "tokenizer.json"
    before = (_tree(REPO), _git_status(), hashlib.sha256(tokenizer.read_bytes()).hexdigest(), tokenizer.stat().st_mtime_ns)
    monkeypatch.chdir(REPO)  # the config's input path is relative to the checkout, as in the README
    out = tmp_path / "qs"
    code = main(["curate", "configs/quickstart.yaml", "--output", str(out), "--executor", "local", "--no-progress",
                 "--set", "tokenizer.train.vocab_size=400", "--set", "tokenizer.train.sample_bytes=100000"])
    assert code == 0, capsys.readouterr().err
    assert (out / "manifest.json").exists() and (out / "tokenizer.json").exists()
    after = (_tree(REPO), _git_status(), hashlib.sha256(tokenizer.read_bytes()).hexdigest(), tokenizer.stat().st_mtime_ns)
    assert after == before


def test_the_readme_python_example_curates_and_loads_batches(tmp_path, monkeypatch, ray_local, capsys):
    """The README's Python block as it stands, on the session's Ray, its output folder moved under tmp_path."""
    text = (REPO / "README.md").read_text()
    code = text.split("```python\n")[1].split("```")[0]
    assert '"out/mine"' in code
    monkeypatch.chdir(REPO)  # the recipe's input path is relative to the checkout, as in the README
    exec(compile(code.replace('"out/mine"', repr(str(tmp_path / "mine"))), "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split()[0].isdigit() and printed[-1] == "torch.Size([8, 512])"



def test_a_run_writes_its_lines_to_run_log_and_a_resumed_run_goes_on_below(tmp_path, slice_input):
    from helpers import CrashAfter, Interrupted, PassThrough
    from datapipe import curate
    from datapipe.curation.executors import LocalExecutor

    cfg = small_config(tmp_path / "out", [slice_input])
    with pytest.raises(Interrupted):
        curate(cfg, executor=LocalExecutor(), extra_stages=[CrashAfter(2)], progress=False, log=lambda _: None)
    first = (tmp_path / "out" / "run.log").read_text().splitlines()
    assert re.search(r"\d\d:\d\d:\d\d  started: datapipe curate into ", first[0]) and re.search(r"  read: \d+ tasks? in ", first[1])
    printed: list[str] = []
    curate(cfg, executor=LocalExecutor(), extra_stages=[PassThrough()], progress=False, log=printed.append)
    lines = (tmp_path / "out" / "run.log").read_text().splitlines()
    assert lines[:len(first)] == first and "resumed: datapipe curate into" in lines[len(first)]
    assert any(" shards: " in line for line in lines) and all(any(p in line for line in lines) for p in printed)
