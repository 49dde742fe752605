"""The document schema shared by the reader, every stage and the shard writer.

A batch of documents is a `pyarrow.RecordBatch` with these columns:
- `id` (string): stable document id, given by the input or derived from file + line/row;
- `domain` (string): the mixture domain (from the input's config or the record's own field);
- `text` (string): the document text;
- `order` (int64): the document's place in the global input order (input unit << 40 | row).
  Deterministic winners ("first by input order") compare this key, whatever the worker count;
- `lang` (string, null until the language-id stage tags it) and `lang_score` (float32, its
  confidence), so that filters, mixtures and statistics can be keyed by (domain, language).

Dropped documents leave a stage as a batch with `DROPPED_SCHEMA`.
"""

from __future__ import annotations

import pyarrow as pa

ROW_BITS = 40  # rows per input unit < 2**40; unit index in the upper bits of `order`

DOC_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("text", pa.large_string(), nullable=False),
        pa.field("order", pa.int64(), nullable=False),
        pa.field("lang", pa.string()),
        pa.field("lang_score", pa.float32()),
    ]
)

DROPPED_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("domain", pa.string()),
        pa.field("order", pa.int64()),
        pa.field("stage", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("kept_id", pa.string()),  # for duplicates: the id of the document kept instead
        pa.field("text", pa.large_string()),  # null unless the run asks to keep dropped text
    ]
)


def order_key(unit_index: int, row: int) -> int:
    """The global order of row `row` of input unit `unit_index`."""
    return (unit_index << ROW_BITS) | row


def empty_dropped() -> pa.RecordBatch:
    return pa.RecordBatch.from_pylist([], schema=DROPPED_SCHEMA)


def example_documents(n: int, id_chars: int = 24, words: int = 120) -> pa.RecordBatch:
    """`n` distinct documents of `words` words, ids of `id_chars` characters: what a stage's rows are measured on
    where a size is estimated before any file is written (the cost model, an exchange's layout at scale)."""
    ids = [f"{i:0{id_chars}d}" for i in range(n)]
    texts = [" ".join(f"w{(i * 7919 + j * 104729) % 100003}" for j in range(words)) for i in range(n)]
    return pa.RecordBatch.from_pylist([{"id": d, "domain": "web", "text": t, "order": i}
                                       for i, (d, t) in enumerate(zip(ids, texts))], schema=DOC_SCHEMA)
