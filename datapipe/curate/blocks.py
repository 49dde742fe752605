"""A block's documents after a segment: the text is written once, by the read task; segments write views.

The read task writes each block's documents, text included, to `work/read/<block>.arrow` (after the
stages that rewrite text: normalize). Every segment after it writes only what it decided and changed,
`work/<segment>/<block>.arrow` with one row per document it kept: `order` (which row of the read block),
`id` (renamed by `unique_ids` in the first segment), `lang` and `lang_score` (set by language id). The
documents of a block after a segment are the read block's rows at those orders with those columns
(`block_documents`), so the text is never copied from phase to phase: a segment costs ~6-30 bytes a
document instead of the document (datatrove's filter step likewise re-reads its input against a removal list).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA
from datapipe.core.workfiles import read_work_table, write_work_table
from datapipe.core.storage import Location

READ = "read"  # the folder of the read blocks: the one copy of the text
VIEW_SCHEMA = pa.schema([DOC_SCHEMA.field(name) for name in ("order", "id", "lang", "lang_score")])


def write_view(work: Location, segment: str, block: str, documents: pa.Table) -> None:
    """Write a segment's output for a block: the kept documents' view columns (not their text)."""
    # zstd: orders run in sequence and ids share prefixes, ~26 bytes a document become ~6
    write_work_table(work / segment / f"{block}.arrow", documents.select(VIEW_SCHEMA.names).cast(VIEW_SCHEMA),
                       compression="zstd")


def block_documents(work: Location, segment: str, block: str, columns: list[str] | None = None) -> pa.Table:
    """The documents (`DOC_SCHEMA`, or just `columns`) of `block` as `segment` left them: the read block
    for `read`, else the read block's rows that the segment's view names, with the view's columns. A
    file that holds the text itself (an `eval.source` block) is returned as it is."""
    path = work / segment / f"{block}.arrow"
    table = read_work_table(path)
    if "text" in table.column_names:
        return table.select(columns) if columns else table
    if columns is not None and set(columns) <= set(VIEW_SCHEMA.names):  # no text needed: the view alone
        return table.select(columns)
    base = read_work_table(work / READ / f"{block}.arrow")
    base_orders = base.column("order").to_numpy()
    orders = table.column("order").to_numpy()
    rows = np.searchsorted(base_orders, orders)
    if len(orders) and (rows.max() >= len(base_orders) or (base_orders[rows] != orders).any()):  # a bug, never bad input
        raise RuntimeError(f"the view {path} names documents that the read block of {block} does not hold")
    taken = base.take(pa.array(rows, pa.int64()))
    out = pa.table({name: table.column(name) if name in VIEW_SCHEMA.names else taken.column(name) for name in DOC_SCHEMA.names},
                   schema=DOC_SCHEMA)
    return out.select(columns) if columns else out
