"""scripts/bench_s3_requests.py: the server-log parser counts every request werkzeug logs, coloured or not.

werkzeug wraps the request of every line whose status is not 200 in ANSI colour codes (a 206 range read in
bold magenta, a 404 in yellow); a pattern that expects `"GET` right after the quote misses all of them. The
lines here are written by werkzeug's own `WSGIRequestHandler.log_request`, and by hand as they appear in a log."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import werkzeug.serving
from werkzeug.serving import WSGIRequestHandler

from scripts.bench_s3_requests import Request, classify, count_lines, parse_line, report, strip_ansi

REPO = Path(__file__).resolve().parents[2]


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def werkzeug_line(method: str, path: str, status: int, monkeypatch, colour: bool = True) -> str:
    """The access-log line werkzeug's request handler writes for one request (its `log_request`)."""
    monkeypatch.setattr(werkzeug.serving, "_log_add_style", colour)
    handler = WSGIRequestHandler.__new__(WSGIRequestHandler)  # no socket: only what log_request reads
    handler.command, handler.path, handler.request_version = method, path, "HTTP/1.1"
    handler.client_address = ("127.0.0.1", 50123)
    logger = logging.getLogger("werkzeug")
    capture = _Capture()
    logger.addHandler(capture)
    try:
        handler.log_request(status, "-")
    finally:
        logger.removeHandler(capture)
    assert len(capture.lines) == 1
    return capture.lines[0]


STATUSES = [("GET", 200), ("GET", 206), ("HEAD", 404), ("GET", 404), ("PUT", 200), ("POST", 200), ("GET", 403),
            ("GET", 304), ("GET", 500)]


@pytest.mark.parametrize("method,status", STATUSES)
def test_werkzeug_lines_coloured_and_plain(method, status, monkeypatch):
    path = "/bench/run/work/ids/keys/u000000-b00000.shuffle"
    coloured = werkzeug_line(method, path, status, monkeypatch, colour=True)
    plain = werkzeug_line(method, path, status, monkeypatch, colour=False)
    if status != 200:
        assert "\x1b[" in coloured  # werkzeug does colour it: the case the old pattern missed
    assert strip_ansi(coloured) == plain
    for line in (coloured, plain):
        assert parse_line(line) == Request(method, path, "", status), repr(line)


def test_hand_written_lines():
    lines = [
        '127.0.0.1 - - [02/Dec/2026 07:00:00] "\x1b[35m\x1b[1mGET /bench/run/work/ids/keys/u000000-b00000.shuffle HTTP/1.1\x1b[0m" 206 -',
        '127.0.0.1 - - [02/Dec/2026 07:00:00] "\x1b[32mGET /datapipe-test/work/x HTTP/1.1\x1b[0m" 206 -',
        '127.0.0.1 - - [02/Dec/2026 07:00:00] "\x1b[33mHEAD /bench/run/work/read/u000000.json HTTP/1.1\x1b[0m" 404 -',
        '127.0.0.1 - - [02/Dec/2026 07:00:00] "PUT /bench/run/work/read/u000000-b00000.arrow HTTP/1.1" 200 -',
        '127.0.0.1 - - [02/Dec/2026 07:00:00] "GET /bench?list-type=2&prefix=run/work/minhash/cc/&delimiter= HTTP/1.1" 200 -',
    ]
    assert [parse_line(x) for x in lines] == [
        Request("GET", "/bench/run/work/ids/keys/u000000-b00000.shuffle", "", 206),
        Request("GET", "/datapipe-test/work/x", "", 206),
        Request("HEAD", "/bench/run/work/read/u000000.json", "", 404),
        Request("PUT", "/bench/run/work/read/u000000-b00000.arrow", "", 200),
        Request("GET", "/bench", "list-type=2&prefix=run/work/minhash/cc/&delimiter=", 200),
    ]
    for other in ["WARNING: This is a development server.", " * Running on http://127.0.0.1:5000", "Press CTRL+C to quit", ""]:
        assert parse_line(other) is None


def test_classify_by_phase_and_folder():
    def c(path, query=""):
        return classify(Request("GET", path, query, 200))[:2]

    assert c("/bench/run/work/minhash/buckets/u000003-b00001.shuffle") == ("work/minhash", "work/minhash/buckets")
    assert c("/bench/run/work/exact_dedup/losers-t007.arrow") == ("work/exact_dedup", "work/exact_dedup/losers-tN.arrow")
    assert c("/bench/run/work/seg1/u000000-b00002.arrow") == ("work/seg1", "work/seg1/uN-bN.arrow")
    assert c("/bench/run/work/tokens/u000001-b00000.json") == ("work/tokens", "work/tokens/uN-bN.json")
    assert c("/bench/run/shards/shard-00000.arrow") == ("shards", "shards")
    assert c("/bench/run/manifest.json") == ("manifest.json", "manifest.json")
    assert c("/bench/in/part-00.jsonl") == ("in", "in")
    # a listing counts for the folder of its prefix
    assert c("/bench", "list-type=2&prefix=run/work/minhash/cc/&delimiter=/&max-keys=1") == ("work/minhash", "work/minhash/cc")
    assert c("/bench", "list-type=2&prefix=run/work/seg1/u000000-b00000.json/&delimiter=/") == ("work/seg1", "work/seg1/uN-bN.json")
    assert c("/bench", "list-type=2&prefix=run/&delimiter=/") == ("run (top)", "run (top)")
    assert classify(Request("POST", "/bench", "delete", 200))[0] == "bucket (batch delete)"
    # below a hashed prefix (`storage.spread`): a shuffle file counts for its folder, a read block for work/read/blocks
    assert c("/bench/run/work/minhash/pairs-u/3f/g001.shuffle") == ("work/minhash", "work/minhash/pairs-u")
    assert c("/bench/run/work/read/a0/u000000-b00002.arrow") == ("work/read", "work/read/blocks")


def test_the_runs_identity_copy_in_work_is_no_task_record():
    from scripts.bench_s3_requests import Tally

    tally = Tally()
    for key in ("run/work/run.json", "run/work/minhash/records/fetch-0.json"):
        tally.add(Request("PUT", f"/bench/{key}", "", 200), key, listing=False)
    assert tally.summary()["task_records_by_name"] == {"records/fetch-N.json": 1}


def test_shuffle_requests_are_held_against_senders_plus_receivers():
    """A folder's requests beside 4 x (its shuffle files + the reading step's tasks + its combine tasks)."""
    from scripts.bench_s3_requests import count_lines, shuffle_bounds

    lines = []
    for b in range(3):  # 3 senders; one combine task reads them and writes one file; 2 receivers read it
        lines += [f'127.0.0.1 - - [d] "PUT /bench/run/work/ids/keys/0{b}/u000000-b0000{b}.shuffle HTTP/1.1" 200 -',
                  f'127.0.0.1 - - [d] "GET /bench/run/work/ids/keys/0{b}/u000000-b0000{b}.shuffle HTTP/1.1" 206 -']
    lines.append('127.0.0.1 - - [d] "PUT /bench/run/work/ids/keys/7f/combined-00000.shuffle HTTP/1.1" 200 -')
    lines += ['127.0.0.1 - - [d] "GET /bench/run/work/ids/keys/7f/combined-00000.shuffle HTTP/1.1" 206 -'] * 4
    bounds = shuffle_bounds(count_lines(lines), {"partitions_exact_and_ids": 2, "near_dedup_resolve_groups": 1})
    assert bounds == {"work/ids/keys": {"requests": 11, "sending_tasks": 4, "receiving_tasks": 3,
                                        "bound_4x_senders_plus_receivers": 28, "within_bound": True}}


def _log(monkeypatch) -> list[str]:
    """A small run's log as werkzeug writes it with colours: 2 blocks, 2 partitions, one shuffle read."""
    requests = [
        ("PUT", "/bench/run/work/read/u000000-b00000.arrow", 200),
        ("PUT", "/bench/run/work/read/u000000-b00001.arrow", 200),
        ("PUT", "/bench/run/work/read/u000000.json", 200),
        ("HEAD", "/bench/run/work/ids/resolved-p000-of-002.json", 404),
        ("HEAD", "/bench/run/work/ids/resolved-p001-of-002.json", 404),
        ("GET", "/bench?list-type=2&prefix=run/work/ids/resolved-p000-of-002.json/&delimiter=/&max-keys=1", 200),
        ("PUT", "/bench/run/work/ids/keys/u000000-b00000.shuffle", 200),
        ("PUT", "/bench/run/work/ids/keys/u000000-b00001.shuffle", 200),
    ]
    for p in range(2):  # every receiver reads a header and a range of every sender's file
        for b in range(2):
            requests += [("GET", f"/bench/run/work/ids/keys/u000000-b0000{b}.shuffle", 206)] * 2
        requests.append(("PUT", f"/bench/run/work/ids/resolved-p00{p}-of-002.json", 200))
    requests += [("GET", "/bench/run/shards/missing.arrow", 404), ("POST", "/bench?delete", 200)]
    lines = ["WARNING: This is a development server. Do not use it in a production deployment.",
             " * Running on http://127.0.0.1:5000", "Press CTRL+C to quit"]
    for method, target, status in requests:
        lines.append(werkzeug_line(method, target, status, monkeypatch, colour=True))
    return lines


def test_counts_every_request_of_a_coloured_log(monkeypatch):
    lines = _log(monkeypatch)
    assert sum("\x1b[" in x for x in lines) == 11  # the 8 range reads (206) and the 3 404s
    count = count_lines(lines)
    assert count.unmatched_request_lines == 0
    assert count.total.requests == 20
    assert dict(count.total.by_status) == {"PUT 200": 7, "HEAD 404": 2, "GET 200": 1, "GET 206": 8, "GET 404": 1,
                                           "POST 200": 1}
    ids = report(count, docs=100)["phases"]["work/ids"]
    assert ids == {"requests": 15, "by_method_status": {"GET 200": 1, "GET 206": 8, "HEAD 404": 2, "PUT 200": 4},
                   "listings": 1, "objects_written": 4, "task_records_written": 2,
                   "task_records_by_name": {"resolved-pN-of-N.json": 2}, "shuffle_files": 2, "range_reads": 8,
                   "objects_range_read": 2}
    keys = report(count, docs=100)["folders"]["work/ids/keys"]
    assert keys["shuffle_files"] == 2 and keys["range_reads_per_shuffle_file"] == 4.0
    assert report(count, docs=100)["phases"]["work/read"]["task_records_by_name"] == {"uN.json": 1}
    assert report(count, docs=100)["range_reads_per_document"] == 0.08


def test_count_log_command(monkeypatch, tmp_path):
    log = tmp_path / "moto.log"
    log.write_text("\n".join(_log(monkeypatch)) + "\n")
    out = subprocess.run([sys.executable, "-m", "scripts.bench_s3_requests", "--count-log", str(log)], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    result = json.loads(out)
    assert result["requests_total"] == 20 and result["by_method_status"]["GET 206"] == 8
