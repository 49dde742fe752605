"""`curate()`: the curation run as a list of steps (`steps.STEPS`), each a set of independent tasks on an executor
that leaves a new, frozen `steps.RunState`.

1. read        one task per input unit (`phases/read.py`); the ids made unique across the run (`phases/unique_ids.py`);
2. segments    one task per block and segment: map stages up to each global stage, whose decision is taken over
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

import time
from typing import Callable

from datapipe.core.config import RunStopped
from datapipe.core.shards import atomic_write_json
from datapipe.core.workfiles import DamagedWorkFile
from datapipe.curation import start, steps
from datapipe.curation.config import CurateConfig
from datapipe.curation.executors import Executor
from datapipe.curation.plan import CurateResult
from datapipe.curation.report import recovery
from datapipe.curation.run_loop import Run
from stages.base import GlobalStage, Stage


def _also_to(log: Callable[[str], None], log_line: Callable[[str], None]) -> Callable[[str], None]:
    def both(line: str) -> None:
        log_line(line)
        log(line)

    return both


def curate(cfg: CurateConfig, *, executor: Executor | None = None, extra_stages: list[Stage | GlobalStage] = (),
           progress: bool = True, verbose: bool = False, log: Callable[[str], None] = print) -> CurateResult:
    """Run the whole curation pipeline described by `cfg`: the steps of `steps.STEPS`, in order, each taking the
    run's state the one before it left; see the module docstring. `progress`: one line per stage on stderr;
    `verbose`: the executor's line per step too."""
    t0 = time.perf_counter()
    plan, tokenizer_text = start.plan_run(cfg, extra_stages)
    if (finished := start.finished_run(plan, tokenizer_text, log)) is not None:
        return finished
    resuming = plan.work.exists()
    log_line = start.run_log(plan)
    with start.executor_for(plan, executor, progress and verbose) as (executor, early):
        run = Run(executor, progress=progress, resumed=resuming, started=t0, log_line=log_line)
        run.lap("start")
        state = steps.RunState(started=t0, early=early, log=_also_to(log, log_line))
        try:
            for step in steps.STEPS:
                state = step(run, plan, state)
        except DamagedWorkFile as exc:
            raise RunStopped(recovery(plan, exc)) from None
    run.lap("shutdown")
    run.lines.close()
    # Rewritten with the clean-up's and shutdown's seconds; a run killed before this keeps the first stats.json.
    stats = {**state.stats, "seconds": round(time.perf_counter() - t0, 3), "phase_seconds": run.seconds,
             "step_seconds": run.step_seconds}  # the executor's steps within the stages (their tasks, start to end)
    atomic_write_json(plan.out / "stats.json", stats, durable=True)
    return CurateResult(plan.out_dir, dict(state.manifest), stats, stats["seconds"], resumed_tasks=run.resumed_tasks)
