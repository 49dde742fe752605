"""The experiment runner: arms x seeds of the trainer at the same compute, results.json, results.png, resume."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from datapipe.cli import main
from datapipe.core.config import ConfigError, to_dict
from datapipe.train.experiment import (ArmConfig, BudgetConfig, ExperimentConfig, load_experiment_config,
                                       paired_ratio, resolve_cells, summarize, t_interval_ratio, tokens_to_target)
from helpers import VOCAB, write_train_source

TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.max_seq_len=64", "train.ckpt_every=3",
        "optim.lr=0.01", "prefetch.depth=2", "train.device=cpu"]


def _flatten(tree, prefix=""):
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def _experiment(tmp_path: Path, **extra) -> Path:
    source = write_train_source(tmp_path / "train", n_shards=2, per_shard=20)
    held = write_train_source(tmp_path / "eval", n_shards=1, per_shard=10)
    spec = {"base": {"set": TINY + [f"data.eval_source={held}"], "data": str(source)},
            "arms": {"base": {}, "low_lr": {"set": ["optim.lr=0.002", "optim.weight_decay=0.0"]}},
            "baseline": "base", "seeds": [0, 1],
            "budget": {"steps": 6, "batch_size": 2, "seq_len": 64, "eval_every": 2},
            "output": str(tmp_path / "exp"), **extra}
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_experiment_runs_arms_writes_results_and_reuses_finished_cells(tmp_path, capsys):
    from datapipe.train.lm import flops_params
    from datapipe.train.model import GPT

    path = _experiment(tmp_path)
    assert main(["experiment", str(path)]) == 0
    out = tmp_path / "exp"
    results = json.loads((out / "results.json").read_text())
    # by default: a line per cell when it is done, a line per arm (its result) and the summary; no trainer line
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 + 2 + 1, lines
    for n, (arm, seed) in enumerate([("base", 0), ("base", 1), ("low_lr", 0), ("low_lr", 1)]):
        loss = results["arms"][arm]["seeds"][str(seed)]["final_eval_loss"]
        tokens = results["arms"][arm]["seeds"][str(seed)]["curve"]["tokens"][-1]
        assert lines[n].startswith(f"cell {arm}/seed-{seed} [{n + 1}/4]: eval loss {loss:.4f} after {tokens:,.0f} "
                                   "tokens; trained in "), lines[n]
    assert [line.split(":")[0] for line in lines[4:6]] == ["base", "low_lr"]
    assert lines[6].startswith("experiment: 4 cells done (2 arms x 2 seeds) in ")
    assert lines[6].endswith(f"; results {out / 'results.json'}, plot {out / 'results.png'}")
    assert not any(line.startswith(("step ", "model: ", "done: ")) for line in lines)
    assert (out / "results.png").stat().st_size > 0
    assert results["baseline"] == "base" and set(results["arms"]) == {"base", "low_lr"} and results["seeds"] == [0, 1]
    assert results["eval_weighting"] == "tokens" and results["eval_target"] is None
    base, low = results["arms"]["base"], results["arms"]["low_lr"]
    # the target defaults to the baseline's final eval loss, mean over its two seeds
    finals = [base["seeds"][s]["final_eval_loss"] for s in ("0", "1")]
    assert finals[0] != finals[1] and results["target"] == pytest.approx(sum(finals) / 2)
    assert results["targets"]["baseline_100pct"]["loss"] == pytest.approx(results["target"])
    model_cfg = resolve_cells(load_experiment_config(path))["base"][0].model
    n = flops_params(GPT(replace(model_cfg, vocab_size=VOCAB)))  # N of the cells' model (the data's vocabulary)
    for arm in results["arms"].values():
        for seed in ("0", "1"):
            cell = arm["seeds"][seed]
            assert len(cell["curve"]["tokens"]) == 3  # evaluations at steps 2, 4, 6
            assert cell["curve"]["tokens"] == sorted(cell["curve"]["tokens"]) and cell["curve"]["tokens"][0] > 0
            assert cell["final_eval_loss"] == cell["curve"]["eval_loss"][-1]
            # FLOPs: 6N a token trained, nothing forwarded only; the curve too
            assert cell["curve"]["flops"] == [6 * n * t for t in cell["curve"]["tokens"]]
            c = cell["compute"]
            assert c["flops"] == 6 * n * c["tokens_trained"] == c["flops_with_scoring"] and c["tokens_forwarded_only"] == 0
            assert c["tokens_trained"] == cell["curve"]["tokens"][-1] and 0 < c["distinct_tokens"] <= c["tokens_read"]
            assert c["wall_s"] > 0 and c["eval_flops"] > 0
            # each cell's own metrics.jsonl holds the same curve
            records = [json.loads(l) for l in (Path(cell["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
            assert [r["eval_loss"] for r in records if "eval_loss" in r] == cell["curve"]["eval_loss"]
        assert set(arm["final_eval_loss"]) == {"mean", "std", "n", "of"}
        assert set(arm["ratio_to_baseline"]) == {"of_means", "per_seed", "of_mean_curve"}
        # the arm's mean curve is the mean of its two seeds' curves (which differ)
        a, b = (arm["seeds"][s]["curve"]["eval_loss"] for s in ("0", "1"))
        assert a != b and arm["curve"]["mean"] == pytest.approx([(x + y) / 2 for x, y in zip(a, b)])
        # the overall eval loss is the token-weighted mean of the domains', not their plain mean
        final = arm["final_by_eval_set"]["eval"]
        assert final["weighting"] == "tokens" and final["loss"]["mean"] == pytest.approx(final["loss_tokens"]["mean"])
        assert final["loss_domain_mean"]["mean"] != pytest.approx(final["loss"]["mean"], abs=1e-9)
    # low_lr against the baseline, seed by seed: its crossing of each target over the baseline seed's
    for name, t in results["targets"].items():
        ratio = low["targets"][name]["ratio_to_baseline"]["tokens"]
        for seed in ("0", "1"):
            mine = tokens_to_target(list(zip(low["seeds"][seed]["curve"]["tokens"], low["seeds"][seed]["curve"]["eval_loss"])), t["loss"])
            theirs = tokens_to_target(list(zip(base["seeds"][seed]["curve"]["tokens"], base["seeds"][seed]["curve"]["eval_loss"])), t["loss"])
            mine = mine if mine is not None else low["seeds"][seed]["curve"]["tokens"][-1]  # censored at the budget
            theirs = theirs if theirs is not None else base["seeds"][seed]["curve"]["tokens"][-1]
            assert ratio["per_seed"][seed]["ratio"] == pytest.approx(mine / theirs)
        assert ratio["ci95"] is not None and ratio["ci95"][0] <= ratio["point"] <= ratio["ci95"][1]
    # the mean curves' crossing of the target
    assert results["baseline_mean_curve_tokens_to_target"] == pytest.approx(
        tokens_to_target(list(zip(base["curve"]["tokens"], base["curve"]["mean"])), results["target"]))
    # the lower learning rate trains the same tokens but learns slower: a different curve
    assert low["seeds"]["0"]["curve"]["eval_loss"] != base["seeds"]["0"]["curve"]["eval_loss"]

    # the arms' resolved configs differ only in the keys the arm sets (and their run folders)
    saved = {arm: yaml.safe_load((out / "cells" / arm / "seed-0" / "config.yaml").read_text()) for arm in ("base", "low_lr")}
    a, b = _flatten(saved["base"]), _flatten(saved["low_lr"])
    assert {k for k in a if a[k] != b[k]} == {"optim.lr", "optim.weight_decay", "train.output"}
    assert a["train.steps"] == 6 and a["data.batch_size"] == 2 and a["train.seed"] == 0

    # a second invocation reads the finished cells back: no cell trains again
    metrics = sorted(out.glob("cells/*/seed-*/*.*"))  # metrics.jsonl, config.yaml, checkpoint.pt
    assert len(metrics) >= 12
    before = {p: p.stat().st_mtime_ns for p in metrics}
    capsys.readouterr()
    assert main(["experiment", str(path)]) == 0
    assert {p: p.stat().st_mtime_ns for p in metrics} == before
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 + 2 + 1 and all("finished, read back" in line for line in lines[:4]), lines
    assert json.loads((out / "results.json").read_text()) == results


def test_verbose_experiment_also_prints_every_cells_trainer_lines(tmp_path, capsys):
    path = _experiment(tmp_path)
    one_cell = ["--set", "arms={base: {}}", "--set", "seeds=[0]", "--set", "budget.steps=2", "--set", "budget.eval_every=1"]
    assert main(["experiment", str(path), "--verbose", *one_cell]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines if line.startswith("step ")] == ["step 1/2", "step 2/2"]
    assert any(line.startswith("done: 2 steps") for line in lines)
    assert lines[0] == f"cell base/seed-0 [1/1]: training -> {tmp_path / 'exp' / 'cells' / 'base' / 'seed-0'}"
    # and the default lines: the cell's, after its trainer's, the arm's and the summary
    assert lines[-3].startswith("cell base/seed-0 [1/1]: eval loss ") and lines[-4].startswith("done: ")
    assert lines[-1].startswith("experiment: 1 cell done (1 arm x 1 seed) in ")


def test_experiment_config_errors_name_the_key(tmp_path):
    path = _experiment(tmp_path)
    with pytest.raises(ConfigError, match="unknown config key 'budget.stpes'"):
        load_experiment_config(path, ["budget.stpes=3"])
    with pytest.raises(ConfigError, match="baseline must be one of the arms"):
        load_experiment_config(path, ["baseline=nope"])
    with pytest.raises(ConfigError, match="arms.low_lr.set: train.steps is set by the experiment"):
        resolve_cells(load_experiment_config(path, ["arms.low_lr.set=[train.steps=3]"]))
    with pytest.raises(ConfigError, match="arms.low_lr: .*unknown config key 'optim.lrr'"):
        resolve_cells(load_experiment_config(path, ["arms.low_lr.set=[optim.lrr=3]"]))
    with pytest.raises(ConfigError, match="data.holdout_shards"):
        resolve_cells(load_experiment_config(path, ["base.set=[data.holdout_shards=1]"]))
    # the eval weighting is the experiment's: the same for every arm, its domains those of the eval set
    held = f"eval_source={tmp_path / 'eval'}"
    with pytest.raises(ConfigError, match="arms.low_lr.set: data.eval_target is set by the experiment"):
        resolve_cells(load_experiment_config(path, ["arms.low_lr.set=['data.eval_target={code: 1}']"]))
    with pytest.raises(ConfigError, match=r"base: data.eval_target names domain\(s\) \['web'\] that the eval source"):
        resolve_cells(load_experiment_config(path, ["base.set=['data.eval_target={code: 1, web: 1}']", held]))
    cells = resolve_cells(load_experiment_config(path, ["base.set=['data.eval_target={code: 1}']", held]))
    assert all(c.data.eval_target == {"code": 1.0} for by_seed in cells.values() for c in by_seed.values())
    # resolved before any training: nothing was written
    assert not (tmp_path / "exp").exists()
    assert main(["experiment", str(path), "--set", "arms.x={data: 1}"]) == 2


def test_every_cell_evaluates_on_every_eval_document_whatever_the_recipe_caps(tmp_path):
    """A recipe's data.eval_batches (configs/train-tiny.yaml caps at 2) is for quick looks at one run; the
    experiment's evaluations read the whole eval set (0: no cap), a base.set of the key included."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("data: {eval_batches: 2}\n")
    exp = load_experiment_config(_experiment(tmp_path), [f"base.recipe={recipe}"])
    for base in (exp.base, replace(exp.base, set=exp.base.set + ["data.eval_batches=3"])):
        cells = resolve_cells(replace(exp, base=base))
        assert [c.data.eval_batches for by_seed in cells.values() for c in by_seed.values()] == [0, 0, 0, 0]


def test_tokens_to_target_interpolates_between_evaluations():
    curve = [(100, 3.0), (200, 2.0), (300, 1.0)]
    assert tokens_to_target(curve, 1.5) == pytest.approx(250.0)
    assert tokens_to_target(curve, 3.5) == 100.0  # already reached at the first evaluation
    assert tokens_to_target(curve, 0.5) is None


N = 1000  # FLOPs per token in the hand-built curves: 6N a token trained


def _hand_built(scoring: float | None = 0.0, seeds=(0, 1, 2), compute: dict | None = None) -> dict:
    """Three seeds; baseline seed 2 never reaches the baseline's mean final loss (5/3), the other arm reaches it on
    every seed. Curves are (tokens, eval loss, FLOPs = 6N tokens)."""
    base = {0: [(100, 3.0), (200, 2.0), (300, 1.0)], 1: [(100, 3.5), (200, 2.5), (300, 1.5)],
            2: [(100, 4.0), (200, 3.0), (300, 2.5)]}
    new = {0: [(100, 2.5), (200, 1.5), (300, 1.0)], 1: [(100, 3.0), (200, 2.0), (300, 1.25)],
           2: [(100, 3.5), (200, 2.0), (300, 1.5)]}
    curves = {arm: {s: [(t, v, 6 * N * t) for t, v in c[s]] for s in seeds} for arm, c in (("base", base), ("new", new))}
    exp = ExperimentConfig(arms={"base": ArmConfig(), "new": ArmConfig()}, baseline="base", seeds=list(seeds),
                           budget=BudgetConfig(steps=30, eval_every=10))
    return summarize(exp, curves, compute=compute, scoring={"new": scoring})


def test_summarize_on_hand_built_curves_where_a_baseline_seed_never_reaches_the_target():
    results = _hand_built(scoring=6 * N * 100)  # the scoring pass: 100 trained tokens' worth of FLOPs
    # targets: the baseline's mean curve (3.5, 2.5, 5/3 at 100, 200, 300 tokens) at 50%, 75%, 100% of its budget
    targets = results["targets"]
    assert targets["baseline_50pct"]["loss"] == pytest.approx(3.0)  # at 150 tokens
    assert targets["baseline_75pct"]["loss"] == pytest.approx(2.5 - 0.25 * (2.5 - 5 / 3))  # at 225 tokens
    assert targets["baseline_100pct"]["loss"] == pytest.approx(5 / 3) == results["target"]
    base, new = results["arms"]["base"], results["arms"]["new"]
    top = base["targets"]["baseline_100pct"]
    # tokens to 5/3, interpolated: baseline 233.3, 283.3, never; the other arm 183.3, 244.4, 266.7
    assert [top["tokens"]["per_seed"][s] for s in "01"] == pytest.approx([700 / 3, 850 / 3])
    assert top["tokens"]["per_seed"]["2"] is None and top["tokens"]["spread"]["n"] == 2
    mine = new["targets"]["baseline_100pct"]
    assert [mine["tokens"]["per_seed"][s] for s in "012"] == pytest.approx([550 / 3, 2200 / 9, 800 / 3])
    assert [mine["flops"]["per_seed"][s] for s in "012"] == pytest.approx([6 * N * t for t in (550 / 3, 2200 / 9, 800 / 3)])
    # paired per seed; the baseline's seed 2 is censored at its budget (300 tokens)
    ratio = mine["ratio_to_baseline"]["tokens"]
    assert [ratio["per_seed"][s]["ratio"] for s in "012"] == pytest.approx([(550 / 3) / (700 / 3), (2200 / 9) / (850 / 3),
                                                                           (800 / 3) / 300])
    assert [ratio["per_seed"][s]["baseline_censored"] for s in "012"] == [False, False, True]
    assert ratio["reached"] == {"arm": 3, "baseline": 2, "of": 3}
    # the geometric mean of the per-seed ratios (11/14, 44/51, 8/9), the censored one at its budget: an upper bound
    # (the baseline's true crossing is later); the ratio of the means over all seeds beside it, a bound the same way
    assert ratio["point"] == pytest.approx((11 / 14 * 44 / 51 * 8 / 9) ** (1 / 3)) and ratio["point_is"] == "upper_bound"
    assert ratio["ratio_of_means"] == pytest.approx((6250 / 27) / (2450 / 9))
    lo, hi = ratio["ci95"]
    assert lo < ratio["point"] < hi and lo > 0.7 and hi < 1.0
    lo, hi = ratio["bootstrap_ci95"]
    assert lo < ratio["ratio_of_means"] < hi and lo > 0.7 and hi < 1.0
    again = _hand_built(scoring=6 * N * 100)["arms"]["new"]["targets"]["baseline_100pct"]["ratio_to_baseline"]["tokens"]
    assert again["ci95"] == ratio["ci95"] and again["bootstrap_ci95"] == [lo, hi]
    # compute: without the scoring pass, FLOPs are 6N tokens here, so the ratio is the tokens'; with it, each cell pays
    # 100 tokens' worth more: per seed (550/3 + 100) / (700/3) = 17/14, (2200/9 + 100) / (850/3) = 62/51 and
    # (800/3 + 100) / 300 = 11/9; of the means (6250/27 + 100) / (2450/9)
    assert mine["ratio_to_baseline"]["flops"]["point"] == pytest.approx(ratio["point"])
    assert mine["ratio_to_baseline"]["flops_with_scoring"]["point"] == pytest.approx((17 / 14 * 62 / 51 * 11 / 9) ** (1 / 3))
    assert mine["ratio_to_baseline"]["flops_with_scoring"]["ratio_of_means"] == pytest.approx(8950 / 7350)
    assert new["uses_scoring"] and new["scoring_flops"] == 6 * N * 100 and not base["uses_scoring"]
    assert new["seeds"]["0"]["compute"]["flops_with_scoring"] == 6 * N * 300 + 6 * N * 100
    # the baseline against itself: 1, said to be the baseline
    assert top["ratio_to_baseline"]["tokens"]["point"] == 1.0 and top["ratio_to_baseline"]["tokens"]["point_is"] == "baseline"
    # at 75% (2.2917) the baseline's seed 2 still never reaches it; the arm reaches it at 120.8, 170.8, 180.6
    mid = new["targets"]["baseline_75pct"]
    assert [mid["tokens"]["per_seed"][s] for s in "012"] == pytest.approx([100 + 500 / 24, 100 + 1700 / 24, 100 + 2900 / 36])
    assert base["targets"]["baseline_75pct"]["tokens"]["per_seed"]["2"] is None
    # the older single-target figures: the ratio of means over the seeds that reach it, and the mean curves' crossing
    assert new["ratio_to_baseline"]["of_means"] == pytest.approx((6250 / 27) / (1550 / 6))
    assert results["baseline_mean_curve_tokens_to_target"] == pytest.approx(300.0)


def test_summarize_without_scoring_flops_or_with_one_seed_leaves_the_unknown_null():
    unknown = _hand_built(scoring=None)["arms"]["new"]  # uses scoring, but its data records no FLOPs for it
    assert unknown["targets"]["baseline_100pct"]["ratio_to_baseline"]["flops_with_scoring"] is None
    assert unknown["targets"]["baseline_100pct"]["ratio_to_baseline"]["flops"] is not None
    one = _hand_built(seeds=(0,))["arms"]["new"]["targets"]["baseline_100pct"]["ratio_to_baseline"]["tokens"]
    # one seed: the target is its final loss 1.0, which both arms reach at their last evaluation; no interval
    assert one["ci95"] is None and one["point"] == pytest.approx(1.0) and one["paired"]["n"] == 1
    assert one["bootstrap_ci95"] is None and one["ratio_of_means"] == pytest.approx(1.0)


# t(0.975) with 2 degrees of freedom, written out rather than computed by scipy. (The brief's 4.302652729911275 is an
# old table value, wrong from the 10th digit: with df = 2 the quantile is (2p - 1) / sqrt(2p(1 - p)) exactly.)
T_975_2 = 4.302652729749464


def test_the_t_quantile_written_out_is_the_closed_form_one():
    assert T_975_2 == pytest.approx(0.95 / math.sqrt(2 * 0.975 * 0.025), rel=1e-15)


def test_t_interval_ratio_of_three_seeds_by_hand():
    # log ratios 0, 0.1, -0.1: mean 0 (ratio 1), sample sd sqrt((0 + 0.01 + 0.01) / 2) = 0.1
    arm, base = [2.0, 3.0 * math.exp(0.1), 5.0 * math.exp(-0.1)], [2.0, 3.0, 5.0]
    point, low, high = t_interval_ratio(arm, base)
    half = T_975_2 * 0.1 / math.sqrt(3)  # 0.24841
    assert point == pytest.approx(1.0, rel=1e-12)
    assert (low, high) == pytest.approx((math.exp(-half), math.exp(half)), rel=1e-12)
    assert (low, high) == pytest.approx((0.78003, 1.28199), abs=1e-5)
    # a constant ratio: a point interval; the order of the seeds does not matter
    assert t_interval_ratio([2, 4, 6], [1, 2, 3]) == pytest.approx((2.0, 2.0, 2.0), rel=1e-12)
    assert t_interval_ratio(arm[::-1], base[::-1]) == pytest.approx((point, low, high), rel=1e-12)


def test_t_interval_ratio_of_one_seed_has_no_interval():
    assert t_interval_ratio([5.0], [4.0]) == (1.25, None, None)
    assert t_interval_ratio([], []) is None and t_interval_ratio([1.0, 0.0], [1.0, 1.0]) is None


def test_a_censored_seed_enters_the_t_interval_at_its_budget():
    # seed 1 of the arm never reaches the target: its budget 400 stands in (ratio 400 / 200 = 2, a lower bound);
    # the others 100 / 100 = 1 and 150 / 300 = 1/2. Logs 0, ln 2, -ln 2: mean 0, sd ln 2
    r = paired_ratio({0: 100.0, 1: None, 2: 150.0}, {0: 400.0, 1: 400.0, 2: 400.0},
                     {0: 100.0, 1: 200.0, 2: 300.0}, {0: 400.0, 1: 400.0, 2: 400.0}, [0, 1, 2])
    half = T_975_2 * math.log(2) / math.sqrt(3)
    assert r["point_is"] == "lower_bound" and r["reached"] == {"arm": 2, "baseline": 3, "of": 3}
    assert r["point"] == pytest.approx(1.0, rel=1e-12)
    assert r["ci95"] == pytest.approx([math.exp(-half), math.exp(half)], rel=1e-12)
    assert r["ratio_of_means"] == pytest.approx(650 / 600, rel=1e-12)
    # 3 seeds: every seed drawn three times is a resample with probability 1/27 > 2.5%, so the bootstrap's 2.5 and
    # 97.5 percentiles are the smallest and largest per-seed ratio
    assert r["bootstrap_ci95"] == pytest.approx([0.5, 2.0], rel=1e-12)
    # a censored baseline seed: its budget in the denominator, an upper bound
    up = paired_ratio({0: 100.0, 1: 300.0}, {0: 400.0, 1: 400.0}, {0: 100.0, 1: None}, {0: 400.0, 1: 400.0}, [0, 1])
    assert up["point_is"] == "upper_bound" and up["point"] == pytest.approx(math.sqrt(3 / 4), rel=1e-12)


def test_summarize_carries_the_t_interval_with_the_bootstrap_beside_it():
    ratio = _hand_built()["arms"]["new"]["targets"]["baseline_100pct"]["ratio_to_baseline"]["tokens"]
    logs = [math.log(r) for r in (11 / 14, 44 / 51, 8 / 9)]  # the per-seed ratios (see the test above)
    mean = sum(logs) / 3
    half = T_975_2 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
    assert ratio["point"] == pytest.approx(math.exp(mean), rel=1e-12)
    assert ratio["ci95"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)], rel=1e-12)
    assert ratio["ci95"] == pytest.approx([0.71981, 0.99108], abs=1e-5)
    assert ratio["bootstrap_ci95"] == pytest.approx([11 / 14, 8 / 9], rel=1e-12)  # 3 seeds: the per-seed range
    results = _hand_built()
    assert results["interval"]["level"] == 0.95 and "t-interval" in results["interval"]["method"]
    assert results["bootstrap"]["of"] == "ratio_of_means"


def _read_four_a_trained() -> dict:
    """Each cell trains 300 tokens; `new` reads 1,200 (4 a token trained), the baseline 300."""
    return {arm: {s: {"tokens_trained": 300, "tokens_read": 300 * k} for s in (0, 1, 2)} for arm, k in (("base", 1), ("new", 4))}


def test_summarize_publishes_tokens_read_to_each_target():
    results = _hand_built(compute=_read_four_a_trained())
    new, base = results["arms"]["new"], results["arms"]["base"]
    # to 5/3: the arm at 550/3, 2200/9, 800/3 tokens trained, 4 read each: mean 4 x 6250/27; the baseline's seed 2
    # never reaches it: the mean of its other two, (700/3 + 850/3) / 2
    read = new["targets"]["baseline_100pct"]["tokens_read"]
    assert [read["per_seed"][s] for s in "012"] == pytest.approx([2200 / 3, 8800 / 9, 3200 / 3], rel=1e-12)
    assert read["spread"]["mean"] == pytest.approx(25000 / 27, rel=1e-12) and read["spread"]["n"] == 3
    top = base["targets"]["baseline_100pct"]["tokens_read"]
    assert top["per_seed"]["2"] is None and top["spread"]["mean"] == pytest.approx(775 / 3, rel=1e-12)
    assert top["spread"]["n"] == 2 and top["spread"]["of"] == 3
    # the single target (the baseline's mean final loss, 5/3 here) too
    assert new["tokens_read_to_target"]["mean"] == pytest.approx(25000 / 27, rel=1e-12)
    # without tokens read (older cells): unknown
    assert _hand_built()["arms"]["new"]["targets"]["baseline_100pct"]["tokens_read"]["spread"]["mean"] is None


def test_experiment_table_prints_tokens_read_to_each_target():
    from scripts.experiment_table import tables

    lines = tables(_hand_built(compute=_read_four_a_trained())).split("\n")
    at = lines.index("target `baseline_100pct`: eval loss 1.6667 (the baseline's mean eval loss at 100% of its budget)")
    assert lines[at + 2].endswith("| FLOPs with scoring, vs baseline | tokens read to target |")
    # tokens: the geometric mean 0.845 [0.720, 0.991] (test above), an upper bound; tokens read 925.9 and 258.3
    assert lines[at + 4] == "| base | 1.00 [1.00, 1.00] (2/3) | 1.00 [1.00, 1.00] (2/3) | 1.00 [1.00, 1.00] (2/3) | 258 (2/3) |"
    assert lines[at + 5].startswith("| new | ≤0.84 [0.72, 0.99] (3/3) | ≤0.84 [0.72, 0.99] (3/3) |")
    assert lines[at + 5].endswith("| 926 (3/3) |")


def test_the_scoring_pass_is_charged_to_the_arms_that_use_reference_losses(tmp_path):
    from datapipe.core import shards
    from datapipe.train.experiment import arm_scoring

    path = _experiment(tmp_path)
    scored = write_train_source(tmp_path / "scored", n_shards=2, per_shard=20)
    manifest = shards.read_manifest(scored)
    shards.write_manifest(scored, {**manifest, "scoring": {"flops": 1.5e12}})
    arms = (f"arms={{base: {{}}, rho: {{data: {scored}, set: [train.rho.enabled=true]}}, "
            f"static: {{data: {scored}, uses_scoring: true}}, plain: {{data: {scored}}}, "
            f"optout: {{data: {scored}, set: [train.rho.enabled=true], uses_scoring: false}}, "
            f"unscored: {{set: [train.rho.enabled=true]}}}}")
    exp = load_experiment_config(path, [arms])
    assert arm_scoring(exp, resolve_cells(exp)) == {"base": 0.0, "rho": 1.5e12, "static": 1.5e12, "plain": 0.0,
                                                    "optout": 0.0, "unscored": None}  # None: uses it, records none

    # data selected by a model is charged its selection, whether or not the arm uses reference losses
    shards.write_manifest(scored, {**manifest, "scoring": {"flops": 1.5e12}, "model_selection": {"flops": 2.0e9}})
    assert arm_scoring(exp, resolve_cells(exp)) == {"base": 0.0, "rho": 1.502e12, "static": 1.502e12, "plain": 2.0e9,
                                                    "optout": 2.0e9, "unscored": None}


def test_a_killed_cell_resumes_from_its_checkpoint_to_the_same_curve(tmp_path):
    from datapipe.train.experiment import run_experiment
    from datapipe.train.loop import train

    exp = load_experiment_config(_experiment(tmp_path), ["arms={base: {}}", "seeds=[0]", f"output={tmp_path / 'whole'}"])
    whole = run_experiment(exp, say=lambda *a: None)["arms"]["base"]["seeds"]["0"]
    exp = replace(exp, output=str(tmp_path / "split"))
    cfg = resolve_cells(exp)["base"][0]
    train(replace(cfg, train=replace(cfg.train, stop_at=3)))  # a cell stopped after its step-3 checkpoint
    said = []
    split = run_experiment(exp, say=said.append)["arms"]["base"]["seeds"]["0"]
    assert len(said) == 1 and "resumed from step 3, trained in" in said[0], said  # the cell's one line
    assert split["curve"] == whole["curve"]


def test_extra_eval_sets_are_evaluated_on_each_cells_final_model_overall_and_per_domain(tmp_path):
    path = _experiment(tmp_path, extra_evals={"same": str(tmp_path / "eval")})
    assert main(["experiment", str(path)]) == 0
    results = json.loads((tmp_path / "exp" / "results.json").read_text())
    for arm in results["arms"].values():
        sets = arm["final_by_eval_set"]
        assert {"eval", "same"} <= set(sets)
        # the final checkpoint re-evaluated on the eval set gives the trainer's own final evaluation
        assert sets["same"]["loss"]["mean"] == pytest.approx(sets["eval"]["loss"]["mean"], rel=1e-5)
        assert set(sets["same"]["domains"]) == set(sets["eval"]["domains"]) and sets["eval"]["domains"]
        for d, v in sets["eval"]["domains"].items():
            assert sets["same"]["domains"][d]["mean"] == pytest.approx(v["mean"], rel=1e-5)
    # the two arms' final models differ, so do their re-evaluations
    assert (results["arms"]["base"]["final_by_eval_set"]["same"]["loss"]["mean"]
            != results["arms"]["low_lr"]["final_by_eval_set"]["same"]["loss"]["mean"])
    with pytest.raises(ConfigError, match="extra_evals.bad"):
        resolve_cells(load_experiment_config(path, [f"extra_evals={{bad: {tmp_path / 'nowhere'}}}"]))
