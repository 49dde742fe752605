"""Normalize: Unicode normal form and whitespace clean-up, so that exact dedup sees through
encoding accidents (composed vs decomposed accents, CRLF line ends, trailing blanks)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
import unicodedata

import pyarrow as pa

from datapipe.core.config import note
from stages.base import StageResult, split_by_reasons

@dataclass(frozen=True, kw_only=True)
class NormalizeConfig:
    enabled: bool = note(True, help="run the normalize stage")
    unicode_form: Literal["NFC", "NFKC", "none"] = note("NFC", help="Unicode normalization form")
    strip_trailing_whitespace: bool = note(True, help="remove spaces and tabs at line ends")
    max_blank_lines: int = note(2, help="collapse longer runs of blank lines to this many (-1 keeps all)")
    normalize_newlines: bool = note(True, help="turn \\r\\n and \\r into \\n")


_TRAILING_WS = re.compile(r"[ \t]+$", re.MULTILINE)


class NormalizeStage:
    name = "normalize"

    def __init__(self, config: NormalizeConfig) -> None:
        self.config = config
        self._blank_run = (
            re.compile(r"\n{%d,}" % (config.max_blank_lines + 2)) if config.max_blank_lines >= 0 else None
        )

    def normalize(self, text: str) -> str:
        c = self.config
        if c.normalize_newlines and "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if c.unicode_form != "none" and not text.isascii():
            text = unicodedata.normalize(c.unicode_form, text)
        if c.strip_trailing_whitespace:
            text = _TRAILING_WS.sub("", text)
        if self._blank_run is not None:
            text = self._blank_run.sub("\n" * (c.max_blank_lines + 1), text)
        return text.strip("\n")

    def __call__(self, batch: pa.RecordBatch) -> StageResult:
        texts = [self.normalize(t) for t in batch.column("text").to_pylist()]
        # A document that normalizes to nothing (only blank lines) is dropped, not passed on empty.
        reasons = [None if t.strip() else "empty_after_normalize" for t in texts]
        i = batch.schema.get_field_index("text")
        batch = batch.set_column(i, batch.schema.field(i), pa.array(texts, pa.large_string()))
        return split_by_reasons(batch, reasons, self.name)
