"""The run's steps as the driver takes them: each phase through the run loop (`Run.execute`, `Run.tasks`), and
what the driver sums of its tasks' results (counters, summaries, shard lists)."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable

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
from datapipe.curation.report import build_stats
from datapipe.curation.run_loop import Run
from stages.base import ResolvingStage
from stages.minhash import MinHashStage
from stages.tokenize import describe


def read(run: Run, plan: Plan, early: EarlyReader | None, total: Counters) -> tuple[list[tuple[int, int]], list[Any], int]:
    """The read phase (the units the driver read while Ray started first); the blocks, the damaged inputs and the
    largest of the blocks' id key files."""
    taken = early.stop() if early is not None else 0
    results = run.execute(read_phase(plan, taken))
    if early is not None:
        found = early.finish()
        run.count_resumed("read", sum(done for _, done in found), len(found))
        results = [result for result, _ in found] + results
        if taken and run.lines.enabled:
            print(f"read: {taken:,} of {len(plan.units):,} units read by this process while Ray started", file=sys.stderr, flush=True)
    for r in results:
        total.merge(Counters.from_json(r["counters"]))
    blocks = [(u, b) for u, r in enumerate(results) for b in range(r["blocks"])]
    return blocks, [d for r in results for d in r.get("damaged", [])], max((r.get("keys_bytes", 0) for r in results), default=0)


def segments(run: Run, plan: Plan, blocks: list[tuple[int, int]], total: Counters) -> tuple[dict[str, Any], int, int]:
    """Every segment over every block, each global stage resolved after its segment: (the global stages'
    summaries, the kept documents, their text bytes). Stops early when no document is left."""
    summaries: dict[str, Any] = {}
    kept_docs = kept_bytes = 0
    for s, seg in enumerate(plan.segments):
        results = run.execute(segment_phase(plan, s, blocks))
        for r in results:
            total.merge(Counters.from_json(r["counters"]))
        kept_bytes, kept_docs = sum(r["bytes"] for r in results), sum(r["rows"] for r in results)
        if kept_docs == 0:  # no block or no document left: a global stage has nothing to resolve, later segments nothing to read
            break
        if (stage := seg.global_stage) is not None:  # its decision, then its losers back to the blocks
            tasks = stage.tasks(kept_docs)
            run_tasks = run.tasks(stage_title(stage.name), memory=task_memory(plan, "resolve", kept_bytes, tasks))
            if isinstance(stage, ResolvingStage):  # near dedup's steps
                senders = [f"{seg.name}/{block_name(u, b)}" for u, b in blocks]  # the map half's blocks
                summaries[stage.name] = stage.resolve(run_tasks, plan.work / stage.name, plan.out, senders, kept_docs,
                                                      largest_keys(results))
            else:
                summaries[stage.name] = decide_losers(run_tasks, plan.work, stage, [block_name(u, b) for u, b in blocks], results)
            route_losers(run_tasks, plan.work / stage.name, tasks, len(plan.units), stage.name)
    return summaries, kept_docs, kept_bytes


def tokenize(run: Run, plan: Plan, blocks: list[tuple[int, int]], kept_bytes: int, total: Counters,
              report: dict[str, Any]) -> tuple[str, Any]:
    """The tokenizer (trained on a sample, or loaded) and the tokenize phase; (its path, its description)."""
    tokenizer_path, where = prepare_tokenizer(plan, blocks, kept_bytes, run.tasks("tokenize", task_memory(plan, "segment")))
    info = describe(location(tokenizer_path).read_text(), where, plan.cfg.tokenizer)
    results = run.execute(tokenize_phase(plan, blocks, tokenizer_path))
    for r in results:
        total.merge(Counters.from_json(r["counters"]))
    report["tokenizer_encoders"] = sorted({r.get("encoder", "tokenizers") for r in results})  # which the workers used
    return tokenizer_path, info


def unique_ids_step(run: Run, plan: Plan, blocks: list[tuple[int, int]], keys_bytes: int, total: Counters) -> dict[str, Any]:
    """Part of reading: ids made unique across the run (renames applied as segment 0 reads); stats.json's summary."""
    partitions = plan.cfg.dedup.exact.partitions
    read_bytes = sum(v[3] for (stage, _), v in total.funnel.items() if stage == "read")  # what the partitions share
    run_tasks = run.tasks("read", task_memory(plan, "ids", read_bytes, partitions))
    return unique_ids.summary(unique_ids.resolve_ids(run_tasks, plan.work, [block_name(u, b) for u, b in blocks], partitions,
                                                     keys_bytes))


def block_inputs(plan: Plan, blocks: list[tuple[int, int]]) -> list[tuple[str, int]]:
    return [(block_name(u, b), plan.units[u].input_index) for u, b in blocks]


def eval_split_step(run: Run, plan: Plan, blocks: list[tuple[int, int]], total: Counters, tokenizer: tuple[str, Any],
                report: dict[str, Any], log: Callable[[str], None]) -> Any:
    """The held-out eval split, before selection: eval documents are never sampled away nor repeated."""
    cfg = plan.cfg
    if not cfg.eval.enabled:
        return None
    near = next((seg for seg in plan.segments if isinstance(seg.global_stage, MinHashStage)), None)
    groups = report["global_stages"][near.global_stage.name]["groups"] if near is not None else None
    held = eval_split.split(run.tasks("eval split", task_memory(plan, "block")), plan.work, plan.out, block_inputs(plan, blocks), plan.segments[-1].name,
                            cfg.eval, cfg.dedup.minhash, near.name if near else None, total, (str(tokenizer[0]), tokenizer[1].sha256),
                            keep_text=cfg.output.keep_dropped_text, near_dedup_groups=groups)
    if not held.report["domains"] and not cfg.eval.source:
        log(f"warning: the eval split is empty: eval.fraction {cfg.eval.fraction} chose no document; "
            "raise eval.fraction (the trainer will not evaluate on it)")
    report["eval"] = held.report
    return held


def shards(run: Run, plan: Plan, blocks: list[tuple[int, int]], itemsize: int, copies: Any,
            held: Any) -> tuple[list[ShardInfo], list[ShardInfo] | None]:
    """The training shards, and the eval split's (copied from `eval.source`, or cut from the held-out rows)."""
    run_tasks = run.tasks("shards", task_memory(plan, "block"))  # planning: a group of blocks' lengths
    pieces = plan_shards(plan, blocks, itemsize, copies, run_tasks)
    shards = run_tasks(shard_task, plan, [(i, p, copies) for i, p in enumerate(pieces)], "shards", record=shard_record_at,
                       memory=task_memory(plan, "shard"))
    if held is None:
        return [ShardInfo(**r) for r in shards], None
    if plan.cfg.eval.source:
        return [ShardInfo(**r) for r in shards], eval_split.copy_source(plan.cfg.eval.source, plan.out / eval_split.EVAL_DIR)
    rows = held.eval_rows()
    eval_pieces = plan_shards(plan, blocks, itemsize, rows, run_tasks)
    eval_shards = run_tasks(eval_shard_task, plan, [(i, p, rows) for i, p in enumerate(eval_pieces)], "eval_split shards",
                            record=eval_shard_record_at, memory=task_memory(plan, "shard"))
    return [ShardInfo(**r) for r in shards], [ShardInfo(**r) for r in eval_shards]


def write(run: Run, plan: Plan, total: Counters, t0: float, report: dict[str, Any], shards: list[ShardInfo],
           eval_shards: list[ShardInfo] | None, info: Any, selected: dict[str, Any],
           log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """stats.json, then manifest.json (its presence means the run is complete), then work/ goes; (stats, manifest)."""
    cfg = plan.cfg
    # Every task has returned: a temporary file still here is a killed worker's (Ray retried its task). Not listed
    # file by file in work/ when that is deleted whole below (at scale it holds most of the run's files).
    remove_temporaries(plan.out_dir, skip=() if cfg.output.keep_work else (plan.work.name,))
    if (line := run.resumed_line()) is not None:
        log(line)
    manifest = build_manifest(shards, tokenizer=dataclasses.asdict(info), config=result_affecting(cfg), config_hash=config_hash(cfg))
    manifest.update(selected)  # `mixture` (targets and realised shares), `diversity`
    if eval_shards is not None:
        written = write_eval_manifest(plan, eval_shards, info)
        manifest["splits"] = {"eval": {**{k: written[k] for k in ("num_shards", "total_docs", "total_tokens", "domains")},
                                       "path": eval_split.EVAL_DIR}}
    run.lap("write")
    stats = build_stats(plan, total, time.perf_counter() - t0)
    stats.update({"phase_seconds": run.seconds, "step_seconds": run.step_seconds, **report})
    unbalanced = [row for row in stats["inputs"] if not row["balanced"]]
    if unbalanced:  # a bug, never bad input: say so loudly rather than write a wrong manifest
        raise RuntimeError(f"document accounting does not balance for {unbalanced}")
    atomic_write_json(plan.out / "stats.json", stats, durable=True)
    write_manifest(plan.out_dir, manifest)  # last: its presence means the run is complete
    if not cfg.output.keep_work:
        remove_work(plan.work, run.tasks("clean up", task_memory(plan, "block")))
    run.lap("clean up")
    return stats, manifest


def select(run: Run, plan: Plan, blocks: list[tuple[int, int]], total: Counters, held: Any) -> tuple[Any, dict[str, Any]]:
    """Selection (a model's, diversity sampling, the mixture) over the training rows: (the rows' copies, its report)."""
    cfg = plan.cfg
    return selection.select(run.tasks("selection", task_memory(plan, "block")), plan.work, plan.out, block_inputs(plan, blocks),
                            cfg.diversity, cfg.mixture, total, held.not_for_training() if held else None, cfg.selection,
                            plan.segments[-1].name, plan.cwd, task_memory(plan, "block"))
