"""The picture of an experiment: `datapipe experiment` reads OUTPUT/results.json and writes OUTPUT/results.png
(eval-loss curves, mean ± std over seeds per arm, over tokens trained; per arm, a bar of the seeds' tokens-to-target
and a marker where the arm's mean curve reaches the target, the legend saying which is which). Results that carry
FLOPs add a second row: the same curves over training FLOPs, and per target the compute-to-target ratio to the
baseline with its 95% interval (`ci95`: a t-interval; a bootstrap one in results written before), with the
scoring pass's FLOPs where an arm uses it. Older results.json files (tokens only) draw the first row alone."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from datapipe.core.shards import atomic_write_bytes


def plot_experiment(results_json: str | Path) -> Path:
    """Draw results.png beside `results_json` (written by datapipe.train.experiment). Returns the PNG path."""
    import matplotlib.pyplot as plt

    path = Path(results_json)
    fig = draw_experiment(json.loads(path.read_text()))
    out = path.with_name("results.png")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(out, png.getvalue())
    return out


def draw_experiment(results: dict[str, Any]) -> Any:
    """The figure of results.json: eval-loss curves on the left; on the right, per arm, a bar for the seeds'
    own crossings of the target (mean ± std over the seeds that reach it) and a marker where the arm's mean
    curve crosses it (every seed counts; the ×ratio to the baseline is of these), each named in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = results["arms"]
    with_flops = all((arm["curve"].get("flops") or None) is not None for arm in arms.values())
    fig, axes = plt.subplots(2 if with_flops else 1, 2, figsize=(12, 10.4 if with_flops else 5.2), squeeze=False)
    (curves, bars), second = axes[0], (axes[1] if with_flops else None)
    for name, arm in arms.items():
        _mean_band(curves, arm["curve"]["tokens"], arm, f"{name} (baseline)" if name == results["baseline"] else name)
    curves.axhline(results["target"], color="grey", linestyle="--", label=f"target {results['target']:.4f}")
    curves.set(title=f"eval loss (mean ± std over {len(results['seeds'])} seed(s))", xlabel="tokens trained",
               ylabel="eval loss")
    curves.legend()

    names = list(arms)
    reach = [arms[n]["tokens_to_target"] for n in names]
    heights = [r["mean"] if r["mean"] is not None else 0.0 for r in reach]
    bars.bar(names, heights, yerr=[r["std"] or 0.0 for r in reach], capsize=4,
             color=["tab:grey" if n == results["baseline"] else "tab:blue" for n in names],
             label="mean ± std over the seeds that reach it (each seed's own crossing)")
    crossings = [arms[n].get("mean_curve_tokens_to_target") for n in names]
    shown = [(i, c) for i, c in enumerate(crossings) if c is not None]
    if shown:
        bars.plot([i for i, _ in shown], [c for _, c in shown], "D", color="black", markersize=6, linestyle="none",
                  label="where the arm's mean curve (all seeds) reaches it")
    for i, r in enumerate(reach):
        ratio = arms[names[i]]["ratio_to_baseline"].get("of_mean_curve", arms[names[i]]["ratio_to_baseline"]["of_means"])
        text = "never reached" if r["mean"] is None else (f"{r['n']}/{r['of']} seeds" +
                                                           (f", ×{ratio:.2f}" if ratio is not None else ""))
        bars.annotate(text, (i, max(heights[i] + (reach[i]["std"] or 0.0), crossings[i] or 0.0)), ha="center",
                      va="bottom", fontsize=8, textcoords="offset points", xytext=(0, 6))
    cross = results.get("baseline_mean_curve_tokens_to_target")
    if cross:  # where the baseline's mean curve reaches the target: every baseline seed counts
        bars.axhline(cross, color="tab:grey", linestyle=":", label=f"{results['baseline']} mean curve: {cross:,.0f}")
    bars.set_ylim(top=bars.get_ylim()[1] * 1.12)  # room for the labels above the bars
    bars.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1))  # under the axes: never over a bar
    bars.set(title="tokens to the target eval loss\n(×ratio: the arm's mean curve against the baseline's)", ylabel="tokens")
    if second is not None:
        _draw_compute(results, *second)
    fig.tight_layout()
    return fig


def _mean_band(ax: Any, x: list[float], arm: dict[str, Any], label: str) -> Any:
    """An arm's mean eval-loss curve over `x` with its ± std band; the curve's line."""
    mean, std = arm["curve"]["mean"], arm["curve"]["std"]
    (line,) = ax.plot(x, mean, "o-", label=label)
    ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], color=line.get_color(), alpha=0.2)
    return line


def _draw_compute(results: dict[str, Any], curves: Any, ratios: Any) -> None:
    """The second row: eval loss over training FLOPs; compute-to-target ratios to the baseline with their intervals."""
    arms = results["arms"]
    for name, arm in arms.items():
        flops, mean = arm["curve"]["flops"], arm["curve"]["mean"]
        line = _mean_band(curves, flops, arm, f"{name} (baseline)" if name == results["baseline"] else name)
        scoring = arm.get("scoring_flops")
        if scoring:  # the same curve shifted by the one-off scoring pass
            curves.plot([f + scoring for f in flops], mean, ":", color=line.get_color(),
                        label=f"{name} + scoring pass ({scoring:.2g} FLOPs)")
    weighting = {"tokens": "token-weighted", "target": "target-mixture"}.get(results.get("eval_weighting"), "")
    curves.set(title=f"eval loss ({weighting}) over training FLOPs",
               xlabel="FLOPs (6N·trained + 2N·forwarded only)", ylabel="eval loss")
    curves.legend(fontsize=8)

    names = list(arms)
    targets = list(results.get("targets", {}))
    width = 0.8 / max(len(targets), 1)
    for k, target in enumerate(targets):
        xs, ys, lo, hi = [], [], [], []
        for i, name in enumerate(names):
            by = arms[name].get("targets", {}).get(target, {}).get("ratio_to_baseline", {})
            r = by.get("flops_with_scoring") or by.get("flops")
            if not r:
                continue
            xs.append(i + (k - (len(targets) - 1) / 2) * width)
            ys.append(r["point"])
            ci = r["ci95"] or [r["point"], r["point"]]
            lo.append(r["point"] - ci[0])
            hi.append(ci[1] - r["point"])
        if xs:
            ratios.errorbar(xs, ys, yerr=[lo, hi], fmt="o", capsize=3,
                            label=f"{target} (loss {results['targets'][target]['loss']:.3f})")
    ratios.axhline(1.0, color="grey", linestyle="--")
    ratios.set_xticks(range(len(names)), names)
    ratios.set(title="FLOPs to each target / the baseline's, 95% t-interval\n(scoring pass included; "
                     "unreached seeds at their budget)", ylabel="FLOPs ratio (geometric mean over seeds)")
    ratios.legend(fontsize=8)
