"""Reading memory is bounded per line and per unit, not by the input: a huge JSONL line is cut off at
the line limit and quarantined as too_long, and quarantine records are streamed to their file. Each
check reads in a child process and compares its peak RSS with a child reading a tiny file."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import orjson

# A child that reads one JSONL file as the read phase does (phases.read._read: read_unit + quarantine file)
# and prints what it kept, what it quarantined and its own peak RSS (KiB, Linux /proc).
CHILD = r"""
import json, sys, types
from pathlib import Path
import orjson
from datapipe.core.config import from_dict
from datapipe.curation.config import CurateConfig
from datapipe.curation.readers import InputUnit
from datapipe.curation.phases import read
path, out, max_bytes = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
cfg = from_dict(CurateConfig, {"inputs": [{"path": path}], "output": {"dir": str(out)},
                               "read": {"max_bytes_per_doc": max_bytes, "block_bytes": 1 << 20},
                               "dedup": {"exact": {"partitions": 4}}})  # (the run resolves auto ones)
plan = types.SimpleNamespace(cfg=cfg, out_dir=str(out), out=out, work=out / "work", read_stages=[])
(out / "work" / "read").mkdir(parents=True)
result = read._read(plan, 0, InputUnit(0, path, "jsonl"), cfg.inputs[0])
import pyarrow as pa
from datapipe.curation.blocks import READ, block_documents
ids = []
for f in sorted((out / "work" / "read").glob("*.arrow")):
    ids += block_documents(out / "work", READ, f.stem, ["id"]).column("id").to_pylist()
quarantine = out / "quarantine" / "u000000.jsonl"
reasons, lines = {}, []
if quarantine.exists():
    with open(quarantine, "rb") as f:
        for raw in f:
            q = orjson.loads(raw)
            reasons[q["reason"]] = reasons.get(q["reason"], 0) + 1
            if q["reason"] == "too_long":
                lines.append(q["line"])
# VmHWM, not ru_maxrss: ru_maxrss keeps the parent's high-water mark across fork and exec (pytest's own).
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"ids": ids, "reasons": reasons, "too_long_lines": lines, "peak_kib": int(hwm.split()[1])}))
"""

MIB = 1 << 20


def read_in_child(path: Path, out: Path, max_bytes: int = 1_000_000) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), str(out), str(max_bytes)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def baseline_kib(tmp_path: Path) -> int:
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_bytes(b'{"id": "a", "text": "hello"}\n')
    return read_in_child(tiny, tmp_path / "out-tiny")["peak_kib"]


def test_a_huge_line_in_a_gz_is_quarantined_as_too_long_without_being_held(tmp_path):
    path = tmp_path / "huge.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=1) as f:
        f.write(b'{"id": "first", "text": "a good document"}\n')
        f.write(b'{"id": "huge", "text": "')
        piece = b"all work and no play makes a long line " * (MIB // 40)
        for _ in range(200):  # ~200 MiB of text on one line
            f.write(piece)
        f.write(b'"}\n')
        f.write(b'{"id": "last", "text": "another good document"}\n')
    assert path.stat().st_size < 20 * MIB
    base = baseline_kib(tmp_path)
    got = read_in_child(path, tmp_path / "out")
    assert got["ids"] == ["first", "last"]
    assert got["reasons"] == {"too_long": 1} and got["too_long_lines"] == [2]
    grown_mib = (got["peak_kib"] - base) / 1024
    assert grown_mib < 150, f"peak RSS grew {grown_mib:.0f} MiB reading one 200 MiB line"  # the old code held it: > 400 MiB


def test_many_bad_lines_are_streamed_to_the_quarantine_file(tmp_path):
    path = tmp_path / "bad.jsonl"
    bad = b'{"id": "x", "text": "unterminated ' + b"garbage " * 30 + b"\n"  # malformed JSON, ~280 bytes
    n_bad = 30 * MIB // len(bad)
    with open(path, "wb") as f:
        f.write(b'{"id": "first", "text": "a good document"}\n')
        f.write(bad * n_bad)
        f.write(b'{"id": "last", "text": "another good document"}\n')
    base = baseline_kib(tmp_path)
    got = read_in_child(path, tmp_path / "out")
    assert got["ids"] == ["first", "last"]
    assert got["reasons"] == {"malformed_json": n_bad}
    grown_mib = (got["peak_kib"] - base) / 1024
    # Held whole, ~110,000 records of ~700 bytes of JSON each (+ Python overhead) grew it by > 100 MiB.
    assert grown_mib < 60, f"peak RSS grew {grown_mib:.0f} MiB quarantining 30 MiB of bad lines"
