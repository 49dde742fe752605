"""DPO in the bundled trainer: `datapipe train configs/dpo-tiny.yaml` (train.objective: dpo).

Data: `data.source` is a preference folder (`datapipe curate-preferences`). When it is empty or
missing, a default set is built from the embedded corpus (stdlib docstrings and code, as
`datapipe run` does for text) into RUN_DIR/data/preferences: a real passage's first tokens are the
prompt, its true continuation is chosen, another passage's continuation is rejected. The last
`dpo.eval_pairs` pairs are held out for preference accuracy.

Step: `grad_accum` micro-batches of preference-packed rows (datapipe/preference.py; or padded pairs
with `dpo.packed: false`). The policy and the frozen reference model (a copy of the initial policy,
or of `dpo.init_from`) give per-response log-prob sums; the loss is
    sum over pairs of -log σ(β((π_c - ref_c) - (π_r - ref_r)))  /  pairs in the step over all micro-batches and ranks.
The pair count is summed over the step's micro-batches and all-reduced over ranks before any
backward, and each rank's loss is scaled by world_size because DDP averages gradients: the gradient
is exactly that of the mean over every pair of the step, whatever their split (a per-micro-batch mean
would weight a pair by 1/(pairs in its micro-batch), and a wrong sign or scale here flips or skews
the gradient: ms-swift#10144). Metrics: loss, reward margin (mean β-scaled margin), preference
accuracy (share of pairs with margin > 0), tokens (real) and slots (row tokens incl. padding).
DPO runs do not support --resume; they write RUN_DIR/checkpoint.pt (the policy) at the end.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from dataclasses import replace
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import yaml

from datapipe.core import shards
from datapipe.core.config import ConfigError, to_dict
from datapipe.train.checkpoint import save_checkpoint
from datapipe.train.model import GPT
from datapipe.train.optim import lr_factor, param_groups
from datapipe.loader.preference_packing import load_pairs, packed_batches



def _stream(pairs: list, idx: list[int], cfg: Any, seed: int, packed: bool) -> Iterator[tuple[dict, int]]:
    """Endless (batch, pairs) over this rank's pairs, reshuffled every epoch by (seed, epoch)."""
    epoch = 0
    while True:
        order = [idx[i] for i in np.random.default_rng([seed, epoch]).permutation(len(idx))]
        yield from packed_batches(pairs, order, cfg.data.seq_len, cfg.data.batch_size, packed=packed, chunk=cfg.dpo.chunk)
        epoch += 1


def _forward(model: torch.nn.Module, batch: dict, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], attn_mask=batch["attn_mask"])
    return response_logps(logits, batch, n)


def backward_step(model: torch.nn.Module, reference: torch.nn.Module, micro: list[tuple[dict, int]], count: torch.Tensor,
                  world: int, beta: float, device: torch.device) -> torch.Tensor:
    """Backward of one step's micro-batches: gradient of (sum of pair losses) / count, count = the step's pairs
    over all micro-batches and ranks. Returns (loss sum, margin sum, correct, pairs) of this rank."""
    stats = torch.zeros(4, device=device, dtype=torch.float64)
    for k, (batch, n) in enumerate(micro):
        batch = {key: v.to(device) for key, v in batch.items()}
        with torch.no_grad():
            rc, rr = _forward(reference, batch, n)
        sync = world == 1 or k == len(micro) - 1  # DDP all-reduces on the last micro-batch only
        with model.no_sync() if not sync else contextlib.nullcontext():
            pc, pr = _forward(model, batch, n)
            loss, margin = dpo_loss(pc, pr, rc, rr, beta)
            (loss.sum() * world / count).backward()  # DDP averages over ranks: this gives sum / all pairs
        stats += torch.stack([loss.detach().sum().double(), margin.sum().double(), (margin > 0).sum().double(),
                              torch.tensor(float(n), device=device, dtype=torch.float64)])
    return stats


def train_dpo(cfg: Any, *, rank: int, world: int, device: torch.device, resume: bool = False,
              default_preferences: Callable[[str, int, Callable], Any] | None = None) -> dict[str, Any]:
    """Train the policy with DPO for cfg.train.steps steps; returns a summary (rank 0's view)."""
    if resume:
        raise ConfigError("--resume is not supported with train.objective=dpo; start a new run")
    t_start = time.perf_counter()
    main = rank == 0
    say = print if main else (lambda *a, **k: None)
    run_dir = Path(cfg.train.output)
    run_dir.mkdir(parents=True, exist_ok=True)
    source = cfg.data.source
    if not source or not Path(source, "manifest.json").exists():
        if source and "://" in source:
            raise ConfigError(f"data.source must be a local preference folder, got {source!r}")
        if default_preferences is None:
            raise ConfigError(f"data.source must be a preference folder holding manifest.json, got {source!r}; curate one "
                              "with `datapipe curate-preferences` (`datapipe train` builds a default set when it is empty)")
        source = str(run_dir / "data" / "preferences")
        if main:
            default_preferences(source, cfg.dpo.default_pairs, say)
        if world > 1:
            dist.barrier()
    pairs = load_pairs(source)
    manifest = shards.read_manifest(source)
    vocab = cfg.model.vocab_size or manifest.get("tokenizer", {}).get("vocab_size")
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=vocab))
    n_eval = min(cfg.dpo.eval_pairs, len(pairs) // 5)
    train_idx = list(range(len(pairs) - n_eval))[rank::world]
    eval_idx = list(range(len(pairs) - n_eval, len(pairs)))

    torch.manual_seed(cfg.train.seed)
    policy = GPT(cfg.model).to(device)
    if cfg.dpo.init_from:
        state = torch.load(cfg.dpo.init_from, map_location="cpu", weights_only=True)
        policy.load_state_dict(state.get("model", state))
    reference = copy.deepcopy(policy).eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(param_groups(policy, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    model = policy
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(policy, device_ids=[device.index] if device.type == "cuda" else None)
    if main:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    say(f"dpo: {len(pairs)} pairs ({n_eval} held out) from {source}; beta {cfg.dpo.beta}; "
        f"{'packed' if cfg.dpo.packed else 'padded'} rows of {cfg.data.seq_len}; world {world}")
    batches = _stream(pairs, train_idx, cfg, cfg.train.seed + 1000 * rank, cfg.dpo.packed)
    metrics = open(run_dir / "metrics.jsonl", "a") if main else None
    acc = {"t": time.perf_counter(), "loss": 0.0, "margin": 0.0, "correct": 0.0, "pairs": 0, "tokens": 0, "slots": 0, "steps": 0}
    losses, record, total_pairs = [], {}, 0
    try:
        for step in range(cfg.train.steps):
            micro = [next(batches) for _ in range(cfg.train.grad_accum)]
            count = torch.tensor(float(sum(n for _, n in micro)), device=device)
            if world > 1:
                dist.all_reduce(count)  # pairs in this step, all ranks
            step_stats = backward_step(model, reference, micro, count, world, cfg.dpo.beta, device)
            for batch, _ in micro:
                acc["tokens"] += int((batch["resp_id"] >= 0).sum())  # response tokens (slots: all row tokens)
                acc["slots"] += batch["input_ids"].numel()
            if world > 1:
                dist.all_reduce(step_stats)
            if cfg.optim.grad_clip:
                torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            step_loss = float(step_stats[0] / step_stats[3])
            losses.append(step_loss)
            total_pairs += int(step_stats[3])
            acc["loss"] += float(step_stats[0])
            acc["margin"] += float(step_stats[1])
            acc["correct"] += float(step_stats[2])
            acc["pairs"] += int(step_stats[3])
            acc["steps"] += 1
            done = step + 1
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                seconds = time.perf_counter() - acc["t"]
                record = {"step": done, "loss": acc["loss"] / acc["pairs"], "reward_margin": acc["margin"] / acc["pairs"],
                          "pref_accuracy": acc["correct"] / acc["pairs"], "pairs": total_pairs,
                          "step_time_s": seconds / acc["steps"], "pairs_per_s": acc["pairs"] / seconds,
                          "response_tokens": acc["tokens"], "slots": acc["slots"], "lr": scheduler.get_last_lr()[0]}
                if n_eval and (done == cfg.train.steps or (cfg.train.eval_every and done % cfg.train.eval_every == 0)):
                    record.update(evaluate_pairs(policy, reference, pairs, eval_idx, cfg, device))
                say(f"step {done}/{cfg.train.steps} | dpo loss {record['loss']:.4f} | margin {record['reward_margin']:+.3f} | "
                    f"acc {record['pref_accuracy']:.3f} | step {1000 * record['step_time_s']:.0f} ms"
                    + (f" | eval acc {record['eval_pref_accuracy']:.3f}" if "eval_pref_accuracy" in record else ""))
                if metrics:
                    metrics.write(json.dumps(record) + "\n")
                    metrics.flush()
                acc = {"t": time.perf_counter(), "loss": 0.0, "margin": 0.0, "correct": 0.0, "pairs": 0, "tokens": 0,
                       "slots": 0, "steps": 0}
    finally:
        if metrics:
            metrics.close()
    if main:
        save_checkpoint(run_dir / "checkpoint.pt", {"step": cfg.train.steps, "model": policy.state_dict(), "config": to_dict(cfg)})
    seconds = time.perf_counter() - t_start
    say(f"done: {cfg.train.steps} dpo steps in {seconds:.1f} s; metrics {run_dir / 'metrics.jsonl'}")
    return {"run_dir": str(run_dir), "steps": cfg.train.steps, "losses": losses, "final_loss": losses[-1] if losses else None,
            "seconds": seconds, "world_size": world, "pairs": total_pairs,
            **{k: v for k, v in record.items() if k in ("reward_margin", "pref_accuracy", "eval_pref_accuracy", "eval_reward_margin")}}


@torch.no_grad()
def evaluate_pairs(policy: GPT, reference: GPT, pairs: list, idx: list[int], cfg: Any, device: torch.device) -> dict[str, float]:
    was = policy.training
    policy.eval()
    margins = []
    for batch, n in packed_batches(pairs, idx, cfg.data.seq_len, cfg.data.batch_size, packed=True, chunk=len(idx) or 1):
        batch = {k: v.to(device) for k, v in batch.items()}
        pc, pr = _forward(policy, batch, n)
        rc, rr = _forward(reference, batch, n)
        margins.append(dpo_loss(pc, pr, rc, rr, cfg.dpo.beta)[1])
    policy.train(was)
    m = torch.cat(margins)
    return {"eval_reward_margin": float(m.mean()), "eval_pref_accuracy": float((m > 0).float().mean()),
            "eval_loss": float(-torch.nn.functional.logsigmoid(m).mean())}


def response_logps(logits: torch.Tensor, batch: Mapping[str, torch.Tensor], n_pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of each pair's chosen and rejected response: two tensors of shape (n_pairs,)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    rows = torch.arange(logp.shape[0], device=logp.device)[:, None]
    tok = logp[rows, batch["pred_index"], batch["input_ids"]]  # token i's log-prob at its predicting position
    rid = batch["resp_id"]
    mask = rid >= 0
    sums = torch.zeros(2 * n_pairs, dtype=tok.dtype, device=tok.device).index_add_(0, rid[mask], tok[mask])
    return sums[0::2], sums[1::2]


def dpo_loss(pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss -log σ(β((π_c - ref_c) - (π_r - ref_r))) and the reward margins."""
    margin = beta * ((pc - rc) - (pr - rr))
    return -torch.nn.functional.logsigmoid(margin), margin.detach()
