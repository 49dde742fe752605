"""The picture of an experiment: `datapipe experiment` reads OUTPUT/results.json and writes OUTPUT/results.png
(eval-loss curves, mean ± std over seeds per arm, over tokens trained; per arm, a bar of the seeds' tokens-to-target
and a marker where the arm's mean curve reaches the target, the legend saying which is which)."""

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
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 5.2))
    for name, arm in arms.items():
        tokens, mean, std = arm["curve"]["tokens"], arm["curve"]["mean"], arm["curve"]["std"]
        label = f"{name} (baseline)" if name == results["baseline"] else name
        (line,) = curves.plot(tokens, mean, "o-", label=label)
        curves.fill_between(tokens, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            color=line.get_color(), alpha=0.2)
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
    fig.tight_layout()
    return fig
