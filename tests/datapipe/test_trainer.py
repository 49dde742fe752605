"""The trainer: schedule and decay groups, exact resume, non-finite handling, DDP on 2 CPU processes, logs
(metrics.jsonl, TensorBoard, W&B)."""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from datapipe.cli import main
from datapipe.core.config import ConfigError, RunStopped
from datapipe.loader import PackedLoader
from datapipe.train.model import GPT
from datapipe.train.config import load_train_config
from datapipe.train.loop import train
from datapipe.train.optim import lr_factor, param_groups
from helpers import VOCAB, tiny_cfg, write_train_source as write_source

@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_source(tmp_path_factory.mktemp("src"))


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

    # `tokens` counts the batches trained on (10 steps of one batch), not the ones prefetched ahead, across a resume
    fresh = PackedLoader(str(tmp_path / "a" / "data" / "train"), seq_len=64, batch_size=2, seed=0, epochs=None)
    trained = sum(int((batch["doc_ids"] >= 0).sum()) for _, batch in zip(range(10), fresh))
    resumed_rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert train_rows[-1]["tokens"] == trained == resumed_rows[-1]["tokens"] == straight["tokens"]
    assert all(a["tokens"] < b["tokens"] for a, b in zip(train_rows, train_rows[1:]))  # cumulative

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
    with pytest.raises(RunStopped, match=r"stopping at step 6: 4 non-finite losses or gradients in a row"):
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


def _rows(real: list[int], seq_len: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """One document per row; row i has real[i] real labels, the rest ignored (-100)."""
    n = len(real)
    ids = torch.randint(1, VOCAB, (n, seq_len), generator=torch.Generator().manual_seed(seed))
    labels = torch.roll(ids, -1, dims=1)
    for i, r in enumerate(real):
        labels[i, r:] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq_len).expand(n, seq_len),
            "doc_ids": torch.arange(n)[:, None].expand(n, seq_len).contiguous(),
            "cu_seqlens": torch.arange(0, (n + 1) * seq_len, seq_len, dtype=torch.int32)}


def _take(batch: dict[str, torch.Tensor], lo: int, hi: int) -> dict[str, torch.Tensor]:
    seq_len = batch["input_ids"].shape[1]
    part = {k: v[lo:hi] for k, v in batch.items() if k != "cu_seqlens"}
    return {**part, "cu_seqlens": torch.arange(0, (hi - lo + 1) * seq_len, seq_len, dtype=torch.int32)}


def test_lm_gradient_is_the_mean_over_every_real_token_of_the_step_whatever_the_split():
    from datapipe.train.lm import backward_step
    from datapipe.train.model import ModelConfig, token_losses

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=32, max_seq_len=32, attention="sdpa"))
    batch = _rows([3] * 4 + [31] * 12)  # the first 4 rows are short: 12 real tokens against 124 in each other group
    count = (batch["labels"] != -100).sum().float()

    def grads(ranks: list[list[tuple[int, int]]]) -> torch.Tensor:
        """DDP emulated: each rank's backward with world=len(ranks), then the average over ranks."""
        total = 0
        for micro in ranks:
            model.zero_grad()
            backward_step(model, [_take(batch, lo, hi) for lo, hi in micro], count, len(ranks), torch.device("cpu"))
            total = total + torch.cat([p.grad.flatten() for p in model.parameters()])
        return total / len(ranks)

    whole = grads([[(0, 16)]])
    micro = grads([[(0, 4), (4, 8), (8, 12), (12, 16)]])
    ranks = grads([[(0, 4), (4, 8)], [(8, 12), (12, 16)]])
    assert torch.allclose(whole, micro, rtol=1e-4, atol=1e-7) and torch.allclose(whole, ranks, rtol=1e-4, atol=1e-7)

    model.zero_grad()  # the old loss, a mean per micro-batch averaged over them, weights the short rows 10x more
    for lo, hi in [(0, 4), (4, 8), (8, 12), (12, 16)]:
        b = _take(batch, lo, hi)
        tl = token_losses(model(b["input_ids"], position_ids=b["position_ids"], cu_seqlens=b["cu_seqlens"]), b["labels"])
        (tl.sum() / (b["labels"] != -100).sum() / 4).backward()
    per_micro = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert not torch.allclose(whole, per_micro, rtol=1e-2, atol=1e-5)


def test_a_run_folder_is_not_reused_and_resume_keeps_the_settings(source, tmp_path):
    base = ("data.holdout_shards=0", "train.steps=4", "train.stop_at=2")
    train(tiny_cfg(source, tmp_path / "r", *base))
    with pytest.raises(ConfigError, match=r"already holds a run \(config.yaml, metrics.jsonl, checkpoint.pt\); "
                                          r"continue it with --resume, or pass another --output"):
        train(tiny_cfg(source, tmp_path / "r", *base))
    with pytest.raises(ConfigError, match=r"--resume: train.steps is 6 but the checkpoint's run has 4"):
        train(tiny_cfg(source, tmp_path / "r", "data.holdout_shards=0", "train.steps=6"), resume=True)
    with pytest.raises(ConfigError, match=r"--resume: optim.lr is 0.02 but the checkpoint's run has 0.01"):
        train(tiny_cfg(source, tmp_path / "r", "data.holdout_shards=0", "train.steps=4", "optim.lr=0.02"), resume=True)
    # execution-only keys may change on resume
    rest = train(tiny_cfg(source, tmp_path / "r", "data.holdout_shards=0", "train.steps=4", "train.log_every=1",
                          "prefetch.enabled=false"), resume=True)
    assert rest["start_step"] == 2 and len(rest["losses"]) == 2

    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "metrics.jsonl").write_text("")  # a run stopped before its first checkpoint
    with pytest.raises(ConfigError, match="no checkpoint to resume from: pass another --output"):
        train(tiny_cfg(source, tmp_path / "s", *base))


def _ctrl_c_at_step(monkeypatch, step: int) -> None:
    """Ctrl-C in the forward pass of training step `step` (one micro-batch a step): the run stops there."""
    real, calls = GPT.forward, {"n": 0}

    def forward(self, *a, **k):
        if self.training:
            calls["n"] += 1
            if calls["n"] == step:
                raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(GPT, "forward", forward)


def _logged(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(source, tmp_path, monkeypatch):
    """The Ctrl-C line says --resume; with no checkpoint yet, --resume starts the same run again from step 0 (its
    config.yaml checked like a checkpoint's), and metrics.jsonl keeps each step once."""
    sets = ("data.holdout_shards=0", "train.steps=4", "train.log_every=1", "train.ckpt_every=0", "train.ckpt_minutes=0")
    straight = train(tiny_cfg(source, tmp_path / "a", *sets))
    with monkeypatch.context() as m:
        _ctrl_c_at_step(m, 3)
        with pytest.raises(KeyboardInterrupt):
            train(tiny_cfg(source, tmp_path / "b", *sets))
    assert [step for step, _ in _logged(tmp_path / "b")] == [1, 2] and not (tmp_path / "b" / "checkpoint.pt").exists()
    with pytest.raises(ConfigError, match=r"already holds a run \(config.yaml, metrics.jsonl\); it stopped before its "
                                          r"first checkpoint: --resume starts it again from step 0"):
        train(tiny_cfg(source, tmp_path / "b", *sets))
    with pytest.raises(ConfigError, match=r"--resume: optim.lr is 0.02 but the run's .*config.yaml has 0.01"):
        train(tiny_cfg(source, tmp_path / "b", *sets, "optim.lr=0.02"), resume=True)
    again = train(tiny_cfg(source, tmp_path / "b", *sets), resume=True)
    assert again["start_step"] == 0 and again["losses"] == straight["losses"]
    assert _logged(tmp_path / "b") == _logged(tmp_path / "a")  # steps 1 and 2 once, from the run that counts


def test_a_resume_keeps_each_step_of_metrics_once(source, tmp_path, monkeypatch):
    """Killed after logging step 4 with its checkpoint at step 3: the resume replays step 4 and logs it once."""
    sets = ("data.holdout_shards=0", "train.steps=6", "train.log_every=1", "train.ckpt_every=3", "train.ckpt_minutes=0")
    train(tiny_cfg(source, tmp_path / "a", *sets))
    with monkeypatch.context() as m:
        _ctrl_c_at_step(m, 5)
        with pytest.raises(KeyboardInterrupt):
            train(tiny_cfg(source, tmp_path / "b", *sets))
    assert [step for step, _ in _logged(tmp_path / "b")] == [1, 2, 3, 4]
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # a row cut short by a kill
    rest = train(tiny_cfg(source, tmp_path / "b", *sets), resume=True)
    assert rest["start_step"] == 3
    assert _logged(tmp_path / "b") == _logged(tmp_path / "a")  # 1..6 once each, the same losses as straight


def test_cli_resume_continues_with_the_runs_own_settings(source, tmp_path, capsys):
    """`datapipe train --resume` reads the run's config.yaml: the earlier --set and --data need not be repeated; one
    given again must agree (a differing one is refused, naming it); execution keys may change."""
    recipe = tmp_path / "t.yaml"
    recipe.write_text("model: {n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}\n"
                      "data: {seq_len: 64, batch_size: 2}\ntrain: {steps: 3, log_every: 1, device: cpu}\n")
    run = str(tmp_path / "r")
    assert main(["train", str(recipe), "--data", str(source), "--output", run, "--set", "train.steps=4",
                 "--set", "optim.lr=0.01", "--set", "train.stop_at=2"]) == 0
    capsys.readouterr()
    assert main(["train", str(recipe), "--output", run, "--resume", "--set", "optim.lr=0.02"]) == 2
    err = capsys.readouterr().err
    assert "--resume: --set optim.lr=0.02 sets optim.lr to 0.02, but the run has 0.01" in err and "Traceback" not in err
    assert main(["train", str(recipe), "--output", run, "--resume", "--data", str(tmp_path)]) == 2
    assert f"--data {tmp_path} sets data.source to" in capsys.readouterr().err
    assert main(["train", str(recipe), "--output", run, "--resume", "--set", "optim.lr=0.01",
                 "--set", "train.log_every=2"]) == 0
    out = capsys.readouterr().out
    assert f"resumed from {run}/checkpoint.pt at step 2" in out and "step 4/4" in out and "step 3/4" not in out
    assert torch.load(Path(run) / "checkpoint.pt", weights_only=True)["step"] == 4


def test_prioritization_lag_must_cover_a_step_of_micro_batches(source, tmp_path):
    with pytest.raises(ConfigError, match=r"data.prioritize.lag must be >= train.grad_accum - 1 = 7"):
        tiny_cfg(source, tmp_path, "data.prioritize.enabled=true", "data.prioritize.lag=3", "train.grad_accum=8")
    tiny_cfg(source, tmp_path, "data.prioritize.enabled=true", "data.prioritize.lag=7", "train.grad_accum=8")


def test_checkpoints_carry_a_sha256_keep_the_previous_one_and_refuse_damage(source, tmp_path, capsys):
    from datapipe.core.shards import file_sha256

    run = tmp_path / "r"
    sets = ("data.holdout_shards=0", "train.steps=4", "train.ckpt_every=0")
    train(tiny_cfg(source, run, *sets, "train.ckpt_minutes=1e-9"))  # a wall-clock checkpoint after every step
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 4  # always one at the end
    assert torch.load(run / "checkpoint.prev.pt", weights_only=True)["step"] == 3  # the wall-clock one before it
    digests = dict(line.split("  ")[::-1] for line in (run / "checkpoint.sha256").read_text().splitlines())
    assert digests == {"checkpoint.pt": file_sha256(run / "checkpoint.pt"),
                       "checkpoint.prev.pt": file_sha256(run / "checkpoint.prev.pt")}

    train(tiny_cfg(source, tmp_path / "q", *sets, "train.ckpt_minutes=0"))
    assert not (tmp_path / "q" / "checkpoint.prev.pt").exists()  # ckpt_every=0, no wall clock: only the end

    good = (run / "checkpoint.pt").read_bytes()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0xFF
    (run / "checkpoint.pt").write_bytes(bytes(flipped))
    resume_cfg = tiny_cfg(source, run, "data.holdout_shards=0", "train.steps=6", "train.ckpt_every=0")
    with pytest.raises(ConfigError, match=r"checkpoint '.*checkpoint.pt' is damaged.*checkpoint.prev.pt' is intact: "
                                          r"move it to '.*checkpoint.pt' to resume from it"):
        train(resume_cfg, resume=True)
    (run / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"checkpoint '.*checkpoint.pt' is damaged: .* \(0 bytes\)"):
        train(resume_cfg, resume=True)
    recipe = tmp_path / "t.yaml"
    recipe.write_text("train: {steps: 4}\n")
    assert main(["train", str(recipe), "--data", str(source), "--output", str(run), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.pt' is damaged" in err and "Traceback" not in err and "EOFError" not in err
    (run / "checkpoint.pt").unlink()
    with pytest.raises(ConfigError, match=r"no checkpoint at '.*checkpoint.pt'; '.*checkpoint.prev.pt' holds the "
                                          r"checkpoint before it: move it to"):
        train(resume_cfg, resume=True)
    (run / "checkpoint.prev.pt").rename(run / "checkpoint.pt")  # the user falls back to the previous checkpoint
    with pytest.raises(ConfigError, match=r"train.steps is 6 but the checkpoint's run has 4"):  # it loads and is checked
        train(resume_cfg, resume=True)


@pytest.mark.parametrize("killed_at", ["checkpoint.prev.pt", "checkpoint.pt"])
def test_a_checkpoint_save_killed_between_its_renames_leaves_a_verifiable_checkpoint(tmp_path, monkeypatch, killed_at):
    """The digest file is replaced first, then checkpoint.pt -> checkpoint.prev.pt, then the new file -> checkpoint.pt:
    killed before either rename, the files on disk still match the digests, and nothing newer is claimed."""
    from datapipe.train.checkpoint import load_checkpoint, save_checkpoint

    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, {"step": 1})
    save_checkpoint(path, {"step": 2})
    real = os.replace

    def killed(src, dst):
        if Path(dst).name == killed_at:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"step": 3})
    monkeypatch.setattr(os, "replace", real)
    if killed_at == "checkpoint.prev.pt":  # nothing moved yet: checkpoint.pt is still step 2, and verifies
        assert load_checkpoint(path)["step"] == 2
    else:  # checkpoint.pt moved away: the error says so, and the previous one (step 2) verifies once moved back
        with pytest.raises(ConfigError, match="checkpoint.prev.pt' holds the checkpoint before it"):
            load_checkpoint(path)
        (tmp_path / "checkpoint.prev.pt").rename(path)
        assert load_checkpoint(path)["step"] == 2


# one checkpoint at step 3, a log record every step, evaluations at steps 3 and 6
LOGGED = ("train.steps=6", "train.log_every=1", "train.eval_every=3", "train.ckpt_every=3", "train.ckpt_minutes=0")


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_holds_the_logged_scalars_and_a_resume_continues_the_curves(source, tmp_path, monkeypatch):
    """Killed at step 5 after logging step 4, its checkpoint at step 3: the resumed run's events replace step 4 and
    continue; the reader sees each step once, in order, with the values of metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    with monkeypatch.context() as m:
        _ctrl_c_at_step(m, 5)
        with pytest.raises(KeyboardInterrupt):
            train(tiny_cfg(source, run, *LOGGED, "train.tensorboard=true"))
    resumed_at = time.time()
    assert train(tiny_cfg(source, run, *LOGGED, "train.tensorboard=true"), resume=True)["start_step"] == 3

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {"loss", "eval_loss", "tokens_per_s", "lr"} <= set(events.Tags()["scalars"])
    for tag in ("loss", "tokens_per_s", "lr", "eval_loss"):
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        steps = [step for step, _ in logged]
        assert steps == sorted(set(steps)), tag  # strictly increasing: no step twice across the resume
        assert logged == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in _records(run) if tag in r], tag
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("eval_loss")] == [3, 6]
    # step 4 is the resumed run's: the stopped run's step 4 (past its checkpoint) was purged
    assert next(e for e in events.Scalars("loss") if e.step == 4).wall_time >= resumed_at


def test_a_missing_tracker_package_is_a_config_error_naming_the_key(source, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails, as without tensorboard
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"train.tensorboard is true but the tensorboard package is not installed: "
                                          r"pip install tensorboard"):
        train(tiny_cfg(source, tmp_path / "a", "train.tensorboard=true"))
    with pytest.raises(ConfigError, match=r"train.wandb is true but the wandb package is not installed: pip install wandb"):
        train(tiny_cfg(source, tmp_path / "b", "train.wandb=true"))
    assert not (tmp_path / "a").exists()  # refused before anything was written
    recipe = tmp_path / "t.yaml"
    recipe.write_text("model: {n_layer: 1, n_head: 2, d_model: 32, max_seq_len: 64}\ndata: {seq_len: 64, batch_size: 2}\n")
    assert main(["train", str(recipe), "--data", str(source), "--output", str(tmp_path / "c"),
                 "--set", "train.tensorboard=true"]) == 2
    err = capsys.readouterr().err
    assert "train.tensorboard" in err and "pip install tensorboard" in err and "Traceback" not in err


class _FakeWandb(types.ModuleType):
    """What the trainer calls of wandb: init(...) -> a run with log(values, step=) and finish()."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.inits, self.logged = [], []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return types.SimpleNamespace(log=lambda values, step: self.logged.append((step, values)), finish=lambda: None)


def test_wandb_gets_each_record_and_a_resume_continues_its_run(source, tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    run = tmp_path / "run"
    train(tiny_cfg(source, run, *LOGGED, "train.stop_at=3", "train.wandb=true"))
    train(tiny_cfg(source, run, *LOGGED, "train.wandb=true"), resume=True)
    first, again = fake.inits
    assert first["id"] == again["id"] == (run / "wandb-run-id").read_text() and again["resume"] == "allow"
    assert [step for step, _ in fake.logged] == [r["step"] for r in _records(run)] == [1, 2, 3, 4, 5, 6]
    assert {"loss", "lr", "tokens_per_s"} <= set(fake.logged[0][1]) and "eval_loss" in fake.logged[-1][1]
    assert not (tmp_path / "run" / "tensorboard").exists()  # train.tensorboard is off by default
