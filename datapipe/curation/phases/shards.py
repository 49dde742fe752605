"""The shards phase: rows cut into shards of `output.shard_bytes` in input order, one task per shard.

`plan_shards` reads no file in the driver: tasks over groups of blocks sum each block's token bytes per pass,
the driver adds the sums up into each block's offset (a number per block), and tasks cut the blocks' rows at
the shard boundaries (`auto`: sized from the token bytes to write). The eval split's rows go the same way into
OUT/eval/shards/, with a manifest of their own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from datapipe.core.shards import ShardInfo, build_manifest, write_manifest, write_shard
from datapipe.core.storage import Location
from datapipe.core.workfiles import read_work_table
from datapipe.curation.config import auto_shard_bytes, config_hash, result_affecting
from datapipe.curation.plan import EVAL_DIR, MODEL_SELECTION_DIR, Plan, block_name, lengths_file, token_file
from datapipe.curation.cuts import RowCopies
from datapipe.curation.blocks import block_file


def _lengths(plan: Plan, name: str) -> np.ndarray:
    """Token count of every row of one token block (its small `lengths/` file: one GET, no existence check)."""
    return read_work_table(lengths_file(plan.work, name)).column("num_tokens").to_numpy()


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


@dataclasses.dataclass(frozen=True)
class ShardsPlan:
    """What the shards plan's tasks share: the run's plan, a token's bytes, the copies per row and the shard size."""

    plan: Plan
    itemsize: int
    copies: RowCopies | None
    target: int = 0  # token bytes a shard holds (the cut tasks')


def block_bytes_task(task: ShardsPlan, names: list[str]) -> list[list[int]]:
    """Per block of `names`: the token bytes of each pass (a summary; the rows stay in the task)."""
    plan, itemsize, copies = task.plan, task.itemsize, task.copies
    return [[int(x.sum()) for x in _pass_bytes(plan, name, itemsize, copies)] for name in names]


def cut_task(task: ShardsPlan, pieces: list[tuple[str, int, int]]) -> list[tuple[int, Piece]]:
    """For each (block, pass, byte offset of its first row in the whole output): the block's rows cut by
    shard, a row going to shard `offset of its first byte // target`. Returns (shard, piece) pairs."""
    plan, itemsize, copies, target = task.plan, task.itemsize, task.copies, task.target
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
    task = ShardsPlan(plan, itemsize, copies)
    per_block = [x for part in run_tasks(block_bytes_task, task, [(g,) for g in groups], "shards plan") for x in part]
    passes = 1 if copies is None else copies.passes
    totals = np.array(per_block, dtype=np.int64).reshape(len(names), passes) if names else np.zeros((0, passes), np.int64)
    target = plan.cfg.output.shard_bytes
    if target == "auto":
        target = auto_shard_bytes(int(totals.sum()))
    order = totals.T.reshape(-1)  # pass 0's blocks in input order, then pass 1's, ...
    offsets = np.cumsum(order) - order
    items = [(names[i % len(names)], i // len(names), int(offsets[i])) for i in range(len(order)) if order[i] > 0]
    cut = run_tasks(cut_task, dataclasses.replace(task, target=max(int(target), 1)),
                    [(items[i : i + PLAN_GROUP],) for i in range(0, len(items), PLAN_GROUP)], "shards cut")
    shards: dict[int, list[Piece]] = {}
    for part in cut:
        for shard, piece in part:
            shards.setdefault(shard, []).append(piece)
    return [shards[s] for s in sorted(shards)]


def _piece_rows(copies: RowCopies | None, name: str, k: int, start: int, stop: int) -> np.ndarray:
    """The rows of a block that a piece (name, k, start, stop) takes."""
    return np.arange(start, stop) if copies is None else np.flatnonzero(copies.of(name) > k)[start:stop]


SCORE_COLUMN = "selection_score"  # training shards' column when selection by a model ran: each document's score


def _shard_table(plan: Plan, pieces: list[Piece], copies: RowCopies | None, scores: bool = False) -> pa.Table:
    parts = []
    for name, k, start, stop in pieces:
        rows = _piece_rows(copies, name, k, start, stop)
        part = read_work_table(token_file(plan.work, name)).take(pa.array(rows))
        if scores:  # every training row was scored (work/model_select/<block>.arrow: row, score)
            scored = read_work_table(block_file(plan.work, MODEL_SELECTION_DIR, name)).select(["row", "score"])
            by_row = np.full(int(scored.column("row").to_numpy().max(initial=-1)) + 1, np.nan)
            by_row[scored.column("row").to_numpy()] = scored.column("score").to_numpy()
            part = part.append_column(SCORE_COLUMN, pa.array(by_row[rows], pa.float64()))
        parts.append(part)
    return pa.concat_tables(parts)


def shard_record_at(plan: Plan, index: int, *_: Any) -> Location:
    return plan.work / "shards" / f"shard-{index:05d}.json"


def shard_task(plan: Plan, index: int, pieces: list[Piece], copies: RowCopies | None = None) -> dict[str, Any]:
    """One training shard, OUT/shards/shard-NNNNN.arrow: its pieces' rows, in order (with their selection score when
    selection by a model ran)."""
    table = _shard_table(plan, pieces, copies, scores=plan.cfg.selection.enabled)
    return dataclasses.asdict(write_shard(plan.out_dir, index, table))


def eval_shard_record_at(plan: Plan, index: int, *_: Any) -> Location:
    return plan.work / EVAL_DIR / "shards" / f"shard-{index:05d}.json"


def eval_shard_task(plan: Plan, index: int, pieces: list[Piece], copies: RowCopies | None = None) -> dict[str, Any]:
    """One shard of the eval split, into OUT/eval/shards/."""
    return dataclasses.asdict(write_shard(plan.out / EVAL_DIR, index, _shard_table(plan, pieces, copies)))


def write_eval_manifest(plan: Plan, shards: list[ShardInfo], info: Any) -> dict[str, Any]:
    """OUT/eval/manifest.json: a curated folder of its own (written before the main manifest)."""
    tokenizer = dataclasses.asdict(info)
    if tokenizer["path"] == "tokenizer.json":  # trained into OUT/: relative to the eval folder it is one up
        tokenizer["path"] = "../tokenizer.json"
    manifest = build_manifest(shards, tokenizer=tokenizer, config=result_affecting(plan.cfg), config_hash=config_hash(plan.cfg))
    manifest["split"] = {"name": "eval", "of": ".."}
    write_manifest(plan.out / EVAL_DIR, manifest)
    return manifest
