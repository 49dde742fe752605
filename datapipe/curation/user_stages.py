"""Your own stages, named in the recipe by import path (`stages: [{path: 'my_filters:ShortLines', args: {...}}]`)

Each entry's `path` names a class (`module:attr`), called with `args`. What it builds is either
- a map stage (`stages.base.Stage`): a `name` and a call over a record batch returning `StageResult`, or
- a document filter (`stages.base.DocumentFilter`): a `name` and `check(text) -> str | None`, which
  `DomainFilterStage` applies to the entry's `domains` (empty: every document), dropping with reason
  `"<name>:<detail>"`.
They run after the shipped filters and before near dedup (`datapipe.curation.pipeline.build_segments`), their
drops counted under their own `name`. The modules they live in go to Ray's workers with the job (`worker_modules`).
A stage that raises, or a check that answers something other than None or a string, stops the run with
`UserStageFailed`: the entry, what went wrong, the document (or batch) and where it lies in its input, what to do.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.config import ConfigError
from datapipe.core.schema import DOC_SCHEMA, DROPPED_SCHEMA, ROW_BITS
from stages.base import LOSER_SCHEMA, GlobalStage, StageResult, drop_reason, split_by_reasons

# Stage names the run itself counts under in the funnel: a user's stage must not share one (nor another's).
SHIPPED_NAMES = frozenset({"read", "normalize", "exact_dedup", "langid", "filters", "minhash", "tokenize", "eval_split",
                           "quality_classifier", "dsir", "perplexity", "random_selection", "diversity", "mixture"})
# Packages of datapipe itself: installed wherever the workers run, never shipped to them.
OWN_PACKAGES = frozenset({"datapipe", "stages"})


class UserStageFailed(ConfigError):
    """A user's stage failed on documents: `stage` names the entry, `problem` what went wrong, `ids` and `orders` the
    document (or a batch's first and last), `where` where they lie in the inputs (added by the segment task, which
    knows the input units: `located`), `todo` what to do. The CLI prints it as one paragraph; it pickles as itself,
    so that it reaches the driver through Ray."""

    def __init__(self, stage: str, problem: str, ids: Sequence[str], orders: Sequence[int], count: int, todo: str,
                 where: str = "") -> None:
        self.stage, self.problem, self.ids, self.orders = stage, problem, list(ids), list(orders)
        self.count, self.todo, self.where = count, todo, where
        if count == 1:
            documents = f"document {self.ids[0]!r}" + (f" ({where})" if where else "")
        else:
            documents = (f"a batch of {count:,} documents ({self.ids[0]!r} to {self.ids[-1]!r}"
                         + (f", {where})" if where else ")"))
        super().__init__(f"{stage}, on {documents}: {problem}. {todo}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.stage, self.problem, self.ids, self.orders, self.count, self.todo, self.where)

    def located(self, units: Sequence[Any]) -> UserStageFailed:
        """The same failure, saying where its documents lie in the inputs (`units`: the plan's `InputUnit`s)."""
        return UserStageFailed(self.stage, self.problem, self.ids, self.orders, self.count, self.todo,
                               where_in_inputs(units, self.orders))


def where_in_inputs(units: Sequence[Any], orders: Sequence[int]) -> str:
    """'line 18 of corpus.jsonl' (one order), 'lines 3 to 40 of corpus.jsonl' (a first and a last of one unit):
    a document's order is its unit's index and its position in the unit (`datapipe.curation.readers`)."""
    if not orders:  # a failure on no document (a global stage's keys of an empty block): nowhere to name
        return ""
    places = [divmod(order, 1 << ROW_BITS) for order in orders]
    unit = units[places[0][0]]
    if any(index != places[0][0] for index, _ in places):  # a batch never spans units; say so rather than guess
        return "input " + ", ".join(units[index].path for index, _ in places)
    if unit.format == "text":
        return " to ".join(unit.files[position] for _, position in places)
    noun, first = ("line", 1) if unit.format == "jsonl" else ("row", unit.start)
    numbers = " to ".join(str(first + position) for _, position in places)
    return f"{noun}{'s' * (len(places) > 1)} {numbers} of {unit.path}"


def _source_file(obj: Any) -> str | None:
    """The file that defines `obj`'s class, as the driver imported it (None when it cannot be told)."""
    try:
        return inspect.getsourcefile(type(obj))
    except (TypeError, OSError):
        return None


def _as_the_users(filename: str, home: str | None) -> str:
    """A frame's file as the user knows it: Ray runs a shipped module from its own copy (runtime_resources/.../
    _ray_pkg_<hash>/my_filters.py); that copy of the stage's own file is named as the driver's `home`."""
    if home and filename != home and "runtime_resources" in Path(filename).parts and Path(filename).name == Path(home).name:
        return home
    return filename


def _raised(exc: BaseException, home: str | None = None) -> str:
    """'ValueError: bad text (my_filters.py, line 6, in check)': the exception and the innermost line of the user's
    own code it came through (not of Python's library or an installed package); `home`: the stage's own file, as the
    driver has it, named instead of a worker's shipped copy of it."""
    library = {sysconfig.get_path(kind) for kind in ("stdlib", "platstdlib", "purelib", "platlib")}
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # [0] is the wrapper's call
    own = [f for f in frames if not any(f.filename.startswith(path) for path in library if path)] or frames
    line = f" ({_as_the_users(own[-1].filename, home)}, line {own[-1].lineno}, in {own[-1].name})" if own else ""
    text = " ".join(str(exc).split())  # one paragraph; a KeyError of a whole document must not fill the screen
    return f"{type(exc).__name__}: {text if len(text) <= 300 else text[:300] + ' ...'}{line}"

_FIX_CHECK = ("Fix check so that it answers every text (None keeps the document, a short string drops it naming why), "
              "then run the same command again: the blocks already done are kept.")
_FIX_ANSWER = "Return None (or \"\") for a document the filter keeps, then run the same command again."
_FIX_STAGE = ("Fix the stage so that it handles every batch, then run the same command again: the blocks already done "
              "are kept.")


class DomainFilterStage:
    """A user's `DocumentFilter` as a map stage: documents of `domains` (all when empty) that fail its check are
    dropped with reason `"<name>:<detail>"`, under stage `name`. A check that raises, or answers something other
    than None or a string (`stages.base.drop_reason`), is a `UserStageFailed` naming `entry` and the document."""

    def __init__(self, document_filter: Any, domains: Sequence[str], *, key: str, path: str, keep_text: bool = False) -> None:
        self.filter = document_filter
        self.name = document_filter.name
        self.domains = frozenset(domains)
        self.entry = f"{key}: filter {self.name!r} ({path})"  # its recipe entry, for its errors
        self.keep_text = keep_text
        self.home = _source_file(document_filter)  # its file in the driver, named in its errors

    def __call__(self, batch: pa.RecordBatch) -> StageResult:
        reasons: list[str | None] = []
        for i, (text, domain) in enumerate(zip(batch.column("text").to_pylist(), batch.column("domain").to_pylist())):
            if self.domains and domain not in self.domains:
                reasons.append(None)
                continue
            try:
                answer = self.filter.check(text)
            except Exception as exc:  # noqa: BLE001 - the user's code: name it and the document, not a worker's stack
                raise self._failed(batch, i, f"its check raised {_raised(exc, self.home)}", _FIX_CHECK) from None
            try:
                reasons.append(drop_reason(self.name, answer))
            except TypeError as exc:
                raise self._failed(batch, i, str(exc), _FIX_ANSWER) from None
        return split_by_reasons(batch, reasons, self.name, keep_text=self.keep_text)

    def _failed(self, batch: pa.RecordBatch, row: int, problem: str, todo: str) -> UserStageFailed:
        return UserStageFailed(self.entry, problem, [batch.column("id")[row].as_py()],
                               [batch.column("order")[row].as_py()], 1, todo)


def _ends(rows: pa.RecordBatch | pa.Table) -> tuple[list[str], list[int], int]:
    """A failure's documents: the ids and orders of the first and last of `rows` (none: "?"), and how many."""
    if rows.num_rows == 0 or "id" not in rows.schema.names or "order" not in rows.schema.names:
        return ["?"], [], max(rows.num_rows, 1)
    ids, orders, last = rows.column("id"), rows.column("order"), rows.num_rows - 1
    return [ids[0].as_py(), ids[last].as_py()], [orders[0].as_py(), orders[last].as_py()], rows.num_rows


class CheckedStage:
    """A user's map stage, its result checked: a wrong one stops the run with a message naming the entry
    (a ConfigError, which the CLI prints without a traceback), not a failure somewhere downstream; one that raises
    is a `UserStageFailed` naming the entry and the batch."""

    def __init__(self, stage: Any, key: str, path: str) -> None:
        self.stage = stage
        self.name = stage.name
        self.key = key
        self.entry = f"{key}: stage {self.name!r} ({path})"  # its recipe entry, for the error when it raises
        self.home = _source_file(stage)  # its file in the driver, named in its errors

    def __call__(self, batch: pa.RecordBatch) -> StageResult:
        try:
            result = self.stage(batch)
        except Exception as exc:  # noqa: BLE001 - the user's code: name it and the batch, not a worker's stack
            raise UserStageFailed(self.entry, f"it raised {_raised(exc, self.home)}", *_ends(batch), _FIX_STAGE) from None
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


class CheckedGlobalStage(GlobalStage):
    """A user's global stage, its answers checked: `keys` must give a table with a uint32 `partition` column below
    `partitions`, `decide` a table of `LOSER_SCHEMA`; a wrong answer is a ConfigError naming the entry, a raise a
    `UserStageFailed` naming the entry and the documents (or the partition), never a worker's traceback."""

    def __init__(self, stage: GlobalStage, key: str, path: str) -> None:
        self.stage, self.name, self.partitions, self.key = stage, stage.name, stage.partitions, key
        self.locates_text = stage.locates_text
        self.entry = f"{key}: global stage {self.name!r} ({path})"
        self.home = _source_file(stage)

    def keys(self, batch: pa.RecordBatch) -> pa.Table:
        try:
            keys = self.stage.keys(batch)
        except Exception as exc:  # noqa: BLE001 - the user's code: name it and the batch
            raise UserStageFailed(self.entry, f"keys raised {_raised(exc, self.home)}", *_ends(batch), _FIX_STAGE) from None
        field = keys.schema.field("partition") if isinstance(keys, pa.Table) and "partition" in keys.schema.names else None
        if field is None or field.type != pa.uint32():
            raise ConfigError(f"{self.key}: global stage {self.name!r}: keys returned {type(keys).__name__} without a "
                              "uint32 `partition` column; keys returns a pyarrow Table of key rows with one")
        if keys.num_rows and pc.max(keys.column("partition")).as_py() >= self.partitions:
            raise ConfigError(f"{self.key}: global stage {self.name!r}: keys gave a partition >= its partitions "
                              f"({self.partitions}); every `partition` is below it")
        return keys

    def decide(self, keys: pa.Table) -> pa.Table:
        try:
            losers = self.stage.decide(keys)
        except Exception as exc:  # noqa: BLE001 - the user's code: name it and the documents it had
            raise UserStageFailed(self.entry, f"decide raised {_raised(exc, self.home)}", *_ends(keys), _FIX_STAGE) from None
        if not isinstance(losers, pa.Table) or not losers.schema.equals(LOSER_SCHEMA):
            got = losers.schema if isinstance(losers, pa.Table) else type(losers).__name__
            raise ConfigError(f"{self.key}: global stage {self.name!r}: decide returned {got}; it returns a pyarrow "
                              f"Table of stages.base.LOSER_SCHEMA ({', '.join(LOSER_SCHEMA.names)})")
        return losers


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
        return DomainFilterStage(obj, entry.domains, key=key, path=entry.path, keep_text=keep_text)
    if not callable(obj):
        raise ConfigError(f"{key}.path: {entry.path!r} built a {type(obj).__name__} named {name!r} that has neither "
                          "__call__(batch) -> StageResult (a map stage) nor check(text) (a document filter)")
    if entry.domains:
        raise ConfigError(f"{key}.domains: {name!r} is a map stage, which sees every document and chooses itself; "
                          "domains applies to a document filter only")
    return CheckedStage(obj, key, entry.path)


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


def check_extra_stages(objects: Sequence[Any], taken: set[str], *, keep_text: bool = False) -> list[Any]:
    """`curate(cfg, extra_stages=[...])`'s objects as the recipe's entries are: a document filter wrapped in a
    `DomainFilterStage`, a map stage in a `CheckedStage` (a raising one is a `UserStageFailed` naming it, the
    documents and the user's own file and line), a global stage as it is. Anything else, or a name already taken
    (`taken`: the stages before them), is refused here, before any work."""
    built = []
    for i, obj in enumerate(objects):
        key, where = f"extra_stages[{i}]", f"{type(obj).__module__}.{type(obj).__qualname__}"
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}: a {where} has no non-empty string `name`; a stage (map or global) or a document "
                              "filter names itself, and the funnel counts its drops by that name (stages/base.py)")
        if name in SHIPPED_NAMES or name in taken:
            raise ConfigError(f"{key}: the stage name {name!r} is taken by a stage before it; the funnel counts drops "
                              "by name, so give it another `name`")
        taken.add(name)
        if isinstance(obj, GlobalStage):
            built.append(CheckedGlobalStage(obj, key, where))
        elif callable(getattr(obj, "check", None)):
            built.append(DomainFilterStage(obj, (), key=key, path=where, keep_text=keep_text))
        elif callable(obj):
            built.append(CheckedStage(obj, key, where))
        else:
            raise ConfigError(f"{key}: a {where} named {name!r} has neither __call__(batch) -> StageResult (a map "
                              "stage), check(text) (a document filter), nor is a stages.base.GlobalStage")
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
