"""The one fake-shard writer: curated-format shards and a manifest from plain token lists, for tests and benchmarks.

    write_fake_shards(out, [[{"id": "d0", "domain": "web", "tokens": [5, 6, 0]}, ...], ...], vocab_size=64)

Each inner list is one shard; each document is a dict with `id`, `domain` and `tokens`, plus any extra columns
(`lang`, a numeric `score`, ...) that every document of the run carries. `num_tokens` is computed. The files are
written by `datapipe.core.shards`, the module that owns the format, so they are what a curation run would write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from datapipe.core import shards

_DTYPES = {"uint16": pa.uint16(), "uint32": pa.uint32()}


def write_fake_shards(out: str | Path, shard_docs: Sequence[Sequence[Mapping[str, Any]]], *, vocab_size: int,
                      dtype: str = "uint32", eos_id: int = 0, extra_manifest: Mapping[str, Any] | None = None) -> dict:
    """Write the shards and manifest.json to `out`; returns the manifest."""
    infos = []
    for index, docs in enumerate(shard_docs):
        extra = [k for k in (docs[0] if docs else {}) if k not in ("id", "domain", "tokens")]
        columns = {
            "id": pa.array([str(d["id"]) for d in docs], pa.string()),
            "domain": pa.array([d["domain"] for d in docs], pa.string()),
            "tokens": pa.array([list(d["tokens"]) for d in docs], pa.list_(_DTYPES[dtype])),
            "num_tokens": pa.array([len(d["tokens"]) for d in docs], pa.int64()),
        }
        for key in extra:
            values = pa.array([d[key] for d in docs])
            columns[key] = values.cast(pa.string()) if pa.types.is_null(values.type) else values  # all-missing `lang`
        infos.append(shards.write_shard(out, index, pa.table(columns)))
    tokenizer = {"eos_id": eos_id, "bos_id": None, "dtype": dtype, "vocab_size": vocab_size, "path": None, "sha256": None}
    manifest = shards.build_manifest(infos, tokenizer=tokenizer, config={}, config_hash="test")
    manifest.update(extra_manifest or {})
    shards.write_manifest(out, manifest)
    return manifest
