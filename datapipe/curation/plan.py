"""The plan of a curation run: its units, its segments of stages, the blocks' names, and what a task needs.

A segment is the map stages run back to back on a block up to a global stage, whose map half emits keys
(`stages.base.GlobalStage`); `pipeline.build_segments` cuts the stage list there. Memory is bounded by blocks and
partitions, not by the corpus: `task_memory` is what one task of a phase declares to Ray, from its input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.storage import Location, RemotePath, location, remove_tree
from datapipe.curation.config import (
    SHARD_TARGET_BYTES, TASK_BYTES_PER_TEXT_BYTE, CurateConfig, auto_block_bytes, auto_partitions,
)
from datapipe.curation.readers import InputUnit, estimated_text_bytes, input_fingerprints
from datapipe.curation.blocks import block_file
from stages.base import GlobalStage, Stage


EVAL_DIR = "eval"  # OUT/eval/ (the split's curated folder) and work/eval/ (its work)
MODEL_SELECTION_DIR = "model_select"  # work/model_select/: selection by a model's model, scores and kept rows
WORK_COMPRESSION = "zstd"  # text and token blocks in work/: ~4x smaller text for ~0.3 CPU-s per 100 MB written


@dataclass
class Segment:
    """Map stages run back to back on a block, then (optionally) a global stage's key emission.
    `name` names its folder in work/; `title` names it to the user (progress lines, phase seconds)."""

    name: str
    stages: list[Stage]
    global_stage: GlobalStage | None = None
    title: str = ""
    stage: str = ""  # the user-level stage its blocks' tasks belong to (progress, `phase_seconds`)


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


# What a user calls the stages whose names (in stats.json, the funnel, dropped/) are short identifiers.
STAGE_TITLES = {"exact_dedup": "exact dedup", "minhash": "near dedup", "langid": "language id"}


def stage_title(name: str) -> str:
    return STAGE_TITLES.get(name, name)


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


def token_file(work: str | Location, block: str) -> Location:
    """A block's token file: the tokenize task writes it; selection, the eval split and the shards read it."""
    return block_file(work, "tokens", block)


def lengths_file(work: str | Location, block: str) -> Location:
    """A block's row lengths (8 bytes a row): the tokenize task writes them, the shards' plan reads them."""
    return block_file(work, "lengths", block)


@contextlib.contextmanager
def working_dir(path: str) -> Iterator[None]:
    """In the driver's working folder (`Plan.cwd`): where a recipe's relative paths are read from."""
    # Safe in a worker: a Ray worker process runs one task at a time. The driver (`EarlyReader`) is there already.
    before = os.getcwd()
    if before == path:
        yield
        return
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def block_name(unit: int, block: int) -> str:
    return f"u{unit:06d}-b{block:05d}"


def text_bytes(batch: pa.RecordBatch | pa.Table) -> int:
    return int(pc.sum(pc.binary_length(batch.column("text"))).as_py() or 0) if batch.num_rows else 0


_TASK_BASE_BYTES = 256 * 2**20  # a worker process with its imports


# Bytes a task holds per byte of its block's text, by phase (upper estimates: the text, its batches and copies,
# the stage's arrays: near dedup's signatures, a tokenizer's encodings).
# `block`: a per-block task after tokenize (the eval split's, selection's): a token block (~ its text) and copies.
_BLOCK_FACTOR = {"read": 6, "segment": 8, "tokenize": 6, "block": 4}  # read: a block parsed while the one before is written
_SHARD_FACTOR = 3  # a shard task holds its pieces, their concatenation and the written buffer


def task_memory(plan: Plan, phase: str, text_bytes: int = 0, tasks: int = 1) -> int:
    """About how many bytes one task of `phase` needs, from its input (a block; a resolve task's share of
    `text_bytes`, near dedup's by default, "ids" the id renames'; a shard), never more than `ray.task_memory_gib`:
    what the executor tells Ray (`memory=`)."""
    budget = int(plan.cfg.ray.task_memory_gib * 2**30)
    if phase in ("resolve", "ids"):
        factor = TASK_BYTES_PER_TEXT_BYTE["minhash" if phase == "resolve" else "exact"]
        need = int(factor * text_bytes / max(tasks, 1))
    elif phase == "shard":
        shard_bytes = plan.cfg.output.shard_bytes
        need = _SHARD_FACTOR * (SHARD_TARGET_BYTES if shard_bytes == "auto" else int(shard_bytes))
    else:
        need = _BLOCK_FACTOR[phase] * int(plan.cfg.read.block_bytes)
        if phase == "read":  # one line is held whole up to 6x max_bytes_per_doc (readers/jsonl.py)
            need += 6 * plan.cfg.read.max_bytes_per_doc
    return min(budget, _TASK_BASE_BYTES + need)


def _remove_folder_task(work: Location, name: str) -> None:
    remove_tree(work / name)


def remove_work(work: Location, run_tasks: Callable[..., list[Any]]) -> None:
    """Delete work/ with one task per entry in it (one listing in the driver: one folder per phase), then what is
    left. At scale work/ holds most of the run's files, and unlinking them one by one in the driver was its largest
    cost that grows with the blocks."""
    if work.exists():
        run_tasks(_remove_folder_task, work, [(entry.name,) for entry in sorted(work.iterdir())], "clean_up")
    remove_tree(work)
