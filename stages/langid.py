"""Language identification: tag each document's language and confidence.

The model is py3langid's (a numpy port of langid.py, 97 languages), which ships inside its package:
nothing is downloaded at run time. Only the first `max_chars` characters are classified — enough
for a confident label, and the cost stays flat on long documents. The stage fills the `lang` and
`lang_score` columns, so filters (`domain/lang` keys), mixtures and statistics can be keyed by
(domain, language); it drops a document only when told to keep a set of languages
(`langid:other_language`) or a minimum confidence (`langid:low_confidence`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from datapipe.core.config import check, note
from stages.base import StageResult, split_by_reasons


@dataclass(frozen=True, kw_only=True)
class LangIdConfig:
    enabled: bool = note(False, help="tag each document's language (lang, lang_score)")
    languages: list[str] = note([], help="restrict the model to these ISO 639-1 codes (empty = all it knows)")
    max_chars: int = note(4000, help="characters of each document that are classified")
    keep: list[str] = note([], help="drop documents whose language is not in this list (empty = keep all)")
    min_score: float | None = note(None, help="drop documents whose language confidence is below this (null = keep all)")

    def __post_init__(self) -> None:
        check(self.max_chars > 0, f"max_chars must be > 0, got {self.max_chars!r}")
        if self.min_score is not None:
            check(0.0 <= self.min_score <= 1.0, f"min_score must be in [0, 1], got {self.min_score!r}")


def _identifier(languages: list[str]):
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    identifier = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    if languages:
        unknown = sorted(set(languages) - set(identifier.nb_classes))
        check(not unknown, f"langid.languages: the model does not know {unknown}; it knows {sorted(set(identifier.nb_classes))}")
        identifier.set_languages(languages)
    return identifier


class LangIdStage:
    name = "langid"

    def __init__(self, config: LangIdConfig, *, keep_text: bool = False) -> None:
        self.config = config
        self.keep_text = keep_text  # dropped rows keep their text (output.keep_dropped_text)
        self._model = None  # loaded on first use: the stage is pickled to workers without it

    def __getstate__(self) -> dict:
        return {"config": self.config, "keep_text": self.keep_text, "_model": None}

    def classify(self, text: str) -> tuple[str, float]:
        if self._model is None:
            self._model = _identifier(self.config.languages)
        lang, score = self._model.classify(text[: self.config.max_chars])
        return lang, float(score)

    def __call__(self, batch: pa.RecordBatch) -> StageResult:
        labels = [self.classify(t) for t in batch.column("text").to_pylist()]
        langs = [lang for lang, _ in labels]
        scores = [score for _, score in labels]
        for name, values, type_ in (("lang", langs, pa.string()), ("lang_score", scores, pa.float32())):
            i = batch.schema.get_field_index(name)
            batch = batch.set_column(i, batch.schema.field(i), pa.array(values, type_))
        keep, min_score = set(self.config.keep), self.config.min_score
        reasons = [
            "langid:other_language" if keep and lang not in keep
            else "langid:low_confidence" if min_score is not None and score < min_score
            else None
            for lang, score in labels
        ]
        return split_by_reasons(batch, reasons, self.name, keep_text=self.keep_text)
