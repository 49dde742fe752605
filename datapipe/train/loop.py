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
from dataclasses import replace
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


def train(cfg: TrainConfig, *, resume: bool = False, default_preferences: Callable | None = None) -> dict[str, Any]:
    """Train `cfg.model` with `cfg.train.objective` for `cfg.train.steps` steps; returns a summary (rank 0's view).

    `default_preferences(out, n, log)` builds a preference folder when a DPO run has no data.source (the CLI passes
    `datapipe.curate.preferences.default_preference_set`; the training wing does not import curation)."""
    t_start = time.perf_counter()
    rank, world, device = _dist_setup(cfg.train.device)
    main = rank == 0
    say = print if main else (lambda *a, **k: None)
    run_dir = Path(cfg.train.output)
    ckpt_path = run_dir / "checkpoint.pt"

    # -- before any work: the data folders fit the objective; a fresh run needs a run folder without a run,
    #    --resume a checkpoint of the same run
    check_sources(cfg)
    check_trackers(cfg)
    ckpt: dict[str, Any] | None = None
    from_zero = (resume and not ckpt_path.exists() and not previous_path(ckpt_path).exists()
                 and (run_dir / "config.yaml").is_file())
    if from_zero:  # stopped before its first checkpoint: the same run again from step 0, with the run's settings
        _raise_on_all_ranks(resume_problem(_recorded(run_dir), cfg, f"the run's {run_dir / 'config.yaml'}")
                            if main else None, rank, world)
        say(f"--resume: {run_dir} stopped before its first checkpoint: starting it again from step 0 with its config")
    elif resume:
        ckpt = load_checkpoint(ckpt_path)  # a ConfigError naming the file when it is missing or damaged
        problem = resume_problem(ckpt.get("config", {}), cfg)
        if problem is None and objective_key(cfg) not in ckpt:
            problem = (f"--resume: {ckpt_path} holds no {objective_key(cfg)!r} (written by an older datapipe that could "
                       "not resume this objective); start a new run with another --output")
        if problem is None and len(ckpt[objective_key(cfg)]) != world:
            problem = (f"--resume: the checkpoint was written by {len(ckpt[objective_key(cfg)])} ranks, this run has "
                       f"world_size={world}; resume with the same number of processes")
        _raise_on_all_ranks(problem, rank, world)
    else:
        _raise_on_all_ranks(fresh_run_problem(run_dir) if main else None, rank, world)
    make_local_folder(run_dir, "train.output")  # a file in the way, a folder that cannot be made: said as such
    if main:  # nothing writes in the run folder yet: a temporary file there is a killed save's (or write's) leftover
        clear_temporaries(ckpt_path)

    # -- set up: the objective's data, model, optimizer, schedule (same seed on every rank: identical initial weights)
    objective = build_objective(cfg, run_dir, rank=rank, world=world, device=device, say=say,
                                default_preferences=default_preferences)
    cfg = replace(cfg, model=replace(cfg.model, vocab_size=objective.vocab_size))
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model).to(device)
    objective.init_model(model)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                  betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                                  fused=device.type == "cuda")
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    start, skipped = 0, 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        try:
            objective.load_rank_state(ckpt[objective.state_key][rank])
        except ValueError as exc:  # the data changed under the run
            raise ConfigError(f"--resume: {ckpt_path}: {exc}") from None
        objective.totals.update({k: int(v) for k, v in ckpt.get("totals", {}).items()})
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
        atomic_write_bytes(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())
    say(f"model: {raw_model.num_params(non_embedding=False) / 1e6:.2f} M parameters "
        f"({cfg.model.n_layer} layers, d_model {cfg.model.d_model}, vocab {cfg.model.vocab_size}); device {device}, "
        f"world {world}\n{objective.describe()}")

    def checkpoint(done: int) -> None:
        rng = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}
        states, rngs = _gather(objective.rank_state(), world), _gather(rng, world)
        if main:
            save_checkpoint(ckpt_path, {
                "step": done, "skipped": skipped, "objective": objective.name, "model": raw_model.state_dict(),
                "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), objective.state_key: states,
                "rng": rngs, "totals": dict(objective.totals), "config": to_dict(cfg)})
        if world > 1:
            dist.barrier()

    metrics = MetricsLog(cfg, run_dir, start=start, resume=resume) if main else None
    objective.start(raw_model)
    stop = min(cfg.train.stop_at or cfg.train.steps, cfg.train.steps)
    in_a_row, losses, record = 0, [], {}
    interval = {"t": time.perf_counter(), "steps": 0, "skipped": 0}
    last_ckpt = time.monotonic()
    try:
        for step in range(start, stop):
            lr = scheduler.get_last_lr()[0]
            micro = objective.next_step()
            sums = objective.backward(model, micro)
            # one all-reduce: the objective's sums, and whether any rank's wall-clock checkpoint is due
            time_due = bool(cfg.train.ckpt_minutes) and time.monotonic() - last_ckpt >= 60 * cfg.train.ckpt_minutes
            sums = torch.cat([sums, torch.tensor([float(time_due)], dtype=torch.float64, device=sums.device)])
            if world > 1:
                dist.all_reduce(sums)
            sums, time_due = sums[:-1], bool(sums[-1] > 0)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.optim.grad_clip or float("inf")))
            step_loss = objective.step_loss(sums)
            ok = math.isfinite(step_loss) and math.isfinite(grad_norm)
            if ok:
                optimizer.step()
                in_a_row = 0
            else:  # skip the update; the data is consumed and the schedule moves on
                skipped += 1
                in_a_row += 1
                interval["skipped"] += 1
                say(f"step {step + 1}: non-finite loss {step_loss} or grad norm {grad_norm}: update skipped "
                    f"({in_a_row} in a row, {skipped} in all)")
                if in_a_row >= cfg.train.max_nonfinite:
                    raise RunStopped(f"stopping at step {step + 1}: {in_a_row} non-finite losses or gradients in a row "
                                     f"(train.max_nonfinite={cfg.train.max_nonfinite}); lower optim.lr or check the data")
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            objective.add(sums, ok)
            losses.append(step_loss)
            interval["steps"] += 1
            done = step + 1
            last = done == stop

            evaluated = objective.can_evaluate and ((cfg.train.eval_every and done % cfg.train.eval_every == 0) or last)
            if done % cfg.train.log_every == 0 or last:
                seconds = max(time.perf_counter() - interval["t"], 1e-9)
                fields = objective.log_fields(seconds)
                record = {"step": done, "loss": fields.pop("loss"), "lr": lr, "grad_norm": grad_norm,
                          "step_time_s": seconds / interval["steps"], "skipped": interval["skipped"], **fields}
                if evaluated:
                    record.update(objective.evaluate(raw_model))
                say(f"step {done}/{cfg.train.steps} | {objective.log_text(record)} | lr {lr:.2e} | gnorm {grad_norm:.2f} | "
                    f"step {1000 * record['step_time_s']:.0f} ms" + (f" | {objective.eval_text(record)}" if evaluated else ""))
                if metrics is not None:
                    metrics.write(record)
                interval = {"t": time.perf_counter(), "steps": 0, "skipped": 0}
            elif evaluated:
                t_eval = time.perf_counter()
                extra = objective.evaluate(raw_model)
                interval["t"] += time.perf_counter() - t_eval  # evaluation time is not step time
                say(f"step {done}: {objective.eval_text(extra)}")
                if metrics is not None:
                    metrics.write({"step": done, **extra})

            if (cfg.train.ckpt_every and done % cfg.train.ckpt_every == 0) or last or time_due:
                checkpoint(done)
                last_ckpt = time.monotonic()
    finally:
        objective.close()
        if metrics is not None:
            metrics.close()
    seconds = time.perf_counter() - t_start
    summary = {"params_sha256": _params_sha256(raw_model), "run_dir": str(run_dir), "objective": objective.name,
               "steps": stop, "start_step": start, "losses": losses, "final_loss": losses[-1] if losses else None,
               "skipped": skipped, "seconds": seconds, "world_size": world, **objective.summary(record)}
    say(f"done: {stop - start} steps in {seconds:.1f} s; checkpoint {ckpt_path}; metrics {run_dir / 'metrics.jsonl'}")
    return summary

