"""Usage: python -m scripts.bench_prefetch [--data DIR] [--delay-s 0.05] [--steps 40] [--out BENCH_DIR]

Prefetch on vs off, side by side in one run: the tiny model of configs/train-tiny.yaml trained for
`--steps` steps on curated shards, with the loader slowed by `--delay-s` seconds per batch
(prefetch.delay_s). Reports tokens/s and the fraction of step time spent waiting for data, and how
much of the total load time prefetch hid. On CUDA the same script runs the bf16 model and adds MFU.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from datapipe.train.config import load_train_config
from datapipe.train.loop import train


def run(data: str, out: Path, steps: int, delay: float, enabled: bool, extra: list[str]) -> dict:
    recipe = Path(__file__).resolve().parents[1] / "configs" / "train-tiny.yaml"
    cfg = load_train_config(recipe, [f"train.steps={steps}", f"train.log_every={steps}", "train.eval_every=0",
                                     f"train.ckpt_every={steps}", "data.holdout_shards=0",
                                     f"prefetch.enabled={str(enabled).lower()}", f"prefetch.delay_s={delay}", *extra],
                            data=data, output=str(out / ("on" if enabled else "off")))
    summary = train(cfg)
    row = json.loads((out / ("on" if enabled else "off") / "metrics.jsonl").read_text().splitlines()[-1])
    return {"prefetch": "on" if enabled else "off", "tokens_per_s": row["tokens_per_s"],
            "data_wait_frac": row["data_wait_frac"], "step_ms": 1000 * row["step_time_s"], "mfu": row.get("mfu"),
            "seconds": summary["seconds"], "wait_s": summary["data_wait_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="out/run", help="a curated folder (datapipe run's output)")
    p.add_argument("--delay-s", type=float, default=0.05, help="extra seconds per batch read: a slow loader")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", default="/tmp/bench_prefetch")
    p.add_argument("--set", action="append", default=[], dest="overrides", help="extra config overrides")
    args = p.parse_args()
    out = Path(args.out)
    for d in ("on", "off"):  # a fresh run folder for each arm (the trainer refuses to reuse one)
        shutil.rmtree(out / d, ignore_errors=True)
    rows = [run(args.data, out, args.steps, args.delay_s, enabled, args.overrides) for enabled in (False, True)]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({torch.get_num_threads()} threads)"
    print(f"\n{device}; loader delay {args.delay_s * 1000:.0f} ms/batch; {args.steps} steps; "
          f"last log interval (steps 1-{args.steps})")
    print("| prefetch | tokens/s | step (ms) | data-wait fraction | time waiting (s) |" + (" MFU |" if rows[0]["mfu"] else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|" if rows[0]["mfu"] else ""))
    for r in rows:
        print(f"| {r['prefetch']} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.0f} | {r['data_wait_frac']:.1%} | "
              f"{r['wait_s']:.2f} |" + (f" {r['mfu']:.1%} |" if r["mfu"] else ""))
    total_delay = args.delay_s * args.steps
    hidden = 1 - rows[1]["wait_s"] / max(rows[0]["wait_s"], 1e-9)
    print(f"\nprefetch hid {hidden:.0%} of the time the loop waited for data "
          f"({rows[0]['wait_s']:.2f} s -> {rows[1]['wait_s']:.2f} s; injected delay {total_delay:.2f} s); "
          f"speed-up {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
