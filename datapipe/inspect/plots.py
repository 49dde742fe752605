"""Pictures of a training run: `datapipe plot RUN_DIR` reads RUN_DIR/metrics.jsonl and writes training.png."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"run_dir must hold metrics.jsonl (written by `datapipe train`), got {str(run_dir)!r}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path) -> Path:
    """Four panels: train and eval loss, learning rate, tokens/s, data-wait fraction. Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ax = axes[0][0]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval")
    ax.set(title="loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax.legend()
    for ax, key, title in ((axes[0][1], "lr", "learning rate"), (axes[1][0], "tokens_per_s", "tokens/s"),
                           (axes[1][1], "data_wait_frac", "fraction of step time waiting for data")):
        ax.plot([r["step"] for r in train], [r[key] for r in train])
        ax.set(title=title, xlabel="step")
    axes[1][1].set_ylim(0, max(1e-3, *[r["data_wait_frac"] for r in train]) * 1.1 if train else 1)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = Path(run_dir) / "training.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
