"""Small helpers shared by the tests (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datapipe.curate.config import CurateConfig
from datapipe.core.config import from_dict

ASSETS = Path(__file__).parent / "assets"


def small_config(out_dir: Path | str, inputs: list[dict[str, Any]], **sections: Any) -> CurateConfig:
    """A fast config: tiny blocks (many tasks), a tiny tokenizer, tiny shards."""
    data: dict[str, Any] = {
        "inputs": inputs,
        "read": {"block_bytes": 8192, "batch_size": 16},
        "dedup": {"exact": {"partitions": 3}},
        "filters": {"code": {"code": {}}},
        "tokenizer": {"train": {"vocab_size": 400, "sample_bytes": 200_000}},
        "output": {"dir": str(out_dir), "shard_bytes": 8192},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return from_dict(CurateConfig, data)
