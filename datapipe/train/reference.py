"""The RHO-LOSS scoring pass (`datapipe score`): a copy of a curated folder whose shards gain `ref_loss`, each token's loss under a small reference model that never trained on its document.

    datapipe score configs/train-tiny.yaml --data out/run --output out/run-scored --steps 300 --seed 0
    datapipe train configs/train-tiny.yaml --data out/run-scored --set train.rho.enabled=true

RHO-LOSS (Mindermann et al. 2022, "Prioritized Training on Points that are Learnable, Worth Learning,
and Not Yet Learnt") trains on the points of highest reducible loss: the training model's loss minus
the point's irreducible loss, the loss of an "irreducible loss model" trained on held-out data. The
selection is in datapipe/train/lm.py (`train.rho`); this pass computes the irreducible losses once.

Held-out data without a holdout set, the paper's variant for that case: the documents are split in
two halves by a seeded hash of their id (`fold_of`: the first 8 bytes of sha256("{seed}:{id}"), mod 2),
one reference model is trained on each half with the bundled trainer (`datapipe.train.loop.train`, the
recipe's model, optimizer, schedule, data.seq_len and data.batch_size, `train.steps` steps, seed
`train.seed`), and each document is scored by the model of the OTHER half. The source's eval split
is never read, and the reference runs evaluate nothing (the recipe's data.eval_source,
data.holdout_shards, train.rho and train.stop_at do not apply to them).

A document's `ref_loss` is a list of float32 as long as its `tokens` (format 2): value t is the loss of
predicting token t + 1 at position t, with the context the training loader gives it: documents longer
than data.seq_len are cut into pieces of data.seq_len tokens (positions restart per piece, a piece's last
token predicts the document's next one), as the loader's `split` policy does; the last token predicts
nothing (0). The loader carries it through packing like the tokens (`PackedLoader(token_columns=
("ref_loss",))`: a piece [start, end) gets values [start, end)), so a training row's reducible loss uses
the reference loss of exactly the tokens it trains on: a 256-token piece of a long document is compared
with that piece's reference losses, not with the document's mean. With the same data.seq_len in training
the contexts are the scoring's too (another seq_len cuts other pieces: the values are then the scoring's
contexts'). `ref_loss_mean` (float32, one per document) is the mean over its tokens but the last (0 for a
document of one token), for document-level uses: `ref_band` and the summary. Format 1 (before) stored one
ref_loss per document; its folders are refused by the trainer and by a new scoring into them, with that said.

Compute, recorded under the manifest's `scoring`: `params` (N, `datapipe.train.lm.flops_params`, the trainer's
convention), `train_tokens` (the document tokens both reference runs trained on),
`forward_tokens` (the document tokens forwarded to score them: every token of the pool, once) and `flops` =
6 N train_tokens + 2 N forward_tokens. The pass is paid once per pool and reference recipe; every arm that trains
on this folder's `ref_loss` (RHO-LOSS, the `ref_band` subset) uses it.

OUTPUT is a new curated folder (the input is never modified): shard i is the input's shard i plus the
`ref_loss` and `ref_loss_mean` columns (replacing ones the input may have), written by `datapipe.core.shards`, with a
manifest of the new sha256s that records the scoring under `scoring` (its identity: the input's shard
checksums and the result-shaping settings). The input's tokenizer file is copied, its splits (eval)
are linked. The two reference runs stay in OUTPUT/reference/fold-{0,1} (config, metrics, checkpoint).
Every file is written atomically and the manifest last. A killed pass run again resumes: finished
reference runs are kept, an unfinished one resumes from its checkpoint, and the output is the same.
It prints a line per reference model, one for the scoring of the shards and a summary; `--verbose` (`verbose=True`)
adds the plan, the reference models' trainer lines (every log step) and a line per scored shard.
Run again over a finished output of the same input and settings, it does nothing; any other content
at OUTPUT is refused with an error before any work.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import torch

from datapipe.core import shards
from datapipe.core.config import ConfigError, from_dict, to_dict
from datapipe.loader.packing import compact_batch, expand_batch, pack
from datapipe.train.checkpoint import load_checkpoint
from datapipe.train.config import EXECUTION_KEYS, RhoConfig, TrainConfig, check_sources
from datapipe.train.loop import RUN_FILES, train
from datapipe.train.lm import flops_params
from datapipe.train.model import GPT, ModelConfig, token_losses
from datapipe.train.objective import autocast

COLUMN = "ref_loss"  # per token: a list as long as `tokens`
MEAN_COLUMN = "ref_loss_mean"  # per document: the mean of its tokens' (all but the last) reference losses
FORMAT = 2  # 1: one ref_loss per document (its mean); 2: ref_loss per token and ref_loss_mean per document
FOLDS = 2
MARKER = "scoring.json"  # written first: OUTPUT is a scoring in progress of this identity
FOLD_RULE = "fold = int.from_bytes(sha256(f'{seed}:{id}')[:8], 'big') % 2; a document is scored by the other fold's model"


def fold_of(doc_id: str, seed: int) -> int:
    """The half (0 or 1) of document `doc_id`: a seeded hash of the id, independent of order and sharding."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{doc_id}".encode()).digest()[:8], "big") % FOLDS


def _settings(cfg: TrainConfig) -> dict[str, Any]:
    """The result-shaping settings of the reference runs (no paths, no execution keys)."""
    flat: dict[str, Any] = {}

    def walk(tree: Any, prefix: str) -> None:
        for key, value in tree.items():
            dotted = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                walk(value, dotted)
            elif dotted not in EXECUTION_KEYS and dotted not in IGNORED_KEYS and not dotted.startswith("train.rho."):
                flat[dotted] = value

    walk(to_dict(cfg), "")
    return flat


# keys of the recipe that do not shape the reference runs: paths, evaluation, selection (see the module docstring)
IGNORED_KEYS = ("data.source", "data.eval_source", "data.holdout_shards", "train.output", "train.stop_at",
                "dpo.init_from")  # and every train.rho key


def identity(manifest: dict[str, Any], cfg: TrainConfig) -> str:
    """What makes two scorings the same: the input's shard checksums and tokenizer, and the settings."""
    doc = {"shards": [s["sha256"] for s in manifest["shards"]], "tokenizer": manifest.get("tokenizer"),
           "settings": _settings(cfg), "column": COLUMN, "rule": FOLD_RULE, "format": FORMAT}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def _check_output(source: Path, out: Path, ident: str) -> bool:
    """True when OUTPUT is a finished scoring of this identity (nothing to do); raises when OUTPUT holds anything
    but that or an unfinished scoring of this identity."""
    if out.resolve() == source.resolve() or source.resolve() in out.resolve().parents \
            or out.resolve() in source.resolve().parents:
        raise ConfigError(f"--output {str(out)!r} must be a new folder outside the input {str(source)!r} and not "
                          "holding it (the scoring pass never modifies its input); choose another --output")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {str(out)!r} is a file; choose a folder")
    if not out.exists() or not any(out.iterdir()):
        return False
    fix = "choose another --output, or delete that folder to score again"
    if (out / shards.MANIFEST_NAME).exists():
        try:
            theirs = shards.read_manifest(out).get("scoring", {}).get("identity")
        except (ValueError, OSError) as exc:
            raise ConfigError(f"--output {str(out)!r} holds a manifest.json that is not a datapipe manifest ({exc}); "
                              f"{fix}") from None
        if theirs == ident:
            return True
        old = shards.read_manifest(out).get("scoring", {}).get("format", 1) if theirs else FORMAT
        what = ("a scoring written by an older `datapipe score` (format 1: one ref_loss per document; training now "
                "needs ref_loss per token)" if old != FORMAT
                else "a scoring of another input or with other settings" if theirs else "a curated folder, not a scoring")
        raise ConfigError(f"--output {str(out)!r} already holds {what}; {fix}")
    try:
        marker = json.loads((out / MARKER).read_text())
        theirs, old = marker.get("identity"), marker.get("format", 1)
    except (OSError, ValueError, AttributeError):
        theirs, old = None, FORMAT
    if theirs != ident:
        what = ("an unfinished scoring by an older `datapipe score` (format 1: one ref_loss per document)" if old != FORMAT
                else "an unfinished scoring of another input or with other settings" if theirs
                else "files that are not a datapipe scoring")
        raise ConfigError(f"--output {str(out)!r} already holds {what}; {fix}")
    return False


def _device(kind: str) -> torch.device:
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but torch sees no CUDA device; allowed here: 'auto' or 'cpu'")
    return torch.device("cuda" if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()) else "cpu")


@torch.no_grad()
def document_token_losses(model: GPT, docs: list[np.ndarray], seq_len: int, rows_per_batch: int,
                          device: torch.device, pad_id: int = 0) -> list[np.ndarray]:
    """Each document's per-token losses (float32, as long as the document): value t is the loss of predicting
    token t + 1 from token t and the tokens before it in its piece (the loss of the label at input position t);
    the last token predicts nothing (0). Documents are packed into rows of `seq_len` as the training loader packs
    them (documents longer than seq_len cut into pieces of seq_len tokens, a piece's last token predicting the
    document's next one)."""
    out = [np.zeros(len(d), dtype=np.float32) for d in docs]
    rows = pack([len(d) for d in docs], seq_len)  # document j has id j
    for start in range(0, len(rows), rows_per_batch):
        chunk = rows[start:start + rows_per_batch]
        arrays = expand_batch(**compact_batch(chunk, docs.__getitem__, seq_len, pad_id=pad_id))
        batch = {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}
        with autocast(device):
            logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"],
                           cu_seqlens=batch["cu_seqlens"])
        losses = token_losses(logits, batch["labels"]).float().cpu().numpy()  # 0 where there is no label
        for r, row in enumerate(chunk):
            off = 0
            for p in row:
                out[p.doc][p.start:p.end] = losses[r, off:off + p.length]
                off += p.length
    return out


def mean_loss(values: np.ndarray) -> float:
    """A document's mean token loss from its per-token losses: over the tokens that predict one (all but the last);
    0 for a document of one token."""
    return float(values[:-1].astype(np.float64).mean()) if len(values) > 1 else 0.0


def _write_fold_data(source: Path, manifest: dict[str, Any], folds: list[np.ndarray], k: int, folder: Path) -> None:
    """A curated folder of the input's documents of fold k (one shard per input shard that holds any)."""
    if (folder / shards.MANIFEST_NAME).exists():
        return
    infos = []
    for i, info in enumerate(manifest["shards"]):
        table = shards.open_shard(source, info["path"])
        part = table.filter(pa.array(folds[i] == k))
        if part.num_rows:
            infos.append(shards.write_shard(folder, len(infos), part))
    shards.write_manifest(folder, shards.build_manifest(infos, tokenizer=manifest.get("tokenizer", {}),
                                                        config={"scoring_fold": k}, config_hash=f"fold-{k}"))


def _reference_model(run_dir: Path, device: torch.device) -> GPT:
    ckpt = load_checkpoint(run_dir / "checkpoint.pt", what="datapipe score")
    model = GPT(from_dict(ModelConfig, ckpt["config"]["model"], "model"))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def _finished(run_dir: Path, steps: int) -> bool:
    ckpt = run_dir / "checkpoint.pt"
    return ckpt.exists() and int(load_checkpoint(ckpt, what="datapipe score")["step"]) == steps


def _link_splits(source: Path, out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The input's splits (eval), linked into OUTPUT at the same relative paths; returns the manifest entry."""
    splits = {}
    for name, entry in manifest.get("splits", {}).items():
        target = (source / entry["path"]).resolve()
        if not target.exists():
            continue
        link = out / entry["path"]
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
        splits[name] = entry
    return splits


def _derived_manifest(source: Path, out: Path, manifest: dict[str, Any], infos: list[Any]) -> dict[str, Any]:
    """The manifest of a folder derived from `source` (its shards `infos`, written to `out`): the source's tokenizer,
    config and hash, its tokenizer file copied, its splits linked."""
    derived = shards.build_manifest(infos, tokenizer=manifest.get("tokenizer", {}), config=manifest.get("config", {}),
                                    config_hash=manifest.get("config_hash", ""))
    tokenizer_path = (manifest.get("tokenizer") or {}).get("path")
    if tokenizer_path and (source / tokenizer_path).is_file() and not Path(tokenizer_path).is_absolute():
        shards.atomic_write_bytes(out / tokenizer_path, (source / tokenizer_path).read_bytes(), durable=True)
    splits = _link_splits(source, out, manifest)
    if splits:
        derived["splits"] = splits
    return derived


def score(cfg: TrainConfig, output: str | os.PathLike[str], *, say: Callable[..., None] = print,
          verbose: bool = False) -> dict[str, Any]:
    """Score `cfg.data.source` into the new curated folder `output` (see the module docstring); returns its manifest.

    `say` gets one line per reference model, one for the scoring of the shards and a last one (documents and tokens
    scored, seconds, the manifest); `verbose`: also the plan, the reference models' trainer lines (every log step)
    and a line per scored shard."""
    t_start = time.perf_counter()
    cfg = _scoring_config(cfg)
    source, out = Path(cfg.data.source), Path(output)
    manifest = shards.read_manifest(source)
    ident = identity(manifest, cfg)
    if _check_output(source, out, ident):
        say(f"{out} already holds this scoring of {source}: nothing to do")
        return shards.read_manifest(out)
    shards.make_folder(out)
    shards.remove_temporaries(out)
    shards.atomic_write_json(out / MARKER, {"identity": ident, "format": FORMAT, "source": str(source.resolve())})

    tables = [shards.open_shard(source, info["path"]) for info in manifest["shards"]]
    folds = [np.array([fold_of(i, cfg.train.seed) for i in t.column("id").to_pylist()], dtype=np.int64) for t in tables]
    detail = say if verbose else None  # the sub-step lines: the plan, the trainer's, one per shard
    runs = _train_reference_models(cfg, source, out, manifest, folds, say, detail)
    device = _device(cfg.train.device)
    models = [_reference_model(run_dir, device) for run_dir in runs]
    train_tokens = sum(int(load_checkpoint(r / "checkpoint.pt", what="datapipe score").get("totals", {}).get("tokens", 0))
                       for r in runs)
    eos = int(manifest.get("tokenizer", {}).get("eos_id") or 0)
    t_pass = time.perf_counter()
    infos, totals, forward_tokens = _score_shards(cfg, out, tables, folds, models, device, eos, detail)
    say(f"scoring pass: {len(tables)} shards, each document through the other half's reference model "
        f"({forward_tokens:,} tokens forwarded), in {time.perf_counter() - t_pass:.1f} s")

    scored = _derived_manifest(source, out, manifest, infos)
    scored["scoring"] = _scoring_entry(cfg, ident, source, out, runs, totals, params=flops_params(models[0]),
                                       train_tokens=train_tokens, forward_tokens=forward_tokens)
    shards.write_manifest(out, scored)
    say(f"score: {scored['total_docs']:,} documents, {scored['total_tokens']:,} tokens scored in "
        f"{time.perf_counter() - t_start:.1f} s ({COLUMN} per token, mean "
        f"{float(totals[:, 0].sum() / max(totals[:, 1].sum(), 1)):.4f}; {scored['scoring']['flops']:.3g} FLOPs) -> "
        f"{out / shards.MANIFEST_NAME}; train on it with --set train.rho.enabled=true")
    return scored


def _scoring_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` as the scoring pass runs it: one process, a local folder of text shards, no eval; or a ConfigError."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("`datapipe score` runs as one process (each reference model is small); run it without torchrun")
    if "://" in cfg.data.source and not cfg.data.source.startswith("file://"):
        raise ConfigError(f"data.source must be a local folder for `datapipe score`, got {cfg.data.source!r}")
    if cfg.train.objective != "lm":
        raise ConfigError(f"train.objective must be 'lm' for `datapipe score` (it scores text shards), "
                          f"got {cfg.train.objective!r}")
    cfg = replace(cfg, data=replace(cfg.data, source=cfg.data.source.removeprefix("file://"), eval_source=None,
                                    holdout_shards=0))
    check_sources(cfg)  # a curated folder of text shards with documents, or a ConfigError naming data.source
    return cfg


def _train_reference_models(cfg: TrainConfig, source: Path, out: Path, manifest: dict[str, Any],
                            folds: list[np.ndarray], say: Callable[..., None],
                            detail: Callable[..., None] | None) -> list[Path]:
    """One reference model per half, each trained on its half's documents (kept when finished, resumed from its
    checkpoint when killed), a line each to `say`; the plan and the trainer's lines to `detail` (None: nowhere).
    Returns their run folders."""
    seed, steps = cfg.train.seed, cfg.train.steps
    docs = [int(sum(int((f == k).sum()) for f in folds)) for k in range(FOLDS)]
    if min(docs) < 1:
        raise ConfigError(f"data.source {str(source)!r} has {docs[0]} and {docs[1]} documents in the two halves; "
                          "each half trains a reference model and needs at least one document")
    if detail:
        detail(f"score: {sum(docs):,} documents of {source} in two halves ({docs[0]:,} / {docs[1]:,}, seed {seed}); "
               f"one reference model per half, {steps} steps each; the recipe's eval and train.rho settings do not apply")
    runs = [out / "reference" / f"fold-{k}" for k in range(FOLDS)]
    for k, run_dir in enumerate(runs):
        if _finished(run_dir, steps):
            say(f"reference model {k}: finished ({run_dir})")
            continue
        data_dir = out / "reference" / f"fold-{k}-data"
        _write_fold_data(source, manifest, folds, k, data_dir)
        resume = (run_dir / "checkpoint.pt").exists()
        if not resume:  # killed before its first checkpoint: nothing to resume, start it again
            for name in RUN_FILES:
                (run_dir / name).unlink(missing_ok=True)
        fold_cfg = replace(cfg, data=replace(cfg.data, source=str(data_dir)),
                           train=replace(cfg.train, output=str(run_dir), stop_at=0, rho=RhoConfig()))
        if detail:
            detail(f"reference model {k}: training on half {k} ({docs[k]:,} documents) -> {run_dir}")
        done = train(fold_cfg, resume=resume, say=detail)
        say(f"reference model {k}: {steps} steps on half {k} ({docs[k]:,} documents), {done['tokens']:,} tokens"
            + (f" (resumed from step {done['start_step']})" if done["start_step"] else "")
            + f"{_last_loss(run_dir)}, in {done['seconds']:.1f} s -> {run_dir}")
    for k in range(FOLDS):
        shutil.rmtree(out / "reference" / f"fold-{k}-data", ignore_errors=True)
    return runs


def _last_loss(run_dir: Path) -> str:
    """The train loss of the run's last log record (the one its last step line shows) as ", train loss X"; "" when
    it has none."""
    for line in reversed((run_dir / "metrics.jsonl").read_text().splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("loss"), (int, float)):
            return f", train loss {record['loss']:.4f}"
    return ""


def _score_shards(cfg: TrainConfig, out: Path, tables: list[pa.Table], folds: list[np.ndarray], models: list[GPT],
                  device: torch.device, eos: int,
                  detail: Callable[..., None] | None) -> tuple[list[Any], np.ndarray, int]:
    """Every input shard with its reference losses, written to `out` (a line each to `detail`, None: nowhere);
    returns the shards' infos, per fold the sum of the documents' ref_loss_mean and their number, and the tokens
    forwarded."""
    infos, totals = [], np.zeros((FOLDS, 2))  # per fold: (sum of ref_loss_mean, documents)
    forward_tokens = 0
    for i, table in enumerate(tables):
        per_token, forwarded = _shard_token_losses(cfg, table, folds[i], models, device, eos)
        forward_tokens += forwarded
        means = np.array([mean_loss(v) for v in per_token], dtype=np.float64)
        for k in range(FOLDS):
            totals[k] += (means[folds[i] == k].sum(), int((folds[i] == k).sum()))
        infos.append(shards.write_shard(out, i, _with_ref_columns(table, per_token, means)))
        if detail:
            detail(f"scored shard {i + 1}/{len(tables)}")
    return infos, totals, forward_tokens


def _shard_token_losses(cfg: TrainConfig, table: pa.Table, fold: np.ndarray, models: list[GPT], device: torch.device,
                        eos: int) -> tuple[list[np.ndarray], int]:
    """Each document's per-token losses under the model of the other half, and the tokens forwarded to get them."""
    per_token: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * table.num_rows
    forwarded = 0
    if not table.num_rows:
        return per_token, forwarded
    tokens = table.column("tokens").combine_chunks()
    offsets, values = tokens.offsets.to_numpy(), tokens.values.to_numpy(zero_copy_only=False)
    for k in range(FOLDS):
        rows = np.flatnonzero(fold == k)
        if len(rows):
            docs_k = [values[offsets[r]:offsets[r + 1]].astype(np.int64) for r in rows]
            losses = document_token_losses(models[1 - k], docs_k, cfg.data.seq_len, cfg.data.batch_size, device, eos)
            for r, v in zip(rows.tolist(), losses):
                per_token[r] = v
            forwarded += sum(len(d) for d in docs_k)
    return per_token, forwarded


def _with_ref_columns(table: pa.Table, per_token: list[np.ndarray], means: np.ndarray) -> pa.Table:
    """`table` with the ref_loss (a float32 list per document) and ref_loss_mean columns, replacing ones it had."""
    table = table.drop_columns([c for c in (COLUMN, MEAN_COLUMN) if c in table.column_names])
    lengths = np.array([len(v) for v in per_token], dtype=np.int64)
    column = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
        pa.array(np.concatenate(per_token) if per_token else np.zeros(0, dtype=np.float32), pa.float32()))
    return table.append_column(COLUMN, column).append_column(MEAN_COLUMN, pa.array(means.astype(np.float32)))


def _scoring_entry(cfg: TrainConfig, ident: str, source: Path, out: Path, runs: list[Path], totals: np.ndarray, *,
                   params: int, train_tokens: int, forward_tokens: int) -> dict[str, Any]:
    """The scored manifest's `scoring`: the identity, the rule and settings, each half's figures and the compute."""
    return {
        "identity": ident, "format": FORMAT, "column": COLUMN, "granularity": "token", "mean_column": MEAN_COLUMN,
        "source": str(source.resolve()), "rule": FOLD_RULE, "seed": cfg.train.seed, "steps": cfg.train.steps,
        "seq_len": cfg.data.seq_len, "reference_runs": [str(r.relative_to(out)) for r in runs],
        "folds": {str(k): {"docs": int(totals[k, 1]), "mean_ref_loss": float(totals[k, 0] / max(totals[k, 1], 1))}
                  for k in range(FOLDS)},
        # compute of the pass (the FLOPs convention of datapipe.train.lm.flops_params): both reference models'
        # training (6 N per token trained) and the forward of every document by the other half's model (2 N)
        "params": params, "train_tokens": train_tokens, "forward_tokens": int(forward_tokens),
        "flops": 6 * params * train_tokens + 2 * params * int(forward_tokens),
    }


BAND_RULE = ("per domain (or over the pool), documents sorted by ref_loss_mean (ties: shard order) each span a share of "
             "the tokens; a document is kept when the middle of its span lies in [low, high]")


def band_mask(means: np.ndarray, tokens: np.ndarray, low: float, high: float) -> np.ndarray:
    """Which documents lie in the token-weighted band [low, high] of `means`: sorted by mean (stable), each
    document spans a share of the tokens, and is kept when the middle of its span lies in [low, high]."""
    order = np.argsort(means, kind="stable")
    share = tokens[order] / max(int(tokens.sum()), 1)
    middle = np.cumsum(share) - share / 2
    keep = np.zeros(len(means), dtype=bool)
    keep[order] = (middle >= low) & (middle <= high)
    return keep


def ref_band(scored: str | os.PathLike[str], output: str | os.PathLike[str], *, low: float, high: float,
             per_domain: bool = True, say: Callable[..., None] = print) -> dict[str, Any]:
    """A static learnability subset of a scored folder: a new curated folder of the documents whose `ref_loss_mean`
    (the reference models' mean loss on them) lies in the middle band between the token-weighted quantiles `low`
    and `high` (per domain by default, so the domain mixture stays the pool's). It drops the lowest reference losses
    (text a small model already predicts: boilerplate, repeats, license headers) and the highest (text it cannot:
    noise, encoded data). Training on it is uniform sampling of the subset: no per-step selection cost; the one-off
    cost is the scoring pass (`scoring.flops`, copied into this folder's manifest with the band under `ref_band`).
    The shards keep every column (ref_loss too). The eval split is linked, not filtered. Returns the manifest; run
    again with the same settings it does nothing; another band into the same OUTPUT is refused."""
    if not 0 <= low < high <= 1:
        raise ConfigError(f"ref_band needs 0 <= low < high <= 1, got low={low!r}, high={high!r}")
    source, out = Path(scored), Path(output)
    manifest = shards.read_manifest(source)
    scoring = manifest.get("scoring")
    if not scoring or scoring.get("format", 1) != FORMAT:
        raise ConfigError(f"ref_band needs a folder written by `datapipe score` (format {FORMAT}); {str(source)!r} "
                          + ("is not one" if not scoring else "was scored by an older version: score it again"))
    band = {"low": low, "high": high, "per_domain": per_domain, "rule": BAND_RULE, "scored": scoring["identity"]}
    if (out / shards.MANIFEST_NAME).is_file():
        theirs = shards.read_manifest(out).get("ref_band", {})
        if {k: theirs.get(k) for k in band} == band:
            say(f"{out} already holds this band of {source}: nothing to do")
            return shards.read_manifest(out)
        raise ConfigError(f"--output {str(out)!r} already holds another folder; choose another output or delete it")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--output {str(out)!r} is not empty; choose another output or delete it")
    tables = [shards.open_shard(source, info["path"]) for info in manifest["shards"]]
    means = [t.column(MEAN_COLUMN).to_numpy().astype(np.float64) for t in tables]
    tokens = [t.column("num_tokens").to_numpy().astype(np.int64) for t in tables]
    domains = [np.asarray(t.column("domain").to_pylist(), dtype=object) for t in tables]
    all_means, all_tokens, all_domains = np.concatenate(means), np.concatenate(tokens), np.concatenate(domains)
    keep_all = np.zeros(len(all_means), dtype=bool)
    limits = {}
    for g in (sorted(set(all_domains.tolist())) if per_domain else [None]):
        sel = np.flatnonzero(all_domains == g) if g is not None else np.arange(len(all_means))
        keep_all[sel] = band_mask(all_means[sel], all_tokens[sel], low, high)
        kept = all_means[sel][keep_all[sel]]
        limits["*" if g is None else g] = [float(kept.min()), float(kept.max())] if len(kept) else None
    if not keep_all.any():
        raise ConfigError(f"ref_band low={low} high={high} keeps no document of {str(source)!r}; widen the band")
    shards.make_folder(out)
    shards.remove_temporaries(out)
    infos, start = [], 0
    for t in tables:
        keep = keep_all[start:start + t.num_rows]
        start += t.num_rows
        if keep.any():
            infos.append(shards.write_shard(out, len(infos), t.filter(pa.array(keep))))
    kept_docs, kept_tokens = int(keep_all.sum()), int(all_tokens[keep_all].sum())
    result = _derived_manifest(source, out, manifest, infos)
    # the scoring this subset was cut by (its compute: `flops`), not a scoring of this folder: no identity
    result["scoring"] = {**{k: v for k, v in scoring.items() if k != "identity"}, "derived": "ref_band",
                         "scored_identity": scoring["identity"], "scored_folder": str(source.resolve())}
    result["ref_band"] = {**band, "kept_ref_loss_mean": limits,
                          "docs": kept_docs, "tokens": kept_tokens, "of_docs": int(len(all_means)),
                          "of_tokens": int(all_tokens.sum())}
    shards.write_manifest(out, result)
    say(f"ref_band: kept {kept_docs:,} of {len(all_means):,} documents ({kept_tokens:,} of {int(all_tokens.sum()):,} "
        f"tokens) with ref_loss_mean in the [{low}, {high}] token quantiles{' per domain' if per_domain else ''} -> {out}")
    return result
