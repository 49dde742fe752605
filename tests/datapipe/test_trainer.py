"""The trainer: schedule and decay groups, exact resume, non-finite handling, DDP on 2 CPU processes, logs."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from datapipe.core import shards
from datapipe.testing.shards import write_fake_shards
from datapipe.cli import main
from datapipe.core.config import ConfigError
from datapipe.train.model import GPT
from datapipe.train.config import TrainConfig, load_train_config
from datapipe.train.loop import train
from datapipe.train.optim import lr_factor, param_groups

VOCAB = 64


def write_source(out: Path, n_shards: int = 3, per_shard: int = 30) -> Path:
    """Tiny curated-like shards: two domains, documents of 10-90 tokens with a learnable pattern."""
    rng = np.random.default_rng(0)
    specs, g = [], 0
    for s in range(n_shards):
        shard = []
        for i in range(per_shard):
            n = int(rng.integers(10, 90))
            start = int(rng.integers(1, VOCAB))
            toks = [(start + 3 * k) % (VOCAB - 1) + 1 for k in range(n - 1)] + [0]
            shard.append({"id": f"d{g}", "domain": "code" if (s + i) % 2 else "prose", "tokens": toks})
            g += 1
        specs.append(shard)
    write_fake_shards(out, specs, vocab_size=VOCAB, dtype="uint16")
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_source(tmp_path_factory.mktemp("src"))


def tiny_cfg(source: Path, output: Path, *overrides: str) -> TrainConfig:
    base = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.max_seq_len=64", "data.seq_len=64",
            "data.batch_size=2", "data.holdout_shards=1", "data.eval_batches=1", "train.steps=10",
            "train.log_every=2", "train.eval_every=5", "train.ckpt_every=5", "optim.lr=0.01", "prefetch.depth=2"]
    return load_train_config(None, base + list(overrides), data=str(source), output=str(output))


def test_weight_decay_on_matrices_only():
    from datapipe.train.model import ModelConfig

    model = GPT(ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=32))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(no_decay["params"]) == 3  # two norms in the block and the final norm
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == model.num_params(non_embedding=False)


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_lr_schedule_warms_up_then_decays_to_the_floor(decay):
    cfg = load_train_config(None, ["train.steps=200", "schedule.warmup_frac=0.02", f"schedule.decay={decay}",
                                   "schedule.min_lr_frac=0.1"])
    f = [lr_factor(s, cfg) for s in range(200)]
    assert f[0] == pytest.approx(0.25) and f[3] == pytest.approx(1.0)  # 4 warmup steps (2% of 200), linear
    assert all(a >= b for a, b in zip(f[3:], f[4:]))  # then never increases
    assert f[-1] == pytest.approx(0.1)  # down to the floor
    mid = f[3 + (199 - 3) // 2]
    assert mid == pytest.approx(0.55, abs=0.01)  # halfway: both shapes sit at the middle
    if decay == "cosine":
        assert f[50] > 0.1 + 0.9 * (1 - (50 - 4) / 195)  # cosine stays above the straight line early


def test_resume_gives_the_same_losses_and_logs_metrics(source, tmp_path):
    straight = train(tiny_cfg(source, tmp_path / "a"))
    half = train(tiny_cfg(source, tmp_path / "b", "train.stop_at=5"))  # a job that ends at step 5
    rest = train(tiny_cfg(source, tmp_path / "b"), resume=True)
    assert rest["start_step"] == 5 and len(half["losses"]) == 5
    assert half["losses"] + rest["losses"] == straight["losses"]  # bitwise on CPU
    assert rest["params_sha256"] == straight["params_sha256"]
    ckpt = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 10 and ckpt["loaders"][0]["losses"]  # per-document losses reached the loader

    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8, 10]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "data_wait_frac", "step_time_s"):
        assert all(key in r for r in train_rows), key
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [5, 10]
    assert set(evals[-1]["eval_domains"]) == {"code", "prose"} and math.isfinite(evals[-1]["eval_ppl"])
    assert all(0 <= r["data_wait_frac"] <= 1 for r in train_rows)
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]  # it learns the pattern

    assert main(["plot", str(tmp_path / "a")]) == 0
    assert (tmp_path / "a" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_train_with_set_and_bad_keys_named(source, tmp_path, capsys):
    recipe = tmp_path / "t.yaml"
    recipe.write_text("model: {n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}\n"
                      "data: {seq_len: 64, batch_size: 2}\ntrain: {steps: 3, log_every: 1}\n")
    assert main(["train", str(recipe), "--data", str(source), "--output", str(tmp_path / "r"),
                 "--set", "train.steps=2"]) == 0
    assert "step 2/2" in capsys.readouterr().out
    assert main(["train", str(recipe), "--set", "optim.lrr=1"]) == 2
    assert "unknown config key 'optim.lrr'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"warmup_frac must be in \[0, 1\), got 1.5"):
        load_train_config(None, ["schedule.warmup_frac=1.5"])


def test_non_finite_updates_are_skipped_counted_and_stop_the_run(source, tmp_path, monkeypatch):
    real = GPT.forward
    bad_steps: set[int] = set()
    calls = {"n": 0}

    def forward(self, *a, **k):
        out = real(self, *a, **k)
        if self.training:
            calls["n"] += 1
            if calls["n"] in bad_steps:
                out = out * float("nan")
        return out

    monkeypatch.setattr(GPT, "forward", forward)
    bad_steps.update({3})
    summary = train(tiny_cfg(source, tmp_path / "a", "data.holdout_shards=0", "train.steps=5"))
    assert summary["skipped"] == 1 and math.isnan(summary["losses"][2])
    assert all(math.isfinite(x) for i, x in enumerate(summary["losses"]) if i != 2)

    calls["n"] = 0
    bad_steps.update({4, 5, 6})  # steps 3..6 in a row
    with pytest.raises(RuntimeError, match=r"stopping at step 6: 4 non-finite losses or gradients in a row"):
        train(tiny_cfg(source, tmp_path / "b", "data.holdout_shards=0", "train.steps=8", "train.max_nonfinite=4"))


def _ddp_worker(rank: int, world: int, port: int, source: str, out: str, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    summary = train(tiny_cfg(Path(source), Path(out), "data.holdout_shards=0", "train.steps=2", "train.ckpt_every=0"))
    Path(results, f"rank{rank}.json").write_text(json.dumps({"sha": summary["params_sha256"]}))
    torch.distributed.destroy_process_group()


def test_ddp_two_gloo_processes_see_disjoint_data_and_hold_identical_params(source, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(source), str(tmp_path / "run"), str(tmp_path)), nprocs=2, join=True)
    shas = [json.loads((tmp_path / f"rank{r}.json").read_text())["sha"] for r in range(2)]
    assert shas[0] == shas[1]  # identical parameters after the steps
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    seen = [{doc for doc, _, _ in state["losses"]} for state in ckpt["loaders"]]  # documents each rank trained on
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    single = train(tiny_cfg(source, tmp_path / "one", "data.holdout_shards=0", "train.steps=2"))
    assert single["params_sha256"] != shas[0]  # sanity: 2 ranks saw twice the data
