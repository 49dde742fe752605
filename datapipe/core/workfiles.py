"""Checked work files: every table a curation task hands to another carries its length and digest.

Work files are written without fsync (one PUT on an object store, a rename on a disk), so a power loss or
a full disk can leave one cut, emptied or changed after its task's record says it is done. A reader that
trusted it would stop with Arrow's traceback, or worse, read a changed row and write different shards.
So each work table ends with a trailer, and every read checks it before Arrow sees a byte::

    Arrow IPC file  b"DPCHECK1"  uint64 length of the Arrow file  uint64 xxh3_64 of it   (little endian)

A mismatch, a missing trailer or a missing file raises `DamagedWorkFile` naming the file; the run turns it
into one paragraph with the command that recovers. Shuffle files check themselves the same way, per
partition (`datapipe.core.shuffle`). xxh3 hashes at memory speed: the check costs no request and little CPU.
"""

from __future__ import annotations

import errno
import itertools
import json
import struct
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import xxhash

from datapipe.core.config import RunStopped
from datapipe.core.shards import atomic_write_bytes, table_bytes
from datapipe.core.storage import Location, RemotePath, cat_ranges, location

TRAILER_MAGIC = b"DPCHECK1"
_TRAILER = struct.Struct("<8sQQ")


MISSING = "it is missing (deleted after its task finished)"  # the problem of a work file that is gone


class DamagedWorkFile(RunStopped):
    """A work file that is not what its task wrote: cut, emptied, changed or gone."""

    def __init__(self, path: str | Location, problem: str) -> None:
        super().__init__(f"work file {path} is damaged: {problem}")
        self.path = str(path)
        self.problem = problem

    def __reduce__(self) -> tuple[type[DamagedWorkFile], tuple[str, str]]:
        # rebuilt from its own arguments, not the message: a task's damage reaches the driver through Ray as itself
        return type(self), (self.path, self.problem)


def digest(data: bytes | memoryview | pa.Buffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def checked(data: bytes) -> bytes:
    """`data` with its trailer."""
    return data + _TRAILER.pack(TRAILER_MAGIC, len(data), digest(data))


def verified(path: str | Location, data: pa.Buffer) -> pa.Buffer:
    """The payload of a checked file's bytes, or DamagedWorkFile."""
    if data.size < _TRAILER.size:
        raise DamagedWorkFile(path, f"{data.size} bytes, shorter than its trailer (emptied or cut)")
    magic, length, expected = _TRAILER.unpack(data.slice(data.size - _TRAILER.size).to_pybytes())
    if magic != TRAILER_MAGIC:
        raise DamagedWorkFile(path, "it does not end with its check trailer (cut, or not written by this version)")
    if length != data.size - _TRAILER.size:
        raise DamagedWorkFile(path, f"{data.size - _TRAILER.size} bytes where its task wrote {length}")
    payload = data.slice(0, length)
    if digest(memoryview(payload)) != expected:
        raise DamagedWorkFile(path, "its digest does not match what its task wrote (a changed byte)")
    return payload


def write_work_table(path: str | Path | Location, table: pa.Table, *, compression: str | None = None) -> None:
    """Write a checked Arrow IPC work file atomically (one request on an object store)."""
    atomic_write_bytes(path, checked(table_bytes(table, "arrow", compression)))


def read_work_bytes(path: str | Path | Location) -> pa.Buffer:
    """A checked work file's payload (memory-mapped when local), or DamagedWorkFile when it is damaged or gone."""
    path = location(path)
    try:
        if isinstance(path, RemotePath):
            data = pa.py_buffer(path.read_bytes(small=True))
        else:
            with pa.memory_map(str(path), "r") as source:
                data = source.read_buffer()
    except FileNotFoundError:
        raise DamagedWorkFile(path, MISSING) from None
    return verified(path, data)


def checked_ranges(paths: Sequence[Location], pieces: list) -> list[bytes]:
    """The pieces of `cat_ranges(..., on_error="return")` over work files (`paths[i]`'s range is `pieces[i]`): a file
    that is gone, or one a range starts past the end of (S3 answers 416, which s3fs raises as EINVAL: the file emptied
    or cut), is a DamagedWorkFile naming it; any other error is raised as it is."""
    for path, piece in zip(paths, pieces):
        if isinstance(piece, FileNotFoundError):
            raise DamagedWorkFile(path, MISSING)
        if isinstance(piece, OSError) and piece.errno == errno.EINVAL:
            raise DamagedWorkFile(path, "it is shorter than its task wrote (emptied or cut)")
        if isinstance(piece, BaseException):
            raise piece
    return pieces


def read_work_ranges(paths: Sequence[str | Path | Location], starts: list[int], ends: list[int]) -> list[bytes]:
    """Byte ranges of work files (`starts[i]` to `ends[i]` of `paths[i]`), unchecked (the caller checks what it reads:
    a frame's own checksum): on an object store all requested at once (`cat_ranges`), on a disk read in turn, a file
    opened once for its run of ranges; a missing file, or one shorter than a range, is a DamagedWorkFile naming it."""
    paths = [location(p) for p in paths]
    if paths and isinstance(paths[0], RemotePath):  # one work folder: every path on one file system
        out = checked_ranges(paths, cat_ranges(paths[0].fs, [p.path for p in paths], starts, ends, on_error="return"))
    else:
        out = []
        for path, ranges in itertools.groupby(zip(paths, starts, ends), key=lambda r: r[0]):
            try:
                with open(path, "rb") as f:
                    for _, a, b in ranges:
                        f.seek(a)
                        out.append(f.read(b - a))
            except FileNotFoundError:
                raise DamagedWorkFile(path, MISSING) from None
    for path, piece, a, b in zip(paths, out, starts, ends):
        if len(piece) != b - a:
            raise DamagedWorkFile(path, "it is shorter than its task wrote")
    return out


def read_work_table(path: str | Path | Location) -> pa.Table:
    """Read a table written by `write_work_table`, checked first."""
    return pa.ipc.open_file(read_work_bytes(path)).read_all()


def write_record(path: str | Path | Location, result: dict) -> None:
    """A task's record (written last, after its outputs): JSON with the check trailer."""
    atomic_write_bytes(path, checked(json.dumps(result, indent=1, sort_keys=True).encode() + b"\n"))


def read_record(path: str | Path | Location) -> dict | None:
    """A finished task's record, or None when the task must (re)run: no record, or one that is damaged (a record is
    written after its task's outputs, so running the task again rewrites the same files and a sound record)."""
    try:
        return json.loads(read_work_bytes(path).to_pybytes())
    except (DamagedWorkFile, ValueError):  # missing, cut, emptied or changed (json's errors are ValueErrors)
        return None
