"""Readers: turn the configured inputs into streams of documents (`DOC_SCHEMA` record batches).

Reading has two steps so that the runner can spread the work:

1. `plan_units(inputs)` expands every input (a path, a glob or any fsspec URL) into `InputUnit`s, in
   input order and sorted within an input, so the plan is the same on every run. It checks everything
   it can before any work starts and raises `InputError` naming the input: nothing matched, a file
   that cannot be opened, an extension it cannot map to a format, a folder mixing formats, a JSON
   file holding one JSON array (JSON Lines only), a Hugging Face dataset that does not load, a
   columnar file without a string text column.
   `input_fingerprints(units, inputs)` gives each file they read a fingerprint (size and mtime, or
   size and ETag for a remote object), which the run record keeps so a resume notices an edited input.
2. `read_unit(unit, unit_index, inp, read)` streams one unit and yields `(batch, quarantined)`: a
   batch of at most `read.batch_size` documents and the records set aside while reading it.

Folders (`format: auto`): a saved Hugging Face dataset is `hf_disk`; otherwise the folder is read
by the format of its files' extensions (all `.jsonl[.gz|.zst|...]`, all `.parquet` or all `.arrow`),
and as text (one document per file) when none has a data extension. Hidden files do not count; a
folder whose files have several formats is refused, naming the extensions found.

JSON arrays are refused (not read): reading one needs the whole file in memory (no streaming JSON
parser among the dependencies), it has no line numbers for the quarantine, and it cannot be split.

Units: one file for jsonl/parquet/arrow; `rows_per_unit` files of a folder for text; a range of
`rows_per_unit` rows for hf/hf_disk.

Order: the i-th record position of a unit (blank lines and quarantined records counted too, so a
JSONL position is its line number - 1) gets `order_key(unit_index, i)`; the order therefore depends
only on the inputs, never on the number of workers.

Ids: the record's `id_field` (through `str()` when not a string). When it is missing, null or the
empty string, the id is derived: `f"{path}:{line}"` (1-based) for JSONL, `f"{path}:{row}"` (0-based
row of the file or dataset) for parquet/arrow/hf, the path relative to the folder for text files.

Domain: the record's `domain_field` when that is a non-empty string, else the input's `domain`.

Quarantine reasons (`QUARANTINE_REASONS`): invalid_utf8, malformed_json, not_an_object,
missing_text, text_not_string, empty_text (empty or whitespace only), too_long (more UTF-8 bytes
than `read.max_bytes_per_doc`), truncated_input (a compressed file cut short: the lines that fully
decoded are read, the rest of the file becomes this one record, with the line where reading
stopped), corrupt_input (a line of a compressed member that fails its check: a gzip member's CRC-32
or length, a zstd frame's checksum or data, a bz2/xz stream's data; none of its lines is kept, since
the damage may have garbled any of them; reading goes on with the next member when the damaged one's
end is known (gzip: its trailer; zstd: its block headers), else the rest of the file becomes one
record; the text after a damaged member starts a fresh line, so the next member's first record is not
glued to the damaged one's cut-off last line). A run is not stopped by one damaged file.

Damage is found before any line is used: a compressed JSONL file is decompressed twice, first to check
every member (gzip checks its CRC only at the end of a member, so zlib hands over garbled text until
then), keeping nothing but the line ranges of the members that fail, then to parse it (`compressed.unusable_lines`).

A parquet/arrow/hf input whose text column is missing or not a string column is refused with
`InputError` at plan time (its schema is cheap to read) rather than quarantining every row: that is
almost always a wrong `text_field`. `read_unit` checks again and raises the same error. A column of
type null (all values null) is accepted; its rows are quarantined as `missing_text`.

Memory: JSONL is read in 1 MiB blocks split into lines (compressed ones decompressed 64 KiB of
input at a time, so damage loses little that came before it, into pieces of at most 1 MiB; zstd, which
has no output bound, 1 KiB of input at a time); a line longer than 6 x `max_bytes_per_doc` (more than
JSON escaping can make of an allowed text) is quarantined as too_long after its first bytes and the
rest of it skipped to the next newline unheld, parquet by row batches, Arrow IPC one record
batch at a time, text files up to `max_bytes_per_doc + 1` bytes, hf datasets (memory-mapped) by
`batch_size` row slices.

Modules: `planning` (inputs into units, fingerprints), `reading` (`read_unit`: a unit into batches),
`jsonl`, `columnar` (Parquet, Arrow, Hugging Face datasets) and `text` (the formats), `compressed` (the
damage-aware codec layer under JSONL), `common` (the unit, the error, the quarantine record and the
per-record checks every format shares).
"""

from __future__ import annotations

from datapipe.curation.readers.common import QUARANTINE_REASONS, RAW_CHARS, InputError, InputUnit, Quarantined
from datapipe.curation.readers.planning import (
    COMPRESSED_TEXT_RATIO,
    estimated_text_bytes,
    file_fingerprint,
    input_fingerprints,
    plan_units,
    unit_files,
)
from datapipe.curation.readers.reading import read_unit

__all__ = [
    "InputError",
    "InputUnit",
    "Quarantined",
    "QUARANTINE_REASONS",
    "plan_units",
    "read_unit",
    "RAW_CHARS",
    "COMPRESSED_TEXT_RATIO",
    "estimated_text_bytes",
    "file_fingerprint",
    "input_fingerprints",
    "unit_files",
]
