"""Selection by a model, the first step of selection: score every training document, keep the best-scored ones.

Every step is tasks with records, like every phase's (`run_loop`): a resumed run skips a step by its records
alone, and the driver holds no document and fits nothing.

1. sample   one task per block takes its part of a seeded sample of the training documents (about `sample_docs`;
            id and text) into a shuffle file of one partition, routed to the fit by the exchange (`exchange.route`);
2. fit      one task reads the target documents (`selection.target`, at most `target_docs`) and the routed
            sample in block order, fits the model (`stages.selection.fit`), or reads it from `selection.model`
            (for `fasttext`, an existing fastText classifier whose scores of the sample give the knots), and writes
            it to OUT/selection/model.npz, for later runs, then checked to work/model_select/model.npz; its record
            carries the model's sha256, its costs and the histogram's edges. A model file without its record is
            fitted again;
3. publish  one task checks both copies against the fit's record: a damaged work copy is a `DamagedWorkFile`
            (the run's recovery paragraph), a damaged or missing OUT copy is written again from the work copy;
4. score    one task per block scores its training documents (their text, the last segment's) and writes the
            assignment file of the exact cut (`cuts.py`: one group, or one per domain; rank from score);
5. cut      `keep_fraction` / `keep_tokens`: the exact cut to the token budget, filled: the documents in score order
            up to and including the one that crosses it (a long document at the cut does not leave the budget
            short); `threshold`: none needed;
6. apply    one task per block: which rows stay (work/model_select/excluded/<block>.arrow, 1 = not for training
            any more, with the rows held out before), the dropped documents' records (stage = the method's
            name, e.g. `dsir`), the scores (OUT/selection/scores/<block>.parquet: id, domain, num_tokens, score, kept) and a
            histogram of the scores per domain, all and kept.
A `fasttext` model's tasks (fit, score) declare its file's size beside their block's memory, so that Ray does not
put more of them on a node than its memory holds.
Diversity sampling and the mixture then see only the rows kept here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.config import ConfigError
from datapipe.core.shards import atomic_write_bytes, atomic_write_table
from datapipe.core.exchange import Received, Shuffle, routed, run_maps
from datapipe.core.storage import Location, absolute, is_url, location
from datapipe.core.workfiles import DamagedWorkFile, checked, read_work_bytes, read_work_table, write_work_table
from datapipe.curation.blocks import block_documents, block_file
from datapipe.curation.config import ReadConfig, SelectionConfig
from datapipe.curation.counters import Counters
from datapipe.curation.phase import RunTasks, record_in
from datapipe.curation.plan import MODEL_SELECTION_DIR, Plan, task_memory, token_file, working_dir
from datapipe.curation.cuts import ASSIGN_SCHEMA, Budget, Cut, RowCopies, cuts, held_rows
from datapipe.curation.readers import InputUnit, plan_units, read_unit
from stages.sampling import seeded_sample
from stages.selection import STAGE_NAMES, FastTextScorer, SelectionModel, fit

FOLDER = MODEL_SELECTION_DIR
ALL = "*"  # the one group of a corpus-wide budget
HIST_BINS = 20  # score histogram bins per domain, between the corpus sample's 1st and 99th percentiles
FIT_BYTES_PER_TEXT_BYTE = 8  # the fit task's memory, about, per byte of its texts (the texts, then their n-grams)


def _documents(work: Location, segment: str, block: str) -> tuple[pa.Table, list[str]]:
    """The block's tokenized rows (id, domain, num_tokens) and their texts, row for row."""
    tokens = read_work_table(token_file(work, block)).select(["id", "domain", "num_tokens"])
    texts = block_documents(work, segment, block, ["id", "text"])
    if texts.column("id").to_pylist() != tokens.column("id").to_pylist():  # a bug, never bad input
        raise RuntimeError(f"block {block}: the tokens and the {segment} documents are not the same rows")
    return tokens, texts.column("text").to_pylist()


SAMPLE_SCHEMA = pa.schema([("id", pa.string()), ("text", pa.large_string())])


@dataclass(frozen=True)
class SampleTask:
    """What the sample tasks share: the work folder, the segment whose blocks hold the documents' text, the rows that
    are not training data (never sampled), the sample's share of the training documents and its seed."""

    folder: str
    segment: str
    held_out: RowCopies | None
    rate: float
    seed: int


@dataclass(frozen=True)
class ScoreTask:
    """What the score tasks share: the work folder, the text's segment, the rows held out (never scored), whether
    the cut is per domain (else one over all) and the fitted model's checksum (a worker never scores with another)."""

    folder: str
    segment: str
    held_out: RowCopies | None
    per_domain: bool
    sha256: str


@dataclass(frozen=True)
class ApplyTask:
    """What the apply tasks share: the work folder, the rows held out (never kept), the output folder (drops and
    scores), the method's name, the cut per group (None: a threshold instead), the threshold, the histograms' bins."""

    folder: str
    held_out: RowCopies | None
    out_dir: str
    method: str
    group_cuts: dict[str, Cut] | None
    threshold: float | None
    edges: tuple[float, ...]


def sample_exchange(work: Location) -> Shuffle:
    """The corpus sample: every block's part (`work/model_select/sample/<block>.shuffle`, one partition) to the fit,
    which reads them all, in block order."""
    return Shuffle("selection sample", str(work / FOLDER / "sample"), 1, records=str(work / FOLDER / "records"),
                   sender_record="sample-", map_step="", schema=SAMPLE_SCHEMA)


def sample_rows(task: SampleTask, block: str) -> tuple[pa.Table, np.ndarray, dict[str, Any]]:
    """The block's part of the corpus sample: its training rows whose seeded rank falls below `rate` (id, text)."""
    work, segment, held_out, rate, seed = location(task.folder), task.segment, task.held_out, task.rate, task.seed
    started = time.process_time()
    tokens, texts = _documents(work, segment, block)
    ids = tokens.column("id").to_pylist()
    chosen = seeded_sample(ids, rate, seed)
    take = np.flatnonzero(chosen & ~held_rows(held_out, block, len(ids)))
    table = pa.table({"id": [ids[i] for i in take], "text": [texts[i] for i in take]}, schema=SAMPLE_SCHEMA)
    text_bytes = int(pc.sum(pc.binary_length(table.column("text"))).as_py() or 0)
    return table, np.zeros(len(take), np.int64), {"documents": len(take), "text_bytes": text_bytes,
                                                  "cpu_seconds": time.process_time() - started}


def read_target(cfg: SelectionConfig, units: Sequence[InputUnit]) -> list[str]:
    """The first `target_docs` documents of `selection.target` (planned as `units`), or a ConfigError naming it."""
    texts: list[str] = []
    for unit_index, unit in enumerate(units):
        for batch, _ in read_unit(unit, unit_index, cfg.target, ReadConfig()):
            texts += batch.column("text").to_pylist()[: cfg.target_docs - len(texts)]
            if len(texts) >= cfg.target_docs:
                return texts
    if not texts:
        raise ConfigError(f"selection.target: {cfg.target.path!r} holds no document; give documents of what you train for")
    return texts


def check_selection_files(cfg: SelectionConfig) -> None:
    """Before any work (and before the run claims its folder, so that a fixed file makes the same command run): the
    target documents can be planned (InputError naming `selection.target`) and hold text, the model file can be
    read and is a model of this method (ConfigError naming `selection.model`)."""
    if not cfg.enabled:
        return
    if cfg.target is not None:
        plan_units([cfg.target], "selection.target")
        if not _holds_text(cfg):
            raise ConfigError(f"selection.target: {cfg.target.path!r} holds no document with text; give documents of "
                              "what you train for (their text in the input's text field)")
    if cfg.model is not None and cfg.method == "fasttext":
        fasttext_scorer(cfg)
        FastTextScorer.unload()  # the driver scores nothing: it keeps no model in memory for the run
    elif cfg.model is not None:
        read_model_file(cfg)


def fasttext_scorer(cfg: SelectionConfig) -> FastTextScorer:
    """`selection.model`'s fastText classifier, checked (it loads, it has the label), or a ConfigError naming it."""
    local = "://" not in cfg.model or cfg.model.startswith("file://")
    scorer = FastTextScorer(os.path.abspath(cfg.model.removeprefix("file://")) if local else cfg.model, cfg.fasttext_label)
    try:  # the absolute path: workers may run in another folder
        scorer.check()
    except ValueError as exc:
        raise ConfigError(f"selection.model: {cfg.model!r} is not a fastText classifier datapipe can use: {exc}; give "
                          "the .bin file of a fastText classifier (fasttext.train_supervised's save_model)") from None
    return scorer


def _holds_text(cfg: SelectionConfig) -> bool:
    """Whether a target document has text that is not blank: reads up to the first one."""
    for unit_index, unit in enumerate(plan_units([cfg.target], "selection.target")):
        for batch, _ in read_unit(unit, unit_index, cfg.target, ReadConfig()):
            if any(t and not t.isspace() for t in batch.column("text").to_pylist()):
                return True
    return False


def read_model_file(cfg: SelectionConfig) -> SelectionModel:
    """`selection.model`'s model, or a ConfigError naming the file, what is wrong and what to do."""
    fix = "give the model.npz an earlier run saved in its OUT/selection/ (copy it again if it was damaged), or set selection.target to fit one"
    if not location(cfg.model).exists():
        raise ConfigError(f"selection.model: {cfg.model!r} does not exist; {fix}")
    try:
        model = SelectionModel.from_bytes(location(cfg.model).read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"selection.model: {cfg.model!r} is not a selection model datapipe can read: {exc}; {fix}") from None
    if model.method != cfg.method:
        raise ConfigError(f"selection.model: {cfg.model!r} is a {model.method!r} model, not {cfg.method!r}; set "
                          f"selection.method={model.method} to use it, or give a {cfg.method!r} model")
    return model


@dataclass(frozen=True)
class FitInputs:
    """What the fit task (`fit_task`) reads."""

    work: str
    out_dir: str
    cfg: SelectionConfig
    cwd: str  # the driver's working folder: a relative target or model path is read from there
    target_units: tuple[InputUnit, ...]  # `selection.target` as planned in the driver (none for a saved model)
    sample: Received | None  # the corpus sample (id, text; in block order); None for a saved model, which is read
    sample_cpu_seconds: float  # what taking the sample cost, charged to the fit


def _fit_record(inputs: FitInputs) -> Location:
    return location(inputs.work) / FOLDER / "records" / "fit.json"


def _model_files(inputs: FitInputs) -> tuple[Location, Location]:
    """(the checked work copy the scoring tasks read, the copy for later runs in OUT/selection/)."""
    return location(inputs.work) / FOLDER / "model.npz", location(inputs.out_dir) / "selection" / "model.npz"


def _fitted(inputs: FitInputs) -> SelectionModel:
    """The run's model: `selection.model`'s saved one as it is, or one fit on the target against the sample."""
    cfg = inputs.cfg
    if inputs.sample is None:
        return read_model_file(cfg)
    started = time.process_time()
    sample = inputs.sample.read(0, SAMPLE_SCHEMA)
    target = read_target(cfg, inputs.target_units) if cfg.target is not None else []
    scorer = fasttext_scorer(cfg) if cfg.method == "fasttext" else None
    model = fit(cfg.method, target, sample.column("text").to_pylist(), sample.column("id").to_pylist(), cfg.seed, scorer)
    return dataclasses.replace(model, fit_cpu_seconds=time.process_time() - started + inputs.sample_cpu_seconds)


def fit_task(inputs: FitInputs) -> dict[str, Any]:
    """Fit (or read) the model and write both its copies; the record carries the model's sha256, its costs and the
    score histogram's inner edges (between the sample's 1st and 99th percentiles), all the driver needs of it."""
    local = any(p is not None and not is_url(p) for p in (inputs.cfg.model, inputs.cfg.target and inputs.cfg.target.path))
    with working_dir(inputs.cwd) if local else contextlib.nullcontext():
        model = _fitted(inputs)
    data = model.to_bytes()
    saved, published = _model_files(inputs)
    # the copy for later runs first: a run killed between the two writes has no record, and fits again
    atomic_write_bytes(published, data)
    atomic_write_bytes(saved, checked(data))
    edges = np.linspace(model.knots[40], model.knots[-41], HIST_BINS + 1)
    return {"path": f"{FOLDER}/model.npz", "sha256": hashlib.sha256(data).hexdigest(), "fit_flops": model.fit_flops,
            "fit_cpu_seconds": model.fit_cpu_seconds, "edges": edges.tolist()}


def publish_task(inputs: FitInputs, sha256: str) -> None:
    """Both copies of the model as the fit's record says: the work copy checked (a damaged one is a DamagedWorkFile,
    which the run turns into its recovery paragraph), the copy for later runs written again from it when it was cut,
    changed or deleted since."""
    saved, published = _model_files(inputs)
    data = read_work_bytes(saved).to_pybytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DamagedWorkFile(saved, "it is not the model its fit task recorded")
    try:
        same = hashlib.sha256(published.read_bytes()).hexdigest() == sha256
    except FileNotFoundError:
        same = False
    if not same:
        atomic_write_bytes(published, data)


def fasttext_bytes(cfg: SelectionConfig) -> int:
    """The memory a `fasttext` model takes in a task: its file's size (fastText loads its matrices as they are
    stored); 0 for the other methods, whose models are small."""
    return os.path.getsize(absolute(cfg.model)) if cfg.method == "fasttext" else 0


def fit_model(run_tasks: RunTasks, plan: Plan, names: list[str], training_docs: int, held_out: RowCopies | None) -> dict[str, Any]:
    """The fit's record (`fit_task`), after the sample's tasks and before the publish task; its memory a block task's
    and its sample's. Relative paths of the recipe are read from the plan's `cwd`."""
    work, out_dir, segment, cfg, cwd = plan.work, plan.out, plan.segments[-1].name, plan.cfg.selection, plan.cwd
    task_bytes = task_memory(plan, "block")
    sample, cpu, text_bytes = None, 0.0, 0
    if cfg.model is None or cfg.method == "fasttext":
        rate = cfg.sample_docs / max(training_docs, 1)
        spec = sample_exchange(work)
        parts = run_maps(run_tasks, spec, sample_rows, SampleTask(str(work), segment, held_out, rate, cfg.seed),
                         [(b,) for b in names])
        sample = routed(run_tasks, spec, names, parts)
        cpu, documents = sum(p["cpu_seconds"] for p in parts), sum(p["documents"] for p in parts)
        text_bytes = sum(p["text_bytes"] for p in parts)
        if cfg.target is not None:  # the target's documents, at the sample's mean size
            text_bytes += text_bytes * cfg.target_docs // max(documents, 1)
    units = tuple(plan_units([cfg.target], "selection.target")) if cfg.target is not None else ()
    inputs = FitInputs(str(work), str(out_dir), cfg, cwd, units, sample, cpu)
    memory = task_bytes + FIT_BYTES_PER_TEXT_BYTE * text_bytes + fasttext_bytes(cfg)
    (fitted,) = run_tasks(fit_task, inputs, [()], "selection fit", record=_fit_record, memory=memory)
    run_tasks(publish_task, inputs, [(fitted["sha256"],)], "selection publish")
    return fitted


@functools.lru_cache(maxsize=1)
def _model(path: str, sha256: str) -> SelectionModel:
    """One model per worker process, loaded by its first task (the fit's, from the work folder); keyed by its
    checksum too, so a worker that outlives a refit never scores with the model before it."""
    return SelectionModel.from_bytes(read_work_bytes(path).to_pybytes())


def score_task(task: ScoreTask, block: str) -> dict[str, str]:
    """Score the block's training rows -> work/model_select/<block>.arrow (the cut's assignments, plus `score`)."""
    work, segment, held_out, per_domain, sha256 = location(task.folder), task.segment, task.held_out, task.per_domain, task.sha256
    started = time.process_time()
    model = _model(str(work / FOLDER / "model.npz"), sha256)
    tokens, texts = _documents(work, segment, block)
    rows = np.flatnonzero(~held_rows(held_out, block, tokens.num_rows))
    sub = tokens.take(pa.array(rows, pa.int64()))
    scores = model.scores([texts[i] for i in rows], sub.column("id").to_pylist())
    groups = sub.column("domain") if per_domain else pa.array([ALL] * len(rows), pa.string())
    table = pa.table({"row": rows.astype(np.int64), "domain": groups, "cluster": np.zeros(len(rows), np.int32),
                      "rank": model.rank(scores), "num_tokens": sub.column("num_tokens")}, schema=ASSIGN_SCHEMA)
    out = block_file(work, FOLDER, block)
    write_work_table(out, table.append_column("score", pa.array(scores, pa.float64())))
    flops = model.scoring_flops(int(pc.sum(sub.column("num_tokens")).as_py() or 0))
    return {"path": f"{FOLDER}/{block}.arrow", "flops": flops, "cpu_seconds": time.process_time() - started}


def _histogram(scores: np.ndarray, edges: np.ndarray) -> list[int]:
    return np.bincount(np.clip(np.searchsorted(edges, scores, side="right") - 1, 0, len(edges) - 2), minlength=len(edges) - 1).tolist()


def apply_task(task: ApplyTask, block: str, index: int, input_index: int) -> dict[str, Any]:
    """One block's decision: the excluded-rows file, the dropped documents' records, the scores, the counters'
    changes and the score histograms per domain (all, kept)."""
    work, out_dir, held_out, method = location(task.folder), location(task.out_dir), task.held_out, task.method
    group_cuts, threshold, edges = task.group_cuts, task.threshold, task.edges
    tokens = read_work_table(token_file(work, block)).select(["id", "domain", "num_tokens"])
    part = read_work_table(block_file(work, FOLDER, block))
    row, score = part.column("row").to_numpy(), part.column("score").to_numpy()
    if threshold is not None:
        keep = score >= threshold
    else:
        groups = np.array(part.column("domain").to_pylist(), dtype=object)
        keep = np.zeros(len(row), dtype=bool)
        for group, cut in (group_cuts or {}).items():
            mine = groups == group
            keep[mine] = cut.keep(np.zeros(int(mine.sum()), np.int64), part.column("rank").to_numpy()[mine], index, row[mine])
    excluded = held_rows(held_out, block, tokens.num_rows).astype(np.int8)
    excluded[row[~keep]] = 1
    write_work_table(block_file(work, f"{FOLDER}/excluded", block), pa.table({"excluded": excluded}))
    sub = tokens.take(pa.array(row, pa.int64()))
    kept_flags = pa.array(keep)
    atomic_write_table(out_dir / "selection" / "scores" / f"{block}.parquet", pa.table(
        {"id": sub.column("id"), "domain": sub.column("domain"), "num_tokens": sub.column("num_tokens"), "score": part.column("score"),
         "kept": kept_flags}), format="parquet", published=True)
    counters = _drops(out_dir, block, input_index, sub.filter(pc.invert(kept_flags)), STAGE_NAMES[method],
                      "below_threshold" if threshold is not None else "below_cut")
    domains, bins = np.array(sub.column("domain").to_pylist(), dtype=object), np.array(edges)
    hist = {d: [_histogram(score[domains == d], bins), _histogram(score[(domains == d) & keep], bins)]
            for d in np.unique(domains).tolist()}
    return {"counters": counters.to_json(), "hist": hist}


def _drops(out_dir: Location, block: str, input_index: int, dropped: pa.Table, stage: str, reason: str) -> Counters:
    """The dropped documents' records (OUT/dropped/model-<block>.parquet) and what they change in the counters."""
    counters = Counters()
    if dropped.num_rows:
        table = counters.selection_drops(input_index, dropped, stage, f"{stage}:{reason}")
        atomic_write_table(out_dir / "dropped" / f"model-{block}.parquet", table, format="parquet", published=True)
    return counters


def _budget(cfg: SelectionConfig, group: str, tokens: int) -> float:
    """A group's token budget: its `domain_tokens` entry (0 when not named), else keep_tokens or keep_fraction of it."""
    if cfg.domain_tokens:
        return cfg.domain_tokens.get(group, 0)
    return cfg.keep_tokens if cfg.keep_tokens is not None else cfg.keep_fraction * tokens


def select_by_model(run_tasks: RunTasks, plan: Plan, blocks: list[tuple[str, int]], totals: dict[str, list[int]],
                    counters: Counters, held_out: RowCopies | None) -> tuple[RowCopies, dict[str, Any]]:
    """The rows not for training after selection by a model (the plan's `selection`; those held out before
    included) and a report for the stats. `totals`: training [documents, tokens] per domain. Updates `counters`."""
    work, out_dir, segment, cfg = plan.work, plan.out, plan.segments[-1].name, plan.cfg.selection
    task_bytes = task_memory(plan, "block")  # a block task's memory
    names = [b for b, _ in blocks]
    unknown = sorted(set(cfg.domain_tokens) - set(totals))
    if unknown:
        raise ConfigError(f"selection.domain_tokens names domains the corpus has no training documents of: {unknown}; "
                          f"its domains are {sorted(totals)}")
    fitted = fit_model(run_tasks, plan, names, sum(n for n, _ in totals.values()), held_out)
    scored = run_tasks(score_task, ScoreTask(str(work), segment, held_out, cfg.per_domain or bool(cfg.domain_tokens),
                                             fitted["sha256"]),
                       [(b,) for b in names],
                       "selection score", record=record_in(FOLDER, "score", first_item_only=True),
                       memory=task_bytes + fasttext_bytes(cfg))
    group_cuts, report = None, {}
    if cfg.threshold is None:
        by_domain = cfg.per_domain or bool(cfg.domain_tokens)
        group_tokens = {d: k for d, (_, k) in totals.items()} if by_domain else {ALL: sum(k for _, k in totals.values())}
        # fill: every arm of a comparison holds its whole budget, however long the document at the cut
        wanted = {g: _budget(cfg, g, k) for g, k in group_tokens.items() if k > 0}
        budgets = {g: Budget(float(b), by_tokens=True, fill=True) for g, b in wanted.items() if b > 0}  # none: keeps none
        group_cuts, report, kept_tokens = cuts(run_tasks, work, FOLDER, names, budgets, held_out)
        for g, entry in report.items():
            entry.update(budget_tokens=budgets[g].value, tokens_in=group_tokens[g], tokens_kept=kept_tokens[g])
    edges = np.array(fitted["edges"], np.float64)
    edges[0], edges[-1] = -np.inf, np.inf  # the outer bins take the tails
    items = [(b, i, input_index) for i, (b, input_index) in enumerate(blocks)]
    apply = ApplyTask(str(work), held_out, str(out_dir), cfg.method, group_cuts, cfg.threshold, tuple(edges.tolist()))
    results = run_tasks(apply_task, apply, items, "selection apply", record=record_in(FOLDER, "apply", first_item_only=True))
    histograms: dict[str, list[np.ndarray]] = {}
    for r in results:
        counters.merge(Counters.from_json(r["counters"]))
        for d, (all_, kept) in r["hist"].items():
            h = histograms.setdefault(d, [np.zeros(HIST_BINS, np.int64), np.zeros(HIST_BINS, np.int64)])
            h[0] += all_
            h[1] += kept
    summary = {"method": cfg.method, "stage": STAGE_NAMES[cfg.method], "groups": report,
               # what selection cost, charged to the data by `datapipe experiment` (flops_with_scoring)
               "flops": fitted["fit_flops"] + sum(r["flops"] for r in scored),
               "cpu_seconds": round(fitted["fit_cpu_seconds"] + sum(r["cpu_seconds"] for r in scored), 3),
               "histogram": {"edges": [round(float(e), 6) for e in edges[1:-1]],
                             "domains": {d: {"all": h[0].tolist(), "kept": h[1].tolist()} for d, h in sorted(histograms.items())}}}
    return RowCopies(str(work / FOLDER / "excluded"), "excluded"), summary
