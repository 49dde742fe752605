"""The run's start, before any phase: the plan after every check that needs no work, the output folder claimed (or a
finished run of the same config reused), and the executor (a given one, or an embedded or connected Ray)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Callable, Iterator

from datapipe.core.config import ConfigError, RunStopped
from datapipe.core.shards import make_folder, read_manifest, remove_temporaries
from datapipe.core.storage import (RemotePath, absolute, check_reachable, location, make_local_folder, reachable,
                                   remove_tree, size_of)
from datapipe.curation.config import CurateConfig
from datapipe.curation.executors import Executor, make_executor, ray_address, ray_is_running
from datapipe.curation.identity import check_output
from datapipe.curation.phases import eval_split
from datapipe.curation.phases.model_selection import check_selection_files
from datapipe.curation.phases.read import EarlyReader, read_record_at, read_task
from datapipe.curation.pipeline import build_segments
from datapipe.curation.plan import CurateResult, Plan, resolve_block_bytes
from datapipe.curation.readers import plan_units
from datapipe.curation.run_loop import in_this_process
from datapipe.curation.user_stages import worker_modules
from stages.base import GlobalStage, Stage
from stages.normalize import NormalizeStage
from stages.tokenize import choose_encoder, describe


def plan_run(cfg: CurateConfig, extra_stages: list[Stage | GlobalStage]) -> tuple[Plan, str | None]:
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


def finished_run(plan: Plan, tokenizer_text: str | None, log: Callable[[str], None]) -> CurateResult | None:
    """Claim the output folder (or refuse it); the result of the finished run it already holds, if it does."""
    finished = check_output(plan, tokenizer_text)
    remove_temporaries(plan.out_dir)  # no writer works in this folder now: temporaries left by a killed run are garbage
    if finished is None:
        return None
    damaged = _damaged_shard(plan.out, finished)
    if damaged:
        raise RunStopped(f"{plan.cfg.output.dir} holds a finished run of this config, but {damaged}: its manifest no "
                         f"longer describes it. Run it again: rm -r {plan.out} and run the same command (it writes the "
                         "same shards)")
    if not plan.cfg.output.keep_work:  # a run killed between its manifest and this clean-up
        remove_tree(plan.work)
    log(f"{plan.cfg.output.dir} is a finished run of the same config: reusing it (nothing to do)")
    return CurateResult(plan.out_dir, finished, json.loads((plan.out / "stats.json").read_text()), 0.0, reused=True)


RUN_LOG = "run.log"


def run_log(plan: Plan) -> Callable[[str], None]:
    """A writer of OUT/run.log: every progress and report line of the run with its time, appended as it happens (a
    resumed run goes on below the killed one's lines); a log to read later, not an output the shards depend on. On
    an object store, where nothing can be appended, there is none (the lines still print)."""
    path = plan.out / RUN_LOG
    if isinstance(path, RemotePath):
        return lambda _: None

    def write(line: str) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {line}\n")

    resumed = path.exists()  # written as soon as the run claimed the folder: a run found it there went before
    write(f"{'resumed' if resumed else 'started'}: datapipe curate into {plan.cfg.output.dir}")
    return write


def _damaged_shard(out: Any, manifest: dict[str, Any]) -> str | None:
    """What is wrong with the first shard of a finished folder (its eval split's too) that is gone or not of its
    manifest's size, or None. Sizes only: a reuse reads no shard whole, and the loader checks each shard's sha256
    when it opens it (`verify`)."""
    folders = [(out, manifest)]
    split = manifest.get("splits", {}).get("eval")
    if split:
        try:
            folders.append((out / split["path"], read_manifest(out / split["path"])))
        except (OSError, ValueError) as exc:
            return f"{split['path']}/manifest.json cannot be read ({type(exc).__name__})"
    for folder, listed in folders:
        for shard in listed["shards"]:
            path = folder / shard["path"]
            try:
                size = size_of(path)
            except OSError:
                return f"{path} is missing"
            if size != shard["bytes"]:
                return f"{path} holds {size:,} bytes where its manifest says {shard['bytes']:,}"
    return None


@contextlib.contextmanager
def executor_for(plan: Plan, executor: Executor | None, progress: bool) -> Iterator[tuple[Executor, EarlyReader | None]]:
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
