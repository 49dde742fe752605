"""`curate()`: the curation run as a list of phases, each a set of independent tasks on an executor.

1. read        one task per input unit (`phases/read.py`); the ids made unique across the run (`phases/unique_ids.py`);
2. segments    one task per block and segment: map stages up to each global stage, whose resolve decides over
               all keys and whose losers are routed back to the blocks (`phases/segment.py`, `exchange.py`);
3. tokenize    the tokenizer trained once on a sample (or loaded), one task per block (`phases/tokenize.py`);
4. eval split  held-out documents and their exact and near copies (`phases/eval_split.py`);
5. selection   diversity sampling and the mixture (`phases/selection.py`);
6. shards      rows cut into shards in input order, one task per shard (`phases/shards.py`);
7. write       manifest.json and stats.json last; then work/ goes (unless `output.keep_work`).

Every task writes its outputs atomically, then its record: `Run.execute` (`run_loop.py`) skips a task whose record is
there, so a killed run resumes where it stopped and, every task being deterministic, writes the same shards.
`run.json` says which run an output folder holds (`identity.py`); a rerun that is not the same run is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable, Iterator

from datapipe.core.config import ConfigError, RunStopped
from datapipe.core.shards import ShardInfo, atomic_write_json, build_manifest, make_folder, remove_temporaries, write_manifest
from datapipe.core.storage import absolute, check_reachable, location, make_local_folder, reachable, remove_tree
from datapipe.core.workfiles import DamagedWorkFile
from datapipe.curate.phases import eval_split, selection, unique_ids
from datapipe.curate.phases.model_selection import check_selection_files
from datapipe.curate.config import CurateConfig, config_hash, result_affecting
from datapipe.curate.counters import Counters
from datapipe.curate.executors import Executor, make_executor, ray_address, ray_is_running
from datapipe.curate.identity import check_output
from datapipe.curate.exchange import route_losers
from datapipe.curate.run_loop import Run, in_this_process
from datapipe.curate.phases.read import EarlyReader, read_phase, read_record_at, read_task
from datapipe.curate.phases.segment import build_segments, segment_phase
from datapipe.curate.phases.shards import (
    eval_shard_record_at, eval_shard_task, plan_shards, shard_record_at, shard_task, write_eval_manifest,
)
from datapipe.curate.phases.tokenize import prepare_tokenizer, tokenize_phase
from datapipe.curate.plan import CurateResult, Plan, block_name, remove_work, resolve_block_bytes, stage_title, task_memory
from datapipe.curate.readers import plan_units
from datapipe.curate.report import build_stats, nothing_survived, recovery
from datapipe.curate.user_stages import worker_modules
from stages.base import GlobalStage, Stage
from stages.minhash import MinHashStage
from stages.normalize import NormalizeStage
from stages.tokenize import choose_encoder, describe, token_dtype


def curate(cfg: CurateConfig, *, executor: Executor | None = None, extra_stages: list[Stage | GlobalStage] = (),
           progress: bool = True, verbose: bool = False, log: Callable[[str], None] = print) -> CurateResult:
    """Run the whole curation pipeline described by `cfg`; see the module docstring. `progress`: one line per
    stage on stderr; `verbose`: the executor's line per step too."""
    t0 = time.perf_counter()
    plan, tokenizer_text = _plan(cfg, extra_stages)
    if (finished := _finished(plan, tokenizer_text, log)) is not None:
        return finished
    resuming = plan.work.exists()
    with _executor(plan, executor, progress and verbose) as (executor, early):
        run = Run(executor, progress=progress, resumed=resuming, started=t0)
        run.lap("start")
        try:
            total = Counters()
            blocks, damaged = _read(run, plan, early, total)
            report = {"damaged_inputs": damaged, "duplicate_ids": _unique_ids(run, plan, blocks, total)}
            report["global_stages"], kept_docs, kept_bytes = _segments(run, plan, blocks, total)
            if kept_docs == 0:
                raise nothing_survived(plan, total, t0, report)
            tokenizer_path, info = _tokenize(run, plan, blocks, kept_bytes, total, report)
            held = _eval_split(run, plan, blocks, total, (tokenizer_path, info), report, log)
            copies, selected = selection.select(run.tasks("selection", task_memory(plan, "block")), plan.work, plan.out,
                                                _block_inputs(plan, blocks), plan.cfg.diversity, plan.cfg.mixture, total,
                                                held.not_for_training() if held else None, plan.cfg.selection,
                                                plan.segments[-1].name)
            report.update(selected)
            shards, eval_shards = _shards(run, plan, blocks, token_dtype(info.vocab_size).byte_width, copies, held)
            if sum(s.rows for s in shards) == 0:  # the selection took the last documents
                raise nothing_survived(plan, total, t0, report)
            stats, manifest = _write(run, plan, total, t0, report, shards, eval_shards, info, selected, log)
        except DamagedWorkFile as exc:
            raise RunStopped(recovery(plan, exc)) from None
    run.lap("shutdown")
    run.lines.close()
    # Rewritten with the clean-up's and shutdown's seconds; a run killed before this keeps the first stats.json.
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    stats["phase_seconds"] = run.seconds
    stats["step_seconds"] = run.step_seconds  # the executor's steps within the stages (their tasks, start to end)
    atomic_write_json(plan.out / "stats.json", stats, durable=True)
    return CurateResult(plan.out_dir, manifest, stats, stats["seconds"], resumed_tasks=run.resumed_tasks)


def _plan(cfg: CurateConfig, extra_stages: list[Stage | GlobalStage]) -> tuple[Plan, str | None]:
    """The run's plan, after every check that needs no work: inputs, tokenizer and output reachable and sound."""
    # storage that cannot be reached (no credentials, wrong endpoint) is named first, not a reader's traceback
    check_reachable([*((f"inputs[{i}].path", inp.path) for i, inp in enumerate(cfg.inputs)),
                     ("tokenizer.path", cfg.tokenizer.path), ("eval.source", cfg.eval.source if cfg.eval.enabled else None)])
    units = plan_units(list(cfg.inputs))  # a missing or unreadable input fails here, before any work
    if cfg.eval.enabled and cfg.eval.source:
        eval_split.read_source(cfg.eval.source)  # so does a missing or empty eval.source
    check_selection_files(cfg.selection)  # and selection's target documents or model file
    cfg = resolve_block_bytes(cfg, units)
    tokenizer_text = None
    if cfg.tokenizer.path is not None:
        try:
            tokenizer_text = location(cfg.tokenizer.path).read_text()
        except OSError as exc:
            raise ConfigError(f"tokenizer.path: cannot read {cfg.tokenizer.path!r}: {exc}") from None
        describe(tokenizer_text, cfg.tokenizer.path, cfg.tokenizer)  # special ids in the vocabulary, ids fit uint32: fail now
        choose_encoder(tokenizer_text, cfg.tokenizer, cfg.tokenizer.path)  # `encoder: fast` that cannot be: fail now
    plan = Plan(cfg=cfg, out_dir=absolute(cfg.output.dir), units=units, segments=build_segments(cfg, list(extra_stages)),
                read_stages=[NormalizeStage(cfg.normalize)] if cfg.normalize.enabled else [], cwd=os.getcwd())
    reachable(plan.out_dir, "output.dir")  # a URL without credentials or with a wrong endpoint: an error now
    make_local_folder(plan.out_dir, "output.dir")  # a file in the way, a folder that cannot be made: said as such
    make_folder(plan.out_dir)  # a read-only or full disk: an OutputError naming the folder
    return plan, tokenizer_text


def _finished(plan: Plan, tokenizer_text: str | None, log: Callable[[str], None]) -> CurateResult | None:
    """Claim the output folder (or refuse it); the result of the finished run it already holds, if it does."""
    finished = check_output(plan, tokenizer_text)
    remove_temporaries(plan.out_dir)  # no writer works in this folder now: temporaries left by a killed run are garbage
    if finished is None:
        return None
    if not plan.cfg.output.keep_work:  # a run killed between its manifest and this clean-up
        remove_tree(plan.work)
    log(f"{plan.cfg.output.dir} is a finished run of the same config: reusing it (nothing to do)")
    return CurateResult(plan.out_dir, finished, json.loads((plan.out / "stats.json").read_text()), 0.0, reused=True)


@contextlib.contextmanager
def _executor(plan: Plan, executor: Executor | None, progress: bool) -> Iterator[tuple[Executor, EarlyReader | None]]:
    """The given executor, or an embedded or connected Ray one, shut down at the end; while an embedded Ray starts,
    the driver reads the first input units itself (`EarlyReader`)."""
    if executor is not None:
        yield executor, None
        return
    cfg, early = plan.cfg, None
    if ray_address(cfg.ray.address) is None and not ray_is_running():  # an embedded Ray: this machine's cores
        early = EarlyReader(plan, in_this_process(read_task, read_record_at, plan))
        early.start()
    interrupted = False
    try:
        executor = make_executor("ray", cfg.ray.address, num_cpus=cfg.ray.num_cpus, max_retries=cfg.ray.max_retries,
                                 progress=progress, stall_timeout_s=cfg.ray.stall_timeout_s,
                                 py_modules=worker_modules(cfg.stages))  # the recipe's own stages' code
        if early is not None:
            early.stop()
        yield executor, early
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if early is not None:
            early.wind_down(interrupted)
        if executor is not None:
            executor.shutdown()


def _read(run: Run, plan: Plan, early: EarlyReader | None, total: Counters) -> tuple[list[tuple[int, int]], list[Any]]:
    """The read phase (the units the driver read while Ray started first); the blocks and the damaged inputs."""
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
    return [(u, b) for u, r in enumerate(results) for b in range(r["blocks"])], [d for r in results for d in r.get("damaged", [])]


def _segments(run: Run, plan: Plan, blocks: list[tuple[int, int]], total: Counters) -> tuple[dict[str, Any], int, int]:
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
        if (stage := seg.global_stage) is not None:  # its resolve half, the same way for every global stage
            senders = [f"{seg.name}/{block_name(u, b)}" for u, b in blocks]  # the map half's blocks
            tasks = stage.tasks(kept_docs)
            run_tasks = run.tasks(stage_title(stage.name), memory=task_memory(plan, "resolve", kept_bytes, tasks))
            summaries[stage.name] = stage.resolve(run_tasks, plan.work / stage.name, plan.out, senders, kept_docs)
            route_losers(run_tasks, plan.work / stage.name, tasks, len(plan.units), stage.name)
    return summaries, kept_docs, kept_bytes


def _tokenize(run: Run, plan: Plan, blocks: list[tuple[int, int]], kept_bytes: int, total: Counters,
              report: dict[str, Any]) -> tuple[str, Any]:
    """The tokenizer (trained on a sample, or loaded) and the tokenize phase; (its path, its description)."""
    tokenizer_path, where = prepare_tokenizer(plan, blocks, kept_bytes, run.tasks("tokenize", task_memory(plan, "segment")))
    info = describe(location(tokenizer_path).read_text(), where, plan.cfg.tokenizer)
    results = run.execute(tokenize_phase(plan, blocks, tokenizer_path))
    for r in results:
        total.merge(Counters.from_json(r["counters"]))
    report["tokenizer_encoders"] = sorted({r.get("encoder", "tokenizers") for r in results})  # which the workers used
    return tokenizer_path, info


def _unique_ids(run: Run, plan: Plan, blocks: list[tuple[int, int]], total: Counters) -> dict[str, Any]:
    """Part of reading: ids made unique across the run (renames applied as segment 0 reads); stats.json's summary."""
    partitions = plan.cfg.dedup.exact.partitions
    read_bytes = sum(v[3] for (stage, _), v in total.funnel.items() if stage == "read")  # what the partitions share
    run_tasks = run.tasks("read", task_memory(plan, "ids", read_bytes, partitions))
    documents = sum(v[1] for (stage, _), v in total.funnel.items() if stage == "read")
    return unique_ids.summary(unique_ids.resolve_ids(run_tasks, plan.work, [block_name(u, b) for u, b in blocks], partitions,
                                                     documents))


def _block_inputs(plan: Plan, blocks: list[tuple[int, int]]) -> list[tuple[str, int]]:
    return [(block_name(u, b), plan.units[u].input_index) for u, b in blocks]


def _eval_split(run: Run, plan: Plan, blocks: list[tuple[int, int]], total: Counters, tokenizer: tuple[str, Any],
                report: dict[str, Any], log: Callable[[str], None]) -> Any:
    """The held-out eval split, before selection: eval documents are never sampled away nor repeated."""
    cfg = plan.cfg
    if not cfg.eval.enabled:
        return None
    near = next((seg for seg in plan.segments if isinstance(seg.global_stage, MinHashStage)), None)
    groups = report["global_stages"][near.global_stage.name]["groups"] if near is not None else None
    held = eval_split.split(run.tasks("eval split", task_memory(plan, "block")), plan.work, plan.out, _block_inputs(plan, blocks), plan.segments[-1].name,
                            cfg.eval, cfg.dedup.minhash, near.name if near else None, total, (str(tokenizer[0]), tokenizer[1].sha256),
                            keep_text=cfg.output.keep_dropped_text, near_dedup_groups=groups)
    if not held.report["domains"] and not cfg.eval.source:
        log(f"warning: the eval split is empty: eval.fraction {cfg.eval.fraction} chose no document; "
            "raise eval.fraction (the trainer will not evaluate on it)")
    report["eval"] = held.report
    return held


def _shards(run: Run, plan: Plan, blocks: list[tuple[int, int]], itemsize: int, copies: Any,
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


def _write(run: Run, plan: Plan, total: Counters, t0: float, report: dict[str, Any], shards: list[ShardInfo],
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
