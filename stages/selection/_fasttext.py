"""Scoring with an existing fastText classifier: a model file in fastText's own format (`.bin`, as DCLM and others
publish their quality classifiers), applied as it is.

A document's score is the probability the model gives `label` (DCLM: `__label__hq`), read through the maintained
fastText binding (`fasttext-community`, which works with numpy 2). fastText classifies one line at a time, so a
document's newlines become spaces first, as DCLM's own scoring does. The model file is read by each process that
scores (once: `_loaded`), from where the recipe names it; only its path and label travel in the selection model.
"""

from __future__ import annotations

import functools
import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np


PROBE = "a line of plain text that the model classifies before any work, to find a damaged file at the start"


@functools.lru_cache(maxsize=2)
def _loaded(path: str, size: int, mtime_ns: int) -> Any:
    """The model of `path` as it is now (its size and time in the key: a file replaced is read again)."""
    import fasttext  # imported when used: only this method needs the binding

    return fasttext.load_model(path)


def load(path: str) -> Any:
    """The fastText model in `path`, or a ValueError saying why it cannot be read."""
    if not os.path.isfile(path):
        raise ValueError(f"{path!r} is not a file on this machine (fastText reads local files)")
    try:
        info = os.stat(path)
        return _loaded(path, info.st_size, info.st_mtime_ns)
    except Exception as exc:  # noqa: BLE001 - the binding raises ValueError or RuntimeError by version; say which
        raise ValueError(f"fastText cannot load it ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class FastTextScorer:
    path: str  # absolute: every process reads the same file
    label: str

    @property
    def model(self) -> Any:
        return load(self.path)

    def check(self) -> None:
        """The file loads, is a classifier with `label`, and classifies a line (ValueError otherwise): a file cut
        short loads, and only its first prediction finds the matrices' sizes wrong."""
        labels = list(self.model.labels)
        if self.label not in labels:
            raise ValueError(f"it has no label {self.label!r} (its labels: {', '.join(labels[:10])}); set "
                             "selection.fasttext_label to the label of what you want kept")
        try:
            scores = self.scores([PROBE])
        except Exception as exc:  # noqa: BLE001 - the binding raises ValueError or RuntimeError ('Vector::mul: size mismatch')
            raise ValueError(f"it loads but cannot classify a line ({type(exc).__name__}: {exc}): the file is damaged "
                             "or cut short") from None
        if not np.isfinite(scores).all():
            raise ValueError(f"it gives the probe line a score of {scores[0]}: the file is damaged")

    @staticmethod
    def unload() -> None:
        """Let go of the models this process has loaded (the driver's, once it has checked a file: only the tasks
        that score keep one)."""
        _loaded.cache_clear()

    def flops_per_word(self) -> float:
        """A multiply-add per dimension for each input vector a word adds (the word and its word n-grams)."""
        args = self.model.f.getArgs()
        return 2.0 * self.model.get_dimension() * max(int(args.wordNgrams), 1)

    def scores(self, texts: list[str]) -> np.ndarray:
        """The probability of `label` for each document."""
        if not texts:
            return np.empty(0, np.float64)
        labels, probabilities = self.model.predict([t.replace("\n", " ") for t in texts], k=-1, threshold=0.0)
        return np.array([float(p[list(names).index(self.label)]) if self.label in names else 0.0
                         for names, p in zip(labels, probabilities)], np.float64)

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, kind="fasttext", path=self.path, label=self.label)
        return buffer.getvalue()

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> "FastTextScorer":
        return cls(str(arrays["path"]), str(arrays["label"]))
