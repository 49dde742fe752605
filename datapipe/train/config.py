"""The training config tree (one strict loader for `datapipe train`): model, optim, schedule, data,
train (the loop), prefetch, dpo."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from datapipe.core import shards
from datapipe.core.config import ConfigError, check, load, note
from datapipe.core.storage import check_url, is_url, location, reachable
from datapipe.loader.online_mixing import OnlineMixing
from datapipe.loader.prioritize import Prioritize
from datapipe.train.model import ModelConfig


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = note(3e-3, help="peak learning rate (after warmup)")
    beta1: float = note(0.9, help="AdamW beta1")
    beta2: float = note(0.95, help="AdamW beta2")
    eps: float = note(1e-8, help="AdamW epsilon")
    weight_decay: float = note(0.1, help="decoupled weight decay on matrices (embeddings included); none on norms/biases")
    grad_clip: float = note(1.0, help="clip the global gradient norm to this (0 = no clipping)")

    def __post_init__(self) -> None:
        check(self.lr > 0, f"lr must be > 0, got {self.lr!r}")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"beta1 and beta2 must be in [0, 1), got {self.beta1!r}, {self.beta2!r}")
        check(self.eps > 0, f"eps must be > 0, got {self.eps!r}")
        check(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay!r}")
        check(self.grad_clip >= 0, f"grad_clip must be >= 0, got {self.grad_clip!r}")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    warmup_frac: float = note(0.02, help="linear warmup over this fraction of train.steps (at least one step)")
    decay: Literal["cosine", "linear"] = note("cosine", help="shape of the decay from the peak to the floor")
    min_lr_frac: float = note(0.1, help="the floor, as a fraction of the peak lr")

    def __post_init__(self) -> None:
        check(0 <= self.warmup_frac < 1, f"warmup_frac must be in [0, 1), got {self.warmup_frac!r}")
        check(0 <= self.min_lr_frac <= 1, f"min_lr_frac must be in [0, 1], got {self.min_lr_frac!r}")


@dataclass(frozen=True, kw_only=True)
class PrioritizeConfig:
    enabled: bool = note(False, help="loss-aware document selection (datapipe/loader/prioritize.py): keep the documents predicted hardest")
    pool: int = note(Prioritize.pool, help="candidate documents per selection")
    keep: float = note(Prioritize.keep, help="fraction of each pool kept; the rest are skipped this pass")
    temperature: float = note(Prioritize.temperature, help="softmax temperature over predicted losses, in nats (lower = greedier)")
    floor: float = note(Prioritize.floor, help="weight of the uniform distribution in the selection probabilities (nothing starves)")
    min_reports: int = note(Prioritize.min_reports, help="documents with reported losses before predictions are used")
    forget: float = note(Prioritize.forget, help="RLS forgetting factor per reported document")
    refresh: int = note(Prioritize.refresh, help="batches between predictor snapshots handed to the loader's planner")
    lag: int = note(Prioritize.lag, help="the snapshot at batch b has learnt exactly the losses of the first b - lag batches (> prefetch.depth)")

    def __post_init__(self) -> None:
        try:
            self.build()
        except ValueError as exc:
            raise ConfigError(str(exc).replace("prioritize.", "")) from None

    def build(self) -> Prioritize | None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "enabled"}
        built = Prioritize(**fields)  # validates the fields even when disabled
        return built if self.enabled else None


@dataclass(frozen=True, kw_only=True)
class OnlineMixingConfig:
    enabled: bool = note(False, help="online data mixing (datapipe/loader/online_mixing.py, ODM): an EXP3 bandit rewarded by each domain's training loss sets the domain weights")
    alpha: float = note(OnlineMixing.alpha, help="smoothing of the reward moving average: R = alpha R + (1 - alpha) loss / weight")
    warmup: int = note(OnlineMixing.warmup, help="loss reports (micro-batches) served at the prior weights (the manifest's token shares) before the bandit steers")
    refresh: int = note(OnlineMixing.refresh, help="batches between policy snapshots handed to the loader's planner (1: every batch, as the paper)")
    lag: int = note(OnlineMixing.lag, help="the snapshot at batch b has learnt exactly the losses of the first b - lag batches (> prefetch.depth)")

    def __post_init__(self) -> None:
        try:
            self.build()
        except ValueError as exc:
            raise ConfigError(str(exc).replace("online_mixing.", "")) from None

    def build(self) -> OnlineMixing | None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "enabled"}
        built = OnlineMixing(**fields)  # validates the fields even when disabled
        return built if self.enabled else None


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    source: str = note("out/run", help="a curated output folder (holds manifest.json); --data replaces it")
    seq_len: int = note(128, help="tokens per packed row")
    batch_size: int = note(8, help="rows per micro-batch on each rank")
    num_workers: int = note(0, help="loader worker processes (batches do not depend on it)")
    eval_source: str | None = note(None, help="a curated folder of held-out data for evaluation (null: the source's eval "
                                              "split, SOURCE/eval, when it has one; else no evaluation)")
    holdout_shards: int = note(0, help="without eval_source: hold out the last N shards of source for evaluation instead of "
                                       "its eval split (0 = hold out none: evaluate on the eval split, if any)")
    eval_batches: int = note(0, help="a cap on this rank's batches per evaluation (0: none, the whole eval source, each "
                                     "document once). An evaluation reads the eval source once, unshuffled, its domains "
                                     "interleaved at their token shares in one fixed order and never cycled, so a capped "
                                     "one reads the same leading part on every run, each domain in proportion to its tokens")
    eval_target: dict[str, float] | None = note(
        None, help="the target mixture of the overall eval loss, {domain: weight} (normalized; a domain of the eval "
                   "source left out weighs 0, one the eval source lacks is an error): eval_loss = sum of weight x "
                   "domain loss. null: token-weighted over the eval source (its token losses' mean). The token-weighted "
                   "and the plain domain-mean losses and the per-domain losses are logged either way")
    verify: Literal["cached", "always"] = note(
        "cached", help="shard checks (size, sha256, token ids): 'cached' hashes a shard once and then trusts its size "
                       "and modification time (bytes that rot in place with both kept are served); 'always' hashes it "
                       "on every open")
    mixture: dict[str, float] | None = note(None, help="constant domain weights of the training data, e.g. {code: 0.3, "
                                                       "man: 0.7} (a domain it does not name gets none; each domain "
                                                       "restarts its passes on its own); null: the manifest's token "
                                                       "shares, one pass per epoch. With online_mixing: its prior")
    prioritize: PrioritizeConfig = note(PrioritizeConfig(), help="loss-aware batch prioritization (off by default)")
    online_mixing: OnlineMixingConfig = note(OnlineMixingConfig(), help="online data mixing of the domains (off by default)")

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size"):
            check(getattr(self, name) >= 1, f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        check(self.eval_batches >= 0, f"eval_batches must be an integer >= 0 (0: the whole eval source), got "
                                      f"{self.eval_batches!r}")
        if self.eval_target is not None:
            check(bool(self.eval_target) and all(math.isfinite(w) and w >= 0 for w in self.eval_target.values())
                  and sum(self.eval_target.values()) > 0,
                  f"eval_target must map domains to finite weights >= 0 with a positive sum, got {self.eval_target!r}")
        check(self.num_workers >= 0, f"num_workers must be >= 0, got {self.num_workers!r}")
        check(self.holdout_shards >= 0, f"holdout_shards must be >= 0, got {self.holdout_shards!r}")
        check(self.mixture is None or (all(w >= 0 for w in self.mixture.values()) and sum(self.mixture.values()) > 0),
              f"mixture must map domains to weights >= 0 with a positive sum, got {self.mixture!r}")
        check(not (self.eval_source and self.holdout_shards),
              f"set eval_source or holdout_shards, not both; got {self.eval_source!r} and {self.holdout_shards!r}")


@dataclass(frozen=True, kw_only=True)
class RhoConfig:
    enabled: bool = note(False, help="RHO-LOSS selection (datapipe/train/lm.py): train on the rows of highest reducible "
                                     "loss; needs a folder scored by `datapipe score`")
    candidates: int = note(10, help="candidate rows per trained row: each micro-batch reads candidates x "
                                    "data.batch_size rows (selection 'forward': forwarded without gradients) and trains "
                                    "on the top data.batch_size (the paper's n_B / n_b = 10)")
    column: str = note("ref_loss", help="the shard column of each token's irreducible (reference-model) loss: a list "
                                        "as long as the document's tokens, written by `datapipe score`")
    max_rows_per_doc: int = note(2, help="at most this many rows holding a piece of one document in a selected "
                                         "micro-batch (0: no cap): a long document's pieces cannot fill the batch; when "
                                         "the cap leaves fewer than data.batch_size rows, the best rows it refused fill in")
    selection: Literal["forward", "last_loss"] = note(
        "forward", help="how candidate rows are scored: 'forward' forwards every candidate row without gradients (the "
                        "paper: 2N FLOPs per candidate token); 'last_loss' forwards nothing: a row's reducible loss is "
                        "the one its documents had when last trained on (the loader's loss memory; documents never "
                        "trained on get the mean of the remembered ones)")

    def __post_init__(self) -> None:
        check(self.candidates >= 2, f"candidates must be an integer >= 2 (1 would select nothing), got {self.candidates!r}")
        check(bool(self.column), f"column must name a shard column, got {self.column!r}")
        check(self.max_rows_per_doc >= 0, f"max_rows_per_doc must be an integer >= 0 (0: no cap), got {self.max_rows_per_doc!r}")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    steps: int = note(300, help="optimizer steps")
    grad_accum: int = note(1, help="micro-batches per optimizer step")
    log_every: int = note(10, help="steps per log line and metrics.jsonl record")
    eval_every: int = note(100, help="steps between evaluations (0 = only at the end); needs held-out data")
    ckpt_every: int = note(100, help="steps between checkpoints (0 = only at the end)")
    ckpt_minutes: float = note(10.0, help="also checkpoint when this many minutes passed since the last one (0 = off)")
    stop_at: int = note(0, help="stop after this step and checkpoint (0 = run all steps): splits a run across jobs, same schedule")
    max_nonfinite: int = note(5, help="stop after this many non-finite losses/gradients in a row")
    compile: bool = note(False, help="torch.compile the model")
    seed: int = note(0, help="seed of the model init and of the data order")
    output: str = note("runs/tiny", help="run folder: metrics.jsonl, checkpoint.pt, config.yaml; --output replaces it")
    device: Literal["auto", "cpu", "cuda"] = note("auto", help="'auto' = cuda when available")
    objective: Literal["lm", "dpo"] = note("lm", help="'lm': next-token loss on text shards (datapipe/train/lm.py); 'dpo': DPO on preference shards (datapipe/train/dpo.py)")
    rho: RhoConfig = note(RhoConfig(), help="RHO-LOSS reducible-loss selection of the rows trained on (off by default)")
    tensorboard: bool = note(False, help="also write each metrics.jsonl record as TensorBoard scalars to OUTPUT/tensorboard/ "
                                         "(rank 0; needs `pip install tensorboard`); a resume continues the same curves")
    wandb: bool = note(False, help="also log each metrics.jsonl record to a Weights & Biases run (rank 0; needs `pip "
                                   "install wandb`; project and entity: WANDB_PROJECT, WANDB_ENTITY); a resume "
                                   "continues the run named in OUTPUT/wandb-run-id")

    def __post_init__(self) -> None:
        check(not is_url(self.output), f"output must be a local folder (metrics.jsonl and checkpoints are written there), "
                                       f"got the URL {self.output!r}; train into a local folder and copy the run to object "
                                       "storage afterwards")
        for name in ("steps", "grad_accum", "log_every", "max_nonfinite"):
            check(getattr(self, name) >= 1, f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("eval_every", "ckpt_every", "seed", "stop_at"):
            check(getattr(self, name) >= 0, f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        check(self.ckpt_minutes >= 0, f"ckpt_minutes must be >= 0, got {self.ckpt_minutes!r}")


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    enabled: bool = note(True, help="read batches on a background thread while the model computes")
    depth: int = note(4, help="batches kept ready")
    delay_s: float = note(0.0, help="sleep this long per batch read: a slow loader, for the benchmark")

    def __post_init__(self) -> None:
        check(self.depth >= 1, f"depth must be an integer >= 1, got {self.depth!r}")
        check(self.delay_s >= 0, f"delay_s must be >= 0, got {self.delay_s!r}")


@dataclass(frozen=True, kw_only=True)
class DPOConfig:
    beta: float = note(0.1, help="DPO temperature β on the log-ratio margin")
    packed: bool = note(True, help="preference packing (several pairs a row, prompt once); false: padded pairs, two rows each")
    init_from: str | None = note(None, help="a checkpoint.pt whose model initialises the policy and the frozen reference")
    default_pairs: int = note(2000, help="pairs of the default set built when data.source is empty or missing")
    eval_pairs: int = note(128, help="pairs held out (the last ones) for preference accuracy")
    chunk: int = note(256, help="pairs packed together (best-fit) at a time")

    def __post_init__(self) -> None:
        check(self.beta > 0, f"beta must be > 0, got {self.beta!r}")
        for name in ("default_pairs", "chunk"):
            check(getattr(self, name) >= 1, f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        check(self.eval_pairs >= 0, f"eval_pairs must be >= 0, got {self.eval_pairs!r}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelConfig = note(ModelConfig(), help="the transformer")
    optim: OptimConfig = note(OptimConfig(), help="AdamW and gradient clipping")
    schedule: ScheduleConfig = note(ScheduleConfig(), help="learning-rate warmup and decay")
    data: DataConfig = note(DataConfig(), help="shards, rows and held-out data")
    train: LoopConfig = note(LoopConfig(), help="the loop: steps, intervals, output")
    prefetch: PrefetchConfig = note(PrefetchConfig(), help="background batch prefetching")
    dpo: DPOConfig = note(DPOConfig(), help="DPO settings (train.objective: dpo)")

    def __post_init__(self) -> None:
        check(self.model.max_seq_len >= self.data.seq_len,
              f"model.max_seq_len must be >= data.seq_len={self.data.seq_len}, got {self.model.max_seq_len!r}")
        # a step reads all its micro-batches before it reports their losses, and the loader waits for the
        # reports of the first b - lag batches before it serves batch b
        check(not self.data.prioritize.enabled or self.data.prioritize.lag >= self.train.grad_accum - 1,
              f"data.prioritize.lag must be >= train.grad_accum - 1 = {self.train.grad_accum - 1} (a step reads all "
              f"its micro-batches before reporting their losses), got {self.data.prioritize.lag!r}")
        check(not self.data.online_mixing.enabled or self.data.online_mixing.lag >= self.train.grad_accum - 1,
              f"data.online_mixing.lag must be >= train.grad_accum - 1 = {self.train.grad_accum - 1} (a step reads "
              f"all its micro-batches before reporting their losses), got {self.data.online_mixing.lag!r}")
        if self.train.rho.enabled:  # one selection rule at a time, on text shards
            check(self.train.objective == "lm", f"train.rho.enabled needs train.objective 'lm' (it selects rows of "
                                                f"packed text), got {self.train.objective!r}; set train.rho.enabled=false")
            check(not self.data.prioritize.enabled, "train.rho.enabled and data.prioritize.enabled select data two ways "
                                                    "at once; enable one of them")
            check(not self.data.online_mixing.enabled, "train.rho.enabled and data.online_mixing.enabled select data two "
                                                       "ways at once (the bandit would learn from the selected rows' "
                                                       "losses only); enable one of them")


# Keys a resumed run may change: they decide how a run executes and reports, not what it computes. Every other
# key must match the checkpoint's run (`datapipe train --resume` names the first that differs).
EXECUTION_KEYS = ("train.log_every", "train.eval_every", "train.ckpt_every", "train.ckpt_minutes", "train.stop_at",
                  "train.max_nonfinite", "train.output", "train.device", "train.compile", "data.num_workers",
                  "data.eval_batches", "data.verify", "model.attention", "prefetch.enabled", "prefetch.depth",
                  "prefetch.delay_s", "train.tensorboard", "train.wandb")


def load_train_config(path: str | Path | None, overrides: list[str] = (), *, data: str | None = None,
                      output: str | None = None) -> TrainConfig:
    """Read a YAML training recipe, apply `--set` overrides and the --data/--output flags, validate strictly
    (the one loader of every command, `datapipe.core.config.load`)."""
    return load(TrainConfig, path, overrides, {"data.source": data, "train.output": output})


def check_sources(cfg: TrainConfig) -> None:
    """Check the data folders before any work starts, so a wrong folder is a ConfigError, not a traceback
    from deep in the loader: each local folder holds a datapipe manifest of the kind the objective reads
    (text shards for 'lm', preference shards for 'dpo'), at least one document, and token ids that fit
    model.vocab_size; dpo.init_from is a file. A URL folder (s3://…) is read through datapipe.core.storage."""
    dpo = cfg.train.objective == "dpo"
    folders = [("data.source", cfg.data.source)]
    if cfg.data.eval_source and not dpo:
        folders.append(("data.eval_source", cfg.data.eval_source))
    for key, folder in folders:
        if dpo and key == "data.source" and not folder:  # '' + dpo: the default set
            continue
        if is_url(folder):
            check_url(folder, key, write=False)
        manifest = _read_manifest(key, folder, dpo)
        is_pref = manifest.get("kind") == "preference"
        if dpo and not is_pref:
            raise ConfigError(f"{key} must be a preference folder (curated with `datapipe curate-preferences`) "
                              f"for train.objective 'dpo', got {folder!r}, a folder of text shards")
        if not dpo and is_pref:
            raise ConfigError(f"{key} {folder!r} is a preference folder; train.objective 'lm' reads text shards "
                              "(`datapipe curate`): set train.objective: dpo to train on preference pairs")
        check(manifest.get("total_docs", 0) > 0, f"{key} {folder!r} holds no documents (manifest total_docs=0)")
        vocab = (manifest.get("tokenizer") or {}).get("vocab_size")
        check(cfg.model.vocab_size is None or not isinstance(vocab, int) or cfg.model.vocab_size >= vocab,
              f"model.vocab_size must be >= {vocab}, the vocab_size of the tokenizer of {key} {folder!r}, got "
              f"{cfg.model.vocab_size!r} (null: the tokenizer's)")
    if cfg.dpo.init_from and dpo and "://" not in cfg.dpo.init_from:
        check(Path(cfg.dpo.init_from).is_file(), f"dpo.init_from must be a checkpoint.pt file, got {cfg.dpo.init_from!r}: "
                                                 "no such file")


def _read_manifest(key: str, folder: str, dpo: bool) -> dict:
    if not (reachable(folder, key) / shards.MANIFEST_NAME).is_file():
        curate = "`datapipe curate-preferences` (or data.source: '' for the default set)" if dpo else \
            "`datapipe run` or `datapipe curate`, or pass --data"
        what = "does not exist" if not location(folder).exists() else "holds no manifest.json (not a finished curated folder)"
        raise ConfigError(f"{key} must be a curated folder holding manifest.json; {folder!r} {what}. Curate one with {curate}")
    try:
        return shards.read_manifest(folder)
    except (ValueError, KeyError, OSError) as exc:  # not JSON, another format version, unreadable
        raise ConfigError(f"{key} {folder!r}: its manifest.json is not a datapipe manifest ({exc})") from None
