"""The pre-registered analysis of the within-domain selection experiment: its interval, its crossing and its checks,
by hand on small raw records."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from scripts.analyze_selection import (COMPARISONS, PRIMARY_COMPARISON, compare, crossing, frequency_check, load_pools,
                                       pool_checks, summarize, t_interval)
from scripts.experiment_selection import ARMS, PRIMARY, STEPS, TARGETS

T_975_DF2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)  # the t quantile with 2 degrees of freedom, in closed form


def test_t_interval_of_three_pools_by_hand():
    got = t_interval([0.0, 0.1, -0.1])  # mean 0, sd 0.1
    half = T_975_DF2 * 0.1 / math.sqrt(3)
    assert got["ratio"] == pytest.approx(1.0)
    assert got["low"] == pytest.approx(math.exp(-half)) and got["high"] == pytest.approx(math.exp(half))
    plain = t_interval([1.0, 1.1, 0.9], log=False)
    assert plain["mean"] == pytest.approx(1.0) and plain["high"] == pytest.approx(1.0 + half)


def test_one_pool_has_a_point_and_no_interval():
    assert t_interval([math.log(0.5)]) == {"ratio": pytest.approx(0.5), "low": None, "high": None, "n": 1}


def test_crossing_interpolates_tokens_and_flops_between_evaluations():
    curve = [(100.0, 5.0, 1e3), (200.0, 4.0, 2e3), (300.0, 3.0, 3e3)]
    assert crossing(curve, 3.5) == (pytest.approx(250.0), pytest.approx(2.5e3))
    assert crossing(curve, 5.5) == (100.0, 1e3)  # reached at the first evaluation
    assert crossing(curve, 2.0) is None  # never reached: censored


REFERENCE = [(100.0, 5.0, 1e3), (200.0, 4.0, 2e3), (300.0, 3.0, 3e3), (400.0, 2.0, 4e3)]  # trains to 400 tokens


def test_a_pool_s_comparison_by_hand():
    """The target is the reference's loss at step 300 of 400 (300 tokens here: 3.0, at 3,000 FLOPs, plus its own 500
    selection FLOPs); the arm crosses 3.0 halfway from 200 to 300 tokens (2,500 FLOPs), plus its 1,000 selection
    FLOPs: 3,500 against 3,500, in 250 tokens against 300; its final loss 0.5 above the reference's."""
    arm = [(100.0, 4.5, 1e3), (200.0, 3.5, 2e3), (300.0, 2.5, 3e3), (400.0, 2.5, 4e3)]
    got = compare(arm, 1000.0, REFERENCE, 500.0)
    assert got["target_loss"] == pytest.approx(3.0) and got["bound"] is None
    assert got["flops"] == pytest.approx(3500.0) and got["log_flops_ratio"] == pytest.approx(0.0)
    assert got["log_tokens_ratio"] == pytest.approx(math.log(250 / 300))
    assert got["final_loss_difference"] == pytest.approx(0.5)


def test_floors_and_censored_pools_are_flagged_at_their_bound():
    below_at_once = [(100.0, 2.9, 1e3), (200.0, 2.0, 2e3), (300.0, 1.5, 3e3), (400.0, 1.0, 4e3)]
    floor = compare(below_at_once, 0.0, REFERENCE, 0.0)
    assert floor["bound"] == "floor" and floor["log_flops_ratio"] == pytest.approx(math.log(1e3 / 3e3))  # an upper bound
    never = [(100.0, 6.0, 1e3), (200.0, 5.5, 2e3), (300.0, 5.0, 3e3), (400.0, 4.5, 4e3)]
    censored = compare(never, 0.0, REFERENCE, 0.0)
    assert censored["bound"] == "censored" and censored["log_flops_ratio"] == pytest.approx(math.log(4e3 / 3e3))  # a lower bound


def test_the_primary_is_the_classifier_against_its_mixture_matched_arm_on_man3():
    assert PRIMARY_COMPARISON == ("man3", "classifier_man3", "mm_man3") and COMPARISONS[0] == PRIMARY_COMPARISON
    assert ("man3", "aa", "random") in COMPARISONS and ("man8", "classifier_man8", "mm_man8") in COMPARISONS


def _curve(offset: float) -> list[list[float]]:
    """An eval curve of STEPS // 25 + 1 points falling from 6 to 3 nats, shifted by `offset`."""
    points = STEPS // 25
    return [[i * 25 * 4096.0, 6.0 - 3.0 * i / points + offset, i * 1e9] for i in range(1, points + 1)]


def _raw(seed: int, offsets: dict[str, float] | None = None) -> dict:
    """A pool's raw record: every arm on the same curves (shifted per arm by `offsets`), mixtures matched, budgets met."""
    kept = {"tokens": 2_000_000, "domain_tokens": {"man": 1_400_000, "code": 400_000, "license": 200_000},
            "slice_tokens": {t: 100_000 for t in TARGETS}}
    arm = {"curves": {t: _curve(0.0) for t in TARGETS}, "general_loss": {"man": 3.0, "code": 2.0},
           "tokens_trained": 1_638_400, "kept": kept, "selection": {"flops": 0.0, "cpu_seconds": 0.0, "groups": {}},
           "budgets": {"*": 1_900_000}}
    arms = {a: copy.deepcopy(arm) for a in ARMS}
    for a, off in (offsets or {}).items():
        arms[a]["curves"] = {t: _curve(off) for t in TARGETS}
    for t in TARGETS:
        arms[f"mm_{t}"]["budgets"] = dict(kept["domain_tokens"])
    return {"seed": seed, "tokenizer_sha256": "t", "eval_sha256": ["e"], "design": {"steps": STEPS},
            "pool": kept, "unigram_entropy": {t: 6.0 for t in TARGETS}, "arms": arms}


def test_a_mixture_matched_arm_off_its_selector_s_shares_or_short_of_its_budget_is_flagged():
    assert pool_checks(_raw(1))["problems"] == []
    raw = _raw(1)
    raw["arms"]["mm_man3"]["kept"]["domain_tokens"] = {"man": 1_300_000, "code": 500_000, "license": 200_000}  # 0.65 vs 0.70
    problems = pool_checks(raw)["problems"]
    assert any(p.startswith("mm_man3 shares off classifier_man3's by 0.050") for p in problems)
    assert any(p == "mm_man3 capped in man" for p in problems)  # 1.3 M kept of a 1.4 M budget
    raw = _raw(1)
    raw["arms"]["random"]["kept"] = {**raw["arms"]["random"]["kept"], "tokens": 1_500_000}
    problems = pool_checks(raw)["problems"]
    assert "random capped in *" in problems and "random read 1.09 epochs" in problems


def test_the_frequency_check_fails_a_model_worse_than_the_slice_s_unigram_model():
    assert frequency_check(5.6, 6.0) and not frequency_check(5.8, 6.0) and not frequency_check(6.5, 6.0)
    raw = _raw(1, {"random": 2.0})  # random's loss at step 300: 3.75 + 2 = 5.75 nats, unigram entropy 6.0
    assert any(p.startswith("man3: random's target loss 5.750 not 0.3 below") for p in pool_checks(raw)["problems"])


def test_a_flagged_pool_is_reported_and_kept_and_the_primary_reads_every_pool(tmp_path: Path):
    raws = {s: _raw(s, {"classifier_man3": -0.7 - 0.02 * s}) for s in (1, 2, 3)}
    raws[2]["arms"]["mm_man3"]["kept"]["domain_tokens"]["man"] = 1_000_000
    for s, raw in raws.items():
        (tmp_path / f"pool-{s}.json").write_text(json.dumps(raw))
    result = summarize(load_pools(tmp_path))
    assert result["pools"] == [1, 2, 3] and list(result["flagged_pools"]) == [2]
    primary = result["primary"]
    assert primary["comparison"] == "man3:classifier_man3/mm_man3" and primary["flops_ratio"]["n"] == 3
    assert primary["flops_ratio"]["high"] < 0.9 and primary["verdict"] == "pays"
    assert result["comparisons"]["man3:aa/random"]["flops_ratio"]["ratio"] == pytest.approx(1.0)


def test_pools_of_another_tokenizer_are_refused(tmp_path: Path):
    for s in (1, 2):
        (tmp_path / f"pool-{s}.json").write_text(json.dumps({**_raw(s), "tokenizer_sha256": f"t{s}"}))
    with pytest.raises(SystemExit, match="tokenizer_sha256 differs"):
        load_pools(tmp_path)
