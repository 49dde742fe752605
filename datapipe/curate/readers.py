"""Readers: turn the configured inputs into streams of documents (`DOC_SCHEMA` record batches).

Reading has two steps so that the runner can spread the work:

1. `plan_units(inputs)` expands every input (a path, a glob or any fsspec URL) into `InputUnit`s, in
   input order and sorted within an input, so the plan is the same on every run. It checks everything
   it can before any work starts and raises `InputError` naming the input: nothing matched, a file
   that cannot be opened, an extension it cannot map to a format, a folder mixing formats, a JSON
   file holding one JSON array (JSON Lines only), a Hugging Face dataset that does not load, a
   columnar file without a string text column.
   `input_fingerprints(units, inputs)` gives each file they read a fingerprint (size and mtime, or
   size and ETag for a remote object), which the run record keeps so a resume notices an edited input.
2. `read_unit(unit, unit_index, inp, read)` streams one unit and yields `(batch, quarantined)`: a
   batch of at most `read.batch_size` documents and the records set aside while reading it.

Folders (`format: auto`): a saved Hugging Face dataset is `hf_disk`; otherwise the folder is read
by the format of its files' extensions (all `.jsonl[.gz|.zst|...]`, all `.parquet` or all `.arrow`),
and as text (one document per file) when none has a data extension. Hidden files do not count; a
folder whose files have several formats is refused, naming the extensions found.

JSON arrays are refused (not read): reading one needs the whole file in memory (no streaming JSON
parser among the dependencies), it has no line numbers for the quarantine, and it cannot be split.

Units: one file for jsonl/parquet/arrow; `rows_per_unit` files of a folder for text; a range of
`rows_per_unit` rows for hf/hf_disk.

Order: the i-th record position of a unit (blank lines and quarantined records counted too, so a
JSONL position is its line number - 1) gets `order_key(unit_index, i)`; the order therefore depends
only on the inputs, never on the number of workers.

Ids: the record's `id_field` (through `str()` when not a string). When it is missing, null or the
empty string, the id is derived: `f"{path}:{line}"` (1-based) for JSONL, `f"{path}:{row}"` (0-based
row of the file or dataset) for parquet/arrow/hf, the path relative to the folder for text files.

Domain: the record's `domain_field` when that is a non-empty string, else the input's `domain`.

Quarantine reasons (`QUARANTINE_REASONS`): invalid_utf8, malformed_json, not_an_object,
missing_text, text_not_string, empty_text (empty or whitespace only), too_long (more UTF-8 bytes
than `read.max_bytes_per_doc`), truncated_input (a compressed file cut short: the lines that fully
decoded are read, the rest of the file becomes this one record, with the line where reading
stopped), corrupt_input (a line of a compressed member that fails its check: a gzip member's CRC-32
or length, a zstd frame's checksum or data, a bz2/xz stream's data; none of its lines is kept, since
the damage may have garbled any of them; reading goes on with the next member when the damaged one's
end is known (gzip: its trailer; zstd: its block headers), else the rest of the file becomes one
record; the text after a damaged member starts a fresh line, so the next member's first record is not
glued to the damaged one's cut-off last line). A run is not stopped by one damaged file.

Damage is found before any line is used: a compressed JSONL file is decompressed twice, first to check
every member (gzip checks its CRC only at the end of a member, so zlib hands over garbled text until
then), keeping nothing but the line ranges of the members that fail, then to parse it (`_unusable_lines`).

A parquet/arrow/hf input whose text column is missing or not a string column is refused with
`InputError` at plan time (its schema is cheap to read) rather than quarantining every row: that is
almost always a wrong `text_field`. `read_unit` checks again and raises the same error. A column of
type null (all values null) is accepted; its rows are quarantined as `missing_text`.

Memory: JSONL is read in 1 MiB blocks split into lines (compressed ones decompressed 64 KiB of
input at a time, so damage loses little that came before it, into pieces of at most 1 MiB; zstd, which
has no output bound, 1 KiB of input at a time); a line longer than 6 x `max_bytes_per_doc` (more than
JSON escaping can make of an allowed text) is quarantined as too_long after its first bytes and the
rest of it skipped to the next newline unheld, parquet by row batches, Arrow IPC one record
batch at a time, text files up to `max_bytes_per_doc + 1` bytes, hf datasets (memory-mapped) by
`batch_size` row slices.
"""

from __future__ import annotations

import bz2
import contextlib
import lzma
import os
import posixpath
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Union

import fsspec
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from datapipe.curate.config import InputConfig, ReadConfig
from datapipe.core.config import ConfigError
from datapipe.core.schema import DOC_SCHEMA, order_key

QUARANTINE_REASONS = (
    "invalid_utf8",
    "malformed_json",
    "not_an_object",
    "missing_text",
    "text_not_string",
    "empty_text",
    "too_long",
    "truncated_input",
    "corrupt_input",
)
RAW_CHARS = 2000  # a quarantined record keeps at most this much of its raw form

_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}
# Outer compressions fsspec infers from the extension; only line formats may carry one.
_COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz", ".lzma")
_HF_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_MAGIC = re.compile(r"[*?\[]")
_BLOCK = 1 << 20
_STEP = 1 << 16  # compressed bytes per decompression step: what damage can take with it
_HEAD = 1 << 16  # bytes of a JSONL file read at plan time to tell a JSON array
_BOM = b"\xef\xbb\xbf"


class InputError(ConfigError):
    """An input that cannot be read; the message names the input path and what is wrong."""


@dataclass(frozen=True)
class InputUnit:
    """One independent piece of reading work (the unit of parallelism)."""

    input_index: int  # which InputConfig
    path: str  # file path / URL (for hf: the dataset name; for text: the folder)
    format: str  # resolved format, never "auto"
    start: int = 0  # for hf/hf_disk/text units: first row/file index of this unit
    stop: int | None = None  # exclusive end, None = to the end
    files: tuple[str, ...] = ()  # for format 'text': the files of this unit (sorted)


@dataclass
class Quarantined:
    """A record set aside while reading, with where it was and why."""

    file: str
    line: int | None  # 1-based line number (JSONL)
    row: int | None  # 0-based row (parquet/arrow/hf) or file index in the folder (text)
    reason: str  # one of QUARANTINE_REASONS
    detail: str
    raw: str  # the raw record, truncated to RAW_CHARS characters


# A record stream item: (position in unit, id, domain, text) or a quarantined record.
_Item = Union[tuple[int, str, str, str], Quarantined]


# ----------------------------------------------------------------------------------------- plan


def plan_units(inputs: list[InputConfig]) -> list[InputUnit]:
    """Expand paths/globs/URLs (via fsspec, sorted, deterministic) into units, in input order.

    Raises InputError before any work, naming the input (`inputs[i].path`) and what is wrong.
    """
    units: list[InputUnit] = []
    for i, inp in enumerate(inputs):
        where = f"input {i} ({inp.path!r})"
        try:
            units.extend(_plan_input(i, inp, where))
        except InputError:
            raise
        except (OSError, ValueError, ImportError) as exc:  # fsspec/URL trouble (ImportError: protocol package missing)
            raise InputError(f"{where}: cannot be read: {exc}") from exc
    return units


def unit_files(unit: InputUnit, inp: InputConfig) -> list[str]:
    """The files a unit reads: its file, a text unit's files, every file of a saved dataset's folder,
    a hub dataset's local `data_files` (a hub dataset by name has no file of ours to look at)."""
    if unit.format == "text":
        return list(unit.files)
    if unit.format == "hf":
        return list(inp.data_files)
    if unit.format == "hf_disk":
        fs, root = fsspec.core.url_to_fs(unit.path)
        return [_rejoin(fs, unit.path.rstrip("/") + "/", root.rstrip("/") + "/", p) for p in sorted(fs.find(root))]
    return [unit.path]


# fs.info keys that change when a remote object is rewritten, most specific first (S3/HTTP ETag, GCS
# md5Hash/generation, Azure etag/last_modified, ...); the first one present is recorded beside the size.
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "VersionId", "version_id", "LastModified",
                 "last_modified", "mtime", "modified", "created")


def file_fingerprint(path: str) -> dict[str, Any]:
    """What a file is now, cheaply: size and modification time (ns) for a local file; size and the
    object's version (ETag, generation, modification time: what `fs.info` gives) for a remote one."""
    fs, stripped = fsspec.core.url_to_fs(path)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        st = os.stat(stripped)
        return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    info = fs.info(stripped)
    fingerprint: dict[str, Any] = {"size": info.get("size")}
    for key in _VERSION_KEYS:
        if info.get(key) is not None:
            fingerprint[key] = str(info[key])
            break
    return fingerprint


def input_fingerprints(units: list[InputUnit], inputs: list[InputConfig]) -> dict[str, dict[str, Any]]:
    """{path: fingerprint} of every file the units read, so a resume can tell an input edited since the
    run started (the run record keeps them; `runner._check_output` compares)."""
    found: dict[str, dict[str, Any]] = {}
    seen_datasets: set[tuple[int, str]] = set()
    for unit in units:
        if unit.format in ("hf", "hf_disk"):  # row-range units of one dataset share its files: list them once
            if (unit.input_index, unit.path) in seen_datasets:
                continue
            seen_datasets.add((unit.input_index, unit.path))
        for path in unit_files(unit, inputs[unit.input_index]):
            if path not in found:
                try:
                    found[path] = file_fingerprint(path)
                except (OSError, ValueError) as exc:
                    raise InputError(f"input {unit.input_index} ({path!r}): cannot be read: {exc}") from exc
    return found


# Text bytes per file byte assumed for a compressed input when sizing blocks (`estimated_text_bytes`): a guess
# that only moves the block size (text compresses 3-6x with gzip/zstd; the shared corpus 5.7x).
COMPRESSED_TEXT_RATIO = 4
_COMPRESSED_SUFFIXES = (".gz", ".zst", ".zstd", ".bz2", ".xz", ".parquet")


def estimated_text_bytes(fingerprints: dict[str, dict[str, Any]]) -> int | None:
    """About how many bytes of text the input files hold, from their sizes ({path: fingerprint}, as
    `input_fingerprints` gives): a compressed file counts COMPRESSED_TEXT_RATIO times its size. None when
    a size is unknown (a remote store that gives none). Sizes `read.block_bytes: auto`."""
    total = 0
    for path, fingerprint in fingerprints.items():
        size = fingerprint.get("size")
        if size is None:
            return None
        total += int(size) * (COMPRESSED_TEXT_RATIO if path.lower().endswith(_COMPRESSED_SUFFIXES) else 1)
    return total


def _plan_input(i: int, inp: InputConfig, where: str) -> list[InputUnit]:
    if inp.format == "hf":
        ds = _load_hf(inp.path, inp, where)
        _check_text_column(ds.data.schema, inp, where)
        return _row_units(i, inp.path, "hf", len(ds), inp.rows_per_unit)

    fs, root = fsspec.core.url_to_fs(inp.path)
    if inp.format not in ("text", "hf_disk") and _MAGIC.search(root):
        # A glob: files only, sorted; each keeps the protocol and form of the written path.
        found = fs.glob(root, detail=True)
        stripped_base, written_base = _static_prefix(root), _static_prefix(inp.path)
        files = sorted(p for p, info in found.items() if info.get("type") == "file")
        if not files:
            raise InputError(f"{where}: the glob matches no files")
        paths = [_rejoin(fs, written_base, stripped_base, p) for p in files]
    elif not fs.exists(root):
        raise InputError(f"{where}: no such file or folder")
    elif fs.isdir(root):
        fmt = inp.format
        if fmt == "auto":
            fmt = _folder_format(fs, root, inp, where)
        if fmt == "text":
            return _plan_text(i, inp, fs, root, where)
        if fmt == "hf_disk":
            ds = _load_disk(inp.path, inp.split, where)
            _check_text_column(ds.data.schema, inp, where)
            return _row_units(i, inp.path, "hf_disk", len(ds), inp.rows_per_unit)
        # A folder given with a file format: every file under it with that format's extension.
        files = sorted(p for p in fs.find(root) if _format_of(p) == fmt)
        if not files:
            raise InputError(f"{where}: the folder has no {fmt} files (extensions {_extensions_of(fmt)})")
        paths = [_rejoin(fs, inp.path.rstrip("/") + "/", root.rstrip("/") + "/", p) for p in files]
    elif inp.format in ("text", "hf_disk"):
        raise InputError(f"{where}: format {inp.format!r} expects a folder, got a file")
    else:
        paths = [inp.path]

    units = []
    for path in paths:
        fmt = inp.format if inp.format != "auto" else _format_of(path)
        if fmt is None:
            raise InputError(
                f"{where}: cannot tell the format of {path!r} from its extension; allowed: "
                f"{sorted(_EXTENSIONS)} (jsonl also with {list(_COMPRESSIONS)}) or a folder; "
                "or set 'format'"
            )
        _check_file(path, fmt, inp, where)
        units.append(InputUnit(i, path, fmt))
    return units


def _plan_text(i: int, inp: InputConfig, fs: Any, root: str, where: str) -> list[InputUnit]:
    base = root.rstrip("/") + "/"
    found = fs.glob(base + inp.glob, detail=True)
    rels = sorted(p[len(base) :] for p, info in found.items() if info.get("type") == "file" and p.startswith(base))
    if not rels:
        raise InputError(f"{where}: no files under the folder match glob {inp.glob!r}")
    written = inp.path.rstrip("/") + "/"
    files = [written + r for r in rels]  # so the id (relative path) is the suffix after unit.path
    n = inp.rows_per_unit
    return [
        InputUnit(i, inp.path, "text", start=s, stop=min(s + n, len(files)), files=tuple(files[s : s + n]))
        for s in range(0, len(files), n)
    ]


def _folder_format(fs: Any, root: str, inp: InputConfig, where: str) -> str:
    """The format of a folder given with `format: auto`: a saved Hugging Face dataset, else the one
    format of its files' extensions (JSONL, Parquet, Arrow), else text when none of its files has a
    data extension. A folder mixing them is refused, naming the extensions found."""
    base = root.rstrip("/") + "/"
    if any(fs.exists(base + m) for m in _HF_DISK_MARKERS):
        return "hf_disk"
    found = fs.glob(base + inp.glob, detail=True)
    files = sorted(p for p, info in found.items() if info.get("type") == "file")
    by_format: dict[str | None, set[str]] = {}
    for p in files:
        name = p.rsplit("/", 1)[-1]
        if name.startswith("."):
            continue  # hidden files (.DS_Store, editor swap files) say nothing about the data
        by_format.setdefault(_format_of(p), set()).add(_extension_of(name))
    formats = sorted(f for f in by_format if f is not None)
    if not formats:
        return "text"
    if len(by_format) == 1:
        return formats[0]
    found_exts = sorted(e for exts in by_format.values() for e in exts)
    raise InputError(
        f"{where}: the folder mixes files of different formats (extensions {found_exts}); set 'format' "
        f"(one of {formats + ['text'] if None in by_format else formats}) to read only the files of that "
        "format, or give a glob such as 'folder/*.jsonl' as the path"
    )


def _extension_of(name: str) -> str:
    """'.jsonl.gz' for 'a.jsonl.gz', '.txt' for 'a.txt', '' for 'README'."""
    base, ext = posixpath.splitext(name.lower())
    if ext in _COMPRESSIONS:
        ext = posixpath.splitext(base)[1] + ext
    return ext


def _row_units(i: int, path: str, fmt: str, n_rows: int, per_unit: int) -> list[InputUnit]:
    return [InputUnit(i, path, fmt, start=s, stop=min(s + per_unit, n_rows)) for s in range(0, n_rows, per_unit)]


def _static_prefix(path: str) -> str:
    """The part of a glob before its first wildcard, up to and including the last '/'."""
    m = _MAGIC.search(path)
    head = path[: m.start()] if m else path
    return head[: head.rfind("/") + 1]


def _rejoin(fs: Any, written_base: str, stripped_base: str, p: str) -> str:
    """An expanded path in the form the user wrote (relative stays relative, URL keeps protocol)."""
    if p.startswith(stripped_base):
        return written_base + p[len(stripped_base) :]
    return fs.unstrip_protocol(p)


def _format_of(path: str) -> str | None:
    name = path.rsplit("/", 1)[-1].lower()
    base, ext = posixpath.splitext(name)
    compressed = ext in _COMPRESSIONS
    if compressed:
        ext = posixpath.splitext(base)[1]
    fmt = _EXTENSIONS.get(ext)
    return None if compressed and fmt != "jsonl" else fmt


def _extensions_of(fmt: str) -> list[str]:
    return [e for e, f in _EXTENSIONS.items() if f == fmt]


def _check_file(path: str, fmt: str, inp: InputConfig, where: str) -> None:
    """Open the file (and read the schema of columnar ones) so a bad input fails before any work."""
    name = f"{where}: {path!r}" if path != inp.path else where
    try:
        if fmt == "jsonl":
            with fsspec.open(path, "rb", compression="infer") as f:
                head = f.read(1)  # also checks the compression header
                try:
                    head += f.read(_HEAD - 1)
                except Exception as exc:  # damage further in is quarantined while reading
                    if not _is_decompression_error(exc):
                        raise
            if _is_json_array(head):
                raise InputError(
                    f"{name}: holds a JSON array, but datapipe reads JSON Lines (one JSON object per "
                    "line), so every line would be quarantined as malformed_json. Use JSON Lines: "
                    "convert it, e.g. with `jq -c '.[]' FILE > FILE.jsonl`"
                )
            return
        with fsspec.open(path, "rb") as f:
            schema = pq.read_schema(f) if fmt == "parquet" else _open_ipc(f)[0]
    except InputError:
        raise
    except Exception as exc:  # any decoder/IO failure means the same thing here: unreadable
        raise InputError(f"{name}: cannot be read as {fmt}: {type(exc).__name__}: {exc}") from exc
    _check_text_column(schema, inp, name)


def _is_json_array(head: bytes) -> bool:
    """Whether a file starting with `head` holds one JSON array (rather than JSON Lines): it starts
    with '[' and its first line is not a whole JSON value, or is a list of objects (records)."""
    text = head.lstrip(_BOM).lstrip()
    if not text.startswith(b"["):
        return False
    first, newline, _ = text.partition(b"\n")
    if not newline and len(head) >= _HEAD:
        return True  # a first line longer than the head: an array written on one line
    try:
        value = orjson.loads(first)
    except orjson.JSONDecodeError:
        return True  # an array spread over several lines (pretty-printed)
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


def _check_text_column(schema: pa.Schema, inp: InputConfig, where: str) -> None:
    if inp.text_field not in schema.names:
        raise InputError(f"{where}: no column {inp.text_field!r} (text_field); columns: {schema.names}")
    tp = schema.field(inp.text_field).type
    if pa.types.is_dictionary(tp):
        tp = tp.value_type
    t = pa.types
    if not (t.is_string(tp) or t.is_large_string(tp) or t.is_string_view(tp) or t.is_null(tp)):
        raise InputError(f"{where}: column {inp.text_field!r} (text_field) must be a string column, got {tp}")


def _load_hf(name: str, inp: InputConfig, where: str) -> Any:
    import datasets  # heavy; only hf inputs need it

    try:
        return datasets.load_dataset(name, data_files=list(inp.data_files) or None, split=inp.split)
    except Exception as exc:  # datasets raises many types (hub, builder, file errors)
        raise InputError(f"{where}: cannot load Hugging Face dataset: {type(exc).__name__}: {exc}") from exc


def _load_disk(path: str, split: str, where: str) -> Any:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:
        raise InputError(f"{where}: cannot load a saved dataset: {type(exc).__name__}: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise InputError(f"{where}: split must be one of {sorted(ds)}, got {split!r}")
        ds = ds[split]
    return ds


# ----------------------------------------------------------------------------------------- read


def read_unit(
    unit: InputUnit, unit_index: int, inp: InputConfig, read: ReadConfig
) -> Iterator[tuple[pa.RecordBatch, list[Quarantined]]]:
    """Yield (documents as a DOC_SCHEMA RecordBatch of at most read.batch_size rows, the quarantined
    records met while reading that batch).

    The i-th record of the unit (quarantined ones and blank lines counted too) gets
    order = order_key(unit_index, i).
    """
    readers = {"jsonl": _jsonl_items, "parquet": _parquet_items, "arrow": _arrow_items, "text": _text_items}
    if unit.format in readers:
        items = readers[unit.format](unit, inp, read)
    elif unit.format in ("hf", "hf_disk"):
        items = _hf_items(unit, inp, read)
    else:
        allowed = sorted([*readers, "hf", "hf_disk"])
        raise InputError(f"unit {unit.path!r}: format must be one of {allowed}, got {unit.format!r}")

    ids: list[str] = []
    domains: list[str] = []
    texts: list[str] = []
    orders: list[int] = []
    quarantined: list[Quarantined] = []

    def take() -> tuple[pa.RecordBatch, list[Quarantined]]:
        nonlocal ids, domains, texts, orders, quarantined
        n = len(ids)
        batch = pa.RecordBatch.from_arrays(
            [pa.array(ids, pa.string()), pa.array(domains, pa.string()),
             pa.array(texts, pa.large_string()), pa.array(orders, pa.int64()),
             pa.nulls(n, pa.string()), pa.nulls(n, pa.float32())],  # language: tagged later
            schema=DOC_SCHEMA,
        )
        out = (batch, quarantined)
        ids, domains, texts, orders, quarantined = [], [], [], [], []
        return out

    for item in items:
        if isinstance(item, Quarantined):
            quarantined.append(item)
        else:
            pos, doc_id, domain, text = item
            ids.append(doc_id)
            domains.append(domain)
            texts.append(text)
            orders.append(order_key(unit_index, pos))
        # Quarantined records also flush, so a file of garbage does not pile up in memory.
        if len(ids) >= read.batch_size or len(quarantined) >= read.batch_size:
            yield take()
    if ids or quarantined:
        yield take()


def _text_problem(text: object, field: str, max_bytes: int) -> tuple[str, str] | None:
    """(reason, detail) when `text` cannot be a document, else None."""
    if text is None:
        return "missing_text", f"no value in field {field!r}"
    if not isinstance(text, str):
        return "text_not_string", f"field {field!r} holds a {type(text).__name__}, not a string"
    if not text or text.isspace():
        return "empty_text", f"field {field!r} is empty or whitespace only"
    # Cheap bounds first: a character is 1..4 UTF-8 bytes; encode only when it could go either way.
    if len(text) > max_bytes or (len(text) * 4 > max_bytes and len(text.encode("utf-8")) > max_bytes):
        return "too_long", f"text is longer than max_bytes_per_doc={max_bytes} UTF-8 bytes"
    return None


def _id_of(value: object, derived: str) -> str:
    if value is None or value == "":
        return derived
    return value if isinstance(value, str) else str(value)


def _domain_of(value: object, default: str) -> str:
    return value if isinstance(value, str) and value.strip() else default


_RAW_BYTES = RAW_CHARS * 4  # enough bytes for RAW_CHARS characters (at most 4 bytes each)


def _raw_bytes(data: bytes) -> str:
    return data[:_RAW_BYTES].decode("utf-8", "replace")[:RAW_CHARS]


class _MaxLength:
    """A zlib/bz2/lzma decompressor whose output comes in pieces of at most _BLOCK bytes (`max_length`),
    so a small compressed step of a highly repetitive text (gzip inflates up to ~1000x) is not
    decompressed whole at once."""

    damage = None  # bz2/lzma report a failed check by raising: the stream's end is then unknown

    def __init__(self, d: Any) -> None:
        self.d = d

    @property
    def eof(self) -> bool:
        return self.d.eof

    @property
    def unused_data(self) -> bytes:
        return self.d.unused_data

    def pieces(self, data: bytes) -> Iterator[bytes]:
        zlib_like = hasattr(self.d, "unconsumed_tail")
        while True:
            out = self.d.decompress(data, _BLOCK)
            if out:
                yield out
            if self.d.eof:
                return
            if zlib_like:  # unconsumed input waits in unconsumed_tail; a full piece may leave output pending
                data = self.d.unconsumed_tail
                if not data and len(out) < _BLOCK:
                    return
            else:  # bz2/lzma keep unconsumed input themselves and say when they need more
                data = b""
                if self.d.needs_input:
                    return


class _ZstdSlices:
    """A zstd decompressor fed _ZSTD_SLICE bytes at a time: zstandard's decompressobj has no output bound,
    and a zstd block of a repeated byte inflates ~32,000x, so a small input slice is the bound."""

    damage = None  # zstandard reports a failed checksum by raising; `frame_end` then finds the next frame

    def __init__(self) -> None:
        import zstandard

        self.d = zstandard.ZstdDecompressor().decompressobj()
        self.unused_data = b""

    @staticmethod
    def frame_end(raw: Any, start: int) -> int | None:
        """Where the zstd frame that begins at compressed offset `start` ends, read from its block headers
        (RFC 8878) without decoding it; None when its framing is damaged too or the file cannot seek."""
        import zstandard

        try:
            raw.seek(start)
            head = raw.read(18)  # the longest frame header
            magic = int.from_bytes(head[:4], "little")
            if len(head) >= 8 and magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame: its size follows
                end = start + 8 + int.from_bytes(head[4:8], "little")
            elif len(head) >= 6 and magic == 0xFD2FB528:
                at = start + zstandard.frame_header_size(head)
                while True:
                    raw.seek(at)
                    block = raw.read(3)
                    if len(block) < 3:
                        return None
                    word = int.from_bytes(block, "little")
                    kind, size = (word >> 1) & 3, word >> 3
                    if kind == 3:  # reserved block type
                        return None
                    at += 3 + (1 if kind == 1 else size)  # an RLE block stores one byte
                    if word & 1:  # the last block
                        break
                end = at + (4 if head[4] & 0x04 else 0)  # the content checksum
            else:
                return None
            raw.seek(end - 1)
            if len(raw.read(1)) != 1:  # the frame runs past the end of the file: not a frame end
                return None
            return end
        except (OSError, ValueError, zstandard.ZstdError):
            return None

    @property
    def eof(self) -> bool:
        return self.d.eof

    def pieces(self, data: bytes) -> Iterator[bytes]:
        for at in range(0, len(data), _ZSTD_SLICE):
            if out := self.d.decompress(data[at : at + _ZSTD_SLICE]):
                yield out
            if self.d.eof:
                self.unused_data = self.d.unused_data + data[at + _ZSTD_SLICE :]
                return


_ZSTD_SLICE = 1 << 10  # compressed bytes per zstd call: at most ~32 MiB of output even for a run of one byte


class _BadStream(ValueError):
    """Compressed data that is not what its format says (a gzip header that is not one)."""


_GZIP_HEAD_MAX = 1 << 20  # a longer gzip header (a file name, a comment, extra fields) is not a header


def _gzip_header_size(head: bytes) -> int | None:
    """The size of the gzip member header (RFC 1952) that `head` starts with; None while more bytes are needed."""
    if head[:3] != b"\x1f\x8b\x08"[: len(head[:3])]:
        raise _BadStream(f"not a gzip member (it starts with {head[:3].hex()}, not 1f8b08)")
    if len(head) < 10:
        return None
    flags, at = head[3], 10
    if flags & 0xE0:
        raise _BadStream(f"not a gzip member (reserved header flags {flags:#04x})")
    if flags & 0x04:  # FEXTRA: a length, then that many bytes
        if len(head) < at + 2:
            return None
        at += 2 + int.from_bytes(head[at : at + 2], "little")
    for flag in (0x08, 0x10):  # FNAME, FCOMMENT: zero-terminated
        if flags & flag:
            end = head.find(b"\x00", at)
            if end < 0:
                return None
            at = end + 1
    if flags & 0x02:  # FHCRC: the low 16 bits of the CRC-32 of the header before it
        if len(head) < at + 2:
            return None
        if int.from_bytes(head[at : at + 2], "little") != zlib.crc32(head[:at]) & 0xFFFF:
            raise _BadStream("the gzip member's header fails its CRC")
        at += 2
    return at if len(head) >= at else None


class _GzipMember:
    """One gzip member (RFC 1952), its header parsed and its CRC-32 and length checked here, its deflate
    data inflated raw in bounded pieces (`_MaxLength`). zlib's own gzip mode (wbits=31) reports a failed
    check as an error with no say in where the member ended; here a member that fails its check ends at
    its trailer like any other (`damage` says why), so the members after it are still read. Zero bytes
    where a member would start are padding, skipped as gzip and Python's gzip module do."""

    def __init__(self) -> None:
        self.head = b""  # header bytes gathered until the header is complete
        self.body: _MaxLength | None = None  # raw deflate, once the header is parsed
        self.crc = self.size = 0  # of the decoded bytes
        self.trailer = b""
        self.eof = False
        self.unused_data = b""
        self.damage: str | None = None

    def pieces(self, data: bytes) -> Iterator[bytes]:
        if self.body is None:
            if not self.head:
                data = data.lstrip(b"\x00")
                if not data:  # padding only: no member here
                    self.eof = True
                    return
            self.head += data
            size = _gzip_header_size(self.head[:_GZIP_HEAD_MAX])
            if size is None:
                if len(self.head) >= _GZIP_HEAD_MAX:
                    raise _BadStream(f"not a gzip member (no end of its header in {_GZIP_HEAD_MAX} bytes)")
                return
            data, self.head = self.head[size:], b""
            self.body = _MaxLength(zlib.decompressobj(wbits=-15))
        if not self.body.eof:
            for piece in self.body.pieces(data):
                self.crc = zlib.crc32(piece, self.crc)
                self.size += len(piece)
                yield piece
            if not self.body.eof:
                return
            data = self.body.unused_data
        self.trailer += data
        if len(self.trailer) >= 8:
            crc, size = int.from_bytes(self.trailer[:4], "little"), int.from_bytes(self.trailer[4:8], "little")
            self.unused_data, self.eof = self.trailer[8:], True
            if (crc, size) != (self.crc, self.size & 0xFFFFFFFF):
                self.damage = (f"its data has CRC-32 {self.crc:08x} and length {self.size & 0xFFFFFFFF}, "
                               f"its trailer says {crc:08x} and {size}")


def _decompressors() -> dict[str, Callable[[], Any]]:
    return {
        ".gz": _GzipMember,
        ".bz2": lambda: _MaxLength(bz2.BZ2Decompressor()),
        ".xz": lambda: _MaxLength(lzma.LZMADecompressor()),
        ".lzma": lambda: _MaxLength(lzma.LZMADecompressor()),
        ".zst": _ZstdSlices,
    }


# What a member is called in a format, for the quarantine's details.
_MEMBER_NAMES = {".gz": "gzip member", ".zst": "zstd frame", ".bz2": "bz2 stream", ".xz": "xz stream",
                 ".lzma": "lzma stream"}


def _decompressed(
    raw: Any, make: Callable[[], Any], on_end: Callable[[str | None, bool], None] | None = None
) -> Iterator[bytes]:
    """Decompressed blocks of a stream of one or more members/frames, a small compressed step at a
    time, so that when the stream turns out damaged every block before the damage has been handed
    over (gzip.GzipFile.read drops what it decoded in the failing call), and in bounded pieces, so a
    bomb-like step does not land in memory whole. A stream cut inside a member raises EOFError:
    zstandard's own stream reader would end silently there.

    Each member that ends is reported to `on_end(damage, cut)`: why it failed its check (None: intact),
    and whether part of its data never came out. A gzip member that fails its CRC-32 or length ends at
    its trailer (all of it came out); a zstd frame that fails ends where its block headers say (what
    zstandard decoded in the failing call, and after, never comes out): reading goes on with the next
    member. Damage whose end cannot be told (a corrupt deflate, bz2 or xz stream, a zstd frame with
    damaged block headers) raises.

    After a member that fails its check, the text starts a fresh line: a '\n' is handed over (before
    `on_end`, so it counts as the failed member's) when its text, or the text before it when it was cut
    with nothing out, does not end in one. Its last line is cut off or garbled, and without the break the
    next member's first line, intact, would be glued to it and lost with it. (Where members were cut
    mid-line, the next member's first line is the tail of a damaged line: read on its own, it fails as
    a line of its own would.)"""
    member = None
    start = offset = 0  # compressed offsets: the current member's first byte; the end of what was read
    newline_last = True  # whether the text so far ends a line
    decoded = False  # whether the current member's text is not empty
    while chunk := raw.read(_STEP):
        offset += len(chunk)
        while chunk:
            if member is None or member.eof:
                member, start, decoded = make(), offset - len(chunk), False
            try:
                for piece in member.pieces(chunk):
                    newline_last, decoded = piece.endswith(b"\n"), True
                    yield piece
            except Exception as exc:
                end = (member.frame_end(raw, start)
                       if isinstance(member, _ZstdSlices) and _is_decompression_error(exc) else None)
                if end is None:
                    raise
                raw.seek(end)  # the frame's output so far was handed over: `on_end` lets a caller drop it
                offset, member = end, None
                if not newline_last:  # the line it broke off in ends with it: the next frame starts a fresh one
                    newline_last = True
                    yield b"\n"
                if on_end is not None:
                    on_end(f"{type(exc).__name__}: {exc}", True)
                break
            chunk = member.unused_data if member.eof else b""
            if member.eof and member.damage is not None and decoded and not newline_last:
                newline_last = True  # (an empty member that fails holds no line: it breaks none)
                yield b"\n"
            if member.eof and on_end is not None:
                on_end(member.damage, False)
    if member is not None and not member.eof:
        raise EOFError("the file ends inside a compressed stream (truncated)")


@dataclass(frozen=True)
class _BadMember:
    """A compressed member that failed its check: the lines holding its decoded bytes, and whether part of
    it never came out (`cut`: one more quarantined record stands for that part, whose lines are unknown)."""

    first: int
    last: int  # first - 1 when none of its bytes came out
    why: str
    cut: bool


def _unusable_lines(path: str, make: Callable[[], Any], name: str) -> list[_BadMember]:
    """The first pass over a compressed JSONL file: decompress it all, keeping nothing but a count of
    newlines, and return the members (`name`s) that fail their check, in order, so that the second
    pass quarantines their lines instead of parsing them.

    Why a first pass: a member's check (gzip's CRC-32 at its end, a zstd frame's checksum) comes after
    all of its data, and one member is commonly the whole file (`gzip file.jsonl`: 10 GB in one member),
    so neither holding a member's lines until its check nor spooling it to disk is bounded. Counting
    newlines keeps memory at one decompressed piece; the cost is decompressing the file twice (and, for
    a remote file, reading it twice). A line any of whose bytes came from a failed member counts as
    that member's, and so does the line a cut member's lost part would have gone on with (`_decompressed`
    ends it). A file cut short keeps the lines that fully decoded: it has no check to fail."""
    bad: list[_BadMember] = []
    lines = 0  # newlines decoded so far
    first = 1  # the line holding the current member's first byte
    size = 0  # bytes decoded from the current member
    newline_last = True  # whether the last byte decoded was a newline

    def ended(damage: str | None, cut: bool) -> None:
        nonlocal first, size
        if damage is not None and (size or cut):  # (an empty member that fails holds no record)
            last = first - 1 if not size else lines if newline_last else lines + 1
            where = (f"holding lines {first}-{last}" if not cut else
                     f"from line {first} (only lines {first}-{last} came out of it)" if last >= first else
                     f"after line {first - 1} (nothing came out of it)")
            bad.append(_BadMember(first, last, f"the {name} {where} fails its check ({damage})", cut))
        first, size = lines + 1, 0

    with fsspec.open(path, "rb") as raw:
        try:
            for piece in _decompressed(raw, make, ended):
                lines += piece.count(b"\n")
                size += len(piece)
                newline_last = piece.endswith(b"\n")
        except Exception as exc:
            if not _is_decompression_error(exc):
                raise
            if not isinstance(exc, EOFError) and lines >= first:  # the complete lines of the member it stopped in
                bad.append(_BadMember(first, lines, f"the {name} holding lines {first}-{lines} cannot be decompressed "
                                                    f"past line {lines} ({type(exc).__name__}: {exc})", False))
    return bad


def _raw_chunks(f: Any) -> Iterator[bytes]:
    while chunk := f.read(_BLOCK):
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
                long_head = _first_bytes([*pending, chunk[start : start + _RAW_BYTES]], _RAW_BYTES)
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
    make = _decompressors().get(posixpath.splitext(path.lower())[1])
    with fsspec.open(path, "rb") as raw:
        yield _iter_lines(_raw_chunks(raw) if make is None else _decompressed(raw, make), limit)


# JSON escaping grows a text at most 6x ("\u0001" for one byte), so a line longer than this many times
# `max_bytes_per_doc` cannot hold a text within the limit (unless its other fields are huge): it is
# quarantined as too_long without being held or parsed.
_LINE_FACTOR = 6


def _is_decompression_error(exc: BaseException) -> bool:
    """A corrupt or truncated compressed stream (not an I/O failure, which carries an errno)."""
    import zstandard

    if isinstance(exc, (EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError, _BadStream)):
        return True
    return isinstance(exc, OSError) and exc.errno is None  # gzip.BadGzipFile, bz2 "Invalid data stream"


def _jsonl_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[_Item]:
    path, lineno = unit.path, 0
    extension = posixpath.splitext(path.lower())[1]
    compressed = extension in _MEMBER_NAMES
    damaged: list[_BadMember] = []  # members that fail their check, in order
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
            damaged = _unusable_lines(path, _decompressors()[extension], _MEMBER_NAMES[extension])
        line_limit = _LINE_FACTOR * read.max_bytes_per_doc
        with _line_stream(path, line_limit) as lines:
            for lineno, line in enumerate(lines, start=1):
                yield from passed(lineno)
                if k < len(damaged) and damaged[k].first <= lineno:  # a line of a member that failed its check
                    raw = line.head if isinstance(line, _LongLine) else line
                    if raw.strip():  # blank lines are no records, here as anywhere
                        detail = (f"{damaged[k].why}: none of its lines is used, since the damage may have "
                                  "garbled any of them")
                        yield Quarantined(path, lineno, None, "corrupt_input", detail, _raw_bytes(raw))
                    continue
                if isinstance(line, _LongLine):
                    detail = (f"line is longer than {line_limit} bytes ({_LINE_FACTOR} x max_bytes_per_doc="
                              f"{read.max_bytes_per_doc}), so its text is too; skipped unread")
                    yield Quarantined(path, lineno, None, "too_long", detail, _raw_bytes(line.head))
                    continue
                line = line.rstrip(b"\r")
                if lineno == 1 and line.startswith(_BOM):  # orjson refuses a BOM; editors write one
                    line = line[len(_BOM) :]
                if not line.strip():
                    continue  # blank: skipped, but it keeps its line position

                def bad(reason: str, detail: str, line: bytes = line, lineno: int = lineno) -> Quarantined:
                    return Quarantined(path, lineno, None, reason, detail, _raw_bytes(line))

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
                problem = _text_problem(text, inp.text_field, read.max_bytes_per_doc)
                if problem:
                    yield bad(*problem)
                    continue
                doc_id = _id_of(rec.get(inp.id_field) if inp.id_field else None, f"{path}:{lineno}")
                domain = _domain_of(rec.get(inp.domain_field) if inp.domain_field else None, inp.domain)
                yield (lineno - 1, doc_id, domain, text)
        yield from passed(sys.maxsize)
    except Exception as exc:
        if not (compressed and _is_decompression_error(exc)):
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


def _columns_of(inp: InputConfig, names: Iterable[str]) -> list[str]:
    present = set(names)
    wanted = [inp.text_field, inp.id_field, inp.domain_field]
    return list(dict.fromkeys(c for c in wanted if c and c in present))


def _column_items(
    batches: Iterable[pa.RecordBatch | pa.Table], path: str, first_row: int, first_pos: int,
    inp: InputConfig, read: ReadConfig,
) -> Iterator[_Item]:
    """Documents from Arrow batches whose first row is row `first_row` of `path`."""
    row, pos = first_row, first_pos
    for big in batches:
        for start in range(0, big.num_rows, read.batch_size):
            b = big.slice(start, read.batch_size)  # bound the Python lists made below
            cols = {name: b.column(name).to_pylist() for name in b.schema.names}
            texts = cols[inp.text_field]
            ids = cols.get(inp.id_field) if inp.id_field else None
            doms = cols.get(inp.domain_field) if inp.domain_field else None
            for k, text in enumerate(texts):
                problem = _text_problem(text, inp.text_field, read.max_bytes_per_doc)
                if problem:
                    yield Quarantined(path, None, row + k, *problem, raw=_raw_row({n: c[k] for n, c in cols.items()}))
                    continue
                doc_id = _id_of(ids[k] if ids is not None else None, f"{path}:{row + k}")
                domain = _domain_of(doms[k] if doms is not None else None, inp.domain)
                yield (pos + k, doc_id, domain, text)
            row += b.num_rows
            pos += b.num_rows


def _raw_row(record: dict[str, Any]) -> str:
    short = {k: v[:RAW_CHARS] if isinstance(v, (str, bytes)) else v for k, v in record.items()}
    return orjson.dumps(short, default=str, option=orjson.OPT_NON_STR_KEYS).decode()[:RAW_CHARS]


def _parquet_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[_Item]:
    with fsspec.open(unit.path, "rb") as f:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow
        _check_text_column(schema, inp, repr(unit.path))
        batches = pf.iter_batches(batch_size=read.batch_size, columns=_columns_of(inp, schema.names))
        yield from _column_items(batches, unit.path, 0, 0, inp, read)


def _open_ipc(f: Any) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Schema and batches of an Arrow IPC file (random access) or, failing the magic, a stream."""
    magic = f.read(6)
    f.seek(0)
    if magic == b"ARROW1":
        reader = pa.ipc.open_file(f)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    stream = pa.ipc.open_stream(f)
    return stream.schema, iter(stream)


def _arrow_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[_Item]:
    with fsspec.open(unit.path, "rb") as f:
        schema, batches = _open_ipc(f)
        _check_text_column(schema, inp, repr(unit.path))
        cols = _columns_of(inp, schema.names)
        yield from _column_items((b.select(cols) for b in batches), unit.path, 0, 0, inp, read)


def _hf_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[_Item]:
    where = repr(unit.path)
    # datasets caches the prepared dataset, so reloading here (per unit) is cheap.
    ds = _load_hf(unit.path, inp, where) if unit.format == "hf" else _load_disk(unit.path, inp.split, where)
    _check_text_column(ds.data.schema, inp, where)
    ds = ds.select_columns(_columns_of(inp, ds.column_names)).with_format("arrow")
    stop = len(ds) if unit.stop is None else min(unit.stop, len(ds))
    slices = (ds[a : min(a + read.batch_size, stop)] for a in range(unit.start, stop, read.batch_size))
    yield from _column_items(slices, unit.path, unit.start, 0, inp, read)


def _text_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[_Item]:
    base = unit.path.rstrip("/") + "/"
    limit = read.max_bytes_per_doc
    for k, path in enumerate(unit.files):
        row = unit.start + k
        with fsspec.open(path, "rb") as f:
            data = f.read(limit + 1)  # one byte more than allowed tells too_long without reading it all
        if len(data) > limit:
            detail = f"file is longer than max_bytes_per_doc={limit} bytes"
            yield Quarantined(path, None, row, "too_long", detail, _raw_bytes(data))
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield Quarantined(path, None, row, "invalid_utf8", str(exc), _raw_bytes(data))
            continue
        if not text or text.isspace():
            yield Quarantined(path, None, row, "empty_text", "file is empty or whitespace only", _raw_bytes(data))
            continue
        doc_id = path[len(base) :] if path.startswith(base) else path
        yield (k, doc_id, inp.domain, text)


__all__ = ["InputError", "InputUnit", "Quarantined", "QUARANTINE_REASONS", "plan_units", "read_unit"]
