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

Evaluation (`evaluate`). Every eval document is read once per evaluation (epochs=1, no shuffle, no
cycling), packed as training packs; every label token is scored once. The overall `eval_loss` is the
token-weighted mean over the split (sum of token losses / label tokens, i.e. the per-domain losses weighted
by their tokens in the eval split, whose per-domain cap (`eval.max_tokens_per_domain`) can weigh a small domain
far more than the training data does) or, with `data.eval_target` {domain: weight},
that mixture of the per-domain losses; the record says which (`eval_weighting`) and always carries
`eval_loss_tokens`, `eval_loss_domain_mean` (plain mean over domains) and `eval_domains` (loss, ppl, label
tokens). `data.eval_batches` > 0 caps the batches (the domains come interleaved at their token shares in one
fixed order, so a cap reads the same part on every run; `eval_capped` says so). With several ranks the
ranks' parts partition the split and their sums are all-reduced.

Compute (`LMObjective.compute`, in every log and eval record and the summary, cumulative over resumes):
`flops` = 6N x `tokens_trained` + 2N x `tokens_forwarded_only`, N = `flops_params(model)` (the parameters
a token's forward multiplies by: blocks, final norm, output projection; not the input-embedding lookup;
attention-score FLOPs left out). `tokens_forwarded_only` sums `forward_only_tokens`, which code that
forwards rows without training on them increments (RHO's selection forward). `eval_flops` = 2N x the
document tokens evaluations forwarded (not training compute). `tokens_read`: document tokens of every row
the loader delivered (RHO's candidates included). `distinct_tokens`: tokens of the distinct pieces among
them, a piece being a document or one seq_len chunk of a longer one and two pieces with the same tokens
counting once (a 64-bit hash of token ids and positions; repeated epochs and exact copies count once; rank 0
holds every rank's set, gathered at each log). `wall_s`: training-loop time (steps, data waits,
checkpoints) plus evaluations (`eval_s`), summed over resumes; set-up is left out.

Checkpoint state per rank: the loader state of the batch last trained on (not of the prefetched
ones), with the loss feedback reported so far: `loader.state_dict(position=prefetcher.state)`, and
`lm_counters` (this rank's `forward_only_tokens`, distinct-piece keys and those not yet gathered).

RHO-LOSS selection (`train.rho.enabled`; Mindermann et al. 2022, "Prioritized Training on Points that
are Learnable, Worth Learning, and Not Yet Learnt"). The source must carry each token's irreducible
loss, its loss under a reference model that did not train on its document (`train.rho.column`, default
`ref_loss`, a list per document as long as its tokens, written by `datapipe score`:
datapipe/train/reference.py). The loader serves `train.rho.candidates` x `data.batch_size` rows per
micro-batch, the column carried per token (a piece of a long document gets its own tokens' values), and
`data.batch_size` of them are trained on, in the loader's order:
- `train.rho.selection: forward` (the paper): the candidate rows go through a forward pass without
  gradients (in chunks of data.batch_size rows, so memory is a training batch's); a row's reducible loss
  is the mean over its label tokens of (token loss - that token's ref_loss). Every candidate token is
  counted in `forward_only_tokens` (2N FLOPs each; the selected rows are forwarded again, with gradients,
  and counted as trained).
- `train.rho.selection: last_loss`: no forward. A row's score is the mean over its label tokens of its
  documents' remembered reducible losses: the trainer reports each trained document's mean (token loss -
  ref_loss) to the loader, whose loss memory (an EMA per document, part of its state) keeps it; a document
  never trained on gets the mean of the remembered values, so in a first pass over the data most rows tie
  and the earlier ones are taken. It pays off when documents come back (epochs, long documents' pieces).
The rows are taken by descending score (ties: the earlier row), at most `train.rho.max_rows_per_doc` of them
holding a piece of one document (`top_rows`). The loader position, and so a resume, covers every candidate
row consumed. `tokens_forwarded` (log records and summary) is the document tokens of the candidate rows
forwarded for selection (0 with last_loss); `tokens` stays the document tokens trained on, `tokens_read` every
candidate token the loader served.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np
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


def eval_weights(target: Mapping[str, float] | None, domains: Sequence[str], source: str,
                 key: str = "data.eval_target") -> dict[str, float] | None:
    """The target mixture normalized over `domains` (the eval source's; one it does not name weighs 0), or None for
    token weighting. A named domain the eval source lacks is a ConfigError naming `key`."""
    if target is None:
        return None
    unknown = sorted(set(target) - set(domains))
    if unknown:
        raise ConfigError(f"{key} names domain(s) {unknown} that the eval source {source!r} lacks; its domains are "
                          f"{sorted(domains)}")
    total = sum(target.values())
    return {d: target.get(d, 0.0) / total for d in domains}


@torch.no_grad()
def evaluate(model: GPT, source: str, cfg: TrainConfig, device: torch.device, rank: int, world: int,
             target: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Mean token loss of `model` on the eval source, overall and per domain.

    What is read: the whole source once (`epochs=1`, no shuffle, no cycling), packed as training packs
    (data.seq_len rows, data.batch_size rows a batch, long documents split into seq_len chunks whose last token
    predicts the next chunk's first), the ranks' parts partitioning it. Every label token (every token of a
    document but its last) is scored once. The domains are interleaved at their token shares in one fixed
    order, so `data.eval_batches` (> 0: a cap on this rank's batches) reads the same leading part on every run,
    each domain in proportion to its tokens; `eval_capped` says whether the cap cut the split short.

    The overall `eval_loss`: with `target` None, the token-weighted mean over the split (sum of token losses /
    label tokens, = the per-domain losses weighted by their tokens: `eval_weighting: "tokens"`); with a target
    mixture {domain: weight} (normalized; a domain it does not name weighs 0), sum_d w_d loss_d
    (`eval_weighting: "target"`; a domain with no token evaluated, under a cap, is left out and the others
    renormalized). `eval_loss_tokens` and `eval_loss_domain_mean` (the plain mean over the domains evaluated) are
    reported either way, beside `eval_domains` (every domain of the source: loss, ppl, label tokens; loss and ppl
    null for a domain a cap left unread) and `eval_tokens` (label tokens scored)
    and `eval_tokens_forwarded` (document tokens forwarded: for FLOPs)."""
    loader = PackedLoader(source, seq_len=cfg.data.seq_len, batch_size=cfg.data.batch_size, seed=0, epochs=1,
                          rank=rank, world_size=world, shuffle=False, verify=loader_verify(cfg))
    domains = list(loader.domains)
    weights = eval_weights(target, domains, source)
    # per domain: (loss sum, label tokens, document tokens forwarded); the extra row: (capped, 0, 0)
    sums = torch.zeros(len(domains) + 1, 3, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    cap, n = cfg.data.eval_batches, 0
    for batch in loader:
        if cap and n == cap:  # one batch beyond the cap was planned: the cap cut the split short
            sums[-1, 0] = 1
            break
        n += 1
        dom = torch.from_numpy(loader.doc_domains(batch["doc_ids"])).to(device)
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(device):
            logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"],
                           cu_seqlens=batch["cu_seqlens"])
        tl = token_losses(logits, batch["labels"])
        mask = batch["labels"] != IGNORE_INDEX
        sums[:, 0].index_add_(0, dom[mask], tl[mask].double())
        sums[:, 1].index_add_(0, dom[mask], torch.ones_like(tl[mask], dtype=torch.float64))
        real = dom >= 0
        sums[:, 2].index_add_(0, dom[real], torch.ones_like(dom[real], dtype=torch.float64))
    model.train(was_training)
    if world > 1:
        dist.all_reduce(sums)
    sums = sums.cpu()
    per = {d: float(sums[i, 0] / sums[i, 1]) for i, d in enumerate(domains) if sums[i, 1] > 0}
    tokens_mean = float(sums[:-1, 0].sum() / sums[:-1, 1].sum().clamp(min=1))
    domain_mean = sum(per.values()) / len(per) if per else float("nan")
    if weights is None:
        total = tokens_mean
    else:
        mass = sum(weights[d] for d in per)
        total = sum(weights[d] * v for d, v in per.items()) / mass if mass > 0 else float("nan")
    return {"eval_loss": total, "eval_ppl": math.exp(min(total, 50)),
            "eval_weighting": "tokens" if weights is None else "target",
            "eval_loss_tokens": tokens_mean, "eval_loss_domain_mean": domain_mean,
            **({"eval_target": weights} if weights is not None else {}),
            "eval_tokens": int(sums[:-1, 1].sum()), "eval_tokens_forwarded": int(sums[:-1, 2].sum()),
            "eval_capped": bool(sums[-1, 0] > 0),
            "eval_domains": {d: ({"loss": per[d], "ppl": math.exp(min(per[d], 50)), "tokens": int(sums[i, 1])} if d in per
                                 else {"loss": None, "ppl": None, "tokens": 0}) for i, d in enumerate(domains)}}


def top_rows(scores: torch.Tensor, doc_ids: torch.Tensor, keep: int, max_rows_per_doc: int = 0) -> torch.Tensor:
    """The indices (ascending: the loader's row order) of the `keep` rows of highest score, at most
    `max_rows_per_doc` of them holding a piece of any one document (0: no cap). Rows are taken in descending score
    (ties: the earlier row); a row that would put a document over the cap is passed over, and when the cap leaves
    fewer than `keep` rows, the best rows passed over fill in (in score order). Deterministic."""
    order = torch.sort(scores, descending=True, stable=True).indices
    if max_rows_per_doc <= 0:
        return order[:keep].sort().values
    docs = doc_ids.detach().cpu().numpy()
    counts: dict[int, int] = {}
    chosen: list[int] = []
    passed: list[int] = []
    for i in order.tolist():
        row = np.unique(docs[i])
        row = row[row >= 0].tolist()
        if all(counts.get(d, 0) < max_rows_per_doc for d in row):
            chosen.append(i)
            for d in row:
                counts[d] = counts.get(d, 0) + 1
            if len(chosen) == keep:
                break
        else:
            passed.append(i)
    chosen += passed[:keep - len(chosen)]
    return torch.tensor(sorted(chosen), dtype=torch.int64, device=scores.device)


@torch.no_grad()
def select_reducible(model: torch.nn.Module, batch: dict[str, torch.Tensor], keep: int, column: str,
                     device: torch.device, max_rows_per_doc: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """RHO-LOSS: the `keep` rows of `batch` with the highest reducible loss, as a batch in the loader's row order,
    and each row's reducible loss. A row's reducible loss is the mean over its label tokens of (token loss -
    batch[column]), batch[column] being each token's own reference loss (the loader's token column); a row without
    label tokens gets -inf. The forward runs in chunks of `keep` rows. `max_rows_per_doc`: see `top_rows`."""
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
    return select_rows(batch, top_rows(scores, batch["doc_ids"], keep, max_rows_per_doc)), scores


def remembered_scores(batch: dict[str, torch.Tensor], memory: Mapping[int, float],
                      prior: float | None = None) -> torch.Tensor:
    """RHO-LOSS without a forward (`train.rho.selection: last_loss`): each row's score is the mean over its label
    tokens of its document's remembered reducible loss (`memory`: document -> the reducible loss its rows had when
    last trained on, an EMA); a document not in `memory` gets `prior` (None: the mean of the remembered values, 0
    when there are none). A row without label tokens gets -inf."""
    if prior is None:
        prior = float(np.mean(list(memory.values()))) if memory else 0.0
    docs, inverse = torch.unique(batch["doc_ids"], return_inverse=True)
    values = torch.tensor([memory.get(int(d), prior) for d in docs.tolist()], dtype=torch.float64)
    mask = (batch["labels"] != IGNORE_INDEX).cpu()
    per_token = values[inverse.cpu()] * mask
    count = mask.sum(1)
    return torch.where(count > 0, per_token.sum(1) / count.clamp(min=1), float("-inf"))


def reducible_reporter(micro: list[dict[str, torch.Tensor]], column: str,
                       report: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A `backward_step` reporter that reports reducible losses: `backward_step` hands it each micro-batch's
    per-document mean token loss in order; this subtracts the same tokens' mean reference loss (batch[column]) and
    passes (documents, mean reducible loss) to `report`."""
    refs = []
    for b in micro:
        mask = b["labels"] != IGNORE_INDEX
        ids, inverse = torch.unique(b["doc_ids"][mask], return_inverse=True)
        ref = torch.zeros(len(ids), device=mask.device).scatter_add_(0, inverse, b[column][mask].float())
        refs.append((ref / torch.bincount(inverse, minlength=len(ids)).clamp(min=1)).cpu())
    pending = iter(refs)

    def reporter(ids: torch.Tensor, losses: torch.Tensor) -> None:
        report(ids, losses - next(pending))

    return reporter


def flops_params(model: GPT) -> int:
    """N of every FLOP count (training, forward-only, evaluation, reference models): the parameters a token's forward
    multiplies by, i.e. every transformer block, the final norm and the output projection, but not the input
    embedding (a lookup); with tied embeddings the shared matrix counts once, as the output projection. A token costs
    6N FLOPs trained (forward + backward) and 2N forwarded only; the attention scores (12·L·d·S a token trained,
    the same for every arm at one seq_len) are left out."""
    return model.num_params(non_embedding=True) + (model.head.weight.numel() if model.cfg.tie_embeddings else 0)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def piece_keys(batch: dict[str, torch.Tensor], weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key, tokens) of each document piece (attention segment) of a batch, padding left out. The key is a 64-bit
    hash of the piece's token ids at their positions (`weights[position]`, random odd integers), mixed with its
    length: two pieces with the same tokens share a key. Keys are int64 (the uint64 hash's bits)."""
    ids = batch["input_ids"].reshape(-1).cpu().numpy().astype(np.uint64)
    docs = batch["doc_ids"].reshape(-1).cpu().numpy()
    cu = batch["cu_seqlens"].cpu().numpy().astype(np.int64)
    lens = np.diff(cu)
    pos = np.arange(ids.size, dtype=np.int64) - np.repeat(cu[:-1], lens)
    summed = np.zeros(ids.size + 1, dtype=np.uint64)
    np.cumsum((ids + np.uint64(1)) * weights[pos % len(weights)], out=summed[1:])  # uint64 wraps: a hash mod 2^64
    keys = (summed[cu[1:]] - summed[cu[:-1]]) ^ (lens.astype(np.uint64) * _GOLDEN)
    real = (lens > 0) & (docs[np.minimum(cu[:-1], max(ids.size - 1, 0))] >= 0)
    return keys[real].view(np.int64), lens[real]


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
        if cfg.data.eval_target is not None:  # the named domains exist in the eval source, before any training
            if not eval_source:
                raise ConfigError("data.eval_target weights the eval loss's domains, but this run has no eval data: "
                                  "set data.eval_source (or curate the source with an eval split)")
            eval_domains = sorted(d for d, c in shards.read_manifest(eval_source).get("domains", {}).items()
                                  if c.get("docs", 0) > 0)
            eval_weights(cfg.data.eval_target, eval_domains, eval_source)
        self.rho = cfg.train.rho if cfg.train.rho.enabled else None
        rows = cfg.data.batch_size * (self.rho.candidates if self.rho else 1)  # RHO-LOSS: the candidate rows
        try:
            self.loader = PackedLoader(source, seq_len=cfg.data.seq_len, batch_size=rows, seed=cfg.train.seed,
                                       epochs=None, rank=rank, world_size=world, num_workers=cfg.data.num_workers,
                                       prioritize=cfg.data.prioritize.build(), online_mixing=cfg.data.online_mixing.build(),
                                       token_columns=(self.rho.column,) if self.rho else (), mixture=cfg.data.mixture,
                                       verify=loader_verify(cfg))
        except ConfigError as exc:
            if self.rho and "token_columns" in str(exc):  # say it in the trainer's keys
                raise ConfigError(f"train.rho.enabled reads each token's train.rho.column={self.rho.column!r} "
                                  f"from data.source {cfg.data.source!r}: {exc}") from None
            raise
        # cumulative over the run and its resumes, all ranks (saved in the checkpoint): document tokens trained on
        # (forward + backward), forwarded without a backward (RHO's selection forward), delivered by the loader (every
        # row, RHO's candidates included), of the distinct pieces delivered (rank 0's count), forwarded by
        # evaluations; milliseconds of training-loop time (steps, data waits, checkpoints) and of evaluations
        self.totals = {"tokens": 0, "tokens_forwarded_only": 0, "tokens_read": 0, "distinct_tokens": 0,
                       "eval_tokens_forwarded": 0, "train_ms": 0, "eval_ms": 0}
        if self.rho:
            self.totals["tokens_forwarded"] = 0  # document tokens of the candidate rows forwarded for selection
        # This rank's document tokens forwarded without a backward (outside evaluation), cumulative: code that
        # forwards rows it does not train on adds them here (`self.forward_only_tokens += n`, anywhere in a step, in
        # backward or before it); each step's increase is summed over ranks into totals["tokens_forwarded_only"]
        # (2N FLOPs a token). Kept in the checkpoint (rank_state).
        self.forward_only_tokens = 0
        self._forward_only_counted = 0  # the part of it already in a step's sums
        # distinct pieces: keys seen (rank 0 holds every rank's, merged at each log) and this rank's not yet merged
        self._hash_weights = np.random.default_rng(0).integers(0, 2**63, size=cfg.data.seq_len, dtype=np.uint64) * \
            np.uint64(2) + np.uint64(1)
        self._pieces: set[int] = set()
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._read = 0  # document tokens delivered for the step being read (this rank)
        self._n_flops = 0
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
        self._n_flops = flops_params(model)  # N of the FLOP counts
        self._peak = peak_flops(self.device)
        self.pf = Prefetcher(self.loader, depth=self.cfg.prefetch.depth, device=self.device,
                             enabled=self.cfg.prefetch.enabled, state_fn=self.loader.position,
                             delay_s=self.cfg.prefetch.delay_s)
        self._batches = iter(self.pf)
        self._interval = self._fresh_interval()

    def _fresh_interval(self) -> dict[str, float]:
        return {"loss": 0.0, "ok": 0, "tokens": 0, "forwarded": 0, "wait": self.pf.wait_seconds if self.pf else 0.0}

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        micro = [next(self._batches) for _ in range(self.cfg.train.grad_accum)]
        self._read = 0
        for batch in micro:  # every row delivered, before any selection
            keys, lens = piece_keys(batch, self._hash_weights)
            self._pending.append((keys, lens))
            self._read += int(lens.sum())
        return micro

    def _pending_pieces(self) -> tuple[np.ndarray, np.ndarray]:
        """(keys, token counts) of this rank's pieces delivered since the last merge."""
        if not self._pending:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate([k for k, _ in self._pending]), np.concatenate([n for _, n in self._pending])

    def _merge_pieces(self) -> None:
        """Rank 0 adds every rank's pieces delivered since the last merge to the distinct set (a collective)."""
        keys, lens = self._pending_pieces()
        self._pending = []
        parts = [(keys.tolist(), lens.tolist())]
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            dist.all_gather_object(gathered, parts[0])
            parts = gathered
        if self.rank != 0:
            return
        for ks, ns in parts:
            for k, n in zip(ks, ns):
                if k not in self._pieces:
                    self._pieces.add(k)
                    self.totals["distinct_tokens"] += n

    def compute(self) -> dict[str, Any]:
        """The run's cumulative compute so far (the fields every log and eval record carries): FLOPs of training
        (6N a token trained + 2N a token forwarded only; N: `flops_params`), and of the evaluations apart."""
        t, n = self.totals, self._n_flops
        return {"tokens": t["tokens"], "tokens_trained": t["tokens"], "tokens_forwarded_only": t["tokens_forwarded_only"],
                "flops": 6 * n * t["tokens"] + 2 * n * t["tokens_forwarded_only"], "tokens_read": t["tokens_read"],
                "distinct_tokens": t["distinct_tokens"], "eval_flops": 2 * n * t["eval_tokens_forwarded"],
                "wall_s": (t["train_ms"] + t["eval_ms"]) / 1000, "eval_s": t["eval_ms"] / 1000}

    def backward(self, model: torch.nn.Module, micro: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The step's backward; returns (loss sum, real tokens, document tokens trained, document tokens forwarded
        only (the increase of `forward_only_tokens` since the last step's sums), document tokens delivered)."""
        report = self.loader.report_losses
        if self.rho:
            micro, report = self._select(model, micro)
        count = sum((b["labels"] != -100).sum() for b in micro).to(torch.float32)
        if self.world > 1:
            dist.all_reduce(count)  # real tokens of this step, all ranks
        sums = backward_step(model, micro, count.clamp(min=1), self.world, self.device, report=report)
        extra = [float(self.forward_only_tokens - self._forward_only_counted), float(self._read)]
        self._forward_only_counted = self.forward_only_tokens
        return torch.cat([sums, torch.tensor(extra, dtype=torch.float64, device=self.device)])

    def _select(self, model: torch.nn.Module, micro: list[dict[str, torch.Tensor]]) -> tuple[
            list[dict[str, torch.Tensor]], Callable[[torch.Tensor, torch.Tensor], None]]:
        """RHO-LOSS (train.rho): each micro-batch's data.batch_size rows to train on, and the loss reporter.
        'forward': a forward of every candidate row without gradients, all counted in `forward_only_tokens` (the
        training step forwards the selected rows again, with gradients); raw losses are reported, as without RHO.
        'last_loss': no forward; rows are scored by their documents' remembered reducible losses (the loader's loss
        memory, part of its state: resume stays exact), and reducible losses are what is reported."""
        keep, rho = self.cfg.data.batch_size, self.rho
        if rho.selection == "last_loss":
            memory = self.loader.losses()
            micro = [select_rows(b, top_rows(remembered_scores(b, memory), b["doc_ids"], keep,
                                             rho.max_rows_per_doc)) for b in micro]
            return micro, reducible_reporter(micro, rho.column, self.loader.report_losses)
        scorer = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        for b in micro:  # the selection forward of every candidate row, without a backward
            self.forward_only_tokens += int((b["doc_ids"] >= 0).sum())
        micro = [select_reducible(scorer, b, keep, rho.column, self.device, rho.max_rows_per_doc)[0] for b in micro]
        return micro, self.loader.report_losses

    def step_loss(self, sums: torch.Tensor) -> float:
        return float(sums[0] / sums[1].clamp(min=1))

    def add(self, sums: torch.Tensor, ok: bool) -> None:
        tokens, forwarded = int(sums[2]), int(sums[3])
        self.totals["tokens"] += tokens
        self.totals["tokens_forwarded_only"] += forwarded
        self.totals["tokens_read"] += int(sums[4])
        self._interval["tokens"] += tokens
        self._interval["forwarded"] += forwarded
        if self.rho:
            self.totals["tokens_forwarded"] += forwarded
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
        self._merge_pieces()
        self.totals["train_ms"] += round(1000 * seconds)
        self._interval = self._fresh_interval()
        return {**rec, **self.compute()}

    def log_text(self, record: dict[str, Any]) -> str:
        return (f"loss {record['loss']:.4f} | {record['tokens_per_s']:,.0f} tok/s | "
                f"data wait {100 * record['data_wait_frac']:.1f}%" + (f" | mfu {100 * record['mfu']:.1f}%" if "mfu" in record else "")
                + (f" | trained {record['tokens']:,} of {record['tokens_forwarded']:,} tokens forwarded"
                   if "tokens_forwarded" in record else ""))

    def evaluate(self, model: GPT) -> dict[str, Any]:
        """The eval metrics (`evaluate`) and the run's compute so far (`compute`), so an eval record stands on the
        tokens and FLOPs axes by itself; the evaluation's forward tokens and time are counted apart."""
        t0 = time.perf_counter()
        out = evaluate(model, self.eval_source, self.cfg, self.device, self.rank, self.world, self.cfg.data.eval_target)
        self.totals["eval_tokens_forwarded"] += out["eval_tokens_forwarded"]
        self.totals["eval_ms"] += round(1000 * (time.perf_counter() - t0))
        self._merge_pieces()  # every rank evaluates: distinct_tokens is up to date in an eval record too
        return {**out, **self.compute()}

    def eval_text(self, record: dict[str, Any]) -> str:
        return (f"eval {record['eval_loss']:.4f} (ppl {record['eval_ppl']:.1f}, {record['eval_weighting']}-weighted"
                + (f"; domain mean {record['eval_loss_domain_mean']:.4f}" if record["eval_weighting"] == "tokens"
                   else f"; token-weighted {record['eval_loss_tokens']:.4f}") + ")")

    def rank_state(self) -> dict[str, Any]:
        # the position of the batch last trained on, with the loss feedback reported up to now; the counters that are
        # this rank's: forward-only tokens, the distinct pieces (rank 0: all ranks' merged) and those not yet merged
        keys, lens = self._pending_pieces()
        return {**self.loader.state_dict(position=self.pf.state),
                "lm_counters": {"forward_only_tokens": self.forward_only_tokens,
                                "pieces": torch.tensor(sorted(self._pieces), dtype=torch.int64),
                                "pending": torch.from_numpy(np.stack([keys, lens]).astype(np.int64))}}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        counters = state.pop("lm_counters", None)  # a checkpoint written before they were kept: none
        self.loader.load_state_dict(state)
        if counters is not None:
            self.forward_only_tokens = self._forward_only_counted = int(counters["forward_only_tokens"])
            self._pieces = set(counters["pieces"].tolist())
            pending = counters["pending"].numpy()
            self._pending = [(pending[0].copy(), pending[1].copy())] if pending.shape[1] else []

    def summary(self, record: dict[str, Any]) -> dict[str, Any]:
        return {"data_wait_s": self.pf.wait_seconds if self.pf else 0.0, **self.totals, **self.compute(),
                "flops_params": self._n_flops, **{k: v for k, v in record.items() if k.startswith("eval")}}

    def close(self) -> None:
        if self.pf is not None:
            self.pf.close()
