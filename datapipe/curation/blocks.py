"""A block's documents after a segment: the text is written once, by the read task; segments write views.

The read task writes each block's documents to `work/read/<block>.arrow` (after the stages that rewrite
text: normalize), as one object of two parts (`write_read_block`): the texts, each compressed on its own
(one zstd frame a document, with its checksum), back to back; then an Arrow table of every other column
and `text_end`, where each document's frame ends. A whole read verifies the object's digest; a task that
wants a few documents (near dedup's exact check) reads just their frames by range (`read_texts`), each
checked by its frame's checksum, instead of the block. Every segment after it writes only what it decided
and changed, `work/<segment>/<block>.arrow` with one row per document it kept: `order` (which row of the
read block), `id` (renamed by `unique_ids` in the first segment), `lang` and `lang_score` (set by language
id). The documents of a block after a segment are the read block's rows at those orders with those columns
(`block_documents`), so the text is never copied from phase to phase: a segment costs ~6-30 bytes a
document instead of the document (datatrove's filter step likewise re-reads its input against a removal list).
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import zstandard

from datapipe.core.schema import DOC_SCHEMA
from datapipe.core.shards import atomic_write_bytes, table_bytes
from datapipe.core.storage import Location, location, spread
from datapipe.core.workfiles import DamagedWorkFile, checked, read_work_bytes, read_work_ranges, read_work_table, write_work_table

READ = "read"  # the folder of the read blocks: the one copy of the text
VIEW_SCHEMA = pa.schema([DOC_SCHEMA.field(name) for name in ("order", "id", "lang", "lang_score")])
LOCATOR_COLUMNS = ("text_at", "text_bytes")  # a document's frame in its read block: `block_documents(locate=True)`
_FRAMES_LENGTH = struct.Struct("<Q")  # the last bytes of a read block's payload: where its Arrow part starts
# zstd's level 1, not 3: cheaper to write and to read back (each phase that needs the text reads it) for a few percent
# more bytes (measured in BENCHMARKS.md, "read blocks' text frames at zstd level 1")
_TEXT_LEVEL = 1


def read_block_path(work: Location, block: str) -> Location:
    """Below a hashed prefix on an object store (`spread`): every segment, and the exact check by range, reads it."""
    return spread(work / READ / f"{block}.arrow")


def write_read_block(work: Location, block: str, table: pa.Table, compression: str | None) -> None:
    """The one copy of a block's documents (`table`, `DOC_SCHEMA`): its texts as one zstd frame each, back to back,
    then the other columns and `text_end` as Arrow IPC (`compression`), then the frames' length; one object."""
    frames = text_frames(_utf8_values(table.column("text")))
    ends = np.cumsum(np.fromiter(map(len, frames), dtype=np.int64, count=len(frames)))
    rest = table.drop(["text"]).append_column("text_end", pa.array(ends, pa.int64()))
    packed = b"".join(frames)
    atomic_write_bytes(read_block_path(work, block),
                       checked(packed + table_bytes(rest, "arrow", compression) + _FRAMES_LENGTH.pack(len(packed))))


def text_frames(texts: Sequence[bytes]) -> list[bytes]:
    """Each text (UTF-8) as a zstd frame of its own, with its checksum: how a read block stores its texts."""
    compressor = zstandard.ZstdCompressor(level=_TEXT_LEVEL, write_checksum=True)
    return [compressor.compress(t) for t in texts]


def _utf8_values(column: pa.ChunkedArray) -> list[bytes]:
    return [b"" if v is None else v for v in column.cast(pa.large_binary()).to_pylist()]


def _read_block(work: Location, block: str, with_text: bool, where: "Where | None" = None) -> pa.Table:
    """A read block's documents (`DOC_SCHEMA`, the text decompressed when `with_text`) with each one's frame
    (`LOCATOR_COLUMNS`); with `where`, only the rows it picks from the other columns (their frames alone decoded)."""
    path = read_block_path(work, block)
    payload = read_work_bytes(path)
    if payload.size < _FRAMES_LENGTH.size:
        raise DamagedWorkFile(path, "it is shorter than a read block's layout")
    (length,) = _FRAMES_LENGTH.unpack(payload.slice(payload.size - _FRAMES_LENGTH.size).to_pybytes())
    rest = pa.ipc.open_file(payload.slice(length, payload.size - _FRAMES_LENGTH.size - length)).read_all()
    ends = rest.column("text_end").to_numpy()
    starts = np.r_[0, ends[:-1]].astype(np.int64) if len(ends) else ends
    rest = rest.drop(["text_end"])
    if where is not None:
        rows = where(rest)
        rest, starts, ends = rest.take(pa.array(rows, pa.int64())), starts[rows], ends[rows]
    rest = rest.append_column("text_at", pa.array(starts, pa.int64())).append_column("text_bytes", pa.array(ends - starts, pa.int64()))
    if not with_text:
        return rest
    text = _decompress_block_texts(payload.slice(0, length), starts, ends - starts)
    at = DOC_SCHEMA.get_field_index("text")
    return rest.add_column(min(at, rest.num_columns), DOC_SCHEMA.field("text"), text)


def _decompress_block_texts(frames: pa.Buffer, at: np.ndarray, nbytes: np.ndarray) -> pa.LargeStringArray:
    """The texts of the frames at `at` (`nbytes` long) in a read block's frames, all decompressed in one call
    (zstd's `multi_decompress_to_buffer`, each frame checked by its checksum) rather than one call a document."""
    if not len(at):
        return pa.array([], pa.large_string())
    segments = np.stack([at, nbytes], axis=1).astype(np.uint64)
    decompressed = zstandard.ZstdDecompressor().multi_decompress_to_buffer(
        zstandard.BufferWithSegments(frames, segments.tobytes()))
    texts = [decompressed[i] for i in range(len(decompressed))]
    offsets = np.zeros(len(texts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)), out=offsets[1:])
    text = pa.LargeStringArray.from_buffers(len(texts), pa.py_buffer(offsets), pa.py_buffer(b"".join(texts)))
    text.validate(full=True)  # UTF-8, as the cast from binary checked it
    return text


FRAME_GAP = 32 << 10  # frames this close may share a request: at 64 in flight a request costs far more than 32 KiB
RANGE_WASTE = 2  # a shared range holds at most this many times the bytes of the frames wanted in it


def frame_ranges(at: np.ndarray, nbytes: np.ndarray, gap: int = FRAME_GAP,
                 waste: float = RANGE_WASTE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Neighbouring frames of one block coalesced into ranges: (each frame's range, the ranges' starts and ends).
    In block order, a frame joins the range before it when it starts at most `gap` bytes past that range's end and
    the range would still hold at most `waste` x the bytes of its frames, so a task that wants many documents of
    a block (a dense cluster of near copies) makes few requests, and one that wants a few far apart reads no more
    than twice their bytes (RANGE_WASTE)."""
    by_at = np.argsort(at, kind="stable")
    group = np.empty(len(at), np.int64)
    starts: list[int] = []
    ends: list[int] = []
    wanted = 0
    for i, a, n in zip(by_at.tolist(), at[by_at].tolist(), nbytes[by_at].tolist()):
        end = max(ends[-1], a + n) if ends else 0
        if ends and a <= ends[-1] + gap and end - starts[-1] <= waste * (wanted + n):
            ends[-1], wanted = end, wanted + n
        else:
            starts.append(a)
            ends.append(a + n)
            wanted = n
        group[i] = len(starts) - 1
    return group, np.array(starts, np.int64), np.array(ends, np.int64)


def read_texts(work: Location, block: str, at: np.ndarray, nbytes: np.ndarray) -> list[str]:
    """The texts whose frames are at `at` (`nbytes` long) in `block`'s read block (`read_blocks_texts` of one block)."""
    return read_blocks_texts(work, [(block, at, nbytes)])[0]


def read_blocks_texts(work: Location, frames: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> list[list[str]]:
    """For each (block, at, nbytes) of `frames`, the texts whose frames are at `at` (`nbytes` long) in that block's
    read block (`read_blocks_frames`), each frame checked by its own checksum."""
    return [decompress_frames(block_frames, [read_block_path(work, block)] * len(block_frames))
            for (block, _, _), block_frames in zip(frames, read_blocks_frames(work, frames))]


def read_blocks_frames(work: Location, frames: Sequence[tuple[str, np.ndarray, np.ndarray]], *, gap: int = FRAME_GAP,
                       waste: float = RANGE_WASTE) -> list[list[bytes]]:
    """For each (block, at, nbytes) of `frames`, the frames (compressed, as stored, unchecked: `decompress_frames`
    checks them) at `at` (`nbytes` long) in that block's read block: one range per run of neighbouring frames of a
    block (`frame_ranges` with `gap` and `waste`), and the ranges of all the blocks in one batched read
    (`read_work_ranges`: on an object store all in flight at once, as many as the connection pool holds), so a task
    that wants a few documents of each of many blocks waits for one round of requests, not one per block."""
    paths: list[Location] = []
    starts: list[int] = []
    ends: list[int] = []
    plans = []
    for block, at, nbytes in frames:
        group, block_starts, block_ends = frame_ranges(at, nbytes, gap, waste)
        plans.append((len(starts), group, block_starts))
        paths += [read_block_path(work, block)] * len(block_starts)
        starts += block_starts.tolist()
        ends += block_ends.tolist()
    ranges = read_work_ranges(paths, starts, ends)
    return [[bytes(memoryview(ranges[first + g])[a - block_starts[g] : a - block_starts[g] + n])
             for g, a, n in zip(group.tolist(), at.tolist(), nbytes.tolist())]
            for (_, at, nbytes), (first, group, block_starts) in zip(frames, plans)]


def decompress_frames(frames: Sequence[bytes], paths: Sequence[Location]) -> list[str]:
    """The text of each frame (`text_frames`), checked by its checksum; a frame that does not decompress is a
    DamagedWorkFile naming the read block it came from (`paths[i]`: frame i's)."""
    decompressor = zstandard.ZstdDecompressor()
    texts: list[str] = []
    try:
        for frame in frames:
            texts.append(decompressor.decompress(frame).decode("utf-8"))
    except (zstandard.ZstdError, UnicodeDecodeError) as exc:
        raise DamagedWorkFile(paths[len(texts)], f"a document's text does not decompress to what its task wrote ({exc})") from None
    return texts


def block_file(work: str | Location, folder: str, block: str) -> Location:
    """A block's file in a work folder, `<work>/<folder>/<block>.arrow` (a segment's view, its tokens, its rows of
    the eval split, ...): below a hashed key prefix on an object store (`spread`), as a phase writes one a block,
    thousands at once at scale."""
    return spread(location(work) / folder / f"{block}.arrow")


def write_view(work: Location, segment: str, block: str, documents: pa.Table) -> None:
    """Write a segment's output for a block: the kept documents' view columns (not their text)."""
    # zstd: orders run in sequence and ids share prefixes, ~26 bytes a document become ~6
    write_work_table(block_file(work, segment, block), documents.select(VIEW_SCHEMA.names).cast(VIEW_SCHEMA),
                       compression="zstd")


Where = Callable[[pa.Table], np.ndarray]  # the rows (ascending indices) to keep, from a block's columns without text


def block_documents(work: Location, segment: str, block: str, columns: list[str] | None = None, *,
                    locate: bool = False, where: Where | None = None) -> pa.Table:
    """The documents (`DOC_SCHEMA`, or just `columns`) of `block` as `segment` left them: the read block
    for `read`, else the read block's rows that the segment's view names, with the view's columns; only the
    texts of those rows are decompressed. A file that holds the text itself (an `eval.source` block) is
    returned as it is. `locate`: with each document's frame in the read block (`LOCATOR_COLUMNS`), for
    `read_texts`. `where`: of those documents, only the rows it picks from their `VIEW_SCHEMA` columns (a
    sample by id decodes the sampled texts alone)."""
    wanted = list(columns or DOC_SCHEMA.names) + (list(LOCATOR_COLUMNS) if locate else [])
    if segment == READ:
        return _read_block(work, block, "text" in wanted, where).select(wanted).cast(_schema(wanted))
    path = block_file(work, segment, block)
    table = read_work_table(path)
    if where is not None:
        table = table.take(pa.array(where(table), pa.int64()))
    if "text" in table.column_names:
        return table.select(columns) if columns else table
    if set(wanted) <= set(VIEW_SCHEMA.names):  # no text needed: the view alone
        return table.select(wanted)
    orders = table.column("order").to_numpy()

    def viewed(base: pa.Table) -> np.ndarray:  # the read block's rows the view names, in the view's order
        base_orders = base.column("order").to_numpy()
        rows = np.searchsorted(base_orders, orders)
        if len(orders) and (rows.max() >= len(base_orders) or (base_orders[rows] != orders).any()):  # a bug, never bad input
            raise RuntimeError(f"the view {path} names documents that the read block of {block} does not hold")
        return rows

    taken = _read_block(work, block, "text" in wanted, viewed)
    return pa.table({name: table.column(name) if name in VIEW_SCHEMA.names else taken.column(name) for name in wanted},
                    schema=_schema(wanted))


def _schema(names: list[str]) -> pa.Schema:
    return pa.schema([DOC_SCHEMA.field(n) if n in DOC_SCHEMA.names else pa.field(n, pa.int64()) for n in names])
