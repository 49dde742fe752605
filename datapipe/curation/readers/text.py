"""Plain text: a folder of text files, one document per file. The id is the path relative to the folder;
each file is read up to one byte past `max_bytes_per_doc`."""

from __future__ import annotations

from collections.abc import Iterator

import fsspec

from datapipe.curation.config import InputConfig, ReadConfig
from datapipe.curation.readers.common import InputUnit, Item, Quarantined, raw_bytes

def text_items(unit: InputUnit, inp: InputConfig, read: ReadConfig) -> Iterator[Item]:
    base = unit.path.rstrip("/") + "/"
    limit = read.max_bytes_per_doc
    for k, path in enumerate(unit.files):
        row = unit.start + k
        with fsspec.open(path, "rb") as f:
            data = f.read(limit + 1)  # one byte more than allowed tells too_long without reading it all
        if len(data) > limit:
            detail = f"file is longer than max_bytes_per_doc={limit} bytes"
            yield Quarantined(path, None, row, "too_long", detail, raw_bytes(data))
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield Quarantined(path, None, row, "invalid_utf8", str(exc), raw_bytes(data))
            continue
        if not text or text.isspace():
            yield Quarantined(path, None, row, "empty_text", "file is empty or whitespace only", raw_bytes(data))
            continue
        doc_id = path[len(base) :] if path.startswith(base) else path
        yield (k, doc_id, inp.domain, text)
