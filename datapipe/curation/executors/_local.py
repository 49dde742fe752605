"""The Executor protocol every run loop is given, and `LocalExecutor`: a plain loop in this process."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from datapipe.curation.executors._progress import _bar


class Executor(Protocol):
    num_workers: int

    def run_tasks(self, fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str, *,
                  memory: int | None = None) -> list[Any]: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """Runs everything in this process, in order."""

    num_workers = 1

    def __init__(self, *, progress: bool = False) -> None:
        self.progress = progress

    def run_tasks(self, fn: Callable[..., Any], shared: Any, items: Sequence[tuple], desc: str, *,
                  memory: int | None = None) -> list[Any]:
        with _bar(len(items), desc, self.progress) as bar:
            out = []
            for item in items:
                out.append(fn(shared, *item))
                bar.update(1)
            return out

    def shutdown(self) -> None:
        pass

