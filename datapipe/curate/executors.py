"""Executors: the only module that imports Ray.

`run_tasks(fn, shared, items)` calls `fn(shared, *item)` for every item and returns the results in
item order; `run_actors(cls, init_args, method, items)` does the same through a pool of stateful
workers (one `cls(*init_args)` per worker, e.g. one tokenizer each). `LocalExecutor` is a plain loop
in this process (unit tests, debugging); `RayExecutor` runs on an embedded local Ray or a cluster,
retrying tasks whose worker process died.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

from tqdm.auto import tqdm

from datapipe.core.config import ConfigError


class Executor(Protocol):
    num_workers: int

    def run_tasks(self, fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str) -> list[Any]: ...

    def run_actors(
        self, cls: type, init_args: tuple, method: str, items: Sequence[tuple], desc: str
    ) -> list[Any]: ...

    def shutdown(self) -> None: ...


class _PlainProgress:
    """Progress as periodic plain lines, for logs and CI (no carriage returns, no terminal width needed):
    one line when a phase starts, at most one every `every_s` seconds, and one when it ends."""

    def __init__(self, total: int, desc: str, every_s: float = 10.0) -> None:
        self.total, self.desc, self.every_s, self.n = total, desc, every_s, 0
        self.start = self.last = time.monotonic()
        self._say(f"{self.desc}: {total:,} tasks")

    def _say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if self.n < self.total and now - self.last >= self.every_s:
            self.last = now
            self._say(f"{self.desc}: {self.n:,}/{self.total:,} tasks, {now - self.start:.0f} s")

    def __enter__(self) -> "_PlainProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self._say(f"{self.desc}: {self.n:,}/{self.total:,} tasks done in {time.monotonic() - self.start:.1f} s")


class _NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> "_NoProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def _bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar in a terminal; plain periodic lines when stderr is a file, a pipe or a CI log."""
    if not enabled:
        return _NoProgress()
    if not sys.stderr.isatty():
        return _PlainProgress(total, desc)
    return tqdm(total=total, desc=f"{desc:>14}", unit="task", leave=True, dynamic_ncols=True)


class LocalExecutor:
    """Runs everything in this process, in order."""

    num_workers = 1

    def __init__(self, *, progress: bool = False) -> None:
        self.progress = progress

    def run_tasks(self, fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str) -> list[Any]:
        with _bar(len(items), desc, self.progress) as bar:
            out = []
            for item in items:
                out.append(fn(shared, *item))
                bar.update(1)
            return out

    def run_actors(self, cls: type, init_args: tuple, method: str, items: Sequence[tuple], desc: str) -> list[Any]:
        worker = cls(*init_args)
        return self.run_tasks(lambda _, *item: getattr(worker, method)(*item), None, items, desc)

    def shutdown(self) -> None:
        pass


@contextlib.contextmanager
def _user_errors(ray: Any) -> Iterator[None]:
    """Re-raise a user error (a ConfigError: a bad input, a full or read-only disk) that a task
    raised as itself, so the CLI prints its one-paragraph message instead of Ray's wrapper with the
    worker's traceback; any other failure stays as Ray reports it (a bug needs its traceback)."""
    try:
        yield
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ConfigError):
            raise cause from None
        raise


# Each Ray worker gets one core; keep native thread pools from oversubscribing it.
_WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


class RayExecutor:
    """Runs tasks on Ray: an embedded local instance (address None) or an existing cluster."""

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        max_retries: int = 3,
        progress: bool = True,
    ) -> None:
        import ray

        self.ray = ray
        self.max_retries = max_retries
        self.progress = progress
        self._owns_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(logging_level=logging.WARNING, log_to_driver=True)
            if address is None:
                # "local" always starts a fresh embedded instance, never a stale cluster from `ray start`
                ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
            else:
                ray.init(address=address, **kwargs)
            self._owns_ray = True
        self.num_workers = max(1, int(ray.cluster_resources().get("CPU", 1)))

    def _gather(self, refs: list[Any], desc: str) -> list[Any]:
        ray = self.ray
        pending = list(refs)
        with _bar(len(refs), desc, self.progress) as bar, _user_errors(ray):
            while pending:
                done, pending = ray.wait(pending, num_returns=min(len(pending), 16), timeout=0.5)
                bar.update(len(done))
            return ray.get(refs)

    def run_tasks(self, fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str) -> list[Any]:
        if not items:
            return []
        remote = self.ray.remote(num_cpus=1, max_retries=self.max_retries, runtime_env={"env_vars": _WORKER_ENV})(fn)
        shared_ref = self.ray.put(shared)
        return self._gather([remote.remote(shared_ref, *item) for item in items], desc)

    def run_actors(self, cls: type, init_args: tuple, method: str, items: Sequence[tuple], desc: str) -> list[Any]:
        if not items:
            return []
        actor_cls = self.ray.remote(
            num_cpus=1,
            max_restarts=self.max_retries,
            max_task_retries=self.max_retries,
            runtime_env={"env_vars": _WORKER_ENV},
        )(cls)
        # Constructor arguments go by value (keep them small): an actor restarted after its process
        # died must not depend on an object-store copy that may be gone (ray-project/ray#53727).
        actors = [actor_cls.remote(*init_args) for _ in range(min(self.num_workers, len(items)))]
        from ray.util import ActorPool

        # The pool hands the next item to whichever actor is free; results come back in item order.
        pool = ActorPool(actors)
        results = []
        try:
            with _bar(len(items), desc, self.progress) as bar, _user_errors(self.ray):
                for result in pool.map(lambda actor, item: getattr(actor, method).remote(*item), items):
                    results.append(result)
                    bar.update(1)
            return results
        finally:
            for a in actors:
                self.ray.kill(a)

    def shutdown(self) -> None:
        if self._owns_ray:
            self.ray.shutdown()


def make_executor(kind: str, address: str | None, *, num_cpus: int | None, max_retries: int, progress: bool) -> Executor:
    if kind == "local":
        return LocalExecutor(progress=progress)
    if kind == "ray":
        return RayExecutor(address, num_cpus=num_cpus, max_retries=max_retries, progress=progress)
    raise ValueError(f"executor must be one of {{'local', 'ray'}}, got {kind!r}")

