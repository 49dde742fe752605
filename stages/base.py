"""The contracts every curation stage keeps: map stages and global stages.

A **map stage** (`Stage`) is a small class with a frozen, typed config and a pure function over a
batch of documents (`datapipe.core.schema.DOC_SCHEMA` in, `StageResult` out). Stages never import
Ray, torch, the loader or the trainer: the curation run (`datapipe.curation.run`) maps them onto Ray (or
a plain loop in tests).

A **global stage** (`GlobalStage`: exact dedup, or a user's) decides over every document at once, in
two halves: `keys` emits hash-partitioned keys per document inside the block tasks, and `decide` names the
losers among one partition's keys. The run does the rest: it sends the keys through one exchange, runs one
`decide` task per partition, records them and drops the losers in the next segment. Near dedup, whose decision
takes steps of its own, is a `ResolvingStage`.

A document filter is smaller still: `check(text) -> reason | None` (`drop_reason`: None or "" keeps, a
non-empty string drops, anything else is refused). `FilterStage` applies the
filters configured for each document's domain (or domain and language: keys `domain/lang`, `domain`,
`*/lang`, `*`, most specific first) and turns the first failing check into a drop whose
reason is `"<filter name>:<check>"` (e.g. `gopher_quality:word_count`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.schema import DOC_SCHEMA, DROPPED_SCHEMA
from datapipe.core.storage import Location


@dataclass(frozen=True)
class StageResult:
    kept: pa.RecordBatch  # DOC_SCHEMA
    dropped: pa.RecordBatch  # DROPPED_SCHEMA


class Stage(Protocol):
    """A map stage: a pure function of one batch of documents."""

    name: str

    def __call__(self, batch: pa.RecordBatch) -> StageResult: ...


# The documents a global stage decided against: global input `order`, the drop reason and the id of
# the document kept in their place.
LOSER_SCHEMA = pa.schema([("order", pa.int64()), ("reason", pa.string()), ("kept_id", pa.string())])

# run_tasks(fn, shared, items, desc, *, record=None, memory=None): fn(shared, *item) for each item, in tasks; with
# `record` (record(shared, *item) -> where a finished task's record goes), a task whose record is there is skipped
# and its recorded result returned (the run loop checks records: a stage never does).
RunTasks = Callable[..., list[Any]]
"""An executor's `run_tasks(fn, shared, items, desc)`: calls `fn(shared, *item)` once per item, as
independent tasks (so `fn` is a module-level function and `shared` is picklable), and returns the
results in item order."""


class GlobalStage(ABC):
    """A stage that decides over all documents of the run at once, in two halves; the run does the rest.

    - `keys(batch)`: for each document of a batch, rows of keys, with a `partition` column (uint32 in
      `[0, partitions)`). The run calls it in each block task after the segment's map stages and sends the rows
      through one exchange (`datapipe.core.exchange.Shuffle`): every key of one partition, from every block,
      reaches one task.
    - `decide(keys)`: all keys of one partition (from every file, worker and node; without the `partition`
      column), in no promised order: the documents that lose (`LOSER_SCHEMA`: their `order`, the reason, the id
      of the document kept in their place; each document at most once). It is pure: the run writes its answer,
      records the task and skips it on resume, so a killed run resumes to the same result.

    The next segment drops the losers before its own stages, as drops of stage `name` with the loser's reason and
    `kept_id`; stats.json's `global_stages.<name>` counts them (`removed`).
    """

    name: ClassVar[str]  # also its work folder, work/<name>/
    partitions: int  # the exchange's width: `partition` values are below it
    # True: the batches `keys` gets carry `text_at` and `text_bytes`, where each document's text lies in its
    # read block (`datapipe.curation.blocks.read_texts` reads a few documents' text back by those ranges)
    locates_text: ClassVar[bool] = False

    @abstractmethod
    def keys(self, batch: pa.RecordBatch) -> pa.Table:
        """The map half: key rows with a `partition` column."""

    @abstractmethod
    def decide(self, keys: pa.Table) -> pa.Table:
        """The losers among one partition's keys (`LOSER_SCHEMA`)."""

    def tasks(self, documents: int) -> int:
        """How many losers files the run's decision leaves for `documents` documents: one per partition."""
        return self.partitions

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "resolve" in vars(cls) and "decide" not in vars(cls):  # written to the contract before keys + decide
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} defines resolve(run_tasks, folder, ...), which a global "
                            "stage no longer has: define decide(keys) -> the losers (stages.base.LOSER_SCHEMA) of one "
                            "partition's keys, and return the keys from keys(batch) as one table; the run sends, routes "
                            "and records them (docs/curation.md shows one)")


class ResolvingStage(ABC):
    """A global stage whose decision takes steps of its own (near dedup: candidate pairs, verification, connected
    components, winners), not one `decide` per partition: `keys` gives tables by kind (each sent as one exchange,
    `work/<name>/<kind>/`), and `resolve(run_tasks, folder, out_dir, senders, documents, largest)` runs its steps'
    tasks and leaves `folder/losers-tNNN.arrow` for t below `tasks(documents)` (`largest`: the largest file of each
    kind, as the block tasks measured it); it returns a summary for stats.json."""

    name: ClassVar[str]
    partitions: int
    locates_text: ClassVar[bool] = False

    @abstractmethod
    def keys(self, batch: pa.RecordBatch) -> dict[str, pa.Table]:
        """The map half: key tables by kind, each with a `partition` column."""

    def tasks(self, documents: int) -> int:
        return self.partitions

    @abstractmethod
    def resolve(self, run_tasks: RunTasks, folder: Location, out_dir: Location, senders: Sequence[str],
                documents: int, largest: dict[str, int]) -> dict[str, Any]:
        """Write `folder/losers-tNNN.arrow` for t below `tasks(documents)`; return a summary for the stats."""


GLOBAL_STAGES = (GlobalStage, ResolvingStage)  # what closes a segment


def utf8_bytes(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The UTF-8 bytes of all `texts` back to back (no copy of a large_string array's), and each text's start in them
    (len(texts) + 1 offsets): how the compiled loops and numpy passes over a batch's text read it."""
    texts = texts.cast(pa.large_string()) if texts.type != pa.large_string() else texts
    offsets = np.frombuffer(texts.buffers()[1], dtype=np.int64)[texts.offset : texts.offset + len(texts) + 1]
    data = texts.buffers()[2]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.empty(0, np.uint8)
    return data[offsets[0] : offsets[-1]], offsets - offsets[0]


def split_by_reasons(
    batch: pa.RecordBatch,
    reasons: Sequence[str | None],
    stage: str,
    *,
    kept_ids: Sequence[str | None] | None = None,
    keep_text: bool = False,
) -> StageResult:
    """Keep the rows whose reason is None; the others become dropped rows with that reason."""
    if len(reasons) != batch.num_rows:
        raise ValueError(f"stage {stage!r} gave {len(reasons)} reasons for {batch.num_rows} rows")
    keep_mask = pa.array([r is None for r in reasons], type=pa.bool_())
    kept = batch.filter(keep_mask)
    if kept.num_rows == batch.num_rows:
        return StageResult(kept, pa.RecordBatch.from_pylist([], schema=DROPPED_SCHEMA))
    drop_mask = pc.invert(keep_mask)
    gone = batch.filter(drop_mask)
    n = gone.num_rows
    drop_reasons = [r for r in reasons if r is not None]
    kept_col = (
        pa.array([k for k, r in zip(kept_ids, reasons) if r is not None], type=pa.string())
        if kept_ids is not None
        else pa.nulls(n, pa.string())
    )
    dropped = pa.RecordBatch.from_arrays(
        [
            gone.column("id"),
            gone.column("domain"),
            gone.column("order"),
            pa.array([stage] * n, type=pa.string()),
            pa.array(drop_reasons, type=pa.string()),
            kept_col,
            gone.column("text") if keep_text else pa.nulls(n, pa.large_string()),
        ],
        schema=DROPPED_SCHEMA,
    )
    return StageResult(kept, dropped)


class DocumentFilter(Protocol):
    """A heuristic check on one document: None (or "") keeps it, a non-empty string names why it is dropped.
    Any other answer is refused (`drop_reason`)."""

    name: ClassVar[str]

    def check(self, text: str) -> str | None: ...


def drop_reason(name: str, answer: Any) -> str | None:
    """A document filter's answer to `check` as a drop reason: None or "" keeps the document (None), a non-empty
    string drops it with reason `"<name>:<answer>"`. Anything else is a TypeError naming the filter, the answer and
    the contract: a filter answering "fine" with False (or with a count) would otherwise drop every document."""
    if answer is None:
        return None
    if isinstance(answer, str):
        return f"{name}:{answer}" if answer else None
    raise TypeError(f"check returned {answer!r} (a {type(answer).__name__}); a filter's check returns None or \"\" to "
                    "keep a document, or a non-empty string naming why it is dropped")


class FilterStage:
    """Applies each domain's filters in order; the first failing check drops the document."""

    name = "filters"

    def __init__(self, filters_by_domain: dict[str, list[DocumentFilter]], default: list[DocumentFilter],
                 *, keep_text: bool = False) -> None:
        self.filters_by_domain = filters_by_domain
        self.default = default
        self.keep_text = keep_text

    def filters_for(self, domain: str, lang: str | None) -> list[DocumentFilter]:
        """The most specific filter set: 'domain/lang', then 'domain', then '*/lang', then '*'."""
        by = self.filters_by_domain
        for key in (f"{domain}/{lang}" if lang else None, domain, f"*/{lang}" if lang else None):
            if key is not None and key in by:
                return by[key]
        return self.default

    def __call__(self, batch: pa.RecordBatch) -> StageResult:
        reasons: list[str | None] = [None] * batch.num_rows
        rows_by_filters: dict[int, tuple[list[DocumentFilter], list[int]]] = {}
        columns = (batch.column(c).to_pylist() for c in ("domain", "lang"))
        for row, (domain, lang) in enumerate(zip(*columns)):
            filters = self.filters_for(domain, lang)
            rows_by_filters.setdefault(id(filters), (filters, []))[1].append(row)
        texts = batch.column("text")
        for filters, rows in rows_by_filters.values():
            if filters:
                for row, reason in zip(rows, first_failures(filters, texts.take(rows))):
                    reasons[row] = reason
        return split_by_reasons(batch, reasons, self.name, keep_text=self.keep_text)


class BatchDocumentFilter(DocumentFilter, Protocol):
    """A document filter that also checks many texts at once (compiled filters: one call per batch, not per text)."""

    def check_batch(self, texts: pa.Array, undecided: np.ndarray, shared: dict[str, Any]) -> list[str | None]:
        """What `check` answers for each of `texts` where `undecided` is set (None elsewhere). `shared` lives for
        one batch and is passed to every filter of a chain: a filter keeps there what the next can reuse (the
        texts' splits into words and lines)."""
        ...


def first_failures(filters: Sequence[DocumentFilter], texts: pa.Array) -> list[str | None]:
    """Each text's drop reason from the first of `filters` it fails, or None: a `BatchDocumentFilter` checks the
    texts still undecided in one call, any other filter one text at a time."""
    reasons: list[str | None] = [None] * len(texts)
    undecided = np.ones(len(texts), dtype=np.bool_)
    shared: dict[str, Any] = {}
    plain: list[str] | None = None
    for f in filters:
        if not undecided.any():
            break
        if (check_batch := getattr(f, "check_batch", None)) is not None:
            answers = check_batch(texts, undecided, shared)
        else:
            plain = texts.to_pylist() if plain is None else plain
            answers = [f.check(text) if u else None for text, u in zip(plain, undecided)]
        for i in np.flatnonzero(undecided).tolist():
            if answers[i] is not None:
                reasons[i] = f"{f.name}:{answers[i]}"
                undecided[i] = False
    return reasons
