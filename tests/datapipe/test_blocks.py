"""A block's documents after a segment: the read block's rows a view names, and a pick of them (`where`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA
from datapipe.curation.blocks import READ, block_documents, write_read_block, write_view

TEXTS = ["", "a b c", "é日本語 ünïcode", "line one\nline two\n", "x" * 5000, "last"]


def _read_block(work) -> pa.Table:
    n = len(TEXTS)
    table = pa.table({"id": [f"doc-{i}" for i in range(n)], "domain": ["d"] * n, "text": pa.array(TEXTS, pa.large_string()),
                      "order": pa.array(range(10, 10 + n), pa.int64()), "lang": ["en"] * n,
                      "lang_score": pa.array([0.5] * n, pa.float32())}, schema=DOC_SCHEMA)
    write_read_block(work, "b0", table, "zstd")
    return table


def test_a_view_gives_the_read_blocks_rows_it_names_with_its_own_ids(tmp_path):
    _read_block(tmp_path)
    view = pa.table({"order": pa.array([11, 13, 14], pa.int64()), "id": ["r1", "r3", "r4"], "lang": ["en"] * 3,
                     "lang_score": pa.array([0.5] * 3, pa.float32())})
    write_view(tmp_path, "seg", "b0", view)
    got = block_documents(tmp_path, "seg", "b0", ["id", "text", "order"])
    assert got.column("id").to_pylist() == ["r1", "r3", "r4"]
    assert got.column("text").to_pylist() == [TEXTS[1], TEXTS[3], TEXTS[4]]
    assert got.column("order").to_pylist() == [11, 13, 14]


def test_where_picks_rows_from_the_columns_without_text_in_either_kind_of_segment(tmp_path):
    _read_block(tmp_path)
    view = pa.table({"order": pa.array([10, 12, 13, 15], pa.int64()), "id": ["k0", "k2", "k3", "k5"], "lang": ["en"] * 4,
                     "lang_score": pa.array([0.5] * 4, pa.float32())})
    write_view(tmp_path, "seg", "b0", view)
    seen: list[list[str]] = []

    def odd_ids(columns: pa.Table) -> np.ndarray:
        assert "text" not in columns.column_names
        seen.append(columns.column("id").to_pylist())
        return np.flatnonzero([int(i[-1]) % 2 == 1 for i in columns.column("id").to_pylist()])

    got = block_documents(tmp_path, "seg", "b0", ["id", "text"], where=odd_ids, locate=True)
    assert got.column("id").to_pylist() == ["k3", "k5"]
    assert got.column("text").to_pylist() == [TEXTS[3], TEXTS[5]]
    whole = block_documents(tmp_path, READ, "b0", ["text"], locate=True)
    assert got.column("text_at").to_pylist() == whole.column("text_at").take([3, 5]).to_pylist()
    assert seen == [["k0", "k2", "k3", "k5"]]

    read = block_documents(tmp_path, READ, "b0", ["order", "text"], where=odd_ids)
    assert read.column("order").to_pylist() == [11, 13, 15]
    assert read.column("text").to_pylist() == [TEXTS[1], TEXTS[3], TEXTS[5]]
    none = block_documents(tmp_path, READ, "b0", ["text"], where=lambda columns: np.array([], np.int64))
    assert none.num_rows == 0 and none.schema.field("text").type == pa.large_string()
