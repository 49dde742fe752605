"""JSONL: JSON Lines files, plain or compressed, split into lines and parsed into documents or quarantine
records. Lines come from bounded blocks (a line too long to hold an allowed text is skipped unheld); each is
parsed into a document or quarantined (invalid UTF-8, malformed JSON, not an object, a bad text); the lines
of a damaged member and the rest of a cut file are quarantined too (`compressed` finds them)."""

from __future__ import annotations

import contextlib
import posixpath
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import orjson

from datapipe.curation.config import InputConfig, ReadConfig
from datapipe.curation.readers.common import (
    RAW_BYTES,
    InputUnit,
    Item,
    Quarantined,
    domain_of,
    id_of,
    raw_bytes,
    text_problem,
)
from datapipe.curation.readers.compressed import (
    BLOCK,
    MEMBER_NAMES,
    BadMember,
    decompressed,
    decompressors,
    is_decompression_error,
    unusable_lines,
)

BOM = b"\xef\xbb\xbf"


def _raw_chunks(f: Any) -> Iterator[bytes]:
    while chunk := f.read(BLOCK):
        yield chunk


@dataclass(frozen=True)
class _LongLine:
    """A line longer than the line limit: only its first bytes were kept (the rest was skipped unread)."""

    head: bytes


def _first_bytes(pieces: list[bytes], n: int) -> bytes:
    out, size = [], 0
    for piece in pieces:
        if size >= n:
            break
        out.append(piece[: n - size])
        size += len(out[-1])
    return b"".join(out)


def _iter_lines(chunks: Iterable[bytes], limit: int) -> Iterator[bytes | _LongLine]:
    """Lines (without '\\n') of a stream of byte blocks. A line longer than `limit` bytes comes as a
    `_LongLine` holding its first bytes: the rest of it is skipped up to the next newline without
    being held, so one huge line costs `limit` bytes of memory, not its length."""
    pending: list[bytes] = []
    pending_bytes = 0
    long_head: bytes | None = None  # set while skipping the rest of a long line
    for chunk in chunks:
        start = 0
        while start < len(chunk):
            nl = chunk.find(b"\n", start)
            end = len(chunk) if nl < 0 else nl
            if long_head is None and pending_bytes + end - start > limit:
                long_head = _first_bytes([*pending, chunk[start : start + RAW_BYTES]], RAW_BYTES)
                pending, pending_bytes = [], 0
            if nl < 0:
                if long_head is None:
                    pending.append(chunk[start:])
                    pending_bytes += len(chunk) - start
                break
            if long_head is not None:
                yield _LongLine(long_head)
                long_head = None
            elif pending:
                pending.append(chunk[start:nl])
                yield b"".join(pending)
                pending, pending_bytes = [], 0
            else:
                yield chunk[start:nl]
            start = nl + 1
    if long_head is not None:
        yield _LongLine(long_head)
    elif pending:
        yield b"".join(pending)


@contextlib.contextmanager
def _line_stream(path: str, limit: int) -> Iterator[Iterator[bytes | _LongLine]]:
    """The lines of a JSONL file, decompressed by its extension; lines over `limit` bytes as `_LongLine`."""
    make = decompressors().get(posixpath.splitext(path.lower())[1])
    with fsspec.open(path, "rb") as raw:
        yield _iter_lines(_raw_chunks(raw) if make is None else decompressed(raw, make), limit)


# JSON escaping grows a text at most 6x ("\u0001" for one byte), so a line longer than this many times
# `max_bytes_per_doc` cannot hold a text within the limit (unless its other fields are huge): it is
# quarantined as too_long without being held or parsed.
_LINE_FACTOR = 6


def jsonl_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[Item]:
    path, lineno = unit.path, 0
    extension = posixpath.splitext(path.lower())[1]
    compressed = extension in MEMBER_NAMES
    damaged: list[BadMember] = []  # members that fail their check, in order
    k = 0  # the first of them whose lines were not all passed yet

    def passed(upto: int) -> Iterator[Quarantined]:
        """One record for the part that never came out of each cut member ending before line `upto`."""
        nonlocal k
        while k < len(damaged) and damaged[k].last < upto:
            if damaged[k].cut:
                detail = (f"{damaged[k].why}: the part of it after line {damaged[k].last} never came out; "
                          "this record stands for it")
                yield Quarantined(path, damaged[k].last + 1, None, "corrupt_input", detail, "")
            k += 1

    try:
        if compressed:  # the first pass, before any line is used
            damaged = unusable_lines(path, decompressors()[extension], MEMBER_NAMES[extension])
        line_limit = _LINE_FACTOR * read.max_bytes_per_doc
        with _line_stream(path, line_limit) as lines:
            for lineno, line in enumerate(lines, start=1):
                yield from passed(lineno)
                if k < len(damaged) and damaged[k].first <= lineno:  # a line of a member that failed its check
                    raw = line.head if isinstance(line, _LongLine) else line
                    if raw.strip():  # blank lines are no records, here as anywhere
                        detail = (f"{damaged[k].why}: none of its lines is used, since the damage may have "
                                  "garbled any of them")
                        yield Quarantined(path, lineno, None, "corrupt_input", detail, raw_bytes(raw))
                    continue
                if isinstance(line, _LongLine):
                    detail = (f"line is longer than {line_limit} bytes ({_LINE_FACTOR} x max_bytes_per_doc="
                              f"{read.max_bytes_per_doc}), so its text is too; skipped unread")
                    yield Quarantined(path, lineno, None, "too_long", detail, raw_bytes(line.head))
                    continue
                line = line.rstrip(b"\r")
                if lineno == 1 and line.startswith(BOM):  # orjson refuses a BOM; editors write one
                    line = line[len(BOM) :]
                if not line.strip():
                    continue  # blank: skipped, but it keeps its line position

                def bad(reason: str, detail: str, line: bytes = line, lineno: int = lineno) -> Quarantined:
                    return Quarantined(path, lineno, None, reason, detail, raw_bytes(line))

                try:
                    rec = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    try:
                        line.decode("utf-8")
                    except UnicodeDecodeError as uexc:
                        yield bad("invalid_utf8", str(uexc))
                    else:
                        yield bad("malformed_json", str(exc))
                    continue
                if not isinstance(rec, dict):
                    yield bad("not_an_object", f"expected a JSON object, got {type(rec).__name__}")
                    continue
                text = rec.get(inp.text_field)
                problem = text_problem(text, inp.text_field, read.max_bytes_per_doc)
                if problem:
                    yield bad(*problem)
                    continue
                doc_id = id_of(rec.get(inp.id_field) if inp.id_field else None, f"{path}:{lineno}")
                domain = domain_of(rec.get(inp.domain_field) if inp.domain_field else None, inp.domain)
                yield (lineno - 1, doc_id, domain, text)
        yield from passed(sys.maxsize)
    except Exception as exc:
        if not (compressed and is_decompression_error(exc)):
            raise
        yield from passed(sys.maxsize)
        # A cut file, or damage after which the next member cannot be found: the lines before it were
        # handled above and the rest is set aside as one record, so one damaged file among many does not
        # stop the run (the rest of it cannot be counted). A cut file has no check to fail: the lines that
        # fully decoded are kept; damage is corrupt_input, and the first pass quarantined its member's lines.
        reason = "truncated_input" if isinstance(exc, EOFError) else "corrupt_input"
        detail = (f"cannot decompress past line {lineno} ({type(exc).__name__}: {exc}); the rest of the "
                  f"file is skipped (a line cut by the damage counts with the rest)")
        yield Quarantined(path, lineno + 1, None, reason, detail, "")
