"""Usage: python -m scripts.experiment_prioritization [--data DIR] [--out DIR] [--steps 600] [--seeds 0 1 2] [--variant NAME:KEY=V,KEY=V]

Uniform sampling vs loss-aware prioritization (datapipe/loader/prioritize.py) on the bundled tiny GPT, same
compute: the same steps, rows and seq_len, so the same tokens per step. DIR is a curated folder; when it
is missing it is made from --corpus (../shared/data): a seeded sample of 2,500 man pages, 300 license
texts and 600 stdlib files (text cut at 20,000 characters), curated with configs/quickstart.yaml.
Its shards are split into a train part and a held-out part holding one shard of each domain's last
shard-group (so evaluation covers every large domain, not just the last shard's). Writes OUT/curves.png
(mean eval loss vs tokens, ±1 std band over seeds), OUT/results.json, and prints tokens to reach a
target eval loss: the highest final eval loss over all runs (a level every run reaches).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from datapipe.core import shards
from datapipe.inspect.plots import read_metrics
from datapipe.train.config import load_train_config
from datapipe.train.loop import train


def prepare(corpus: str, folder: Path) -> None:
    """The experiment's curated folder from the shared corpus (see the usage line); about a minute."""
    import gzip
    import random
    import subprocess
    import sys

    docs = [json.loads(line) for line in gzip.open(corpus, "rt")]
    random.Random(0).shuffle(docs)
    by: dict[str, list] = {}
    for d in docs:
        by.setdefault(d["source"], []).append(d)
    subset = by["man"][:2500] + by["license"][:300] + by["code"][:600]
    folder.parent.mkdir(parents=True, exist_ok=True)
    raw = folder.parent / "subset.jsonl"
    with open(raw, "w") as f:
        for d in subset:
            f.write(json.dumps({**d, "text": d["text"][:20_000]}) + "\n")
    subprocess.run([sys.executable, "-m", "datapipe", "curate", "configs/quickstart.yaml", "--input", str(raw),
                    "--output", str(folder), "--set", f"tokenizer.train.save_dir={folder.parent / 'tokenizer'}",
                    "--set", "output.shard_bytes=1000000", "--no-progress"], check=True)


def held_out(manifest: dict) -> list[int]:
    """The last shard of every domain that has at least two single-domain shards."""
    by_domain: dict[str, list[int]] = {}
    for i, s in enumerate(manifest["shards"]):
        if len(s.get("domains", {})) == 1:
            by_domain.setdefault(next(iter(s["domains"])), []).append(i)
    return sorted(ix[-1] for ix in by_domain.values() if len(ix) >= 2)


def tokens_to(curve: list[tuple[int, float]], target: float) -> float | None:
    """Tokens at which the eval curve first reaches `target` (linear interpolation between evaluations)."""
    prev = None
    for t, loss in curve:
        if loss <= target:
            if prev is None:
                return float(t)
            (t0, l0) = prev
            return t0 + (t - t0) * (l0 - target) / max(l0 - loss, 1e-12)
        prev = (t, loss)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="out/exp7/curated")
    ap.add_argument("--corpus", default="../shared/data/corpus.jsonl.gz", help="to build --data when it is missing")
    ap.add_argument("--out", default="runs/prioritization")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--eval-batches", type=int, default=16, help="held-out batches per domain per evaluation")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=V,...",
                    help="another prioritized arm with these data.prioritize overrides, e.g. mild:temperature=1.0,floor=0.5")
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--set", action="append", default=[], help="extra dotted overrides for both arms")
    args = ap.parse_args()
    out = Path(args.out)
    source = Path(args.data)
    if not (source / "manifest.json").exists():
        prepare(args.corpus, source)
    manifest = shards.read_manifest(str(source))
    heldout = held_out(manifest)
    train_ix = [i for i in range(len(manifest["shards"])) if i not in heldout]
    train_src = shards.link_subset(source, train_ix, out / "data" / "train", note={"part": "train"})
    eval_src = shards.link_subset(source, heldout, out / "data" / "eval", note={"part": "eval"})
    print(f"train shards {train_ix}, held-out shards {heldout}")

    arms = {"uniform": ["data.prioritize.enabled=false"], "prioritized": ["data.prioritize.enabled=true"]}
    for spec in args.variant:
        name, _, sets = spec.partition(":")
        arms[name] = ["data.prioritize.enabled=true"] + [f"data.prioritize.{kv}" for kv in sets.split(",") if kv]
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in args.seeds:
        for arm in results:
            run_dir = out / f"{arm}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run folder per arm (the trainer refuses to reuse one)
            overrides = [f"train.steps={args.steps}", f"train.seed={seed}", f"train.eval_every={args.eval_every}",
                         f"train.log_every={args.eval_every}", "train.ckpt_every=0", "data.holdout_shards=0",
                         f"data.eval_source={eval_src}", f"data.eval_batches={args.eval_batches}", "train.device=cpu",
                         *arms[arm], *args.set]
            cfg = load_train_config("configs/train-tiny.yaml", overrides, data=train_src, output=str(run_dir))
            t0 = time.perf_counter()
            summary = train(cfg)
            curve = [(r["tokens"], r["eval_loss"]) for r in read_metrics(run_dir) if "eval_loss" in r and "tokens" in r]
            results[arm].append({"seed": seed, "curve": curve, "final_eval": curve[-1][1], "seconds": time.perf_counter() - t0,
                                 "eval_domains": summary.get("eval_domains")})
            print(f"{arm} seed {seed}: final eval {curve[-1][1]:.4f} in {time.perf_counter() - t0:.0f} s")

    target = max(r["final_eval"] for rs in results.values() for r in rs)
    table = {}
    for arm, rs in results.items():
        reach = [tokens_to(r["curve"], target) for r in rs]
        finals = [r["final_eval"] for r in rs]
        table[arm] = {"final_eval_mean": float(np.mean(finals)), "final_eval_std": float(np.std(finals)),
                      "tokens_to_target": reach, "tokens_to_target_mean": float(np.mean([x for x in reach if x is not None])),
                      "seconds_mean": float(np.mean([r["seconds"] for r in rs]))}
    u = table["uniform"]["tokens_to_target_mean"]
    print(f"target eval loss {target:.4f} (highest final eval loss over all runs)")
    for arm, row in table.items():
        print(f"{arm:12s} final eval {row['final_eval_mean']:.4f} ± {row['final_eval_std']:.4f} | tokens to target "
              f"{row['tokens_to_target_mean']:,.0f} ({', '.join(f'{x:,.0f}' for x in row['tokens_to_target'] if x)}) | "
              f"{row['seconds_mean']:.0f} s/run")
    for arm in table:
        if arm != "uniform":
            print(f"{arm} needs {100 * (table[arm]['tokens_to_target_mean'] / u - 1):+.1f}% tokens to reach the target vs uniform")
    (out / "results.json").write_text(json.dumps({"target": target, "table": table, "arms": arms, "runs": results}, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, color in zip(results, ("tab:blue", "tab:red", "tab:green", "tab:purple", "tab:orange")):
        curves = np.array([[loss for _, loss in r["curve"]] for r in results[arm]])
        toks = np.array([t for t, _ in results[arm][0]["curve"]]) / 1e6
        mean, std = curves.mean(0), curves.std(0)
        ax.plot(toks, mean, "o-", color=color, ms=3, label=f"{arm} (mean of {len(curves)} seeds)")
        ax.fill_between(toks, mean - std, mean + std, color=color, alpha=0.2)
    ax.axhline(target, color="gray", ls="--", lw=0.8, label=f"target {target:.3f}")
    ax.set(xlabel="training tokens (M)", ylabel="held-out loss (nats/token)", title="uniform vs loss-aware prioritization")
    ax.set_ylim(top=min(ax.get_ylim()[1], target + 1.5))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    print(f"wrote {out / 'curves.png'} and {out / 'results.json'}")


if __name__ == "__main__":
    main()
