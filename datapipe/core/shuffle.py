"""Shuffle files: one file per sending task, holding its rows for every partition, with an offset header.

A shuffle moves rows from M sending tasks to P receiving tasks by a partition number per row. Writing
one file per (sender, partition) makes M x P objects, which an object store answers one request at a
time (1 B documents: ~10^8-10^9 objects a phase). Here each sender writes **one** file, its rows
sorted by partition, and each receiver reads its byte range of every sender's file (datatrove's
MinHash buckets are laid out the same way). Objects per phase: M; requests per receiver: two reads per
sender file (the header's pieces it needs, then its range: a header with many partitions is not read
whole), or one where it reads every partition (the file whole: a combine task's usual read), issued
concurrently on an object store (`fsspec`'s `cat_ranges`), seeks and reads on a local disk.

Layout (little endian)::

    b"DPSHUF02"  uint64 P  uint64 S  uint64 xxh3(schema)  uint64 offsets[P + 1]  uint64 xxh3(batch p)[P]
    schema (S bytes)  batch of p=0 ... batch of p=P-1

`schema` is the Arrow IPC schema message and each partition's rows are one Arrow IPC record-batch
message at `[offsets[p], offsets[p+1])` (empty when the sender had none for p). A reader checks the
schema and every range it reads against their digests, so a file cut, emptied or changed after it was
written is a `DamagedWorkFile` naming it, never rows read wrong (files are not fsynced). Files are written
whole (`atomic_write_bytes`: one PUT on an object store, a rename on a disk), so a killed sender
leaves no file, and a file's bytes depend only on its rows: resume gives identical files.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from datapipe.core.shards import atomic_write_bytes
from datapipe.core.storage import Location, RemotePath, cat_ranges, location, spread
from datapipe.core.workfiles import MISSING, DamagedWorkFile, checked_ranges, digest

MAGIC = b"DPSHUF02"
SUFFIX = ".shuffle"
_FIXED = len(MAGIC) + 24  # magic, P, S, the schema's digest
_SCHEMA_GUESS = 2048  # bytes read past the offsets in the first request: the schemas here are smaller


def shuffle_bytes(table: pa.Table, partition: np.ndarray, partitions: int) -> bytes:
    """The bytes of a shuffle file holding `table`'s rows, row i going to partition `partition[i]`
    (in `[0, partitions)`); rows keep their order within a partition."""
    partition = np.asarray(partition, dtype=np.int64)
    if len(partition) != table.num_rows:
        raise ValueError(f"{len(partition)} partition numbers for {table.num_rows} rows")
    if len(partition) and (partition.min() < 0 or partition.max() >= partitions):
        raise ValueError(f"partition numbers must be in [0, {partitions})")
    rows = np.argsort(partition, kind="stable")
    bounds = np.searchsorted(partition[rows], np.arange(partitions + 1))
    table = table.take(pa.array(rows)).combine_chunks() if table.num_rows else table
    schema = table.schema.serialize().to_pybytes()
    header = _schema_at(partitions) + len(schema)
    parts, offsets, digests, at = [], [header], [], header
    for p in range(partitions):
        start, stop = int(bounds[p]), int(bounds[p + 1])
        piece = table.slice(start, stop - start).to_batches()[0].serialize().to_pybytes() if stop > start else b""
        parts.append(piece)
        digests.append(digest(piece))
        at += len(piece)
        offsets.append(at)
    head = (MAGIC + struct.pack("<QQQ", partitions, len(schema), digest(schema)) + np.asarray(offsets, "<u8").tobytes()
            + np.asarray(digests, "<u8").tobytes() + schema)
    return b"".join([head, *parts])


def _digests_at(partitions: int) -> int:
    return _FIXED + 8 * (partitions + 1)


def _schema_at(partitions: int) -> int:
    return _digests_at(partitions) + 8 * partitions


def write_shuffle(path: str | Location, table: pa.Table, partition: np.ndarray, partitions: int) -> int:
    """Write a shuffle file (atomically, in one request on an object store); its size in bytes."""
    data = shuffle_bytes(table, partition, partitions)
    atomic_write_bytes(spread(location(path)), data)
    return len(data)


_SMALL_HEADER = 1 << 16  # a header up to this size is read whole; a larger one (many partitions) in pieces


def _header_ranges(p0: int, p1: int, partitions: int) -> list[tuple[int, int]]:
    """The byte ranges of a file's header that a reader of partitions p0..p1-1 needs: the fixed part, offsets
    p0 to p1, digests p0 to p1-1, and (a guess of) the schema. One range when the header is small."""
    schema_at = _schema_at(partitions)
    if schema_at <= _SMALL_HEADER:
        return [(0, schema_at + _SCHEMA_GUESS)]
    digests_at = _digests_at(partitions)
    return [(0, _FIXED), (_FIXED + 8 * p0, _FIXED + 8 * (p1 + 1)), (digests_at + 8 * p0, digests_at + 8 * p1),
            (schema_at, schema_at + _SCHEMA_GUESS)]


def range_requests(partitions: int) -> int:
    """Requests of one read of a range of a file of `partitions` on an object store: the header's pieces (one where
    the header is small, four past about 4,000 partitions) and the range (the cost model counts by this)."""
    return len(_header_ranges(0, 1, partitions)) + 1


class _Header:
    """What a reader of partitions p0..p1-1 learnt from a file's header."""

    def __init__(self, path: str, pieces: list[bytes], p0: int, p1: int, partitions: int) -> None:
        head = pieces[0]
        if len(head) < _FIXED or head[: len(MAGIC)] != MAGIC:
            raise DamagedWorkFile(path, f"no {MAGIC!r} header (emptied, cut or not a shuffle file of this version)")
        written_for, self.schema_len, self.schema_digest = struct.unpack_from("<QQQ", head, len(MAGIC))
        if written_for != partitions:
            raise DamagedWorkFile(path, f"its header says {written_for} partitions, not the run's {partitions}")
        n = p1 - p0
        if len(pieces) == 1:
            at, digests_at, schema_at = _FIXED + 8 * p0, _digests_at(partitions) + 8 * p0, _schema_at(partitions)
            offsets, digests = head[at : at + 8 * (n + 1)], head[digests_at : digests_at + 8 * n]
            self.schema = head[schema_at : schema_at + self.schema_len]
        else:
            offsets, digests, self.schema = pieces[1], pieces[2], pieces[3][: self.schema_len]
        if len(offsets) != 8 * (n + 1) or len(digests) != 8 * n:
            raise DamagedWorkFile(path, "its header is cut short")
        self.offsets = np.frombuffer(offsets, "<u8").astype(np.int64)
        self.digests = np.frombuffer(digests, "<u8")
        if (np.diff(self.offsets) < 0).any():
            raise DamagedWorkFile(path, "its partition offsets are out of order (a changed byte)")
        self.path = path

    def check(self, schema: bytes, body: bytes | memoryview) -> Piece:
        """The file's piece, once the schema and every partition's bytes match their digests."""
        if len(schema) != self.schema_len or digest(schema) != self.schema_digest:
            raise DamagedWorkFile(self.path, "its schema does not match its digest (cut or changed)")
        relative = self.offsets - self.offsets[0]
        if len(body) != relative[-1]:
            raise DamagedWorkFile(self.path, f"{len(body)} bytes where its header promises {relative[-1]} (cut)")
        for k, expected in enumerate(self.digests):
            if digest(body[relative[k] : relative[k + 1]]) != int(expected):
                raise DamagedWorkFile(self.path, "a partition's rows do not match their digest (a changed byte)")
        return schema, body, relative


# a file's schema, the bytes of partitions p0..p1-1 (a view of a file read whole), their offsets in them
Piece = tuple[bytes, bytes | memoryview, np.ndarray]


def _local_reads(paths: list[Path], p0: int, p1: int, partitions: int) -> list[Piece]:
    out = []
    for path in paths:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise DamagedWorkFile(path, MISSING) from None
        with f:
            pieces = []
            for a, b in _header_ranges(p0, p1, partitions):
                f.seek(a)
                pieces.append(f.read(b - a))
            header = _Header(str(path), pieces, p0, p1, partitions)
            schema = header.schema
            if len(schema) < header.schema_len:
                f.seek(_schema_at(partitions))
                schema = f.read(header.schema_len)
            f.seek(int(header.offsets[0]))
            body = f.read(int(header.offsets[-1] - header.offsets[0])) if header.offsets[-1] > header.offsets[0] else b""
            out.append(header.check(schema, body))
    return out


def _whole(path: str | Path, data: bytes, partitions: int) -> Piece:
    """A file read whole: its header, schema and every partition's bytes, checked."""
    header = _Header(str(path), [data], 0, partitions, partitions)
    schema_at = _schema_at(partitions)
    body = memoryview(data)[int(header.offsets[0]) : int(header.offsets[-1])]  # a view: the file is held once
    return header.check(data[schema_at : schema_at + header.schema_len], body)


def _whole_reads(paths: list[Path] | list[RemotePath], partitions: int) -> list[Piece]:
    """Every partition of each file: one read of the file whole, with no read of its header first."""
    if paths and isinstance(paths[0], RemotePath):
        fs = paths[0].fs
        datas = _cat_ranges(fs, paths, [x.path for x in paths], [0] * len(paths), [None] * len(paths))
        return [_whole(x, data, partitions) for x, data in zip(paths, datas)]
    out = []
    for path in paths:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DamagedWorkFile(path, MISSING) from None
        out.append(_whole(path, data, partitions))
    return out


def _remote_reads(paths: list[RemotePath], p0: int, p1: int, partitions: int) -> list[Piece]:
    """Concurrent range requests over all files: the headers' pieces, then the ranges."""
    fs, names = paths[0].fs, [x.path for x in paths]
    schema_at = _schema_at(partitions)
    ranges = _header_ranges(p0, p1, partitions)
    flat = _cat_ranges(fs, paths, [n for n in names for _ in ranges], [a for _ in names for a, _ in ranges],
                       [b for _ in names for _, b in ranges])
    parsed = [_Header(str(x), flat[i * len(ranges) : (i + 1) * len(ranges)], p0, p1, partitions) for i, x in enumerate(paths)]
    short = [i for i, h in enumerate(parsed) if len(h.schema) < h.schema_len]  # a schema past the guess
    schemas = [h.schema for h in parsed]
    if short:
        more = _cat_ranges(fs, paths, [names[i] for i in short], [schema_at] * len(short),
                           [schema_at + parsed[i].schema_len for i in short])
        for i, schema in zip(short, more):
            schemas[i] = schema
    todo = [i for i, h in enumerate(parsed) if h.offsets[-1] > h.offsets[0]]
    bodies = _cat_ranges(fs, paths, [names[i] for i in todo], [int(parsed[i].offsets[0]) for i in todo],
                         [int(parsed[i].offsets[-1]) for i in todo])
    got = dict(zip(todo, bodies))
    return [h.check(schemas[i], got.get(i, b"")) for i, h in enumerate(parsed)]


def _cat_ranges(fs, paths: list[RemotePath], names: list[str], starts: list[int], ends: list[int | None]) -> list[bytes]:
    """fsspec's concurrent range reads of `names` (of the files `paths`); a file that is gone, emptied or cut short of
    a range is a DamagedWorkFile naming it (`workfiles.checked_ranges`)."""
    by_name = {p.path: p for p in paths}
    return checked_ranges([by_name[n] for n in names], cat_ranges(fs, names, starts, ends, on_error="return"))


def read_shuffle(paths: Sequence[str | Location], p: int, partitions: int, schema: pa.Schema | None = None, *,
                 source_column: str | None = None, through: int | None = None,
                 partition_column: str | None = None) -> pa.Table | None:
    """Partition `p`'s rows of every shuffle file in `paths` (in that order, each file's rows in
    their order). None when there are no files and no `schema` is given; an empty table of the
    files' (or the given) schema when none holds a row for `p`. With `source_column`, a last int32
    column of that name holds each row's file (its index in `paths`). With `through`, partitions p to
    `through` - 1 (one range of each file: they are adjacent), file by file, and `partition_column`
    names an int32 column holding each row's partition."""
    p1 = p + 1 if through is None else through
    locations = [spread(location(x)) for x in paths]
    remote = [x for x in locations if isinstance(x, RemotePath)]
    if remote and len(remote) != len(locations):
        raise ValueError("shuffle files must all be local or all remote")
    if not locations:
        return schema.empty_table() if schema is not None else None
    if p == 0 and p1 == partitions:
        pieces = _whole_reads(locations, partitions)
    else:
        pieces = _remote_reads(remote, p, p1, partitions) if remote else _local_reads(locations, p, p1, partitions)
    # each file's rows by its own schema (a sender with no rows may have typed a column as null), unified
    tables = []
    for i, (schema_bytes, body, offsets) in enumerate(pieces):
        if not body:
            continue
        file_schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
        for k in range(p1 - p):
            if offsets[k + 1] == offsets[k]:
                continue
            batch = pa.ipc.read_record_batch(pa.py_buffer(body[offsets[k] : offsets[k + 1]]), file_schema)
            if source_column is not None:
                batch = batch.append_column(source_column, pa.array(np.full(batch.num_rows, i, np.int32)))
            if partition_column is not None:
                batch = batch.append_column(partition_column, pa.array(np.full(batch.num_rows, p + k, np.int32)))
            tables.append(pa.Table.from_batches([batch]))
    if not tables:
        empty = schema if schema is not None else pa.ipc.read_schema(pa.py_buffer(pieces[0][0]))
        for extra in (source_column, partition_column):
            if extra is not None and extra not in empty.names:
                empty = empty.append(pa.field(extra, pa.int32()))
        return empty.empty_table()
    return pa.concat_tables(tables, promote_options="default")


def shuffle_files(folder: str | Location, senders: Sequence[str]) -> list[Location]:
    """The shuffle files of the named senders in `folder` (no listing: the senders are known)."""
    folder = location(folder)
    return [folder / f"{name}{SUFFIX}" for name in senders]
