"""The experiment runner (`datapipe experiment CONFIG`): arms × seeds of the bundled trainer at the same budget,
compared by eval loss on one declared eval distribution and by the tokens and the compute each arm needs to reach
target eval losses, with paired per-seed ratios and t-intervals over seeds.

    datapipe experiment configs/experiment-tiny.yaml

One YAML names a `base` training config (a recipe file, inline keys and `--set` overrides), `arms` (name -> `--set`
overrides and/or another curated `data` folder, and whether the arm uses the data's scoring pass), `seeds`, the
`budget` every cell trains with (steps, and optionally batch size and sequence length; arms may not change them),
the `baseline` arm, an optional `target` eval loss and the `output` folder. Every arm is evaluated on the same eval
set (`eval_source`; by default the base config's data.eval_source, else the eval split of the baseline arm's data)
with the same weighting, so the arms differ only in what they configure: with the same seed they get the same init
and, on the same data, the same data order.

What is measured (datapipe/train/lm.py):
- **Eval loss**: each evaluation reads every eval document once (no cycling; data.eval_batches is 0 in every cell,
  whatever the base config sets); the overall loss is token-weighted over the eval split (sum of token losses /
  tokens in the eval split, whose per-domain cap can weigh a small domain far more than training does) or, with `data.eval_target` (set in `base`, the same for every
  arm), the target mixture's weighted mean of the domain losses. Both the token-weighted and the plain domain-mean
  figures are kept per cell (`final_by_eval_set`).
- **Compute**: FLOPs = 6·N·(tokens trained) + 2·N·(tokens forwarded only, e.g. RHO's selection forward), N = the
  parameters a token's forward multiplies by (`lm.flops_params`: blocks, final norm and output projection; not the
  input-embedding lookup). Evaluations' forwards are reported apart (`eval_flops`), never counted as training. An
  arm that uses reference-model losses (`uses_scoring`, default: when `train.rho.enabled`) has the scoring pass's
  FLOPs (`manifest["scoring"]["flops"]` of its data: training the reference models and scoring the pool) added to
  every cell (`flops_with_scoring`): a one-off cost that runs on the same scored data could share, so both figures
  are reported. Data curated with selection by a model always has that selection's FLOPs
  (`manifest["model_selection"]["flops"]`) in `flops_with_scoring`. Also per cell: tokens trained, tokens read (every row the loader delivered), distinct tokens (of the
  distinct pieces delivered) and wall time (training loop + evaluations).
- **Targets**: the baseline's mean eval loss at 50%, 75% and 100% of its budget (its mean curve over seeds,
  interpolated linearly at those fractions of its final tokens), and `target` when configured. For each target, arm
  and seed: the tokens and the FLOPs at which the curve first reaches it (linear interpolation between evaluations;
  null when never reached).
- **Ratios** to the baseline, per target, for tokens, FLOPs and FLOPs with scoring: per seed, paired with the
  baseline's cell of the same seed; over seeds, `point` is the geometric mean of the paired ratios (the exponential
  of their mean log) and `ci95` its 95% t-interval (mean log ratio ± t_{0.975, n-1} x sd / sqrt(n), exponentiated;
  null with fewer than 2 seeds): with the few seeds an experiment runs (2 to 5) a percentile bootstrap covers well
  short of 95% (about 85% with 5 seeds, about half with 2) and is narrower than the t-interval, so the t-interval is
  the one reported. The point used to be the ratio of the means; it is the geometric mean of the paired ratios now so
  that the point and the interval measure the same thing. The ratio of the means is kept as `ratio_of_means`, with
  its 95% paired percentile bootstrap as `bootstrap_ci95` (10,000 resamples of the seeds with replacement, numpy seed
  0; null with fewer than 2 seeds). A seed that never reaches the target is *censored at its budget* (its final tokens
  or FLOPs stand in for the crossing, which is larger) in the point and in both intervals: the ratio is then a bound,
  and `point_is` says which (`lower_bound` when only the arm has censored seeds, `upper_bound` when only the baseline
  has, `censored_both`), beside how many seeds of each reached it.
- **Tokens read**: per target (`tokens_read`), each seed's tokens read to its crossing (its tokens to the target x
  the cell's tokens read / tokens trained: RHO-LOSS reads several candidate rows per row it trains on) and their
  mean over the seeds that reach it; per arm, the same for the single target (`tokens_read_to_target`).

Each cell (arm, seed) is one training run in OUTPUT/cells/ARM/seed-N. Rerunning the command reads back a finished
cell (its checkpoint reached budget.steps); a cell killed after a checkpoint continues from it with `--resume`
semantics (the trainer refuses when its settings changed); one killed before its first checkpoint restarts.
Progress is one line per cell when it is done (its final eval loss, tokens trained and seconds); `--verbose`
(`verbose=True`) adds each cell's trainer lines, every log step of it.
OUTPUT/results.json (written atomically) holds every cell's eval-loss curve over tokens trained and FLOPs, its final
eval loss, compute and crossings; per arm the mean ± std over seeds, the `targets` with their ratios and intervals,
and the older single-target fields (`target`: the configured one, else the baseline's mean final loss;
`tokens_to_target`, `tokens_read_to_target`, `ratio_to_baseline` with `of_means` over the seeds that reach it and
`of_mean_curve`, the tokens at which the arm's mean curve reaches it against the baseline's). `final_by_eval_set`
holds the final losses, overall (both weightings) and per domain, on the eval set and on each of `extra_evals` (e.g.
the clean part of the split: the held-out documents every filter keeps), whose evaluations of a cell's final model
are cached in the cell.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
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
                 "data.holdout_shards", "data.eval_batches", "data.eval_target")


@dataclass(frozen=True, kw_only=True)
class BaseConfig:
    recipe: str | None = note(None, help="a YAML training recipe (e.g. configs/train-tiny.yaml), relative to the working directory")
    config: dict[str, Any] = note({}, help="inline training keys, merged over the recipe (e.g. {model: {n_layer: 2}})")
    set: list[str] = note([], help="`--set`-style KEY=VALUE overrides applied after the recipe and inline keys (the "
                                   "budget's keys and data.eval_batches are the experiment's: every evaluation reads "
                                   "every eval document)")
    data: str | None = note(None, help="the curated folder every arm trains on unless it names its own (default: the recipe's data.source)")


@dataclass(frozen=True, kw_only=True)
class ArmConfig:
    set: list[str] = note([], help="`--set`-style KEY=VALUE overrides of this arm (train.steps, batch, seq, seed, eval and output keys are the experiment's)")
    data: str | None = note(None, help="a curated folder this arm trains on instead of the base data")
    uses_scoring: bool | None = note(None, help="whether the arm's cells use the reference-model losses of their data's "
                                                "scoring pass, whose FLOPs (manifest scoring.flops) are then added to "
                                                "the arm's compute (null: when train.rho.enabled)")


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
    if base.data.eval_target is not None and Path(eval_source, shards.MANIFEST_NAME).is_file():
        from datapipe.train.lm import eval_weights

        domains = sorted(d for d, c in shards.read_manifest(eval_source).get("domains", {}).items() if c.get("docs", 0) > 0)
        try:
            eval_weights(base.data.eval_target, domains, eval_source)
        except ConfigError as exc:
            raise ConfigError(f"base: {exc}") from None
    # every evaluation reads every eval document (0: no cap), whatever the recipe's data.eval_batches: a capped one
    # would compare the arms on the eval set's leading part only
    budget = {**compute, "data.eval_source": eval_source, "data.holdout_shards": 0, "data.eval_batches": 0}
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


def _final(record: dict[str, Any]) -> dict[str, Any]:
    """An eval record (or `evaluate`'s result) as a final_by_eval_set entry: the overall loss under the run's weighting,
    both weightings, and per domain the loss and the tokens scored (older records: the fields they have)."""
    out = {"loss": float(record["eval_loss"]), "weighting": record.get("eval_weighting"),
           "loss_tokens": record.get("eval_loss_tokens"), "loss_domain_mean": record.get("eval_loss_domain_mean"),
           "domains": {d: (float(v["loss"]) if v["loss"] is not None else None)
                       for d, v in record.get("eval_domains", {}).items()},
           "domain_tokens": {d: v.get("tokens") for d, v in record.get("eval_domains", {}).items()}}
    return out


def final_evaluations(cfg: TrainConfig, sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    """A finished cell's final model evaluated on each extra eval set, overall and per domain (the trainer's own
    `evaluate`, with the cell's batch shape, data.eval_batches and data.eval_target when the set holds its domains,
    else token-weighted); cached in RUN_DIR/extra_evals.json by name and folder, so a rerun evaluates only what is
    new (entries of the older per-domain-batches evaluation are not reused)."""
    from datapipe.train.lm import evaluate
    from datapipe.train.model import GPT

    cache_path = Path(cfg.train.output) / "extra_evals.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    wanted = {name: f"{name}={folder};every-document-once" for name, folder in sources.items()}
    if any(key not in cache for key in wanted.values()):
        ckpt = load_checkpoint(Path(cfg.train.output) / "checkpoint.pt", what="datapipe experiment")
        saved = from_dict(TrainConfig, ckpt["config"])
        model = GPT(saved.model)
        model.load_state_dict(ckpt["model"])
        for name, key in wanted.items():
            if key not in cache:
                target = saved.data.eval_target
                if target is not None:
                    domains = shards.read_manifest(sources[name]).get("domains", {})
                    target = target if all(domains.get(d, {}).get("docs", 0) > 0 for d in target) else None
                cache[key] = evaluate(model, sources[name], saved, torch.device("cpu"), 0, 1, target)
        shards.atomic_write_json(cache_path, cache)
    return {name: _final(cache[key]) for name, key in wanted.items()}


def _metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl, in order."""
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines() if line.strip()]


def _last_with(records: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The last record holding `key` ({} when none does)."""
    return next((r for r in reversed(records) if key in r), {})


def final_eval(run_dir: str | Path, records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The last evaluation in RUN_DIR/metrics.jsonl (or in its `records`) as a final_by_eval_set entry (`_final`)."""
    last = _last_with(records if records is not None else _metrics(run_dir), "eval_domains")
    return _final(last) if last else {}


# the compute fields a cell's last log record carries (datapipe/train/lm.py LMObjective.compute)
COMPUTE_KEYS = ("flops", "tokens_trained", "tokens_forwarded_only", "tokens_read", "distinct_tokens", "eval_flops",
                "wall_s", "eval_s")


def cell_compute(run_dir: str | Path, records: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The compute of a finished cell: the COMPUTE_KEYS of the last record of RUN_DIR/metrics.jsonl (or of its
    `records`) that has them (null each for a run logged before they were)."""
    last = _last_with(records if records is not None else _metrics(run_dir), "flops")
    return {k: last.get(k) for k in COMPUTE_KEYS}


def scoring_flops(data: str, key: str = "scoring") -> float | None:
    """FLOPs a curated folder records under `manifest[key]["flops"]`: `scoring` (training its reference models and
    scoring its documents, written by `datapipe score`) or `model_selection` (fitting and scoring with a selection
    model during curation); None when it records none."""
    try:
        flops = (shards.read_manifest(data).get(key) or {}).get("flops")
    except (OSError, ValueError, KeyError):
        return None
    return float(flops) if isinstance(flops, (int, float)) else None


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


def eval_curve(run_dir: str | Path, every: int, steps: int, records: list[dict[str, Any]] | None = None,
               domain: str | None = None) -> list[tuple[int, float, float | None]]:
    """(tokens trained, eval loss, training FLOPs) of the evaluations in RUN_DIR/metrics.jsonl at every `every` steps
    and at the last step (so every seed's curve has the same points; a run split by train.stop_at also evaluated
    where it stopped); of a step logged twice (a run resumed from an earlier checkpoint) the later record counts.
    FLOPs are None in a run logged before they were. `domain`: that eval domain's loss (`eval_domains`) instead of
    the overall one; an evaluation without it is an error naming the run."""
    by_step: dict[int, tuple[int, float, float | None]] = {}
    for record in records if records is not None else _metrics(run_dir):
        on_grid = record["step"] % every == 0 or record["step"] == steps
        if "eval_loss" in record and "tokens" in record and on_grid:
            flops = record.get("flops")
            loss = record["eval_loss"] if domain is None else (record.get("eval_domains", {}).get(domain) or {}).get("loss")
            if loss is None:
                raise ValueError(f"{run_dir}: the evaluation at step {record['step']} has no loss of eval domain {domain!r}")
            by_step[int(record["step"])] = (int(record["tokens"]), float(loss), float(flops) if flops is not None else None)
    return [by_step[s] for s in sorted(by_step)]


def tokens_to_target(curve: list[tuple[float, float]], target: float) -> float | None:
    """Tokens (or any cumulative x: FLOPs) at which the eval loss first reaches `target`, interpolated linearly
    between the two evaluations around the crossing; the first evaluation's x when it is already at or below it;
    None if never reached. `curve`: (x, eval loss) points in order."""
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


BOOTSTRAP_RESAMPLES = 10_000  # resamples of the seeds
BOOTSTRAP_SEED = 0  # numpy.random.default_rng seed: the intervals are the same on every rerun
TARGET_FRACTIONS = (0.5, 0.75, 1.0)  # of the baseline's budget (tokens trained): the targets' points on its mean curve
MEASURES = ("tokens", "flops", "flops_with_scoring")  # what a crossing is measured in

NOTES = {
    "eval": "each evaluation reads every eval document once; eval_loss is token-weighted over the eval split "
            "(eval_weighting 'tokens') or the data.eval_target mixture of the domain losses ('target'); "
            "final_by_eval_set gives both weightings (loss_tokens, loss_domain_mean) and the per-domain losses",
    "flops": "6 N x tokens trained + 2 N x tokens forwarded only (N: parameters a token's forward multiplies by: blocks, "
             "final norm, output projection; not the input-embedding lookup); evaluation forwards are in eval_flops, "
             "not in flops",
    "scoring": "flops_with_scoring adds, to every cell of an arm that uses reference-model losses, the FLOPs of its "
               "data's scoring pass (training the reference models and scoring the pool): a one-off cost that runs on "
               "the same scored data can share (amortise); flops leaves it out",
    "ratios": "per target and measure: per seed, arm / baseline cell of the same seed; point = geometric mean of "
              "those paired ratios over seeds; ci95 = its 95% t-interval (mean log ratio +- t(0.975, n - 1) x sd / "
              "sqrt(n), exponentiated; null with fewer than 2 seeds: with few seeds a percentile bootstrap covers well "
              "short of 95%). ratio_of_means = mean over seeds of the arm / mean of the baseline (the point before), "
              "bootstrap_ci95 = 2.5 and 97.5 percentiles of it over 10,000 paired resamples of the seeds with "
              "replacement (numpy seed 0). A seed that never reaches the target is censored at its budget (its final "
              "tokens or FLOPs stand in for its crossing, which is larger): point_is says whether the point is an "
              "estimate or a lower/upper bound; reached counts the seeds that reach it",
    "tokens_read": "tokens the loader delivered to the crossing: tokens to the target x the cell's tokens_read / "
                   "tokens_trained (RHO-LOSS reads candidate rows it does not train on); mean over the seeds that "
                   "reach it",
}


def bootstrap_ratio(arm: list[float], base: list[float], *, resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = BOOTSTRAP_SEED) -> list[float] | None:
    """The 95% percentile interval of mean(arm) / mean(base) over the seeds resampled with replacement, paired (one
    draw of seed indices for both lists); None with fewer than 2 seeds."""
    n = len(arm)
    if n < 2:
        return None
    a, b = np.asarray(arm, dtype=np.float64), np.asarray(base, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    lo, hi = np.quantile(a[idx].mean(axis=1) / b[idx].mean(axis=1), [0.025, 0.975])
    return [float(lo), float(hi)]


def t_interval_ratio(arm: list[float], base: list[float]) -> tuple[float, float | None, float | None] | None:
    """The geometric mean of the paired ratios arm[i] / base[i] and its two-sided 95% t-interval: per seed the log
    ratio; exp(mean), exp(mean -+ t_{0.975, n-1} x sd / sqrt(n)) with the sample sd (n - 1). Lower and upper are None
    below 2 seeds; None without seeds or with a value <= 0. Censoring is the caller's: `paired_ratio` passes a censored
    seed's budget as its value, so the result is then a bound (`point_is`)."""
    n = len(arm)
    if n == 0 or len(base) != n or any(v <= 0 for v in (*arm, *base)):
        return None
    logs = [math.log(a / b) for a, b in zip(arm, base)]
    mean = statistics.fmean(logs)
    if n < 2:
        return math.exp(mean), None, None
    import scipy.stats  # a dependency of datasketch's; only needed here

    half = float(scipy.stats.t.ppf(0.975, n - 1)) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def paired_ratio(arm: dict[int, float | None], arm_budget: dict[int, float | None], base: dict[int, float | None],
                 base_budget: dict[int, float | None], seeds: list[int], *, same: bool = False) -> dict[str, Any] | None:
    """Arm against baseline for one target and measure. `arm`/`base`: each seed's crossing (None: never reached),
    `*_budget`: each seed's final value, which stands in for a crossing never reached (censored at the budget).
    `point` and `ci95`: `t_interval_ratio`; `ratio_of_means` and `bootstrap_ci95`: `bootstrap_ratio`.
    None when a value is unknown (a run logged before FLOPs were) or not positive."""
    a, b, per_seed = [], [], {}
    for seed in seeds:
        av = arm[seed] if arm[seed] is not None else arm_budget[seed]
        bv = base[seed] if base[seed] is not None else base_budget[seed]
        if av is None or bv is None or bv <= 0 or av <= 0:
            return None
        a.append(av)
        b.append(bv)
        per_seed[str(seed)] = {"ratio": av / bv, "arm_censored": arm[seed] is None,
                               "baseline_censored": base[seed] is None}
    arm_cens = any(arm[s] is None for s in seeds)
    base_cens = any(base[s] is None for s in seeds)
    point_is = ("baseline" if same else "censored_both" if arm_cens and base_cens else
                "lower_bound" if arm_cens else "upper_bound" if base_cens else "estimate")
    point, low, high = t_interval_ratio(a, b)
    return {"point": point, "ci95": [low, high] if low is not None else None,
            "ratio_of_means": statistics.fmean(a) / statistics.fmean(b), "bootstrap_ci95": bootstrap_ratio(a, b),
            "point_is": point_is,
            "reached": {"arm": sum(arm[s] is not None for s in seeds), "baseline": sum(base[s] is not None for s in seeds),
                        "of": len(seeds)},
            "per_seed": per_seed, "paired": _spread([r["ratio"] for r in per_seed.values()])}


def _points(curve: list[tuple]) -> list[tuple[float, float, float | None]]:
    """(tokens, eval loss, FLOPs or None) of a curve given as 2- or 3-tuples."""
    return [(float(p[0]), float(p[1]), (float(p[2]) if len(p) > 2 and p[2] is not None else None)) for p in curve]


def _crossing(points: list[tuple[float, float, float | None]], target: float, scoring: float | None) -> dict[str, Any]:
    """Where a cell's curve first reaches `target`, in each measure (None: never reached or unknown), and its budget
    (the final values, which stand in for a crossing never reached)."""
    known = all(p[2] is not None for p in points)
    tokens = tokens_to_target([(p[0], p[1]) for p in points], target)
    flops = tokens_to_target([(p[2], p[1]) for p in points], target) if known else None
    budget_flops = points[-1][2] if known else None
    def add(v: float | None) -> float | None:
        return v + scoring if v is not None and scoring is not None else None

    return {"at": {"tokens": tokens, "flops": flops, "flops_with_scoring": add(flops)},
            "budget": {"tokens": points[-1][0], "flops": budget_flops, "flops_with_scoring": add(budget_flops)}}


def summarize(exp: ExperimentConfig, curves: dict[str, dict[int, list[tuple]]],
              cells: dict[str, dict[int, TrainConfig]] | None = None,
              finals_by_set: dict[str, dict[int, dict[str, dict[str, Any]]]] | None = None,
              compute: dict[str, dict[int, dict[str, Any]]] | None = None,
              scoring: dict[str, float | None] | None = None) -> dict[str, Any]:
    """The results document (see the module docstring). `curves`: arm -> seed -> (tokens, eval loss[, FLOPs]) points
    (the same evaluation steps in every cell); `cells`: the cells' configs (run folders, data, eval weighting);
    `finals_by_set`: arm -> seed -> eval set -> `_final` entry; `compute`: arm -> seed -> `cell_compute`;
    `scoring`: arm -> the scoring FLOPs added to each of its cells (0 or absent: the arm uses no scoring; None: it
    does but its data records none, so FLOPs with scoring are unknown)."""
    points = {arm: {seed: _points(c) for seed, c in by_seed.items()} for arm, by_seed in curves.items()}
    scoring = {arm: (scoring or {}).get(arm, 0.0) for arm in curves}
    seeds = list(exp.seeds)
    finals = {arm: {seed: c[-1][1] for seed, c in by_seed.items()} for arm, by_seed in points.items()}
    target = exp.target if exp.target is not None else statistics.fmean(finals[exp.baseline].values())
    reach = {arm: {seed: tokens_to_target([(t, v) for t, v, _ in c], target) for seed, c in by_seed.items()}
             for arm, by_seed in points.items()}
    targets = _targets(exp, _mean_curve(points[exp.baseline], seeds))
    crossings = {name: {arm: {seed: _crossing(c, t["loss"], scoring[arm]) for seed, c in by_seed.items()}
                        for arm, by_seed in points.items()} for name, t in targets.items()}
    arms = {arm: _arm_summary(exp, arm, by_seed, seeds, cells=cells, finals=finals[arm], reach=reach, targets=targets,
                              crossings=crossings, finals_by_set=finals_by_set,
                              compute=(compute or {}).get(arm, {}), scoring=scoring[arm])
            for arm, by_seed in points.items()}
    base_cross = _add_mean_curve_crossings(arms, exp.baseline, target)
    base_cfg = cells[exp.baseline][seeds[0]] if cells else None
    eval_target = base_cfg.data.eval_target if base_cfg else None
    return {"baseline": exp.baseline, "target": target, "baseline_mean_curve_tokens_to_target": base_cross,
            "target_from": "config" if exp.target is not None else "baseline final eval loss (mean over seeds)",
            "targets": targets, "seeds": seeds, "budget": to_dict(exp.budget) | {"eval_every": exp.budget.eval_interval},
            "eval_source": base_cfg.data.eval_source if base_cfg else exp.eval_source,
            "eval_weighting": "target" if eval_target is not None else "tokens", "eval_target": eval_target,
            "interval": {"method": "t-interval of the mean per-seed log ratio (df = seeds - 1), exponentiated",
                         "level": 0.95, "min_seeds": 2, "not_reached": "censored at the seed's budget"},
            "bootstrap": {"resamples": BOOTSTRAP_RESAMPLES, "seed": BOOTSTRAP_SEED, "level": 0.95,
                          "of": "ratio_of_means", "min_seeds": 2, "not_reached": "censored at the seed's budget"},
            "notes": NOTES, "arms": arms}


def _mean_curve(by_seed: dict[int, list[tuple[float, float, float | None]]], seeds: list[int]) -> dict[str, list]:
    """An arm's curve averaged over its seeds at each evaluation: tokens, eval loss (mean and std) and FLOPs (None
    unless every point has them)."""
    n_points = min(len(c) for c in by_seed.values())  # the same eval steps in every seed
    at = [[by_seed[s][i] for s in seeds] for i in range(n_points)]
    known = all(p[2] is not None for row in at for p in row)
    return {"tokens": [statistics.fmean(p[0] for p in row) for row in at],
            "mean": [statistics.fmean(p[1] for p in row) for row in at],
            "std": [statistics.pstdev([p[1] for p in row]) for row in at],
            "flops": [statistics.fmean(p[2] for p in row) for row in at] if known else None}


def _targets(exp: ExperimentConfig, base_curve: dict[str, list]) -> dict[str, dict[str, Any]]:
    """The targets: the baseline's mean curve at fractions of its budget, and the configured one."""
    targets: dict[str, dict[str, Any]] = {}
    for frac in TARGET_FRACTIONS:
        at = frac * base_curve["tokens"][-1]
        targets[f"baseline_{round(100 * frac)}pct"] = {
            "loss": float(np.interp(at, base_curve["tokens"], base_curve["mean"])), "tokens": at,
            "from": f"the baseline's mean eval loss at {frac:.0%} of its budget (its mean curve over seeds at "
                    f"{at:,.0f} tokens, interpolated linearly; clamped to its first evaluation before it)"}
    if exp.target is not None:
        targets["config"] = {"loss": float(exp.target), "tokens": None, "from": "the experiment's target"}
    return targets


def _arm_summary(exp: ExperimentConfig, arm: str, by_seed: dict[int, list[tuple[float, float, float | None]]],
                 seeds: list[int], *, cells: dict[str, dict[int, TrainConfig]] | None, finals: dict[int, float],
                 reach: dict[str, dict[int, float | None]], targets: dict[str, dict[str, Any]],
                 crossings: dict[str, dict[str, dict[int, dict[str, Any]]]],
                 finals_by_set: dict[str, dict[int, dict[str, dict[str, Any]]]] | None,
                 compute: dict[int, dict[str, Any]], scoring: float | None) -> dict[str, Any]:
    """One arm's entry of the results, but its mean curve's crossing (`_add_mean_curve_crossings`). `finals`: each
    seed's final eval loss; `compute`: seed -> `cell_compute`; `scoring`: the scoring FLOPs of each of its cells."""
    base_reach = reach[exp.baseline]
    paired = [reach[arm][s] / base_reach[s] if reach[arm][s] is not None and base_reach[s] else None for s in seeds]
    arm_tt, base_tt = _spread(list(reach[arm].values())), _spread(list(base_reach.values()))
    cell_compute_of = _compute_with_scoring(by_seed, compute, scoring)
    read = {s: _read_per_trained(cell_compute_of[s]) for s in seeds}
    return {
        "overrides": list(exp.arms[arm].set),
        "data": cells[arm][seeds[0]].data.source if cells else exp.arms[arm].data,
        "uses_scoring": bool(scoring != 0.0), "scoring_flops": scoring,
        "seeds": {str(seed): {"run_dir": cells[arm][seed].train.output if cells else None,
                              "curve": {"tokens": [t for t, _, _ in c], "eval_loss": [v for _, v, _ in c],
                                        "flops": [f for _, _, f in c]},
                              "final_eval_loss": finals[seed], "tokens_to_target": reach[arm][seed],
                              "compute": cell_compute_of[seed],
                              "to_target": {name: crossings[name][arm][seed]["at"] for name in targets}}
                  for seed, c in by_seed.items()},
        "curve": _mean_curve(by_seed, seeds),
        "final_eval_loss": _spread(list(finals.values())),
        "final_by_eval_set": _by_eval_set(finals_by_set[arm]) if finals_by_set else {},
        "compute": {k: _spread([cell_compute_of[s].get(k) for s in seeds]) for k in (*COMPUTE_KEYS, "flops_with_scoring")},
        "targets": _per_target(exp, arm, seeds, targets, crossings, read),
        "tokens_to_target": arm_tt,
        "tokens_read_to_target": _spread([_times(reach[arm][s], read[s]) for s in seeds]),
        "ratio_to_baseline": {
            "of_means": arm_tt["mean"] / base_tt["mean"] if arm_tt["mean"] is not None and base_tt["mean"] else None,
            "per_seed": _spread(paired)},
    }


def _read_per_trained(cell: dict[str, Any]) -> float | None:
    """A cell's tokens read / tokens trained (None when either is unknown or nothing was trained)."""
    read, trained = cell.get("tokens_read"), cell.get("tokens_trained")
    return read / trained if read is not None and trained else None


def _times(x: float | None, factor: float | None) -> float | None:
    return x * factor if x is not None and factor is not None else None


def _compute_with_scoring(by_seed: dict[int, list[tuple[float, float, float | None]]],
                          compute: dict[int, dict[str, Any]], scoring: float | None) -> dict[int, dict[str, Any]]:
    """Each cell's compute (its curve's last FLOPs when it records none) with the arm's scoring FLOPs, and FLOPs with
    scoring (None when either is unknown)."""
    cell_compute_of = {seed: dict(compute.get(seed) or {}) for seed in by_seed}
    for seed, cc in cell_compute_of.items():
        cc.setdefault("flops", by_seed[seed][-1][2])
        cc["scoring_flops"] = scoring
        cc["flops_with_scoring"] = (cc["flops"] + scoring if cc.get("flops") is not None
                                    and scoring is not None else None)
    return cell_compute_of


def _per_target(exp: ExperimentConfig, arm: str, seeds: list[int], targets: dict[str, dict[str, Any]],
                crossings: dict[str, dict[str, dict[int, dict[str, Any]]]],
                read: dict[int, float | None]) -> dict[str, dict[str, Any]]:
    """Per target and measure: each seed's crossing and their spread, and the ratio to the baseline's (`paired_ratio`);
    the tokens read to each seed's crossing (`read`: seed -> the cell's tokens read / tokens trained)."""
    per_target = {}
    for name, t in targets.items():
        cross = crossings[name]
        entry: dict[str, Any] = {"loss": t["loss"]}
        for m in MEASURES:
            values = {s: cross[arm][s]["at"][m] for s in seeds}
            entry[m] = {"per_seed": {str(s): v for s, v in values.items()}, "spread": _spread(list(values.values()))}
        reads = {s: _times(cross[arm][s]["at"]["tokens"], read[s]) for s in seeds}
        entry["tokens_read"] = {"per_seed": {str(s): v for s, v in reads.items()},
                                "spread": _spread(list(reads.values()))}
        entry["ratio_to_baseline"] = {
            m: paired_ratio({s: cross[arm][s]["at"][m] for s in seeds}, {s: cross[arm][s]["budget"][m] for s in seeds},
                            {s: cross[exp.baseline][s]["at"][m] for s in seeds},
                            {s: cross[exp.baseline][s]["budget"][m] for s in seeds}, seeds, same=arm == exp.baseline)
            for m in MEASURES}
        per_target[name] = entry
    return per_target


def _add_mean_curve_crossings(arms: dict[str, dict[str, Any]], baseline: str, target: float) -> float | None:
    """Each arm's `mean_curve_tokens_to_target` and `ratio_to_baseline.of_mean_curve`; returns the baseline's crossing.

    Mean curve against mean curve: with the default target (the baseline's own final mean) some seeds of the
    baseline never reach it, so a ratio over the seeds that do flatters whichever arm loses its slow seeds; the
    tokens at which each arm's mean curve (over every seed) reaches the target do not."""
    def crossing(arm: dict[str, Any]) -> float | None:
        return tokens_to_target(list(zip(arm["curve"]["tokens"], arm["curve"]["mean"])), target)

    base_cross = crossing(arms[baseline])
    for arm in arms.values():
        arm["mean_curve_tokens_to_target"] = cross = crossing(arm)
        arm["ratio_to_baseline"]["of_mean_curve"] = cross / base_cross if cross is not None and base_cross else None
    return base_cross


def _by_eval_set(per_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Mean ± std over seeds of each eval set's final loss (overall under the run's weighting, token-weighted and
    the plain mean of the domains) and per domain."""
    sets = next(iter(per_seed.values()))
    out = {}
    for name in sets:
        entry = {"loss": _spread([per_seed[s][name]["loss"] for s in per_seed]),
                 "weighting": sets[name].get("weighting"),
                 "domains": {d: _spread([per_seed[s][name]["domains"].get(d) for s in per_seed])
                             for d in sets[name]["domains"]}}
        for key in ("loss_tokens", "loss_domain_mean"):
            entry[key] = _spread([per_seed[s][name].get(key) for s in per_seed])
        entry["domain_tokens"] = sets[name].get("domain_tokens", {})
        out[name] = entry
    return out


def arm_scoring(exp: ExperimentConfig, cells: dict[str, dict[int, TrainConfig]]) -> dict[str, float | None]:
    """The data-side FLOPs each arm's cells are charged: always the selection by a model its data was curated with
    (`manifest["model_selection"]["flops"]`: the data cost it), plus its data's reference-model scoring pass
    (`manifest["scoring"]["flops"]`) when the arm uses those losses (`uses_scoring`, null: `train.rho.enabled`);
    None when it uses them but its data records none."""
    out: dict[str, float | None] = {}
    for arm, by_seed in cells.items():
        cfg = by_seed[exp.seeds[0]]
        uses = exp.arms[arm].uses_scoring
        uses = cfg.train.rho.enabled if uses is None else uses
        selection = scoring_flops(cfg.data.source, "model_selection") or 0.0
        reference = scoring_flops(cfg.data.source) if uses else 0.0
        out[arm] = None if reference is None else reference + selection
    return out


def run_experiment(exp: ExperimentConfig, *, say: Callable[..., None] = print, verbose: bool = False) -> dict[str, Any]:
    """Run every missing cell, then write OUTPUT/results.json; returns the results.

    `say` gets one line per cell when it is done (its final eval loss, tokens trained and seconds; a finished cell
    read back says so); `verbose`: also each cell's start and its trainer's lines (every log step)."""
    cells = resolve_cells(exp)  # every cell's config is valid before the first one trains
    states = {(arm, seed): _cell_state(cfg) for arm, by_seed in cells.items() for seed, cfg in by_seed.items()}
    curves: dict[str, dict[int, list[tuple]]] = {}
    finals_by_set: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
    compute: dict[str, dict[int, dict[str, Any]]] = {}
    detail = say if verbose else None  # the sub-step lines: a cell's start, its trainer's
    for n, (arm, seed) in enumerate(states, 1):
        cfg, state = cells[arm][seed], states[(arm, seed)]
        run_dir, name, t_cell = Path(cfg.train.output), f"cell {arm}/seed-{seed} [{n}/{len(states)}]", time.perf_counter()
        trained = None
        if state != "done":
            if state == "restart":  # killed before its first checkpoint: nothing to resume from
                if detail:
                    detail(f"{name}: no checkpoint, restarting")
                for file in RUN_FILES:
                    (run_dir / file).unlink(missing_ok=True)
            if detail:
                detail(f"{name}: " + ("resuming" if state == "resume" else "training") + f" -> {run_dir}")
            trained = train(cfg, resume=state == "resume", say=detail)
        records = _metrics(run_dir)  # read once for the curve, the compute and the final evaluation
        curve = eval_curve(run_dir, cfg.train.eval_every, cfg.train.steps, records)
        if not curve:
            raise ConfigError(f"cell {run_dir}: metrics.jsonl holds no evaluation with a token count")
        curves.setdefault(arm, {})[seed] = curve
        compute.setdefault(arm, {})[seed] = cell_compute(run_dir, records)
        finals_by_set.setdefault(arm, {})[seed] = {
            "eval": {**final_eval(run_dir, records), "loss": curve[-1][1]},
            **final_evaluations(cfg, dict(exp.extra_evals))}
        say(_cell_line(name, state, curve, trained, time.perf_counter() - t_cell, run_dir))
    scoring = arm_scoring(exp, cells)
    for arm in (a for a, flops in scoring.items() if flops is None):
        say(f"arm {arm}: uses its data's scoring pass, but {cells[arm][exp.seeds[0]].data.source}/manifest.json "
            "records no scoring.flops: its FLOPs with scoring are reported as unknown (null)")
    results = summarize(exp, curves, cells, finals_by_set, compute, scoring)
    out = Path(exp.output)
    out.mkdir(parents=True, exist_ok=True)
    shards.atomic_write_json(out / "results.json", results)
    return results


def _cell_line(name: str, state: str, curve: list[tuple], trained: dict[str, Any] | None, seconds: float,
               run_dir: Path) -> str:
    """A cell's one line when it is done: its final eval loss and tokens trained, and how it got there."""
    figures = f"eval loss {curve[-1][1]:.4f} after {curve[-1][0]:,.0f} tokens"
    if state == "done":
        return f"{name}: finished, read back from {run_dir}: {figures}"
    how = {"resume": f"resumed from step {trained['start_step']}, trained", "restart": "restarted (it had no "
           "checkpoint), trained"}.get(state, "trained")
    skipped = f"; {trained['skipped']} updates skipped (non-finite)" if trained["skipped"] else ""
    return f"{name}: {figures}; {how} in {seconds:.1f} s{skipped}"
