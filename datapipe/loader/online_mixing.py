"""Online Data Mixing (ODM): an EXP3 bandit over domains, rewarded by their training loss, sets the mixture weights.

    from datapipe.loader import PackedLoader
    from datapipe.loader.online_mixing import OnlineMixing
    loader = PackedLoader("out/", seq_len=128, batch_size=16, epochs=None, online_mixing=OnlineMixing())
    for batch in loader:
        ...                                   # forward/backward, per-document mean losses
        loader.report_losses(doc_ids, losses)  # rewards the domains of those documents

The method (Albalak, Pan, Raffel, Wang 2023, "Efficient Online Data Mixing For Language Model
Pre-Training", arXiv:2312.02406, Algorithm 1; the authors' code: github.com/alon-albalak/online-data-mixing).
Each of the K domains is an arm of an adversarial multi-armed bandit (EXP3). A domain's reward is
its training loss: a domain the model still finds hard has more to teach. At round t the policy is

    ε_t      = min(1/K, sqrt(ln K / (K t)))                       (exploration rate, ε_0 = 1/K)
    π_t(i)   = (1 - K ε_t) · p_i exp(ε_{t-1} R̂_i) / Σ_j p_j exp(ε_{t-1} R̂_j) + ε_t

and after the round, for every domain i whose documents the round's batch held,

    R̂_i ← α R̂_i + (1 - α) · L_i / π_t(i)

the loss importance-weighted by the inverse of the probability the domain had (the EXP3 estimator),
smoothed by a moving average (ODM's change to EXP3's cumulative sum, since the loss is not
stationary). Every domain keeps at least ε_t of the mixture: nothing starves.

What the paper leaves open, and what this module does:
  - A round is one `report_losses` call: one loader batch (one micro-batch of the trainer). The
    batch mixes domains (the paper's "mixed minibatches" variant): L_i is the mean, over the
    batch's documents of domain i, of their reported per-document mean losses; domains absent from
    the batch keep their R̂.
  - The prior p: the loader's `mixture` (one constant phase), or the manifest's token shares
    without one. The paper starts from uniform weights (p_i = 1/K gives its formula exactly); a
    prior p multiplies the exponential weights, as EXP3 started from weights p. Domains of prior
    weight 0 are not arms (never served); K counts the others.
  - `warmup`: the policy is the prior until this many rounds are learnt (rewards are learnt
    during the warmup, importance-weighted by the prior); t keeps counting through it, as in the
    authors' code (2,000 warmup steps of 100,000 there). With `warmup=0` the first rounds are
    uniform (ε_t = 1/K while t ≤ K ln K), as in Algorithm 1.
  - No reward rescaling: R̂ is in nats / probability (the authors' cumulative-sum EXP3 code divides
    the loss by 10).
  - With several ranks each rank's bandit learns from the losses of its own batches (no
    all-reduce): the ranks' mixtures are alike but not equal.

Serving. The policy replaces the mixture weights the planner's `DeficitSampler` uses, so realised
token shares follow π within about a document per domain (domains are interleaved, not drawn at
random). Since the weights change during the run, each domain restarts its next pass on its own
(the loader's mixture mode, even without a `mixture`): an epoch is ceil(total_tokens / world_size)
tokens of the rank.

Determinism and resume, exactly as prioritization (datapipe/loader/prioritize.py): the planner
uses a *snapshot* of the policy, renewed every `refresh` served batches; the snapshot taken at
served batch b has learnt exactly the first b - `lag` reports (the loader queues reports in
`feedback.LossFeedback` and waits for the ones it needs), so a prefetch thread running ahead by
fewer than `lag` batches cannot change the batches. The bandit, its queued reports and the snapshot
in use are part of the loader state; a resumed run continues bitwise (tested). The importance
weight of a round is the bandit's own policy at that round; the planner serves a snapshot at most
`refresh + lag` rounds older (with `refresh=1, lag=0` and no prefetch, the policy of each batch).

ODM's static baseline. `time_averaged_weights(RUN_DIR)` reads a finished run's loader states and returns the
shares of the tokens it trained on per domain (`served_weights`): the policy averaged over the run. Training with
those as a fixed mixture (`data.mixture`, the `odm-static` arm of scripts/experiment_prioritization.py) tells a
better static mixture apart from online adaptivity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from datapipe.core.config import ConfigError
from datapipe.loader.settings import check_integers, from_value
from datapipe.loader.reader import Layout, Reader


@dataclass(frozen=True, kw_only=True)
class OnlineMixing:
    """Settings of online data mixing (see the module docstring)."""

    alpha: float = 0.9  # smoothing of the reward moving average: R̂ ← α R̂ + (1 - α) L / π
    warmup: int = 0  # rounds (loss reports) learnt under the prior before the bandit steers
    refresh: int = 10  # batches between policy snapshots handed to the planner (1: every batch, as the paper)
    lag: int = 8  # the snapshot taken at served batch b has learnt exactly the first b - lag loss reports

    def __post_init__(self) -> None:
        check_integers(self, "online_mixing", (("warmup", 0), ("refresh", 1), ("lag", 0)))
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 <= self.alpha < 1:
            raise ConfigError(f"online_mixing.alpha must be a number in [0, 1), got {self.alpha!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_value(cls, value: "OnlineMixing | Mapping[str, Any] | bool | None") -> "OnlineMixing | None":
        return from_value(cls, value, "online_mixing")


def exploration(t: int, k: int) -> float:
    """ε_t = min(1/K, sqrt(ln K / (K t))); ε_0 = 1/K."""
    if t <= 0:
        return 1.0 / k
    return min(1.0 / k, math.sqrt(math.log(k) / (k * t)))


class DomainBandit:
    """The EXP3 state: the smoothed importance-weighted reward R̂ of each domain and the rounds learnt.

    domains: every domain of the manifest (the policy names them all); prior: their weights (≥ 0,
    normalised here); the arms are the domains of positive prior weight.
    """

    def __init__(self, cfg: OnlineMixing, domains: Sequence[str], prior: Mapping[str, float]) -> None:
        self.cfg = cfg
        self.domains = tuple(domains)
        p = np.array([float(prior.get(d, 0.0)) for d in self.domains])
        if not p.sum() > 0:
            raise ConfigError(f"online_mixing needs a prior with a positive weight on a domain of {list(self.domains)!r}, "
                              f"got {dict(prior)!r}")
        self.prior = p / p.sum()
        self.arms = self.prior > 0
        self.k = int(self.arms.sum())
        self.reward = np.zeros(len(self.domains))  # R̂ per domain (0 on non-arms)
        self.rounds = 0  # reports learnt

    def policy(self) -> np.ndarray:
        """π of the next round (round t = rounds + 1), one probability per domain."""
        if self.rounds < self.cfg.warmup:
            return self.prior.copy()
        t = self.rounds + 1
        eps, eps_prev = exploration(t, self.k), exploration(t - 1, self.k)
        logits = np.where(self.arms, np.log(np.where(self.arms, self.prior, 1.0)) + eps_prev * self.reward, -np.inf)
        soft = np.exp(logits - logits[self.arms].max())
        pi = (1.0 - self.k * eps) * soft / soft.sum() + eps
        return np.where(self.arms, pi, 0.0)

    def update(self, domain_index: np.ndarray, losses: np.ndarray) -> None:
        """Learn one round: per-document domain indices and mean losses of one report."""
        pi = self.policy()
        idx, vals = np.asarray(domain_index, dtype=np.int64), np.asarray(losses, dtype=np.float64)
        for i in np.unique(idx).tolist():
            if not self.arms[i]:
                continue  # a domain of prior weight 0 is not an arm (its documents are never served)
            loss = float(vals[idx == i].mean())
            self.reward[i] = self.cfg.alpha * self.reward[i] + (1.0 - self.cfg.alpha) * loss / pi[i]
        self.rounds += 1

    def snapshot(self) -> dict[str, float]:
        """The mixture weights the planner serves: {domain: π}."""
        return dict(zip(self.domains, self.policy().tolist()))

    def state_dict(self) -> dict[str, Any]:
        return {"reward": self.reward.tolist(), "rounds": self.rounds}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        reward = np.array(state["reward"], dtype=np.float64)
        if reward.shape != self.reward.shape:
            raise ConfigError(f"online_mixing state holds {reward.size} domain rewards, this manifest has "
                              f"{len(self.domains)} domains")
        self.reward, self.rounds = reward, int(state["rounds"])


def doc_domains(layout: Layout, reader: Reader, docs: Sequence[int] | np.ndarray) -> np.ndarray:
    """The index (in `layout.domains`) of each document's domain; reads the domain column of mixed shards only."""
    docs = np.asarray(docs, dtype=np.int64)
    out = np.full(len(docs), -1, dtype=np.int64)
    if not len(docs):
        return out
    shard = np.searchsorted(layout.offsets, docs, side="right") - 1
    for s in np.unique(shard[(docs >= 0) & (docs < layout.offsets[-1])]).tolist():  # ids beyond the manifest: -1
        mask = shard == s
        rows = docs[mask] - int(layout.offsets[s])
        here = np.full(len(rows), -1, dtype=np.int64)
        for i, d in enumerate(layout.domains):
            if layout.domain_docs[d][s] > 0:
                here[np.isin(rows, reader.domain_rows(s, d))] = i
        out[mask] = here
    return out


def served_weights(states: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The domain shares of the tokens that loader states (`PackedLoader.state_dict()`, one per rank) have served:
    their `stats.domain_tokens` summed over the ranks, normalized. Of an online-mixing run's states at its end
    (the trainer's checkpoint holds the position of the last batch trained on), these are the bandit's policy
    averaged over the run by tokens (by steps: every step serves the same rows), up to a document per domain,
    since the planner serves the policy's weights: the static mixture an `odm-static` arm trains with to tell a
    better fixed mixture from online adaptivity."""
    totals: dict[str, int] = {}
    for state in states:
        for domain, n in state["stats"]["domain_tokens"].items():
            totals[domain] = totals.get(domain, 0) + int(n)
    total = sum(totals.values())
    if not total:
        raise ConfigError("the loader states have served no tokens: no weights to average")
    return {d: n / total for d, n in sorted(totals.items())}


def time_averaged_weights(run_dir: str | Path, key: str = "loaders") -> dict[str, float]:
    """`served_weights` of a finished training run: the loader states in RUN_DIR/checkpoint.pt (under `key`, the
    LM trainer's; one per rank). A missing checkpoint is a ConfigError naming it."""
    path = Path(run_dir) / "checkpoint.pt"
    if not path.is_file():
        raise ConfigError(f"time_averaged_weights needs a finished run's checkpoint; {str(path)!r} does not exist")
    states = torch.load(path, map_location="cpu", weights_only=True).get(key)
    if not states:
        raise ConfigError(f"{str(path)!r} holds no loader states under {key!r} (not an LM training run?)")
    return served_weights(states)
