"""What a training objective supplies to the one training loop (datapipe/train/loop.py), and the helpers they share.

An objective (train/lm.py: next-token loss on text shards; train/dpo.py: DPO on preference pairs)
owns its data, its loss and its numbers; the loop owns everything else (distributed set-up, device,
model, optimizer, schedule, resume, non-finite handling, autocast, gradient norm, logs, checkpoints).
Per step the loop calls `next_step()` (this rank's micro-batches), `backward(model, micro)` (the
backward passes of the whole step; returns this rank's per-step sums as one float64 tensor, which the
loop all-reduces over ranks once), `step_loss(sums)` and `add(sums, ok)`; per log interval
`log_fields(seconds)` and `log_text(record)`; `evaluate(model)` when evaluation is due; and
`rank_state()` / `totals` for the checkpoint.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol

import torch

from datapipe.train.model import GPT


class Objective(Protocol):
    name: str  # "lm" or "dpo" (train.objective)
    state_key: str  # the checkpoint key of the per-rank data states (a list, one per rank)
    vocab_size: int  # the vocabulary of the data (the model's when model.vocab_size is null)
    totals: dict[str, int]  # cumulative counts over the whole run (resumes included), equal on every rank
    can_evaluate: bool

    def describe(self) -> str:
        """One line on the data, printed at start."""

    def init_model(self, model: GPT) -> None:
        """Called once on the freshly initialised model, before a resume loads weights into it."""

    def start(self, model: GPT) -> None:
        """Open the data stream (after a resume has loaded the data state)."""

    def next_step(self) -> list[Any]:
        """This rank's micro-batches of one optimizer step (`train.grad_accum` of them)."""

    def backward(self, model: torch.nn.Module, micro: list[Any]) -> torch.Tensor:
        """Backward passes of the step's micro-batches; returns this rank's sums (1-D float64)."""

    def step_loss(self, sums: torch.Tensor) -> float:
        """The step's loss from the sums over all ranks."""

    def add(self, sums: torch.Tensor, ok: bool) -> None:
        """Add a step's sums over all ranks to the interval and to `totals`; ok=False: the update was skipped."""

    def log_fields(self, seconds: float) -> dict[str, Any]:
        """The metrics.jsonl fields of the interval that took `seconds`; starts a new interval."""

    def log_text(self, record: dict[str, Any]) -> str:
        """The objective's part of the log line."""

    def evaluate(self, model: GPT) -> dict[str, Any]:
        """Held-out metrics (their keys start with 'eval'; the LM objective adds its cumulative compute counters,
        `tokens`, `flops`, ..., so an eval record stands on the tokens and FLOPs axes by itself)."""

    def eval_text(self, record: dict[str, Any]) -> str:
        """The log text of an evaluation."""

    def rank_state(self) -> dict[str, Any]:
        """This rank's data position (of the batch last trained on), for the checkpoint."""

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Continue from a `rank_state()`."""

    def summary(self, record: dict[str, Any]) -> dict[str, Any]:
        """Fields the objective adds to train()'s summary, given the last log record."""

    def close(self) -> None:
        """Stop background work."""


def autocast(device: torch.device) -> ContextManager:
    """bf16 autocast on CUDA; plain fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync_unless(model: torch.nn.Module, last: bool) -> ContextManager:
    """DDP all-reduces gradients on a step's last micro-batch only; a plain module always 'syncs'."""
    if last or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()
