"""The contract every curation stage keeps.

A stage is a small class with a frozen, typed config and a pure function over a batch of documents
(`datapipe.schema.DOC_SCHEMA` in, `StageResult` out). Stages never import Ray, torch, the loader or
the trainer: the runner in `datapipe.runner` maps them onto Ray (or a plain loop in tests).

A document filter is smaller still: `check(text) -> reason | None`. `FilterStage` applies the
filters configured for each document's domain (or domain and language: keys `domain/lang`, `domain`,
`*/lang`, `*`, most specific first) and turns the first failing check into a drop whose
reason is `"<filter name>:<check>"` (e.g. `gopher_quality:word_count`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.schema import DROPPED_SCHEMA


@dataclass(frozen=True)
class StageResult:
    kept: pa.RecordBatch  # DOC_SCHEMA
    dropped: pa.RecordBatch  # DROPPED_SCHEMA


class Stage(Protocol):
    name: str

    def __call__(self, batch: pa.RecordBatch) -> StageResult: ...


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
    """A heuristic check on one document: None keeps it, a short string names why it is dropped."""

    name: ClassVar[str]

    def check(self, text: str) -> str | None: ...


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
        reasons: list[str | None] = []
        columns = (batch.column(c).to_pylist() for c in ("text", "domain", "lang"))
        for text, domain, lang in zip(*columns):
            reason = None
            for f in self.filters_for(domain, lang):
                detail = f.check(text)
                if detail is not None:
                    reason = f"{f.name}:{detail}"
                    break
            reasons.append(reason)
        return split_by_reasons(batch, reasons, self.name, keep_text=self.keep_text)
