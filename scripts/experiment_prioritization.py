"""Loss-aware prioritization vs uniform sampling, measured by training: eval loss, tokens and compute (FLOPs) to reach
the uniform arm's eval loss, scoring included.

    python -m scripts.experiment_curation --out runs/ablation-curation --curate-only   # the data and the eval split
    python -m scripts.experiment_prioritization --out runs/prioritization               # all arms, 5 seeds, 2 jobs

Arms (same steps, rows and sequence length, so the same tokens trained; seeds 0-4):
  uniform        the loader's natural mixture, documents shuffled
  pbs            predictive batch scheduling (datapipe/loader/prioritize.py, data.prioritize) with its defaults
  odm            online data mixing (datapipe/loader/online_mixing.py, data.online_mixing): an EXP3 bandit over domains
  odm-static     ODM's honest baseline: a fixed mixture (data.mixture) at the time-averaged weights of the odm cells
                 (`online_mixing.time_averaged_weights`: the shares of the tokens each odm seed trained on, mean over
                 seeds), so that "a better static mixture" and "online adaptivity" are told apart; it runs after odm
  rho            RHO-LOSS (datapipe/train/lm.py, train.rho): of `--rho-candidates` x batch rows, train on the batch of
                 highest reducible loss (each token's reference loss, at most train.rho.max_rows_per_doc rows of one
                 document); every candidate row is forwarded (2N FLOPs a token, forward-only)
  rho-2cand      the same with 2 candidate rows per trained row: half the selection forwards
  rho-last-loss  train.rho.selection=last_loss: no candidate forward; rows are scored by their documents' reducible
                 loss when last trained on (unseen ones: the mean). Per-step FLOPs are uniform's; it reads
                 `--rho-candidates` x the rows
  ref-band       a static learnability subset (datapipe/train/reference.py `ref_band`): per domain, the documents whose
                 reference loss lies in the middle `--band` token quantiles (dropping the lowest: already predictable,
                 and the highest: noise), trained on uniformly: no per-step cost
The reference losses come from one `datapipe score` pass (two reference models, each on one half of the pool, scoring
the other half; the cells' model unless `--ref-set` makes it smaller; `--ref-steps` steps each). Its FLOPs
(manifest scoring.flops: 6N x tokens the reference models trained + 2N x the pool's tokens) are the one-off cost of
rho*, ref-band (`uses_scoring`): results.json has every figure with and without it, and this script prints how many
runs on the same scored pool would amortise it against each arm's saving.

Data: the curation ablation's `filters` recipe (dedup and quality filters) with the mixture at the natural shares cut
to `--pool-tokens` tokens; it holds out the curation ablation's eval split (`eval.source`, the raw arm's tokenizer).
Arms without reference losses train on that pool, rho* on its scored copy (the same shards plus ref_loss columns:
the same documents in the same order), ref-band on the band's subset. Eval: that split and its clean part.

Running: phase 1 trains every arm but odm-static, phase 2 odm-static (its weights need the odm cells), then one
`datapipe experiment` over everything reads the cells back and writes results.json. `--jobs J` runs each phase as J
`datapipe experiment` processes over disjoint seeds (each with OMP_NUM_THREADS = cores / J; their logs in
OUT/logs/): cells are separate run folders, so they never share a file but the partial results.json, which the last
pass rewrites. Rerunning skips the finished scoring, band and cells (a killed cell resumes from its checkpoint).

Sizing (defaults: 150 steps x 16 rows x 256 tokens = 0.61 M tokens a cell, 3 M-token pool, 6 evaluations a cell):
measured on 2026-12-01 (BENCHMARKS.md), the whole run took about 85 minutes on 2 cores with --jobs 2, part of it
beside other jobs; the two reference runs trained at ~12.9 k tokens/s on an otherwise idle core, the cells at
~6 k tokens/s per job with two jobs, rho cells at ~3 k (four forwarded rows per trained one).
Prints the experiment's summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from scripts.experiment_curation import ARMS as CURATION_ARMS
from scripts.experiment_curation import TRAIN_SET, run_parts

# name -> (overrides, data: "pool" | "scored" | "band", uses the scoring pass)
ARMS: dict[str, tuple[list[str], str]] = {
    "uniform": ([], "pool"),
    "pbs": (["data.prioritize.enabled=true"], "pool"),
    "odm": (["data.online_mixing.enabled=true"], "pool"),
    "odm-static": ([], "pool"),  # + data.mixture at the odm cells' time-averaged weights (phase 2)
    "rho": (["train.rho.enabled=true"], "scored"),
    "rho-2cand": (["train.rho.enabled=true", "train.rho.candidates=2"], "scored"),
    "rho-last-loss": (["train.rho.enabled=true", "train.rho.selection=last_loss"], "scored"),
    "ref-band": ([], "band"),
}
PHASE_2 = ("odm-static",)


def odm_static_weights(experiment: Path, seeds: list[int], steps: int) -> dict[str, float]:
    """The mean over the odm cells' seeds of their time-averaged domain weights (each a finished cell)."""
    import torch

    from datapipe.loader.online_mixing import time_averaged_weights

    per_seed = []
    for seed in seeds:
        run = experiment / "cells" / "odm" / f"seed-{seed}"
        ckpt = run / "checkpoint.pt"
        if not ckpt.is_file() or int(torch.load(ckpt, map_location="cpu", weights_only=True)["step"]) < steps:
            raise SystemExit(f"odm-static needs the finished odm cell {run}; run the odm arm first")
        per_seed.append(time_averaged_weights(run))
    domains = sorted({d for w in per_seed for d in w})
    return {d: statistics.fmean(w.get(d, 0.0) for w in per_seed) for d in domains}


def amortisation(results: dict[str, Any]) -> dict[str, Any]:
    """Per arm that uses the scoring pass and per target: how many runs on the same scored pool pay it back, the
    scoring FLOPs over the arm's saving against the baseline in FLOPs to the target (mean over seeds, scoring left
    out); null when the arm saves nothing or a mean is unknown."""
    base = results["arms"][results["baseline"]]
    out: dict[str, Any] = {}
    for arm, r in results["arms"].items():
        scoring = r.get("scoring_flops")
        if not scoring:
            continue
        out[arm] = {}
        for name, entry in (r.get("targets") or {}).items():
            mine = ((entry.get("flops") or {}).get("spread") or {}).get("mean")
            theirs = (((base.get("targets") or {}).get(name, {}).get("flops") or {}).get("spread") or {}).get("mean")
            saving = theirs - mine if mine is not None and theirs is not None else None
            out[arm][name] = {"scoring_flops": scoring, "saving_flops_per_run": saving,
                              "runs_to_amortise": scoring / saving if saving and saving > 0 else None}
    return out


def experiment_spec(args: argparse.Namespace, names: list[str], baseline: str, folders: dict[str, Path],
                    train_set: list[str], mixture: dict[str, float] | None, experiment: Path, raw: Path,
                    data_root: Path) -> dict[str, Any]:
    """The `datapipe experiment` spec of arms `names` (odm-static trains at `mixture`)."""
    spec_arms = {}
    for name in names:
        sets, data = ARMS[name]
        sets = list(sets)
        if name.startswith("rho") and not any(s.startswith("train.rho.candidates=") for s in sets):
            sets.append(f"train.rho.candidates={args.rho_candidates}")
        if name == "odm-static":
            sets.append(f"data.mixture={json.dumps(mixture)}")
        spec_arms[name] = {"set": sets, "data": str(folders[data]),
                           **({"uses_scoring": True} if data in ("scored", "band") else {})}
    return {"base": {"recipe": "configs/train-tiny.yaml", "set": train_set, "data": str(folders["pool"])},
            "arms": spec_arms, "baseline": baseline if baseline in names else names[0], "seeds": list(args.seeds),
            "budget": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                       "eval_every": max(args.steps // max(args.evals, 1), 1)},
            "eval_source": str(raw / "eval"), "extra_evals": {"clean": str(data_root / "clean-eval")},
            "output": str(experiment)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ablation", default="runs/ablation-curation", help="the curation ablation's folder (its data/)")
    parser.add_argument("--recipe", default="configs/ablation-curation.yaml", help="the curation ablation's recipe")
    parser.add_argument("--pool-tokens", type=int, default=3_000_000, help="tokens of the training pool")
    parser.add_argument("--out", default="runs/prioritization")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--evals", type=int, default=6, help="evaluations per cell (the points of each curve)")
    parser.add_argument("--rho-candidates", type=int, default=4, help="candidate rows per trained row (the paper: 10)")
    parser.add_argument("--ref-steps", type=int, default=None, help="steps of each reference model (default: --steps)")
    parser.add_argument("--ref-set", nargs="*", default=[], help="--set overrides of the reference models only, e.g. "
                                                                "model.n_layer=1 model.d_model=64 (a smaller one)")
    parser.add_argument("--band", type=float, nargs=2, default=[0.1, 0.9], metavar=("LOW", "HIGH"),
                        help="ref-band: the token quantiles of reference loss kept, per domain")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--jobs", type=int, default=2, help="cells trained at once (processes; each gets cores / jobs threads)")
    parser.add_argument("--train-set", nargs="*", default=[], help="extra --set overrides of the training recipe")
    args = parser.parse_args(argv)
    arms = list(args.arms)
    if "odm-static" in arms and "odm" not in arms:
        arms.insert(arms.index("odm-static"), "odm")  # its weights come from the odm cells
    baseline = "uniform" if "uniform" in arms else arms[0]
    out, data_root = Path(args.out), Path(args.ablation) / "data"
    out.mkdir(parents=True, exist_ok=True)
    train_set = TRAIN_SET + [f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}"] + list(args.train_set)
    pool, raw = out / "data-pool", data_root / "raw"
    if not (pool / "manifest.json").is_file():
        sets = [x for x in CURATION_ARMS["filters"] if not x.startswith("mixture.")] + [
            "mixture.enabled=true", "mixture.method=temperature", "mixture.temperature=1.0", "mixture.max_epochs=1",
            f"mixture.budget_tokens={args.pool_tokens}", f"eval.source={raw / 'eval'}", f"tokenizer.path={raw / 'tokenizer.json'}"]
        cmd = [sys.executable, "-m", "datapipe", "curate", args.recipe, "--output", str(pool)] + [a for s in sets for a in ("--set", s)]
        print(" ".join(cmd[3:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)

    folders = {"pool": pool}
    if any(ARMS[a][1] in ("scored", "band") for a in arms):  # the reference losses: once, read back when finished
        scored = out / ("data-scored" if not args.ref_set else "data-scored-" + "-".join(
            s.replace("model.", "").replace("=", "") for s in args.ref_set))
        ref_steps = args.ref_steps or args.steps
        cmd = [sys.executable, "-m", "datapipe", "score", "configs/train-tiny.yaml", "--data", str(pool),
               "--output", str(scored), "--steps", str(ref_steps), "--seed", "0"] + [
            a for s in train_set + list(args.ref_set) for a in ("--set", s)]
        print(" ".join(cmd[3:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        folders["scored"] = scored
        if "ref-band" in arms:
            from datapipe.train.reference import ref_band

            low, high = args.band
            band = out / f"data-band-{low:g}-{high:g}" if not args.ref_set else scored.with_name(
                f"{scored.name}-band-{low:g}-{high:g}")
            ref_band(scored, band, low=low, high=high, say=lambda *a: print(*a, file=sys.stderr, flush=True))
            folders["band"] = band

    experiment = out / "experiment"

    def spec_for(names: list[str], mixture: dict[str, float] | None = None) -> dict[str, Any]:
        return experiment_spec(args, names, baseline, folders, train_set, mixture, experiment, raw, data_root)

    first = [a for a in arms if a not in PHASE_2]
    if first:
        run_parts(out, spec_for(first), "phase-1", args.jobs)
    mixture = None
    if "odm-static" in arms:
        mixture = odm_static_weights(experiment, list(args.seeds), args.steps)
        print(f"odm-static: the odm cells' time-averaged weights {mixture}", file=sys.stderr, flush=True)
        run_parts(out, spec_for(["odm-static"], mixture), "phase-2", args.jobs)
    full = spec_for(arms, mixture)
    (out / "experiment.yaml").write_text(yaml.safe_dump(full, sort_keys=False))
    subprocess.run([sys.executable, "-m", "datapipe", "experiment", str(out / "experiment.yaml")], check=True,
                   stdout=sys.stderr)  # every cell is read back: results.json over all arms and seeds
    results = json.loads((experiment / "results.json").read_text())
    scorings = {name: json.loads((Path(folders[name]) / "manifest.json").read_text()).get("scoring")
                for name in ("scored", "band") if name in folders}
    print(json.dumps({
        "target": results["target"], "targets": results.get("targets"), "eval_weighting": results.get("eval_weighting"),
        "odm_static_weights": mixture,
        "scoring": {k: {f: (v or {}).get(f) for f in ("flops", "params", "train_tokens", "forward_tokens")}
                    for k, v in scorings.items()},
        "amortisation": amortisation(results),
        "arms": {arm: {"final": {name: {"loss": v["loss"]["mean"], "std": v["loss"]["std"]}
                                 for name, v in r["final_by_eval_set"].items()},
                       "compute": {k: (r.get("compute") or {}).get(k) for k in ("flops", "flops_with_scoring",
                                                                                 "tokens_read", "wall_s")},
                       "targets": {name: {"ratio_to_baseline": e.get("ratio_to_baseline")}
                                   for name, e in (r.get("targets") or {}).items()},
                       "tokens_to_target": r["tokens_to_target"], "ratio_to_uniform": r["ratio_to_baseline"]}
                 for arm, r in results["arms"].items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
