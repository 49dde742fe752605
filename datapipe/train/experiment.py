"""The experiment runner (`datapipe experiment CONFIG`): arms × seeds of the bundled trainer at the same compute,
compared by eval loss and by the tokens each arm needs to reach a target eval loss.

    datapipe experiment configs/experiment-tiny.yaml

One YAML names a `base` training config (a recipe file, inline keys and `--set` overrides), `arms` (name -> `--set`
overrides and/or another curated `data` folder), `seeds`, the `budget` every cell trains with (steps, and
optionally batch size and sequence length; arms may not change them), the `baseline` arm, an optional `target`
eval loss and the `output` folder. Every arm is evaluated on the same eval set (`eval_source`; by default the base
config's data.eval_source, else the eval split of the baseline arm's data), so the arms differ only in what they
configure: with the same seed they get the same init and, on the same data, the same data order.

Each cell (arm, seed) is one training run in OUTPUT/cells/ARM/seed-N. Rerunning the command reads back a finished
cell (its checkpoint reached budget.steps); a cell killed after a checkpoint continues from it with `--resume`
semantics (the trainer refuses when its settings changed); one killed before its first checkpoint restarts.
OUTPUT/results.json (written atomically) holds every cell's eval-loss curve over tokens trained, its final eval
loss and its tokens to reach the target (linear interpolation between evaluations; null when never reached), and
per arm the mean ± std over seeds and the ratio of tokens-to-target to the baseline's (`of_means`, over the seeds
that reach it; `of_mean_curve`, the tokens at which the arm's mean curve over all seeds reaches it against the baseline's: every
seed counts). `final_by_eval_set` holds the
final losses, overall and per domain, on the eval set and on each of `extra_evals` (e.g. the clean part of the split:
the held-out documents every filter keeps), whose evaluations of a cell's final model are cached in the cell.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from datapipe.core import shards
from datapipe.core.config import ConfigError, apply_override, check, from_dict, note, read_recipe, set_key, to_dict
from datapipe.core.storage import is_url
from datapipe.train.checkpoint import load_checkpoint
from datapipe.train.config import TrainConfig, check_sources
from datapipe.train.loop import RUN_FILES, resume_problem, train

# Keys the experiment sets on every cell: arms may not override them (the same compute and the same eval per arm).
RESERVED_KEYS = ("train.steps", "train.seed", "train.output", "train.eval_every", "train.log_every", "train.stop_at",
                 "train.grad_accum", "data.batch_size", "data.seq_len", "data.source", "data.eval_source",
                 "data.holdout_shards", "data.eval_batches")


@dataclass(frozen=True, kw_only=True)
class BaseConfig:
    recipe: str | None = note(None, help="a YAML training recipe (e.g. configs/train-tiny.yaml), relative to the working directory")
    config: dict[str, Any] = note({}, help="inline training keys, merged over the recipe (e.g. {model: {n_layer: 2}})")
    set: list[str] = note([], help="`--set`-style KEY=VALUE overrides applied after the recipe and inline keys")
    data: str | None = note(None, help="the curated folder every arm trains on unless it names its own (default: the recipe's data.source)")


@dataclass(frozen=True, kw_only=True)
class ArmConfig:
    set: list[str] = note([], help="`--set`-style KEY=VALUE overrides of this arm (train.steps, batch, seq, seed, eval and output keys are the experiment's)")
    data: str | None = note(None, help="a curated folder this arm trains on instead of the base data")


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    steps: int = note(help="optimizer steps of every cell (train.steps)")
    batch_size: int | None = note(None, help="rows per micro-batch of every cell (null: the base config's data.batch_size)")
    seq_len: int | None = note(None, help="tokens per row of every cell (null: the base config's data.seq_len)")
    eval_every: int = note(0, help="steps between evaluations, the points of each eval-loss curve (0: steps // 10, at least 1)")

    def __post_init__(self) -> None:
        check(self.steps >= 1, f"steps must be an integer >= 1, got {self.steps!r}")
        for name in ("batch_size", "seq_len"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"{name} must be an integer >= 1 or null, got {value!r}")
        check(self.eval_every >= 0, f"eval_every must be an integer >= 0, got {self.eval_every!r}")

    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(self.steps // 10, 1)


@dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    base: BaseConfig = note(BaseConfig(), help="the training config every arm starts from")
    arms: dict[str, ArmConfig] = note(help="arm name -> its overrides and/or data folder")
    baseline: str = note(help="the arm the others are compared with (its name in arms)")
    seeds: list[int] = note([0], help="train.seed of the cells: each arm runs once per seed")
    budget: BudgetConfig = note(help="the compute of every cell: steps, batch size, sequence length, eval interval")
    target: float | None = note(None, help="the eval loss to reach (null: the baseline arm's final eval loss, mean over seeds)")
    eval_source: str | None = note(None, help="the curated folder every arm is evaluated on (null: the base config's data.eval_source, "
                                              "else the eval split of the baseline arm's data)")
    extra_evals: dict[str, str] = note({}, help="name -> curated folder: each cell's final model is also evaluated on these "
                                                "(e.g. the clean part of the eval split), overall and per domain")
    output: str = note("runs/experiment", help="output folder: cells/ARM/seed-N, results.json, results.png")

    def __post_init__(self) -> None:
        check(len(self.arms) >= 1, "arms must name at least one arm")
        check(not is_url(self.output), f"output must be a local folder (the arms' runs are written there), got the URL "
                                       f"{self.output!r}")
        for name in self.arms:
            check(name and "/" not in name and name not in (".", ".."), f"arms: {name!r} is not a usable folder name")
        check(self.baseline in self.arms, f"baseline must be one of the arms {sorted(self.arms)}, got {self.baseline!r}")
        check(len(self.seeds) >= 1, "seeds must list at least one seed")
        check(len(set(self.seeds)) == len(self.seeds) and all(s >= 0 for s in self.seeds),
              f"seeds must be distinct integers >= 0, got {self.seeds!r}")
        for name, folder in self.extra_evals.items():
            check(bool(name) and bool(folder), f"extra_evals: name and folder must be non-empty, got {name!r}: {folder!r}")
        check(self.target is None or math.isfinite(self.target), f"target must be a finite number or null, got {self.target!r}")


def load_experiment_config(path: str | Path | None, overrides: list[str] = (), *, output: str | None = None) -> ExperimentConfig:
    """Read an experiment YAML, apply `--set` overrides and --output, validate strictly (unknown keys name the dotted key)."""
    from datapipe.core.config import load

    return load(ExperimentConfig, path, overrides, {"output": output})


def _merge(into: dict, extra: dict) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def _override_key(assignment: str) -> str:
    return assignment.split("=", 1)[0].strip()


def cell_dir(exp: ExperimentConfig, arm: str, seed: int) -> Path:
    return Path(exp.output) / "cells" / arm / f"seed-{seed}"


def resolve_cells(exp: ExperimentConfig) -> dict[str, dict[int, TrainConfig]]:
    """Every cell's training config, built and validated before any training starts."""
    try:
        recipe, _ = read_recipe(exp.base.recipe)
    except ConfigError as exc:
        raise ConfigError(f"base.recipe: {exc}") from None
    _merge(recipe, exp.base.config)
    compute = {"train.steps": exp.budget.steps, "train.eval_every": exp.budget.eval_interval,
               "train.log_every": exp.budget.eval_interval,  # every evaluation lands on a log record: its tokens
               "train.stop_at": 0}
    if exp.budget.batch_size is not None:
        compute["data.batch_size"] = exp.budget.batch_size
    if exp.budget.seq_len is not None:
        compute["data.seq_len"] = exp.budget.seq_len
    try:
        for assignment in exp.base.set:
            apply_override(recipe, assignment)
        for key, value in compute.items():
            set_key(recipe, key, value, f"budget {key}")
        base = from_dict(TrainConfig, copy.deepcopy(recipe))
    except ConfigError as exc:
        raise ConfigError(f"base: {exc}") from None
    check(base.train.objective == "lm", f"base: train.objective must be 'lm' (experiments compare eval loss), "
                                        f"got {base.train.objective!r}")
    check(not base.data.holdout_shards, "base: data.holdout_shards would evaluate each arm on the last shards of its "
                                        "own data; every arm is evaluated on one eval set: set eval_source (or "
                                        "curate the baseline data with an eval split) and data.holdout_shards: 0")
    base_data = exp.base.data or base.data.source
    baseline_data = exp.arms[exp.baseline].data or base_data
    eval_source = exp.eval_source or base.data.eval_source
    if not eval_source and Path(baseline_data, shards.MANIFEST_NAME).is_file():
        eval_source = shards.split_source(baseline_data, "eval")
    check(bool(eval_source), f"eval_source: the arms need one eval set and none was found: the base config sets no "
                             f"data.eval_source and the baseline arm's data {baseline_data!r} has no eval split; "
                             "set eval_source to a curated folder")
    budget = {**compute, "data.eval_source": eval_source, "data.holdout_shards": 0}
    for name, folder in exp.extra_evals.items():
        check(Path(folder, shards.MANIFEST_NAME).is_file(), f"extra_evals.{name}: {folder!r} is not a curated folder "
                                                            "(no manifest.json); give a folder that `datapipe curate` wrote")

    cells: dict[str, dict[int, TrainConfig]] = {}
    for name, arm in exp.arms.items():
        for assignment in arm.set:
            key = _override_key(assignment)
            check(key not in RESERVED_KEYS, f"arms.{name}.set: {key} is set by the experiment for every arm (the same "
                                            f"compute and eval set per arm); use budget, seeds, eval_source or the arm's data")
        data = copy.deepcopy(recipe)
        try:
            for assignment in arm.set:
                apply_override(data, assignment)
            for key, value in budget.items():
                set_key(data, key, value, f"budget {key}")
            set_key(data, "data.source", arm.data or base_data, "data")
            cells[name] = {}
            for seed in exp.seeds:
                set_key(data, "train.seed", seed, "seeds")
                set_key(data, "train.output", str(cell_dir(exp, name, seed)), "output")
                cfg = from_dict(TrainConfig, copy.deepcopy(data))
                check_sources(cfg)
                cells[name][seed] = cfg
        except ConfigError as exc:
            raise ConfigError(f"arms.{name}: {exc}") from None
    return cells


def final_evaluations(cfg: TrainConfig, sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    """A finished cell's final model evaluated on each extra eval set, overall and per domain (the trainer's own
    `evaluate`, with the cell's batch shape and data.eval_batches); cached in RUN_DIR/extra_evals.json by name
    and folder, so a rerun evaluates only what is new."""
    from datapipe.train.lm import evaluate
    from datapipe.train.model import GPT

    cache_path = Path(cfg.train.output) / "extra_evals.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    wanted = {name: f"{name}={folder}" for name, folder in sources.items()}
    if any(key not in cache for key in wanted.values()):
        ckpt = load_checkpoint(Path(cfg.train.output) / "checkpoint.pt", what="datapipe experiment")
        saved = from_dict(TrainConfig, ckpt["config"])
        model = GPT(saved.model)
        model.load_state_dict(ckpt["model"])
        for name, key in wanted.items():
            if key not in cache:
                cache[key] = evaluate(model, sources[name], saved, torch.device("cpu"), 0, 1)
        shards.atomic_write_json(cache_path, cache)
    return {name: {"loss": cache[key]["eval_loss"], "domains": {d: v["loss"] for d, v in cache[key]["eval_domains"].items()}}
            for name, key in wanted.items()}


def final_domains(run_dir: str | Path) -> dict[str, float]:
    """Per-domain eval loss of the last evaluation in RUN_DIR/metrics.jsonl."""
    last: dict[str, float] = {}
    for line in Path(run_dir, "metrics.jsonl").read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "eval_domains" in record:
            last = {d: float(v["loss"]) for d, v in record["eval_domains"].items()}
    return last


def _cell_state(cfg: TrainConfig) -> str:
    """'done' (its checkpoint reached train.steps), 'resume' (a checkpoint short of it), 'fresh' (no run yet)
    or 'restart' (files of a run killed before its first checkpoint)."""
    run_dir = Path(cfg.train.output)
    ckpt_path = run_dir / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = load_checkpoint(ckpt_path, what="datapipe experiment")
        problem = resume_problem(ckpt.get("config", {}), cfg)
        if problem:
            raise ConfigError(f"cell {run_dir} was trained with other settings than this experiment now gives it "
                              f"({problem.removeprefix('--resume: ')}); restore the experiment's settings or use "
                              "another output")
        return "done" if int(ckpt["step"]) >= cfg.train.steps else "resume"
    return "restart" if any((run_dir / name).exists() for name in RUN_FILES) else "fresh"


def eval_curve(run_dir: str | Path, every: int, steps: int) -> list[tuple[int, float]]:
    """(tokens trained, eval loss) of the evaluations in RUN_DIR/metrics.jsonl at every `every` steps and at the
    last step (so every seed's curve has the same points; a run split by train.stop_at also evaluated where it
    stopped); of a step logged twice (a run resumed from an earlier checkpoint) the later record counts."""
    by_step: dict[int, tuple[int, float]] = {}
    for line in Path(run_dir, "metrics.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        on_grid = record["step"] % every == 0 or record["step"] == steps
        if "eval_loss" in record and "tokens" in record and on_grid:
            by_step[int(record["step"])] = (int(record["tokens"]), float(record["eval_loss"]))
    return [by_step[s] for s in sorted(by_step)]


def tokens_to_target(curve: list[tuple[int, float]], target: float) -> float | None:
    """Tokens at which the eval loss first reaches `target`, interpolated linearly between the two evaluations
    around the crossing; the first evaluation's tokens when it is already at or below it; None if never reached."""
    for i, (tokens, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(tokens)
            t0, l0 = curve[i - 1]
            return t0 + (l0 - target) / (l0 - loss) * (tokens - t0)
    return None


def _spread(values: list[float | None]) -> dict[str, Any]:
    """Mean and population std of the values that are not None, and how many there were of how many."""
    got = [v for v in values if v is not None]
    return {"mean": statistics.fmean(got) if got else None, "std": statistics.pstdev(got) if got else None,
            "n": len(got), "of": len(values)}


def summarize(exp: ExperimentConfig, curves: dict[str, dict[int, list[tuple[int, float]]]],
              cells: dict[str, dict[int, TrainConfig]],
              finals_by_set: dict[str, dict[int, dict[str, dict[str, Any]]]] | None = None) -> dict[str, Any]:
    """The results document: per cell its curve, final eval loss and tokens to target; per arm the mean ± std over
    seeds and the ratio of tokens-to-target to the baseline's."""
    finals = {arm: {seed: c[-1][1] for seed, c in by_seed.items()} for arm, by_seed in curves.items()}
    target = exp.target if exp.target is not None else statistics.fmean(finals[exp.baseline].values())
    reach = {arm: {seed: tokens_to_target(c, target) for seed, c in by_seed.items()} for arm, by_seed in curves.items()}
    base_reach = reach[exp.baseline]
    arms: dict[str, Any] = {}
    for arm, by_seed in curves.items():
        n_points = min(len(c) for c in by_seed.values())  # the same eval steps in every seed
        paired = [reach[arm][s] / base_reach[s] if reach[arm][s] is not None and base_reach[s] else None
                  for s in exp.seeds]
        arm_tt, base_tt = _spread(list(reach[arm].values())), _spread(list(base_reach.values()))
        arms[arm] = {
            "overrides": list(exp.arms[arm].set),
            "data": cells[arm][exp.seeds[0]].data.source,
            "seeds": {str(seed): {"run_dir": cells[arm][seed].train.output,
                                  "curve": {"tokens": [t for t, _ in c], "eval_loss": [v for _, v in c]},
                                  "final_eval_loss": finals[arm][seed], "tokens_to_target": reach[arm][seed]}
                      for seed, c in by_seed.items()},
            "curve": {"tokens": [statistics.fmean(by_seed[s][i][0] for s in exp.seeds) for i in range(n_points)],
                      "mean": [statistics.fmean(by_seed[s][i][1] for s in exp.seeds) for i in range(n_points)],
                      "std": [statistics.pstdev([by_seed[s][i][1] for s in exp.seeds]) for i in range(n_points)]},
            "final_eval_loss": _spread(list(finals[arm].values())),
            "final_by_eval_set": _by_eval_set(finals_by_set[arm]) if finals_by_set else {},
            "tokens_to_target": arm_tt,
            "ratio_to_baseline": {
                "of_means": arm_tt["mean"] / base_tt["mean"] if arm_tt["mean"] is not None and base_tt["mean"] else None,
                "per_seed": _spread(paired)},
        }
    # Mean curve against mean curve: with the default target (the baseline's own final mean) some seeds of the
    # baseline never reach it, so a ratio over the seeds that do flatters whichever arm loses its slow seeds; the
    # tokens at which each arm's mean curve (over every seed) reaches the target do not.
    def crossing(arm: dict[str, Any]) -> float | None:
        return tokens_to_target(list(zip(arm["curve"]["tokens"], arm["curve"]["mean"])), target)

    base_cross = crossing(arms[exp.baseline])
    for arm in arms.values():
        arm["mean_curve_tokens_to_target"] = cross = crossing(arm)
        arm["ratio_to_baseline"]["of_mean_curve"] = cross / base_cross if cross is not None and base_cross else None
    return {"baseline": exp.baseline, "target": target, "baseline_mean_curve_tokens_to_target": base_cross,
            "target_from": "config" if exp.target is not None else "baseline final eval loss (mean over seeds)",
            "seeds": list(exp.seeds), "budget": to_dict(exp.budget) | {"eval_every": exp.budget.eval_interval},
            "eval_source": cells[exp.baseline][exp.seeds[0]].data.eval_source, "arms": arms}


def _by_eval_set(per_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Mean ± std over seeds of each eval set's final loss, overall and per domain."""
    sets = next(iter(per_seed.values()))
    return {name: {"loss": _spread([per_seed[s][name]["loss"] for s in per_seed]),
                   "domains": {d: _spread([per_seed[s][name]["domains"].get(d) for s in per_seed])
                               for d in sets[name]["domains"]}}
            for name in sets}


def run_experiment(exp: ExperimentConfig, *, say=print) -> dict[str, Any]:
    """Run every missing cell, then write OUTPUT/results.json; returns the results."""
    cells = resolve_cells(exp)  # every cell's config is valid before the first one trains
    states = {(arm, seed): _cell_state(cfg) for arm, by_seed in cells.items() for seed, cfg in by_seed.items()}
    curves: dict[str, dict[int, list[tuple[int, float]]]] = {}
    finals_by_set: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    for arm, by_seed in cells.items():
        curves[arm] = {}
        for seed, cfg in by_seed.items():
            state, run_dir = states[(arm, seed)], Path(cfg.train.output)
            if state == "done":
                say(f"cell {arm}/seed-{seed}: finished, read back from {run_dir}")
            else:
                if state == "restart":  # killed before its first checkpoint: nothing to resume from
                    say(f"cell {arm}/seed-{seed}: no checkpoint, restarting")
                    for name in RUN_FILES:
                        (run_dir / name).unlink(missing_ok=True)
                say(f"cell {arm}/seed-{seed}: " + ("resuming" if state == "resume" else "training") + f" -> {run_dir}")
                train(cfg, resume=state == "resume")
            curve = eval_curve(run_dir, cfg.train.eval_every, cfg.train.steps)
            if not curve:
                raise ConfigError(f"cell {run_dir}: metrics.jsonl holds no evaluation with a token count")
            curves[arm][seed] = curve
            finals_by_set.setdefault(arm, {})[seed] = {
                "eval": {"loss": curve[-1][1], "domains": final_domains(run_dir)},
                **final_evaluations(cfg, dict(exp.extra_evals))}
    results = summarize(exp, curves, cells, finals_by_set)
    out = Path(exp.output)
    out.mkdir(parents=True, exist_ok=True)
    shards.atomic_write_json(out / "results.json", results)
    return results
