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
from stages.base import StageResult, split_by_reasons, utf8_bytes

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
            text = _unicode_form(text, c.unicode_form)
        if c.strip_trailing_whitespace:  # spaces and tabs before each line end (RE2's (?m)$: before a \n, or at the end)
            text = _replace_in_rows(text, _rows_with_trailing_blank(text), r"(?m)[ \t]+$", "")
        if c.max_blank_lines >= 0:
            run = c.max_blank_lines + 2
            text = _replace_in_rows(text, _rows_with_newline_run(text, run), r"\n{%d,}" % run, "\n" * (c.max_blank_lines + 1))
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


# Most documents need neither regex nor a new Unicode form: finding the few that do costs less than rewriting every
# one (the shared corpus's counts are in BENCHMARKS.md), so each rule rewrites only those rows. The text is the same
# either way.


def _rows_at(offsets: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The rows (ascending, once each) that hold the bytes at positions `at`."""
    return np.unique(np.searchsorted(offsets, at, side="right") - 1)


def _is_blank(values: np.ndarray) -> np.ndarray:
    return (values == ord(" ")) | (values == ord("\t"))


def _rows_with_trailing_blank(text: pa.Array) -> np.ndarray:
    """The rows the trailing-blank regex can match: a space or tab before a newline or at the row's end (a newline
    that starts a row follows the row before's last byte: that row is then taken too, and the regex leaves it as it is)."""
    values, offsets = utf8_bytes(text)
    newlines = np.flatnonzero(values == ord("\n"))
    before = newlines[newlines > 0] - 1
    last = offsets[1:][offsets[1:] > offsets[:-1]] - 1  # each non-empty row's last byte
    at = np.concatenate([before, last])
    return _rows_at(offsets, at[_is_blank(values[at])])


def _rows_with_newline_run(text: pa.Array, run: int) -> np.ndarray:
    """The rows the blank-lines regex can match: `run` newlines one after another (a run across two rows takes a row
    that the regex leaves as it is)."""
    values, offsets = utf8_bytes(text)
    newlines = np.flatnonzero(values == ord("\n"))
    first = newlines[: max(0, len(newlines) - run + 1)]
    return _rows_at(offsets, first[newlines[run - 1 :] - first == run - 1])


def _replace_in_rows(text: pa.Array, rows: np.ndarray, pattern: str, replacement: str) -> pa.Array:
    """`pc.replace_substring_regex(text, pattern, replacement)`, computed on `rows` only: the rows the pattern
    can match (the others it would leave as they are)."""
    if not len(rows):
        return text
    fixed = pc.replace_substring_regex(text.take(pa.array(rows)), pattern, replacement)
    return pc.replace_with_mask(text, pa.array(_mask(len(text), rows)), fixed)


def _unicode_form(text: pa.Array, form: str) -> pa.Array:
    """`text` in Unicode normal form `form` (Python's `unicodedata`): only non-ASCII rows can change, and only those
    that do are replaced."""
    other = np.flatnonzero(~pc.fill_null(pc.string_is_ascii(text), True).to_numpy(zero_copy_only=False))
    if not len(other):
        return text
    rows, fixed = [], []
    for row, value in zip(other.tolist(), text.take(pa.array(other)).to_pylist()):
        if (normal := unicodedata.normalize(form, value)) != value:
            rows.append(row)
            fixed.append(normal)
    if not rows:
        return text
    return pc.replace_with_mask(text, pa.array(_mask(len(text), np.array(rows))), pa.array(fixed, text.type))


def _mask(n: int, rows: np.ndarray) -> np.ndarray:
    mask = np.zeros(n, bool)
    mask[rows] = True
    return mask
