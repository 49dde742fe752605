"""Mixture and curriculum schedules for the streaming loader.

- `MixtureSchedule`: domain weights as a function of **tokens consumed** (global, all ranks), given as
  phases `[{"start_tokens": 0, "weights": {...}}, ...]` and interpolated between phase starts
  (`constant`: a step at each start; `linear`; `cosine`: half a cosine from one phase's weights to
  the next). Progress in tokens, not steps, keeps the schedule independent of batch size, gradient
  accumulation and world size.
- `DeficitSampler`: picks the domain of the next document. Each document of n tokens adds
  `w_d * n` of credit to every eligible domain d (weights taken at the current position, so the
  credit is the integral of the schedule), and the chosen domain is the one whose served tokens lag
  their credit most. Realised token shares then match the weights to within about one document per
  domain at every point, instead of the O(sqrt(n)) drift of drawing domains at random, and weighting
  by tokens rather than documents keeps a domain of long documents from being over-served. There is
  no random state to save: the sampler's state is its credit and served counters (ties go to the
  first domain by name). Documents within a domain are shuffled by the loader.
- `Curriculum`: orders each domain's documents by a numeric shard column (e.g. `num_tokens`, or a
  per-document loss written by a scoring pass) from easy (low) to hard within every pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from datapipe.core.config import ConfigError

INTERPOLATIONS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Phase:
    start_tokens: int  # global tokens consumed (all ranks) at which these weights hold exactly
    weights: Mapping[str, float]  # domain -> relative weight (≥ 0; normalised; absent domains get 0)


def _check_weights(name: str, weights: Any) -> dict[str, float]:
    if not isinstance(weights, Mapping) or not weights:
        raise ConfigError(f"{name} must be a non-empty mapping of domain to weight, got {weights!r}")
    out = {}
    for domain, w in weights.items():
        if not isinstance(domain, str):
            raise ConfigError(f"{name} keys must be domain names (str), got {domain!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"{name}[{domain!r}] must be a finite number ≥ 0, got {w!r}")
        out[domain] = float(w)
    if sum(out.values()) <= 0:
        raise ConfigError(f"{name} must have a positive weight for at least one domain, got {weights!r}")
    return out


class MixtureSchedule:
    """Domain weights as a function of global tokens consumed."""

    def __init__(self, phases: Sequence[Phase | Mapping[str, Any]], *, interpolation: str = "constant") -> None:
        if interpolation not in INTERPOLATIONS:
            raise ConfigError(f"interpolation must be one of {set(INTERPOLATIONS)}, got {interpolation!r}")
        if isinstance(phases, (str, bytes, Mapping)) or not isinstance(phases, Sequence) or not phases:
            raise ConfigError(f"phases must be a non-empty list of phases, got {phases!r}")
        parsed: list[Phase] = []
        for i, ph in enumerate(phases):
            if isinstance(ph, Mapping):
                unknown = set(ph) - {"start_tokens", "weights"}
                if unknown:
                    raise ConfigError(f"phases[{i}] has unknown keys {sorted(unknown)!r}; allowed: 'start_tokens', 'weights'")
                ph = Phase(ph.get("start_tokens", 0), ph.get("weights"))  # type: ignore[arg-type]
            elif not isinstance(ph, Phase):
                raise ConfigError(f"phases[{i}] must be a Phase or a mapping, got {ph!r}")
            start = ph.start_tokens
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ConfigError(f"phases[{i}].start_tokens must be an integer ≥ 0, got {start!r}")
            if i == 0 and start != 0:
                raise ConfigError(f"phases[0].start_tokens must be 0, got {start!r}")
            if i and start <= parsed[-1].start_tokens:
                raise ConfigError(
                    f"phases[{i}].start_tokens must be greater than phases[{i - 1}].start_tokens="
                    f"{parsed[-1].start_tokens}, got {start!r}")
            parsed.append(Phase(start, _check_weights(f"phases[{i}].weights", ph.weights)))
        self.phases: tuple[Phase, ...] = tuple(parsed)
        self.interpolation = interpolation
        self.domains: tuple[str, ...] = tuple(sorted({d for ph in parsed for d in ph.weights}))

    @classmethod
    def constant(cls, weights: Mapping[str, float]) -> "MixtureSchedule":
        return cls([Phase(0, weights)])

    @classmethod
    def natural(cls, manifest: Mapping[str, Any]) -> "MixtureSchedule":
        """Weights proportional to each domain's tokens in the manifest."""
        totals = {d: float(c["tokens"]) for d, c in manifest.get("domains", {}).items() if c.get("tokens", 0) > 0}
        if not totals:
            raise ConfigError("manifest['domains'] must list at least one domain with tokens, got none")
        return cls.constant(totals)

    def weights_at(self, tokens: float) -> dict[str, float]:
        """Normalised weights (summing to 1) over `self.domains` after `tokens` global tokens."""
        phases = self.phases
        i = 0
        while i + 1 < len(phases) and phases[i + 1].start_tokens <= tokens:
            i += 1
        raw = {d: phases[i].weights.get(d, 0.0) for d in self.domains}
        if self.interpolation != "constant" and i + 1 < len(phases):
            a, b = phases[i], phases[i + 1]
            frac = (tokens - a.start_tokens) / (b.start_tokens - a.start_tokens)
            if self.interpolation == "cosine":
                frac = (1.0 - math.cos(math.pi * frac)) / 2.0
            wa, wb = _normalise(raw), _normalise({d: b.weights.get(d, 0.0) for d in self.domains})
            raw = {d: wa[d] + (wb[d] - wa[d]) * frac for d in self.domains}
        return _normalise(raw)

    def steady_until(self, tokens: float) -> float:
        """The global token count before which `weights_at` stays what it is at `tokens` (`tokens` itself
        where the weights move with every token: between two phases of a linear or cosine schedule)."""
        phases = self.phases
        i = 0
        while i + 1 < len(phases) and phases[i + 1].start_tokens <= tokens:
            i += 1
        if i + 1 == len(phases):
            return math.inf
        return phases[i + 1].start_tokens if self.interpolation == "constant" else tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "interpolation": self.interpolation,
            "phases": [{"start_tokens": p.start_tokens, "weights": dict(sorted(p.weights.items()))} for p in self.phases],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "MixtureSchedule":
        unknown = set(data) - {"interpolation", "phases"}
        if unknown:
            raise ConfigError(f"mixture has unknown keys {sorted(unknown)!r}; allowed: 'interpolation', 'phases'")
        return cls(data.get("phases", []), interpolation=data.get("interpolation", "constant"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MixtureSchedule) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"MixtureSchedule({self.to_dict()!r})"


def _normalise(weights: Mapping[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {d: (w / total if total > 0 else 0.0) for d, w in weights.items()}


class DeficitSampler:
    """Chooses the domain whose served tokens lag their scheduled share the most (see module docstring)."""

    def __init__(self, domains: Sequence[str]) -> None:
        self.domains = tuple(domains)
        self.credit = {d: 0.0 for d in self.domains}
        self.served = {d: 0 for d in self.domains}

    def choose(self, weights: Mapping[str, float], eligible: Iterable[str]) -> str | None:
        """The next domain among `eligible` with a positive weight; None when there is none."""
        best, best_lag = None, -math.inf
        for d in eligible:  # in self.domains order, so ties go to the first by name
            if weights.get(d, 0.0) <= 0:
                continue
            lag = self.credit[d] - self.served[d]
            if lag > best_lag:
                best, best_lag = d, lag
        return best

    def record(self, domain: str, tokens: int, weights: Mapping[str, float], eligible: Iterable[str]) -> None:
        """Account `tokens` served from `domain`; credit every eligible domain its share of them."""
        eligible = [d for d in eligible if weights.get(d, 0.0) > 0]
        total = sum(weights[d] for d in eligible)
        for d in eligible:
            self.credit[d] += weights[d] / total * tokens
        self.served[domain] += tokens

    def reset(self) -> None:
        self.credit = {d: 0.0 for d in self.domains}
        self.served = {d: 0 for d in self.domains}

    def state_dict(self) -> dict[str, Any]:
        return {"credit": dict(self.credit), "served": dict(self.served)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.credit = {d: float(state["credit"][d]) for d in self.domains}
        self.served = {d: int(state["served"][d]) for d in self.domains}


@dataclass(frozen=True)
class Curriculum:
    """Order each domain's documents by a numeric shard column, easy (low) to hard, within each pass."""

    column: str = "num_tokens"  # a numeric column of the shards (e.g. num_tokens, or a scoring pass's loss)
    descending: bool = False  # True: high scores first

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ConfigError(f"curriculum.column must be a column name, got {self.column!r}")
        if self.column in ("id", "domain", "tokens"):
            raise ConfigError(f"curriculum.column must be a numeric column, got {self.column!r}")
        if not isinstance(self.descending, bool):
            raise ConfigError(f"curriculum.descending must be a bool, got {self.descending!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"column": self.column, "descending": self.descending}
