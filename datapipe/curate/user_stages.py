"""Your own stages, named in the recipe by import path (`stages: [{path: 'my_filters:ShortLines', args: {...}}]`)

Each entry's `path` names a class (`module:attr`), called with `args`. What it builds is either
- a map stage (`stages.base.Stage`): a `name` and a call over a record batch returning `StageResult`, or
- a document filter (`stages.base.DocumentFilter`): a `name` and `check(text) -> str | None`, which
  `DomainFilterStage` applies to the entry's `domains` (empty: every document), dropping with reason
  `"<name>:<detail>"`.
They run after the shipped filters and before near dedup (`datapipe.curate.phases.segment.build_segments`), their
drops counted under their own `name`. The modules they live in go to Ray's workers with the job (`worker_modules`).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa

from datapipe.core.config import ConfigError
from datapipe.core.schema import DOC_SCHEMA, DROPPED_SCHEMA
from stages.base import GlobalStage, StageResult, split_by_reasons

# Stage names the run itself counts under in the funnel: a user's stage must not share one (nor another's).
SHIPPED_NAMES = frozenset({"read", "normalize", "exact_dedup", "langid", "filters", "minhash", "tokenize", "eval_split",
                           "quality_classifier", "dsir", "perplexity", "random_selection", "diversity", "mixture"})
# Packages of datapipe itself: installed wherever the workers run, never shipped to them.
OWN_PACKAGES = frozenset({"datapipe", "stages"})


class DomainFilterStage:
    """A user's `DocumentFilter` as a map stage: documents of `domains` (all when empty) that fail its check are
    dropped with reason `"<name>:<detail>"`, under stage `name`."""

    def __init__(self, document_filter: Any, domains: Sequence[str], *, keep_text: bool = False) -> None:
        self.filter = document_filter
        self.name = document_filter.name
        self.domains = frozenset(domains)
        self.keep_text = keep_text

    def __call__(self, batch: pa.RecordBatch) -> StageResult:
        reasons: list[str | None] = []
        for text, domain in zip(batch.column("text").to_pylist(), batch.column("domain").to_pylist()):
            detail = self.filter.check(text) if not self.domains or domain in self.domains else None
            reasons.append(None if detail is None else f"{self.name}:{detail}")
        return split_by_reasons(batch, reasons, self.name, keep_text=self.keep_text)


class CheckedStage:
    """A user's map stage, its result checked: a wrong one stops the run with a message naming the entry
    (a ConfigError, which the CLI prints without a traceback), not a failure somewhere downstream."""

    def __init__(self, stage: Any, key: str) -> None:
        self.stage = stage
        self.name = stage.name
        self.key = key

    def __call__(self, batch: pa.RecordBatch) -> StageResult:
        result = self.stage(batch)
        kept, dropped = getattr(result, "kept", None), getattr(result, "dropped", None)
        if not (isinstance(kept, pa.RecordBatch) and isinstance(dropped, pa.RecordBatch)):
            raise ConfigError(f"{self.key}: stage {self.name!r} returned {type(result).__name__}; a map stage returns "
                              "stages.base.StageResult(kept, dropped), two pyarrow RecordBatches")
        for what, got, schema in (("kept", kept, DOC_SCHEMA), ("dropped", dropped, DROPPED_SCHEMA)):
            if not got.schema.equals(schema):
                raise ConfigError(f"{self.key}: stage {self.name!r} returned {what} rows of another schema than "
                                  f"{'DOC_SCHEMA' if what == 'kept' else 'DROPPED_SCHEMA'} (datapipe.core.schema): {got.schema}")
        if kept.num_rows + dropped.num_rows != batch.num_rows:
            raise ConfigError(f"{self.key}: stage {self.name!r} kept {kept.num_rows} and dropped {dropped.num_rows} of "
                              f"{batch.num_rows} documents; every document must be kept or dropped, once")
        return result


def import_object(path: str, key: str) -> Any:
    """The object that `path` ('module:attr', attr maybe dotted) names; a ConfigError naming `key` otherwise.
    The working folder is on the import path, as for `python -m`, so a file next to the recipe's run is found."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{key}: {path!r} is not an import path 'module:attr' (e.g. 'my_filters:ShortLines')")
    if os.getcwd() not in sys.path and "" not in sys.path:  # the `datapipe` script, unlike `python -m`, lacks it
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({exc}); it must be on the Python path or a "
                          f"file {module_name.replace('.', '/')}.py in the working folder {os.getcwd()}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed as it ran: say which and why
        raise ConfigError(f"{key}: importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{key}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def build_user_stage(entry: Any, index: int, *, keep_text: bool = False) -> Any:
    """The map stage of `stages[index]` (a `StageConfig`): its class called with its args, a document filter
    wrapped in a `DomainFilterStage`, a map stage in a `CheckedStage`. Every mistake is a ConfigError naming the key."""
    key = f"stages[{index}]"
    factory = import_object(entry.path, f"{key}.path")
    if not callable(factory):
        raise ConfigError(f"{key}.path: {entry.path!r} is a {type(factory).__name__}, not a class to call with args")
    try:
        obj = factory(**entry.args)
    except Exception as exc:  # noqa: BLE001 - a wrong keyword, or the class refusing a value: the user's to fix
        raise ConfigError(f"{key}.args: {entry.path}(**{entry.args!r}) failed: {type(exc).__name__}: {exc}") from None
    name = getattr(obj, "name", None)
    if isinstance(obj, GlobalStage) or not isinstance(name, str) or not name:
        raise ConfigError(f"{key}.path: {entry.path!r} built a {type(obj).__name__}, which is neither a map stage nor "
                          "a document filter: either has a non-empty string `name`, and a map stage is called on a "
                          "record batch and returns StageResult, a filter has check(text) -> str | None (stages/base.py)")
    if callable(getattr(obj, "check", None)):
        return DomainFilterStage(obj, entry.domains, keep_text=keep_text)
    if not callable(obj):
        raise ConfigError(f"{key}.path: {entry.path!r} built a {type(obj).__name__} named {name!r} that has neither "
                          "__call__(batch) -> StageResult (a map stage) nor check(text) (a document filter)")
    if entry.domains:
        raise ConfigError(f"{key}.domains: {name!r} is a map stage, which sees every document and chooses itself; "
                          "domains applies to a document filter only")
    return CheckedStage(obj, key)


def build_user_stages(entries: Sequence[Any], *, keep_text: bool = False) -> list[Any]:
    """Every entry's map stage, in order; a name shared with a shipped stage or another entry is refused
    (the funnel counts by name)."""
    built, seen = [], {}
    for i, entry in enumerate(entries):
        stage = build_user_stage(entry, i, keep_text=keep_text)
        if stage.name in SHIPPED_NAMES or stage.name in seen:
            other = f"stages[{seen[stage.name]}]" if stage.name in seen else "a shipped stage"
            raise ConfigError(f"stages[{i}].path: the stage name {stage.name!r} is {other}'s; the funnel counts drops by "
                              "name, so give it another `name`")
        seen[stage.name] = i
        built.append(stage)
    return built


def worker_modules(entries: Sequence[Any]) -> list[str]:
    """The files or folders Ray ships to its workers (runtime_env py_modules) so that they import the entries'
    modules: each module's top-level package folder, or its file; none for an installed package (site-packages)
    or datapipe's own, which the workers have already."""
    found: list[str] = []
    for i, entry in enumerate(entries):
        import_object(entry.path, f"stages[{i}].path")  # imported, so that its top-level module is known
        top = sys.modules[entry.path.partition(":")[0].split(".")[0]]
        if top.__name__ in OWN_PACKAGES:
            continue
        paths = list(getattr(top, "__path__", []))
        where = paths[0] if len(paths) == 1 else getattr(top, "__file__", None)
        if where is None or any(part in ("site-packages", "dist-packages") for part in Path(where).parts):
            continue
        if str(where) not in found:
            found.append(str(where))
    return found
