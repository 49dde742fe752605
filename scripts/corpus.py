"""The shared corpus (../shared/data/corpus.jsonl.gz) as documents, for the benchmark scripts."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson

DEFAULT = "../shared/data/corpus.jsonl.gz"


def load_docs(corpus: str | Path = DEFAULT, limit: int | None = None) -> list[dict]:
    """The first `limit` documents (all by default) as {id, domain (the source), text}."""
    docs = []
    with gzip.open(corpus, "rb") as f:
        for line in f:
            rec = orjson.loads(line)
            docs.append({"id": rec["id"], "domain": rec["source"], "text": rec["text"]})
            if limit and len(docs) >= limit:
                break
    return docs
