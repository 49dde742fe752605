"""The pool count of the second selection experiment: its power against a simulation of the t-interval itself."""

from __future__ import annotations

import math

import numpy as np
import scipy.stats

from scripts.selection_power import BOUND, TRUE_RATIO, pays_rate, pools_needed, power


def _simulated_power(n: int, sd: float, draws: int = 100_000) -> float:
    x = np.random.default_rng(1).normal(math.log(TRUE_RATIO), sd, size=(draws, n))
    upper = x.mean(1) + scipy.stats.t.ppf(0.975, n - 1) * x.std(1, ddof=1) / math.sqrt(n)
    return float(np.mean(upper < math.log(BOUND)))


def test_power_is_the_rate_at_which_simulated_intervals_fall_below_the_bound():
    for n, sd in ((8, 0.2746), (20, 0.15)):
        assert abs(power(n, sd) - _simulated_power(n, sd)) < 0.006  # 4 standard errors of 100,000 draws


def test_pools_needed_is_the_first_count_at_80_percent_and_the_pays_rule_caps_at_half():
    n = pools_needed(0.2)
    assert power(n - 1, 0.2) < 0.8 <= power(n, 0.2)
    assert abs(pays_rate(n, 0.2) - 0.5) < 0.05  # the point condition, at a true ratio of exactly 0.8
