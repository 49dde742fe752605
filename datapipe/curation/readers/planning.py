"""Planning and fingerprints: the configured inputs expanded into `InputUnit`s, and what the files they read
are now. `plan_units` expands paths, globs, fsspec URLs, folders and datasets, with every check that can
run before any work; `input_fingerprints` gives each file the units read a fingerprint, so a resume notices
an edited input; `estimated_text_bytes` estimates the text they hold from their sizes."""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any

import fsspec
import orjson
import pyarrow.parquet as pq

from datapipe.curation.config import InputConfig
from datapipe.curation.readers.columnar import check_text_column, load_disk, load_hf, open_ipc
from datapipe.curation.readers.common import InputError, InputUnit
from datapipe.curation.readers.compressed import is_decompression_error
from datapipe.curation.readers.jsonl import BOM

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
_HEAD = 1 << 16  # bytes of a JSONL file read at plan time to tell a JSON array


def plan_units(inputs: list[InputConfig], name: str = "input") -> list[InputUnit]:
    """Expand paths/globs/URLs (via fsspec, sorted, deterministic) into units, in input order.

    Raises InputError before any work, naming the input (`input i ('path')`, or `name` for another kind of input
    such as selection's target documents) and what is wrong.
    """
    units: list[InputUnit] = []
    for i, inp in enumerate(inputs):
        where = f"input {i} ({inp.path!r})" if name == "input" else f"{name} ({inp.path!r})"
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
    run started (the run record keeps them; `identity.check_output` compares)."""
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
        ds = load_hf(inp.path, inp, where)
        check_text_column(ds.data.schema, inp, where)
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
            ds = load_disk(inp.path, inp.split, where)
            check_text_column(ds.data.schema, inp, where)
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
                    if not is_decompression_error(exc):
                        raise
            if _is_json_array(head):
                raise InputError(
                    f"{name}: holds a JSON array, but datapipe reads JSON Lines (one JSON object per "
                    "line), so every line would be quarantined as malformed_json. Use JSON Lines: "
                    "convert it, e.g. with `jq -c '.[]' FILE > FILE.jsonl`"
                )
            return
        with fsspec.open(path, "rb") as f:
            schema = pq.read_schema(f) if fmt == "parquet" else open_ipc(f)[0]
    except InputError:
        raise
    except Exception as exc:  # any decoder/IO failure means the same thing here: unreadable
        raise InputError(f"{name}: cannot be read as {fmt}: {type(exc).__name__}: {exc}") from exc
    check_text_column(schema, inp, name)


def _is_json_array(head: bytes) -> bool:
    """Whether a file starting with `head` holds one JSON array (rather than JSON Lines): it starts
    with '[' and its first line is not a whole JSON value, or is a list of objects (records)."""
    text = head.lstrip(BOM).lstrip()
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
