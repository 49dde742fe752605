"""The bundled trainer: a small GPT (datapipe/model.py) trained from curated shards through the loader.

    datapipe train configs/train-tiny.yaml [--data DIR] [--output DIR] [--set train.steps=200] [--resume]
    torchrun --nproc_per_node=2 -m datapipe train configs/train-tiny.yaml

    from datapipe.train.loop import load_train_config, train
    summary = train(load_train_config("configs/train-tiny.yaml", ["train.steps=50"]))

`train(cfg)` is the whole loop in one function, read top to bottom: set up (distributed, device,
data split, loaders, model, optimizer, schedule, resume), then per step: fetch `grad_accum`
micro-batches through the prefetcher, forward/backward, report per-document losses to the loader,
clip, skip the update if anything is non-finite, step; log, evaluate and checkpoint on their
intervals.

`data.prioritize.enabled: true` turns on loss-aware document selection in the loader (datapipe/prioritize.py),
fed by the per-document losses reported each micro-batch; `train.objective: dpo` hands the run to
datapipe/dpo.py (DPO on preference-packed pairs).

Held-out data. The loader reads a whole curated folder and cannot exclude shards, so evaluation
reads either `data.eval_source` (another curated folder) or, with `data.holdout_shards: N`, the
last N shards of `data.source`: the trainer then writes two derived folders under
`RUN_DIR/data/{train,eval}` holding a manifest restricted to their shards and symbolic links to
the shard files, and trains on the first. (Local sources only; use `eval_source` for URLs.)

Checkpoints (`RUN_DIR/checkpoint.pt`, written with `torch.save` to a temporary file then
`os.replace`, so a crash never leaves a half-written file) hold the model, optimizer, scheduler,
step, skip counters, and per rank the loader state (of the batch last trained on, not of the
prefetched ones) and RNG states, all plain tensors/dicts/lists: they load with `weights_only=True`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import yaml

from datapipe.core import shards
from datapipe.core.config import ConfigError, to_dict
from datapipe.loader import PackedLoader
from datapipe.train.config import TrainConfig
from datapipe.train.checkpoint import load_checkpoint, save_checkpoint
from datapipe.train.model import GPT, token_losses
from datapipe.train.optim import lr_factor, param_groups
from datapipe.train.prefetch import Prefetcher

# --------------------------------------------------------------------------------------------- parts


def split_holdout(source: str, n: int, run_dir: Path) -> tuple[str, str]:
    """Derived folders RUN_DIR/data/train and RUN_DIR/data/eval: the manifest's first shards and its last n."""
    manifest = shards.read_manifest(source)
    infos = manifest["shards"]
    if "://" in source and not source.startswith("file://"):
        raise ConfigError(f"data.holdout_shards works on local sources only, got source {source!r}; set data.eval_source")
    if n >= len(infos):
        raise ConfigError(f"data.holdout_shards must be less than the source's {len(infos)} shards, got {n!r}")
    keep = {"train": list(range(len(infos) - n)), "eval": list(range(len(infos) - n, len(infos)))}
    out = [shards.link_subset(source, keep[name], run_dir / "data" / name, note={"holdout_shards": n, "part": name})
           for name in ("train", "eval")]
    return out[0], out[1]


@torch.no_grad()
def evaluate(model: GPT, source: str, cfg: TrainConfig, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    """Mean token loss and perplexity per domain over `data.eval_batches` fixed batches of each domain."""
    manifest = shards.read_manifest(source)
    domains = sorted(d for d, c in manifest.get("domains", {}).items() if c.get("docs", 0) > 0)
    sums = torch.zeros(len(domains), 2, dtype=torch.float64, device=device)  # (loss sum, tokens)
    was_training = model.training
    model.eval()
    for i, domain in enumerate(domains):
        loader = PackedLoader(source, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size, seed=0, epochs=None,
                              rank=rank, world_size=world, mixture={domain: 1.0}, shuffle=False)
        for _, batch in zip(range(cfg.data.eval_batches), loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with _autocast(device):
                logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"],
                               cu_seqlens=batch["cu_seqlens"])
            tl = token_losses(logits, batch["labels"])
            sums[i, 0] += tl.sum().double()
            sums[i, 1] += (batch["labels"] != -100).sum()
    model.train(was_training)
    if world > 1:
        dist.all_reduce(sums)
    per = {d: float(sums[i, 0] / sums[i, 1].clamp(min=1)) for i, d in enumerate(domains)}
    total = float(sums[:, 0].sum() / sums[:, 1].sum().clamp(min=1))
    return {"eval_loss": total, "eval_ppl": math.exp(min(total, 50)),
            "eval_domains": {d: {"loss": v, "ppl": math.exp(min(v, 50))} for d, v in per.items()}}


def _autocast(device: torch.device):
    """bf16 autocast on CUDA; plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU, for MFU; None when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40", 181e12), ("A10", 125e12),
                       ("4090", 165e12), ("3090", 71e12), ("V100", 125e12)):
        if key in name:
            return flops
    return None


def _dist_setup(device_kind: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) from torchrun's environment; one process without it."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device_kind == "cuda" or (device_kind == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but torch sees no CUDA device; allowed here: 'auto' or 'cpu'")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, (dist.get_world_size() if dist.is_initialized() else 1), device


def _gather(obj: Any, world: int) -> list[Any]:
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


# --------------------------------------------------------------------------------------------- loop


def train(cfg: TrainConfig, *, resume: bool = False, default_preferences: Callable | None = None) -> dict[str, Any]:
    """Train `cfg.model` on `cfg.data` for `cfg.train.steps` steps; returns a summary (rank 0's view).

    `default_preferences(out, n, log)` builds a preference folder when a DPO run has no data.source (the CLI passes
    `datapipe.curate.preferences.default_preference_set`; the training wing does not import curation)."""
    t_start = time.perf_counter()
    rank, world, device = _dist_setup(cfg.train.device)
    if cfg.train.objective == "dpo":
        from datapipe.train.dpo import train_dpo

        return train_dpo(cfg, rank=rank, world=world, device=device, resume=resume, default_preferences=default_preferences)
    main = rank == 0
    say = print if main else (lambda *a, **k: None)
    run_dir = Path(cfg.train.output)
    run_dir.mkdir(parents=True, exist_ok=True)

    # -- data: the train source, and held-out data when configured
    source, eval_source = cfg.data.source, cfg.data.eval_source
    if not Path(source, "manifest.json").exists() and "://" not in source:
        raise ConfigError(f"data.source must be a curated folder holding manifest.json, got {source!r} "
                          "(curate one with `datapipe run` or `datapipe curate`, or pass --data)")
    if cfg.data.holdout_shards:
        if main:
            split_holdout(source, cfg.data.holdout_shards, run_dir)
        if world > 1:
            dist.barrier()
        source, eval_source = str(run_dir / "data" / "train"), str(run_dir / "data" / "eval")
    manifest = shards.read_manifest(source)
    vocab = cfg.model.vocab_size or manifest.get("tokenizer", {}).get("vocab_size")
    if not isinstance(vocab, int):
        raise ConfigError(f"model.vocab_size is null and {source}/manifest.json names no tokenizer vocab_size; set model.vocab_size")
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    loader = PackedLoader(source, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size, seed=cfg.train.seed,
                          epochs=None, rank=rank, world_size=world, num_workers=cfg.data.num_workers,
                          prioritize=cfg.data.prioritize.build())

    # -- model, optimizer, schedule (same seed on every rank: identical initial weights)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    start, skipped = 0, 0
    ckpt_path = run_dir / "checkpoint.pt"
    if resume:
        ckpt = load_checkpoint(ckpt_path)
        if len(ckpt["loaders"]) != world:
            raise ConfigError(f"--resume: the checkpoint was written by {len(ckpt['loaders'])} ranks, "
                              f"this run has world_size={world}; resume with the same number of processes")
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        loader.load_state_dict(ckpt["loaders"][rank])
        torch.set_rng_state(ckpt["rng"][rank]["cpu"])
        if device.type == "cuda" and ckpt["rng"][rank]["cuda"] is not None:
            torch.cuda.set_rng_state(ckpt["rng"][rank]["cuda"], device)
        start, skipped = int(ckpt["step"]), int(ckpt["skipped"])
        say(f"resumed from {ckpt_path} at step {start}")
    raw_model = model
    if cfg.train.compile:
        model = torch.compile(model)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    say(f"model: {raw_model.num_params(non_embedding=False) / 1e6:.2f} M parameters "
        f"({cfg.model.n_layer} layers, d_model {cfg.model.d_model}, vocab {vocab}); device {device}, world {world}; "
        f"{cfg.data.batch_size * cfg.data.seq_len * cfg.train.grad_accum * world:,} tokens/step")

    pf = Prefetcher(loader, depth=cfg.prefetch.depth, device=device, enabled=cfg.prefetch.enabled,
                    state_fn=loader.state_dict, delay_s=cfg.prefetch.delay_s)
    batches = iter(pf)
    peak = _peak_flops(device)
    flops_per_token = raw_model.flops_per_token(cfg.data.seq_len)
    metrics = open(run_dir / "metrics.jsonl", "a") if main else None
    in_a_row, losses, record = 0, [], {}
    interval = {"t": time.perf_counter(), "wait": pf.wait_seconds, "tokens": 0, "steps": 0, "loss": 0.0, "skipped": 0}
    stop = min(cfg.train.stop_at or cfg.train.steps, cfg.train.steps)
    try:
        for step in range(start, stop):
            lr = scheduler.get_last_lr()[0]
            loss_sum = torch.zeros((), device=device)
            tokens = torch.zeros((), device=device, dtype=torch.int64)
            for micro in range(cfg.train.grad_accum):
                batch = next(batches)
                labels, doc_ids = batch["labels"], batch["doc_ids"]
                sync = world == 1 or micro == cfg.train.grad_accum - 1  # DDP all-reduces on the last micro-batch only
                with (contextlib.nullcontext() if sync else model.no_sync()), _autocast(device):
                    logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=doc_ids,
                                   cu_seqlens=batch["cu_seqlens"])
                    tl = token_losses(logits, labels)
                    mask = labels != -100
                    loss = tl.sum() / mask.sum().clamp(min=1)
                    (loss / cfg.train.grad_accum).backward()
                loss_sum += loss.detach()
                tokens += (doc_ids >= 0).sum()
                # per-document mean loss of this micro-batch -> the loader (kept in its state for prioritisation)
                ids, inverse = torch.unique(doc_ids[mask], return_inverse=True)
                per_doc = torch.zeros(len(ids), device=device).scatter_add_(0, inverse, tl.detach()[mask].float())
                per_doc /= torch.bincount(inverse, minlength=len(ids)).clamp(min=1)
                with pf.lock:
                    loader.report_losses(ids.cpu(), per_doc.cpu())
            norm_fn = torch.nn.utils.clip_grad_norm_
            grad_norm = norm_fn(raw_model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip else float("inf"))
            step_loss = loss_sum / cfg.train.grad_accum
            if world > 1:  # the mean loss over ranks; grads (hence grad_norm) are already identical
                dist.all_reduce(step_loss)
                step_loss /= world
            step_loss, grad_norm = float(step_loss), float(grad_norm)
            if math.isfinite(step_loss) and math.isfinite(grad_norm):
                optimizer.step()
                in_a_row = 0
            else:  # skip the update; the data is consumed and the schedule moves on
                skipped += 1
                in_a_row += 1
                interval["skipped"] += 1
                say(f"step {step + 1}: non-finite loss {step_loss} or grad norm {grad_norm}: update skipped "
                    f"({in_a_row} in a row, {skipped} in all)")
                if in_a_row >= cfg.train.max_nonfinite:
                    raise RuntimeError(f"stopping at step {step + 1}: {in_a_row} non-finite losses or gradients in a row "
                                       f"(train.max_nonfinite={cfg.train.max_nonfinite}); lower optim.lr or check the data")
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append(step_loss)
            interval["tokens"] += int(tokens) * world
            interval["steps"] += 1
            interval["loss"] += step_loss if math.isfinite(step_loss) else 0.0
            done = step + 1
            last = done == stop

            if done % cfg.train.log_every == 0 or last:
                now = time.perf_counter()
                seconds = max(now - interval["t"], 1e-9)
                ok_steps = interval["steps"] - interval["skipped"]
                record = {"step": done, "loss": interval["loss"] / max(ok_steps, 1), "lr": lr, "grad_norm": grad_norm,
                          "tokens_per_s": interval["tokens"] / seconds, "step_time_s": seconds / interval["steps"],
                          "data_wait_frac": (pf.wait_seconds - interval["wait"]) / seconds,
                          "skipped": interval["skipped"], "tokens": loader.stats()["tokens"] * world}
                if peak:
                    record["mfu"] = flops_per_token * record["tokens_per_s"] / (peak * world)
                evaluated = eval_source and ((cfg.train.eval_every and done % cfg.train.eval_every == 0) or last)
                if evaluated:
                    record.update(evaluate(raw_model, eval_source, cfg, device, rank, world))
                say(f"step {done}/{cfg.train.steps} | loss {record['loss']:.4f} | lr {lr:.2e} | gnorm {grad_norm:.2f} | "
                    f"{record['tokens_per_s']:,.0f} tok/s | step {1000 * record['step_time_s']:.0f} ms | "
                    f"data wait {100 * record['data_wait_frac']:.1f}%"
                    + (f" | mfu {100 * record['mfu']:.1f}%" if "mfu" in record else "")
                    + (f" | eval {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.1f})" if evaluated else ""))
                if metrics:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                interval = {"t": time.perf_counter(), "wait": pf.wait_seconds, "tokens": 0, "steps": 0, "loss": 0.0,
                            "skipped": 0}
            elif eval_source and cfg.train.eval_every and done % cfg.train.eval_every == 0:
                extra = evaluate(raw_model, eval_source, cfg, device, rank, world)
                say(f"step {done}: eval {extra['eval_loss']:.4f} (ppl {extra['eval_ppl']:.1f})")
                if metrics:
                    metrics.write(json.dumps({"step": done, **extra}) + "\n")

            if (cfg.train.ckpt_every and done % cfg.train.ckpt_every == 0) or last:
                with pf.lock:  # the loader state of the batch just trained on, with the losses reported so far
                    live = loader.state_dict()  # losses (and the loss predictor) learnt up to this step
                    state = {**pf.state, **{k: live[k] for k in ("losses", "predictor") if k in live}}
                rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
                loaders, rngs = _gather(state, world), _gather(rng, world)
                if main:
                    save_checkpoint(ckpt_path, {
                        "step": done, "skipped": skipped, "model": raw_model.state_dict(),
                        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                        "loaders": loaders, "rng": rngs, "config": to_dict(cfg)})
                if world > 1:
                    dist.barrier()
    finally:
        pf.close()
        if metrics:
            metrics.close()
    seconds = time.perf_counter() - t_start
    digest = hashlib.sha256()  # of every parameter's bytes: replicas (DDP ranks) must agree exactly
    for p in raw_model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    summary = {"params_sha256": digest.hexdigest(), "run_dir": str(run_dir), "steps": stop, "start_step": start, "losses": losses,
               "final_loss": losses[-1] if losses else None, "skipped": skipped, "seconds": seconds,
               "data_wait_s": pf.wait_seconds, "world_size": world, **{k: v for k, v in record.items() if k.startswith("eval")}}
    say(f"done: {stop - start} steps in {seconds:.1f} s; checkpoint {ckpt_path}; metrics {run_dir / 'metrics.jsonl'}")
    return summary
