"""The RHO-LOSS scoring pass (`datapipe score`, datapipe/train/reference.py): ref_loss by the other half's model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from datapipe.cli import main
from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.train.reference import MARKER, _reference_model, fold_of, score
from helpers import tiny_cfg, write_train_source

SEQ = 64  # tiny_cfg's data.seq_len; write_train_source's documents are 10-89 tokens, so some are cut in two


def _cfg(src: Path, *overrides: str):
    return tiny_cfg(src, src.parent / "unused-run", "train.steps=4", "train.log_every=4", "train.ckpt_every=4",
                    *overrides)


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    src = write_train_source(root / "src")
    before = (src / "manifest.json").read_bytes()
    out = root / "scored"
    manifest = score(_cfg(src), out)
    return src, out, manifest, before


def _doc_loss(model, toks: list[int]) -> float:
    """Mean next-token loss of one document, computed alone: pieces of SEQ tokens, each piece's last token
    predicting the document's next one (the loader's `split` policy), no packing."""
    t = torch.tensor(toks)
    total, count = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(toks), SEQ):
            piece = t[a:a + SEQ]
            target = t[a + 1:a + SEQ + 1]
            logits = model(piece[None])[0, :len(target)]
            total += float(F.cross_entropy(logits, target, reduction="sum"))
            count += len(target)
    return total / count


def test_every_document_gets_the_loss_of_the_model_that_did_not_train_on_it(scored):
    src, out, manifest, before = scored
    assert (src / "manifest.json").read_bytes() == before  # the input is never modified
    assert manifest["total_docs"] == 90 and manifest["num_shards"] == 3
    for info in manifest["shards"]:
        shards.verify_shard(out, info)  # the manifest holds the new files' checksums
    models = [_reference_model(out / "reference" / f"fold-{k}", torch.device("cpu")) for k in (0, 1)]
    folds, own_differs = [], 0
    for src_info, info in zip(shards.read_manifest(src)["shards"], manifest["shards"]):
        original, table = shards.open_shard(src, src_info["path"]), shards.open_shard(out, info["path"])
        assert table.column("ref_loss").type == "float" and table.num_rows == original.num_rows
        for name in original.column_names:  # the input's columns, unchanged
            assert table.column(name).equals(original.column(name))
        for doc_id, toks, ref in zip(*(table.column(c).to_pylist() for c in ("id", "tokens", "ref_loss"))):
            fold = fold_of(doc_id, 0)
            folds.append(fold)
            assert np.isfinite(ref)
            assert ref == pytest.approx(_doc_loss(models[1 - fold], toks), abs=1e-4)  # the other half's model
            own_differs += abs(ref - _doc_loss(models[fold], toks)) > 1e-3
    assert 0 < sum(folds) < len(folds)  # both halves hold documents
    assert manifest["scoring"]["folds"]["1"]["docs"] == sum(folds)
    assert own_differs > 0.9 * len(folds)  # the two models differ: the test would see the wrong one


def test_fold_is_a_seeded_hash_of_the_id():
    ids = [f"doc-{i}" for i in range(400)]
    halves = [fold_of(i, 0) for i in ids]
    assert 150 < sum(halves) < 250  # about half
    assert halves == [fold_of(i, 0) for i in ids]  # no state: the same id, the same half
    assert halves != [fold_of(i, 1) for i in ids]  # the seed changes the split


def test_rerun_over_a_finished_output_is_a_no_op(scored, capsys):
    src, out, manifest, _ = scored
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert score(_cfg(src), out) == manifest
    assert "nothing to do" in capsys.readouterr().out
    assert stamps == {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="another input or with other settings"):
        score(_cfg(src, "train.steps=5"), out)


def test_a_killed_pass_resumes_to_the_same_output(scored, tmp_path):
    src, out, manifest, _ = scored
    again = tmp_path / "again"
    # a pass killed after reference model 0 finished, before model 1's first checkpoint and the shards
    (again / "reference").mkdir(parents=True)
    (again / MARKER).write_text((out / MARKER).read_text())
    for name in ("checkpoint.pt", "checkpoint.pt.sha256", "config.yaml", "metrics.jsonl"):
        if (out / "reference" / "fold-0" / name).exists():
            (again / "reference" / "fold-0").mkdir(exist_ok=True)
            (again / "reference" / "fold-0" / name).write_bytes((out / "reference" / "fold-0" / name).read_bytes())
    (again / "reference" / "fold-1").mkdir()
    (again / "reference" / "fold-1" / "metrics.jsonl").write_text("{}\n")  # no checkpoint yet
    resumed = score(_cfg(src), again)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in manifest["shards"]]
    assert not (again / "reference" / "fold-0-data").exists()  # the halves' copies are gone


def test_errors_before_any_work(scored, tmp_path):
    src, out, _, _ = scored
    with pytest.raises(ConfigError, match="data.source"):
        score(_cfg(tmp_path / "missing"), tmp_path / "o1")
    with pytest.raises(ConfigError, match="outside the input"):
        score(_cfg(src), src / "scored")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a datapipe scoring"):
        score(_cfg(src), foreign)
    with pytest.raises(ConfigError, match="a curated folder, not a scoring"):
        score(_cfg(out), src)  # the input folder as an output: refused, never touched


def test_cli_errors_are_messages(scored, tmp_path, capsys):
    src, _, _, _ = scored
    recipe = str(Path(__file__).parents[3] / "configs" / "train-tiny.yaml")
    assert main(["score", recipe, "--data", str(tmp_path / "missing"), "--output", str(tmp_path / "o"), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "datapipe: error:" in err and "data.source" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
