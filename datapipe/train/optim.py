"""AdamW parameter groups and the learning-rate schedule, shared by every objective."""

from __future__ import annotations

import math
from typing import Any

import torch

from datapipe.train.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """The multiple of the peak lr at 0-based `step`: linear warmup, then cosine/linear decay to the floor."""
    steps, sch = cfg.train.steps, cfg.schedule
    warmup = max(1, round(sch.warmup_frac * steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup - 1))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if sch.decay == "cosine" else 1 - progress
    return sch.min_lr_frac + (1 - sch.min_lr_frac) * shape


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices (linear and embedding weights) only; none on norm gains or biases."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
