"""Pictures of a training run: `datapipe plot RUN_DIR` reads RUN_DIR/metrics.jsonl and writes training.png."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from datapipe.core.shards import atomic_write_bytes

# (title, y label, [(metrics key, legend label)]): a panel is drawn when the run logged any of its keys, so an
# LM run (tokens/s, data wait) and a DPO run (pairs/s, preference accuracy) each get the panels they have.
PANELS = (
    ("loss", "objective loss", [("loss", "train"), ("eval_loss", "eval")]),
    ("learning rate", "", [("lr", "lr")]),
    ("gradient norm (before clipping)", "", [("grad_norm", "grad norm")]),
    ("throughput", "tokens/s", [("tokens_per_s", "tokens/s")]),
    ("throughput", "pairs/s", [("pairs_per_s", "pairs/s")]),
    ("fraction of step time waiting for data", "", [("data_wait_frac", "data wait")]),
    ("preference accuracy", "share of pairs with margin > 0", [("pref_accuracy", "train"), ("eval_pref_accuracy", "eval")]),
    ("reward margin", "β-scaled", [("reward_margin", "train"), ("eval_reward_margin", "eval")]),
)
DATA_WAIT_FLOOR = 0.05  # the data-wait panel's y axis shows at least 0..5% of the step time


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"run_dir must hold metrics.jsonl (written by `datapipe train`), got {str(run_dir)!r}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: str | Path) -> Path:
    """One panel per kind of number the run logged (loss, lr, throughput, ...). Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    rows = read_metrics(run_dir)
    panels = [(title, ylabel, [(label, *_series(rows, key)) for key, label in lines])
              for title, ylabel, lines in PANELS]
    panels = [(t, y, [line for line in lines if line[1]]) for t, y, lines in panels]
    panels = [p for p in panels if p[2]]
    if not panels:
        raise FileNotFoundError(f"{str(run_dir)!r}/metrics.jsonl holds no logged steps yet")
    cols = 2
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(10, 3.5 * nrows), squeeze=False)
    for ax, (title, ylabel, lines) in zip(axes.flat, panels):
        for label, steps, values in lines:
            ax.plot(steps, values, "o-" if label == "eval" else "-", label=label)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if title == "fraction of step time waiting for data":
            # never below DATA_WAIT_FLOOR: a wait of 0.1% would otherwise fill the panel and look dramatic
            ax.set_ylim(0, max(DATA_WAIT_FLOOR, *lines[0][2]) * 1.1)
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        if len(lines) > 1:
            ax.legend()
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    atomic_write_bytes(out, png.getvalue())
    return out
