"""The shard format: the one module that writes and reads shard files and the manifest.

A curated output folder holds:
- `shards/shard-00000.arrow` …: Arrow IPC files (file format, readable by pyarrow, polars and
  `datasets.load_dataset("arrow", ...)`) with columns `id` (string), `domain` (string), `tokens`
  (list of uint16, or uint32 when the vocabulary needs it), `num_tokens` (int64) and `lang`
  (string, null unless a language-id stage ran). Each row is one whole document, its
  end-of-document id included; document boundaries are the rows.
- `manifest.json`: format version, every shard (path, rows, tokens, bytes, sha256, per-domain
  counts), the tokenizer (path, sha256, vocab size, EOS id, dtype), the config snapshot and its
  hash, and per-domain totals. Optional `splits`: {name: {path, num_shards, total_docs,
  total_tokens, domains}} names held-out splits (`eval`), each a curated folder of its own at
  `path` (relative to this folder) whose manifest says `"split": {"name", "of"}`. Readers that do
  not know `splits` see the training shards only, as before.

Every file is written under a temporary name in the same folder and renamed when complete, so a
reader never sees half a file and a killed run leaves nothing it could mistake for finished work.
The folder may be local or any writable fsspec URL (`datapipe.core.storage`): there the temporary is
an object next to the final key, moved to it when complete, and the manifest is written last.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import os
import re
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from datapipe.core.config import ConfigError
from datapipe.core.storage import RemotePath, location

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_DIR = "shards"
CLUSTERS_DIR = "near_duplicates/clusters"  # near dedup's clusters, a parquet part per order range


def shard_schema(token_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            pa.field("id", pa.string()),
            pa.field("domain", pa.string()),
            pa.field("tokens", pa.list_(token_type)),
            pa.field("num_tokens", pa.int64()),
            pa.field("lang", pa.string()),  # null when no language-id stage ran
        ]
    )


TEMP_MARK = ".tmp-"  # a temporary file is named `.{name}.tmp-{pid}-{8 hex}`, next to its final name
_TEMP_NAME = re.compile(r"^\..+\.tmp-\d+-[0-9a-f]{8}$")


def temporary_name(path: Path | RemotePath) -> Path | RemotePath:
    """A fresh temporary name next to `path`, one that `remove_temporaries` clears when its writer was
    killed; for a writer with renames of its own (a checkpoint save), others use `replacing`."""
    return path.parent / f".{path.name}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"


class OutputError(ConfigError):
    """An output file that cannot be written (disk full, read-only or forbidden folder): a problem
    of the machine, not a bug, so the message names the path and what to do instead of a traceback."""


# errno -> (what happened, what to do)
_WRITE_ADVICE = {
    errno.ENOSPC: ("no space left on the device", "free space there (or choose another output folder)"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space there (or choose another output folder)"),
    errno.EROFS: ("the file system is read-only", "choose a writable output folder"),
    errno.EACCES: ("permission denied", "choose a folder you may write to, or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose a folder you may write to, or fix its permissions"),
}


def _output_error(path: Path | RemotePath, exc: OSError) -> OutputError:
    code = exc.errno
    if code is None:  # pyarrow raises OSError("... [Errno 28] ...") without setting errno
        found = re.search(r"\[Errno (\d+)\]", str(exc))
        code = int(found.group(1)) if found else None
    what, fix = _WRITE_ADVICE.get(code, (exc.strerror or str(exc), "check the output folder"))
    return OutputError(
        f"cannot write {path}: {what} ({type(exc).__name__}: {exc}). To go on, {fix}, then run the same "
        "command again: the work already finished is kept, the run resumes where it stopped and its "
        "output is the same as an uninterrupted run's."
    )


@contextlib.contextmanager
def replacing(path: str | Path | RemotePath, durable: bool) -> Iterator[Path | RemotePath]:
    """Yield a temporary name next to `path` to write (open it with its `.open`); on success (fsync it
    when `durable` and) rename it to `path` (remote: move the temporary object to the final key). On any
    failure the temporary file is removed; an OSError becomes an OutputError naming `path`."""
    path = location(path)
    make_folder(path.parent)
    tmp = temporary_name(path)
    try:
        yield tmp
        if isinstance(tmp, RemotePath):
            tmp.move_to(path)
        else:
            if durable:
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError):
            raise _output_error(path, exc) from exc
        raise


# Every write goes to a temporary name and is renamed when complete: a killed process never leaves
# a half-written file under the real name (a temporary left by a kill is removed by
# `remove_temporaries` when the run starts again). `durable=True` also fsyncs before the rename,
# so the file survives a power loss too; that costs milliseconds per file, so only final outputs
# (shards, manifest, stats) ask for it, not the many small intermediate files under work/.


# The outputs the running task has published (files outside the work folder: shards, dropped documents, scores,
# clusters), each {path, bytes, sha256}: its record keeps them and a resumed run checks them (`noting_outputs`).
_TASK_OUTPUTS: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar("task_outputs", default=None)


@contextlib.contextmanager
def noting_outputs() -> Iterator[list[dict[str, Any]]]:
    """While the block runs, every output published (`published=True` writes, `write_shard`, `note_published`) is
    listed in what it yields, with its size and sha256 (from the bytes written: no read back from an object store)."""
    outputs: list[dict[str, Any]] = []
    token = _TASK_OUTPUTS.set(outputs)
    try:
        yield outputs
    finally:
        _TASK_OUTPUTS.reset(token)


def note_published(path: str | Path | RemotePath, size: int, sha256: str) -> None:
    """That the running task (if any notes its outputs) wrote the output `path` of `size` bytes and that digest."""
    outputs = _TASK_OUTPUTS.get()
    if outputs is not None:
        outputs.append({"path": str(path), "bytes": int(size), "sha256": sha256})


def atomic_write_bytes(path: str | Path | RemotePath, data: bytes, *, durable: bool = False, published: bool = False) -> None:
    """Write `data` to `path` atomically; `published`: an output of the run, noted for its task's record."""
    path = location(path)
    if isinstance(path, RemotePath) and path.is_object_store:
        # One PUT: an object store makes an object visible only once its upload is complete, so a
        # temporary key and a move (copy + delete: ~6 requests and two copies) buy nothing.
        try:
            path.fs.pipe_file(path.path, data)
        except OSError as exc:
            raise _output_error(path, exc) from exc
    else:
        with replacing(path, durable) as tmp, open(tmp, "wb") as f:
            f.write(data)
    if published:
        note_published(path, len(data), hashlib.sha256(data).hexdigest())


def atomic_write_json(path: str | Path | RemotePath, obj: Any, *, durable: bool = False) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n", durable=durable)


def atomic_write_table(path: str | Path | RemotePath, table: pa.Table, *, format: str = "arrow", durable: bool = False,
                       compression: str | None = None, published: bool = False) -> None:
    """Write an Arrow IPC file (or Parquet) atomically. Output is byte-for-byte deterministic.
    `compression` ("zstd", "lz4"): IPC buffer compression, for work files read a few times (`read_table`
    then decompresses instead of memory-mapping). `published`: an output of the run, noted for its task's record."""
    if format not in ("arrow", "parquet"):
        raise ValueError(f"format must be one of {{'arrow', 'parquet'}}, got {format!r}")
    path = location(path)
    if isinstance(path, RemotePath):  # serialised here, then one upload
        atomic_write_bytes(path, table_bytes(table, format, compression), published=published)
        return
    options = pa.ipc.IpcWriteOptions(compression=compression)
    with replacing(path, durable) as tmp:
        if format == "arrow":
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema, options=options) as writer:
                writer.write_table(table)
        else:
            pq.write_table(table, tmp)
    if published:
        note_published(path, path.stat().st_size, file_sha256(path))


def table_bytes(table: pa.Table, format: str = "arrow", compression: str | None = None) -> bytes:
    """The bytes of `atomic_write_table`'s file for `table`."""
    sink = pa.BufferOutputStream()
    if format == "arrow":
        with pa.ipc.new_file(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
            writer.write_table(table)
    else:
        pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def make_folder(path: str | Path | RemotePath) -> None:
    """mkdir -p, with an OutputError naming the folder when the machine refuses (read-only, full).
    Nothing on an object store, which has no folders."""
    path = location(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _output_error(path, exc) from exc


def remove_temporaries(folder: str | Path | RemotePath, skip: tuple[str, ...] = ()) -> list[Path | RemotePath]:
    """Delete the temporary files (`.NAME.tmp-PID-XXXXXXXX`) that killed or failed writers left
    anywhere under `folder` but its subfolders named in `skip` (e.g. a work folder about to be deleted
    whole: not listed file by file); returns them. Call it only while no writer works in `folder`."""
    folder = location(folder)
    if isinstance(folder, RemotePath):
        tops = [f for f in folder.iterdir() if f.name not in skip]
        files = [g for f in tops for g in (f.walk_files() if f.is_dir() else [f])]
        found = [f for f in files if TEMP_MARK in f.name and _TEMP_NAME.match(f.name)]
        for f in found:
            f.unlink(missing_ok=True)
        return found
    removed = []
    for dirpath, dirs, files in os.walk(folder):
        if dirpath == str(folder):
            dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            if TEMP_MARK in name and _TEMP_NAME.match(name):
                path = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
    return sorted(removed)


def read_table(path: str | Path | RemotePath) -> pa.Table:
    """Read an Arrow IPC file written by `atomic_write_table` (memory-mapped when local)."""
    path = location(path)
    if isinstance(path, RemotePath):
        return pa.ipc.open_file(pa.py_buffer(path.read_bytes())).read_all()
    with pa.memory_map(str(path), "r") as source:
        return pa.ipc.open_file(source).read_all()


def file_sha256(path: str | Path | RemotePath) -> str:
    h = hashlib.sha256()
    with location(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class ShardInfo:
    path: str  # relative to the output folder
    rows: int
    tokens: int
    bytes: int
    sha256: str
    domains: dict[str, dict[str, int]] = field(default_factory=dict)  # domain -> {docs, tokens}


def write_shard(out_dir: str | Path, index: int, table: pa.Table) -> ShardInfo:
    """Write shard number `index` and describe it for the manifest."""
    rel = f"{SHARD_DIR}/shard-{index:05d}.arrow"
    path = location(out_dir) / rel
    if isinstance(path, RemotePath):  # checksum and size from the bytes uploaded, not a download
        data = table_bytes(table.combine_chunks())
        atomic_write_bytes(path, data)
        size, sha256 = len(data), hashlib.sha256(data).hexdigest()
    else:
        atomic_write_table(path, table.combine_chunks(), durable=True)
        size, sha256 = path.stat().st_size, file_sha256(path)
    note_published(path, size, sha256)
    domains: dict[str, dict[str, int]] = {}
    if table.num_rows:
        grouped = table.group_by("domain").aggregate([("num_tokens", "sum"), ("num_tokens", "count")])
        for row in grouped.to_pylist():
            domains[row["domain"]] = {"docs": row["num_tokens_count"], "tokens": row["num_tokens_sum"]}
    return ShardInfo(
        path=rel,
        rows=table.num_rows,
        tokens=int(pc.sum(table.column("num_tokens")).as_py() or 0),
        bytes=size,
        sha256=sha256,
        domains=dict(sorted(domains.items())),
    )


def build_manifest(
    shards: list[ShardInfo], *, tokenizer: dict[str, Any], config: dict[str, Any], config_hash: str
) -> dict[str, Any]:
    totals: dict[str, dict[str, int]] = {}
    for s in shards:
        for domain, c in s.domains.items():
            t = totals.setdefault(domain, {"docs": 0, "tokens": 0})
            t["docs"] += c["docs"]
            t["tokens"] += c["tokens"]
    return {
        "format_version": FORMAT_VERSION,
        "shards": [asdict(s) for s in shards],
        "num_shards": len(shards),
        "total_docs": sum(s.rows for s in shards),
        "total_tokens": sum(s.tokens for s in shards),
        "domains": dict(sorted(totals.items())),
        "tokenizer": tokenizer,
        "config": config,
        "config_hash": config_hash,
    }


def write_manifest(out_dir: str | Path | RemotePath, manifest: dict[str, Any]) -> None:
    atomic_write_json(location(out_dir) / MANIFEST_NAME, manifest, durable=True)


def read_manifest(source: str | Path) -> dict[str, Any]:
    """The manifest of an output folder, local or any fsspec URL."""
    url = str(source).rstrip("/") + "/" + MANIFEST_NAME
    with fsspec.open(url, "rb") as f:
        manifest = json.load(f)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{url}: format_version must be {FORMAT_VERSION}, got {version!r}")
    return manifest


def split_source(source: str | Path, name: str = "eval", manifest: dict[str, Any] | None = None) -> str | None:
    """The folder (local path or URL) of the split `name` that `source`'s manifest names; None when it
    names none, or an empty one (curation warned about that)."""
    entry = (manifest if manifest is not None else read_manifest(source)).get("splits", {}).get(name)
    if not entry or not entry.get("total_docs"):
        return None
    return str(source).rstrip("/") + "/" + entry["path"]


def open_shard(source: str | Path, rel_path: str) -> pa.Table:
    """One shard of an output folder, local (memory-mapped) or any fsspec URL."""
    url = str(source).rstrip("/") + "/" + rel_path
    fs, path = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):
        return read_table(path)
    with fs.open(path, "rb") as f:
        return pa.ipc.open_file(pa.BufferReader(f.read())).read_all()


def verify_shard(source: str | Path, info: dict[str, Any]) -> None:
    """Raise if a shard's checksum differs from the manifest's."""
    actual = file_sha256(location(source) / info["path"])
    if actual != info["sha256"]:
        raise ValueError(f"{info['path']}: checksum {actual} differs from the manifest's {info['sha256']}")


def link_subset(source: str | Path, keep: list[int], folder: str | Path, *, note: dict[str, Any] | None = None) -> str:
    """A curated folder holding only shards `keep` of the local output folder `source`: a manifest
    (totals recomputed) and symbolic links to the shard files and the tokenizer. Used to hold shards
    out for evaluation without copying them. Returns the folder."""
    source, folder = Path(str(source).removeprefix("file://")).resolve(), Path(folder)
    manifest = read_manifest(source)
    part = [manifest["shards"][i] for i in keep]
    domains: dict[str, dict[str, int]] = {}
    for s in part:
        for d, c in s.get("domains", {}).items():
            acc = domains.setdefault(d, {"docs": 0, "tokens": 0})
            acc["docs"] += int(c.get("docs", 0))
            acc["tokens"] += int(c.get("tokens", 0))
    for rel in [s["path"] for s in part] + [manifest.get("tokenizer", {}).get("path") or ""]:
        if rel and (source / rel).exists():
            link = folder / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(source / rel)
    subset = {**manifest, "shards": part, "num_shards": len(part), "domains": dict(sorted(domains.items())),
              "total_docs": sum(int(s["rows"]) for s in part), "total_tokens": sum(int(s["tokens"]) for s in part),
              "derived_from": {"source": str(source), **(note or {})}}
    atomic_write_json(folder / MANIFEST_NAME, subset)
    return str(folder)

