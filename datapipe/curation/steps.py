"""The run's steps as the driver takes them, each `step(run, plan, state) -> state`: its phases through the run loop
(`Run.execute`, `Run.tasks`), and what the driver keeps of its tasks' results in a new, frozen `RunState` (counters,
report, blocks, tokenizer, held-out rows, copies, shards). `curate()` is the list `STEPS` taken in order."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from datapipe.core.shards import ShardInfo, atomic_write_json, build_manifest, remove_temporaries, write_manifest
from datapipe.core.storage import location
from datapipe.curation.config import config_hash, result_affecting
from datapipe.curation.counters import Counters
from datapipe.curation.losers import route_losers
from datapipe.curation.phases import eval_split, selection, unique_ids
from datapipe.curation.phases.read import EarlyReader, read_phase
from datapipe.curation.phases.segment import decide_losers, largest_keys, segment_phase
from datapipe.curation.phases.shards import (
    eval_shard_record_at, eval_shard_task, plan_shards, shard_record_at, shard_task, write_eval_manifest,
)
from datapipe.curation.phases.tokenize import prepare_tokenizer, tokenize_phase
from datapipe.curation.plan import Plan, block_name, remove_work, stage_title, task_memory
from datapipe.curation.report import build_stats, nothing_survived
from datapipe.curation.run_loop import Run
from stages.base import ResolvingStage
from stages.minhash import MinHashStage
from stages.tokenize import describe, token_dtype


_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class RunState:
    """What the steps so far have made of the run: each step returns a new one (`dataclasses.replace`), none changes
    the one it got. `counters` and `report` are the driver's sums of the tasks' results, for stats.json."""

    started: float  # the run's start (`time.perf_counter()`)
    early: EarlyReader | None = None  # the units read in this process while Ray started (the read step's)
    log: Callable[[str], None] = print
    counters: Counters = field(default_factory=Counters)
    report: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    blocks: tuple[tuple[int, int], ...] = ()
    keys_bytes: int = 0  # the largest of the blocks' id key files (the renames' exchange)
    kept_docs: int = 0
    kept_bytes: int = 0
    tokenizer: tuple[str, Any] | None = None  # (its path, its description)
    held: Any = None  # the eval split's held-out rows (None without one)
    copies: Any = None  # how many times each training row is written
    selected: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    shards: tuple[ShardInfo, ...] = ()
    eval_shards: tuple[ShardInfo, ...] | None = None
    stats: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    manifest: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)

    def counted(self, results: Sequence[dict[str, Any]] = ()) -> Counters:
        """The counters with each result's `counters` added (a new object: without results, a copy)."""
        total = Counters.from_json(self.counters.to_json())
        for r in results:
            total.merge(Counters.from_json(r["counters"]))
        return total

    def reported(self, **entries: Any) -> Mapping[str, Any]:
        return MappingProxyType({**self.report, **entries})


def read(run: Run, plan: Plan, state: RunState) -> RunState:
    """The read phase (the units the driver read while Ray started first): the blocks, the damaged inputs, the
    largest of the blocks' id key files."""
    early = state.early
    taken = early.stop() if early is not None else 0
    results = run.execute(read_phase(plan, taken))
    if early is not None:
        found = early.finish()
        run.count_resumed("read", sum(done for _, done in found), len(found))
        results = [result for result, _ in found] + results
        if taken and run.lines.enabled:
            print(f"read: {taken:,} of {len(plan.units):,} units read by this process while Ray started", file=sys.stderr, flush=True)
    return dataclasses.replace(
        state, counters=state.counted(results), blocks=tuple((u, b) for u, r in enumerate(results) for b in range(r["blocks"])),
        keys_bytes=max((r.get("keys_bytes", 0) for r in results), default=0),
        report=state.reported(damaged_inputs=[d for r in results for d in r.get("damaged", [])]))


def unique_ids_step(run: Run, plan: Plan, state: RunState) -> RunState:
    """Part of reading: ids made unique across the run (renames applied as segment 0 reads); stats.json's summary."""
    partitions = plan.cfg.dedup.exact.partitions
    read_bytes = sum(v[3] for (stage, _), v in state.counters.funnel.items() if stage == "read")  # what the partitions share
    run_tasks = run.tasks("read", task_memory(plan, "ids", read_bytes, partitions))
    renames = unique_ids.resolve_ids(run_tasks, plan.work, [block_name(u, b) for u, b in state.blocks], partitions,
                                     state.keys_bytes)
    return dataclasses.replace(state, report=state.reported(duplicate_ids=unique_ids.summary(renames)))


def segments(run: Run, plan: Plan, state: RunState) -> RunState:
    """Every segment over every block, each global stage decided after its segment and its losers routed back: the
    global stages' summaries, the kept documents and their text bytes. Stops early when no document is left."""
    summaries: dict[str, Any] = {}
    blocks = list(state.blocks)
    for s, seg in enumerate(plan.segments):
        results = run.execute(segment_phase(plan, s, blocks))
        state = dataclasses.replace(state, counters=state.counted(results), kept_bytes=sum(r["bytes"] for r in results),
                                    kept_docs=sum(r["rows"] for r in results))
        if state.kept_docs == 0:  # no document left: a global stage has nothing to decide, later segments nothing to read
            break
        if (stage := seg.global_stage) is not None:  # its decision, then its losers back to the blocks
            tasks = stage.tasks(state.kept_docs)
            run_tasks = run.tasks(stage_title(stage.name), memory=task_memory(plan, "resolve", state.kept_bytes, tasks))
            if isinstance(stage, ResolvingStage):  # near dedup's steps
                senders = [f"{seg.name}/{block_name(u, b)}" for u, b in blocks]  # the map half's blocks
                summaries[stage.name] = stage.resolve(run_tasks, plan.work / stage.name, plan.out, senders, state.kept_docs,
                                                      largest_keys(results))
            else:
                summaries[stage.name] = decide_losers(run_tasks, plan.work, stage, [block_name(u, b) for u, b in blocks], results)
            route_losers(run_tasks, plan.work / stage.name, tasks, len(plan.units), stage.name)
    return dataclasses.replace(state, report=state.reported(global_stages=summaries))


def documents_kept(run: Run, plan: Plan, state: RunState) -> RunState:
    """No document kept by the segments: stats.json says where they went, and the run stops."""
    if state.kept_docs == 0:
        raise nothing_survived(plan, state.counters, state.started, dict(state.report))
    return state


def rows_written(run: Run, plan: Plan, state: RunState) -> RunState:
    """No row in the shards (the selection took the last documents): the same."""
    if sum(s.rows for s in state.shards) == 0:
        raise nothing_survived(plan, state.counters, state.started, dict(state.report))
    return state


def tokenize(run: Run, plan: Plan, state: RunState) -> RunState:
    """The tokenizer (trained on a sample, or loaded) and the tokenize phase."""
    tokenizer_path, where = prepare_tokenizer(plan, list(state.blocks), state.kept_bytes,
                                              run.tasks("tokenize", task_memory(plan, "segment")))
    info = describe(location(tokenizer_path).read_text(), where, plan.cfg.tokenizer)
    results = run.execute(tokenize_phase(plan, list(state.blocks), tokenizer_path))
    encoders = sorted({r.get("encoder", "tokenizers") for r in results})  # which the workers used
    return dataclasses.replace(state, counters=state.counted(results), tokenizer=(tokenizer_path, info),
                               report=state.reported(tokenizer_encoders=encoders))


def block_inputs(plan: Plan, blocks: tuple[tuple[int, int], ...]) -> list[tuple[str, int]]:
    return [(block_name(u, b), plan.units[u].input_index) for u, b in blocks]


def eval_split_step(run: Run, plan: Plan, state: RunState) -> RunState:
    """The held-out eval split, before selection: eval documents are never sampled away nor repeated."""
    cfg = plan.cfg
    if not cfg.eval.enabled:
        return state
    near = next((seg for seg in plan.segments if isinstance(seg.global_stage, MinHashStage)), None)
    groups = state.report["global_stages"][near.global_stage.name]["groups"] if near is not None else None
    total = state.counted()  # a copy the split counts its drops into
    path, info = state.tokenizer
    held = eval_split.split(run.tasks("eval split", task_memory(plan, "block")), plan, block_inputs(plan, state.blocks),
                            total, (str(path), info.sha256), groups)
    if not held.report["domains"] and not cfg.eval.source:
        state.log(f"warning: the eval split is empty: eval.fraction {cfg.eval.fraction} chose no document; "
                  "raise eval.fraction (the trainer will not evaluate on it)")
    return dataclasses.replace(state, counters=total, held=held, report=state.reported(eval=held.report))


def select(run: Run, plan: Plan, state: RunState) -> RunState:
    """Selection (a model's, diversity sampling, the mixture) over the training rows: the rows' copies, its report."""
    held = state.held
    total = state.counted()  # a copy selection counts its drops into
    copies, selected = selection.select(run.tasks("selection", task_memory(plan, "block")), plan,
                                        block_inputs(plan, state.blocks), total, held.not_for_training() if held else None)
    return dataclasses.replace(state, counters=total, copies=copies, selected=MappingProxyType(selected),
                               report=state.reported(**selected))


def shards(run: Run, plan: Plan, state: RunState) -> RunState:
    """The training shards, and the eval split's (copied from `eval.source`, or cut from the held-out rows)."""
    itemsize, blocks, copies, held = token_dtype(state.tokenizer[1].vocab_size).byte_width, list(state.blocks), state.copies, state.held
    run_tasks = run.tasks("shards", task_memory(plan, "block"))  # planning: a group of blocks' lengths
    pieces = plan_shards(plan, blocks, itemsize, copies, run_tasks)
    written = tuple(ShardInfo(**r) for r in run_tasks(shard_task, plan, [(i, p, copies) for i, p in enumerate(pieces)],
                                                      "shards", record=shard_record_at, memory=task_memory(plan, "shard")))
    if held is None:
        return dataclasses.replace(state, shards=written)
    if plan.cfg.eval.source:
        copied = eval_split.copy_source(plan.cfg.eval.source, plan.out / eval_split.EVAL_DIR)
        return dataclasses.replace(state, shards=written, eval_shards=tuple(copied))
    rows = held.eval_rows()
    eval_pieces = plan_shards(plan, blocks, itemsize, rows, run_tasks)
    eval_shards = run_tasks(eval_shard_task, plan, [(i, p, rows) for i, p in enumerate(eval_pieces)], "eval_split shards",
                            record=eval_shard_record_at, memory=task_memory(plan, "shard"))
    return dataclasses.replace(state, shards=written, eval_shards=tuple(ShardInfo(**r) for r in eval_shards))


def write(run: Run, plan: Plan, state: RunState) -> RunState:
    """stats.json, then manifest.json (its presence means the run is complete), then work/ goes."""
    cfg, info = plan.cfg, state.tokenizer[1]
    # Every task has returned: a temporary file still here is a killed worker's (Ray retried its task). Not listed
    # file by file in work/ when that is deleted whole below (at scale it holds most of the run's files).
    remove_temporaries(plan.out_dir, skip=() if cfg.output.keep_work else (plan.work.name,))
    if (line := run.resumed_line()) is not None:
        state.log(line)
    manifest = build_manifest(list(state.shards), tokenizer=dataclasses.asdict(info), config=result_affecting(cfg),
                              config_hash=config_hash(cfg))
    manifest.update(state.selected)  # `mixture` (targets and realised shares), `diversity`
    if state.eval_shards is not None:
        written = write_eval_manifest(plan, list(state.eval_shards), info)
        manifest["splits"] = {"eval": {**{k: written[k] for k in ("num_shards", "total_docs", "total_tokens", "domains")},
                                       "path": eval_split.EVAL_DIR}}
    run.lap("write")
    stats = build_stats(plan, state.counters, time.perf_counter() - state.started)
    stats.update({"phase_seconds": run.seconds, "step_seconds": run.step_seconds, **state.report})
    unbalanced = [row for row in stats["inputs"] if not row["balanced"]]
    if unbalanced:  # a bug, never bad input: say so loudly rather than write a wrong manifest
        raise RuntimeError(f"document accounting does not balance for {unbalanced}")
    atomic_write_json(plan.out / "stats.json", stats, durable=True)
    write_manifest(plan.out_dir, manifest)  # last: its presence means the run is complete
    if not cfg.output.keep_work:
        remove_work(plan.work, run.tasks("clean up", task_memory(plan, "block")))
    run.lap("clean up")
    return dataclasses.replace(state, stats=stats, manifest=manifest)


# the run, in order: each step takes the state the one before it left
STEPS = (read, unique_ids_step, segments, documents_kept, tokenize, eval_split_step, select, shards, rows_written, write)
