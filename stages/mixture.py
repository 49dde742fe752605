"""Mixture reweighting: hit target domain shares by deterministic down- and up-sampling.

Targets come from explicit weights, or from the natural token counts n_d by temperature sampling
(p_d ∝ n_d^(1/T); T = 1 keeps the natural mixture, large T tends to uniform) or UniMax (Chung et
al., 2023: the budget spread uniformly over the domains, none repeated more than `max_epochs`
times, what a small domain cannot take going to the others). The budget is `budget_tokens`, or the
natural total when null.

Each domain gets a rate r_d = target tokens / natural tokens. A document is written
floor(r_d) times, plus once more when its seeded hash falls below frac(r_d): down-sampling
(r_d < 1) keeps a hash-chosen subset, up-sampling repeats documents — never more than
`max_epochs` times. A domain whose target needs more epochs than that is **capped and reported**
(`capped: true`, realised share below target), not silently distorted. The realised token counts
are computed exactly from the documents' token counts and recorded beside the targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from datapipe.core.config import ConfigError, check, note
from stages.sampling import seeded_rank


@dataclass(frozen=True, kw_only=True)
class MixtureConfig:
    enabled: bool = note(False, help="reweight the domain mixture before writing shards")
    method: Literal["explicit", "temperature", "unimax"] = note("temperature", help="how the target shares are set")
    weights: dict[str, float] = note({}, help="explicit: domain -> weight (normalised to shares)")
    temperature: float = note(1.0, help="temperature: p_d proportional to n_d^(1/T)")
    budget_tokens: int | None = note(None, help="total tokens to write (null = the natural total)")
    max_epochs: float = note(4.0, help="no document is written more than this many times (rounded up per document)")
    seed: int = note(0, help="seed of the hash that picks which documents are kept or repeated")

    def __post_init__(self) -> None:
        check(self.temperature > 0, f"temperature must be > 0, got {self.temperature!r}")
        check(self.max_epochs >= 1, f"max_epochs must be >= 1, got {self.max_epochs!r}")
        if self.budget_tokens is not None:
            check(self.budget_tokens > 0, f"budget_tokens must be > 0, got {self.budget_tokens!r}")
        for domain, w in self.weights.items():
            check(w >= 0, f"weights.{domain} must be >= 0, got {w!r}")
        if self.method == "explicit":
            check(sum(self.weights.values()) > 0, "weights must give at least one domain a positive weight for method 'explicit'")


def target_shares(natural: dict[str, int], config: MixtureConfig) -> dict[str, float]:
    """Target token share per domain (sums to 1)."""
    domains = sorted(d for d, n in natural.items() if n > 0)
    if config.method == "explicit":
        unknown = sorted(set(config.weights) - set(natural))
        missing = [d for d in domains if d not in config.weights]
        if unknown or missing:
            raise ConfigError(
                f"mixture.weights must name exactly the domains in the data {domains}; "
                f"unknown: {unknown}, missing: {missing}"
            )
        raw = {d: config.weights[d] for d in domains}
    elif config.method == "temperature":
        raw = {d: natural[d] ** (1.0 / config.temperature) for d in domains}
    else:  # unimax
        budget = config.budget_tokens or sum(natural.values())
        alloc, left = {}, float(budget)
        by_size = sorted(domains, key=lambda d: (natural[d], d))
        for i, d in enumerate(by_size):
            fair = left / (len(by_size) - i)
            alloc[d] = min(fair, config.max_epochs * natural[d])
            left -= alloc[d]
        raw = alloc
    total = sum(raw.values())
    return {d: raw[d] / total for d in domains}


def plan(natural: dict[str, int], config: MixtureConfig) -> dict[str, dict[str, Any]]:
    """Per domain: natural tokens, target share, sampling rate (epochs) and whether it was capped."""
    shares = target_shares(natural, config)
    budget = config.budget_tokens or sum(natural.values())
    out = {}
    for d, share in shares.items():
        wanted = share * budget / natural[d]
        rate = min(wanted, config.max_epochs)
        out[d] = {"natural_tokens": natural[d], "target_share": share, "rate": rate, "capped": wanted > config.max_epochs + 1e-12}
    return out


def copies(ids: list[str], rate: float, seed: int) -> np.ndarray:
    """How many times each document is written at sampling rate `rate` (deterministic per id)."""
    whole = math.floor(rate)
    frac = rate - whole
    u = seeded_rank(ids, seed)
    extra = (u.astype(np.float64) / 2.0**64) < frac
    return (whole + extra).astype(np.int64)


def realised(plan_: dict[str, dict[str, Any]], written: dict[str, int]) -> dict[str, dict[str, Any]]:
    """The manifest's mixture entry: targets beside what was written."""
    total = sum(written.values()) or 1
    return {
        d: {
            "natural_tokens": p["natural_tokens"],
            "target_share": round(p["target_share"], 6),
            "realised_tokens": written.get(d, 0),
            "realised_share": round(written.get(d, 0) / total, 6),
            "epochs": round(written.get(d, 0) / p["natural_tokens"], 4) if p["natural_tokens"] else 0.0,
            "capped": p["capped"],
        }
        for d, p in plan_.items()
    }
