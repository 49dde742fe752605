"""Progress display of a phase: a tqdm bar in a terminal, periodic plain lines in a log, or nothing."""

from __future__ import annotations

import sys
import time
from typing import Any

from tqdm.auto import tqdm


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


class StageBar:
    """A live bar for one user-level stage in a terminal (tqdm: tasks done / total, rate, ETA): each of the stage's
    phases adds its tasks as it starts, and every task finished in any of them ticks it. The executors tick it
    through `_bar` while it is the current one (`current`); it runs in the driver, where both executors collect."""

    current: "StageBar | None" = None

    def __init__(self, stage: str) -> None:
        self.bar = tqdm(total=0, desc=f"{stage:>14}", unit="task", leave=True, dynamic_ncols=True)
        StageBar.current = self

    def add(self, tasks: int) -> None:
        self.bar.total += tasks
        self.bar.refresh()

    def update(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()
        if StageBar.current is self:
            StageBar.current = None

    def __enter__(self) -> "StageBar":
        return self

    def __exit__(self, *exc: Any) -> None:  # a phase's end: the stage's bar goes on
        pass


def _bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar in a terminal; plain periodic lines when stderr is a file, a pipe or a CI log; the running stage's
    bar (`StageBar`) when there is one and the phase's own is off."""
    if not enabled:
        return StageBar.current or _NoProgress()
    if not sys.stderr.isatty():
        return _PlainProgress(total, desc)
    return tqdm(total=total, desc=f"{desc:>14}", unit="task", leave=True, dynamic_ncols=True)

