"""The shard format: the one module that writes and reads shard files and the manifest.

A curated output folder holds:
- `shards/shard-00000.arrow` …: Arrow IPC files (file format, readable by pyarrow, polars and
  `datasets.load_dataset("arrow", ...)`) with columns `id` (string), `domain` (string), `tokens`
  (list of uint16, or uint32 when the vocabulary needs it), `num_tokens` (int64) and `lang`
  (string, null unless a language-id stage ran). Each row is one whole document, its
  end-of-document id included; document boundaries are the rows.
- `manifest.json`: format version, every shard (path, rows, tokens, bytes, sha256, per-domain
  counts), the tokenizer (path, sha256, vocab size, EOS id, dtype), the config snapshot and its
  hash, and per-domain totals.

Every file is written under a temporary name in the same folder and renamed when complete, so a
reader never sees half a file and a killed run leaves nothing it could mistake for finished work.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_DIR = "shards"


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


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


# Every write goes to a temporary name and is renamed when complete: a killed process never leaves
# a half-written file under the real name. `durable=True` also fsyncs before the rename, so the file
# survives a power loss too; that costs milliseconds per file, so only final outputs (shards,
# manifest, stats) ask for it, not the many small intermediate files under work/.


def atomic_write_bytes(path: str | Path, data: bytes, *, durable: bool = False) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | Path, obj: Any, *, durable: bool = False) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode() + b"\n", durable=durable)


def atomic_write_table(path: str | Path, table: pa.Table, *, format: str = "arrow", durable: bool = False) -> None:
    """Write an Arrow IPC file (or Parquet) atomically. Output is byte-for-byte deterministic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    if format == "arrow":
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    elif format == "parquet":
        pq.write_table(table, tmp)
    else:
        raise ValueError(f"format must be one of {{'arrow', 'parquet'}}, got {format!r}")
    if durable:
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_table(path: str | Path) -> pa.Table:
    """Read a local Arrow IPC file written by `atomic_write_table` (memory-mapped)."""
    with pa.memory_map(str(path), "r") as source:
        return pa.ipc.open_file(source).read_all()


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
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
    path = Path(out_dir) / rel
    atomic_write_table(path, table.combine_chunks(), durable=True)
    domains: dict[str, dict[str, int]] = {}
    if table.num_rows:
        grouped = table.group_by("domain").aggregate([("num_tokens", "sum"), ("num_tokens", "count")])
        for row in grouped.to_pylist():
            domains[row["domain"]] = {"docs": row["num_tokens_count"], "tokens": row["num_tokens_sum"]}
    return ShardInfo(
        path=rel,
        rows=table.num_rows,
        tokens=int(pc.sum(table.column("num_tokens")).as_py() or 0),
        bytes=path.stat().st_size,
        sha256=file_sha256(path),
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


def write_manifest(out_dir: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(Path(out_dir) / MANIFEST_NAME, manifest, durable=True)


def read_manifest(source: str | Path) -> dict[str, Any]:
    """The manifest of an output folder, local or any fsspec URL."""
    url = str(source).rstrip("/") + "/" + MANIFEST_NAME
    with fsspec.open(url, "rb") as f:
        manifest = json.load(f)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{url}: format_version must be {FORMAT_VERSION}, got {version!r}")
    return manifest


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
    actual = file_sha256(Path(source) / info["path"])
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

