"""The RHO-LOSS scoring pass (`datapipe score`): a copy of a curated folder whose shards gain `ref_loss`, each document's loss under a small reference model that never trained on it.

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

A document's `ref_loss` (float32) is its mean token loss over every token that has a next token in the
document, with the context the training loader gives it: documents longer than data.seq_len are cut
into pieces of data.seq_len tokens (positions restart per piece, a piece's last token predicts the
document's next one), as the loader's `split` policy does. A document of one token has no predicted
token: its ref_loss is 0 (it carries no label token in training either).

OUTPUT is a new curated folder (the input is never modified): shard i is the input's shard i plus the
`ref_loss` column (replacing one the input may have), written by `datapipe.core.shards`, with a
manifest of the new sha256s that records the scoring under `scoring` (its identity: the input's shard
checksums and the result-shaping settings). The input's tokenizer file is copied, its splits (eval)
are linked. The two reference runs stay in OUTPUT/reference/fold-{0,1} (config, metrics, checkpoint).
Every file is written atomically and the manifest last. A killed pass run again resumes: finished
reference runs are kept, an unfinished one resumes from its checkpoint, and the output is the same.
Run again over a finished output of the same input and settings, it does nothing; any other content
at OUTPUT is refused with an error before any work.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
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
from datapipe.train.model import GPT, ModelConfig, token_losses
from datapipe.train.objective import autocast

COLUMN = "ref_loss"
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
            elif dotted not in EXECUTION_KEYS and dotted not in IGNORED_KEYS:
                flat[dotted] = value

    walk(to_dict(cfg), "")
    return flat


# keys of the recipe that do not shape the reference runs: paths, evaluation, selection (see the module docstring)
IGNORED_KEYS = ("data.source", "data.eval_source", "data.holdout_shards", "train.output", "train.stop_at",
                "train.rho.enabled", "train.rho.candidates", "train.rho.column", "dpo.init_from")


def identity(manifest: dict[str, Any], cfg: TrainConfig) -> str:
    """What makes two scorings the same: the input's shard checksums and tokenizer, and the settings."""
    doc = {"shards": [s["sha256"] for s in manifest["shards"]], "tokenizer": manifest.get("tokenizer"),
           "settings": _settings(cfg), "column": COLUMN, "rule": FOLD_RULE}
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
        what = "a scoring of another input or with other settings" if theirs else "a curated folder, not a scoring"
        raise ConfigError(f"--output {str(out)!r} already holds {what}; {fix}")
    try:
        theirs = json.loads((out / MARKER).read_text()).get("identity")
    except (OSError, ValueError, AttributeError):
        theirs = None
    if theirs != ident:
        what = ("an unfinished scoring of another input or with other settings" if theirs
                else "files that are not a datapipe scoring")
        raise ConfigError(f"--output {str(out)!r} already holds {what}; {fix}")
    return False


def _device(kind: str) -> torch.device:
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but torch sees no CUDA device; allowed here: 'auto' or 'cpu'")
    return torch.device("cuda" if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()) else "cpu")


@torch.no_grad()
def document_losses(model: GPT, docs: list[np.ndarray], seq_len: int, rows_per_batch: int, device: torch.device,
                    pad_id: int = 0) -> np.ndarray:
    """Mean token loss of each document (float64; 0 for a document without a predicted token), packed into rows
    of `seq_len` as the training loader packs them (documents longer than seq_len cut into pieces)."""
    sums, counts = np.zeros(len(docs)), np.zeros(len(docs), dtype=np.int64)
    rows = pack([len(d) for d in docs], seq_len)  # document j has id j
    for start in range(0, len(rows), rows_per_batch):
        arrays = expand_batch(**compact_batch(rows[start:start + rows_per_batch], docs.__getitem__, seq_len,
                                              pad_id=pad_id))
        batch = {k: torch.from_numpy(v).to(device) for k, v in arrays.items()}
        with autocast(device):
            logits = model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"],
                           cu_seqlens=batch["cu_seqlens"])
        losses = token_losses(logits, batch["labels"]).double().cpu().numpy().reshape(-1)
        labelled = arrays["labels"].reshape(-1) != -100
        ids = arrays["doc_ids"].reshape(-1)[labelled]
        np.add.at(sums, ids, losses[labelled])
        np.add.at(counts, ids, 1)
    return np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)


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


def score(cfg: TrainConfig, output: str | os.PathLike[str], *, say: Callable[..., None] = print) -> dict[str, Any]:
    """Score `cfg.data.source` into the new curated folder `output` (see the module docstring); returns its manifest."""
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
    source, out = Path(cfg.data.source), Path(output)
    manifest = shards.read_manifest(source)
    ident = identity(manifest, cfg)
    if _check_output(source, out, ident):
        say(f"{out} already holds this scoring of {source}: nothing to do")
        return shards.read_manifest(out)
    shards.make_folder(out)
    shards.remove_temporaries(out)
    shards.atomic_write_json(out / MARKER, {"identity": ident, "source": str(source.resolve())})

    seed, steps = cfg.train.seed, cfg.train.steps
    tables = [shards.open_shard(source, info["path"]) for info in manifest["shards"]]
    folds = [np.array([fold_of(i, seed) for i in t.column("id").to_pylist()], dtype=np.int64) for t in tables]
    docs = [int(sum(int((f == k).sum()) for f in folds)) for k in range(FOLDS)]
    if min(docs) < 1:
        raise ConfigError(f"data.source {str(source)!r} has {docs[0]} and {docs[1]} documents in the two halves; "
                          "each half trains a reference model and needs at least one document")
    say(f"score: {sum(docs):,} documents of {source} in two halves ({docs[0]:,} / {docs[1]:,}, seed {seed}); "
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
        say(f"reference model {k}: training on half {k} ({docs[k]:,} documents) -> {run_dir}")
        train(fold_cfg, resume=resume)
    for k in range(FOLDS):
        shutil.rmtree(out / "reference" / f"fold-{k}-data", ignore_errors=True)

    device = _device(cfg.train.device)
    models = [_reference_model(run_dir, device) for run_dir in runs]
    eos = int(manifest.get("tokenizer", {}).get("eos_id") or 0)
    infos, totals = [], np.zeros((FOLDS, 2))  # per fold: (sum of ref_loss, documents)
    for i, table in enumerate(tables):
        tokens = table.column("tokens").combine_chunks() if table.num_rows else None
        ref = np.zeros(table.num_rows, dtype=np.float64)
        for k in range(FOLDS):
            rows = np.flatnonzero(folds[i] == k)
            if len(rows):
                offsets, values = tokens.offsets.to_numpy(), tokens.values.to_numpy(zero_copy_only=False)
                docs_k = [values[offsets[r]:offsets[r + 1]].astype(np.int64) for r in rows]
                ref[rows] = document_losses(models[1 - k], docs_k, cfg.data.seq_len, cfg.data.batch_size, device, eos)
                totals[k] += (ref[rows].sum(), len(rows))
        if COLUMN in table.column_names:
            table = table.drop_columns([COLUMN])
        infos.append(shards.write_shard(out, i, table.append_column(COLUMN, pa.array(ref.astype(np.float32)))))
        say(f"scored shard {i + 1}/{len(tables)}")

    scored = shards.build_manifest(infos, tokenizer=manifest.get("tokenizer", {}), config=manifest.get("config", {}),
                                   config_hash=manifest.get("config_hash", ""))
    tokenizer_path = (manifest.get("tokenizer") or {}).get("path")
    if tokenizer_path and (source / tokenizer_path).is_file() and not Path(tokenizer_path).is_absolute():
        shards.atomic_write_bytes(out / tokenizer_path, (source / tokenizer_path).read_bytes(), durable=True)
    splits = _link_splits(source, out, manifest)
    if splits:
        scored["splits"] = splits
    scored["scoring"] = {
        "identity": ident, "column": COLUMN, "source": str(source.resolve()), "rule": FOLD_RULE, "seed": seed,
        "steps": steps, "reference_runs": [str(r.relative_to(out)) for r in runs],
        "folds": {str(k): {"docs": int(totals[k, 1]), "mean_ref_loss": float(totals[k, 0] / max(totals[k, 1], 1))}
                  for k in range(FOLDS)},
    }
    shards.write_manifest(out, scored)
    say(f"wrote {out / shards.MANIFEST_NAME}: {scored['total_docs']:,} documents with {COLUMN} (mean "
        f"{float(totals[:, 0].sum() / max(totals[:, 1].sum(), 1)):.4f}); train on it with "
        "--set train.rho.enabled=true")
    return scored
