"""Reading one unit: `read_unit` turns a unit's records into `DOC_SCHEMA` record batches. It streams the
records in the unit's format's reader and gathers them into batches of at most `read.batch_size`
documents, each with the records quarantined while reading it, every document ordered by
`order_key(unit_index, position)`."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA, order_key
from datapipe.curation.config import InputConfig, ReadConfig
from datapipe.curation.readers.columnar import arrow_items, hf_items, parquet_items
from datapipe.curation.readers.common import InputError, InputUnit, Quarantined
from datapipe.curation.readers.jsonl import jsonl_items
from datapipe.curation.readers.text import text_items

def read_unit(
    unit: InputUnit, unit_index: int, inp: InputConfig, read: ReadConfig
) -> Iterator[tuple[pa.RecordBatch, list[Quarantined]]]:
    """Yield (documents as a DOC_SCHEMA RecordBatch of at most read.batch_size rows, the quarantined
    records met while reading that batch).

    The i-th record of the unit (quarantined ones and blank lines counted too) gets
    order = order_key(unit_index, i).
    """
    readers = {"jsonl": jsonl_items, "parquet": parquet_items, "arrow": arrow_items, "text": text_items}
    if unit.format in readers:
        items = readers[unit.format](unit, inp, read)
    elif unit.format in ("hf", "hf_disk"):
        items = hf_items(unit, inp, read)
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
