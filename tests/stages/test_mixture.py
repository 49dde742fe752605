"""Mixture targets (explicit, temperature, UniMax), the epoch cap, and deterministic sampling."""

from __future__ import annotations

import numpy as np
import pytest

from datapipe.core.config import ConfigError
from stages.mixture import MixtureConfig, copies, plan, realised, target_shares

NATURAL = {"web": 8_000_000, "code": 1_500_000, "books": 400_000, "math": 100_000}


def test_temperature_one_is_natural_and_large_t_tends_to_uniform():
    natural = target_shares(NATURAL, MixtureConfig(method="temperature", temperature=1.0))
    total = sum(NATURAL.values())
    assert all(abs(natural[d] - n / total) < 1e-12 for d, n in NATURAL.items())
    flat = target_shares(NATURAL, MixtureConfig(method="temperature", temperature=100.0))
    assert max(flat.values()) - min(flat.values()) < 0.05


def test_unimax_is_uniform_under_the_epoch_cap():
    shares = target_shares(NATURAL, MixtureConfig(method="unimax", max_epochs=4.0))
    budget = sum(NATURAL.values())
    # math (100k tokens) takes at most 4 epochs = 400k, books at most 1.6M; web and code split the rest
    assert shares["math"] * budget == pytest.approx(400_000)
    assert shares["books"] * budget == pytest.approx(1_600_000)
    assert shares["web"] * budget == pytest.approx(4_000_000) and shares["code"] == pytest.approx(shares["web"])


def test_explicit_weights_must_name_the_domains():
    with pytest.raises(ConfigError, match=r"unknown: \['wiki'\], missing: \['books', 'math'\]"):
        target_shares(NATURAL, MixtureConfig(method="explicit", weights={"web": 1, "code": 1, "wiki": 1}))


def test_a_target_beyond_the_epoch_cap_is_capped_and_reported():
    p = plan(NATURAL, MixtureConfig(method="explicit", weights={"web": 1, "code": 1, "books": 1, "math": 1}, max_epochs=3))
    assert p["math"]["capped"] and p["math"]["rate"] == 3
    assert not p["web"]["capped"] and p["web"]["rate"] == pytest.approx(0.3125)


def test_copies_realise_the_rate_deterministically():
    ids = [f"doc{i}" for i in range(20000)]
    for rate in (0.25, 1.0, 2.6):
        c = copies(ids, rate, seed=3)
        assert np.array_equal(c, copies(ids, rate, seed=3))
        assert c.min() >= int(rate) and c.max() <= int(rate) + 1
        assert c.mean() == pytest.approx(rate, abs=0.02)
    assert not np.array_equal(copies(ids, 0.5, seed=3), copies(ids, 0.5, seed=4))


def test_realised_shares_sum_to_one():
    p = plan(NATURAL, MixtureConfig(method="temperature", temperature=2.0, max_epochs=100))
    r = realised(p, {d: int(v["rate"] * v["natural_tokens"]) for d, v in p.items()})
    assert sum(v["realised_share"] for v in r.values()) == pytest.approx(1.0, abs=1e-5)
    assert all(abs(v["realised_share"] - v["target_share"]) < 1e-3 for v in r.values())
