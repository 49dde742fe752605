"""The loss-feedback path of the loader: per-document losses from the trainer, remembered and taught to the loss predictor and the mixing bandit.

    feedback = LossFeedback(loss_memory=100_000, prioritize=None, features=None)
    feedback.report(doc_ids, losses)          # any thread, no external lock
    snapshot = feedback.snapshot(until=n)     # the predictor after exactly the first n reports
    weights = feedback.mixing_snapshot(until=n)  # the online-mixing policy after exactly the first n reports
    state = feedback.state_dict()             # {"losses": ..., "predictor": ..., "mixing": ...}: one consistent cut

Threading contract. One `LossFeedback` is owned by one `PackedLoader`; it is the only place the
reported losses, the predictor and the mixing bandit live. Every public method may be called from
any thread: the object holds its own lock (a `threading.Condition`) and takes it around every read
or write of its state, so callers need no lock of their own. `report` does its costly part (the
documents' static features and domains, read from the shards) before taking the lock, then appends
the report to each learner's queue under it; reports are learnt in the order they took the lock.
`snapshot(until)` (and `mixing_snapshot(until)`) blocks (without holding the lock while it waits)
until `until` reports have arrived, teaches its learner exactly those and no others, and returns
its snapshot; so a prefetch thread that plans batches ahead of the trainer cannot change what a
learner has learnt at a given batch (see datapipe/loader/prioritize.py). Each learner keeps its own
queue and count, so the predictor and the bandit may refresh at different batches.
`state_dict` and `load_state_dict` are atomic under the lock.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from datapipe.core.config import ConfigError
from datapipe.loader import online_mixing as om
from datapipe.loader import prioritize as prio

FEEDBACK_KEYS = ("losses", "predictor", "mixing")  # the keys of the loader state that this object owns
EMA_DECAY = 0.9


class _Learner:
    """A model taught by the reports in arrival order; the reports not yet learnt wait in `pending`.

    The model has `update(*entry)`, `snapshot()`, `state_dict()` and `load_state_dict(state)`; an
    entry is a tuple of float64 arrays built by `LossFeedback.report`.

    What is learnt for good. A snapshot for `until` is the model plus the first `until` reports, but
    the model itself only learns the first `reports - lag` (when fewer than `until`): a state may be
    saved later with the position of an earlier batch (a prefetcher runs ahead of the trainer), and
    the loader resumed from it asks again for the snapshot of a refresh point it had already passed.
    Every saved position has served at least the batches reported by then (the trainer reports a
    batch before it saves the position after it), so no later request asks for fewer than
    `reports - lag` reports, and the model never holds more than a request needs.
    """

    def __init__(self, name: str, model: Any, lag: int) -> None:
        self.name, self.model, self.lag = name, model, lag
        self.reports = 0  # reports queued here
        self.applied = 0  # of them, learnt by the model for good
        self.pending: list[tuple[np.ndarray, ...]] = []

    def snapshot(self, until: int) -> Any:
        """The model's snapshot after exactly the first `until` reports (the caller has waited for them)."""
        keep = min(until, self.reports - self.lag)
        if keep > self.applied:
            todo, self.pending = self.pending[: keep - self.applied], self.pending[keep - self.applied:]
            for entry in todo:
                self.model.update(*entry)
            self.applied = keep
        if until <= self.applied:
            return self.model.snapshot()
        model = copy.deepcopy(self.model)
        for entry in self.pending[: until - self.applied]:
            model.update(*entry)
        return model.snapshot()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "applied": self.applied, "reports": self.reports,
                "pending": [[a.tolist() for a in entry] for entry in self.pending]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.applied, self.reports = int(state["applied"]), int(state["reports"])
        self.pending = [tuple(np.array(a, dtype=np.float64) for a in entry) for entry in state["pending"]]


class LossFeedback:
    """Reported per-document losses (an EMA, bounded memory) and the learners they train.

    loss_memory: the most documents remembered (the least recently reported are forgotten first).
    prioritize: the predictor's settings, or None (no predictor: only the EMA is kept).
    features: the static features of documents (`Reader.features`), needed with `prioritize`.
    online_mixing: the mixing bandit's settings, or None; its `mixing_prior` (domain -> weight) and
    domains: the index in `mixing_prior`'s domains of each document (`online_mixing.doc_domains`) are
    needed with it.
    """

    def __init__(self, loss_memory: int, prioritize: prio.Prioritize | None,
                 features: Callable[[list[int]], np.ndarray] | None, *,
                 online_mixing: om.OnlineMixing | None = None, mixing_prior: Mapping[str, float] | None = None,
                 domains: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        if prioritize is not None and features is None:
            raise ValueError("a LossFeedback with prioritize needs a features function")
        if online_mixing is not None and (domains is None or mixing_prior is None):
            raise ValueError("a LossFeedback with online_mixing needs a mixing_prior and a domains function")
        self.loss_memory = loss_memory
        self.prioritize = prioritize
        self.online_mixing = online_mixing
        self._mixing_prior = dict(mixing_prior or {})
        self._features = features
        self._domains = domains
        self._lock = threading.Condition()
        self._reset()

    def _reset(self) -> None:
        self._losses: OrderedDict[int, list[float]] = OrderedDict()  # doc -> [ema, reports]
        self._predictor = (_Learner("prioritize", prio.LossPredictor(self.prioritize), self.prioritize.lag)
                           if self.prioritize else None)
        self._mixing = (_Learner("online_mixing", om.DomainBandit(self.online_mixing, list(self._mixing_prior),
                                                                   self._mixing_prior), self.online_mixing.lag)
                        if self.online_mixing else None)

    # -- writes ------------------------------------------------------------------------------------
    def report(self, doc_ids: Sequence[int] | torch.Tensor | np.ndarray,
               losses: Sequence[float] | torch.Tensor | np.ndarray) -> None:
        """Remember per-token or per-document losses (mean per document per call, then an EMA, 0.9 decay).

        Ids < 0 (padding) and non-finite losses are ignored. With `prioritize` (`online_mixing`), each call
        that holds at least one document is one report for the predictor (the bandit): the documents' static
        features (domains) and mean losses.
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
        # the costly parts (they read shards), outside the lock
        feats = np.asarray(self._features(uniq.tolist()), dtype=np.float64) if self._predictor else None
        domains = np.asarray(self._domains(uniq), dtype=np.float64) if self._mixing else None
        with self._lock:
            for learner, entry in ((self._predictor, (feats, means)), (self._mixing, (domains, means))):
                if learner is not None:
                    learner.pending.append(entry)
                    learner.reports += 1
            if self._predictor or self._mixing:
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

        A request for fewer reports than the predictor has learnt for good (from a position older than
        the reports made, against the contract in `_Learner`) gets the predictor as it is.
        """
        return self._snapshot(self._predictor, until, timeout_s)

    def mixing_snapshot(self, until: int, timeout_s: float = 600.0) -> dict[str, float] | None:
        """The online-mixing policy ({domain: weight}) after learning exactly the first `until` reports."""
        return self._snapshot(self._mixing, until, timeout_s)

    def _snapshot(self, learner: _Learner | None, until: int, timeout_s: float) -> Any:
        if learner is None:
            return None
        with self._lock:
            if until > learner.applied:
                if not self._lock.wait_for(lambda: learner.reports >= until, timeout=timeout_s):
                    raise RuntimeError(
                        f"{learner.name}: the loader needs the first {until} loss reports, but {learner.reports} "
                        f"came in {timeout_s:.0f} s; call report_losses once per batch")
            return learner.snapshot(until)

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
                state["predictor"] = self._predictor.state_dict()
            if self._mixing is not None:
                state["mixing"] = self._mixing.state_dict()
            return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace everything with a saved state's losses, predictor and bandit (a missing key: empty)."""
        losses = OrderedDict((int(doc), [float(v), int(n)]) for doc, v, n in state.get("losses", []))
        with self._lock:
            self._reset()
            self._losses = losses
            for learner, key in ((self._predictor, "predictor"), (self._mixing, "mixing")):
                if learner is not None and state.get(key):
                    learner.load_state_dict(state[key])
