"""The pre-registered analysis of `scripts/experiment_selection.py`: every table from the pools' committed raw results.

    python -m scripts.analyze_selection [RAW_DIR] [--markdown] [--plot PICTURE]   # RAW_DIR: benchmarks/selection_within_domain

Fixed before the first cell trained (committed with the experiment script):
- **Primary endpoint** (PRIMARY_COMPARISON): on the primary target (man3), classifier_man3 against its
  mixture-matched random mm_man3. The target loss is the reference arm's loss on the target's eval set at step
  TARGET_STEP of STEPS (an evaluation point); the endpoint is the compute at which the arm's loss first reaches it
  (linear interpolation between evaluations): training FLOPs plus every FLOP of its selection (the manifest's
  `model_selection.flops`: fit and scoring), over the reference's compute at TARGET_STEP plus its own selection FLOPs.
  Reached at the first evaluation: a **floor** (the ratio an upper bound); never reached: **censored** at the final
  compute (a lower bound). Both stay in the interval at their bound, and the tables count them.
- **Statistic**: one log ratio per pool; the mean over pools with a two-sided 95% t-interval (df = pools - 1),
  reported as exp(mean) [exp(lower), exp(upper)].
- **Decision** on the primary: *pays* when the point is at most 0.8 and the upper bound below 0.9; *beats
  mixture-matched random* when the upper bound is below 1; *costs* when the lower bound is above 1; otherwise no
  difference is shown. The README recommends a selector for a target inside a domain only if the primary pays.
- **Secondaries** (SECONDARY_COMPARISONS, the same statistic, no decision drawn from them alone): the final-loss
  difference of every comparison (arm minus reference at STEPS, t-interval); classifier_T against mm_T on man8 and
  code; on every target each arm against random, aa against random (the A/A arm: its interval should hold 1);
  the slice share each arm kept; diversity against random on the general eval set (mean over its domains of the
  final loss, difference per pool, t-interval): the "diversity diet" question.
- **Checks** (reported per pool; a violating pool is named, never dropped): every mm_T arm's realised domain shares
  within SHARE_TOLERANCE of classifier_T's (largest absolute difference over domains); no arm short of its budget in
  any group (capped); every arm's epochs (tokens trained over tokens kept) below 1; the frequency check: random's
  target loss at TARGET_STEP at least FREQUENCY_MARGIN nats below the target eval set's own unigram entropy (a model
  that knows only the slice's token frequencies), else the pool is still in the token-frequency stage; every pool
  with the same tokenizer, eval set and design.
- **Pool count**: after FIRST_POOLS pools, the sample sd of aa/random's per-pool log FLOPs ratio on the primary target
  through `scripts.selection_power.pools_needed` (80% power to show a 20% saving), within [FIRST_POOLS, 32]. Only
  random and aa enter it, so it cannot favour a selector; one target only, since a pool's targets share its cells.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import scipy.stats

from scripts.experiment_selection import (ARMS, FIRST_POOLS, POOL_SEEDS, PRIMARY, RAW_DIR, STEPS, TARGET_DOMAIN,
                                          TARGETS)

TARGET_STEP = 300
BASELINE = "random"
PRIMARY_COMPARISON = (PRIMARY, f"classifier_{PRIMARY}", f"mm_{PRIMARY}")  # (target, arm, reference)
SECONDARY_COMPARISONS = (
    [(t, f"classifier_{t}", f"mm_{t}") for t in TARGETS if t != PRIMARY]
    + [(t, arm, BASELINE) for t in TARGETS for arm in ("aa", "diversity", f"classifier_{t}", f"mm_{t}")])
COMPARISONS = [PRIMARY_COMPARISON] + SECONDARY_COMPARISONS
PAYS_UPPER, PAYS_POINT = 0.9, 0.8
SHARE_TOLERANCE, FREQUENCY_MARGIN = 0.02, 0.3

Curve = list[tuple[float, float, float]]  # (tokens trained, eval loss, training FLOPs) per evaluation


def t_interval(values: list[float], level: float = 0.95, log: bool = True) -> dict[str, Any]:
    """The mean and its two-sided t-interval (df = n - 1); with `log`, of log ratios, exponentiated. No interval below 2."""
    x = np.asarray(values, np.float64)
    n = len(x)
    back = math.exp if log else float
    if n == 0:
        return {"ratio" if log else "mean": None, "low": None, "high": None, "n": 0}
    mean = float(x.mean())
    if n < 2:
        return {"ratio" if log else "mean": back(mean), "low": None, "high": None, "n": 1}
    half = float(scipy.stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
    return {"ratio" if log else "mean": back(mean), "low": back(mean - half), "high": back(mean + half), "n": n}


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


def target_point(reference: Curve) -> tuple[float, float, float]:
    """(tokens, loss, flops) of the reference at TARGET_STEP of STEPS."""
    tokens = reference[-1][0] * TARGET_STEP / STEPS
    return (tokens, *at_tokens(reference, tokens))


def compare(curve: Curve, selection_flops: float, reference: Curve, reference_selection_flops: float) -> dict[str, Any]:
    """One pool's comparison of an arm with its reference on one target."""
    ref_tokens, target, ref_flops = target_point(reference)
    ref_flops += reference_selection_flops
    hit = crossing(curve, target)
    bound = "censored" if hit is None else "floor" if hit[0] == curve[0][0] else None
    tokens, flops = hit if hit is not None else (curve[-1][0], curve[-1][2])
    flops += selection_flops
    return {"target_loss": target, "bound": bound, "tokens": tokens, "flops": flops,
            "log_flops_ratio": math.log(flops / ref_flops), "log_tokens_ratio": math.log(tokens / ref_tokens),
            "final_loss_difference": curve[-1][1] - reference[-1][1]}


def share_gap(kept: dict[str, Any], matched: dict[str, Any]) -> float:
    """The largest absolute difference of two arms' token shares over their domains."""
    a, b = kept["domain_tokens"], matched["domain_tokens"]
    ta, tb = max(sum(a.values()), 1), max(sum(b.values()), 1)
    return max(abs(a.get(d, 0) / ta - b.get(d, 0) / tb) for d in set(a) | set(b))


def capped(arm: dict[str, Any]) -> list[str]:
    """The groups whose kept tokens fall short of the arm's budget ('*': the whole corpus)."""
    kept = arm["kept"]
    return [g for g, budget in arm["budgets"].items()
            if (kept["tokens"] if g == "*" else kept["domain_tokens"].get(g, 0)) < budget]


def frequency_check(random_target_loss: float, entropy: float) -> bool:
    """True when random's target loss is at least FREQUENCY_MARGIN nats below the slice's unigram entropy."""
    return random_target_loss <= entropy - FREQUENCY_MARGIN


def pool_checks(raw: dict[str, Any]) -> dict[str, Any]:
    """One pool's checks: mixture match, budgets, epochs, the frequency stage."""
    arms = raw["arms"]
    gaps = {t: share_gap(arms[f"classifier_{t}"]["kept"], arms[f"mm_{t}"]["kept"]) for t in TARGETS}
    epochs = {a: (arms[a]["tokens_trained"] or 0) / max(arms[a]["kept"]["tokens"], 1) for a in ARMS}
    frequency = {}
    for t in TARGETS:
        _, loss, _ = target_point(arms[BASELINE]["curves"][t])
        frequency[t] = {"random_target_loss": loss, "unigram_entropy": raw["unigram_entropy"][t],
                        "passes": frequency_check(loss, raw["unigram_entropy"][t])}
    problems = ([f"mm_{t} shares off classifier_{t}'s by {g:.3f}" for t, g in gaps.items() if g > SHARE_TOLERANCE]
                + [f"{a} capped in {', '.join(capped(arms[a]))}" for a in ARMS if capped(arms[a])]
                + [f"{a} read {e:.2f} epochs" for a, e in epochs.items() if e >= 1.0]
                + [f"{t}: random's target loss {f['random_target_loss']:.3f} not {FREQUENCY_MARGIN} below the unigram "
                   f"entropy {f['unigram_entropy']:.3f}" for t, f in frequency.items() if not f["passes"]])
    return {"share_gaps": gaps, "epochs": epochs, "frequency": frequency, "problems": problems}


def pool_comparisons(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    arms = raw["arms"]
    return {f"{t}:{a}/{r}": compare(arms[a]["curves"][t], arms[a]["selection"]["flops"], arms[r]["curves"][t],
                                    arms[r]["selection"]["flops"]) for t, a, r in COMPARISONS}


def verdict(interval: dict[str, Any]) -> str:
    if interval["high"] is not None and interval["high"] < PAYS_UPPER and interval["ratio"] <= PAYS_POINT:
        return "pays"
    if interval["high"] is not None and interval["high"] < 1.0:
        return "beats mixture-matched random" if interval.get("against_mm") else "beats its reference"
    if interval["low"] is not None and interval["low"] > 1.0:
        return "costs"
    return "no difference shown"


def general_mean(arm: dict[str, Any]) -> float:
    """The arm's final loss on the general eval set, the plain mean over its domains."""
    return float(np.mean(list(arm["general_loss"].values())))


def load_pools(raw_dir: Path, pools: list[int] | None = None) -> dict[int, dict[str, Any]]:
    """The committed raw results, every one of the same tokenizer, eval set and design (else an error naming them)."""
    files = sorted(raw_dir.glob("pool-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    raws = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in files}
    if pools is not None:
        missing = sorted(set(pools) - set(raws))
        if missing:
            raise SystemExit(f"no raw results for pools {missing} in {raw_dir}")
        raws = {s: raws[s] for s in pools}
    if not raws:
        raise SystemExit(f"no raw results (pool-SEED.json) in {raw_dir}: run python -m scripts.experiment_selection first")
    first = next(iter(raws.values()))
    for seed, raw in raws.items():
        for key in ("tokenizer_sha256", "eval_sha256", "design"):
            if raw[key] != first[key]:
                raise SystemExit(f"pool {seed}'s {key} differs from pool {next(iter(raws))}'s: the pools are not one experiment")
    return raws


def summarize(raws: dict[int, dict[str, Any]]) -> dict[str, Any]:
    pools = sorted(raws)
    per_pool = {s: pool_comparisons(raws[s]) for s in pools}
    checks = {s: pool_checks(raws[s]) for s in pools}
    comparisons = {}
    for t, a, r in COMPARISONS:
        name = f"{t}:{a}/{r}"
        rows = [per_pool[s][name] for s in pools]
        interval = {**t_interval([x["log_flops_ratio"] for x in rows]), "against_mm": r.startswith("mm_")}
        comparisons[name] = {
            "flops_ratio": interval, "tokens_ratio": t_interval([x["log_tokens_ratio"] for x in rows]),
            "final_loss_difference": t_interval([x["final_loss_difference"] for x in rows], log=False),
            "floors": sum(x["bound"] == "floor" for x in rows), "censored": sum(x["bound"] == "censored" for x in rows),
            "verdict": verdict(interval), "per_pool": {s: round(math.exp(x["log_flops_ratio"]), 4) for s, x in zip(pools, rows)}}
    arms = {}
    for arm in ARMS:
        rows = [raws[s]["arms"][arm] for s in pools]
        domains = sorted({d for r in rows for d in r["kept"]["domain_tokens"]})
        arms[arm] = {"kept_tokens_mean": float(np.mean([r["kept"]["tokens"] for r in rows])),
                     "kept_tokens_min": min(r["kept"]["tokens"] for r in rows),
                     "epochs_max": max(checks[s]["epochs"][arm] for s in pools),
                     "shares": {d: float(np.mean([r["kept"]["domain_tokens"].get(d, 0) / r["kept"]["tokens"] for r in rows]))
                                for d in domains},
                     "slice_shares": {t: float(np.mean([r["kept"]["slice_tokens"][t] / r["kept"]["tokens"] for r in rows]))
                                      for t in TARGETS},
                     "general_loss": {d: float(np.mean([r["general_loss"][d] for r in rows]))
                                      for d in sorted({d for r in rows for d in r["general_loss"]})},
                     "selection_cpu_seconds_mean": float(np.mean([r["selection"]["cpu_seconds"] for r in rows])),
                     "selection_flops_mean": float(np.mean([r["selection"]["flops"] for r in rows]))}
    pool_slices = {t: float(np.mean([raws[s]["pool"]["slice_tokens"][t] / raws[s]["pool"]["tokens"] for s in pools]))
                   for t in TARGETS}
    diversity = t_interval([general_mean(raws[s]["arms"]["diversity"]) - general_mean(raws[s]["arms"][BASELINE])
                            for s in pools], log=False)
    primary = comparisons["{}:{}/{}".format(*PRIMARY_COMPARISON)]
    return {"pools": pools, "primary": {"comparison": "{}:{}/{}".format(*PRIMARY_COMPARISON), **primary},
            "comparisons": comparisons, "arms": arms, "pool_slice_shares": pool_slices,
            "diversity_general_loss_difference": diversity,
            "checks": {s: checks[s] for s in pools}, "flagged_pools": {s: c["problems"] for s, c in checks.items() if c["problems"]},
            "final_pool_count": final_pool_count(per_pool)}


def final_pool_count(per_pool: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The A/A rule: the sd of aa/random's log FLOPs ratios on the primary target, through `pools_needed`."""
    from scripts.selection_power import pools_needed

    logs = [p[f"{PRIMARY}:aa/{BASELINE}"]["log_flops_ratio"] for p in per_pool.values()]
    if len(logs) < 2:
        return {"aa_sd": None, "pools": None, "binding": False}
    sd = float(np.std(logs, ddof=1))
    return {"aa_sd": sd, "pools": min(max(pools_needed(sd), FIRST_POOLS), len(POOL_SEEDS)),
            "binding": len(logs) >= FIRST_POOLS}


def _fmt(v: float | None, digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _interval(i: dict[str, Any], key: str = "ratio", digits: int = 2) -> str:
    return f"{_fmt(i[key], digits)} [{_fmt(i['low'], digits)}, {_fmt(i['high'], digits)}]"


def markdown(result: dict[str, Any]) -> str:
    p = result["primary"]
    lines = [f"**Primary** ({len(result['pools'])} pools), `{p['comparison']}`: FLOPs to the target "
             f"{_interval(p['flops_ratio'])} (95% t), final-loss difference {_interval(p['final_loss_difference'], 'mean', 3)} "
             f"nats: **{p['verdict']}**.", "",
             "| target: arm / reference | FLOPs to target [95% t] | tokens | final loss difference [95% t] | floors | censored | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, c in result["comparisons"].items():
        lines.append(f"| {name} | {_interval(c['flops_ratio'])} | {_fmt(c['tokens_ratio']['ratio'])} | "
                     f"{_interval(c['final_loss_difference'], 'mean', 3)} | {c['floors']} | {c['censored']} | {c['verdict']} |")
    general = sorted({d for a in result["arms"].values() for d in a["general_loss"]})
    lines += ["", "| arm | kept tokens (mean, fewest) | epochs (most) | `man` share | " + " | ".join(f"`{t}` slice" for t in TARGETS)
              + " | selection CPU s | " + " | ".join(f"general `{d}`" for d in general) + " |",
              "|---|---|---|---|" + "---|" * (len(TARGETS) + 1 + len(general))]
    for arm, a in result["arms"].items():
        lines.append(f"| {arm} | {a['kept_tokens_mean']:,.0f}, {a['kept_tokens_min']:,} | {a['epochs_max']:.2f} | "
                     f"{a['shares'].get('man', 0.0):.3f} | " + " | ".join(f"{a['slice_shares'][t]:.3f}" for t in TARGETS)
                     + f" | {a['selection_cpu_seconds_mean']:.1f} | " + " | ".join(_fmt(a["general_loss"].get(d), 3) for d in general) + " |")
    d = result["diversity_general_loss_difference"]
    flagged = result["flagged_pools"]
    count = result["final_pool_count"]
    lines += ["", f"The pool's own slice shares: " + ", ".join(f"`{t}` {s:.3f}" for t, s in result["pool_slice_shares"].items()) + ".",
              f"Diversity minus random on the general eval set (mean over its domains of the final loss): {_interval(d, 'mean', 3)} nats.",
              "Checks: " + ("every pool passes." if not flagged else
                            "; ".join(f"pool {s}: {', '.join(ps)}" for s, ps in flagged.items()) + "."),
              f"A/A spread on `{PRIMARY}` (sd of the log ratio): {_fmt(count['aa_sd'], 3)}; the rule's pool count: "
              f"{count['pools']}{'' if count['binding'] else ' (not binding before ' + str(FIRST_POOLS) + ' pools)'}.", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["comparisons"])
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(names) + 1.5))
    for i, name in enumerate(names):
        c = result["comparisons"][name]
        ratios = list(c["per_pool"].values())
        ax.scatter(ratios, [i] * len(ratios), s=8, color="gray")
        f = c["flops_ratio"]
        if f["low"] is not None:
            ax.plot([f["low"], f["high"]], [i, i], color="black", lw=2)
        ax.scatter([f["ratio"]], [i], color="red" if i == 0 else "black", zorder=3)
    ax.axvline(1.0, color="gray", ls=":")
    ax.axvline(PAYS_UPPER, color="green", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"FLOPs to the reference's loss at step {TARGET_STEP} (ratio; red: the primary)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", nargs="?", default=str(RAW_DIR), help="the folder of pool-SEED.json files")
    parser.add_argument("--pools", type=int, nargs="+", default=None, help="these pools only (default: every raw file)")
    parser.add_argument("--plot", default=None, help="write the picture here (PNG)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown after the JSON")
    args = parser.parse_args(argv)
    result = summarize(load_pools(Path(args.raw), args.pools))
    print(json.dumps({k: v for k, v in result.items() if k != "checks"}, indent=1, default=str))
    if args.markdown:
        print(markdown(result))
    if args.plot:
        plot(result, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
