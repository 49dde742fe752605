"""Read blocks of given texts (`datapipe.curation.blocks`), for tests and benchmarks of the reads by range."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA
from datapipe.core.storage import Location
from datapipe.curation.blocks import READ, block_documents, write_read_block


def write_read_blocks(work: Location, texts_by_block: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """Read blocks `b0`, `b1`, ... in `work`, block i holding `texts_by_block[i]`, the documents' orders numbered
    across the blocks (block 0's first, then on); each document's frame (`text_at`, `text_bytes`) by order."""
    at, nbytes, order = [], [], 0
    for b, texts in enumerate(texts_by_block):
        n = len(texts)
        table = pa.table({"id": [f"d{order + i}" for i in range(n)], "domain": ["d"] * n,
                          "text": pa.array(texts, pa.large_string()), "order": pa.array(range(order, order + n), pa.int64()),
                          "lang": pa.nulls(n, pa.string()), "lang_score": pa.nulls(n, pa.float32())}, schema=DOC_SCHEMA)
        write_read_block(work, f"b{b}", table, "zstd")
        located = block_documents(work, READ, f"b{b}", ["order"], locate=True)
        at += located.column("text_at").to_pylist()
        nbytes += located.column("text_bytes").to_pylist()
        order += n
    return np.array(at, np.int64), np.array(nbytes, np.int64)
