"""The next-token objective (train.objective: lm): packed text shards through the loader and the prefetcher.

Loss. The step's loss is the mean token loss over every real token (labels != -100) of the step:
all its micro-batches on all ranks. The step's micro-batches are read first, their real tokens
counted and all-reduced over ranks; each micro-batch's backward is then of (sum of its token losses) /
that count, times world_size because DDP averages gradients over ranks. So a token weighs the same
whatever micro-batch or rank it lands in (a per-micro-batch mean would weight a token of a short
micro-batch more). Per-document mean losses of each micro-batch go to `loader.report_losses` (the
loader is thread-safe; it keeps them in its state for prioritization and online mixing).

Held-out data. The loader reads a whole curated folder and cannot exclude shards, so evaluation
reads `data.eval_source` (another curated folder), or the eval split curated with the source
(`SOURCE/eval`, named by its manifest), or, with `data.holdout_shards: N`, the last N shards of `data.source`: the trainer then writes two derived folders under
`RUN_DIR/data/{train,eval}` holding a manifest restricted to their shards and symbolic links to
the shard files, and trains on the first. (Local sources only; use `eval_source` for URLs.)

Checkpoint state per rank: the loader state of the batch last trained on (not of the prefetched
ones), with the loss feedback reported so far: `loader.state_dict(position=prefetcher.state)`.

RHO-LOSS selection (`train.rho.enabled`; Mindermann et al. 2022, "Prioritized Training on Points that
are Learnable, Worth Learning, and Not Yet Learnt"). The source must carry each document's
irreducible loss, the mean token loss of a reference model that did not train on it (`train.rho.column`,
default `ref_loss`, written by `datapipe score`: datapipe/train/reference.py). The loader then serves
`train.rho.candidates` x `data.batch_size` rows per micro-batch, with the column per token; each
micro-batch's rows go through a forward pass without gradients (in chunks of data.batch_size rows,
so memory is a training batch's), each row's reducible loss is the mean over its label tokens of
(token loss - its document's ref_loss), and the data.batch_size rows with the highest are trained on
(ties: the earlier row), in the loader's order. The loader position, and so a resume, covers every
candidate row consumed. The extra compute is counted: `tokens_forwarded` (log records and summary)
is the document tokens of all candidate rows forwarded for selection; `tokens` stays the document
tokens trained on (which are forwarded once more, with gradients).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader import PackedLoader
from datapipe.loader.packing import IGNORE_INDEX, select_rows
from datapipe.train.config import TrainConfig
from datapipe.train.model import GPT, token_losses
from datapipe.train.objective import autocast, sync_unless
from datapipe.train.prefetch import Prefetcher


def loader_verify(cfg: TrainConfig) -> bool | str:
    """The loader's `verify` for `data.verify`: 'cached' is the loader's default (True), 'always' itself."""
    return True if cfg.data.verify == "cached" else cfg.data.verify


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


def backward_step(model: torch.nn.Module, micro: list[dict[str, torch.Tensor]], count: torch.Tensor, world: int,
                  device: torch.device, report: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Backward of one step's micro-batches: the gradient of (sum of token losses) / count, count = the real tokens
    (labels != -100) of the step over all micro-batches and ranks. `report(doc_ids, mean losses)` gets each
    micro-batch's per-document losses. Returns this rank's (loss sum, real tokens, document tokens) in float64."""
    sums = torch.zeros(3, device=device, dtype=torch.float64)
    for k, batch in enumerate(micro):
        labels, doc_ids = batch["labels"], batch["doc_ids"]
        with sync_unless(model, k == len(micro) - 1):
            with autocast(device):
                logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=doc_ids,
                               cu_seqlens=batch["cu_seqlens"])
            tl = token_losses(logits, labels)
            (tl.sum() * world / count).backward()  # DDP averages over ranks: this gives sum / all tokens
        mask = labels != -100
        sums += torch.stack([tl.detach().sum().double(), mask.sum().double(), (doc_ids >= 0).sum().double()])
        if report is not None:  # per-document mean loss of this micro-batch
            ids, inverse = torch.unique(doc_ids[mask], return_inverse=True)
            per_doc = torch.zeros(len(ids), device=tl.device).scatter_add_(0, inverse, tl.detach()[mask].float())
            per_doc /= torch.bincount(inverse, minlength=len(ids)).clamp(min=1)
            report(ids.cpu(), per_doc.cpu())
    return sums


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
                              rank=rank, world_size=world, mixture={domain: 1.0}, shuffle=False,
                              verify=loader_verify(cfg))
        for _, batch in zip(range(cfg.data.eval_batches), loader):
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast(device):
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


@torch.no_grad()
def select_reducible(model: torch.nn.Module, batch: dict[str, torch.Tensor], keep: int, column: str,
                     device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """RHO-LOSS: the `keep` rows of `batch` with the highest reducible loss, as a batch in the loader's row order,
    and each row's reducible loss. A row's reducible loss is the mean over its label tokens of (token loss -
    batch[column]); a row without label tokens gets -inf. The forward runs in chunks of `keep` rows."""
    n = batch["input_ids"].shape[0]
    scores = []
    for start in range(0, n, keep):
        chunk = select_rows(batch, torch.arange(start, min(start + keep, n), device=batch["input_ids"].device))
        with autocast(device):
            logits = model(chunk["input_ids"], position_ids=chunk["position_ids"], doc_ids=chunk["doc_ids"],
                           cu_seqlens=chunk["cu_seqlens"])
        mask = chunk["labels"] != IGNORE_INDEX
        reducible = ((token_losses(logits, chunk["labels"]) - chunk[column].float()) * mask).sum(1)
        count = mask.sum(1)
        scores.append(torch.where(count > 0, reducible / count.clamp(min=1), float("-inf")))
    scores = torch.cat(scores)
    order = torch.sort(scores, descending=True, stable=True).indices[:keep]
    return select_rows(batch, order.sort().values), scores


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU, for MFU; None when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40", 181e12), ("A10", 125e12),
                       ("4090", 165e12), ("3090", 71e12), ("V100", 125e12)):
        if key in name:
            return flops
    return None


class LMObjective:
    """Next-token loss on curated text shards (see the module docstring)."""

    name = "lm"
    state_key = "loaders"

    def __init__(self, cfg: TrainConfig, run_dir: Path, *, rank: int, world: int, device: torch.device) -> None:
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        source, eval_source = cfg.data.source, cfg.data.eval_source  # checked by train.config.check_sources
        manifest = shards.read_manifest(source)
        if not eval_source and not cfg.data.holdout_shards:  # the eval split curated with the source, if any
            eval_source = shards.split_source(source, "eval", manifest)
        if cfg.data.holdout_shards:
            if rank == 0:
                split_holdout(source, cfg.data.holdout_shards, run_dir)
            if world > 1:
                dist.barrier()
            source, eval_source = str(run_dir / "data" / "train"), str(run_dir / "data" / "eval")
        vocab = cfg.model.vocab_size or manifest.get("tokenizer", {}).get("vocab_size")
        if not isinstance(vocab, int):
            raise ConfigError(f"model.vocab_size is null and {source}/manifest.json names no tokenizer vocab_size; "
                              "set model.vocab_size")
        self.source, self.eval_source, self.vocab_size = source, eval_source, vocab
        self.can_evaluate = bool(eval_source)
        self.rho = cfg.train.rho if cfg.train.rho.enabled else None
        rows = cfg.data.batch_size * (self.rho.candidates if self.rho else 1)  # RHO-LOSS: the candidate rows
        try:
            self.loader = PackedLoader(source, seq_len=cfg.data.seq_len, batch_size=rows, seed=cfg.train.seed,
                                       epochs=None, rank=rank, world_size=world, num_workers=cfg.data.num_workers,
                                       prioritize=cfg.data.prioritize.build(), online_mixing=cfg.data.online_mixing.build(),
                                       doc_columns=(self.rho.column,) if self.rho else (), verify=loader_verify(cfg))
        except ConfigError as exc:
            if self.rho and "doc_columns" in str(exc):  # say it in the trainer's keys
                raise ConfigError(f"train.rho.enabled reads each document's train.rho.column={self.rho.column!r} "
                                  f"from data.source {cfg.data.source!r}: {exc}") from None
            raise
        self.totals = {"tokens": 0}  # document tokens of the batches trained on, all ranks
        if self.rho:
            self.totals["tokens_forwarded"] = 0  # document tokens of the candidate rows forwarded for selection
        self.pf: Prefetcher | None = None
        self._interval = self._fresh_interval()

    def describe(self) -> str:
        c = self.cfg
        return (f"lm: {c.data.batch_size * c.data.seq_len * c.train.grad_accum * self.world:,} tokens/step from "
                f"{self.source}" + (f"; eval on {self.eval_source}" if self.eval_source else "")
                + (f"; RHO-LOSS: the top {c.data.batch_size} of {c.data.batch_size * self.rho.candidates} rows by "
                   f"reducible loss (column {self.rho.column})" if self.rho else ""))

    def init_model(self, model: GPT) -> None:
        pass

    def start(self, model: GPT) -> None:
        self._flops_per_token = model.flops_per_token(self.cfg.data.seq_len)  # for MFU
        self._peak = peak_flops(self.device)
        self.pf = Prefetcher(self.loader, depth=self.cfg.prefetch.depth, device=self.device,
                             enabled=self.cfg.prefetch.enabled, state_fn=self.loader.position,
                             delay_s=self.cfg.prefetch.delay_s)
        self._batches = iter(self.pf)
        self._interval = self._fresh_interval()

    def _fresh_interval(self) -> dict[str, float]:
        return {"loss": 0.0, "ok": 0, "tokens": 0, "forwarded": 0, "wait": self.pf.wait_seconds if self.pf else 0.0}

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        return [next(self._batches) for _ in range(self.cfg.train.grad_accum)]

    def backward(self, model: torch.nn.Module, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The step's backward; returns (loss sum, real tokens, document tokens trained, document tokens forwarded
        for RHO-LOSS selection)."""
        forwarded = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.rho:
            scorer = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
            for b in micro:
                forwarded += (b["doc_ids"] >= 0).sum().double()
            micro = [select_reducible(scorer, b, self.cfg.data.batch_size, self.rho.column, self.device)[0]
                     for b in micro]
        count = sum((b["labels"] != -100).sum() for b in micro).to(torch.float32)
        if self.world > 1:
            dist.all_reduce(count)  # real tokens of this step, all ranks
        sums = backward_step(model, micro, count.clamp(min=1), self.world, self.device, report=self.loader.report_losses)
        return torch.cat([sums, forwarded])

    def step_loss(self, sums: torch.Tensor) -> float:
        return float(sums[0] / sums[1].clamp(min=1))

    def add(self, sums: torch.Tensor, ok: bool) -> None:
        tokens, forwarded = int(sums[2]), int(sums[3])
        self.totals["tokens"] += tokens
        self._interval["tokens"] += tokens
        if self.rho:
            self.totals["tokens_forwarded"] += forwarded
            self._interval["forwarded"] += forwarded
        if ok:
            self._interval["loss"] += self.step_loss(sums)
            self._interval["ok"] += 1

    def log_fields(self, seconds: float) -> dict[str, Any]:
        iv = self._interval
        rec = {"loss": iv["loss"] / max(iv["ok"], 1), "tokens_per_s": iv["tokens"] / seconds,
               "data_wait_frac": (self.pf.wait_seconds - iv["wait"]) / seconds, "tokens": self.totals["tokens"]}
        if self.rho:
            rec["tokens_forwarded"] = self.totals["tokens_forwarded"]
        if self._peak:  # a forward without gradients costs a third of a training step's FLOPs per token
            flops = self._flops_per_token * (iv["tokens"] + iv["forwarded"] / 3) / seconds
            rec["mfu"] = flops / (self._peak * self.world)
        self._interval = self._fresh_interval()
        return rec

    def log_text(self, record: dict[str, Any]) -> str:
        return (f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"data wait {100 * record['data_wait_frac']:.1f}%" + (f" | mfu {100 * record['mfu']:.1f}%" if "mfu" in record else "")
                + (f" | trained {record['tokens']:,} of {record['tokens_forwarded']:,} tokens forwarded"
                   if "tokens_forwarded" in record else ""))

    def evaluate(self, model: GPT) -> dict[str, Any]:
        return evaluate(model, self.eval_source, self.cfg, self.device, self.rank, self.world)

    def eval_text(self, record: dict[str, Any]) -> str:
        return f"eval {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.1f})"

    def rank_state(self) -> dict[str, Any]:
        # the position of the batch last trained on, with the loss feedback reported up to now
        return self.loader.state_dict(position=self.pf.state)

    def load_rank_state(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def summary(self, record: dict[str, Any]) -> dict[str, Any]:
        return {"data_wait_s": self.pf.wait_seconds if self.pf else 0.0, **self.totals,
                **{k: v for k, v in record.items() if k.startswith("eval")}}

    def close(self) -> None:
        if self.pf is not None:
            self.pf.close()
