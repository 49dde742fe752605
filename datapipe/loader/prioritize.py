"""Loss-aware batch prioritization (Predictive Batch Scheduling): sample documents the model finds hard.

    from datapipe.loader import PackedLoader
    from datapipe.loader.prioritize import Prioritize
    loader = PackedLoader("out/", seq_len=128, batch_size=16, prioritize=Prioritize(keep=0.5))
    for batch in loader:
        ...                                   # forward/backward, per-document mean losses
        loader.report_losses(doc_ids, losses)  # trains the predictor

Predictor. An online linear model predicts a document's mean token loss from five cheap static
features of its tokens, computed without the model:
  - mean log-frequency of its tokens under a unigram table (counts of the first `ref_tokens` tokens
    of the manifest's shards in manifest order: fixed, so the features are a pure function of the
    document and resume needs no counts in the state),
  - log length,
  - vocabulary diversity (distinct tokens / length),
  - rare-token ratio (share of tokens whose reference count is ≤ `rare_count`),
  - std of token log-frequency,
plus a bias. It is fitted by recursive least squares with forgetting factor `forget` (the loss level
falls as the model learns; forgetting lets the fit follow it) on features standardised by the mean
and std of the first `min_reports` reported documents. RLS is exact for a linear model and needs no
learning rate.

Sampler. The loader's planner fills a pool of `pool` documents from a domain's stream (the domain
is still chosen by the mixture, so the mixture is unchanged), predicts their losses and keeps
`round(keep * pool)` of them, sampled without replacement with probability
    p_i = (1 - floor) * softmax(pred_i / temperature)_i + floor / pool
so a document's chance rises with its predicted loss and never falls below the uniform floor:
nothing starves. The others are skipped in this pass (with `epochs=None` every pass draws every
document again as a candidate). Until the predictor has `min_reports` documents, the kept ones are a
uniform random subset. Selection happens before packing: the packer only sees kept documents.

Determinism and resume. The planner uses a *snapshot* of the predictor (a few floats in the planner
state), renewed every `refresh` served batches. The snapshot taken at served batch b has learnt
exactly the first b - `lag` loss reports: the loader queues reports and, at a refresh point, waits
for the ones it needs and learns no others. So a prefetch thread running ahead of the trainer
(by fewer than `lag` batches) cannot change which documents are kept. The batch sequence is a pure
function of the seed and the reported losses; two runs agree and a resumed run continues bitwise,
with or without prefetch (tested). The queued reports are part of the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from datapipe.core.config import ConfigError
from datapipe.loader.settings import check_integers, from_value

FEATURES = ("mean_log_freq", "log_length", "diversity", "rare_ratio", "std_log_freq")


@dataclass(frozen=True, kw_only=True)
class Prioritize:
    """Settings of loss-aware prioritization (see the module docstring)."""

    pool: int = 32  # candidate documents per selection
    keep: float = 0.5  # fraction of each pool kept (at least one document)
    temperature: float = 0.3  # in nats of predicted loss: lower = greedier
    floor: float = 0.2  # weight of the uniform distribution in the selection probabilities
    min_reports: int = 64  # documents reported before predictions are used
    forget: float = 0.999  # RLS forgetting factor per reported document
    refresh: int = 10  # batches between predictor snapshots handed to the planner
    lag: int = 8  # the snapshot taken at served batch b has learnt exactly the first b - lag loss reports
    ref_tokens: int = 1_000_000  # tokens of the unigram reference table
    rare_count: int = 2  # a token is rare when its reference count is at most this

    def __post_init__(self) -> None:
        check_integers(self, "prioritize", (("pool", 1), ("min_reports", 0), ("refresh", 1), ("lag", 0), ("ref_tokens", 1), ("rare_count", 0)))
        if not 0 < self.keep <= 1:
            raise ConfigError(f"prioritize.keep must be in (0, 1], got {self.keep!r}")
        if not self.temperature > 0:
            raise ConfigError(f"prioritize.temperature must be > 0, got {self.temperature!r}")
        if not 0 <= self.floor <= 1:
            raise ConfigError(f"prioritize.floor must be in [0, 1], got {self.floor!r}")
        if not 0 < self.forget <= 1:
            raise ConfigError(f"prioritize.forget must be in (0, 1], got {self.forget!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: "Prioritize | Mapping[str, Any] | bool | None") -> "Prioritize | None":
        return from_value(cls, value, "prioritize")


def reference_log_freq(token_arrays: Any, ref_tokens: int, vocab_size: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(log-frequency per token id with add-one smoothing, raw counts) from the first `ref_tokens` tokens."""
    parts, n = [], 0
    for arr in token_arrays:
        take = np.asarray(arr[: ref_tokens - n], dtype=np.int64)
        parts.append(take)
        n += len(take)
        if n >= ref_tokens:
            break
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    size = max(int(vocab_size or 0), int(tokens.max()) + 1 if tokens.size else 1)
    size = min(size, 1 << 22) if not vocab_size else size  # a synthetic 2**24 "vocab": count what is there
    counts = np.bincount(tokens[tokens < size], minlength=size).astype(np.float64)
    return np.log((counts + 1.0) / (counts.sum() + size)), counts


def features(tokens: np.ndarray, log_freq: np.ndarray, counts: np.ndarray, rare_count: int) -> np.ndarray:
    """The five static features of one document (see FEATURES)."""
    t = np.asarray(tokens, dtype=np.int64)
    if t.size == 0:
        return np.zeros(len(FEATURES))
    inside = t < len(log_freq)
    floor = float(np.log(1.0 / (counts.sum() + len(log_freq))))  # ids beyond the table: as unseen
    lf = np.where(inside, log_freq[np.minimum(t, len(log_freq) - 1)], floor)
    cnt = np.where(inside, counts[np.minimum(t, len(counts) - 1)], 0.0)
    return np.array([lf.mean(), np.log(t.size), np.unique(t).size / t.size, float(np.mean(cnt <= rare_count)),
                     lf.std()])


class LossPredictor:
    """Online RLS on standardised features plus bias; `snapshot()` is what the planner predicts with.

    The first `min_reports` documents are buffered; their mean and standard deviation fix the
    standardisation (so the regression's inputs mean the same thing throughout), then RLS runs over
    them and over every later report.
    """

    def __init__(self, cfg: Prioritize) -> None:
        self.cfg = cfg
        k = len(FEATURES) + 1
        self.n = 0
        self.buffer: list[list[float]] = []  # [features..., loss] until the standardisation is fixed
        self.mean = np.zeros(len(FEATURES))
        self.std = np.ones(len(FEATURES))
        self.w = np.zeros(k)
        self.P = np.eye(k) * 100.0

    @property
    def ready(self) -> bool:
        return self.n >= max(self.cfg.min_reports, 2)

    def update(self, feats: np.ndarray, losses: np.ndarray) -> None:
        for f, y in zip(np.asarray(feats, dtype=np.float64), np.asarray(losses, dtype=np.float64)):
            self.n += 1
            if not self.ready:
                self.buffer.append([*f.tolist(), float(y)])
                continue
            if self.n == max(self.cfg.min_reports, 2):  # fix the standardisation, fit the buffer
                rows = np.array(self.buffer + [[*f.tolist(), float(y)]])
                self.mean, self.std = rows[:, :-1].mean(0), rows[:, :-1].std(0) + 1e-6
                self.buffer = []
                for row in rows:
                    self._rls(row[:-1], row[-1])
            else:
                self._rls(f, y)

    def _rls(self, f: np.ndarray, y: float) -> None:
        lam = self.cfg.forget
        x = np.concatenate([[1.0], (f - self.mean) / self.std])
        Px = _dot(self.P, x)
        gain = Px / (lam + _dot(x, Px))
        self.w += gain * (y - _dot(x, self.w))
        self.P = (self.P - np.outer(gain, Px)) / lam

    def snapshot(self) -> dict[str, Any] | None:
        if not self.ready:
            return None
        return {"w": self.w.tolist(), "mean": self.mean.tolist(), "std": self.std.tolist()}

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "buffer": [list(r) for r in self.buffer], "mean": self.mean.tolist(),
                "std": self.std.tolist(), "w": self.w.tolist(), "P": self.P.tolist()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.n = int(state["n"])
        self.buffer = [[float(v) for v in r] for r in state["buffer"]]
        self.mean, self.std = np.array(state["mean"], dtype=np.float64), np.array(state["std"], dtype=np.float64)
        self.w, self.P = np.array(state["w"], dtype=np.float64), np.array(state["P"], dtype=np.float64)


def _dot(a: np.ndarray, x: np.ndarray) -> np.ndarray:
    """a @ x for a vector x, as exact products summed in a fixed order: BLAS's dot and gemv sum in an order (and
    with fused multiply-adds) that depend on the CPU's kernel and thread count, and the plan must not."""
    a = np.asarray(a, dtype=np.float64)
    total = a[..., 0] * x[0]
    for j in range(1, len(x)):  # elementwise, one rounding each, in column order: no BLAS kernel or thread count decides it
        total = total + a[..., j] * x[j]
    return total


def predict(snapshot: Mapping[str, Any], feats: np.ndarray) -> np.ndarray:
    """Predicted loss of each row of `feats` under a predictor snapshot."""
    w = np.asarray(snapshot["w"])
    z = (np.asarray(feats) - np.asarray(snapshot["mean"])) / np.asarray(snapshot["std"])
    return w[0] + _dot(z, w[1:])


def select(n: int, pred: np.ndarray | None, keep: int, cfg: Prioritize, rng: np.random.Generator) -> np.ndarray:
    """Indices of the `keep` kept candidates among n, in selection order: uniform without predictions."""
    if pred is None:
        return rng.choice(n, size=keep, replace=False)
    p = selection_probs(pred, cfg)
    return rng.choice(n, size=keep, replace=False, p=p / p.sum())


def selection_probs(pred: np.ndarray, cfg: Prioritize) -> np.ndarray:
    """The first-draw probabilities of `select` (for tests and reporting)."""
    soft = np.exp((pred - pred.max()) / cfg.temperature)
    return (1 - cfg.floor) * soft / soft.sum() + cfg.floor / len(pred)
