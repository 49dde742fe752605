"""The picture of an experiment: `datapipe experiment` reads OUTPUT/results.json and writes OUTPUT/results.png
(eval-loss curves, mean ± std over seeds per arm, over tokens trained; a bar of tokens-to-target per arm)."""

from __future__ import annotations

import io
import json
from pathlib import Path

from datapipe.core.shards import atomic_write_bytes


def plot_experiment(results_json: str | Path) -> Path:
    """Draw results.png beside `results_json` (written by datapipe.train.experiment). Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(results_json)
    results = json.loads(path.read_text())
    arms = results["arms"]
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
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
             color=["tab:grey" if n == results["baseline"] else "tab:blue" for n in names])
    for i, r in enumerate(reach):
        ratio = arms[names[i]]["ratio_to_baseline"].get("of_mean_curve", arms[names[i]]["ratio_to_baseline"]["of_means"])
        text = "never reached" if r["mean"] is None else (f"{r['n']}/{r['of']} seeds" +
                                                           (f", ×{ratio:.2f}" if ratio is not None else ""))
        bars.annotate(text, (i, heights[i]), ha="center", va="bottom", fontsize=8)
    cross = results.get("baseline_mean_curve_tokens_to_target")
    if cross:  # where the baseline's mean curve reaches the target: every baseline seed counts
        bars.axhline(cross, color="tab:grey", linestyle=":", label=f"{results['baseline']} mean curve: {cross:,.0f}")
        bars.legend(fontsize=8)
    bars.set(title="tokens to the target eval loss\n(mean ± std; ×ratio to the baseline's mean curve)", ylabel="tokens")
    fig.tight_layout()
    out = path.with_name("results.png")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(out, png.getvalue())
    return out
