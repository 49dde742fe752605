"""Executors, the only package that imports Ray: the protocol and the local loop (`_local`), the Ray executor
(`_ray_executor`), an embedded Ray's start patches (`_embedded`) and the progress display (`_progress`).

`run_tasks(fn, shared, items)` calls `fn(shared, *item)` for every item and returns the results in
item order (state a phase's tasks share, a tokenizer, is cached per worker process by the task itself:
Ray reuses its workers, and starting actor processes cost ~1.5 s a phase). `LocalExecutor` is a plain loop
in this process (unit tests, debugging); `RayExecutor` runs on an embedded local Ray or a cluster,
retrying tasks whose worker process died, and stops a phase in which no task has finished for
`ray.stall_timeout_s` (`PhaseStalled`) instead of waiting forever. Only `_ray_executor` and `_embedded`
name Ray (inside functions: importing this package does not import Ray).
"""

from __future__ import annotations

from typing import Sequence

from datapipe.curation.executors._local import Executor, LocalExecutor
from datapipe.curation.executors._progress import StageBar
from datapipe.curation.executors._ray_executor import (
    PhaseStalled,
    RayExecutor,
    WorkerDeathFilter,
    ray_address,
    ray_is_running,
    state_api_url,
    task_label,
    worker_env,
)

__all__ = [
    "Executor", "LocalExecutor", "PhaseStalled", "RayExecutor", "StageBar", "WorkerDeathFilter", "make_executor", "ray_address",
    "ray_is_running", "state_api_url", "task_label", "worker_env",
]


def make_executor(
    kind: str, address: str | None, *, num_cpus: int | None, max_retries: int, progress: bool, stall_timeout_s: float = 600.0,
    py_modules: Sequence[str] = (),
) -> Executor:
    if kind == "local":
        return LocalExecutor(progress=progress)
    if kind == "ray":
        return RayExecutor(address, num_cpus=num_cpus, max_retries=max_retries, progress=progress,
                           stall_timeout_s=stall_timeout_s, py_modules=py_modules)
    raise ValueError(f"executor must be one of {{'local', 'ray'}}, got {kind!r}")
