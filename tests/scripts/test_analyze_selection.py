"""The pre-registered analysis of the selection experiment: its interval and its crossing, by hand."""

from __future__ import annotations

import math

import pytest

from scripts.analyze_selection import COMPARISONS, compare, crossing, t_interval

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


REFERENCE = [(100.0, 5.0, 1e3), (200.0, 4.0, 2e3), (300.0, 3.0, 3e3), (400.0, 2.0, 4e3)]  # trains to 400 tokens


def test_a_pool_s_comparison_by_hand():
    """The target is the reference's loss at half its final tokens (200 tokens: 4.0, at 2,000 FLOPs, plus its own 500
    selection FLOPs); the arm crosses 4.0 halfway from 100 to 200 tokens (1,500 FLOPs), plus its 1,000 selection
    FLOPs: 2,500 against 2,500, in 150 tokens against 200."""
    arm = [(100.0, 4.5, 1e3), (200.0, 3.5, 2e3), (300.0, 3.0, 3e3), (400.0, 2.5, 4e3)]
    got = compare(arm, 1000.0, REFERENCE, 500.0)
    assert got["target_loss"] == pytest.approx(4.0) and got["bound"] is None
    assert got["flops"] == pytest.approx(2500.0) and got["log_flops_ratio"] == pytest.approx(0.0)
    assert got["log_tokens_ratio"] == pytest.approx(math.log(150 / 200))


def test_floors_and_censored_pools_are_flagged_at_their_bound():
    below_at_once = [(100.0, 3.9, 1e3), (200.0, 3.0, 2e3), (300.0, 2.0, 3e3), (400.0, 1.0, 4e3)]
    floor = compare(below_at_once, 0.0, REFERENCE, 0.0)
    assert floor["bound"] == "floor" and floor["log_flops_ratio"] == pytest.approx(math.log(1e3 / 2e3))  # an upper bound
    never = [(100.0, 6.0, 1e3), (200.0, 5.5, 2e3), (300.0, 5.0, 3e3), (400.0, 4.5, 4e3)]
    censored = compare(never, 0.0, REFERENCE, 0.0)
    assert censored["bound"] == "censored" and censored["log_flops_ratio"] == pytest.approx(math.log(4e3 / 2e3))  # a lower bound


def test_the_reference_is_each_selector_s_mixture_matched_arm_as_well_as_random():
    assert ("classifier", "mm_classifier") in COMPARISONS and ("classifier", "random") in COMPARISONS
    assert all(reference in ("random", f"mm_{arm}") for arm, reference in COMPARISONS)
