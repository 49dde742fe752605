"""Columnar formats: Parquet, Arrow IPC and Hugging Face datasets, read in bounded batches. Parquet by row
batches, Arrow IPC files and streams one record batch at a time, Hugging Face datasets from the hub (`hf`)
or saved to disk (`hf_disk`, memory-mapped) by row ranges; also the checks planning runs on them (a string
text column, a dataset that loads)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import fsspec
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from datapipe.curation.config import InputConfig, ReadConfig
from datapipe.curation.readers.common import (
    RAW_CHARS,
    InputError,
    InputUnit,
    Item,
    Quarantined,
    domain_of,
    id_of,
    text_problem,
)

def check_text_column(schema: pa.Schema, inp: InputConfig, where: str) -> None:
    if inp.text_field not in schema.names:
        raise InputError(f"{where}: no column {inp.text_field!r} (text_field); columns: {schema.names}")
    tp = schema.field(inp.text_field).type
    if pa.types.is_dictionary(tp):
        tp = tp.value_type
    t = pa.types
    if not (t.is_string(tp) or t.is_large_string(tp) or t.is_string_view(tp) or t.is_null(tp)):
        raise InputError(f"{where}: column {inp.text_field!r} (text_field) must be a string column, got {tp}")


def load_hf(name: str, inp: InputConfig, where: str) -> Any:
    import datasets  # heavy; only hf inputs need it

    try:
        return datasets.load_dataset(name, data_files=list(inp.data_files) or None, split=inp.split)
    except Exception as exc:  # datasets raises many types (hub, builder, file errors)
        raise InputError(f"{where}: cannot load Hugging Face dataset: {type(exc).__name__}: {exc}") from exc


def load_disk(path: str, split: str, where: str) -> Any:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as exc:
        raise InputError(f"{where}: cannot load a saved dataset: {type(exc).__name__}: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise InputError(f"{where}: split must be one of {sorted(ds)}, got {split!r}")
        ds = ds[split]
    return ds


def _columns_of(inp: InputConfig, names: Iterable[str]) -> list[str]:
    present = set(names)
    wanted = [inp.text_field, inp.id_field, inp.domain_field]
    return list(dict.fromkeys(c for c in wanted if c and c in present))


def _column_items(
    batches: Iterable[pa.RecordBatch | pa.Table], path: str, first_row: int, first_pos: int,
    inp: InputConfig, read: ReadConfig,
) -> Iterator[Item]:
    """Documents from Arrow batches whose first row is row `first_row` of `path`."""
    row, pos = first_row, first_pos
    for big in batches:
        for start in range(0, big.num_rows, read.batch_size):
            b = big.slice(start, read.batch_size)  # bound the Python lists made below
            cols = {name: b.column(name).to_pylist() for name in b.schema.names}
            texts = cols[inp.text_field]
            ids = cols.get(inp.id_field) if inp.id_field else None
            doms = cols.get(inp.domain_field) if inp.domain_field else None
            for k, text in enumerate(texts):
                problem = text_problem(text, inp.text_field, read.max_bytes_per_doc)
                if problem:
                    yield Quarantined(path, None, row + k, *problem, raw=_raw_row({n: c[k] for n, c in cols.items()}))
                    continue
                doc_id = id_of(ids[k] if ids is not None else None, f"{path}:{row + k}")
                domain = domain_of(doms[k] if doms is not None else None, inp.domain)
                yield (pos + k, doc_id, domain, text)
            row += b.num_rows
            pos += b.num_rows


def _raw_row(record: dict[str, Any]) -> str:
    short = {k: v[:RAW_CHARS] if isinstance(v, (str, bytes)) else v for k, v in record.items()}
    return orjson.dumps(short, default=str, option=orjson.OPT_NON_STR_KEYS).decode()[:RAW_CHARS]


def parquet_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[Item]:
    with fsspec.open(unit.path, "rb") as f:
        pf = pq.ParquetFile(f)
        schema = pf.schema_arrow
        check_text_column(schema, inp, repr(unit.path))
        batches = pf.iter_batches(batch_size=read.batch_size, columns=_columns_of(inp, schema.names))
        yield from _column_items(batches, unit.path, 0, 0, inp, read)


def open_ipc(f: Any) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    """Schema and batches of an Arrow IPC file (random access) or, failing the magic, a stream."""
    magic = f.read(6)
    f.seek(0)
    if magic == b"ARROW1":
        reader = pa.ipc.open_file(f)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    stream = pa.ipc.open_stream(f)
    return stream.schema, iter(stream)


def arrow_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[Item]:
    with fsspec.open(unit.path, "rb") as f:
        schema, batches = open_ipc(f)
        check_text_column(schema, inp, repr(unit.path))
        cols = _columns_of(inp, schema.names)
        yield from _column_items((b.select(cols) for b in batches), unit.path, 0, 0, inp, read)


def hf_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[Item]:
    where = repr(unit.path)
    # datasets caches the prepared dataset, so reloading here (per unit) is cheap.
    ds = load_hf(unit.path, inp, where) if unit.format == "hf" else load_disk(unit.path, inp.split, where)
    check_text_column(ds.data.schema, inp, where)
    ds = ds.select_columns(_columns_of(inp, ds.column_names)).with_format("arrow")
    stop = len(ds) if unit.stop is None else min(unit.stop, len(ds))
    slices = (ds[a : min(a + read.batch_size, stop)] for a in range(unit.start, stop, read.batch_size))
    yield from _column_items(slices, unit.path, unit.start, 0, inp, read)
