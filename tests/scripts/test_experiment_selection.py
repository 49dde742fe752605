"""The within-domain selection experiment's corpus and its pool runner: what reaches a selector, and a failing pool."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import scripts.experiment_selection as experiment

HEADER = "PRINTF(3)                  Linux Programmer's Manual                  PRINTF(3)"
FOOTER = "GNU                               2017-09-15                          PRINTF(3)"


def _page(i: int, section: str) -> str:
    rng = random.Random(f"{section}-{i}")  # pages of their own words: no two are near copies
    body = "\n".join("       " + " ".join(f"w{rng.randrange(10_000)}" for _ in range(8)) for _ in range(6))
    return f"{HEADER.replace('(3)', f'({section})')}\n\nNAME\n{body}\n\n{FOOTER.replace('(3)', f'({section})')}\n"


def test_strip_frame_cuts_the_first_and_last_non_empty_lines():
    assert experiment.strip_frame("\nHEAD\n\nbody one\nbody two\n\nFOOT\n\n") == "body one\nbody two"
    assert experiment.strip_frame("HEAD\nFOOT\n") == ""


def test_the_section_header_and_footer_never_reach_a_selector_and_foreign_pages_are_out(tmp_path: Path, monkeypatch):
    docs = ([{"id": f"man/man3/f{i}.3.gz", "text": _page(i, "3"), "source": "man", "lang": "en"} for i in range(150)]
            + [{"id": f"man/man8/d{i}.8.gz", "text": _page(i, "8"), "source": "man", "lang": "en"} for i in range(150)]
            + [{"id": f"man/de/man3/f{i}.3.gz", "text": _page(i, "3"), "source": "man", "lang": "de"} for i in range(10)]
            + [{"id": f"code/m{i}.py", "text": "".join(f"def f{i}_{j}(x):\n    return x * {i * 1000 + j}\n" for j in range(12)), "source": "code", "lang": "python"}
               for i in range(150)])
    corpus = tmp_path / "corpus.jsonl.gz"
    with gzip.open(corpus, "wt") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    monkeypatch.setattr(experiment, "EVAL_TEXT_BYTES", 6_000)
    counts = experiment.split_corpus(tmp_path / "run", str(corpus))
    assert all(counts["reference"][t] > 0 and counts["eval"][t] > 0 for t in experiment.TARGETS)
    seen = []
    for path in (tmp_path / "run").rglob("*.jsonl.gz"):
        seen += experiment._read_jsonl(path)
    man = [d for d in seen if d["id"].startswith("man/")]
    assert man and not any("/de/" in d["id"] for d in seen)
    assert not any("Linux Programmer's Manual" in d["text"] or "2017-09-15" in d["text"] for d in man)
    evals = experiment._read_jsonl(tmp_path / "run" / "input" / "eval.jsonl.gz")
    assert {d["source"] for d in evals} == set(experiment.TARGETS)  # one eval folder, a domain per target
    held = {d["id"] for d in evals}
    for t in experiment.TARGETS:
        assert not held & {d["id"] for d in experiment._read_jsonl(tmp_path / "run" / "target" / t / "reference.jsonl.gz")}


def test_a_reference_example_that_copies_an_eval_document_is_dropped():
    text = " ".join(f"word{i}" for i in range(200))
    evals = [{"id": "e", "text": text}]
    reference = [{"id": "same", "text": "  " + text.replace(" ", "\n")}, {"id": "near", "text": text + " and one more"},
                 {"id": "other", "text": " ".join(f"other{i}" for i in range(200))}]
    kept, dropped = experiment.without_copies(reference, evals)
    assert [d["id"] for d in kept] == ["other"] and dropped == 2


def test_a_failing_pool_stops_the_pools_running_beside_it(tmp_path: Path):
    started: dict[int, subprocess.Popen] = {}

    def child(seed: int) -> subprocess.Popen:
        code = "import sys; sys.exit(3)" if seed == 2 else "import time; time.sleep(60)"
        started[seed] = subprocess.Popen([sys.executable, "-c", code])
        return started[seed]

    began = time.monotonic()
    with pytest.raises(SystemExit, match=r"pool 2 failed \(exit 3\); the pools beside it were stopped: \[1\]"):
        experiment.run_pools([1, 2, 3], 2, child, poll_s=0.05)
    assert time.monotonic() - began < 30 and sorted(started) == [1, 2]  # pool 3 never started
    assert started[1].poll() is not None  # pool 1 was stopped, not left writing
