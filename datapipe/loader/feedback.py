"""The loss-feedback path of the loader: per-document losses from the trainer, remembered and taught to the loss predictor.

    feedback = LossFeedback(loss_memory=100_000, prioritize=None, features=None)
    feedback.report(doc_ids, losses)          # any thread, no external lock
    snapshot = feedback.snapshot(until=n)     # the predictor after exactly the first n reports
    state = feedback.state_dict()             # {"losses": ..., "predictor": ...}: one consistent cut

Threading contract. One `LossFeedback` is owned by one `PackedLoader`; it is the only place the
reported losses and the predictor live. Every public method may be called from any thread: the
object holds its own lock (a `threading.Condition`) and takes it around every read or write of its
state, so callers need no lock of their own. `report` does its costly part (the documents' static
features, read from the shards) before taking the lock, then appends the report under it; reports
are learnt in the order they took the lock. `snapshot(until)` blocks (without holding the lock
while it waits) until `until` reports have arrived, teaches the predictor exactly those and no
others, and returns its snapshot; so a prefetch thread that plans batches ahead of the trainer
cannot change what the predictor has learnt at a given batch (see datapipe/loader/prioritize.py).
`state_dict` and `load_state_dict` are atomic under the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from datapipe.core.config import ConfigError
from datapipe.loader import prioritize as prio

FEEDBACK_KEYS = ("losses", "predictor")  # the keys of the loader state that this object owns
EMA_DECAY = 0.9


class LossFeedback:
    """Reported per-document losses (an EMA, bounded memory) and the loss predictor they train.

    loss_memory: the most documents remembered (the least recently reported are forgotten first).
    prioritize: the predictor's settings, or None (no predictor: only the EMA is kept).
    features: the static features of documents (`Reader.features`), needed with `prioritize`.
    """

    def __init__(self, loss_memory: int, prioritize: prio.Prioritize | None,
                 features: Callable[[list[int]], np.ndarray] | None) -> None:
        if prioritize is not None and features is None:
            raise ValueError("a LossFeedback with prioritize needs a features function")
        self.loss_memory = loss_memory
        self.prioritize = prioritize
        self._features = features
        self._lock = threading.Condition()
        self._reset()

    def _reset(self) -> None:
        self._losses: OrderedDict[int, list[float]] = OrderedDict()  # doc -> [ema, reports]
        self._predictor = prio.LossPredictor(self.prioritize) if self.prioritize else None
        self._n_reports = 0  # report() calls that reached the predictor queue
        self._applied = 0  # of them, learnt by the predictor
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # reported, not yet learnt

    # -- writes ------------------------------------------------------------------------------------
    def report(self, doc_ids: Sequence[int] | torch.Tensor | np.ndarray,
               losses: Sequence[float] | torch.Tensor | np.ndarray) -> None:
        """Remember per-token or per-document losses (mean per document per call, then an EMA, 0.9 decay).

        Ids < 0 (padding) and non-finite losses are ignored. With `prioritize`, each call that holds
        at least one document is one report for the predictor (its static features and mean losses).
        """
        ids = np.asarray(doc_ids.detach().cpu() if isinstance(doc_ids, torch.Tensor) else doc_ids).reshape(-1)
        vals = np.asarray(losses.detach().float().cpu() if isinstance(losses, torch.Tensor) else losses,
                          dtype=np.float64).reshape(-1)
        if ids.shape != vals.shape:
            raise ConfigError(f"doc_ids and losses must have the same number of elements, got {ids.size!r} and {vals.size!r}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(f"doc_ids must be integers, got dtype {str(ids.dtype)!r}")
        keep = (ids >= 0) & np.isfinite(vals)
        ids, vals = ids[keep].astype(np.int64), vals[keep]
        if not ids.size:
            return
        uniq, inv = np.unique(ids, return_inverse=True)
        means = np.bincount(inv, weights=vals) / np.bincount(inv)
        feats = None
        if self._predictor is not None:  # the costly part (reads tokens), outside the lock
            feats = np.asarray(self._features(uniq.tolist()), dtype=np.float64)
        with self._lock:
            if feats is not None:
                self._pending.append((feats, means))
                self._n_reports += 1
                self._lock.notify_all()
            if not self.loss_memory:
                return
            for doc, loss in zip(uniq.tolist(), means.tolist()):
                entry = self._losses.pop(doc, None)
                if entry is None:
                    entry = [loss, 0]
                else:
                    entry[0] = EMA_DECAY * entry[0] + (1 - EMA_DECAY) * loss
                entry[1] += 1
                self._losses[doc] = entry
            while len(self._losses) > self.loss_memory:
                self._losses.popitem(last=False)

    def snapshot(self, until: int, timeout_s: float = 600.0) -> dict[str, Any] | None:
        """The predictor's snapshot after learning exactly the first `until` reports (waits for them).

        Reports learnt earlier stay learnt: `until` below the count already learnt changes nothing.
        """
        if self._predictor is None:
            return None
        with self._lock:
            if until > self._applied:
                if not self._lock.wait_for(lambda: self._n_reports >= until, timeout=timeout_s):
                    raise RuntimeError(
                        f"prioritize: the predictor needs the first {until} loss reports, but {self._n_reports} "
                        f"came in {timeout_s:.0f} s; call report_losses once per batch")
                todo = self._pending[: until - self._applied]
                self._pending = self._pending[until - self._applied:]
                for feats, means in todo:
                    self._predictor.update(feats, means)
                self._applied = until
            return self._predictor.snapshot()

    # -- reads ---------------------------------------------------------------------------------------
    def losses(self) -> dict[int, float]:
        """The remembered loss of each reported document."""
        with self._lock:
            return {doc: v[0] for doc, v in self._losses.items()}

    def remembered(self) -> int:
        with self._lock:
            return len(self._losses)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The keys of the loader state this object owns (FEEDBACK_KEYS), one consistent cut, JSON-ready."""
        with self._lock:
            state: dict[str, Any] = {"losses": [[doc, v[0], int(v[1])] for doc, v in self._losses.items()]}
            if self._predictor is not None:
                state["predictor"] = {
                    "model": self._predictor.state_dict(), "applied": self._applied, "reports": self._n_reports,
                    "pending": [[f.tolist(), m.tolist()] for f, m in self._pending]}
            return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace everything with a saved state's losses and predictor (a missing key: empty)."""
        losses = OrderedDict((int(doc), [float(v), int(n)]) for doc, v, n in state.get("losses", []))
        saved = state.get("predictor") if self._predictor is not None else None
        with self._lock:
            self._reset()
            self._losses = losses
            if saved:
                self._predictor.load_state_dict(saved["model"])
                self._applied, self._n_reports = int(saved["applied"]), int(saved["reports"])
                self._pending = [(np.array(f, dtype=np.float64), np.array(m, dtype=np.float64))
                                 for f, m in saved["pending"]]
