"""The GPU path, checked on a lent device in one bounded run; a CPU dry run of the same steps first.

    python -m scripts.gpu_check --out "$OUT"                      # on the device: ~6 minutes on one H100
    python -m scripts.gpu_check --out /tmp/gpu-dry --dry-run      # here, on the CPU: the same steps, small shapes

Each step's result goes into OUT/gpu_check.json as soon as it is known (atomically), so a run cut by its time limit
keeps what it measured; a step that fails is recorded with its error and the next step runs.
1. `device`: torch's version, the device's name and its dense bf16 peak (the trainer's MFU denominator).
2. `tests`: the `gpu`-marked tests (the attention paths against sdpa: logits, loss and gradients on a packed batch,
   no attention across pieces; the prefetcher's copy stream and events), passed / failed / skipped.
3. `data`: curated shards: `--data DIR`, else `datapipe run --train-steps 0` on the embedded corpus into OUT/data.
4. `train`: the tiny recipe and a ~100 M-parameter GPT (TRAIN_CONFIGS), each with prefetch on and off: tokens/s, MFU
   against the peak, the fraction of step time the loop waited for data (the prefetcher's own measure), step ms.
5. `loader`: the loader alone at each configuration's shapes, tokens/s served (0 and 2 workers), against the tokens/s
   the GPU consumed with prefetch on: how many loader workers keep it fed.
6. `ddp`: `torchrun --nproc_per_node=1 -m datapipe train` (the process-group path: nccl on CUDA, gloo in the dry run)
   for half the steps, then `--resume` to the end: the resumed run's step and losses continue the first's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
GPU_TESTS = ["tests/datapipe/test_model.py", "tests/datapipe/test_prefetch.py"]
# name -> (model and batch overrides of configs/train-tiny.yaml, steps on the device, steps in the dry run)
TRAIN_CONFIGS: dict[str, tuple[list[str], int, int]] = {
    "tiny": (["data.seq_len=128", "data.batch_size=16"], 300, 6),
    "gpt-100m": (["model.n_layer=12", "model.n_head=12", "model.d_model=768", "model.max_seq_len=1024",
                  "data.seq_len=1024", "data.batch_size=16"], 200, 3),
}
DRY_100M = ["model.n_layer=2", "model.n_head=4", "model.d_model=64", "model.max_seq_len=256", "data.seq_len=256",
            "data.batch_size=4"]  # the dry run's stand-in for the big shapes: the same code path, CPU-sized


class Report:
    """OUT/gpu_check.json, rewritten atomically after every step."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        began = time.monotonic()
        try:
            result = fn()
            self.data[name] = {"ok": True, "seconds": round(time.monotonic() - began, 1), **result}
        except Exception as exc:  # recorded, and the next step runs: one failure must not lose the others
            result = None
            self.data[name] = {"ok": False, "seconds": round(time.monotonic() - began, 1), "error": repr(exc),
                               "traceback": traceback.format_exc(limit=8)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        tmp.replace(self.path)
        print(f"gpu_check {name}: {'ok' if self.data[name]['ok'] else 'FAILED ' + self.data[name]['error']}", flush=True)
        return result


def device_info() -> dict[str, Any]:
    import torch

    from datapipe.train.lm import peak_flops

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
            "name": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
            "bf16_peak_flops": peak_flops(device), "cpus": os.cpu_count()}


def run_tests(out: Path) -> dict[str, Any]:
    """The gpu-marked tests, in a pytest child; its JUnit XML counted."""
    xml = out / "gpu_tests.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "gpu",
                           f"--junitxml={xml}", *GPU_TESTS], cwd=ROOT, capture_output=True, text=True, timeout=240)
    suite = ElementTree.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
    return {"exit_code": proc.returncode, **counts, "passed": counts["tests"] - counts["failures"] - counts["errors"]
            - counts["skipped"], "failed_tests": failed, "tail": proc.stdout[-2000:]}


def curated(out: Path, data: str | None, dry_run: bool) -> dict[str, Any]:
    if data is not None:
        if not (Path(data) / "manifest.json").is_file():
            raise FileNotFoundError(f"--data {data}: not a curated folder (no manifest.json); curate one with datapipe run")
        return {"path": str(Path(data).resolve()), "curated_here": False}
    folder = out / "data"
    cmd = [sys.executable, "-m", "datapipe", "run", "--output", str(folder), "--man-pages", "0", "--train-steps", "0",
           "--no-progress"]
    if dry_run:
        cmd += ["--executor", "local"]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=400)
    return {"path": str(folder), "curated_here": True}


def _train(data: str, out: Path, sets: list[str], steps: int, prefetch: bool) -> dict[str, Any]:
    from datapipe.train.config import load_train_config
    from datapipe.train.loop import train

    run = out / ("prefetch-on" if prefetch else "prefetch-off")
    cfg = load_train_config(ROOT / "configs" / "train-tiny.yaml",
                            [*sets, f"train.steps={steps}", f"train.log_every={max(steps // 4, 1)}", "train.eval_every=0",
                             f"train.ckpt_every={steps}", "data.holdout_shards=0", "train.device=auto",
                             f"prefetch.enabled={str(prefetch).lower()}"], data=data, output=str(run))
    summary = train(cfg)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"tokens_per_s"' in line]
    steady = rows[1:] or rows  # the first interval holds the warm-up (CUDA context, kernels' first calls)
    mean = lambda key: (sum(r[key] for r in steady) / len(steady)) if all(key in r for r in steady) else None  # noqa: E731
    return {"prefetch": prefetch, "steps": steps, "tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"),
            "data_wait_frac": mean("data_wait_frac"), "step_ms": 1000 * mean("step_time_s"),
            "seconds": summary["seconds"], "data_wait_s": summary["data_wait_s"]}


def train_configs(data: str, out: Path, dry_run: bool) -> dict[str, Any]:
    from datapipe.train.model import GPT, ModelConfig
    from datapipe.core import shards

    vocab = int(shards.read_manifest(data)["tokenizer"]["vocab_size"])
    results = {}
    for name, (sets, steps, dry_steps) in TRAIN_CONFIGS.items():
        sets = DRY_100M if dry_run and name == "gpt-100m" else sets
        model_keys = {s.split("=")[0].split(".")[1]: int(s.split("=")[1]) for s in sets if s.startswith("model.")}
        params = GPT(ModelConfig(vocab_size=vocab, **{"n_layer": 2, "n_head": 4, "d_model": 128, "max_seq_len": 128,
                                                       **model_keys})).num_params(non_embedding=False)
        runs = [_train(data, out / "train" / name, sets, dry_steps if dry_run else steps, prefetch) for prefetch in (True, False)]
        on, off = runs
        results[name] = {"params": params, "sets": sets, "prefetch_on": on, "prefetch_off": off,
                         "speedup_from_prefetch": on["tokens_per_s"] / off["tokens_per_s"] if off["tokens_per_s"] else None}
    return results


def loader_headroom(data: str, trained: dict[str, Any] | None, dry_run: bool) -> dict[str, Any]:
    """The loader alone at each configuration's shapes: tokens/s served against the GPU's tokens/s consumed."""
    from datapipe.loader import PackedLoader

    results = {}
    for name, (sets, _, _) in TRAIN_CONFIGS.items():
        sets = DRY_100M if dry_run and name == "gpt-100m" else sets
        keys = {s.split("=")[0]: int(s.split("=")[1]) for s in sets if s.startswith("data.")}
        seq_len, batch = keys["data.seq_len"], keys["data.batch_size"]
        served = {}
        for workers in (0, 2):
            loader = PackedLoader(data, seq_len=seq_len, batch_size=batch, num_workers=workers, epochs=None)
            batches, tokens, began = 0, 0, None
            for b in loader:
                if began is None:  # the first batch pays the workers' start and the shards' opening
                    began = time.perf_counter()
                    continue
                tokens += int((b["labels"] >= 0).sum())
                batches += 1
                if batches >= (20 if dry_run else 300):
                    break
            served[workers] = tokens / (time.perf_counter() - began) if batches else None
        consumed = ((trained or {}).get(name) or {}).get("prefetch_on", {}).get("tokens_per_s")
        results[name] = {"seq_len": seq_len, "batch_size": batch, "served_tokens_per_s": served,
                         "consumed_tokens_per_s": consumed,
                         "headroom_0_workers": served[0] / consumed if consumed and served[0] else None,
                         "workers_needed": (math.ceil(consumed / served[0]) if consumed and served[0] else None)}
    return results


def ddp(data: str, out: Path, dry_run: bool) -> dict[str, Any]:
    """torchrun at world size 1: half the steps, then --resume to the end; the resumed run continues the first."""
    steps = 4 if dry_run else 100
    run = out / "ddp"
    base = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port=29533", "-m", "datapipe",
            "train", str(ROOT / "configs" / "train-tiny.yaml"), "--data", data, "--output", str(run),
            "--set", f"train.steps={steps}", "--set", "train.eval_every=0", "--set", "train.log_every=1",
            "--set", f"train.ckpt_every={steps // 2}", "--set", "data.holdout_shards=0"]
    subprocess.run(base + ["--set", f"train.stop_at={steps // 2}"], cwd=ROOT, check=True, timeout=300)
    first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    subprocess.run(base + ["--resume"], cwd=ROOT, check=True, timeout=300)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    return {"steps": steps, "backend": "nccl" if device_info()["cuda_available"] else "gloo",
            "stopped_at": max(r["step"] for r in first if "step" in r), "last_step": max(losses),
            "steps_logged": sorted(losses), "resumed_continues": sorted(losses) == list(range(1, steps + 1))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the folder for gpu_check.json and the runs ($OUT on the device)")
    parser.add_argument("--data", default=None, help="a curated folder (default: curate the embedded corpus)")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, small shapes and few steps: the same steps")
    parser.add_argument("--skip", nargs="*", default=[], choices=["tests", "train", "loader", "ddp"])
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    report = Report(out / "gpu_check.json")
    report.data["dry_run"] = args.dry_run
    info = report.step("device", device_info)
    if not args.dry_run and not (info or {}).get("cuda_available"):
        raise SystemExit("torch sees no CUDA device here: run with --dry-run on a CPU machine")
    if "tests" not in args.skip:
        report.step("tests", lambda: run_tests(out))
    data = report.step("data", lambda: curated(out, args.data, args.dry_run))
    if data is None:
        return 1
    trained = report.step("train", lambda: train_configs(data["path"], out, args.dry_run)) if "train" not in args.skip else None
    if "loader" not in args.skip:
        report.step("loader", lambda: loader_headroom(data["path"], trained, args.dry_run))
    if "ddp" not in args.skip:
        report.step("ddp", lambda: ddp(data["path"], out, args.dry_run))
    failed = [k for k, v in report.data.items() if isinstance(v, dict) and not v.get("ok")]
    print(json.dumps({"out": str(report.path), "failed_steps": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
