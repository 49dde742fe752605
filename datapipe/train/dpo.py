"""The DPO objective (train.objective: dpo): `datapipe train configs/dpo-tiny.yaml`.

Data: `data.source` is a preference folder (`datapipe curate-preferences`). When it is empty or
missing, a default set is built from the embedded corpus (stdlib docstrings and code, as
`datapipe run` does for text) into RUN_DIR/data/preferences: a real passage's first tokens are the
prompt, its true continuation is chosen, another passage's continuation is rejected. The last
`dpo.eval_pairs` pairs are held out for preference accuracy.

Step: `grad_accum` micro-batches of preference-packed rows (datapipe/loader/preference_packing.py; or
padded pairs with `dpo.packed: false`). The policy and the frozen reference model (a copy of the
initial policy, or of `dpo.init_from`) give per-response log-prob sums; the loss is
    sum over pairs of -log σ(β((π_c - ref_c) - (π_r - ref_r)))  /  pairs in the step over all micro-batches and ranks.
The pair count is summed over the step's micro-batches and all-reduced over ranks before any
backward, and each rank's loss is scaled by world_size because DDP averages gradients: the gradient
is exactly that of the mean over every pair of the step, whatever their split (a per-micro-batch mean
would weight a pair by 1/(pairs in its micro-batch), and a wrong sign or scale here flips or skews
the gradient: ms-swift#10144). Metrics: loss, reward margin (mean β-scaled margin), preference
accuracy (share of pairs with margin > 0), pairs (cumulative), response tokens and slots (row tokens
incl. padding) per interval.

Resume is exact: each rank's position in its pair stream (epoch, index of the next batch in that
epoch) is the checkpoint state, and the reference model is rebuilt from the same initial weights.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader.preference_packing import load_pairs, packed_batches
from datapipe.train.checkpoint import load_checkpoint
from datapipe.train.config import TrainConfig
from datapipe.train.model import GPT
from datapipe.train.objective import autocast, sync_unless

Pair = tuple[np.ndarray, np.ndarray, np.ndarray]


class PairStream:
    """Endless (batch, pairs) over one rank's pairs, reshuffled every epoch by (seed, epoch). Its position is
    (epoch, index of the next batch in that epoch); a stream given a saved position continues with the same batch."""

    def __init__(self, pairs: Sequence[Pair], idx: Sequence[int], cfg: TrainConfig, seed: int) -> None:
        self.pairs, self.idx, self.cfg, self.seed = pairs, list(idx), cfg, seed
        self.epoch, self.index = 0, 0
        self._it: Iterator[tuple[dict[str, torch.Tensor], int]] | None = None

    def _open(self) -> None:
        """The batches of `epoch` from `index` on (the skipped ones are rebuilt: packing is deterministic)."""
        order = [self.idx[i] for i in np.random.default_rng([self.seed, self.epoch]).permutation(len(self.idx))]
        batches = packed_batches(self.pairs, order, self.cfg.data.seq_len, self.cfg.data.batch_size,
                                 packed=self.cfg.dpo.packed, chunk=self.cfg.dpo.chunk)
        self._it = itertools.islice(batches, self.index, None)

    def __iter__(self) -> "PairStream":
        return self

    def __next__(self) -> tuple[dict[str, torch.Tensor], int]:
        if self._it is None:
            self._open()
        item = next(self._it, None)
        if item is None:  # the epoch is over: the next one, reshuffled
            self.epoch, self.index = self.epoch + 1, 0
            self._open()
            item = next(self._it, None)
            if item is None:
                raise ConfigError(f"no preference pair fits in a row of data.seq_len={self.cfg.data.seq_len} tokens; "
                                  "raise data.seq_len (and model.max_seq_len)")
        self.index += 1
        return item

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._it = None


def _forward(model: torch.nn.Module, batch: dict, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast(batch["input_ids"].device):
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
        with sync_unless(model, k == len(micro) - 1):
            pc, pr = _forward(model, batch, n)
            loss, margin = dpo_loss(pc, pr, rc, rr, beta)
            (loss.sum() * world / count).backward()  # DDP averages over ranks: this gives sum / all pairs
        stats += torch.stack([loss.detach().sum().double(), margin.sum().double(), (margin > 0).sum().double(),
                              torch.tensor(float(n), device=device, dtype=torch.float64)])
    return stats


class DPOObjective:
    """DPO on preference pairs against a frozen reference (see the module docstring)."""

    name = "dpo"
    state_key = "pair_streams"

    def __init__(self, cfg: TrainConfig, run_dir: Path, *, rank: int, world: int, device: torch.device,
                 say: Callable[..., None], default_preferences: Callable[[str, int, Callable], Any] | None) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        source = cfg.data.source
        if not source or not Path(source, "manifest.json").exists():
            if source and "://" in source:
                raise ConfigError(f"data.source must be a local preference folder, got {source!r}")
            if default_preferences is None:
                raise ConfigError(f"data.source must be a preference folder holding manifest.json, got {source!r}; curate "
                                  "one with `datapipe curate-preferences` (`datapipe train` builds a default set when it is empty)")
            source = str(run_dir / "data" / "preferences")
            if rank == 0:
                default_preferences(source, cfg.dpo.default_pairs, say)
            if world > 1:
                dist.barrier()
        self.pairs = load_pairs(source)  # a ConfigError naming `datapipe curate-preferences` on a text folder
        vocab = cfg.model.vocab_size or shards.read_manifest(source).get("tokenizer", {}).get("vocab_size")
        if not isinstance(vocab, int):
            raise ConfigError(f"model.vocab_size is null and {source}/manifest.json names no tokenizer vocab_size; "
                              "set model.vocab_size")
        self.source, self.vocab_size = source, vocab
        self.n_eval = min(cfg.dpo.eval_pairs, len(self.pairs) // 5)
        train_idx = list(range(len(self.pairs) - self.n_eval))[rank::world]
        if not train_idx:
            raise ConfigError(f"data.source {source!r} holds {len(self.pairs)} pairs: too few for {world} rank(s) after "
                              f"holding out {self.n_eval}; curate more pairs")
        self.eval_idx = list(range(len(self.pairs) - self.n_eval, len(self.pairs)))
        self.can_evaluate = self.n_eval > 0
        self.stream = PairStream(self.pairs, train_idx, cfg, cfg.train.seed + 1000 * rank)
        self.totals = {"pairs": 0}
        self.reference: GPT | None = None
        self._interval = self._fresh_interval()

    def describe(self) -> str:
        return (f"dpo: {len(self.pairs)} pairs ({self.n_eval} held out) from {self.source}; beta {self.cfg.dpo.beta}; "
                f"{'packed' if self.cfg.dpo.packed else 'padded'} rows of {self.cfg.data.seq_len}")

    def init_model(self, model: GPT) -> None:
        """Load dpo.init_from into the policy; the frozen reference is a copy of the initial policy."""
        if self.cfg.dpo.init_from:
            state = load_checkpoint(Path(self.cfg.dpo.init_from), what="dpo.init_from")
            model.load_state_dict(state.get("model", state))
        self.reference = copy.deepcopy(model).eval()
        for p in self.reference.parameters():
            p.requires_grad_(False)

    def start(self, model: GPT) -> None:
        self._interval = self._fresh_interval()

    @staticmethod
    def _fresh_interval() -> dict[str, float]:
        return {"loss": 0.0, "margin": 0.0, "correct": 0.0, "pairs": 0, "tokens": 0, "slots": 0, "all_pairs": 0}

    def next_step(self) -> list[tuple[dict, int]]:
        return [next(self.stream) for _ in range(self.cfg.train.grad_accum)]

    def backward(self, model: torch.nn.Module, micro: list[tuple[dict, int]]) -> torch.Tensor:
        count = torch.tensor(float(sum(n for _, n in micro)), device=self.device)
        if self.world > 1:
            dist.all_reduce(count)  # pairs in this step, all ranks
        stats = backward_step(model, self.reference, micro, count, self.world, self.cfg.dpo.beta, self.device)
        tokens = sum(int((b["resp_id"] >= 0).sum()) for b, _ in micro)  # response tokens (slots: all row tokens)
        slots = sum(b["input_ids"].numel() for b, _ in micro)
        return torch.cat([stats, torch.tensor([tokens, slots], device=self.device, dtype=torch.float64)])

    def step_loss(self, sums: torch.Tensor) -> float:
        return float(sums[0] / sums[3].clamp(min=1))

    def add(self, sums: torch.Tensor, ok: bool) -> None:
        iv = self._interval
        pairs = int(sums[3])
        self.totals["pairs"] += pairs
        iv["all_pairs"] += pairs
        iv["tokens"] += int(sums[4])
        iv["slots"] += int(sums[5])
        if ok:
            iv["loss"] += float(sums[0])
            iv["margin"] += float(sums[1])
            iv["correct"] += float(sums[2])
            iv["pairs"] += pairs

    def log_fields(self, seconds: float) -> dict[str, Any]:
        iv, n = self._interval, max(self._interval["pairs"], 1)
        rec = {"loss": iv["loss"] / n, "reward_margin": iv["margin"] / n, "pref_accuracy": iv["correct"] / n,
               "pairs": self.totals["pairs"], "pairs_per_s": iv["all_pairs"] / seconds,
               "response_tokens": iv["tokens"], "slots": iv["slots"]}
        self._interval = self._fresh_interval()
        return rec

    def log_text(self, record: dict[str, Any]) -> str:
        return (f"dpo loss {record['loss']:.4f} | margin {record['reward_margin']:+.3f} | "
                f"acc {record['pref_accuracy']:.3f} | {record['pairs_per_s']:,.1f} pairs/s")

    def evaluate(self, model: GPT) -> dict[str, Any]:
        return evaluate_pairs(model, self.reference, self.pairs, self.eval_idx, self.cfg, self.device)

    def eval_text(self, record: dict[str, Any]) -> str:
        return f"eval acc {record['eval_pref_accuracy']:.3f} (margin {record['eval_reward_margin']:+.3f})"

    def rank_state(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_rank_state(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)

    def summary(self, record: dict[str, Any]) -> dict[str, Any]:
        return {"pairs": self.totals["pairs"],
                **{k: v for k, v in record.items()
                   if k in ("reward_margin", "pref_accuracy", "eval_pref_accuracy", "eval_reward_margin", "eval_loss")}}

    def close(self) -> None:
        pass


@torch.no_grad()
def evaluate_pairs(policy: GPT, reference: GPT, pairs: Sequence[Pair], idx: list[int], cfg: TrainConfig,
                   device: torch.device) -> dict[str, float]:
    """Reward margin, preference accuracy and DPO loss over the held-out pairs `idx`."""
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
