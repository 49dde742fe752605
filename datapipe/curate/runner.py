"""The curation runner: turns a config into phases of tasks and runs them on an executor.

Phases, each a set of independent tasks whose outputs are files in `OUT/work/`:

1. read       one task per input unit (a file, or a slice of a dataset/folder): parse, quarantine
              what cannot be read, cut the documents into blocks of `read.block_bytes` of text
              (`auto`: sized from the input files' bytes, `resolve_block_bytes`), normalize them and
              write each block once (`blocks.py`: later phases write views, not the text); while an
              embedded Ray starts (3-4 s here) the driver reads the first units itself (`_EarlyReader`);
   unique ids one task per hash partition of the ids: a later document with a taken id `x` is
              renamed `x#2`, ... in input order (`unique_ids.py`), applied as segment 0 reads;
2. segments   one task per block: the map stages (language id, filters, ...) up to the next global
              stage (`stages.base.GlobalStage`), whose map half emits keys into hash partitions
              (one shuffle file per block and kind, `work/<stage>/<kind>/<block>.shuffle`);
   resolve    the global stage's resolve half, with its own tasks (exact dedup: one per partition;
              near dedup: shuffles and connected-components rounds) decides the losers over all
              its keys; one task per losers file cuts them by input unit (`split_losers_task`), one
              task per group of units gathers the group's into one file (`gather_losers_task`),
              and the next segment's task reads its unit's range and drops them first (so exact dedup is
              global across every file, worker and node, and its winner is the first document in
              input order);
3. tokenizer  trained once on a deterministic sample of the kept text, taken by one task per block (or loaded);
4. tokenize   one task per block (each worker process builds the tokenizer once: `_tokenize_stage`);
   eval split (`eval.enabled`) held-out documents chosen by a seeded hash of their id, and their
              exact and near copies dropped from training (`datapipe/curate/eval_split.py`);
   select     diversity sampling and the mixture over the training documents (`selection.py`);
5. shards     rows cut into shards of `output.shard_bytes` in input order, one task per shard
              (`auto`: sized from the token bytes to write; `plan_shards`: tasks sum and cut the blocks'
              rows, the driver adds up one number per block and hands each shard task row ranges)
              (and the eval split's into OUT/eval/shards/);
6. manifest.json and stats.json, written last; then work/ is deleted (unless `output.keep_work`) and
   stats.json rewritten with that clean-up's seconds: its `phase_seconds` add up to the whole run.

Memory is bounded by blocks and partitions, not by the corpus: every per-document decision is made in
a task over a block or a partition, and the driver holds per-block, per-partition and per-shard
summaries only (scripts/bench_driver_memory.py measures it), and, while an embedded Ray starts, what
one read task holds.

Every task writes its outputs atomically, then a small `.json` record of its counters: a rerun
finds that record and skips the task, so a killed run resumes where it stopped and, since every
task is deterministic, produces the same shards (same checksums) as an uninterrupted one. The
output folder's `run.json` says which run that is (the config, each input file's fingerprint, a loaded
tokenizer's sha256, the work layout: `_check_output`); a rerun that is not the same run is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from datapipe.curate.config import (
    TASK_BYTES_PER_TEXT_BYTE, CurateConfig, auto_block_bytes, auto_partitions, auto_shard_bytes, config_hash, diff_configs, result_affecting, work_layout,
    layout_conflict,
)
from datapipe.core.config import ConfigError, RunStopped
from datapipe.curate.counters import Counters
from datapipe.curate.executors import Executor, make_executor, ray_address, ray_is_running
from datapipe.curate.readers import InputUnit, estimated_text_bytes, input_fingerprints, plan_units, read_unit
from datapipe.core.schema import DOC_SCHEMA, DROPPED_SCHEMA, ROW_BITS
from datapipe.core.storage import (
    Location, RemotePath, absolute, check_reachable, is_url, location, make_local_folder, reachable, remove_tree,
)
from datapipe.core.shards import (
    ShardInfo,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_table,
    replacing,
    build_manifest,
    make_folder,
    remove_temporaries,
    shard_schema,
    write_manifest,
    write_shard,
)
from datapipe.core.workfiles import DamagedWorkFile, read_record, read_work_table, write_record, write_work_table
from datapipe.core.shuffle import SUFFIX as SHUFFLE_SUFFIX, read_shuffle, shuffle_files, write_shuffle
from stages.base import LOSER_SCHEMA, FilterStage, GlobalStage, Stage, write_keys
from datapipe.curate.near_dedup import NearDedupStage
from datapipe.curate import eval_split, selection, unique_ids
from datapipe.curate.blocks import READ, block_documents, write_view
from datapipe.curate.selection import RowCopies
from stages.exact_dedup import ExactDedupStage
from stages.langid import LangIdStage
from stages.minhash import MinHashStage
from stages.normalize import NormalizeStage
from stages.quality import build_filters
from stages.tokenize import TokenizeStage, TokenizerConfig, choose_encoder, describe, token_dtype, train_tokenizer

RUN_RECORD = "run.json"
WORK_COMPRESSION = "zstd"  # text and token blocks in work/: ~4x smaller text for ~0.3 CPU-s per 100 MB written


class RunConflict(ConfigError):
    """The output folder holds a run made with a different config or different inputs."""


@dataclass
class Segment:
    """Map stages run back to back on a block, then (optionally) a global stage's key emission.
    `name` names its folder in work/; `title` names it to the user (progress lines, phase seconds)."""

    name: str
    stages: list[Stage]
    global_stage: GlobalStage | None = None
    title: str = ""


@dataclass
class Plan:
    cfg: CurateConfig
    out_dir: str  # absolute, or a URL
    units: list[InputUnit]
    segments: list[Segment]
    cwd: str  # the driver's working folder: relative input paths mean the same on every worker
    read_stages: list[Stage] = dataclasses.field(default_factory=list)  # rewrite the text before it is written

    @property
    def out(self) -> Path | RemotePath:
        """The output folder: a local Path, or a RemotePath for a URL (`datapipe.core.storage`)."""
        return location(self.out_dir)

    @property
    def work(self) -> Path | RemotePath:
        return self.out / "work"


@dataclass
class CurateResult:
    out_dir: str
    manifest: dict[str, Any]
    stats: dict[str, Any]
    seconds: float
    resumed_tasks: int = 0
    reused: bool = False  # the folder already held this run, finished: nothing was done


def build_segments(cfg: CurateConfig, extra_stages: list[Stage | GlobalStage] = ()) -> list[Segment]:
    """The stage list in pipeline order, cut after each global stage. Later stages (language id,
    sampling, mixture) slot in here."""
    per_domain, default = build_filters(cfg.filters)
    pipeline: list[Any] = []  # normalize runs in the read task (`Plan.read_stages`): it rewrites the text
    if cfg.dedup.exact.enabled:
        pipeline.append(ExactDedupStage(cfg.dedup.exact))
    if cfg.langid.enabled:
        pipeline.append(LangIdStage(cfg.langid, keep_text=cfg.output.keep_dropped_text))
    pipeline += [FilterStage(per_domain, default, keep_text=cfg.output.keep_dropped_text), *extra_stages]
    if cfg.dedup.minhash.enabled:
        pipeline.append(NearDedupStage(cfg.dedup.minhash))
    segments = [Segment("seg0", [])]
    for stage in pipeline:
        if isinstance(stage, GlobalStage):  # a global stage closes its segment
            segments[-1].global_stage = stage
            segments.append(Segment(f"seg{len(segments)}", []))
        else:
            segments[-1].stages.append(stage)
    for previous, seg in zip([None, *segments], segments):
        # By the stages' own names, as in stats.json's funnel: "filters+minhash" (its global stage's
        # keys are computed here), or "minhash drop" for a segment that only drops a global stage's losers.
        names = [s.name for s in seg.stages] + ([seg.global_stage.name] if seg.global_stage else [])
        seg.title = "+".join(names) if names else f"{previous.global_stage.name} drop" if previous else "copy"
    return segments


def resolve_block_bytes(cfg: CurateConfig, units: list[InputUnit]) -> CurateConfig:
    """`cfg` with `read.block_bytes: auto` replaced by a number of bytes and the shuffles' `partitions: auto`
    by a count, sized from the input files (their sizes only, so the same inputs always give the same blocks
    and partitions, on any number of workers)."""
    auto = [cfg.read.block_bytes, cfg.dedup.exact.partitions, cfg.dedup.minhash.partitions]
    if "auto" not in auto:
        return cfg
    text_bytes = estimated_text_bytes(input_fingerprints(units, list(cfg.inputs)))
    budget = int(cfg.ray.task_memory_gib * 2**30)
    if cfg.read.block_bytes == "auto":
        cfg = dataclasses.replace(cfg, read=dataclasses.replace(cfg.read, block_bytes=auto_block_bytes(text_bytes)))
    dedup = cfg.dedup
    if dedup.exact.partitions == "auto":
        dedup = dataclasses.replace(dedup, exact=dataclasses.replace(dedup.exact, partitions=auto_partitions(text_bytes, "exact", budget)))
    if dedup.minhash.partitions == "auto":
        dedup = dataclasses.replace(dedup, minhash=dataclasses.replace(dedup.minhash, partitions=auto_partitions(text_bytes, "minhash", budget)))
    return dataclasses.replace(cfg, dedup=dedup)


# ---------------------------------------------------------------- block naming and task records


def block_name(unit: int, block: int) -> str:
    return f"u{unit:06d}-b{block:05d}"


def _records(folder: Path | RemotePath, pattern: str) -> int:
    """How many task records matching `pattern` `folder` holds (one listing): work a resumed run reuses."""
    return sum(1 for _ in folder.glob(pattern))


def _text_bytes(batch: pa.RecordBatch | pa.Table) -> int:
    return int(pc.sum(pc.binary_length(batch.column("text"))).as_py() or 0) if batch.num_rows else 0


def _write_dropped(plan: Plan, stage_name: str, block: str, parts: list[pa.RecordBatch]) -> None:
    parts = [p for p in parts if p.num_rows]
    if parts:
        table = pa.Table.from_batches(parts, schema=DROPPED_SCHEMA)
        atomic_write_table(plan.out / "dropped" / f"{stage_name}-{block}.parquet", table, format="parquet")


# ---------------------------------------------------------------- phase 1: read


def read_task(plan: Plan, unit_index: int) -> dict[str, Any]:
    record = plan.work / "read" / f"u{unit_index:06d}.json"
    if (done := read_record(record)) is not None:
        return done
    unit = plan.units[unit_index]
    inp = plan.cfg.inputs[unit.input_index]
    # A URL input needs no working folder (the driver's may not exist on this node).
    with _working_dir(plan.cwd) if not is_url(inp.path) else contextlib.nullcontext():
        return _read(plan, unit_index, unit, inp, record)


@contextlib.contextmanager
def _working_dir(path: str) -> Iterator[None]:
    # Safe in a worker: a Ray worker process runs one task at a time. The driver (`_EarlyReader`) is there already.
    before = os.getcwd()
    if before == path:
        yield
        return
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


class _QuarantineWriter:
    """The quarantine file of one unit, written as records come in batches of ~1 MiB (not held for the
    whole unit) to a temporary name, and renamed to `path` when the unit is done, so its content and
    name are what one write at the end gave (none when nothing was quarantined) and a killed run
    leaves no half file under the real name (`remove_temporaries` clears the temporary)."""

    FLUSH_BYTES = 1 << 20

    def __init__(self, path: Path | RemotePath) -> None:
        self.path = path
        self.buffer: list[bytes] = []
        self.buffered = 0
        self.file: Any = None  # opened at the first flush: no file when nothing is quarantined
        self.stack = contextlib.ExitStack()

    def write(self, line: bytes) -> None:
        self.buffer.append(line)
        self.buffered += len(line)
        if self.buffered >= self.FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self.file is None:
            tmp = self.stack.enter_context(replacing(self.path, False))
            self.file = self.stack.enter_context(tmp.open("wb"))
        self.file.write(b"".join(self.buffer))
        self.buffer, self.buffered = [], 0

    def __enter__(self) -> "_QuarantineWriter":
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is None and self.buffer:
            try:
                self._flush()
            except BaseException as error:
                if not self.stack.__exit__(type(error), error, error.__traceback__):
                    raise
                return
        # Closes the file, then renames the temporary to `path` (or, after an error, removes it).
        self.stack.__exit__(kind, exc, tb)


def _run_stages(plan: Plan, stages: list[Stage], table: pa.Table, counters: Counters, dropped_parts: list[pa.RecordBatch]) -> pa.Table:
    """Map stages back to back over `table`'s batches: the documents they keep; their drops are counted
    and added to `dropped_parts`."""
    out_batches = []
    for batch in table.to_batches(max_chunksize=plan.cfg.read.batch_size):
        for stage in stages:
            result = stage(batch)
            counters.count_stage(stage.name, batch, result.kept)
            dropped_parts.append(result.dropped)
            batch = result.kept
        out_batches.append(batch)
    return pa.Table.from_batches(out_batches, schema=DOC_SCHEMA)


def _run_read_stages(plan: Plan, table: pa.Table, name: str, input_index: int, counters: Counters) -> pa.Table:
    """The stages that rewrite the text (normalize), run on a block before it is written, so that the
    text is written once (`datapipe.curate.blocks`); their drops are written and counted like any stage's."""
    if not plan.read_stages:
        return table
    dropped_parts: list[pa.RecordBatch] = []
    table = _run_stages(plan, plan.read_stages, table, counters, dropped_parts)
    for part in dropped_parts:
        counters.count_dropped(input_index, part)
    _write_dropped(plan, READ, name, dropped_parts)
    return table


def _write_block(plan: Plan, name: str, table: pa.Table, input_index: int) -> Counters:
    """A parsed block's keys for the renames, its read stages (normalize) and its one written copy; the counts of
    what the read stages dropped."""
    counters = Counters()
    # every parsed document takes part in the renames; the shuffle is as wide as exact dedup's
    unique_ids.write_keys(plan.work, name, table, plan.cfg.dedup.exact.partitions)
    table = _run_read_stages(plan, table, name, input_index, counters)
    # the one copy of the text (`blocks`), compressed: read by a few phases, kept until the run ends
    write_work_table(plan.work / READ / f"{name}.arrow", table, compression=WORK_COMPRESSION)
    return counters


def _read(plan: Plan, unit_index: int, unit: InputUnit, inp: Any, record: Path) -> dict[str, Any]:
    counters = Counters()
    quarantine = _QuarantineWriter(plan.out / "quarantine" / f"u{unit_index:06d}.jsonl")
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    blocks = 0
    # A block is normalized and written on a second thread while the next one is parsed: parsing holds the GIL
    # (Python's line loop, orjson), normalizing (RE2) and writing (zstd) mostly do not. One block in flight.
    writer = ThreadPoolExecutor(1, thread_name_prefix="datapipe-write-block")
    writing: Future[Counters] | None = None

    def flush() -> None:
        nonlocal pending, pending_bytes, blocks, writing
        table = pa.Table.from_batches(pending, schema=DOC_SCHEMA)
        if writing is not None:
            counters.merge(writing.result())
        writing = writer.submit(_write_block, plan, block_name(unit_index, blocks), table, unit.input_index)
        blocks += 1
        pending, pending_bytes = [], 0

    # Files cut or corrupt part-way, one entry each (stats.json names them): the last line before the
    # first damage, that damage, and how many records each kind of damage set aside.
    damaged: dict[str, dict[str, Any]] = {}
    with writer, quarantine:  # the quarantine renamed into place only when the whole unit was read
        for batch, quarantined in read_unit(unit, unit_index, inp, plan.cfg.read):
            counters.read[unit.input_index] += batch.num_rows + len(quarantined)
            for q in quarantined:
                counters.quarantined[(unit.input_index, q.reason)] += 1
                if q.reason in ("truncated_input", "corrupt_input"):
                    entry = damaged.setdefault(q.file, {"file": q.file, "input": unit.input_index, "last_good_line": q.line - 1,
                                                        "detail": q.detail, "quarantined": {}})
                    entry["quarantined"][q.reason] = entry["quarantined"].get(q.reason, 0) + 1
                quarantine.write(orjson.dumps(dataclasses.asdict(q)) + b"\n")
            if batch.num_rows:
                counters.count_stage("read", batch, batch)
                # Cut blocks at document granularity, so parallelism does not hinge on the batch size.
                start = 0
                for row, n in enumerate(pc.binary_length(batch.column("text")).to_numpy()):
                    pending_bytes += int(n)
                    if pending_bytes >= plan.cfg.read.block_bytes:
                        pending.append(batch.slice(start, row + 1 - start))
                        flush()
                        start = row + 1
                if start < batch.num_rows:
                    pending.append(batch.slice(start))
        if pending:
            flush()
        if writing is not None:
            counters.merge(writing.result())
    result = {"blocks": blocks, "counters": counters.to_json(), "damaged": list(damaged.values())}
    write_record(record, result)
    return result


class _EarlyReader(threading.Thread):
    """Reads input units in this process, in order, while an embedded Ray starts in the main thread (most of
    `ray.init` is waiting for its daemons): the read, a single task on a single-file corpus, then costs no
    wall time. `stop()` returns how many units it took; it finishes the one it is in, and Ray's tasks read the
    rest. Output does not depend on which process read a unit (`read_task` is deterministic and resumable)."""

    def __init__(self, plan: Plan) -> None:
        super().__init__(name="datapipe-early-read", daemon=True)
        self.plan = plan
        self.results: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._claimed = 0
        self._lock = threading.Lock()

    def run(self) -> None:
        while True:
            with self._lock:
                if self._stopping.is_set() or self._claimed == len(self.plan.units):
                    return
                unit = self._claimed
                self._claimed += 1
            try:
                self.results.append(read_task(self.plan, unit))
            except BaseException as exc:  # noqa: BLE001 - raised in the main thread by `finish`
                self.error = exc
                return

    def stop(self) -> int:
        """Take no further unit; how many were taken (the last may still be being read: `finish`)."""
        with self._lock:
            self._stopping.set()
            return self._claimed

    def wind_down(self, interrupted: bool) -> None:
        """At the run's end or failure: nothing of it goes on writing after it returns, but for an interrupt (^C),
        which does not wait for the unit being read (this is a daemon thread; what it writes is atomic)."""
        self.stop()
        if not interrupted:
            self.join()

    def finish(self) -> list[dict[str, Any]]:
        """The taken units' results, in unit order, once they are read (or the error one of them raised)."""
        self.join()
        if self.error is not None:
            raise self.error
        return self.results


# ---------------------------------------------------------------- phase 2: segments and global resolves


def _apply_losers(table: pa.Table, losers: pa.Table, stage: str, keep_text: bool) -> tuple[pa.Table, pa.RecordBatch | None]:
    """Drop the rows a global stage decided against (matched by global order)."""
    if losers.num_rows == 0 or table.num_rows == 0:
        return table, None
    lose = pc.is_in(table.column("order"), value_set=losers.column("order"))
    if not pc.any(lose).as_py():
        return table, None
    gone = table.filter(lose)
    kept = table.filter(pc.invert(lose))
    where = pc.index_in(gone.column("order"), value_set=losers.column("order"))
    n = gone.num_rows
    dropped = pa.RecordBatch.from_arrays(
        [
            gone.column("id").combine_chunks(),
            gone.column("domain").combine_chunks(),
            gone.column("order").combine_chunks(),
            pa.array([stage] * n, pa.string()),
            losers.column("reason").take(where).combine_chunks(),
            losers.column("kept_id").take(where).combine_chunks(),
            gone.column("text").combine_chunks() if keep_text else pa.nulls(n, pa.large_string()),
        ],
        schema=DROPPED_SCHEMA,
    )
    return kept, dropped


def segment_task(plan: Plan, seg_index: int, unit_index: int, block: int) -> dict[str, Any]:
    seg = plan.segments[seg_index]
    name = block_name(unit_index, block)
    record = plan.work / seg.name / f"{name}.json"
    if (done := read_record(record)) is not None:
        return done
    previous = plan.segments[seg_index - 1].global_stage if seg_index > 0 else None
    losers = _unit_losers(plan.work / previous.name, unit_index, len(plan.units)) if previous is not None else None
    input_index = plan.units[unit_index].input_index
    table = block_documents(plan.work, READ if seg_index == 0 else plan.segments[seg_index - 1].name, name)
    if seg_index == 0:  # ids made unique before any stage sees them (datapipe/curate/unique_ids.py)
        table = unique_ids.apply(plan.work, unit_index, table)
    counters = Counters()
    dropped_parts: list[pa.RecordBatch] = []
    keep_text = plan.cfg.output.keep_dropped_text

    if losers is not None:
        prev = plan.segments[seg_index - 1].global_stage.name
        before = table
        table, dropped = _apply_losers(table, losers, prev, keep_text)
        counters.count_stage(prev, before, table)
        if dropped is not None:
            dropped_parts.append(dropped)

    out = _run_stages(plan, seg.stages, table, counters, dropped_parts)
    for part in dropped_parts:
        counters.count_dropped(input_index, part)
    _write_dropped(plan, seg.name, name, dropped_parts)
    if seg.global_stage is not None:  # its map half: keys into one shuffle file per kind, work/<stage>/<kind>/<block>
        write_keys(seg.global_stage, out, plan.work / seg.global_stage.name, name)
    write_view(plan.work, seg.name, name, out)  # what it kept, not the text again
    result = {"rows": out.num_rows, "bytes": _text_bytes(out), "counters": counters.to_json()}
    write_record(record, result)
    return result


LOSERS_BY_UNIT = "losers-by-unit"  # work/<global stage>/losers-by-unit/losers-tNNN.shuffle, partitioned by input unit


def split_losers_task(shared: tuple[str, int], file_name: str) -> int:
    """Cut one losers file of a global stage (`folder/losers-tNNN.arrow`) by input unit: one shuffle file
    `folder/losers-by-unit/losers-tNNN.shuffle` whose partition u holds unit u's losers, so that each block
    task reads its own unit's losers (a range of each file) and no process holds them all; the number of losers."""
    folder, units = shared
    root = location(folder)
    stem = file_name.removesuffix(".arrow")
    record = root / LOSERS_BY_UNIT / f"{stem}.json"
    if (done := read_record(record)) is not None:
        return done["losers"]
    losers = read_work_table(root / file_name).sort_by([("order", "ascending")])
    unit = (losers.column("order").to_numpy() >> ROW_BITS).astype(np.int64)
    write_shuffle(root / LOSERS_BY_UNIT / f"{stem}{SHUFFLE_SUFFIX}", losers, unit, units)
    write_record(record, {"losers": losers.num_rows})
    return losers.num_rows


UNIT_GROUPS = 256  # the losers of at most this many groups of input units: one file each (`gather_losers_task`)


def _unit_group(units: int) -> int:
    """Input units per group: contiguous ranges, so a group's units are adjacent partitions of every file."""
    return -(-units // min(units, UNIT_GROUPS))


def _unit_range(group: int, units: int) -> tuple[int, int]:
    """The input units [u0, u1) of a group."""
    size = _unit_group(units)
    return group * size, min(units, (group + 1) * size)


def gather_losers_task(shared: tuple[str, int, int], group: int) -> int:
    """The losers of one group of input units, from the group's range of every losers file's shuffle (one
    read each: its units are adjacent partitions) into one file `losers-by-unit/gNNNNN.shuffle`,
    partitioned by the unit within the group. So each block task reads one range of one file, not a range
    of every losers file (blocks x partitions requests at scale); the number of losers."""
    folder, tasks, units = shared
    root = location(folder) / LOSERS_BY_UNIT
    out = root / f"g{group:05d}{SHUFFLE_SUFFIX}"
    if out.exists():  # written whole (one PUT, or a rename): its existence is its record
        return -1
    u0, u1 = _unit_range(group, units)
    files = shuffle_files(root, [f"losers-t{t:03d}" for t in range(tasks)])
    losers = read_shuffle(files, u0, units, LOSER_SCHEMA, through=u1, partition_column="unit").sort_by([("order", "ascending")])
    unit = losers.column("unit").to_numpy().astype(np.int64) - u0
    write_shuffle(out, losers.drop(["unit"]), unit, u1 - u0)
    return losers.num_rows


def _unit_losers(folder: Path | RemotePath, unit_index: int, units: int) -> pa.Table:
    """The losers of input unit `unit_index`: its range of its group's file (`gather_losers_task`)."""
    group = unit_index // _unit_group(units)
    u0, u1 = _unit_range(group, units)
    return read_shuffle([folder / LOSERS_BY_UNIT / f"g{group:05d}{SHUFFLE_SUFFIX}"], unit_index - u0, u1 - u0, LOSER_SCHEMA)


# ---------------------------------------------------------------- phase 3: tokenizer


def sample_task(plan: Plan, unit: int, block: int, rate: float) -> list[str]:
    """The block's part of the tokenizer's training sample: the kept documents whose id hashes below `rate`."""
    threshold = int(rate * 2**64)
    table = block_documents(plan.work, plan.segments[-1].name, block_name(unit, block), ["id", "text"])
    return [text for doc_id, text in zip(table.column("id").to_pylist(), table.column("text").to_pylist())
            if rate >= 1.0 or xxhash.xxh64_intdigest(doc_id.encode()) < threshold]


def prepare_tokenizer(plan: Plan, blocks: list[tuple[int, int]], kept_bytes: int, run_tasks: Callable[..., list[Any]]) -> tuple[str, str]:
    """(absolute path of the tokenizer.json, the path the manifest records). Trains one when the
    config names none, on a deterministic sample of the kept text (about `sample_bytes`), taken by
    one task per block (`sample_task`)."""
    tcfg = plan.cfg.tokenizer
    if tcfg.path is not None:
        return (tcfg.path if is_url(tcfg.path) else os.path.join(plan.cwd, tcfg.path)), tcfg.path
    saved = plan.out / "tokenizer.json"
    if not saved.exists():
        if kept_bytes == 0:
            raise RuntimeError("no document survived curation: there is no text to train a tokenizer on")
        rate = min(1.0, tcfg.train.sample_bytes / kept_bytes)
        parts = run_tasks(sample_task, plan, [(u, b, rate) for u, b in blocks], "tokenizer sample")
        tokenizer = train_tokenizer((text for part in parts for text in part), tcfg)
        atomic_write_bytes(saved, tokenizer.to_str().encode(), durable=True)
    if tcfg.train.save_dir:
        text = saved.read_text()
        target = Path(plan.cwd) / tcfg.train.save_dir / "tokenizer.json"
        if not target.exists() or target.read_text() != text:
            atomic_write_bytes(target, text.encode())
    return str(saved), "tokenizer.json"


# ---------------------------------------------------------------- phase 4: tokenize


@functools.lru_cache(maxsize=1)
def _tokenize_stage(tokenizer_text: str, cfg: TokenizerConfig, tokenizer_path: str) -> TokenizeStage:
    """One tokenizer per worker process, built by its first tokenize task and reused by the next ones (Ray
    reuses a worker for the tasks of a phase: no actor processes to start, ~1.5 s each here)."""
    return TokenizeStage(tokenizer_text, cfg, tokenizer_path)


def tokenize_task(shared: tuple[Plan, str], unit_index: int, block: int) -> dict[str, Any]:
    """Encode one block's kept documents into its token file (and its lengths file, for shard planning)."""
    plan, tokenizer_path = shared
    name = block_name(unit_index, block)
    record = plan.work / "tokens" / f"{name}.json"
    if (done := read_record(record)) is not None:
        return done
    stage = _tokenize_stage(location(tokenizer_path).read_text(), plan.cfg.tokenizer, tokenizer_path)
    table = block_documents(plan.work, plan.segments[-1].name, name)
    batches = [
        stage(b).append_column("lang", b.column("lang"))
        for b in table.to_batches(max_chunksize=plan.cfg.read.batch_size)
        if b.num_rows
    ]
    schema = shard_schema(stage.dtype)
    tokens = pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()
    write_work_table(plan.work / "tokens" / f"{name}.arrow", tokens, compression=WORK_COMPRESSION)
    # the row lengths alone, for shard planning (`plan_shards`'s tasks): 8 bytes a row
    write_work_table(plan.work / "lengths" / f"{name}.arrow", tokens.select(["num_tokens"]))
    counters = Counters()
    input_index = plan.units[unit_index].input_index
    if tokens.num_rows:
        grouped = tokens.group_by("domain").aggregate([("num_tokens", "sum"), ("num_tokens", "count")])
        for row in grouped.to_pylist():
            counters.kept[(input_index, row["domain"])] = [row["num_tokens_count"], row["num_tokens_sum"]]
    result = {"rows": tokens.num_rows, "counters": counters.to_json(), "encoder": stage.encoder}
    write_record(record, result)
    return result


# ---------------------------------------------------------------- phase 5: shards


def _lengths(plan: Plan, name: str) -> np.ndarray:
    """Token count of every row of one token block (its small `lengths/` file; the token file's column
    for a block tokenized before those files were written)."""
    small = plan.work / "lengths" / f"{name}.arrow"
    table = read_work_table(small if small.exists() else plan.work / "tokens" / f"{name}.arrow")
    return table.column("num_tokens").to_numpy()


# A piece of a shard: (block, pass, start, stop): rows start..stop-1 of the block's rows written in that
# pass (every row without copies; else the rows whose copies exceed the pass number).
Piece = tuple[str, int, int, int]


PLAN_GROUP = 256  # blocks per shard-planning task: each task gets enough files to be worth its overhead


def _pass_bytes(plan: Plan, name: str, itemsize: int, copies: RowCopies | None) -> list[np.ndarray]:
    """Token bytes of the rows of each pass of a block (every row without copies; else the rows whose
    copies exceed the pass number)."""
    sizes = _lengths(plan, name).astype(np.int64) * itemsize
    if copies is None:
        return [sizes]
    count = copies.of(name)
    return [sizes[count > k] for k in range(copies.passes)]


def block_bytes_task(shared: tuple[Plan, int, RowCopies | None], names: list[str]) -> list[list[int]]:
    """Per block of `names`: the token bytes of each pass (a summary; the rows stay in the task)."""
    plan, itemsize, copies = shared
    return [[int(x.sum()) for x in _pass_bytes(plan, name, itemsize, copies)] for name in names]


def cut_task(shared: tuple[Plan, int, RowCopies | None, int], pieces: list[tuple[str, int, int]]) -> list[tuple[int, Piece]]:
    """For each (block, pass, byte offset of its first row in the whole output): the block's rows cut by
    shard, a row going to shard `offset of its first byte // target`. Returns (shard, piece) pairs."""
    plan, itemsize, copies, target = shared
    out: list[tuple[int, Piece]] = []
    for name, k, offset in pieces:
        sizes = _pass_bytes(plan, name, itemsize, copies)[k]
        starts = offset + np.cumsum(sizes) - sizes
        shard = starts // target
        bounds = np.flatnonzero(np.r_[True, shard[1:] != shard[:-1]]) if len(shard) else np.empty(0, np.int64)
        for a, b in zip(bounds.tolist(), np.r_[bounds[1:], len(shard)].tolist()):
            out.append((int(shard[a]), (name, k, a, b)))
    return out


def plan_shards(plan: Plan, blocks: list[tuple[int, int]], itemsize: int, copies: RowCopies | None = None,
                run_tasks: Callable[..., list[Any]] | None = None) -> list[list[Piece]]:
    """Cut the rows of all blocks, in input order, into shards of about `shard_bytes` token bytes
    (`auto`: `auto_shard_bytes` of the token bytes these rows hold). With `copies` (from selection), a
    row written k times appears in passes 0..k-1: every pass is the corpus in input order again, so
    repeats of a document land far apart. A row belongs to shard `b // shard_bytes`, b being the
    offset of its first byte in the whole output, so the cut is independent of the worker count.

    No file is read here: tasks over groups of blocks (`run_tasks`, else in this process) sum each
    block's bytes per pass, the driver adds the sums up into each block's offset (a number per block),
    and tasks cut the blocks' rows at the shard boundaries: the driver holds per-block numbers and the
    pieces only."""
    run_tasks = run_tasks or (lambda fn, shared, items, desc: [fn(shared, *item) for item in items])
    names = [block_name(u, b) for u, b in blocks]
    groups = [names[i : i + PLAN_GROUP] for i in range(0, len(names), PLAN_GROUP)]
    per_block = [x for part in run_tasks(block_bytes_task, (plan, itemsize, copies), [(g,) for g in groups], "shards plan")
                 for x in part]
    passes = 1 if copies is None else copies.passes
    totals = np.array(per_block, dtype=np.int64).reshape(len(names), passes) if names else np.zeros((0, passes), np.int64)
    target = plan.cfg.output.shard_bytes
    if target == "auto":
        target = auto_shard_bytes(int(totals.sum()))
    order = totals.T.reshape(-1)  # pass 0's blocks in input order, then pass 1's, ...
    offsets = np.cumsum(order) - order
    items = [(names[i % len(names)], i // len(names), int(offsets[i])) for i in range(len(order)) if order[i] > 0]
    cut = run_tasks(cut_task, (plan, itemsize, copies, max(int(target), 1)),
                    [(items[i : i + PLAN_GROUP],) for i in range(0, len(items), PLAN_GROUP)], "shards cut")
    shards: dict[int, list[Piece]] = {}
    for part in cut:
        for shard, piece in part:
            shards.setdefault(shard, []).append(piece)
    return [shards[s] for s in sorted(shards)]


def _piece_rows(copies: RowCopies | None, name: str, k: int, start: int, stop: int) -> np.ndarray:
    """The rows of a block that a piece (name, k, start, stop) takes."""
    return np.arange(start, stop) if copies is None else np.flatnonzero(copies.of(name) > k)[start:stop]


def _shard_table(plan: Plan, pieces: list[Piece], copies: RowCopies | None) -> pa.Table:
    parts = [read_work_table(plan.work / "tokens" / f"{name}.arrow").take(pa.array(_piece_rows(copies, name, k, start, stop)))
             for name, k, start, stop in pieces]
    return pa.concat_tables(parts)


def shard_task(plan: Plan, index: int, pieces: list[Piece], copies: RowCopies | None = None) -> dict[str, Any]:
    record = plan.work / "shards" / f"shard-{index:05d}.json"
    if (done := read_record(record)) is not None:
        return done
    info = write_shard(plan.out_dir, index, _shard_table(plan, pieces, copies))
    result = dataclasses.asdict(info)
    write_record(record, result)
    return result


def eval_shard_task(plan: Plan, index: int, pieces: list[Piece], copies: RowCopies | None = None) -> dict[str, Any]:
    """One shard of the eval split, into OUT/eval/shards/."""
    record = plan.work / eval_split.EVAL_DIR / "shards" / f"shard-{index:05d}.json"
    if (done := read_record(record)) is not None:
        return done
    info = write_shard(plan.out / eval_split.EVAL_DIR, index, _shard_table(plan, pieces, copies))
    result = dataclasses.asdict(info)
    write_record(record, result)
    return result


def write_eval_manifest(plan: Plan, shards: list[ShardInfo], info: Any) -> dict[str, Any]:
    """OUT/eval/manifest.json: a curated folder of its own (written before the main manifest)."""
    tokenizer = dataclasses.asdict(info)
    if tokenizer["path"] == "tokenizer.json":  # trained into OUT/: relative to the eval folder it is one up
        tokenizer["path"] = "../tokenizer.json"
    manifest = build_manifest(shards, tokenizer=tokenizer, config=result_affecting(plan.cfg), config_hash=config_hash(plan.cfg))
    manifest["split"] = {"name": "eval", "of": ".."}
    write_manifest(plan.out / eval_split.EVAL_DIR, manifest)
    return manifest


# ---------------------------------------------------------------- the whole run


def _run_record(plan: Plan, tokenizer_text: str | None) -> dict[str, Any]:
    """The run's identity, kept in OUT/run.json: what decides the output (the config, the input units,
    each input file's fingerprint, the loaded tokenizer's sha256) and the work layout it was started with."""
    record = {
        "config": result_affecting(plan.cfg),
        "config_hash": config_hash(plan.cfg),
        "units": [dataclasses.asdict(u) for u in plan.units],
        "input_files": input_fingerprints(plan.units, list(plan.cfg.inputs)),
        "work_layout": work_layout(plan.cfg),
    }
    if tokenizer_text is not None:
        record["tokenizer_sha256"] = hashlib.sha256(tokenizer_text.encode()).hexdigest()
    return json.loads(json.dumps(record))  # as it reads back from the file (tuples are lists)


def _unit_paths(units: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(f for u in units for f in (u["files"] or [u["path"]])))


def _identity_conflict(plan: Plan, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why the run recorded in `old` is not the run `new` describes, or None when it is."""
    out = plan.out_dir
    if old["config_hash"] != new["config_hash"] or old["units"] != new["units"]:
        diffs = diff_configs(old["config"], new["config"])
        if old["units"] != new["units"]:
            before, now = _unit_paths(old["units"]), _unit_paths(new["units"])
            gone, added = [p for p in before if p not in now], [p for p in now if p not in before]
            detail = "; ".join(
                part for part in (f"no longer found: {gone[:3]}" if gone else "", f"new: {added[:3]}" if added else "") if part
            ) or "the same files, cut into other units (a dataset's row count changed?)"
            diffs.append(f"inputs: the input files differ ({detail})")
        return (f"output folder {out} holds a run made with a different config: " + "; ".join(diffs[:10])
                + ". Use another --output, or delete the folder.")
    old_files = old.get("input_files", {})  # absent in a record written before fingerprints were kept
    for path, fingerprint in new["input_files"].items():
        if path in old_files and old_files[path] != fingerprint:
            was, now = old_files[path], fingerprint
            change = (f"size {was['size']:,} -> {now['size']:,} bytes" if was.get("size") != now.get("size")
                      else "same size, modified since")
            return (f"input file {path!r} changed since the run in output folder {out} started ({change}); "
                    "the work already done there read the old version. Restore the file as it was, or curate "
                    "the new version into another --output (or delete the folder).")
    if "tokenizer_sha256" in old and old["tokenizer_sha256"] != new.get("tokenizer_sha256"):
        return (f"tokenizer.path {plan.cfg.tokenizer.path!r} changed since the run in output folder {out} started "
                f"(sha256 {old['tokenizer_sha256'][:12]}... -> {str(new.get('tokenizer_sha256'))[:12]}...); documents "
                "already tokenized there used the old tokenizer. Restore the file as it was, or use another "
                "--output (or delete the folder).")
    return None


def _check_output(plan: Plan, tokenizer_text: str | None = None) -> dict[str, Any] | None:
    """Refuse an output folder holding another run (another config, other or edited inputs, another
    tokenizer, or, unfinished, another work layout); return its manifest if already complete."""
    out = plan.out
    record = _run_record(plan, tokenizer_text)
    existing = out / RUN_RECORD
    if not existing.exists():
        if out.exists() and any(p.name != "work" for p in out.iterdir()):
            raise RunConflict(f"output folder {plan.out_dir} is not empty and holds no {RUN_RECORD}; use an empty folder")
        atomic_write_json(existing, record)
        return None
    old = json.loads(existing.read_text())
    if (conflict := _identity_conflict(plan, old, record)) is not None:
        raise RunConflict(conflict)
    manifest = out / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())
    if (conflict := layout_conflict(plan.out_dir, old.get("work_layout", {}), record["work_layout"])) is not None:
        raise RunConflict(conflict)
    return None


def _accounting(plan: Plan, total: Counters) -> list[dict[str, Any]]:
    """Per input: read = kept + dropped + quarantined, exactly."""
    rows = []
    for i, inp in enumerate(plan.cfg.inputs):
        dropped: dict[str, dict[str, int]] = {}
        for (ii, stage, _domain, reason), n in total.dropped.items():
            if ii == i:
                dropped.setdefault(stage, {}).setdefault(reason, 0)
                dropped[stage][reason] += n
        quarantined = {r: n for (ii, r), n in total.quarantined.items() if ii == i}
        kept = sum(v[0] for (ii, _), v in total.kept.items() if ii == i)
        read = total.read.get(i, 0)
        n_dropped = sum(sum(r.values()) for r in dropped.values())
        rows.append(
            {
                "input": inp.path,
                "read": read,
                "kept": kept,
                "dropped": dropped,
                "quarantined": quarantined,
                "balanced": read == kept + n_dropped + sum(quarantined.values()),
            }
        )
    return rows


_TASK_BASE_BYTES = 256 * 2**20  # a worker process with its imports
# Bytes a task holds per byte of its block's text, by phase (upper estimates: the text, its batches and copies,
# the stage's arrays: near dedup's signatures, a tokenizer's encodings).
_BLOCK_FACTOR = {"read": 6, "segment": 8, "tokenize": 6}  # read: a block parsed while the one before is written


def _task_memory(plan: Plan, phase: str, text_bytes: int = 0, tasks: int = 1) -> int:
    """About how many bytes one task of `phase` needs, from its input (a block, or a resolve task's share of
    `text_bytes`), never more than `ray.task_memory_gib`: what the executor tells Ray (`memory=`)."""
    budget = int(plan.cfg.ray.task_memory_gib * 2**30)
    if phase == "resolve":
        need = int(TASK_BYTES_PER_TEXT_BYTE["minhash"] * text_bytes / max(tasks, 1))
    else:
        need = _BLOCK_FACTOR[phase] * int(plan.cfg.read.block_bytes)
        if phase == "read":  # one line is held whole up to 6x max_bytes_per_doc (readers.py)
            need += 6 * plan.cfg.read.max_bytes_per_doc
    return min(budget, _TASK_BASE_BYTES + need)


def build_stats(plan: Plan, total: Counters, seconds: float) -> dict[str, Any]:
    stage_order = ["read"] + [s.name for s in plan.read_stages] + [s.name for seg in plan.segments for s in seg.stages + ([seg.global_stage] if seg.global_stage else [])]
    funnel = []
    for stage in stage_order:
        domains = {d: dict(zip(("docs_in", "docs_out", "bytes_in", "bytes_out"), v)) for (s, d), v in sorted(total.funnel.items()) if s == stage}
        if domains:
            funnel.append({"stage": stage, "domains": domains})
    dropped: dict[str, dict[str, dict[str, int]]] = {}
    for (_i, stage, domain, reason), n in sorted(total.dropped.items()):
        d = dropped.setdefault(stage, {}).setdefault(domain, {})
        d[reason] = d.get(reason, 0) + n
    quarantined: dict[str, int] = {}
    for (_i, reason), n in sorted(total.quarantined.items()):
        quarantined[reason] = quarantined.get(reason, 0) + n
    kept: dict[str, dict[str, int]] = {}
    for (_i, domain), (docs, tokens) in sorted(total.kept.items()):
        k = kept.setdefault(domain, {"docs": 0, "tokens": 0})
        k["docs"] += docs
        k["tokens"] += tokens
    return {
        "funnel": funnel,
        "dropped": dropped,
        "quarantined": quarantined,
        "kept": kept,
        "inputs": _accounting(plan, total),
        "seconds": round(seconds, 3),
        "counters": total.to_json(),
    }


class NothingSurvived(RunStopped):
    """No document is left to write: every record was quarantined or dropped (or there were none).
    The message names the funnel; stats.json is written so that `datapipe stats` can show why. The
    CLI prints it without a traceback and exits 1."""


def _remove_folder_task(work: Location, name: str) -> None:
    remove_tree(work / name)


def remove_work(work: Location, run_tasks: Callable[..., list[Any]]) -> None:
    """Delete work/ with one task per entry in it (one listing in the driver: one folder per phase), then what is
    left. At scale work/ holds most of the run's files, and unlinking them one by one was the driver's largest cost
    that grows with the blocks (1.0 of its 1.5 CPU-s outside phases on 736 blocks)."""
    if work.exists():
        run_tasks(_remove_folder_task, work, [(entry.name,) for entry in sorted(work.iterdir())], "clean_up")
    remove_tree(work)


def _nothing_survived(
    plan: Plan, total: Counters, t0: float, damaged: list[dict[str, Any]], id_results: list[dict[str, Any]]
) -> NothingSurvived:
    """Write stats.json (no manifest: the run has no output) and say where the documents went."""
    stats = build_stats(plan, total, time.perf_counter() - t0)
    stats["damaged_inputs"] = damaged
    stats["duplicate_ids"] = unique_ids.summary(id_results)
    stats["nothing_survived"] = True
    atomic_write_json(plan.out / "stats.json", stats, durable=True)
    if not plan.cfg.output.keep_work:
        remove_tree(plan.work)
    read = sum(row["read"] for row in stats["inputs"])
    parts = [f"{read:,} records read from {len(plan.cfg.inputs)} input(s)"]
    if stats["quarantined"]:
        reasons = ", ".join(f"{r} {n:,}" for r, n in sorted(stats["quarantined"].items(), key=lambda kv: -kv[1]))
        parts.append(f"{sum(stats['quarantined'].values()):,} quarantined while reading ({reasons})")
    for stage, by_domain in stats["dropped"].items():
        reasons: dict[str, int] = {}
        for by_reason in by_domain.values():
            for reason, n in by_reason.items():
                reasons[reason] = reasons.get(reason, 0) + n
        top = ", ".join(f"{r} {n:,}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
        parts.append(f"{sum(reasons.values()):,} dropped by {stage} ({top})")
    advice = ("the inputs are empty" if read == 0 else
              "check the inputs (format, text_field) and the filters, then run again into a new output folder")
    return NothingSurvived(
        f"no document survived curation: {'; '.join(parts)}; 0 kept. {advice[0].upper() + advice[1:]}. "
        f"stats.json is written: `datapipe stats {plan.out_dir}` shows the funnel and "
        f"`datapipe stats {plan.out_dir} --why ID` where one record went."
    )


def _recovery(plan: Plan, exc: DamagedWorkFile) -> str:
    """One paragraph: which file, why the run stopped, the command that recovers."""
    work = plan.work
    remove = f"rm -r {work}" if not is_url(str(work)) else f"delete every object under {work}"
    return (f"{exc}. Work files are written without fsync, so a power loss, a full disk or a hand edit can leave one so, "
            f"and the run stopped rather than read it. To recover, {remove} and run the same command again: the run "
            f"redoes its work from the inputs and writes the same output.")


def curate(
    cfg: CurateConfig,
    *,
    executor: Executor | None = None,
    extra_stages: list[Stage | GlobalStage] = (),
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> CurateResult:
    """Run the whole curation pipeline described by `cfg`; see the module docstring."""
    t0 = time.perf_counter()
    # storage that cannot be reached (no credentials, wrong endpoint) is named first, not a reader's traceback
    check_reachable([*((f"inputs[{i}].path", inp.path) for i, inp in enumerate(cfg.inputs)),
                     ("tokenizer.path", cfg.tokenizer.path), ("eval.source", cfg.eval.source if cfg.eval.enabled else None)])
    units = plan_units(list(cfg.inputs))  # a missing or unreadable input fails here, before any work
    if cfg.eval.enabled and cfg.eval.source:
        eval_split.read_source(cfg.eval.source)  # so does a missing or empty eval.source
    cfg = resolve_block_bytes(cfg, units)
    tokenizer_text = None
    if cfg.tokenizer.path is not None:
        try:
            tokenizer_text = location(cfg.tokenizer.path).read_text()
        except OSError as exc:
            raise ConfigError(f"tokenizer.path: cannot read {cfg.tokenizer.path!r}: {exc}") from None
        describe(tokenizer_text, cfg.tokenizer.path, cfg.tokenizer)  # special ids in the vocabulary, ids fit uint32: fail now
        choose_encoder(tokenizer_text, cfg.tokenizer, cfg.tokenizer.path)  # `encoder: fast` that cannot be: fail now
    plan = Plan(
        cfg=cfg,
        out_dir=absolute(cfg.output.dir),
        units=units,
        segments=build_segments(cfg, list(extra_stages)),
        read_stages=[NormalizeStage(cfg.normalize)] if cfg.normalize.enabled else [],
        cwd=os.getcwd(),
    )
    reachable(plan.out_dir, "output.dir")  # a URL without credentials or with a wrong endpoint: an error now
    make_local_folder(plan.out_dir, "output.dir")  # a file in the way, a folder that cannot be made: said as such
    make_folder(plan.out_dir)  # a read-only or full disk: an OutputError naming the folder
    finished = _check_output(plan, tokenizer_text)
    # No writer works in this folder now: temporaries left by a killed or failed run are garbage.
    remove_temporaries(plan.out_dir)
    if finished is not None:
        if not cfg.output.keep_work:  # a run killed between its manifest and this clean-up
            remove_tree(plan.work)
        log(f"{cfg.output.dir} is a finished run of the same config: reusing it (nothing to do)")
        stats = json.loads((plan.out / "stats.json").read_text())
        return CurateResult(plan.out_dir, finished, stats, 0.0, reused=True)

    # A resumed run: the records its phases find already written (one listing each; none on a fresh run), the
    # read's taken before this process reads anything itself.
    reused: dict[str, tuple[int, int]] | None = {} if plan.work.exists() else None

    def reusing(phase: str, folder: str, pattern: str, tasks: int) -> None:
        if reused is not None:
            reused[phase] = (_records(plan.work / folder, pattern), tasks)

    reusing("read", "read", "u??????.json", len(units))
    own_executor = executor is None
    early: _EarlyReader | None = None
    early_units = 0
    if executor is None:
        if ray_address(cfg.ray.address) is None and not ray_is_running():  # an embedded Ray: this machine's cores
            early = _EarlyReader(plan)
            early.start()
        try:
            executor = make_executor("ray", cfg.ray.address, num_cpus=cfg.ray.num_cpus, max_retries=cfg.ray.max_retries,
                                     progress=progress, stall_timeout_s=cfg.ray.stall_timeout_s)
        except BaseException as exc:
            if early is not None:
                early.wind_down(interrupted=isinstance(exc, KeyboardInterrupt))
            raise
        early_units = early.stop() if early is not None else 0
    total = Counters()
    global_summaries: dict[str, Any] = {}
    phases: dict[str, float] = {}
    clock = t0  # every second of the run is in some phase: "start" is planning, checks and starting Ray

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name] = round(phases.get(name, 0.0) + now - clock, 3)
        clock = now

    lap("start")
    interrupted = False
    try:
        read_results = executor.run_tasks(read_task, plan, [(u,) for u in range(early_units, len(units))], "read",
                                          memory=_task_memory(plan, "read"))
        if early is not None:  # the units this process took while Ray started come first
            read_results = early.finish() + read_results
            if progress and early_units:
                print(f"read: {early_units:,} of {len(units):,} units read by this process while Ray started",
                      file=sys.stderr, flush=True)
        lap("read")
        blocks = [(u, b) for u, r in enumerate(read_results) for b in range(r["blocks"])]
        for r in read_results:
            total.merge(Counters.from_json(r["counters"]))
        damaged = [d for r in read_results for d in r.get("damaged", [])]
        n_parts = cfg.dedup.exact.partitions  # the shuffle's width; the renames do not depend on it
        id_partitions = [(p, n_parts) for p in range(n_parts)]
        id_results = executor.run_tasks(unique_ids.resolve, (plan.work, [block_name(u, b) for u, b in blocks]), id_partitions,
                                        "unique_ids")
        lap("unique_ids")

        kept_bytes = kept_docs = 0
        for s, seg in enumerate(plan.segments):
            items = [(s, u, b) for u, b in blocks]
            reusing(seg.title, seg.name, "u??????-b?????.json", len(items))
            results = executor.run_tasks(segment_task, plan, items, seg.title, memory=_task_memory(plan, "segment"))
            for r in results:
                total.merge(Counters.from_json(r["counters"]))
            kept_bytes = sum(r["bytes"] for r in results)
            kept_docs = sum(r["rows"] for r in results)
            lap(seg.title)
            if kept_docs == 0:  # no block or no document left: a global stage has nothing to resolve, later segments nothing to read
                break
            if (stage := seg.global_stage) is not None:  # its resolve half, the same way for every global stage
                senders = [f"{seg.name}/{block_name(u, b)}" for u, b in blocks]  # the map half's blocks
                tasks = stage.tasks(kept_docs)
                sized = functools.partial(executor.run_tasks, memory=_task_memory(plan, "resolve", kept_bytes, tasks))
                global_summaries[stage.name] = stage.resolve(sized, plan.work / stage.name, plan.out, senders, kept_docs)
                loser_files = [f"losers-t{t:03d}.arrow" for t in range(tasks)]  # one per resolve task, always
                executor.run_tasks(split_losers_task, (str(plan.work / stage.name), len(plan.units)), [(f,) for f in loser_files],
                                   f"{stage.name} losers by unit")
                groups = -(-len(plan.units) // _unit_group(len(plan.units)))
                executor.run_tasks(gather_losers_task, (str(plan.work / stage.name), tasks, len(plan.units)),
                                   [(g,) for g in range(groups)], f"{stage.name} losers by unit group")
                lap(f"{stage.name} resolve")

        if kept_docs == 0:
            raise _nothing_survived(plan, total, t0, damaged, id_results)
        tokenizer_path, where = prepare_tokenizer(plan, blocks, kept_bytes, executor.run_tasks)
        info = describe(location(tokenizer_path).read_text(), where, cfg.tokenizer)
        lap("tokenizer")
        reusing("tokenize", "tokens", "u??????-b?????.json", len(blocks))
        token_results = executor.run_tasks(tokenize_task, (plan, tokenizer_path), blocks, "tokenize",
                                           memory=_task_memory(plan, "tokenize"))
        for r in token_results:
            total.merge(Counters.from_json(r["counters"]))
        encoders = sorted({r.get("encoder", "tokenizers") for r in token_results})
        lap("tokenize")

        block_inputs = [(block_name(u, b), plan.units[u].input_index) for u, b in blocks]
        held_out = None
        if cfg.eval.enabled:  # before selection: eval documents are never sampled away nor repeated
            held = eval_split.split(
                executor.run_tasks, plan.work, plan.out, block_inputs, plan.segments[-1].name, cfg.eval,
                cfg.dedup.minhash, next((seg.name for seg in plan.segments if isinstance(seg.global_stage, MinHashStage)), None), total,
                (str(tokenizer_path), info.sha256), keep_text=cfg.output.keep_dropped_text,
            )
            held_out = held.not_for_training()
            if not held.report["domains"] and not cfg.eval.source:
                log(f"warning: the eval split is empty: eval.fraction {cfg.eval.fraction} chose no document; "
                    "raise eval.fraction (the trainer will not evaluate on it)")
            lap("eval_split")
        copies, selection_report = selection.select(
            executor.run_tasks, plan.work, plan.out, block_inputs,
            cfg.diversity, cfg.mixture, total, held_out,
        )
        lap("select")
        itemsize = token_dtype(info.vocab_size).byte_width
        shard_plan = plan_shards(plan, blocks, itemsize, copies, executor.run_tasks)
        reusing("shards", "shards", "shard-?????.json", len(shard_plan))
        shard_results = executor.run_tasks(shard_task, plan, [(i, p, copies) for i, p in enumerate(shard_plan)], "shards")
        if cfg.eval.enabled and cfg.eval.source:
            eval_results = [dataclasses.asdict(i) for i in eval_split.copy_source(cfg.eval.source, plan.out / eval_split.EVAL_DIR)]
        elif cfg.eval.enabled:
            eval_rows = held.eval_rows()
            eval_plan = plan_shards(plan, blocks, itemsize, eval_rows, executor.run_tasks)
            eval_results = executor.run_tasks(eval_shard_task, plan, [(i, p, eval_rows) for i, p in enumerate(eval_plan)],
                                              "eval_split shards")
        lap("shards")
        # Every task has returned, so a temporary file still here is a killed worker's (Ray retried its task,
        # which wrote its own): removed before the manifest, so a successful run leaves only its outputs. Not
        # listed file by file in work/ when it is deleted whole below (at scale it holds most of the files).
        remove_temporaries(plan.out_dir, skip=() if cfg.output.keep_work else (plan.work.name,))
        resumed_tasks = sum(done for done, _ in (reused or {}).values())
        if resumed_tasks:
            log(f"resumed: {resumed_tasks:,} of {sum(n for _, n in reused.values()):,} tasks were already done ("
                + ", ".join(f"{phase} {done}/{n}" for phase, (done, n) in reused.items()) + ")")

        if sum(r["rows"] for r in shard_results) == 0:  # the selection took the last documents
            raise _nothing_survived(plan, total, t0, damaged, id_results)
        shards = [ShardInfo(**r) for r in shard_results]
        manifest = build_manifest(
            shards,
            tokenizer=dataclasses.asdict(info),
            config=result_affecting(cfg),
            config_hash=config_hash(cfg),
        )
        manifest.update(selection_report)  # `mixture` (targets and realised shares), `diversity`
        if cfg.eval.enabled:
            eval_manifest = write_eval_manifest(plan, [ShardInfo(**r) for r in eval_results], info)
            manifest["splits"] = {"eval": {**{k: eval_manifest[k] for k in ("num_shards", "total_docs", "total_tokens", "domains")},
                                           "path": eval_split.EVAL_DIR}}
        lap("write")  # the writes below take milliseconds: counted in "clean_up"
        seconds = time.perf_counter() - t0
        stats = build_stats(plan, total, seconds)
        stats["phase_seconds"] = phases
        stats["global_stages"] = global_summaries
        stats["damaged_inputs"] = damaged
        stats["duplicate_ids"] = unique_ids.summary(id_results)
        stats["tokenizer_encoders"] = encoders  # which encoder(s) the tokenize workers used
        stats.update(selection_report)
        if cfg.eval.enabled:
            stats["eval"] = held.report
        unbalanced = [row for row in stats["inputs"] if not row["balanced"]]
        if unbalanced:  # a bug, never bad input: say so loudly rather than write a wrong manifest
            raise RuntimeError(f"document accounting does not balance for {unbalanced}")
        atomic_write_json(plan.out / "stats.json", stats, durable=True)
        write_manifest(plan.out_dir, manifest)  # last: its presence means the run is complete
        if not cfg.output.keep_work:
            remove_work(plan.work, executor.run_tasks)
        lap("clean_up")
    except DamagedWorkFile as exc:
        raise RunStopped(_recovery(plan, exc)) from None
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if early is not None:
            early.wind_down(interrupted)
        if own_executor:
            executor.shutdown()
    lap("shutdown")
    # Rewritten with the clean-up's and shutdown's seconds (deleting thousands of work files can take longer than
    # a phase); a run killed before this keeps the first stats.json, complete but for these figures.
    seconds = time.perf_counter() - t0
    stats["seconds"] = round(seconds, 3)
    atomic_write_json(plan.out / "stats.json", stats, durable=True)
    return CurateResult(plan.out_dir, manifest, stats, seconds, resumed_tasks=resumed_tasks)
