"""Tests of datapipe.curation.readers: every format, order keys, ids, domains, quarantine and plan errors."""

from __future__ import annotations

import gzip
import json
import random
import uuid
from pathlib import Path

import fsspec
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from datapipe.curation.config import InputConfig, ReadConfig
from datapipe.curation.readers import InputError, InputUnit, Quarantined, plan_units, read_unit
from datapipe.core.schema import DOC_SCHEMA, order_key
from helpers import gzip_member_with_a_flipped_bit, zstd_frame_with_a_flipped_bit

ASSETS = Path(__file__).resolve().parents[1] / "assets"
READ = ReadConfig()


def read_all(units: list[InputUnit], inputs: list[InputConfig], read: ReadConfig = READ, first_unit: int = 0):
    """All documents (as dicts) and quarantined records of `units`, unit index = position + first_unit."""
    docs: list[dict] = []
    bad: list[Quarantined] = []
    for k, unit in enumerate(units):
        for batch, quarantined in read_unit(unit, first_unit + k, inputs[unit.input_index], read):
            assert batch.schema.equals(DOC_SCHEMA)
            assert batch.num_rows <= read.batch_size
            docs += batch.to_pylist()
            bad += quarantined
    return docs, bad


def read_input(inp: InputConfig, read: ReadConfig = READ):
    return read_all(plan_units([inp]), [inp], read)


def write_jsonl(path: Path, records: list) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))


RECORDS = [
    {"id": "a", "text": "alpha", "domain": "web"},
    {"text": "beta"},  # no id: derived
    {"id": 7, "text": "gamma", "domain": ""},  # int id -> "7"; empty domain -> input domain
    {"id": None, "text": "delta", "domain": 3},  # null id -> derived; non-string domain -> input domain
]


def check_records(docs: list[dict], path: str, domain: str = "default") -> None:
    assert [d["text"] for d in docs] == ["alpha", "beta", "gamma", "delta"]
    assert [d["id"] for d in docs] == ["a", f"{path}:2", "7", f"{path}:4"]
    assert [d["domain"] for d in docs] == ["web", domain, domain, domain]


@pytest.fixture
def mem() -> str:
    """A fresh memory:// folder, removed afterwards (the memory filesystem is process-global)."""
    root = f"memory://readers-{uuid.uuid4().hex}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


# ----------------------------------------------------------------------------------------- jsonl


def test_jsonl_ids_domains_orders(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    write_jsonl(path, RECORDS)
    inp = InputConfig(path=str(path))
    units = plan_units([inp])
    assert units == [InputUnit(0, str(path), "jsonl")]
    docs, bad = read_all(units, [inp], first_unit=5)
    check_records(docs, str(path))
    assert bad == []
    assert [d["order"] for d in docs] == [order_key(5, i) for i in range(4)]


@pytest.mark.parametrize("suffix", [".jsonl.gz", ".jsonl.zst", ".ndjson", ".json"])
def test_jsonl_compressions_and_extensions(tmp_path: Path, suffix: str) -> None:
    data = b"".join(orjson.dumps(r) + b"\n" for r in RECORDS)
    if suffix.endswith(".gz"):
        data = gzip.compress(data)
    elif suffix.endswith(".zst"):
        data = zstandard.ZstdCompressor().compress(data)
    path = tmp_path / f"a{suffix}"
    path.write_bytes(data)
    inp = InputConfig(path=str(path), domain="d")
    assert [u.format for u in plan_units([inp])] == ["jsonl"]
    docs, bad = read_input(inp)
    check_records(docs, str(path), domain="d")
    assert bad == []


def test_jsonl_id_field_and_domain_field_options(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    write_jsonl(path, [{"key": "k1", "body": "one", "src": "code", "id": "ignored", "domain": "ignored"}])
    inp = InputConfig(path=str(path), text_field="body", id_field="key", domain_field="src")
    docs, _ = read_input(inp)
    assert docs[0] | {"order": 0} == {"id": "k1", "domain": "code", "text": "one", "order": 0, "lang": None, "lang_score": None}
    inp = InputConfig(path=str(path), text_field="body", id_field=None, domain_field=None, domain="fixed")
    docs, _ = read_input(inp)
    assert (docs[0]["id"], docs[0]["domain"]) == (f"{path}:1", "fixed")


def test_every_quarantine_reason_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    lines = [
        b'{"text": "good one"}',  # 1
        b"",  # 2 blank
        b'{"text": "caf\xff"}',  # 3
        b'{"text": "unterminated',  # 4
        b"[1, 2]",  # 5
        b'{"body": "no text field"}',  # 6
        b'{"text": null}',  # 7
        b'{"text": 42}',  # 8
        b'{"text": "   \\n\\t"}',  # 9
        b'{"text": ""}',  # 10
        b'{"text": "0123456789A"}',  # 11: 11 bytes
        "{\"text\": \"\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\"}".encode(),  # 12: 6 chars, 12 bytes
        b"   \t",  # 13 whitespace-only line: blank
        b'{"text": "0123456789"}',  # 14: exactly 10 bytes, kept
        b'{"text": "last", "id": "x"}\r',  # 15: CRLF line ending
    ]
    path.write_bytes(b"\n".join(lines))  # no final newline
    inp = InputConfig(path=str(path))
    docs, bad = read_input(inp, ReadConfig(max_bytes_per_doc=10))
    assert [(d["text"], d["order"]) for d in docs] == [("good one", 0), ("0123456789", 13), ("last", 14)]
    assert docs[0]["id"] == f"{path}:1"
    assert [(q.reason, q.line) for q in bad] == [
        ("invalid_utf8", 3),
        ("malformed_json", 4),
        ("not_an_object", 5),
        ("missing_text", 6),
        ("missing_text", 7),
        ("text_not_string", 8),
        ("empty_text", 9),
        ("empty_text", 10),
        ("too_long", 11),
        ("too_long", 12),
    ]
    assert all(q.file == str(path) and q.row is None and q.detail for q in bad)
    assert bad[1].raw == '{"text": "unterminated'
    assert bad[0].raw == '{"text": "caf\ufffd"}'


def test_quarantine_raw_is_truncated(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    write_jsonl(path, [{"text": "x" * 50_000}])
    _, bad = read_input(InputConfig(path=str(path)), ReadConfig(max_bytes_per_doc=100))
    assert bad[0].reason == "too_long" and len(bad[0].raw) == 2000


def test_batches_are_bounded_and_carry_their_quarantine(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text":"1"}\n{"text":"2"}\nnot json\n{"text":"3"}\n{"text":"4"}\n{"text":"5"}\n')
    inp = InputConfig(path=str(path))
    out = list(read_unit(plan_units([inp])[0], 0, inp, ReadConfig(batch_size=2)))
    assert [b.column("text").to_pylist() for b, _ in out] == [["1", "2"], ["3", "4"], ["5"]]
    assert [[q.line for q in qs] for _, qs in out] == [[], [3], []]


def test_bom_is_ignored_and_line_numbers_match_file(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n\n\n{"text": "fourth"}\n')
    docs, bad = read_input(InputConfig(path=str(path)))
    assert [(d["text"], d["id"], d["order"]) for d in docs] == [
        ("first", f"{path}:1", 0),
        ("fourth", f"{path}:4", 3),
    ]
    assert bad == []


def _random_lines(n: int) -> list[bytes]:
    rng = random.Random(0)  # random text compresses little, so the damage lands well inside the file
    return [orjson.dumps({"id": f"d{i}", "text": rng.randbytes(60).hex()}) + b"\n" for i in range(n)]


@pytest.mark.parametrize("method", ["gz", "zst"])
def test_a_cut_compressed_input_keeps_the_lines_that_fully_decoded(tmp_path: Path, method: str) -> None:
    n = 3000
    data = b"".join(_random_lines(n))
    blob = gzip.compress(data) if method == "gz" else zstandard.ZstdCompressor(write_checksum=True).compress(data)
    path = tmp_path / f"cut.jsonl.{method}"
    path.write_bytes(blob[: len(blob) // 2])
    inp = InputConfig(path=str(path))
    units = plan_units([inp])  # the header is fine: the damage shows only while reading
    docs, bad = read_all(units, [inp], ReadConfig(batch_size=64))
    good = len(docs)
    assert 0 < good < n  # a cut file has no check to fail: what fully decoded before the cut is kept
    assert [d["id"] for d in docs] == [f"d{i}" for i in range(good)]  # every line up to the cut, intact
    (q,) = bad  # one record stands for the unreadable rest
    assert q.reason == "truncated_input" and q.file == str(path) and q.line == good + 1
    assert f"cannot decompress past line {good}" in q.detail


def test_a_bit_flip_in_a_gzip_member_keeps_none_of_its_lines_and_reads_the_next_member(tmp_path: Path) -> None:
    lines = _random_lines(600)
    damaged = gzip_member_with_a_flipped_bit(b"".join(lines[:300]))  # zlib inflates it to its end, garbled
    path = tmp_path / "two-members.jsonl.gz"
    path.write_bytes(damaged + gzip.compress(b"".join(lines[300:])))
    docs, bad = read_input(InputConfig(path=str(path)))
    assert [d["id"] for d in docs] == [f"d{i}" for i in range(300, 600)]  # the intact member, every line
    # Every line of the damaged member, garbled or not (no way to tell), is quarantined, one by one.
    assert [(q.reason, q.line) for q in bad] == [("corrupt_input", line) for line in range(1, 301)]
    assert {q.file for q in bad} == {str(path)}
    assert bad[0].detail.startswith("the gzip member holding lines 1-300 fails its check (its data has CRC-32 ")
    assert sum(q.raw.encode() + b"\n" != line for q, line in zip(bad, lines)) >= 1  # some did come out garbled


def test_zeroed_bytes_inside_a_gzip_member_keep_nothing_of_it(tmp_path: Path) -> None:
    blob = bytearray(gzip.compress(b"".join(_random_lines(3000))))
    mid = len(blob) // 2
    blob[mid : mid + 64] = bytes(64)
    path = tmp_path / "corrupt.jsonl.gz"
    path.write_bytes(bytes(blob))
    docs, bad = read_input(InputConfig(path=str(path)))
    # Not even the lines before the damage: it may have garbled them before zlib noticed (if it does).
    assert docs == [] and bad and {q.reason for q in bad} == {"corrupt_input"}
    assert [q.line for q in bad] == list(range(1, len(bad) + 1))


def test_deflate_data_that_breaks_off_sets_its_member_and_the_rest_of_the_file_aside(tmp_path: Path) -> None:
    lines = _random_lines(800)
    stored = b"".join(lines[100:700])  # ~80 KB: more than one compressed step, so some of it comes out first
    blocks = b"".join(b"\x00" + len(part).to_bytes(2, "little") + (len(part) ^ 0xFFFF).to_bytes(2, "little") + part
                      for part in (stored[i : i + 0xFFFF] for i in range(0, len(stored), 0xFFFF)))
    # A gzip member of stored deflate blocks, then a block of the reserved type: zlib stops with an error there,
    # and where the member ends (where the next one starts) is unknown.
    broken = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + blocks + b"\x07"
    path = tmp_path / "broken.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(lines[:100])) + broken + gzip.compress(b"".join(lines[700:])))
    docs, bad = read_input(InputConfig(path=str(path)))
    assert [d["id"] for d in docs] == [f"d{i}" for i in range(100)]  # the member before it passed its check
    *member, rest = bad  # what came out of the broken member, then one record for the rest of the file
    assert member and [(q.reason, q.line) for q in member] == [("corrupt_input", i) for i in range(101, 101 + len(member))]
    assert member[0].detail.startswith(f"the gzip member holding lines 101-{100 + len(member)} cannot be decompressed")
    assert rest.reason == "corrupt_input" and rest.line == 101 + len(member) and rest.raw == ""
    assert f"cannot decompress past line {100 + len(member)} (error: " in rest.detail and "invalid block type" in rest.detail


def test_a_bit_flip_in_a_zstd_frame_keeps_none_of_its_lines_and_reads_the_next_frame(tmp_path: Path) -> None:
    lines = _random_lines(900)
    frames = [zstandard.ZstdCompressor(write_checksum=True).compress(b"".join(lines[i : i + 300])) for i in (0, 600)]
    damaged = zstd_frame_with_a_flipped_bit(b"".join(lines[300:600]))
    path = tmp_path / "three-frames.jsonl.zst"
    path.write_bytes(frames[0] + damaged + frames[1])
    docs, bad = read_input(InputConfig(path=str(path)))
    assert [d["id"] for d in docs] == [f"d{i}" for i in [*range(300), *range(600, 900)]]  # the intact frames
    assert bad and {q.reason for q in bad} == {"corrupt_input"} and {q.file for q in bad} == {str(path)}
    # The lines that came out of the damaged frame, one record each, then one for the part that never did.
    *came_out, rest = bad
    assert [q.line for q in came_out] == list(range(301, 301 + len(came_out)))
    assert rest.line == 301 + len(came_out) and rest.raw == ""
    assert "the zstd frame " in rest.detail and "never came out; this record stands for it" in rest.detail


def _zstd_frame_that_breaks_off(text: bytes, kept: int) -> bytes:
    """`text` as one zstd frame (with a checksum) whose first block holds `text[:kept]` and whose next
    block has a byte flipped: zstandard hands over the first block's text, then refuses the frame."""
    c = zstandard.ZstdCompressor(write_checksum=True).compressobj()
    head = c.compress(text[:kept]) + c.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    frame = bytearray(head + c.compress(text[kept:]) + c.flush())
    frame[(len(head) + len(frame)) // 2] ^= 0x10
    d = zstandard.ZstdDecompressor().decompressobj()
    out = b"".join(d.decompress(frame[i : i + 512]) for i in range(0, len(head), 512))
    assert out == text[:kept]  # what came out before the damage
    with pytest.raises(zstandard.ZstdError):
        d.decompress(bytes(frame[len(head) :]))
    return bytes(frame)


@pytest.mark.parametrize("cut", ["at line ends", "mid-line", "mid-line, nothing out of the damaged frame"])
def test_the_frame_after_a_damaged_one_starts_a_fresh_line(tmp_path: Path, cut: str) -> None:
    # Three frames, the middle one damaged after some of its text came out, cut off inside a line
    # (d150): the third frame's first line is not glued to that cut-off line.
    lines = _random_lines(300)
    text = b"".join(lines)
    at = [sum(map(len, lines[:i])) for i in range(301)]  # where each line starts
    ends = {"at line ends": (at[100], at[200]), "mid-line": (at[100] + 70, at[200] + 70),
            "mid-line, nothing out of the damaged frame": (at[100] + 70, at[200])}[cut]
    kept = 0 if "nothing out" in cut else at[150] + 70 - ends[0]
    zstd = zstandard.ZstdCompressor(write_checksum=True)
    path = tmp_path / "three-frames.jsonl.zst"
    path.write_bytes(zstd.compress(text[: ends[0]]) + _zstd_frame_that_breaks_off(text[ends[0] : ends[1]], kept)
                     + zstd.compress(text[ends[1] :]))
    docs, bad = read_input(InputConfig(path=str(path)))
    assert {q.file for q in bad} == {str(path)}
    if cut == "at line ends":  # every record of the intact frames
        assert [d["id"] for d in docs] == [f"d{i}" for i in [*range(100), *range(200, 300)]]
        # d101-d150 (the last cut off) that came out of the damaged frame, then one record for the rest of it
        assert [(q.reason, q.line) for q in bad] == [("corrupt_input", line) for line in range(101, 153)]
    elif cut == "mid-line":  # d100 and d200 are partly in the damaged frame: the rest, every record
        assert [d["id"] for d in docs] == [f"d{i}" for i in [*range(100), *range(201, 300)]]
        # d200's tail, at the start of the third frame, is read as a line of its own, and fails as one
        assert [(q.reason, q.line) for q in bad] == [("corrupt_input", line) for line in range(101, 153)] + [
            ("malformed_json", 152)]
        assert bad[-1].raw == lines[200][70:-1].decode()
    else:  # the start of d100, whose rest was in the damaged frame, is the damaged frame's
        assert [d["id"] for d in docs] == [f"d{i}" for i in [*range(100), *range(200, 300)]]
        assert [(q.reason, q.line) for q in bad] == [("corrupt_input", 101), ("corrupt_input", 102)]
        assert bad[0].raw == lines[100][:70].decode()


def test_the_gzip_member_after_a_damaged_one_starts_a_fresh_line(tmp_path: Path) -> None:
    lines = _random_lines(300)
    # Stored deflate blocks (level 0) with the member's last byte, d199's newline, changed: zlib inflates
    # it to its end, the CRC-32 fails, and its text ends inside a line.
    damaged = bytearray(gzip.compress(b"".join(lines[100:200]), compresslevel=0, mtime=0))
    assert damaged[-9] == ord("\n")
    damaged[-9] = ord("x")
    path = tmp_path / "three-members.jsonl.gz"
    path.write_bytes(gzip.compress(b"".join(lines[:100])) + bytes(damaged) + gzip.compress(b"".join(lines[200:])))
    docs, bad = read_input(InputConfig(path=str(path)))
    assert [d["id"] for d in docs] == [f"d{i}" for i in [*range(100), *range(200, 300)]]  # the intact members
    assert [(q.reason, q.line) for q in bad] == [("corrupt_input", line) for line in range(101, 201)]
    assert bad[0].detail.startswith("the gzip member holding lines 101-200 fails its check")


def test_glob_over_several_files_in_sorted_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    for name in ["b.jsonl", "a.jsonl", "c.jsonl", "sub/d.jsonl"]:
        write_jsonl(data / name, [{"text": f"{name} 1"}, {"text": f"{name} 2"}])
    (data / "c.jsonl").write_bytes(gzip.compress((data / "c.jsonl").read_bytes()))
    (data / "c.jsonl").rename(data / "c.jsonl.gz")
    monkeypatch.chdir(tmp_path)
    inputs = [InputConfig(path="data/*.jsonl*"), InputConfig(path="data/**/d.jsonl")]
    units = plan_units(inputs)
    # relative globs give relative paths, so derived ids do not depend on the working folder
    assert [(u.input_index, u.path) for u in units] == [
        (0, "data/a.jsonl"), (0, "data/b.jsonl"), (0, "data/c.jsonl.gz"), (1, "data/sub/d.jsonl"),
    ]
    docs, _ = read_all(units, inputs)
    assert [d["id"] for d in docs][:3] == ["data/a.jsonl:1", "data/a.jsonl:2", "data/b.jsonl:1"]
    assert [d["order"] for d in docs] == [order_key(u, r) for u in range(4) for r in range(2)]
    assert docs[-1]["text"] == "sub/d.jsonl 2"


def test_memory_urls_jsonl_and_parquet(mem: str) -> None:
    for name in ["b.jsonl", "a.jsonl"]:
        with fsspec.open(f"{mem}/j/{name}", "wb") as f:
            f.write(orjson.dumps({"text": name}) + b"\n")
    with fsspec.open(f"{mem}/p/x.parquet", "wb") as f:
        pq.write_table(pa.table({"text": ["p0", "p1"]}), f)
    inputs = [InputConfig(path=f"{mem}/j/*.jsonl"), InputConfig(path=f"{mem}/p/x.parquet")]
    units = plan_units(inputs)
    assert [(u.path, u.format) for u in units] == [
        (f"{mem}/j/a.jsonl", "jsonl"), (f"{mem}/j/b.jsonl", "jsonl"), (f"{mem}/p/x.parquet", "parquet"),
    ]
    docs, bad = read_all(units, inputs)
    assert [(d["text"], d["id"]) for d in docs] == [
        ("a.jsonl", f"{mem}/j/a.jsonl:1"), ("b.jsonl", f"{mem}/j/b.jsonl:1"),
        ("p0", f"{mem}/p/x.parquet:0"), ("p1", f"{mem}/p/x.parquet:1"),
    ]
    assert bad == []


# ------------------------------------------------------------------------------- parquet / arrow


def columnar_table() -> pa.Table:
    return pa.table({
        "text": ["zero", None, "", "three", "x" * 30],
        "id": pa.array([10, 11, None, 13, 14], pa.int64()),
        "domain": ["news", None, "x", "", "y"],
        "extra": [1, 2, 3, 4, 5],
    })


def check_columnar(docs: list[dict], bad: list[Quarantined], path: str, unit: int = 0) -> None:
    assert [(d["id"], d["domain"], d["text"], d["order"]) for d in docs] == [
        ("10", "news", "zero", order_key(unit, 0)),
        ("13", "default", "three", order_key(unit, 3)),
    ]
    assert [(q.reason, q.row, q.line, q.file) for q in bad] == [
        ("missing_text", 1, None, path), ("empty_text", 2, None, path), ("too_long", 4, None, path),
    ]
    assert json.loads(bad[0].raw) == {"text": None, "id": 11, "domain": None}


def test_parquet_batches_and_quarantine(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pq.write_table(columnar_table(), path, row_group_size=2)
    inp = InputConfig(path=str(path))
    docs, bad = read_input(inp, ReadConfig(batch_size=2, max_bytes_per_doc=20))
    check_columnar(docs, bad, str(path))
    docs, _ = read_input(InputConfig(path=str(path), id_field=None))
    assert [d["id"] for d in docs] == [f"{path}:0", f"{path}:3", f"{path}:4"]


@pytest.mark.parametrize("kind", ["file", "stream"])
def test_arrow_ipc_file_and_stream(tmp_path: Path, kind: str) -> None:
    path = tmp_path / ("t.arrow" if kind == "file" else "t.ipc")
    table = columnar_table()
    opener = pa.ipc.new_file if kind == "file" else pa.ipc.new_stream
    with opener(str(path), table.schema) as writer:
        for b in table.to_batches(max_chunksize=3):
            writer.write_batch(b)
    inp = InputConfig(path=str(path))
    assert [u.format for u in plan_units([inp])] == ["arrow"]
    docs, bad = read_input(inp, ReadConfig(batch_size=2, max_bytes_per_doc=20))
    check_columnar(docs, bad, str(path))


def test_columnar_text_column_must_be_a_string(tmp_path: Path) -> None:
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), ints)
    with pytest.raises(InputError, match=r"ints\.parquet.*must be a string column, got int64"):
        plan_units([InputConfig(path=str(ints))])
    nocol = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"body": ["a"]}), nocol)
    with pytest.raises(InputError, match=r"nocol\.parquet.*no column 'text'.*'body'"):
        plan_units([InputConfig(path=str(nocol))])
    # read_unit checks again (a unit built by hand)
    with pytest.raises(InputError, match="string column"):
        list(read_unit(InputUnit(0, str(ints), "parquet"), 0, InputConfig(path=str(ints)), READ))


def test_parquet_folder_with_explicit_format(tmp_path: Path) -> None:
    for name in ["b.parquet", "a.parquet"]:
        pq.write_table(pa.table({"text": [name]}), tmp_path / name)
    (tmp_path / "notes.md").write_text("not data")
    inp = InputConfig(path=str(tmp_path), format="parquet")
    assert [u.path for u in plan_units([inp])] == [f"{tmp_path}/a.parquet", f"{tmp_path}/b.parquet"]


# ------------------------------------------------------------------------------------------- text


def make_text_folder(root: Path) -> None:
    (root / "sub" / "deep").mkdir(parents=True)
    (root / "b.txt").write_text("bee")
    (root / "a.md").write_text("ay")
    (root / "sub" / "c.txt").write_text("sea")
    (root / "sub" / "deep" / "d.txt").write_text("dee")
    (root / "empty.txt").write_text("  \n")
    (root / "latin1.txt").write_bytes(b"caf\xe9")
    (root / "long.txt").write_text("L" * 100)


def test_text_folder(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    make_text_folder(root)
    inp = InputConfig(path=str(root), domain="books")
    units = plan_units([inp])
    assert [u.format for u in units] == ["text"]
    rels = ["a.md", "b.txt", "empty.txt", "latin1.txt", "long.txt", "sub/c.txt", "sub/deep/d.txt"]
    assert units[0].files == tuple(f"{root}/{r}" for r in rels)
    docs, bad = read_all(units, [inp], ReadConfig(max_bytes_per_doc=50))
    assert [(d["id"], d["text"], d["domain"], d["order"]) for d in docs] == [
        ("a.md", "ay", "books", 0), ("b.txt", "bee", "books", 1),
        ("sub/c.txt", "sea", "books", 5), ("sub/deep/d.txt", "dee", "books", 6),
    ]
    assert [(q.reason, q.file, q.row) for q in bad] == [
        ("empty_text", f"{root}/empty.txt", 2), ("invalid_utf8", f"{root}/latin1.txt", 3),
        ("too_long", f"{root}/long.txt", 4),
    ]


def test_text_glob_and_rows_per_unit_give_the_same_documents(tmp_path: Path) -> None:
    root = tmp_path / "docs"
    make_text_folder(root)
    one = InputConfig(path=str(root) + "/", glob="**/*.txt")
    split = InputConfig(path=str(root) + "/", glob="**/*.txt", rows_per_unit=2)
    units = plan_units([split])
    assert [(u.start, u.stop, len(u.files)) for u in units] == [(0, 2, 2), (2, 4, 2), (4, 6, 2)]
    strip = lambda docs: [(d["id"], d["text"]) for d in docs]  # noqa: E731
    docs_one, bad_one = read_input(one)
    docs_split, bad_split = read_input(split)
    assert strip(docs_one) == strip(docs_split)
    assert [q.file for q in bad_one] == [q.file for q in bad_split]
    assert strip(docs_one)[0] == ("b.txt", "bee")


# --------------------------------------------------------------------------------------------- hf


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Keep datasets' cache inside the test folder and make sure nothing reaches the network."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


HF_RECORDS = [
    {"text": f"doc {i}", "id": f"r{i}" if i % 2 else None, "domain": "odd" if i % 2 else None} for i in range(10)
]
HF_RECORDS[4]["text"] = ""


def check_hf(docs: list[dict], bad: list[Quarantined], name: str) -> None:
    assert [d["text"] for d in docs] == [f"doc {i}" for i in range(10) if i != 4]
    assert [d["id"] for d in docs][:3] == [f"{name}:0", "r1", f"{name}:2"]
    assert [d["domain"] for d in docs][:3] == ["default", "odd", "default"]
    assert [(q.reason, q.row, q.file) for q in bad] == [("empty_text", 4, name)]


def test_hf_load_dataset_from_local_files(tmp_path: Path, hf_cache: Path) -> None:
    src = tmp_path / "src.jsonl"
    write_jsonl(src, HF_RECORDS)
    one = InputConfig(path="json", format="hf", data_files=[str(src)])
    split = InputConfig(path="json", format="hf", data_files=[str(src)], rows_per_unit=3)
    assert plan_units([one]) == [InputUnit(0, "json", "hf", 0, 10)]
    units = plan_units([split])
    assert [(u.start, u.stop) for u in units] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    docs, bad = read_all(units, [split], ReadConfig(batch_size=2))
    check_hf(docs, bad, "json")
    assert docs[3]["order"] == order_key(1, 0)  # row 3 is the first row of unit 1
    docs_one, _ = read_input(one)
    assert [(d["id"], d["text"]) for d in docs_one] == [(d["id"], d["text"]) for d in docs]


def test_hf_load_error_names_the_input(hf_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="input 0 \\('json'\\)"):
        plan_units([InputConfig(path="json", format="hf", data_files=[str(tmp_path / "missing.jsonl")])])


def test_hf_disk_dataset_and_dataset_dict(tmp_path: Path, hf_cache: Path) -> None:
    import datasets

    ds = datasets.Dataset.from_list(HF_RECORDS)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds.select(range(2)), "valid": ds}).save_to_disk(str(tmp_path / "saved_dict"))

    saved = str(tmp_path / "saved")
    auto = InputConfig(path=saved, rows_per_unit=4)  # a save_to_disk folder is detected as hf_disk
    units = plan_units([auto])
    assert [(u.format, u.start, u.stop) for u in units] == [("hf_disk", 0, 4), ("hf_disk", 4, 8), ("hf_disk", 8, 10)]
    docs, bad = read_all(units, [auto])
    check_hf(docs, bad, saved)
    docs_one, _ = read_input(InputConfig(path=saved, format="hf_disk"))
    assert [(d["id"], d["text"]) for d in docs_one] == [(d["id"], d["text"]) for d in docs]

    saved_dict = str(tmp_path / "saved_dict")
    docs, bad = read_input(InputConfig(path=saved_dict, format="hf_disk", split="valid"))
    check_hf(docs, bad, saved_dict)
    with pytest.raises(InputError, match=r"split must be one of \['train', 'valid'\], got 'test'"):
        plan_units([InputConfig(path=saved_dict, split="test")])


# ---------------------------------------------------------------------------------------- errors


def test_plan_errors_name_the_input(tmp_path: Path, mem: str) -> None:
    def fails(inp: InputConfig, match: str) -> None:
        with pytest.raises(InputError, match=match) as info:
            plan_units([InputConfig(path=str(tmp_path / "ok.jsonl")), inp])
        assert inp.path in str(info.value) and "input 1" in str(info.value)

    write_jsonl(tmp_path / "ok.jsonl", [{"text": "fine"}])
    fails(InputConfig(path=str(tmp_path / "missing.jsonl")), "no such file")
    fails(InputConfig(path=f"{mem}/nothing.jsonl"), "no such file")
    fails(InputConfig(path=str(tmp_path / "*.parquet")), "matches no files")
    (tmp_path / "notes.txt").write_text("hello")
    fails(InputConfig(path=str(tmp_path / "notes.txt")), r"notes\.txt.*allowed:.*'\.jsonl'.*'\.parquet'")
    (tmp_path / "fake.jsonl.gz").write_bytes(b"not gzip at all")
    fails(InputConfig(path=str(tmp_path / "fake.jsonl.gz")), "cannot be read as jsonl")
    (tmp_path / "fake.parquet").write_bytes(b"nope")
    fails(InputConfig(path=str(tmp_path / "fake.parquet")), "cannot be read as parquet")
    fails(InputConfig(path=str(tmp_path / "ok.jsonl"), format="text"), "expects a folder")
    (tmp_path / "folder").mkdir()
    fails(InputConfig(path=str(tmp_path / "folder"), format="text", glob="*.md"), "no files under the folder match")
    fails(InputConfig(path=str(tmp_path / "folder"), format="jsonl"), "no jsonl files")


def test_plan_error_names_the_file_of_a_glob(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    (tmp_path / "b.csv").write_text("x")
    with pytest.raises(InputError, match=r"b\.csv"):
        plan_units([InputConfig(path=str(tmp_path / "*"))])


# ------------------------------------------------------------------------------------ real corpus


def test_corpus_slice_domains_from_source_field() -> None:
    path = ASSETS / "corpus_slice.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["source"] for r in records} == {"man", "license", "code"}
    inp = InputConfig(path=str(path), domain_field="source", domain="unknown")
    docs, bad = read_input(inp, ReadConfig(batch_size=7))
    assert bad == []
    assert [d["domain"] for d in docs] == [r["source"] for r in records]
    assert [d["id"] for d in docs] == [r["id"] for r in records]
    assert [d["text"] for d in docs] == [r["text"] for r in records]
    assert [d["order"] for d in docs] == list(range(len(records)))


# -------------------------------------------------------------------------- folders and JSON arrays


def test_a_folder_is_read_by_the_format_of_its_files(tmp_path: Path) -> None:
    jsonl = tmp_path / "jsonl"
    (jsonl / "sub").mkdir(parents=True)
    for k, name in enumerate(["b.jsonl", "a.jsonl", "sub/c.jsonl.gz"]):
        data = b"".join(orjson.dumps({"text": f"{name} record {i}"}) + b"\n" for i in range(20))
        (jsonl / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    (jsonl / ".DS_Store").write_bytes(b"\0\0")  # hidden files say nothing about the format
    inp = InputConfig(path=str(jsonl))
    units = plan_units([inp])
    assert [(u.format, u.path.rsplit("/", 1)[-1]) for u in units] == [
        ("jsonl", "a.jsonl"), ("jsonl", "b.jsonl"), ("jsonl", "c.jsonl.gz")]
    docs, bad = read_all(units, [inp])
    assert len(docs) == 60 and bad == []  # 60 records, not 3 text documents

    parquet = tmp_path / "parquet"
    parquet.mkdir()
    pq.write_table(pa.table({"text": ["one", "two"]}), parquet / "part-0.parquet")
    assert [u.format for u in plan_units([InputConfig(path=str(parquet))])] == ["parquet"]

    text = tmp_path / "text"
    make_text_folder(text)  # .txt and .md files: no data extension, so one document per file
    assert [u.format for u in plan_units([InputConfig(path=str(text))])] == ["text"]


def test_a_mixed_folder_is_refused_naming_the_extensions(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    pq.write_table(pa.table({"text": ["y"]}), tmp_path / "b.parquet")
    (tmp_path / "README.md").write_text("about the data")
    with pytest.raises(InputError, match=r"mixes files of different formats \(extensions \['\.jsonl', '\.md', '\.parquet'\]\); set 'format'"):
        plan_units([InputConfig(path=str(tmp_path))])
    # naming the format reads only its files
    assert [u.path for u in plan_units([InputConfig(path=str(tmp_path), format="jsonl")])] == [f"{tmp_path}/a.jsonl"]


@pytest.mark.parametrize("layout", ["pretty", "one_line", "gz"])
def test_a_json_array_is_refused_before_any_work(tmp_path: Path, layout: str) -> None:
    records = [{"id": i, "text": f"record {i}"} for i in range(5)]
    blob = json.dumps(records, indent=None if layout == "one_line" else 2).encode()
    path = tmp_path / ("data.json.gz" if layout == "gz" else "data.json")
    path.write_bytes(gzip.compress(blob) if layout == "gz" else blob)
    with pytest.raises(InputError, match=r"data\.json.*holds a JSON array.*Use JSON Lines"):
        plan_units([InputConfig(path=str(path))])


def test_jsonl_whose_first_line_is_a_stray_array_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'[1, 2]\n{"text": "fine"}\n')
    docs, bad = read_input(InputConfig(path=str(path)))
    assert [d["text"] for d in docs] == ["fine"] and [q.reason for q in bad] == ["not_an_object"]
