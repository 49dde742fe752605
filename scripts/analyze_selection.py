"""The pre-registered analysis of `scripts/experiment_selection.py`: per-pool compute ratios, t-intervals, the A/A floor.

    python -m scripts.analyze_selection runs/selection [--plot benchmarks/selection.png] [--markdown]

Fixed before the runs (committed with the experiment script):
- **Target loss** per pool: the baseline (`random`) arm's eval loss on the target eval set at 0.75 B, B = STEPS / 1.5
  (linear interpolation over tokens trained; it trains to 1.5 B).
- **Endpoint** per (pool, arm): the compute at which the arm's eval loss first reaches that target (linear interpolation
  between evaluations), in FLOPs of training plus every FLOP of its selection (fitting and scoring, from its manifest:
  `model_selection.flops`); the baseline's own compute at 0.75 B is the denominator. An arm that never reaches it is
  censored at its final compute (its ratio is then a lower bound, and said so).
- **Statistic**: per arm, the mean over pools of log(arm / baseline) with a two-sided 95% t-interval (df = pools - 1),
  reported as a ratio exp(mean) [exp(lower), exp(upper)]. The A/A arm's interval is the noise floor. Also per arm:
  tokens trained and tokens read to the target (same ratio), and the selection's CPU seconds.
- **Decision**: a selector *pays* when its upper bound is below 0.9 and its point at most 0.8 (>= 20% less compute);
  *costs* when its lower bound is above 1; otherwise no difference is shown.
- **Known-answer control** (`junk`): expected ratio 1 / (1 - j), j the junk share of the tokens it trains on.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import scipy.stats

from datapipe.core import shards
from datapipe.train.experiment import cell_compute, eval_curve
from scripts.experiment_selection import ARMS, EVAL_EVERY, STEPS

TARGET_AT = 0.75 / 1.5  # of the baseline's final tokens: 0.75 B where it trains to 1.5 B
BASELINE = "random"
PAYS_UPPER, PAYS_POINT = 0.9, 0.8


def t_interval(log_ratios: list[float], level: float = 0.95) -> dict[str, Any]:
    """exp(mean) of the log ratios and the two-sided t-interval of the mean (df = n - 1); no interval below n = 2."""
    x = np.asarray(log_ratios, np.float64)
    n = len(x)
    if n == 0:
        return {"ratio": None, "low": None, "high": None, "n": 0}
    mean = float(x.mean())
    if n < 2:
        return {"ratio": math.exp(mean), "low": None, "high": None, "n": 1}
    half = float(scipy.stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "n": n}


def crossing(curve: list[tuple[float, float, float]], target: float) -> tuple[float, float] | None:
    """(tokens, flops) where the curve of (tokens, loss, flops) first reaches `target`, interpolated linearly."""
    previous = None
    for tokens, loss, flops in curve:
        if loss <= target:
            if previous is None or previous[1] == loss:
                return tokens, flops
            p_tokens, p_loss, p_flops = previous
            w = (p_loss - target) / (p_loss - loss)
            return p_tokens + w * (tokens - p_tokens), p_flops + w * (flops - p_flops)
        previous = (tokens, loss, flops)
    return None


def _at_tokens(curve: list[tuple[float, float, float]], tokens: float) -> tuple[float, float]:
    """(loss, flops) at `tokens`, interpolated linearly between evaluations."""
    xs = [c[0] for c in curve]
    return float(np.interp(tokens, xs, [c[1] for c in curve])), float(np.interp(tokens, xs, [c[2] for c in curve]))


def pool_result(folder: Path, seed: int) -> dict[str, Any]:
    """Per arm of one pool: its crossing of the baseline's target, the ratios, its selection compute."""
    cells = folder / "experiment" / "cells"
    curves = {arm: eval_curve(cells / arm / f"seed-{seed}", EVAL_EVERY, STEPS) for arm in ARMS}
    base = curves[BASELINE]
    target, base_flops = _at_tokens(base, base[-1][0] * TARGET_AT)
    base_tokens = base[-1][0] * TARGET_AT
    out: dict[str, Any] = {"target_loss": target}
    for arm, curve in curves.items():
        manifest = shards.read_manifest(folder / "data" / arm)
        selection = manifest.get("model_selection") or {}
        compute = cell_compute(cells / arm / f"seed-{seed}")
        hit = crossing(curve, target) if arm != BASELINE else (base_tokens, base_flops)
        censored = hit is None
        tokens, flops = hit if hit is not None else (curve[-1][0], curve[-1][2])
        flops += float(selection.get("flops") or 0.0)
        read_per_trained = (compute["tokens_read"] or 0) / max(compute["tokens_trained"] or 1, 1)
        domains = manifest["domains"]
        out[arm] = {"censored": censored, "tokens": tokens, "flops": flops, "log_flops_ratio": math.log(flops / base_flops),
                    "log_tokens_ratio": math.log(tokens / base_tokens),
                    "log_read_ratio": math.log(tokens * read_per_trained / base_tokens),
                    "final_loss": curve[-1][1], "selection_cpu_seconds": selection.get("cpu_seconds", 0.0),
                    "selection_flops": float(selection.get("flops") or 0.0),
                    "junk_share": domains.get("junk", {}).get("tokens", 0) / max(manifest["total_tokens"], 1),
                    # what the arm holds and how often training reads it: an arm short of its budget repeats data
                    "kept_tokens": int(manifest["total_tokens"]),
                    "epochs": (compute["tokens_trained"] or 0) / max(int(manifest["total_tokens"]), 1)}
    return out


def analyze(out: Path, pools: list[int]) -> dict[str, Any]:
    per_pool = {seed: pool_result(out / "pools" / str(seed), seed) for seed in pools}
    arms: dict[str, Any] = {}
    for arm in ARMS:
        if arm == BASELINE:
            continue
        rows = [per_pool[s][arm] for s in pools]
        flops = t_interval([r["log_flops_ratio"] for r in rows])
        verdict = ("pays" if flops["high"] is not None and flops["high"] < PAYS_UPPER and flops["ratio"] <= PAYS_POINT
                   else "costs" if flops["low"] is not None and flops["low"] > 1.0 else "no difference shown")
        arms[arm] = {"flops_ratio": flops, "tokens_ratio": t_interval([r["log_tokens_ratio"] for r in rows]),
                     "tokens_read_ratio": t_interval([r["log_read_ratio"] for r in rows]),
                     "censored_pools": sum(r["censored"] for r in rows), "verdict": verdict,
                     "per_pool_flops_ratio": {s: round(math.exp(per_pool[s][arm]["log_flops_ratio"]), 4) for s in pools},
                     "selection_cpu_seconds_mean": float(np.mean([r["selection_cpu_seconds"] for r in rows])),
                     "selection_flops_mean": float(np.mean([r["selection_flops"] for r in rows])),
                     "kept_tokens_min": min(r["kept_tokens"] for r in rows), "epochs_max": max(r["epochs"] for r in rows)}
    junk = [per_pool[s]["junk"]["junk_share"] for s in pools]
    arms["junk"]["expected_ratio"] = 1.0 / (1.0 - float(np.mean(junk)))
    return {"pools": pools, "baseline": BASELINE, "arms": arms, "per_pool": per_pool}


def markdown(result: dict[str, Any]) -> str:
    fmt = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| arm | FLOPs to target vs random [95% t-interval] | tokens trained | tokens read | censored pools | "
             "selection CPU s / pool | kept tokens (fewest) | epochs (most) | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for arm, r in result["arms"].items():
        f, t, rd = r["flops_ratio"], r["tokens_ratio"], r["tokens_read_ratio"]
        extra = f" (expected {r['expected_ratio']:.2f})" if "expected_ratio" in r else ""
        lines.append(f"| {arm} | {fmt(f['ratio'])} [{fmt(f['low'])}, {fmt(f['high'])}]{extra} | {fmt(t['ratio'])} "
                     f"[{fmt(t['low'])}, {fmt(t['high'])}] | {fmt(rd['ratio'])} | {r['censored_pools']} / {f['n']} | "
                     f"{r['selection_cpu_seconds_mean']:.1f} | {r['kept_tokens_min']:,} | {r['epochs_max']:.2f} | {r['verdict']} |")
    pools = result["pools"]
    lines += ["", "| pool | target loss | " + " | ".join(result["arms"]) + " |", "|---|---|" + "---|" * len(result["arms"])]
    for pool in pools:
        row = result["per_pool"][pool]
        cells = [f"{r['per_pool_flops_ratio'][pool]:.2f}{'*' if row[arm]['censored'] else ''}" for arm, r in result["arms"].items()]
        lines.append(f"| {pool} | {row['target_loss']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, (arm, r) in enumerate(result["arms"].items()):
        ratios = list(r["per_pool_flops_ratio"].values())
        ax.scatter(ratios, [i + (j - len(ratios) / 2) * 0.03 for j in range(len(ratios))], s=12, color="gray")
        f = r["flops_ratio"]
        if f["low"] is not None:
            ax.plot([f["low"], f["high"]], [i, i], color="black", lw=2)
        ax.scatter([f["ratio"]], [i], color="red", zorder=3)
    ax.axvline(1.0, color="gray", ls=":")
    ax.axvline(PAYS_UPPER, color="green", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(result["arms"])), list(result["arms"]))
    ax.set_xlabel("FLOPs to the random arm's loss at 0.75 B (ratio to random; selection FLOPs included)")
    ax.set_title(f"Selection toward Python code: {len(result['pools'])} fresh pools, mean and 95% t-interval")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    from scripts.experiment_selection import POOL_SEEDS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="runs/selection")
    parser.add_argument("--pools", type=int, nargs="+", default=POOL_SEEDS)
    parser.add_argument("--plot", default=None, help="write the picture here (PNG)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown after the JSON")
    args = parser.parse_args(argv)
    result = analyze(Path(args.out), args.pools)
    (Path(args.out) / "analysis.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result["arms"], indent=1))
    if args.markdown:
        print(markdown(result))
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
