"""The read phase: one task per input unit parses it, quarantines what cannot be read, cuts the documents into
blocks of `read.block_bytes` of text, normalizes them and writes each block once (`datapipe.curation.blocks`:
later phases write views, not the text). Each parsed block also sends its ids to the unique-ids exchange.

While an embedded Ray starts, the driver reads the first units itself (`EarlyReader`): on a single-file corpus
the read then costs no wall time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.schema import DOC_SCHEMA
from datapipe.core.shards import replacing
from datapipe.core.storage import Location, RemotePath, is_url
from datapipe.curation.phases import unique_ids
from datapipe.curation.blocks import READ, write_read_block
from datapipe.curation.counters import Counters
from datapipe.curation.phase import Phase
from datapipe.curation.map_stages import run_stages, write_dropped
from datapipe.curation.plan import WORK_COMPRESSION, Plan, block_name, task_memory, working_dir
from datapipe.curation.readers import InputUnit, read_unit


def read_phase(plan: Plan, first: int = 0) -> Phase:
    """One task per input unit from `first` on (the driver may have read the units before it)."""
    return Phase("read", "read", read_task, plan, [(u,) for u in range(first, len(plan.units))], read_record_at,
                 task_memory(plan, "read"))


def read_record_at(plan: Plan, unit_index: int) -> Location:
    return plan.work / READ / f"u{unit_index:06d}.json"


def read_task(plan: Plan, unit_index: int) -> dict[str, Any]:
    """Parse one input unit into blocks (`work/read/<block>.arrow`); its counters, blocks and damaged files."""
    unit = plan.units[unit_index]
    inp = plan.cfg.inputs[unit.input_index]
    # A URL input needs no working folder (the driver's may not exist on this node).
    with working_dir(plan.cwd) if not is_url(inp.path) else contextlib.nullcontext():
        return _read(plan, unit_index, unit, inp)


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


def _run_read_stages(plan: Plan, table: pa.Table, name: str, input_index: int, counters: Counters) -> pa.Table:
    """The stages that rewrite the text (normalize), run on a block before it is written, so that the
    text is written once (`datapipe.curation.blocks`); their drops are written and counted like any stage's."""
    if not plan.read_stages:
        return table
    dropped_parts: list[pa.RecordBatch] = []
    table = run_stages(plan, plan.read_stages, table, counters, dropped_parts)
    for part in dropped_parts:
        counters.count_dropped(input_index, part)
    write_dropped(plan, READ, name, dropped_parts)
    return table


def _write_block(plan: Plan, name: str, table: pa.Table, input_index: int) -> tuple[Counters, int]:
    """A parsed block's keys for the renames, its read stages (normalize) and its one written copy; the counts of
    what the read stages dropped, and the bytes of its keys' file."""
    counters = Counters()
    # every parsed document takes part in the renames; the exchange is as wide as exact dedup's
    keys_bytes = unique_ids.send_keys(plan.work, name, table, plan.cfg.dedup.exact.partitions)
    table = _run_read_stages(plan, table, name, input_index, counters)
    # the one copy of the text (`blocks`), compressed: read by a few phases, kept until the run ends
    write_read_block(plan.work, name, table, WORK_COMPRESSION)
    return counters, keys_bytes


def _read(plan: Plan, unit_index: int, unit: InputUnit, inp: Any) -> dict[str, Any]:
    counters = Counters()
    quarantine = _QuarantineWriter(plan.out / "quarantine" / f"u{unit_index:06d}.jsonl")
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    blocks = 0
    # A block is normalized and written on a second thread while the next one is parsed: parsing holds the GIL
    # (Python's line loop, orjson), normalizing (RE2) and writing (zstd) mostly do not. One block in flight.
    writer = ThreadPoolExecutor(1, thread_name_prefix="datapipe-write-block")
    writing: Future[tuple[Counters, int]] | None = None
    keys_bytes = 0  # the largest of its blocks' key files (what sizes the renames' exchange)

    def written() -> None:
        nonlocal keys_bytes
        block_counters, sent = writing.result()
        counters.merge(block_counters)
        keys_bytes = max(keys_bytes, sent)

    def flush() -> None:
        nonlocal pending, pending_bytes, blocks, writing
        table = pa.Table.from_batches(pending, schema=DOC_SCHEMA)
        if writing is not None:
            written()
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
            written()
    return {"blocks": blocks, "counters": counters.to_json(), "damaged": list(damaged.values()), "keys_bytes": keys_bytes}


class EarlyReader(threading.Thread):
    """Reads input units in this process, in order, while an embedded Ray starts in the main thread (most of
    `ray.init` is waiting for its daemons): the read, a single task on a single-file corpus, then costs no
    wall time. `stop()` returns how many units it took; it finishes the one it is in, and Ray's tasks read the
    rest. Output does not depend on which process read a unit (`read_task` is deterministic and resumable).
    `read(unit)` is the run loop's: the unit's (result, found done), its record checked and written."""

    def __init__(self, plan: Plan, read: Callable[[int], tuple[dict[str, Any], bool]]) -> None:
        super().__init__(name="datapipe-early-read", daemon=True)
        self.plan = plan
        self.read = read
        self.results: list[tuple[dict[str, Any], bool]] = []
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
                self.results.append(self.read(unit))
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

    def finish(self) -> list[tuple[dict[str, Any], bool]]:
        """The taken units' (result, found done) pairs, in unit order, once they are read (or the error one of
        them raised)."""
        self.join()
        if self.error is not None:
            raise self.error
        return self.results
