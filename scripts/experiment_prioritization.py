"""Loss-aware prioritization vs uniform sampling, measured by training: tokens to the uniform arm's final eval loss.

    python -m scripts.experiment_curation --out runs/ablation-curation --curate-only   # the data and the eval split
    python -m scripts.experiment_prioritization --out runs/prioritization

Arms (same steps, rows and sequence length, so the same tokens trained; 3 seeds):
  uniform  the loader's natural mixture, documents shuffled
  pbs      predictive batch scheduling (datapipe/loader/prioritize.py, data.prioritize) with its defaults
  odm      online data mixing (datapipe/loader/online_mixing.py, data.online_mixing): an EXP3 bandit over domains
  rho      RHO-LOSS (datapipe/train/lm.py, train.rho): of `--rho-candidates` x batch rows, train on the batch of
           highest reducible loss; the reference losses come from `datapipe score` (two reference models, each on
           one half of the training documents, scoring the other half; same model and steps as a cell)
Data: the curation ablation's `filters` recipe (dedup and quality filters) with the mixture at the natural shares
(temperature 1) cut to `--pool-tokens` tokens, so that the scoring pass (one forward of every token) stays small; it
holds out the curation ablation's eval split (`eval.source`, the raw arm's tokenizer). Scored once by
`datapipe score`, so every arm reads the same shards; eval: that split and its clean part.
Rerunning skips the finished scoring and cells. Prints the experiment's summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from scripts.experiment_curation import ARMS as CURATION_ARMS
from scripts.experiment_curation import TRAIN_SET

ARMS = {
    "uniform": [],
    "pbs": ["data.prioritize.enabled=true"],
    "odm": ["data.online_mixing.enabled=true"],
    "rho": ["train.rho.enabled=true"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ablation", default="runs/ablation-curation", help="the curation ablation's folder (its data/)")
    parser.add_argument("--recipe", default="configs/ablation-curation.yaml", help="the curation ablation's recipe")
    parser.add_argument("--pool-tokens", type=int, default=6_000_000, help="tokens of the training pool")
    parser.add_argument("--out", default="runs/prioritization")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rho-candidates", type=int, default=4, help="candidate rows per trained row (the paper: 10)")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--train-set", nargs="*", default=[], help="extra --set overrides of the training recipe")
    args = parser.parse_args(argv)
    out, data_root = Path(args.out), Path(args.ablation) / "data"
    train_set = TRAIN_SET + [f"data.seq_len={args.seq_len}", f"data.batch_size={args.batch_size}"] + list(args.train_set)
    pool, raw = out / "data-pool", data_root / "raw"
    if not (pool / "manifest.json").is_file():
        sets = [x for x in CURATION_ARMS["filters"] if not x.startswith("mixture.")] + [
            "mixture.enabled=true", "mixture.method=temperature", "mixture.temperature=1.0", "mixture.max_epochs=1",
            f"mixture.budget_tokens={args.pool_tokens}", f"eval.source={raw / 'eval'}", f"tokenizer.path={raw / 'tokenizer.json'}"]
        cmd = [sys.executable, "-m", "datapipe", "curate", args.recipe, "--output", str(pool)] + [a for s in sets for a in ("--set", s)]
        print(" ".join(cmd[3:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    scored = out / "data-scored"
    if "rho" in args.arms:  # the reference losses: once, read back when finished
        cmd = [sys.executable, "-m", "datapipe", "score", "configs/train-tiny.yaml", "--data", str(pool),
               "--output", str(scored), "--steps", str(args.steps), "--seed", "0"] + [a for s in train_set for a in ("--set", s)]
        print(" ".join(cmd[3:]), file=sys.stderr, flush=True)
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    data = scored if "rho" in args.arms else pool
    arms = {name: {"set": ARMS[name] + ([f"train.rho.candidates={args.rho_candidates}"] if name == "rho" else [])}
            for name in args.arms}
    spec = {"base": {"recipe": "configs/train-tiny.yaml", "set": train_set, "data": str(data)},
            "arms": arms, "baseline": args.arms[0], "seeds": args.seeds,
            "budget": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                       "eval_every": max(args.steps // 10, 1)},
            "eval_source": str(data_root / "raw" / "eval"), "extra_evals": {"clean": str(data_root / "clean-eval")},
            "output": str(out / "experiment")}
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    subprocess.run([sys.executable, "-m", "datapipe", "experiment", str(out / "experiment.yaml")], check=True, stdout=sys.stderr)
    results = json.loads((out / "experiment" / "results.json").read_text())
    print(json.dumps({"target": results["target"], "arms": {
        arm: {"final": {name: {"loss": v["loss"]["mean"], "std": v["loss"]["std"]} for name, v in r["final_by_eval_set"].items()},
              "tokens_to_target": r["tokens_to_target"], "ratio_to_uniform": r["ratio_to_baseline"]}
        for arm, r in results["arms"].items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
