"""Exact answers for the experiment analysis (datapipe/train/experiment.py): the paired percentile bootstrap of the
ratio of means (`bootstrap_ratio`, checked against the resampling distribution enumerated in plain Python, not
against numpy; kept beside the t-interval as `bootstrap_ci95`), and `summarize` on hand-built curves whose
crossings, bounds, geometric means and intervals are worked out by hand:
an arm whose seeds all reach a target (an estimate), one with a seed that never does (a lower bound), a baseline
seed that never does (an upper bound), and both (censored_both)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction as F

import pytest

from datapipe.train.experiment import (BOOTSTRAP_RESAMPLES, ArmConfig, BudgetConfig, ExperimentConfig, bootstrap_ratio,
                                       summarize)


def _resampling_distribution(stat, n: int) -> list:
    """The statistic over every one of the n**n equally likely resamples of n seeds with replacement, sorted."""
    return sorted(stat(t) for t in itertools.product(range(n), repeat=n))


def _quantile(values: list, p: float):
    """The p-quantile (inverse CDF: the smallest value v with P(X <= v) >= p) of the uniform distribution over
    `values` (sorted): the value that the p-quantile of a large sample from it converges to."""
    return values[max(math.ceil(p * len(values)) - 1, 0)]


def _ratio_of_means(arm, base):
    return lambda t: F(sum(arm[i] for i in t), sum(base[i] for i in t))


# t(0.975) with 2 degrees of freedom, not computed by scipy: with df = 2 the quantile has the closed form
# (2p - 1) / sqrt(2p(1 - p)) = 0.95 / sqrt(0.04875) (checked in tests/datapipe/test_experiment.py)
T_975_2 = 4.302652729749464


def _t_interval_of_three(ratios) -> list:
    """exp(mean log r -+ t(0.975, 2) x sd(log r) / sqrt(3)): the 95% t-interval of the geometric mean of 3 ratios."""
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / 3
    half = T_975_2 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
    return [math.exp(mean - half), math.exp(mean + half)]


# --- bootstrap_ratio -------------------------------------------------------------------------------------------------

def test_bootstrap_with_three_seeds_is_exactly_the_range_of_the_per_seed_ratios():
    """n = 3: the 27 paired resamples are equally likely, each of mass 1/27 > 2.5%, so the exact distribution's 2.5%
    and 97.5% quantiles are its smallest and largest values; with 10,000 draws the smallest value is drawn ~370 times
    (>> the 250 under the 2.5% point), so the function must return them exactly. A ratio of sums is a mediant of the
    per-seed ratios, so those extremes are the resamples (i, i, i): the "95%" interval of 3 seeds is the range of the
    3 per-seed ratios (a range that holds the true mean ratio only ~75% of the time for a symmetric spread)."""
    arm, base = [6, 9, 4], [8, 10, 8]  # per-seed ratios 0.75, 0.9, 0.5
    exact = _resampling_distribution(_ratio_of_means(arm, base), 3)
    assert len(exact) == 27
    lo, hi = _quantile(exact, 0.025), _quantile(exact, 0.975)
    assert (lo, hi) == (exact[0], exact[-1]) == (F(1, 2), F(9, 10))  # the per-seed ratios' min and max
    assert bootstrap_ratio(arm, base) == [float(lo), float(hi)] == [0.5, 0.9]
    # paired: one draw of seed indices for both lists. Resampled independently, the lower end would be pulled
    # towards min(arm) / max(base) = 0.4, below every per-seed ratio; and the interval depends on the pairing
    assert bootstrap_ratio([6, 9, 4], [10, 8, 8]) == [0.5, 1.125]
    # the point of paired_ratio is the ratio of the means (19/26) and lies inside
    assert 0.5 < 19 / 26 < 0.9


def test_bootstrap_with_five_seeds_matches_the_quantiles_of_the_enumerated_ratio_of_means():
    """n = 5: 3,125 equally likely resamples, the quantiles now inside the distribution. The sample 2.5% quantile
    of 10,000 draws has a standard error of sqrt(.025 x .975 / 10,000) = 0.0016 in probability: it must lie between
    the exact distribution's quantiles at 2.5% -/+ 5 of those (and likewise at 97.5%). The brackets of the other
    statistics a "ratio" interval could have used (mean of the per-seed ratios, their geometric mean) do not hold
    the answer, so the test tells them apart."""
    arm, base = [30, 12, 25, 9, 40], [20, 15, 10, 12, 60]
    n, se = len(arm), math.sqrt(0.025 * 0.975 / BOOTSTRAP_RESAMPLES)
    lo, hi = bootstrap_ratio(arm, base)

    def brackets(stat):
        d = _resampling_distribution(stat, n)
        return [(_quantile(d, p - 5 * se), _quantile(d, p + 5 * se)) for p in (0.025, 0.975)]

    (lo_min, lo_max), (hi_min, hi_max) = brackets(_ratio_of_means(arm, base))
    assert lo_min <= lo <= lo_max and hi_min <= hi <= hi_max
    assert (lo_min, lo_max, hi_min, hi_max) == (F(107, 156), F(113, 162), F(32, 19), F(9, 5))  # 0.686-0.698, 1.684-1.8
    mean_of_ratios = brackets(lambda t: sum(F(arm[i], base[i]) for i in t) / n)
    geometric = brackets(lambda t: math.exp(sum(math.log(arm[i] / base[i]) for i in t) / n))
    assert not mean_of_ratios[0][0] <= lo <= mean_of_ratios[0][1] and not mean_of_ratios[1][0] <= hi <= mean_of_ratios[1][1]
    assert not geometric[0][0] <= lo <= geometric[0][1]
    # reproducible: numpy seed 0 by default, so the same input gives the same interval on every rerun
    assert bootstrap_ratio(arm, base) == [lo, hi]


def test_bootstrap_needs_two_seeds_and_a_constant_ratio_has_a_point_interval():
    assert bootstrap_ratio([5.0], [4.0]) is None
    assert bootstrap_ratio([], []) is None
    assert bootstrap_ratio([2, 6, 10, 14], [1, 3, 5, 7]) == [2.0, 2.0]  # every resample's ratio of means is 2


# --- summarize -------------------------------------------------------------------------------------------------------

TOKENS = (100, 200, 300, 400)  # every cell's evaluations
# eval losses per arm and seed. Config target 2.0: the baseline's seeds reach it at 300, 350, 400 tokens; `fast`
# at 200, 250, 300; `slow`'s seed 0 never does (censored at its budget, 400), its others at 400 and 300.
# The baseline's mean curve is 4, 10/3, 2.5, 1.5: its 100% target is 1.5, which its seed 2 (final 2.0) never
# reaches; `fast` reaches it on every seed, `slow` only on seed 2.
LOSSES = {
    "base": {0: (4.0, 3.0, 2.0, 1.0), 1: (4.0, 3.5, 2.5, 1.5), 2: (4.0, 3.5, 3.0, 2.0)},
    "fast": {0: (3.0, 2.0, 1.5, 1.0), 1: (3.5, 2.5, 1.5, 1.25), 2: (4.0, 3.0, 2.0, 1.5)},
    "slow": {0: (4.0, 3.5, 3.0, 2.5), 1: (4.0, 3.0, 2.5, 2.0), 2: (3.5, 3.0, 2.0, 1.5)},
}
FLOPS_PER_TOKEN = {"base": 6, "fast": 8, "slow": 6}  # `fast` also forwards rows it does not train on
SCORING = {"fast": 1000.0}  # the FLOPs of `fast`'s scoring pass, charged to each of its cells


def _curves(losses=LOSSES, tokens=TOKENS) -> dict:
    return {arm: {s: [(t, v, FLOPS_PER_TOKEN[arm] * t) for t, v in zip(tokens, c)] for s, c in by_seed.items()}
            for arm, by_seed in losses.items()}


def _summarize(losses=LOSSES, tokens=TOKENS, target: float | None = 2.0) -> dict:
    exp = ExperimentConfig(arms={a: ArmConfig() for a in losses}, baseline="base", seeds=[0, 1, 2],
                           budget=BudgetConfig(steps=40, eval_every=10), target=target)
    return summarize(exp, _curves(losses, tokens), scoring=SCORING)


def _per_seed(entry: dict, measure: str) -> list:
    return [entry[measure]["per_seed"][s] for s in "012"]


def test_summarize_targets_are_the_baselines_mean_curve_at_fractions_of_its_budget_and_the_configured_one():
    results = _summarize()
    t = results["targets"]
    assert {k: v["loss"] for k, v in t.items()} == pytest.approx(
        {"baseline_50pct": 10 / 3, "baseline_75pct": 2.5, "baseline_100pct": 1.5, "config": 2.0}, rel=1e-12)
    assert [t[k]["tokens"] for k in ("baseline_50pct", "baseline_75pct", "baseline_100pct")] == [200, 300, 400]
    assert t["config"]["tokens"] is None
    assert results["target"] == 2.0 and results["target_from"] == "config"
    base = results["arms"]["base"]
    assert base["curve"]["mean"] == pytest.approx([4.0, 10 / 3, 2.5, 1.5], rel=1e-12)
    assert base["curve"]["flops"] == [600, 1200, 1800, 2400]
    # without a configured target, the single target is the baseline's mean final loss
    assert _summarize(target=None)["target"] == 1.5 and "config" not in _summarize(target=None)["targets"]


def test_summarize_crossings_interpolate_linearly_in_tokens_and_in_flops():
    arms = _summarize()["arms"]
    config = {a: arms[a]["targets"]["config"] for a in arms}
    assert _per_seed(config["base"], "tokens") == [300, 350, 400]
    assert _per_seed(config["fast"], "tokens") == [200, 250, 300]  # 250: halfway from 2.5 (200) to 1.5 (300)
    assert _per_seed(config["slow"], "tokens") == [None, 400, 300]
    assert _per_seed(config["fast"], "flops") == [1600, 2000, 2400]  # 8 FLOPs a token
    assert _per_seed(config["fast"], "flops_with_scoring") == [2600, 3000, 3400]
    assert _per_seed(config["slow"], "flops") == [None, 2400, 1800]
    assert _per_seed(config["slow"], "flops_with_scoring") == [None, 2400, 1800]  # no scoring pass: + 0
    assert config["slow"]["tokens"]["spread"] == {"mean": 350, "std": 50, "n": 2, "of": 3}
    # at the 50% target (10/3) a curve already below it at its first evaluation crosses there, not before it
    half = {a: arms[a]["targets"]["baseline_50pct"] for a in arms}
    assert _per_seed(half["fast"], "tokens") == pytest.approx([100, 100 + 100 / 6, 100 + 200 / 3], rel=1e-12)
    assert _per_seed(half["base"], "tokens") == pytest.approx([100 + 200 / 3, 200 + 50 / 3, 200 + 100 / 3], rel=1e-12)
    assert arms["fast"]["seeds"]["1"]["to_target"]["config"] == {"tokens": 250, "flops": 2000, "flops_with_scoring": 3000}
    assert arms["slow"]["seeds"]["0"]["to_target"]["config"] == {"tokens": None, "flops": None, "flops_with_scoring": None}


def test_summarize_ratios_say_whether_the_point_is_an_estimate_or_a_bound():
    arms = _summarize()["arms"]
    ratio = {(a, t): arms[a]["targets"][t]["ratio_to_baseline"] for a in arms for t in ("config", "baseline_100pct")}

    # config target, every seed of both arms reaches it: an estimate, the geometric mean of the per-seed ratios
    # (2/3 x 5/7 x 3/4)^(1/3) = (5/14)^(1/3) with its t-interval; the ratio of the means 250 / 350 beside it
    fast = ratio["fast", "config"]
    assert fast["tokens"]["point"] == pytest.approx((5 / 14) ** (1 / 3), rel=1e-12)
    assert fast["tokens"]["point_is"] == "estimate"
    assert fast["tokens"]["ci95"] == pytest.approx(_t_interval_of_three([2 / 3, 5 / 7, 3 / 4]), rel=1e-12)
    assert fast["tokens"]["ci95"] == pytest.approx([0.61249, 0.82185], abs=1e-5)
    assert fast["tokens"]["ratio_of_means"] == pytest.approx(5 / 7, rel=1e-12)
    assert [fast["tokens"]["per_seed"][s]["ratio"] for s in "012"] == pytest.approx([2 / 3, 5 / 7, 3 / 4], rel=1e-12)
    assert fast["tokens"]["bootstrap_ci95"] == [2 / 3, 3 / 4]  # 3 seeds: the range of the per-seed ratios (see above)
    assert fast["tokens"]["reached"] == {"arm": 3, "baseline": 3, "of": 3}
    assert fast["flops"]["ratio_of_means"] == pytest.approx(2000 / 2100, rel=1e-12)  # 8 against 6 FLOPs a token
    assert fast["flops"]["point"] == pytest.approx((8 / 9 * 20 / 21 * 1) ** (1 / 3), rel=1e-12)
    assert fast["flops_with_scoring"]["ratio_of_means"] == pytest.approx(3000 / 2100, rel=1e-12)
    assert fast["flops_with_scoring"]["point"] == pytest.approx((13 / 9 * 10 / 7 * 17 / 12) ** (1 / 3), rel=1e-12)
    assert fast["flops_with_scoring"]["bootstrap_ci95"] == pytest.approx([3400 / 2400, 2600 / 1800], rel=1e-12)  # 1.417, 1.444
    assert fast["flops_with_scoring"]["point_is"] == "estimate"

    # config target, `slow`'s seed 0 never reaches it: censored at its budget (400 < its true crossing), so the
    # arm's ratios, their geometric mean (4/3 x 8/7 x 3/4)^(1/3) = (8/7)^(1/3) and the ratio of means
    # (400 + 400 + 300) / 3 / 350 are at most what they would be: a lower bound; the t-interval takes the budget too
    slow = ratio["slow", "config"]["tokens"]
    assert slow["point"] == pytest.approx((8 / 7) ** (1 / 3), rel=1e-12) and slow["point_is"] == "lower_bound"
    assert slow["ci95"] == pytest.approx(_t_interval_of_three([4 / 3, 8 / 7, 3 / 4]), rel=1e-12)
    assert slow["ratio_of_means"] == pytest.approx(22 / 21, rel=1e-12)
    assert [slow["per_seed"][s] for s in "012"] == [
        {"ratio": 400 / 300, "arm_censored": True, "baseline_censored": False},
        {"ratio": 400 / 350, "arm_censored": False, "baseline_censored": False},
        {"ratio": 300 / 400, "arm_censored": False, "baseline_censored": False}]
    assert slow["reached"] == {"arm": 2, "baseline": 3, "of": 3}
    assert slow["bootstrap_ci95"] == [0.75, 400 / 300]
    assert slow["paired"]["n"] == 3 and slow["paired"]["mean"] == pytest.approx((4 / 3 + 8 / 7 + 3 / 4) / 3, rel=1e-12)

    # 100% target (1.5): the baseline's seed 2 never reaches it (censored at 400): its mean is understated, so
    # `fast`'s ratios (6/7, 3/4, 1: geometric mean (9/14)^(1/3)) and ratio of means (300 + 300 + 400) / (350 + 400 +
    # 400) are at least what they would be: an upper bound
    up = ratio["fast", "baseline_100pct"]["tokens"]
    assert up["point"] == pytest.approx((9 / 14) ** (1 / 3), rel=1e-12) and up["point_is"] == "upper_bound"
    assert up["ratio_of_means"] == pytest.approx(20 / 23, rel=1e-12)
    assert up["reached"] == {"arm": 3, "baseline": 2, "of": 3}
    assert [up["per_seed"][s]["baseline_censored"] for s in "012"] == [False, False, True]
    # both censored (`slow` reaches 1.5 on seed 2 only): per seed 8/7, 1, 1 (geometric mean (8/7)^(1/3)), ratio of
    # means (400 + 400 + 400) / (350 + 400 + 400), a bound neither way
    both = ratio["slow", "baseline_100pct"]["tokens"]
    assert both["point"] == pytest.approx((8 / 7) ** (1 / 3), rel=1e-12) and both["point_is"] == "censored_both"
    assert both["ratio_of_means"] == pytest.approx(24 / 23, rel=1e-12)
    assert both["reached"] == {"arm": 1, "baseline": 2, "of": 3}
    assert both["ci95"] == pytest.approx(_t_interval_of_three([8 / 7, 1, 1]), rel=1e-12)
    assert both["bootstrap_ci95"] == [1.0, 400 / 350]
    # in FLOPs with a bound too (FLOPs are 6 a token for both)
    assert ratio["slow", "baseline_100pct"]["flops"]["point"] == pytest.approx((8 / 7) ** (1 / 3), rel=1e-12)
    assert ratio["slow", "baseline_100pct"]["flops"]["point_is"] == "censored_both"

    # the baseline against itself: exactly 1, said to be the baseline even where its own seeds are censored
    for t in ("config", "baseline_100pct"):
        for m in ("tokens", "flops", "flops_with_scoring"):
            own = ratio["base", t][m]
            assert (own["point"], own["point_is"], own["ci95"]) == (1.0, "baseline", [1.0, 1.0])
            assert (own["ratio_of_means"], own["bootstrap_ci95"]) == (1.0, [1.0, 1.0])


def test_the_bounds_hold_when_the_runs_are_continued():
    """Continue every run by one evaluation (500 tokens), where every seed is below every target: the censored seeds'
    crossings move past their old budget, and the ratios move the way `point_is` said they could."""
    longer = {a: {s: (*c, 0.5) for s, c in by_seed.items()} for a, by_seed in LOSSES.items()}
    short, long = _summarize()["arms"], _summarize(longer, TOKENS + (500,))["arms"]
    # config target (2.0) is the same in both: `slow` seed 0 crosses at 400 + (2.5 - 2) / (2.5 - 0.5) x 100 = 425
    assert long["slow"]["targets"]["config"]["tokens"]["per_seed"]["0"] == 425
    was = short["slow"]["targets"]["config"]["ratio_to_baseline"]["tokens"]
    now = long["slow"]["targets"]["config"]["ratio_to_baseline"]["tokens"]
    # per seed 425/300, 400/350, 300/400: geometric mean (17/14)^(1/3), was (8/7)^(1/3); ratio of means 1125/1050
    assert now["point_is"] == "estimate" and now["point"] == pytest.approx((17 / 14) ** (1 / 3), rel=1e-12)
    assert now["ratio_of_means"] == pytest.approx(1125 / 1050, rel=1e-12)
    assert now["point"] > was["point"] and now["ratio_of_means"] > was["ratio_of_means"]
    # an upper bound (baseline censored) is checked with the old 1.5 target as a configured one: the baseline's
    # seed 2 crosses at 400 + (2 - 1.5) / (2 - 0.5) x 100 = 433.3 > 400, so the ratio drops
    was = _summarize(target=1.5)["arms"]["fast"]["targets"]["config"]["ratio_to_baseline"]["tokens"]
    now = _summarize(longer, TOKENS + (500,), target=1.5)["arms"]["fast"]["targets"]["config"]["ratio_to_baseline"]["tokens"]
    # per seed 6/7, 3/4, 1 -> 6/7, 3/4, 400/(1300/3) = 12/13: geometric mean (9/14)^(1/3) -> (54/91)^(1/3)
    assert was["point_is"] == "upper_bound" and was["point"] == pytest.approx((9 / 14) ** (1 / 3), rel=1e-12)
    assert was["ratio_of_means"] == pytest.approx(20 / 23, rel=1e-12)
    assert now["point_is"] == "estimate" and now["point"] == pytest.approx((54 / 91) ** (1 / 3), rel=1e-12)
    assert now["ratio_of_means"] == pytest.approx(1000 / (750 + 1300 / 3), rel=1e-12)
    assert now["point"] < was["point"] and now["ratio_of_means"] < was["ratio_of_means"]


def test_summarize_single_target_figures_and_compute():
    results = _summarize()
    arms = results["arms"]
    # the mean curves against the configured target 2.0: base (4, 10/3, 2.5, 1.5) at 350 tokens, fast
    # (3.5, 2.5, 5/3, 1.25) at 200 + 0.5 / (5/6) x 100 = 260, slow (11/3, 19/6, 2.5, 2) at 400
    assert results["baseline_mean_curve_tokens_to_target"] == pytest.approx(350, rel=1e-12)
    assert arms["fast"]["mean_curve_tokens_to_target"] == pytest.approx(260, rel=1e-12)
    assert arms["fast"]["ratio_to_baseline"]["of_mean_curve"] == pytest.approx(26 / 35, rel=1e-12)
    assert arms["slow"]["ratio_to_baseline"]["of_mean_curve"] == pytest.approx(8 / 7, rel=1e-12)
    # of_means averages only the seeds that reach the target: `slow` (300, 400) against the baseline (300, 350,
    # 400) reads as 1.0, where the censored paired ratio says at least 22/21 and the mean curves 8/7
    assert arms["slow"]["ratio_to_baseline"]["of_means"] == pytest.approx(1.0, rel=1e-12)
    assert arms["slow"]["tokens_to_target"] == {"mean": 350, "std": 50, "n": 2, "of": 3}
    assert arms["fast"]["ratio_to_baseline"]["per_seed"]["mean"] == pytest.approx((2 / 3 + 5 / 7 + 3 / 4) / 3, rel=1e-12)
    assert arms["slow"]["ratio_to_baseline"]["per_seed"]["n"] == 2
    # compute per cell: the final FLOPs, plus the scoring pass for the arm charged with one
    assert arms["fast"]["seeds"]["0"]["compute"]["flops"] == 3200
    assert arms["fast"]["compute"]["flops_with_scoring"] == {"mean": 4200, "std": 0.0, "n": 3, "of": 3}
    assert arms["fast"]["uses_scoring"] and not arms["slow"]["uses_scoring"] and arms["slow"]["scoring_flops"] == 0.0
    assert arms["slow"]["final_eval_loss"]["mean"] == pytest.approx(2.0, rel=1e-12)
