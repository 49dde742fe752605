"""scripts/experiment_table.py: the exact Markdown it prints for a results.json, run as it is meant to be run
(`python -m scripts.experiment_table RESULTS [--config YAML --weights D=W,...]`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from datapipe.train.experiment import ArmConfig, BudgetConfig, ExperimentConfig, summarize
from scripts.experiment_table import main

REPO = Path(__file__).resolve().parents[2]
HEAD = [("| arm | tokens to target, vs baseline | FLOPs to target, vs baseline | FLOPs with scoring, vs baseline "
         "| tokens read to target |"),
        "|---|---|---|---|---|"]


def _spread(mean, std=0.0, n=3):
    return {"mean": mean, "std": std, "n": n, "of": 3}


def _ratio(point, point_is, ci, arm, baseline=3, of=3):
    return {"point": point, "point_is": point_is, "ci95": ci, "reached": {"arm": arm, "baseline": baseline, "of": of}}


def _hand_written_results() -> dict:
    """A results.json as `datapipe experiment` writes it, cut to what the tables read: two arms, an extra eval set,
    two domains, three targets given out of order, a ratio of each kind (estimate, each bound, no interval,
    unknown), and tokens read to two of rho's targets (none to the others: "—")."""
    est = _ratio(0.714, "estimate", [0.6667, 0.75], 3)
    targets = {"config": {"loss": 2.0, "from": "the experiment's target"},
               "baseline_100pct": {"loss": 1.5, "from": "the baseline's mean eval loss at 100% of its budget (its mean "
                                                        "curve over seeds at 400 tokens, interpolated linearly)"},
               "baseline_50pct": {"loss": 10 / 3, "from": "the baseline's mean eval loss at 50% of its budget (its mean "
                                                          "curve over seeds at 200 tokens, interpolated linearly)"}}
    one = _ratio(1.0, "baseline", [1.0, 1.0], 3)
    arms = {
        "raw": {"final_eval_loss": _spread(1.5, 0.4082),
                "final_by_eval_set": {
                    "eval": {"loss": _spread(1.5, 0.4082), "loss_tokens": _spread(1.5, 0.4082),
                             "loss_domain_mean": _spread(1.61, 0.25), "domain_tokens": {"man": 56789, "code": 1234},
                             "domains": {"man": _spread(1.4, 0.3), "code": _spread(1.82, 0.2)}},
                    "clean": {"loss": _spread(1.3, 0.1), "loss_tokens": _spread(1.2999, 0.1001)}},
                "compute": {"flops": _spread(2.4e12), "flops_with_scoring": _spread(2.4e12)},
                "targets": {t: {"ratio_to_baseline": {m: one for m in ("tokens", "flops", "flops_with_scoring")}}
                            for t in targets}},
        "rho": {"final_eval_loss": _spread(1.25, 0.2041),
                "final_by_eval_set": {
                    "eval": {"loss": _spread(1.25, 0.2041), "loss_tokens": _spread(1.25, 0.2041),
                             "loss_domain_mean": _spread(None, None, 0), "domain_tokens": {"man": 56789, "code": 1234},
                             "domains": {"man": _spread(1.1, 0.05), "code": _spread(None, None, 0)}},
                    "clean": {"loss": _spread(1.0, 0.0), "loss_tokens": _spread(0.9876, 0.0123)}},
                "compute": {"flops": _spread(3.2e12), "flops_with_scoring": _spread(None, None, 0)},
                "targets": {
                    "baseline_50pct": {"ratio_to_baseline": {"tokens": est, "flops": _ratio(0.952, "estimate", None, 1, 1, 1),
                                                             "flops_with_scoring": None},
                                       "tokens_read": {"per_seed": {"0": 2.7e6, "1": 2.85e6, "2": 3.0e6},
                                                       "spread": _spread(2.85e6, 122474.5)}},
                    "baseline_100pct": {"tokens_read": {"per_seed": {"0": 1.2e6, "1": None, "2": 1.26e6},
                                                        "spread": {"mean": 1.23e6, "std": 3e4, "n": 2, "of": 3}},
                                        "ratio_to_baseline": {"tokens": _ratio(0.8696, "upper_bound", [0.75, 1.0], 3, 2),
                                                              "flops": _ratio(1.0476, "lower_bound", [0.75, 1.3333], 2),
                                                              "flops_with_scoring": _ratio(1.0435, "censored_both",
                                                                                           [1.0, 1.1429], 1, 2)}},
                    "config": {"ratio_to_baseline": {"tokens": est, "flops": est, "flops_with_scoring": est}}}},
    }
    return {"baseline": "raw", "seeds": [0, 1, 2], "eval_weighting": "tokens", "targets": targets, "arms": arms}


EXPECTED = "\n".join([
    "eval weighting: tokens; seeds [0, 1, 2]; baseline `raw`",
    "",
    "| arm | final eval loss (tokens) | eval loss, domain mean | clean: token-weighted | FLOPs a cell | with the scoring pass |",
    "|---|---|---|---|---|---|",
    "| raw | 1.500 ± 0.408 | 1.610 ± 0.250 | 1.300 ± 0.100 | 2.4e+12 | 2.4e+12 |",
    "| rho | 1.250 ± 0.204 | — | 0.988 ± 0.012 | 3.2e+12 | — |",
    "",
    "| arm | eval: code | eval: man |",
    "|---|---|---|",
    "| raw | 1.820 ± 0.200 | 1.400 ± 0.300 |",
    "| rho | — | 1.100 ± 0.050 |",
    "",
    "eval tokens per domain: code 1,234, man 56,789",
    "",
    # the baseline's targets in order of budget, then the configured one
    "target `baseline_50pct`: eval loss 3.3333 (the baseline's mean eval loss at 50% of its budget)",
    "",
    *HEAD,
    "| raw | 1.00 [1.00, 1.00] (3/3) | 1.00 [1.00, 1.00] (3/3) | 1.00 [1.00, 1.00] (3/3) | — |",
    "| rho | 0.71 [0.67, 0.75] (3/3) | 0.95 (1/1) | — | 2.85e+06 (3/3) |",  # no interval (one seed); unknown
    "",
    "target `baseline_100pct`: eval loss 1.5000 (the baseline's mean eval loss at 100% of its budget)",
    "",
    *HEAD,
    "| raw | 1.00 [1.00, 1.00] (3/3) | 1.00 [1.00, 1.00] (3/3) | 1.00 [1.00, 1.00] (3/3) | — |",
    "| rho | ≤0.87 [0.75, 1.00] (3/3) | ≥1.05 [0.75, 1.33] (2/3) | ~1.04 [1.00, 1.14] (1/3) | 1.23e+06 (2/3) |",
    "",
    "target `config`: eval loss 2.0000 (the experiment's target)",
    "",
    *HEAD,
    "| raw | 1.00 [1.00, 1.00] (3/3) | 1.00 [1.00, 1.00] (3/3) | 1.00 [1.00, 1.00] (3/3) | — |",
    "| rho | 0.71 [0.67, 0.75] (3/3) | 0.71 [0.67, 0.75] (3/3) | 0.71 [0.67, 0.75] (3/3) | — |",
    "",
]) + "\n"  # print's own newline


def test_the_command_prints_the_tables_of_a_results_file(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_hand_written_results()))
    run = subprocess.run([sys.executable, "-m", "scripts.experiment_table", str(path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == EXPECTED


def test_under_a_target_weighting_the_final_loss_column_is_that_weightings(tmp_path, capsys):
    """With data.eval_target the runs' eval loss (the curves, the targets, `final_eval_loss`) is the target mixture's;
    the column named after that weighting shows it, not the token-weighted loss beside it in final_by_eval_set."""
    results = _hand_written_results()
    results["eval_weighting"] = "target"
    results["arms"]["raw"]["final_eval_loss"] = results["arms"]["raw"]["final_by_eval_set"]["eval"]["loss"] = _spread(1.7, 0.3)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("| arm | final eval loss (target) | eval loss, domain mean | clean: token-weighted | FLOPs a cell "
                        "| with the scoring pass |")
    assert lines[4] == "| raw | 1.700 ± 0.300 | 1.610 ± 0.250 | 1.300 ± 0.100 | 2.4e+12 | 2.4e+12 |"


# Three seeds' curves, (tokens, eval loss), FLOPs 6 a token (`fast`: 8, and a scoring pass of 1,000 FLOPs a cell):
# the same as tests/datapipe/train/test_experiment_analysis.py, whose summaries are worked out there by hand.
LOSSES = {
    "base": {0: (4.0, 3.0, 2.0, 1.0), 1: (4.0, 3.5, 2.5, 1.5), 2: (4.0, 3.5, 3.0, 2.0)},
    "fast": {0: (3.0, 2.0, 1.5, 1.0), 1: (3.5, 2.5, 1.5, 1.25), 2: (4.0, 3.0, 2.0, 1.5)},
    "slow": {0: (4.0, 3.5, 3.0, 2.5), 1: (4.0, 3.0, 2.5, 2.0), 2: (3.5, 3.0, 2.0, 1.5)},
}


def test_the_tables_of_a_summary_mark_estimates_and_bounds(tmp_path, capsys):
    per_token = {"base": 6, "fast": 8, "slow": 6}
    curves = {a: {s: [(t, v, per_token[a] * t) for t, v in zip((100, 200, 300, 400), c)] for s, c in by_seed.items()}
              for a, by_seed in LOSSES.items()}
    exp = ExperimentConfig(arms={a: ArmConfig() for a in LOSSES}, baseline="base", seeds=[0, 1, 2],
                           budget=BudgetConfig(steps=40, eval_every=10), target=2.0)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(summarize(exp, curves, scoring={"fast": 1000.0})))
    assert main([str(path)]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[:8] == [
        "eval weighting: tokens; seeds [0, 1, 2]; baseline `base`", "",
        "| arm | final eval loss (tokens) | eval loss, domain mean | FLOPs a cell | with the scoring pass |",
        "|---|---|---|---|---|",
        "| base | 1.500 ± 0.408 | — | 2.4e+03 | 2.4e+03 |",  # finals 1, 1.5, 2; 400 tokens x 6
        "| fast | 1.250 ± 0.204 | — | 3.2e+03 | 4.2e+03 |",  # + the scoring pass
        "| slow | 2.000 ± 0.408 | — | 2.4e+03 | 2.4e+03 |", ""]
    at = {line: i for i, line in enumerate(out)}
    full = at["target `baseline_100pct`: eval loss 1.5000 (the baseline's mean eval loss at 100% of its budget)"]
    config = at["target `config`: eval loss 2.0000 (the experiment's target)"]
    assert full < config
    # Each cell: point = the geometric mean g of the per-seed ratios r, interval g x/÷ exp(t sd(log r) / sqrt(3)),
    # t = t(0.975, 2) = 4.3027 (worked out in tests/datapipe/test_experiment.py). No compute given: no tokens read.
    # 1.5: base seed 2 never reaches it. fast tokens per seed 6/7, 3/4, 1: g = (9/14)^(1/3) = 0.863, [0.604, 1.234];
    # FLOPs 8/6 of that, per seed 8/7, 1, 4/3: g = 1.151, [0.805, 1.645]; with scoring, per seed 34/21, 17/12,
    # 7/4: g = 1.589, [1.219, 2.072]. slow (400, 400, 400) with only seed 2 reaching it: per seed 8/7, 1, 1:
    # g = (8/7)^(1/3) = 1.046, [0.863, 1.266]
    assert out[full + 2:full + 8] == HEAD + [
        "| base | 1.00 [1.00, 1.00] (2/3) | 1.00 [1.00, 1.00] (2/3) | 1.00 [1.00, 1.00] (2/3) | — |",
        "| fast | ≤0.86 [0.60, 1.23] (3/3) | ≤1.15 [0.80, 1.65] (3/3) | ≤1.59 [1.22, 2.07] (3/3) | — |",
        "| slow | ~1.05 [0.86, 1.27] (1/3) | ~1.05 [0.86, 1.27] (1/3) | ~1.05 [0.86, 1.27] (1/3) | — |", ""]
    # 2.0: every base seed reaches it (300, 350, 400). fast (200, 250, 300), per seed 2/3, 5/7, 3/4: g = 0.709,
    # [0.612, 0.822]; FLOPs per seed 8/9, 20/21, 1: g = 0.946, [0.817, 1.096]; with scoring per seed 13/9, 10/7,
    # 17/12: g = 1.430, [1.396, 1.465]. slow (never -> 400, 400, 300), per seed 4/3, 8/7, 3/4: g = (8/7)^(1/3) = 1.046,
    # [0.499, 2.191]
    assert out[config + 2:config + 8] == HEAD + [
        "| base | 1.00 [1.00, 1.00] (3/3) | 1.00 [1.00, 1.00] (3/3) | 1.00 [1.00, 1.00] (3/3) | — |",
        "| fast | 0.71 [0.61, 0.82] (3/3) | 0.95 [0.82, 1.10] (3/3) | 1.43 [1.40, 1.46] (3/3) | — |",
        "| slow | ≥1.05 [0.50, 2.19] (2/3) | ≥1.05 [0.50, 2.19] (2/3) | ≥1.05 [0.50, 2.19] (2/3) | — |", ""]


def _metrics_line(step: int, tokens: int, code: float, man: float) -> str:
    return json.dumps({"step": step, "tokens": tokens, "flops": 6 * tokens, "eval_loss": (code + man) / 2,
                       "eval_domains": {"code": {"loss": code, "tokens": 10}, "man": {"loss": man, "tokens": 10}}})


def test_weights_recompute_the_summary_from_each_evaluations_domain_losses(tmp_path, capsys):
    """--weights code=0.25,man=0.75: every evaluation's loss becomes 0.25 code + 0.75 man, and the targets, crossings
    and ratios are those of the re-weighted curves (two seeds: each interval is the geometric mean g of the two
    per-seed ratios x/÷ exp(t(0.975, 1) x |log(r0 / r1)| / 2), t(0.975, 1) = 12.7062: sd / sqrt(2) of two logs is
    half their distance); `filt` reads 4 rows a row it trains on, so its tokens read to a target are 4 x its tokens."""
    domain_losses = {  # arm -> seed -> (code, man) at 100 and 200 tokens; re-weighted in the comments
        "raw": {0: [(3.0, 3.0), (1.0, 2.0)],   # 3.0, 1.75
                1: [(3.0, 3.0), (2.0, 2.0)]},  # 3.0, 2.0
        "filt": {0: [(4.0, 2.0), (2.0, 1.5)],  # 2.5, 1.625
                 1: [(5.0, 3.0), (2.0, 1.0)]},  # 3.5, 1.25
    }
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump({"arms": {"raw": {}, "filt": {}}, "baseline": "raw", "seeds": [0, 1],
                                      "budget": {"steps": 20, "eval_every": 10}, "output": str(tmp_path / "exp")}))
    arms = {}
    for arm, by_seed in domain_losses.items():
        seeds = {}
        for seed, evals in by_seed.items():
            run_dir = tmp_path / "exp" / "cells" / arm / f"seed-{seed}"
            run_dir.mkdir(parents=True)
            lines = [json.dumps({"step": 5, "tokens": 50, "loss": 9.0})]  # a training log record: no evaluation
            lines += [_metrics_line(10 * (i + 1), 100 * (i + 1), code, man) for i, (code, man) in enumerate(evals)]
            lines += [_metrics_line(20, 200, 9.0, 9.0)]  # 200 tokens logged again (a resumed run): the later counts...
            lines[-2], lines[-1] = lines[-1], lines[-2]  # ...so the real one is written last
            (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
            seeds[str(seed)] = {"run_dir": str(run_dir), "curve": {"tokens": [100, 200]},
                                "compute": {"flops": 1200.0, "tokens_trained": 200,
                                            "tokens_read": {"raw": 200, "filt": 800}[arm]}}
        arms[arm] = {"seeds": seeds, "scoring_flops": 0.0}
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"arms": arms}))

    assert main([str(results), "--config", str(config), "--weights", "code=0.25,man=0.75"]) == 0
    out = capsys.readouterr().out.split("\n")
    assert out[:7] == [
        "eval weighting: reweighted to code 0.25, man 0.75; seeds [0, 1]; baseline `raw`", "",
        "| arm | final eval loss (reweighted to code 0.25, man 0.75) | eval loss, domain mean | FLOPs a cell | with the scoring pass |",
        "|---|---|---|---|---|",
        "| raw | 1.875 ± 0.125 | — | 1.2e+03 | 1.2e+03 |",
        "| filt | 1.438 ± 0.188 | — | 1.2e+03 | 1.2e+03 |", ""]
    # raw's mean curve: 3.0, 1.875 -> targets 3.0 (50%: 100 tokens), 2.4375 (75%: 150), 1.875 (100%)
    # 3.0: raw (100, 100), filt (100, 100 + 0.5/2.25 x 100 = 122.2), per seed 1, 11/9: g = 1.106, [0.309, 3.956];
    #   tokens read: raw 100, filt 4 x (100, 122.2) = 400, 488.9: mean 444.4
    # 2.4375: raw (145, 156.25), filt (107.1, 147.2), per seed 0.739, 0.942: g = 0.834, [0.178, 3.908];
    #   tokens read: raw 150.6, filt 4 x 127.2 = 508.7
    # 1.875: raw (190, never: 200), filt (171.4, 172.2), per seed 0.902, 0.861: an upper bound g = 0.881,
    #   [0.655, 1.186]; tokens read: raw 190 (its one seed that reaches it), filt 4 x 171.8 = 687.3
    assert out[7:] == [
        "target `baseline_50pct`: eval loss 3.0000 (the baseline's mean eval loss at 50% of its budget)", "", *HEAD,
        "| raw | 1.00 [1.00, 1.00] (2/2) | 1.00 [1.00, 1.00] (2/2) | 1.00 [1.00, 1.00] (2/2) | 100 (2/2) |",
        "| filt | 1.11 [0.31, 3.96] (2/2) | 1.11 [0.31, 3.96] (2/2) | 1.11 [0.31, 3.96] (2/2) | 444 (2/2) |", "",
        "target `baseline_75pct`: eval loss 2.4375 (the baseline's mean eval loss at 75% of its budget)", "", *HEAD,
        "| raw | 1.00 [1.00, 1.00] (2/2) | 1.00 [1.00, 1.00] (2/2) | 1.00 [1.00, 1.00] (2/2) | 151 (2/2) |",
        "| filt | 0.83 [0.18, 3.91] (2/2) | 0.83 [0.18, 3.91] (2/2) | 0.83 [0.18, 3.91] (2/2) | 509 (2/2) |", "",
        "target `baseline_100pct`: eval loss 1.8750 (the baseline's mean eval loss at 100% of its budget)", "", *HEAD,
        "| raw | 1.00 [1.00, 1.00] (1/2) | 1.00 [1.00, 1.00] (1/2) | 1.00 [1.00, 1.00] (1/2) | 190 (1/2) |",
        "| filt | ≤0.88 [0.66, 1.19] (2/2) | ≤0.88 [0.66, 1.19] (2/2) | ≤0.88 [0.66, 1.19] (2/2) | 687 (2/2) |", "", ""]
