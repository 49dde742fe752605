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


def _bar(total: int, desc: str, enabled: bool) -> Any:
    """A tqdm bar in a terminal; plain periodic lines when stderr is a file, a pipe or a CI log."""
    if not enabled:
        return _NoProgress()
    if not sys.stderr.isatty():
        return _PlainProgress(total, desc)
    return tqdm(total=total, desc=f"{desc:>14}", unit="task", leave=True, dynamic_ncols=True)

