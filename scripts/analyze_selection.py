"""The pre-registered analysis of `scripts/experiment_selection.py` (second experiment): per-pool compute ratios,
t-intervals, floors and censoring, the mixture each arm trained on, what selection costs on the other domains.

    python -m scripts.analyze_selection runs/selection2 [--pools ...] [--markdown] [--plot PICTURE]

Fixed before the runs (committed with the experiment script):
- **Comparisons** (COMPARISONS): every arm against `random`; each selector against its mixture-matched arm
  (`mm_<selector>`: random at the selector's own per-domain token shares), which says what it buys beyond its mixture.
- **Target loss** per (pool, target, comparison): the reference arm's eval loss on the target eval set at TARGET_AT of
  its final tokens (linear interpolation; it trains on past it).
- **Endpoint**: the compute at which the arm's eval loss first reaches that target loss (linear interpolation between
  evaluations), FLOPs of training plus every FLOP of its selection (`model_selection.flops` of its manifest: fit and
  scoring; a fastText model's own training is not counted: a user applies a published one); the reference's compute
  at TARGET_AT, its own selection FLOPs included, is the denominator. Reached at the first evaluation: a **floor**,
  the ratio an upper bound (flagged `<=`); never reached: **censored** at the final compute, the ratio a lower bound
  (flagged `>=`). Both stay in the interval at their bound, and the tables count them.
- **Statistic**: the mean over pools of log(ratio) with a two-sided 95% t-interval (df = pools - 1), as
  exp(mean) [exp(lower), exp(upper)].
- **Decision**: *pays* when the upper bound is below 0.9 and the point at most 0.8; *costs* when the lower bound is
  above 1; otherwise no difference is shown. The experiment's question is answered on a within-domain target
  (`man8`, `man3`) by a selector against its mixture-matched arm.
- **Beside the ratios**, per arm (means over pools): its kept tokens and the epochs training reads them (the cut is
  filled: none should exceed 1), its token share per domain (the target's domain first), its selection CPU seconds,
  and its final loss per domain on the general eval set (what selection costs elsewhere). Per pool and target: the
  target eval set's unigram cross-entropy under the random arm's token counts (add-one), the loss a model that knows
  only token frequencies reaches; a pool whose random target loss is not below it is flagged (still in the
  token-frequency stage).
- **Known-answer control** (`junk`): expected ratio 1 / (1 - j), j the junk share of the tokens of the junk pool
  before selection (random keeps tokens in proportion, in expectation), read from its curated folder `pool-junk`.
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
from scripts.experiment_selection import ARMS, EVAL_EVERY, FIRST_POOLS, POOL_SEEDS, SELECTORS, STEPS, TARGET_DOMAIN, TARGETS

TARGET_AT = 0.75 / 1.5  # of the reference's final tokens: 0.75 B where it trains to 1.5 B
BASELINE = "random"
COMPARISONS = [(arm, BASELINE) for arm in ARMS if arm != BASELINE] + [(s, f"mm_{s}") for s in SELECTORS]
PAYS_UPPER, PAYS_POINT = 0.9, 0.8

Curve = list[tuple[float, float, float]]  # (tokens trained, eval loss, training FLOPs) per evaluation


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


def crossing(curve: Curve, target: float) -> tuple[float, float] | None:
    """(tokens, flops) where the curve first reaches `target`, interpolated linearly."""
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


def at_tokens(curve: Curve, tokens: float) -> tuple[float, float]:
    """(loss, flops) at `tokens`, interpolated linearly between evaluations."""
    xs = [c[0] for c in curve]
    return float(np.interp(tokens, xs, [c[1] for c in curve])), float(np.interp(tokens, xs, [c[2] for c in curve]))


def compare(curve: Curve, selection_flops: float, reference: Curve, reference_selection_flops: float) -> dict[str, Any]:
    """One pool's comparison of an arm with its reference: the reference's loss at TARGET_AT of its final tokens is
    the target; the arm's FLOPs to it (its selection's added) over the reference's (its own selection's added)."""
    ref_tokens = reference[-1][0] * TARGET_AT
    target, ref_flops = at_tokens(reference, ref_tokens)
    ref_flops += reference_selection_flops
    hit = crossing(curve, target)
    bound = "censored" if hit is None else "floor" if hit[0] == curve[0][0] else None
    tokens, flops = hit if hit is not None else (curve[-1][0], curve[-1][2])
    flops += selection_flops
    return {"target_loss": target, "bound": bound, "tokens": tokens, "flops": flops,
            "log_flops_ratio": math.log(flops / ref_flops), "log_tokens_ratio": math.log(tokens / ref_tokens)}


def unigram_loss(train: Path, evaluation: Path) -> float:
    """Cross-entropy (nats a token) of the eval folder's tokens under the training folder's token counts, add-one."""
    def counts(folder: Path) -> np.ndarray:
        total = np.zeros(0, np.int64)
        for shard in shards.read_manifest(folder)["shards"]:
            ids = shards.open_shard(folder, shard["path"]).column("tokens").combine_chunks().flatten().to_numpy()
            found = np.bincount(ids)
            total = np.pad(total, (0, max(0, len(found) - len(total)))) + np.pad(found, (0, max(0, len(total) - len(found))))
        return total

    train_counts, eval_counts = counts(train), counts(evaluation)
    size = max(len(train_counts), len(eval_counts))
    train_counts = np.pad(train_counts, (0, size - len(train_counts))) + 1
    eval_counts = np.pad(eval_counts, (0, size - len(eval_counts)))
    return float(-(eval_counts * np.log(train_counts / train_counts.sum())).sum() / eval_counts.sum())


def _general_losses(cell: Path) -> dict[str, float]:
    """The cell's final loss per domain on the general eval set (its extra_evals.json)."""
    path = cell / "extra_evals.json"
    if not path.exists():
        return {}
    record = next((v for k, v in json.loads(path.read_text()).items() if k.startswith("general=")), {})
    return {d: float(v["loss"]) for d, v in record.get("eval_domains", {}).items() if v.get("loss") is not None}


def pool_result(out: Path, seed: int, target: str) -> dict[str, Any]:
    """One pool and target: each comparison, and per arm what it trained on and what it cost."""
    folder = out / "pools" / str(seed) / target
    cells = folder / "experiment" / "cells"
    curves = {arm: eval_curve(cells / arm / f"seed-{seed}", EVAL_EVERY, STEPS) for arm in ARMS}
    manifests = {arm: shards.read_manifest(folder / "data" / arm) for arm in ARMS}
    selection = {arm: manifests[arm].get("model_selection") or {} for arm in ARMS}
    flops = {arm: float(selection[arm].get("flops") or 0.0) for arm in ARMS}
    arms = {}
    for arm in ARMS:
        kept = int(manifests[arm]["total_tokens"])
        trained = cell_compute(cells / arm / f"seed-{seed}")["tokens_trained"] or 0
        domains = {d: int(v["tokens"]) for d, v in manifests[arm]["domains"].items()}
        arms[arm] = {"kept_tokens": kept, "epochs": trained / max(kept, 1),
                     "shares": {d: n / max(kept, 1) for d, n in sorted(domains.items())},
                     "selection_flops": flops[arm], "selection_cpu_seconds": float(selection[arm].get("cpu_seconds") or 0.0),
                     "final_loss": curves[arm][-1][1], "general": _general_losses(cells / arm / f"seed-{seed}")}
    comparisons = {f"{a}/{r}": compare(curves[a], flops[a], curves[r], flops[r]) for a, r in COMPARISONS}
    junk_pool = shards.read_manifest(out / "pools" / str(seed) / "pool-junk")
    floor = unigram_loss(folder / "data" / BASELINE, out / "target" / target / "eval")
    return {"comparisons": comparisons, "arms": arms, "unigram_loss": floor,
            "frequency_stage": comparisons[f"aa/{BASELINE}"]["target_loss"] >= floor,
            "junk_share": junk_pool["domains"].get("junk", {}).get("tokens", 0) / max(junk_pool["total_tokens"], 1)}


def verdict(interval: dict[str, Any]) -> str:
    if interval["high"] is not None and interval["high"] < PAYS_UPPER and interval["ratio"] <= PAYS_POINT:
        return "pays"
    if interval["low"] is not None and interval["low"] > 1.0:
        return "costs"
    return "no difference shown"


def summarize(per_pool: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One target's table from its pools' results."""
    pools = sorted(per_pool)
    comparisons = {}
    for arm, reference in COMPARISONS:
        rows = [per_pool[s]["comparisons"][f"{arm}/{reference}"] for s in pools]
        interval = t_interval([r["log_flops_ratio"] for r in rows])
        comparisons[f"{arm}/{reference}"] = {
            "flops_ratio": interval, "tokens_ratio": t_interval([r["log_tokens_ratio"] for r in rows]),
            "floors": sum(r["bound"] == "floor" for r in rows), "censored": sum(r["bound"] == "censored" for r in rows),
            "verdict": verdict(interval), "per_pool": {s: round(math.exp(r["log_flops_ratio"]), 4) for s, r in zip(pools, rows)}}
    arms = {}
    for arm in ARMS:
        rows = [per_pool[s]["arms"][arm] for s in pools]
        domains = sorted({d for r in rows for d in r["shares"]} | {d for r in rows for d in r["general"]})
        arms[arm] = {"kept_tokens_mean": float(np.mean([r["kept_tokens"] for r in rows])),
                     "kept_tokens_min": min(r["kept_tokens"] for r in rows), "epochs_max": max(r["epochs"] for r in rows),
                     "shares": {d: float(np.mean([r["shares"].get(d, 0.0) for r in rows])) for d in domains},
                     "general_loss": {d: float(np.mean([r["general"][d] for r in rows if d in r["general"]]))
                                      for d in domains if any(d in r["general"] for r in rows)},
                     "selection_cpu_seconds_mean": float(np.mean([r["selection_cpu_seconds"] for r in rows])),
                     "selection_flops_mean": float(np.mean([r["selection_flops"] for r in rows])),
                     "final_loss_mean": float(np.mean([r["final_loss"] for r in rows]))}
    junk = float(np.mean([per_pool[s]["junk_share"] for s in pools]))
    return {"pools": pools, "comparisons": comparisons, "arms": arms, "junk_expected_ratio": 1.0 / (1.0 - junk),
            "frequency_stage_pools": [s for s in pools if per_pool[s]["frequency_stage"]]}


def final_pool_count(result: dict[str, Any]) -> dict[str, Any]:
    """Stage 1's rule for the final number of pools: the pooled sd over targets of the A/A log ratios (each target's
    deviations from its own mean), through `scripts.selection_power.pools_needed`, within [FIRST_POOLS, all seeds]."""
    from scripts.selection_power import pools_needed

    deviations, groups = [], 0
    for table in result["per_pool"].values():
        logs = np.array([p["comparisons"][f"aa/{BASELINE}"]["log_flops_ratio"] for p in table.values()])
        deviations += list(logs - logs.mean())
        groups += 1
    if len(deviations) - groups < 1:  # one pool a target: no spread yet
        return {"aa_sd": None, "pools": None}
    sd = float(math.sqrt(np.sum(np.square(deviations)) / (len(deviations) - groups)))
    return {"aa_sd": sd, "pools": min(max(pools_needed(sd), FIRST_POOLS), len(POOL_SEEDS))}


def analyze(out: Path, pools: list[int]) -> dict[str, Any]:
    per_pool = {t: {s: pool_result(out, s, t) for s in pools} for t in TARGETS}
    result = {"pools": pools, "targets": {t: summarize(per_pool[t]) for t in TARGETS}, "per_pool": per_pool}
    result["final_pool_count"] = final_pool_count(result)
    return result


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def markdown(result: dict[str, Any]) -> str:
    lines = []
    for target, table in result["targets"].items():
        domain = TARGET_DOMAIN[target]
        lines += [f"#### Target `{target}` ({len(table['pools'])} pools; its domain `{domain}`)", "",
                  "| arm / reference | FLOPs to target [95% t-interval] | tokens | floors | censored | verdict |",
                  "|---|---|---|---|---|---|"]
        for name, c in table["comparisons"].items():
            f, t = c["flops_ratio"], c["tokens_ratio"]
            extra = f" (expected {table['junk_expected_ratio']:.2f})" if name == f"junk/{BASELINE}" else ""
            lines.append(f"| {name} | {_fmt(f['ratio'])} [{_fmt(f['low'])}, {_fmt(f['high'])}]{extra} | {_fmt(t['ratio'])} | "
                         f"{c['floors']} | {c['censored']} | {c['verdict']} |")
        domains = sorted({d for a in table["arms"].values() for d in a["general_loss"]})
        lines += ["", f"| arm | kept tokens (mean, fewest) | epochs (most) | `{domain}` share | selection CPU s | "
                  + " | ".join(f"final loss `{d}`" for d in domains) + " |", "|---|---|---|---|---|" + "---|" * len(domains)]
        for arm, a in table["arms"].items():
            losses = " | ".join(_fmt(a["general_loss"].get(d)) for d in domains)
            lines.append(f"| {arm} | {a['kept_tokens_mean']:,.0f}, {a['kept_tokens_min']:,} | {a['epochs_max']:.2f} | "
                         f"{a['shares'].get(domain, 0.0):.2f} | {a['selection_cpu_seconds_mean']:.1f} | {losses} |")
        flagged = table["frequency_stage_pools"]
        lines += ["", f"Pools still in the token-frequency stage (random's target loss not below the unigram loss): "
                  f"{', '.join(map(str, flagged)) if flagged else 'none'}.", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(result["targets"])
    fig, axes = plt.subplots(1, len(targets), figsize=(5 * len(targets), 5), sharex=True)
    for ax, target in zip(np.atleast_1d(axes), targets):
        names = list(result["targets"][target]["comparisons"])
        for i, name in enumerate(names):
            c = result["targets"][target]["comparisons"][name]
            ratios = list(c["per_pool"].values())
            ax.scatter(ratios, [i] * len(ratios), s=8, color="gray")
            f = c["flops_ratio"]
            if f["low"] is not None:
                ax.plot([f["low"], f["high"]], [i, i], color="black", lw=2)
            ax.scatter([f["ratio"]], [i], color="red", zorder=3)
        ax.axvline(1.0, color="gray", ls=":")
        ax.axvline(PAYS_UPPER, color="green", ls="--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yticks(range(len(names)), names)
        ax.set_title(f"target {target}")
        ax.set_xlabel("FLOPs to the reference's loss at 0.75 B (ratio)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="runs/selection2")
    parser.add_argument("--pools", type=int, nargs="+", default=POOL_SEEDS[:FIRST_POOLS])
    parser.add_argument("--plot", default=None, help="write the picture here (PNG)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown after the JSON")
    args = parser.parse_args(argv)
    result = analyze(Path(args.out), args.pools)
    (Path(args.out) / "analysis.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({"targets": result["targets"], "final_pool_count": result["final_pool_count"]}, indent=1))
    if args.markdown:
        print(markdown(result))
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
