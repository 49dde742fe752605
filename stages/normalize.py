"""Normalize: Unicode normal form and whitespace clean-up, so that exact dedup sees through
encoding accidents (composed vs decomposed accents, CRLF line ends, trailing blanks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.config import note
from stages.base import StageResult, split_by_reasons

# The characters `str.isspace` calls whitespace (all below U+3001 in Python's Unicode database; a test checks the
# whole range), as an RE2 pattern for "empty or nothing else".
_PYTHON_WHITESPACE = [c for c in range(0x3001) if chr(c).isspace()]
_ONLY_PYTHON_WHITESPACE = "^[" + "".join(r"\x{%x}" % c for c in _PYTHON_WHITESPACE) + "]*$"


@dataclass(frozen=True, kw_only=True)
class NormalizeConfig:
    enabled: bool = note(True, help="run the normalize stage")
    unicode_form: Literal["NFC", "NFKC", "none"] = note("NFC", help="Unicode normalization form")
    strip_trailing_whitespace: bool = note(True, help="remove spaces and tabs at line ends")
    max_blank_lines: int = note(2, help="collapse longer runs of blank lines to this many (-1 keeps all)")
    normalize_newlines: bool = note(True, help="turn \\r\\n and \\r into \\n")


class NormalizeStage:
    """The whole column at once in Arrow's compute functions (RE2): 4.0x less CPU than a Python loop of `re.sub` on
    the shared corpus (scripts/bench_normalize.py). It runs in the read task, the one serial step when the input
    is a single file. The Unicode form stays
    Python's `unicodedata` (on the non-ASCII rows only), so the Unicode version is Python's."""

    name = "normalize"

    def __init__(self, config: NormalizeConfig) -> None:
        self.config = config

    def normalize(self, text: pa.Array) -> pa.Array:
        c = self.config
        if c.normalize_newlines:
            text = pc.replace_substring(pc.replace_substring(text, "\r\n", "\n"), "\r", "\n")
        if c.unicode_form != "none":
            other = pc.invert(pc.string_is_ascii(text))
            if pc.any(other).as_py():
                rows = pc.filter(text, other).to_pylist()
                fixed = pa.array([unicodedata.normalize(c.unicode_form, t) for t in rows], text.type)
                text = pc.replace_with_mask(text, other, fixed)
        if c.strip_trailing_whitespace:  # spaces and tabs before each line end
            text = pc.replace_substring_regex(text, r"(?m)[ \t]+$", "")
        if c.max_blank_lines >= 0:
            text = pc.replace_substring_regex(text, r"\n{%d,}" % (c.max_blank_lines + 2), "\n" * (c.max_blank_lines + 1))
        return pc.utf8_trim(text, "\n")

    def __call__(self, batch: pa.RecordBatch) -> StageResult:
        i = batch.schema.get_field_index("text")
        texts = self.normalize(batch.column(i))
        # A document that normalizes to nothing (only blank lines) is dropped, not passed on empty;
        # whitespace is Python's (str.isspace), as before, matched in RE2 (no Python string per document).
        blank = pc.match_substring_regex(texts, _ONLY_PYTHON_WHITESPACE).to_numpy(zero_copy_only=False)
        reasons = np.where(blank, "empty_after_normalize", None).tolist()
        batch = batch.set_column(i, batch.schema.field(i), texts.cast(pa.large_string()))
        return split_by_reasons(batch, reasons, self.name)
