"""The experiment runner: arms x seeds of the trainer at the same compute, results.json, results.png, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from datapipe.cli import main
from datapipe.core.config import ConfigError, to_dict
from datapipe.train.experiment import load_experiment_config, resolve_cells, tokens_to_target
from helpers import write_train_source

TINY = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.max_seq_len=64", "data.eval_batches=1",
        "train.ckpt_every=3", "optim.lr=0.01", "prefetch.depth=2", "train.device=cpu"]


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
            "baseline": "base", "seeds": [0],
            "budget": {"steps": 6, "batch_size": 2, "seq_len": 64, "eval_every": 2},
            "output": str(tmp_path / "exp"), **extra}
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_experiment_runs_arms_writes_results_and_reuses_finished_cells(tmp_path, capsys):
    path = _experiment(tmp_path)
    assert main(["experiment", str(path)]) == 0
    out = tmp_path / "exp"
    results = json.loads((out / "results.json").read_text())
    assert (out / "results.png").stat().st_size > 0
    assert results["baseline"] == "base" and set(results["arms"]) == {"base", "low_lr"}
    base = results["arms"]["base"]
    # the target defaults to the baseline's final eval loss, which the baseline reaches at its last evaluation
    assert results["target"] == pytest.approx(base["final_eval_loss"]["mean"])
    for arm in results["arms"].values():
        cell = arm["seeds"]["0"]
        assert len(cell["curve"]["tokens"]) == 3  # evaluations at steps 2, 4, 6
        assert cell["curve"]["tokens"] == sorted(cell["curve"]["tokens"]) and cell["curve"]["tokens"][0] > 0
        assert cell["final_eval_loss"] == cell["curve"]["eval_loss"][-1]
        assert set(arm["final_eval_loss"]) == {"mean", "std", "n", "of"}
        assert set(arm["ratio_to_baseline"]) == {"of_means", "per_seed", "of_mean_curve"}
        # each cell's own metrics.jsonl holds the same curve
        records = [json.loads(l) for l in (Path(cell["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        assert [r["eval_loss"] for r in records if "eval_loss" in r] == cell["curve"]["eval_loss"]
    assert 0 < base["tokens_to_target"]["mean"] <= base["seeds"]["0"]["curve"]["tokens"][-1]
    assert base["ratio_to_baseline"]["of_means"] == pytest.approx(1.0)
    # one seed: the baseline's mean curve is its curve, which reaches its own final loss at its last evaluation
    assert results["baseline_mean_curve_tokens_to_target"] == pytest.approx(base["seeds"]["0"]["curve"]["tokens"][-1])
    assert base["ratio_to_baseline"]["of_mean_curve"] == pytest.approx(1.0)
    low = results["arms"]["low_lr"]  # one seed: its mean curve is its curve
    assert low["mean_curve_tokens_to_target"] == low["seeds"]["0"]["tokens_to_target"]
    # the lower learning rate trains the same tokens but learns slower: a different curve
    assert results["arms"]["low_lr"]["seeds"]["0"]["curve"]["eval_loss"] != base["seeds"]["0"]["curve"]["eval_loss"]

    # the arms' resolved configs differ only in the keys the arm sets (and their run folders)
    saved = {arm: yaml.safe_load((out / "cells" / arm / "seed-0" / "config.yaml").read_text()) for arm in ("base", "low_lr")}
    a, b = _flatten(saved["base"]), _flatten(saved["low_lr"])
    assert {k for k in a if a[k] != b[k]} == {"optim.lr", "optim.weight_decay", "train.output"}
    assert a["train.steps"] == 6 and a["data.batch_size"] == 2 and a["train.seed"] == 0

    # a second invocation reads the finished cells back: no cell trains again
    metrics = sorted(out.glob("cells/*/seed-0/*.*"))  # metrics.jsonl, config.yaml, checkpoint.pt
    assert len(metrics) >= 6
    before = {p: p.stat().st_mtime_ns for p in metrics}
    capsys.readouterr()
    assert main(["experiment", str(path)]) == 0
    assert {p: p.stat().st_mtime_ns for p in metrics} == before
    assert capsys.readouterr().out.count("finished, read back") == 2
    assert json.loads((out / "results.json").read_text()) == results


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
    # resolved before any training: nothing was written
    assert not (tmp_path / "exp").exists()
    assert main(["experiment", str(path), "--set", "arms.x={data: 1}"]) == 2


def test_tokens_to_target_interpolates_between_evaluations():
    curve = [(100, 3.0), (200, 2.0), (300, 1.0)]
    assert tokens_to_target(curve, 1.5) == pytest.approx(250.0)
    assert tokens_to_target(curve, 3.5) == 100.0  # already reached at the first evaluation
    assert tokens_to_target(curve, 0.5) is None


def test_a_killed_cell_resumes_from_its_checkpoint_to_the_same_curve(tmp_path):
    from dataclasses import replace

    from datapipe.train.experiment import run_experiment
    from datapipe.train.loop import train

    exp = load_experiment_config(_experiment(tmp_path), ["arms={base: {}}", f"output={tmp_path / 'whole'}"])
    whole = run_experiment(exp, say=lambda *a: None)["arms"]["base"]["seeds"]["0"]
    exp = replace(exp, output=str(tmp_path / "split"))
    cfg = resolve_cells(exp)["base"][0]
    train(replace(cfg, train=replace(cfg.train, stop_at=3)))  # a cell stopped after its step-3 checkpoint
    said = []
    split = run_experiment(exp, say=said.append)["arms"]["base"]["seeds"]["0"]
    assert any("resuming" in line for line in said)
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
