"""The pre-registered analysis of the selection experiment: its interval and its crossing, by hand."""

from __future__ import annotations

import math

import pytest

from scripts.analyze_selection import crossing, t_interval

T_975_DF2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # the t quantile with 2 degrees of freedom, in closed form


def test_t_interval_of_three_pools_by_hand():
    got = t_interval([0.0, 0.1, -0.1])  # mean 0, sd 0.1
    half = T_975_DF2 * 0.1 / math.sqrt(3)
    assert got["ratio"] == pytest.approx(1.0)
    assert got["low"] == pytest.approx(math.exp(-half)) and got["high"] == pytest.approx(math.exp(half))


def test_one_pool_has_a_point_and_no_interval():
    assert t_interval([math.log(0.5)]) == {"ratio": pytest.approx(0.5), "low": None, "high": None, "n": 1}


def test_crossing_interpolates_tokens_and_flops_between_evaluations():
    curve = [(100.0, 5.0, 1e3), (200.0, 4.0, 2e3), (300.0, 3.0, 3e3)]
    assert crossing(curve, 3.5) == (pytest.approx(250.0), pytest.approx(2.5e3))
    assert crossing(curve, 5.5) == (100.0, 1e3)  # reached at the first evaluation
    assert crossing(curve, 2.0) is None  # never reached: censored
