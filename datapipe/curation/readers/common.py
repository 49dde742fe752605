"""What the readers of every format share: the unit of work, the input error, the quarantine record and the
per-record checks. `InputUnit` is one independent piece of reading work, `InputError` what a bad input
raises, `Quarantined` a record set aside while reading (with `QUARANTINE_REASONS`); `text_problem`, `id_of`
and `domain_of` judge one record's text, id and domain alike in every format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from datapipe.core.config import ConfigError

QUARANTINE_REASONS = (
    "invalid_utf8",
    "malformed_json",
    "not_an_object",
    "missing_text",
    "text_not_string",
    "empty_text",
    "too_long",
    "truncated_input",
    "corrupt_input",
)
RAW_CHARS = 2000  # a quarantined record keeps at most this much of its raw form


class InputError(ConfigError):
    """An input that cannot be read; the message names the input path and what is wrong."""


@dataclass(frozen=True)
class InputUnit:
    """One independent piece of reading work (the unit of parallelism)."""

    input_index: int  # which InputConfig
    path: str  # file path / URL (for hf: the dataset name; for text: the folder)
    format: str  # resolved format, never "auto"
    start: int = 0  # for hf/hf_disk/text units: first row/file index of this unit
    stop: int | None = None  # exclusive end, None = to the end
    files: tuple[str, ...] = ()  # for format 'text': the files of this unit (sorted)


@dataclass
class Quarantined:
    """A record set aside while reading, with where it was and why."""

    file: str
    line: int | None  # 1-based line number (JSONL)
    row: int | None  # 0-based row (parquet/arrow/hf) or file index in the folder (text)
    reason: str  # one of QUARANTINE_REASONS
    detail: str
    raw: str  # the raw record, truncated to RAW_CHARS characters


# A record stream item: (position in unit, id, domain, text) or a quarantined record.
Item = Union[tuple[int, str, str, str], Quarantined]


def text_problem(text: object, field: str, max_bytes: int) -> tuple[str, str] | None:
    """(reason, detail) when `text` cannot be a document, else None."""
    if text is None:
        return "missing_text", f"no value in field {field!r}"
    if not isinstance(text, str):
        return "text_not_string", f"field {field!r} holds a {type(text).__name__}, not a string"
    if not text or text.isspace():
        return "empty_text", f"field {field!r} is empty or whitespace only"
    # Cheap bounds first: a character is 1..4 UTF-8 bytes; encode only when it could go either way.
    if len(text) > max_bytes or (len(text) * 4 > max_bytes and len(text.encode("utf-8")) > max_bytes):
        return "too_long", f"text is longer than max_bytes_per_doc={max_bytes} UTF-8 bytes"
    return None


def id_of(value: object, derived: str) -> str:
    if value is None or value == "":
        return derived
    return value if isinstance(value, str) else str(value)


def domain_of(value: object, default: str) -> str:
    return value if isinstance(value, str) and value.strip() else default


RAW_BYTES = RAW_CHARS * 4  # enough bytes for RAW_CHARS characters (at most 4 bytes each)


def raw_bytes(data: bytes) -> str:
    return data[:RAW_BYTES].decode("utf-8", "replace")[:RAW_CHARS]
