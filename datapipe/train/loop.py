"""The one training loop: objectives (next-token `lm`, `dpo`) share its set-up, checkpoints, resume and logs.

    datapipe train configs/train-tiny.yaml [--data DIR] [--output DIR] [--set train.steps=200] [--resume]
    torchrun --nproc_per_node=2 -m datapipe train configs/train-tiny.yaml

    from datapipe.train.config import load_train_config
    from datapipe.train.loop import train
    summary = train(load_train_config("configs/train-tiny.yaml", ["train.steps=50"]))

`train(cfg)` reads top to bottom: check the run folder (a fresh run refuses one that holds a run;
--resume refuses a checkpoint whose run had other result-shaping settings, and starts a run stopped
before its first checkpoint again from step 0), set up (distributed,
device, the objective's data, model, AdamW (fused on CUDA), schedule, resume), write config.yaml,
then per step: the objective's micro-batches, its backward passes (bf16 autocast on CUDA), one
all-reduce of its per-step sums, the global gradient norm (clipped), skip the update if the loss or
the norm is non-finite (`train.max_nonfinite` in a row stops the run with the step named), step;
log, evaluate and checkpoint on their intervals. The objective (datapipe/train/objective.py) supplies
the data, the loss, the numbers and its data position; train/lm.py and train/dpo.py are the two.

Checkpoints (`RUN_DIR/checkpoint.pt`, datapipe/train/checkpoint.py: atomic, sha256 beside it, the
previous one kept as checkpoint.prev.pt) hold the model, optimizer, scheduler, step, skip counter,
the objective's totals (tokens or pairs trained) and, per rank, its data position (of the batch last
trained on) and RNG states, all plain tensors/dicts/lists: they load with `weights_only=True`. They
are written every `train.ckpt_every` steps, every `train.ckpt_minutes` of wall time, and at the end.
A resumed run drops the metrics.jsonl rows past its checkpoint's step (it logs those steps again).

Log records (`MetricsLog`, rank 0) go to metrics.jsonl and, when asked, to TensorBoard (`train.tensorboard`:
event files in RUN_DIR/tensorboard/) and to a Weights & Biases run (`train.wandb`): every number of a record as a
scalar under its metrics.jsonl name (`loss`, `lr`, `tokens_per_s`, `eval_loss`, ...; nested ones joined by '/':
`eval_domains/code/loss`) at its step. A resume continues the same curves: the event writer starts with
`purge_step` = the checkpoint's step + 1, so TensorBoard's readers drop the events logged past the checkpoint, as
metrics.jsonl drops its rows (a fresh run purges from step 1: an earlier run's leftovers in the folder too); W&B
resumes the run whose id RUN_DIR/wandb-run-id holds, but it cannot drop logged steps (its rewind is not generally
available): it keeps the values first logged for the steps a resume replays and ignores the replay, with a warning.

`datapipe train --resume` continues with the run's own settings (`resumed_config`: RUN_DIR/config.yaml
for every key that shapes results); a `--set` or `--data` given again must agree with them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import yaml

from datapipe.core.config import ConfigError, RunStopped, from_dict, set_key, to_dict
from datapipe.core.shards import atomic_write_bytes
from datapipe.core.storage import make_local_folder
from datapipe.train.checkpoint import clear_temporaries, load_checkpoint, previous_path, save_checkpoint
from datapipe.train.config import EXECUTION_KEYS, TrainConfig, check_sources
from datapipe.train.dpo import DPOObjective
from datapipe.train.lm import LMObjective
from datapipe.train.model import GPT
from datapipe.train.objective import Objective
from datapipe.train.optim import lr_factor, param_groups

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoint.pt", "checkpoint.prev.pt")


# --------------------------------------------------------------------------------------------- parts


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


def _raise_on_all_ranks(problem: str | None, rank: int, world: int) -> None:
    """Rank 0's verdict, raised on every rank (the others would otherwise wait for it in a collective)."""
    if world > 1:
        box = [problem if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ConfigError(problem)


def fresh_run_problem(run_dir: Path) -> str | None:
    """Why a fresh run cannot use `run_dir` (it holds another run's files), or None."""
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not found:
        return None
    if any(name.startswith("checkpoint") for name in found):
        fix = "continue it with --resume, or pass another --output"
    elif "config.yaml" in found:  # stopped before its first checkpoint: --resume starts it again with its settings
        fix = "it stopped before its first checkpoint: --resume starts it again from step 0, or pass another --output"
    else:
        fix = "it has no checkpoint to resume from: pass another --output, or delete those files"
    return f"train.output {str(run_dir)!r} already holds a run ({', '.join(found)}); {fix}"


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else key))
    return out


def resume_problem(saved: dict[str, Any], cfg: TrainConfig, whose: str = "the checkpoint's run") -> str | None:
    """The first result-shaping key on which `cfg` differs from the saved run's config (`whose` names it), as an
    error; or None.

    Keys in EXECUTION_KEYS may change; model.vocab_size null takes the data's, as the saved run did."""
    ours, theirs = _flatten(to_dict(cfg)), _flatten(saved)
    for key, value in ours.items():
        if key in EXECUTION_KEYS or key not in theirs or theirs[key] == value:
            continue
        if key == "model.vocab_size" and value is None:
            continue
        return (f"--resume: {key} is {value!r} but {whose} has {theirs[key]!r}; a resumed run keeps every "
                f"setting that shapes its results (only {', '.join(EXECUTION_KEYS)} may change): set {key}={theirs[key]!r} "
                "or start a new run with another --output")
    return None


def has_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a run that `train(..., resume=True)` continues: a checkpoint, or the config.yaml of a
    run stopped before its first checkpoint."""
    return any((Path(run_dir) / name).exists() for name in ("checkpoint.pt", "checkpoint.prev.pt", "config.yaml"))


def _recorded(run_dir: Path) -> dict[str, Any] | None:
    """The run's config.yaml (written when it started) as plain data, or None without one."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--resume: {str(path)!r} cannot be read ({type(exc).__name__}); it is the run's config: "
                          "restore it, or start a new run with another --output") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--resume: {str(path)!r} is not a run config (a mapping of keys); restore it, or start a "
                          "new run with another --output")
    return data


def resumed_config(cfg: TrainConfig, given: dict[str, str]) -> TrainConfig:
    """The config `datapipe train --resume` continues with: the run's own (RUN_DIR/config.yaml) for every key that
    shapes results, `cfg`'s (this command's recipe, --set and flags) for the EXECUTION_KEYS. `given` maps each dotted
    key the command line set (a --set, --data) to that flag; one that differs from the run's is a ConfigError naming
    the flag. Without a config.yaml, `cfg` (train() then checks it against the checkpoint)."""
    run_dir = Path(cfg.train.output)
    recorded = _recorded(run_dir)
    if recorded is None:
        return cfg
    theirs, ours = _flatten(recorded), _flatten(to_dict(cfg))
    for dotted, flag in given.items():
        for key, value in ours.items():
            if key in EXECUTION_KEYS or not (key == dotted or key.startswith(dotted + ".")) or key not in theirs:
                continue
            if theirs[key] == value or (key == "model.vocab_size" and value is None):  # null: the data's, as recorded
                continue
            raise ConfigError(f"--resume: {flag} sets {key} to {value!r}, but the run has {theirs[key]!r} "
                              f"({str(run_dir / 'config.yaml')!r}); a resumed run keeps every setting that shapes its "
                              f"results (only {', '.join(EXECUTION_KEYS)} may change): leave {flag} out, or start a "
                              "new run with another --output")
    for key in EXECUTION_KEYS:
        set_key(recorded, key, ours[key], key)
    try:
        return from_dict(TrainConfig, recorded)
    except ConfigError as exc:  # written by another datapipe version
        raise ConfigError(f"--resume: {str(run_dir / 'config.yaml')!r}: {exc}; start a new run with another "
                          "--output") from None


def _keep_metrics_until(path: Path, step: int) -> None:
    """Rewrite metrics.jsonl (atomically) without its rows past `step`: a resumed run logs those steps again, and
    each step is kept once. A line cut short by a kill is dropped too."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line + "\n")
    atomic_write_bytes(path, "".join(kept).encode())


def check_trackers(cfg: TrainConfig) -> None:
    """A ConfigError naming the key when train.tensorboard or train.wandb is on and its package is missing."""
    if cfg.train.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401  (needs the tensorboard package)
        except ImportError:
            raise ConfigError("train.tensorboard is true but the tensorboard package is not installed: "
                              "pip install tensorboard, or set train.tensorboard=false") from None
    if cfg.train.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError("train.wandb is true but the wandb package is not installed: pip install wandb, "
                              "or set train.wandb=false") from None


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a log record by name (nested ones joined by '/'), without `step`; text, flags and nulls left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}/{key}" if prefix else key
        if isinstance(value, dict):
            out.update(scalars(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and name != "step":
            out[name] = float(value)
    return out


class MetricsLog:
    """Where rank 0's log records go: metrics.jsonl, and TensorBoard and W&B when the config asks; opened when the
    loop starts at step `start` (`resume`: a resumed run, whose records past `start` are dropped)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, *, start: int, resume: bool) -> None:
        path = run_dir / "metrics.jsonl"
        if resume:
            _keep_metrics_until(path, start)
        self._jsonl = open(path, "a")
        self._events = self._wandb = None
        if cfg.train.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._events = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start + 1)
        if cfg.train.wandb:
            self._wandb = _wandb_run(cfg, run_dir, start)

    def write(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        numbers = scalars(record)
        if self._events is not None:
            for name, value in numbers.items():
                self._events.add_scalar(name, value, global_step=record["step"])
            self._events.flush()  # as metrics.jsonl: a killed run keeps what it logged
        if self._wandb is not None:
            self._wandb.log(numbers, step=record["step"])

    def close(self) -> None:
        self._jsonl.close()
        if self._events is not None:
            self._events.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_run(cfg: TrainConfig, run_dir: Path, start: int) -> Any:
    """The run's W&B run: the one RUN_DIR/wandb-run-id names when resuming from a checkpoint, else a new one. Project
    and entity: W&B's own settings (WANDB_PROJECT, WANDB_ENTITY, `wandb login`)."""
    import wandb

    id_file = run_dir / "wandb-run-id"
    run_id = id_file.read_text().strip() if start > 0 and id_file.is_file() else secrets.token_hex(8)
    atomic_write_bytes(id_file, run_id.encode())
    return wandb.init(id=run_id, resume="allow", name=run_dir.name, dir=str(run_dir), config=to_dict(cfg))


def build_objective(cfg: TrainConfig, run_dir: Path, *, rank: int, world: int, device: torch.device,
                    say: Callable[..., None], default_preferences: Callable | None) -> Objective:
    if cfg.train.objective == "dpo":
        return DPOObjective(cfg, run_dir, rank=rank, world=world, device=device, say=say,
                            default_preferences=default_preferences)
    return LMObjective(cfg, run_dir, rank=rank, world=world, device=device)


def objective_key(cfg: TrainConfig) -> str:
    """The checkpoint key of the objective's per-rank data states."""
    return DPOObjective.state_key if cfg.train.objective == "dpo" else LMObjective.state_key


def _params_sha256(model: torch.nn.Module) -> str:
    """Of every parameter's bytes: replicas (DDP ranks) must agree exactly."""
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------- loop


@dataclass
class _Run:
    """One process's share of a training run once it is set up: what its steps, logs and checkpoints work on."""

    cfg: TrainConfig  # model.vocab_size is the data's
    rank: int
    world: int
    device: torch.device
    say: Callable[..., None]
    objective: Objective
    raw_model: GPT  # what is checkpointed, evaluated and clipped
    model: torch.nn.Module  # raw_model, compiled and wrapped in DDP when asked: what the backward passes run
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    start: int = 0  # the first step to train (a resumed run: its checkpoint's step)
    skipped: int = 0  # updates skipped in the whole run (checkpointed)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.train.output)

    @property
    def ckpt_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"


@dataclass
class _Interval:
    """The steps since the last log record: when they began (perf_counter), how many, how many updates skipped."""

    t: float = field(default_factory=time.perf_counter)
    steps: int = 0
    skipped: int = 0


@dataclass
class _Progress:
    """The loop's running state."""

    in_a_row: int = 0  # non-finite steps in a row (train.max_nonfinite stops the run)
    losses: list[float] = field(default_factory=list)  # every step's loss
    record: dict[str, Any] = field(default_factory=dict)  # the last log record (the summary's)
    interval: _Interval = field(default_factory=_Interval)
    last_ckpt: float = field(default_factory=time.monotonic)  # when the last checkpoint was written (train.ckpt_minutes)


def _quiet(*args: Any, **kwargs: Any) -> None:
    pass


def train(cfg: TrainConfig, *, resume: bool = False, default_preferences: Callable | None = None,
          say: Callable[..., None] | None = print) -> dict[str, Any]:
    """Train `cfg.model` with `cfg.train.objective` for `cfg.train.steps` steps; returns a summary (rank 0's view).

    `default_preferences(out, n, log)` builds a preference folder when a DPO run has no data.source (the CLI passes
    `datapipe.curation.preferences.default_preference_set`; the training wing does not import curation). `say`: where
    rank 0's lines go (the set-up, every log step, the last line); None: nowhere. `datapipe train` prints them; a
    command that trains runs of its own (`datapipe score`, `datapipe experiment`) passes None unless --verbose. The
    files (metrics.jsonl, checkpoints, config.yaml) are the same either way."""
    t_start = time.perf_counter()
    rank, world, device = _dist_setup(cfg.train.device)
    say = (say or _quiet) if rank == 0 else _quiet
    ckpt = _open_run_folder(cfg, resume=resume, rank=rank, world=world, say=say)
    run = _set_up(cfg, ckpt, rank=rank, world=world, device=device, say=say, default_preferences=default_preferences)
    metrics = MetricsLog(run.cfg, run.run_dir, start=run.start, resume=resume) if run.main else None
    run.objective.start(run.raw_model)
    stop = min(cfg.train.stop_at or cfg.train.steps, cfg.train.steps)
    try:
        progress = _train_steps(run, stop, metrics)
    finally:
        run.objective.close()
        if metrics is not None:
            metrics.close()
    seconds = time.perf_counter() - t_start
    losses = progress.losses
    summary = {"params_sha256": _params_sha256(run.raw_model), "run_dir": str(run.run_dir), "objective": run.objective.name,
               "steps": stop, "start_step": run.start, "losses": losses, "final_loss": losses[-1] if losses else None,
               "skipped": run.skipped, "seconds": seconds, "world_size": world, **run.objective.summary(progress.record)}
    say(f"done: {stop - run.start} steps in {seconds:.1f} s; checkpoint {run.ckpt_path}; "
        f"metrics {run.run_dir / 'metrics.jsonl'}")
    return summary


def _open_run_folder(cfg: TrainConfig, *, resume: bool, rank: int, world: int,
                     say: Callable[..., None]) -> dict[str, Any] | None:
    """Before any work: the data folders fit the objective; a fresh run needs a run folder without a run, --resume a
    checkpoint of the same run. Then the folder is made. Returns the checkpoint to resume from, or None."""
    run_dir = Path(cfg.train.output)
    ckpt_path = run_dir / "checkpoint.pt"
    check_sources(cfg)
    check_trackers(cfg)
    ckpt: dict[str, Any] | None = None
    from_zero = (resume and not ckpt_path.exists() and not previous_path(ckpt_path).exists()
                 and (run_dir / "config.yaml").is_file())
    if from_zero:  # stopped before its first checkpoint: the same run again from step 0, with the run's settings
        _raise_on_all_ranks(resume_problem(_recorded(run_dir), cfg, f"the run's {run_dir / 'config.yaml'}")
                            if rank == 0 else None, rank, world)
        say(f"--resume: {run_dir} stopped before its first checkpoint: starting it again from step 0 with its config")
    elif resume:
        ckpt = load_checkpoint(ckpt_path)  # a ConfigError naming the file when it is missing or damaged
        _raise_on_all_ranks(_checkpoint_problem(ckpt, cfg, ckpt_path, world), rank, world)
    else:
        _raise_on_all_ranks(fresh_run_problem(run_dir) if rank == 0 else None, rank, world)
    make_local_folder(run_dir, "train.output")  # a file in the way, a folder that cannot be made: said as such
    if rank == 0:  # nothing writes in the run folder yet: a temporary file there is a killed save's (or write's) leftover
        clear_temporaries(ckpt_path)
    return ckpt


def _checkpoint_problem(ckpt: dict[str, Any], cfg: TrainConfig, ckpt_path: Path, world: int) -> str | None:
    """Why --resume cannot continue from `ckpt` (another run's settings, no data position for this objective, another
    world size), or None."""
    problem = resume_problem(ckpt.get("config", {}), cfg)
    if problem is None and objective_key(cfg) not in ckpt:
        problem = (f"--resume: {ckpt_path} holds no {objective_key(cfg)!r} (written by an older datapipe that could "
                   "not resume this objective); start a new run with another --output")
    if problem is None and len(ckpt[objective_key(cfg)]) != world:
        problem = (f"--resume: the checkpoint was written by {len(ckpt[objective_key(cfg)])} ranks, this run has "
                   f"world_size={world}; resume with the same number of processes")
    return problem


def _set_up(cfg: TrainConfig, ckpt: dict[str, Any] | None, *, rank: int, world: int, device: torch.device,
            say: Callable[..., None], default_preferences: Callable | None) -> _Run:
    """The objective's data, the model, AdamW (fused on CUDA) and the schedule, restored from `ckpt` when resuming;
    then the run's config.yaml (with the data's vocab_size) is written."""
    objective = build_objective(cfg, Path(cfg.train.output), rank=rank, world=world, device=device, say=say,
                                default_preferences=default_preferences)
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=objective.vocab_size))
    torch.manual_seed(cfg.train.seed)  # the same seed on every rank: identical initial weights
    model = GPT(cfg.model).to(device)
    objective.init_model(model)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    run = _Run(cfg, rank, world, device, say, objective, raw_model=model, model=model, optimizer=optimizer,
               scheduler=scheduler)
    if ckpt is not None:
        _restore(run, ckpt)
    if cfg.train.compile:
        run.model = torch.compile(run.model)
    if world > 1:
        run.model = torch.nn.parallel.DistributedDataParallel(
            run.model, device_ids=[device.index] if device.type == "cuda" else None)
    if run.main:
        atomic_write_bytes(run.run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
    say(f"model: {model.num_params(non_embedding=False) / 1e6:.2f} M parameters "
        f"({cfg.model.n_layer} layers, d_model {cfg.model.d_model}, vocab {cfg.model.vocab_size}); device {device}, "
        f"world {world}\n{objective.describe()}")
    return run


def _restore(run: _Run, ckpt: dict[str, Any]) -> None:
    """The model, optimizer, schedule, data position, totals, RNG states and counters of a checkpoint."""
    run.raw_model.load_state_dict(ckpt["model"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.scheduler.load_state_dict(ckpt["scheduler"])
    try:
        run.objective.load_rank_state(ckpt[run.objective.state_key][run.rank])
    except ValueError as exc:  # the data changed under the run
        raise ConfigError(f"--resume: {run.ckpt_path}: {exc}") from None
    run.objective.totals.update({k: int(v) for k, v in ckpt.get("totals", {}).items()})
    rng = ckpt["rng"][run.rank]
    torch.set_rng_state(rng["cpu"])
    if run.device.type == "cuda" and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"], run.device)
    run.start, run.skipped = int(ckpt["step"]), int(ckpt["skipped"])
    run.say(f"resumed from {run.ckpt_path} at step {run.start}")


def _save_checkpoint(run: _Run, done: int) -> None:
    """Every rank's data position and RNG states, gathered; rank 0 writes the checkpoint, and every rank waits."""
    device = run.device
    rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
    states, rngs = _gather(run.objective.rank_state(), run.world), _gather(rng, run.world)
    if run.main:
        save_checkpoint(run.ckpt_path, {
            "step": done, "skipped": run.skipped, "objective": run.objective.name, "model": run.raw_model.state_dict(),
            "optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict(),
            run.objective.state_key: states, "rng": rngs, "totals": dict(run.objective.totals), "config": to_dict(run.cfg)})
    if run.world > 1:
        dist.barrier()


def _train_steps(run: _Run, stop: int, metrics: MetricsLog | None) -> _Progress:
    """Steps run.start + 1 to `stop`: each trains, then logs, evaluates and checkpoints on their intervals."""
    train_cfg = run.cfg.train
    progress = _Progress()
    for step in range(run.start, stop):
        lr = run.scheduler.get_last_lr()[0]
        grad_norm, time_due = _train_step(run, progress, step)
        done = step + 1
        _log_and_evaluate(run, progress, metrics, done=done, last=done == stop, lr=lr, grad_norm=grad_norm)
        if (train_cfg.ckpt_every and done % train_cfg.ckpt_every == 0) or done == stop or time_due:
            _save_checkpoint(run, done)
            progress.last_ckpt = time.monotonic()
    return progress


def _train_step(run: _Run, progress: _Progress, step: int) -> tuple[float, bool]:
    """The objective's micro-batches and backward passes, the clipped global gradient norm, and the update, skipped
    when the loss or the norm is non-finite. Returns the norm and whether any rank's wall-clock checkpoint is due."""
    objective = run.objective
    micro = objective.next_step()
    sums = objective.backward(run.model, micro)
    sums, time_due = _all_reduce(run, sums, progress.last_ckpt)
    grad_norm = float(torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), run.cfg.optim.grad_clip or float("inf")))
    step_loss = objective.step_loss(sums)
    ok = math.isfinite(step_loss) and math.isfinite(grad_norm)
    if ok:
        run.optimizer.step()
        progress.in_a_row = 0
    else:  # skip the update; the data is consumed and the schedule moves on
        _skip_update(run, progress, step, step_loss, grad_norm)
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    objective.add(sums, ok)
    progress.losses.append(step_loss)
    progress.interval.steps += 1
    return grad_norm, time_due


def _all_reduce(run: _Run, sums: torch.Tensor, last_ckpt: float) -> tuple[torch.Tensor, bool]:
    """One all-reduce per step: the objective's sums, and whether any rank's wall-clock checkpoint is due."""
    minutes = run.cfg.train.ckpt_minutes
    time_due = bool(minutes) and time.monotonic() - last_ckpt >= 60 * minutes
    sums = torch.cat([sums, torch.tensor([float(time_due)], dtype=torch.float64, device=sums.device)])
    if run.world > 1:
        dist.all_reduce(sums)
    return sums[:-1], bool(sums[-1] > 0)


def _skip_update(run: _Run, progress: _Progress, step: int, step_loss: float, grad_norm: float) -> None:
    """Count a skipped update and say so; train.max_nonfinite of them in a row stop the run."""
    run.skipped += 1
    progress.in_a_row += 1
    progress.interval.skipped += 1
    run.say(f"step {step + 1}: non-finite loss {step_loss} or grad norm {grad_norm}: update skipped "
            f"({progress.in_a_row} in a row, {run.skipped} in all)")
    max_nonfinite = run.cfg.train.max_nonfinite
    if progress.in_a_row >= max_nonfinite:
        raise RunStopped(f"stopping at step {step + 1}: {progress.in_a_row} non-finite losses or gradients in a row "
                         f"(train.max_nonfinite={max_nonfinite}); lower optim.lr or check the data")


def _log_and_evaluate(run: _Run, progress: _Progress, metrics: MetricsLog | None, *, done: int, last: bool,
                      lr: float, grad_norm: float) -> None:
    """On a log step, the interval's record (with the evaluation when one is due); an evaluation due between log
    steps is logged on its own."""
    train_cfg, objective = run.cfg.train, run.objective
    evaluated = objective.can_evaluate and ((train_cfg.eval_every and done % train_cfg.eval_every == 0) or last)
    if done % train_cfg.log_every == 0 or last:
        interval = progress.interval
        seconds = max(time.perf_counter() - interval.t, 1e-9)
        fields = objective.log_fields(seconds)
        record = progress.record = {"step": done, "loss": fields.pop("loss"), "lr": lr, "grad_norm": grad_norm,
                                    "step_time_s": seconds / interval.steps, "skipped": interval.skipped, **fields}
        if evaluated:
            record.update(objective.evaluate(run.raw_model))
        run.say(f"step {done}/{train_cfg.steps} | {objective.log_text(record)} | lr {lr:.2e} | gnorm {grad_norm:.2f} | "
                f"step {1000 * record['step_time_s']:.0f} ms" + (f" | {objective.eval_text(record)}" if evaluated else ""))
        if metrics is not None:
            metrics.write(record)
        progress.interval = _Interval()
    elif evaluated:
        t_eval = time.perf_counter()
        extra = objective.evaluate(run.raw_model)
        progress.interval.t += time.perf_counter() - t_eval  # evaluation time is not step time
        run.say(f"step {done}: {objective.eval_text(extra)}")
        if metrics is not None:
            metrics.write({"step": done, **extra})
