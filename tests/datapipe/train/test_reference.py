"""The RHO-LOSS scoring pass (`datapipe score`, datapipe/train/reference.py): ref_loss per token by the other half's
model, the pass's FLOPs, and the static band (`ref_band`)."""

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
from datapipe.train.lm import flops_params
from datapipe.train.reference import MARKER, _reference_model, band_mask, fold_of, ref_band, score
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


def _token_losses(model, toks: list[int]) -> list[float]:
    """Next-token loss at every position of one document, computed alone: pieces of SEQ tokens, each piece's last
    token predicting the document's next one (the loader's `split` policy), no packing; the last token: 0."""
    t = torch.tensor(toks)
    out = []
    with torch.no_grad():
        for a in range(0, len(toks), SEQ):
            piece = t[a:a + SEQ]
            target = t[a + 1:a + SEQ + 1]
            logits = model(piece[None])[0, :len(target)]
            out += F.cross_entropy(logits, target, reduction="none").tolist()
    return out + [0.0]


def _doc_loss(model, toks: list[int]) -> float:
    return float(np.mean(_token_losses(model, toks)[:-1]))


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
        assert str(table.column("ref_loss").type) == "list<item: float>" and table.num_rows == original.num_rows
        assert table.column("ref_loss_mean").type == "float"
        for name in original.column_names:  # the input's columns, unchanged
            assert table.column(name).equals(original.column(name))
        rows = zip(*(table.column(c).to_pylist() for c in ("id", "tokens", "ref_loss", "ref_loss_mean")))
        for doc_id, toks, ref, mean in rows:
            fold = fold_of(doc_id, 0)
            folds.append(fold)
            assert len(ref) == len(toks) and ref[-1] == 0 and np.all(np.isfinite(ref))
            # each token's loss under the other half's model, in the context of its own piece
            assert ref == pytest.approx(_token_losses(models[1 - fold], toks), abs=1e-4)
            assert mean == pytest.approx(_doc_loss(models[1 - fold], toks), abs=1e-4)
            own_differs += abs(mean - _doc_loss(models[fold], toks)) > 1e-3
    assert 0 < sum(folds) < len(folds)  # both halves hold documents
    assert manifest["scoring"]["folds"]["1"]["docs"] == sum(folds)
    assert own_differs > 0.9 * len(folds)  # the two models differ: the test would see the wrong one
    assert any(len(t) > SEQ for t in shards.open_shard(out, manifest["shards"][0]["path"]).column("tokens").to_pylist())


def test_the_manifest_records_the_passes_flops(scored):
    src, out, manifest, _ = scored
    sc = manifest["scoring"]
    assert sc["format"] == 2 and sc["column"] == "ref_loss" and sc["granularity"] == "token" and sc["seq_len"] == SEQ
    model = _reference_model(out / "reference" / "fold-0", torch.device("cpu"))
    assert sc["params"] == flops_params(model)
    trained = [json.loads(line)["tokens"] for k in (0, 1)
               for line in (out / "reference" / f"fold-{k}" / "metrics.jsonl").read_text().splitlines()[-1:]]
    assert sc["train_tokens"] == sum(trained) > 0
    assert sc["forward_tokens"] == manifest["total_tokens"]  # every document forwarded once
    assert sc["flops"] == 6 * sc["params"] * sc["train_tokens"] + 2 * sc["params"] * sc["forward_tokens"]


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
    assert score(_cfg(src, "train.rho.max_rows_per_doc=5", "train.rho.selection=last_loss"), out) == manifest


def test_a_scoring_of_the_old_format_is_refused_with_that_said(scored, tmp_path):
    src, out, manifest, _ = scored
    old = tmp_path / "old"
    old.mkdir()
    doc = {**manifest, "scoring": {k: v for k, v in manifest["scoring"].items() if k != "format"}}
    doc["scoring"]["identity"] = "an identity of the old format"
    (old / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="older `datapipe score`.*one ref_loss per document"):
        score(_cfg(src), old)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / MARKER).write_text(json.dumps({"identity": "old", "source": str(src)}))
    with pytest.raises(ConfigError, match="older `datapipe score`"):
        score(_cfg(src), unfinished)


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
    said = []
    resumed = score(_cfg(src), again, say=said.append)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in manifest["shards"]]
    # a line per reference model (the finished one kept), one for the scoring of the shards, the summary
    assert [line.split(":")[0] for line in said] == ["reference model 0", "reference model 1", "scoring pass", "score"]
    assert said[0] == f"reference model 0: finished ({again / 'reference' / 'fold-0'})"
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


def test_cli_prints_a_line_per_reference_model_and_the_trainers_lines_only_when_verbose(scored, tmp_path, capsys):
    src, _, _, _ = scored
    recipe = str(Path(__file__).parents[3] / "configs" / "train-tiny.yaml")
    tiny = ["--steps", "2", "--set", "model.n_layer=1", "--set", "model.n_head=2", "--set", "model.d_model=32",
            "--set", "model.max_seq_len=64", "--set", f"data.seq_len={SEQ}", "--set", "data.batch_size=2",
            "--set", "train.log_every=1", "--set", "train.device=cpu"]
    assert main(["score", recipe, "--data", str(src), "--output", str(tmp_path / "quiet"), *tiny]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 1 + 1, lines  # a line per reference model, the scoring pass, the summary
    for k in (0, 1):
        assert lines[k].startswith(f"reference model {k}: 2 steps on half {k} (") and lines[k].endswith(
            str(tmp_path / "quiet" / "reference" / f"fold-{k}"))
    assert lines[2].startswith("scoring pass: 3 shards")
    manifest = shards.read_manifest(tmp_path / "quiet")
    assert lines[3].startswith(f"score: {manifest['total_docs']:,} documents, {manifest['total_tokens']:,} tokens "
                               "scored in ") and str(tmp_path / "quiet" / "manifest.json") in lines[3]

    assert main(["score", recipe, "--data", str(src), "--output", str(tmp_path / "verbose"), *tiny, "--verbose"]) == 0
    lines = capsys.readouterr().out.splitlines()
    steps = [line.split(" | ")[0] for line in lines if line.startswith("step ")]
    assert steps == ["step 1/2", "step 2/2"] * 2  # both reference models' trainer lines
    assert [line for line in lines if line.startswith("scored shard")] == [f"scored shard {i}/3" for i in (1, 2, 3)]
    assert lines[0].startswith(f"score: 90 documents of {src} in two halves")  # the plan
    assert [line.split(":")[0] for line in lines[1:] if line.startswith(("reference model", "scoring pass", "score:"))] == [
        "reference model 0", "reference model 0", "reference model 1", "reference model 1", "scoring pass", "score"]
    # the same output either way
    assert [s["sha256"] for s in shards.read_manifest(tmp_path / "verbose")["shards"]] == [
        s["sha256"] for s in manifest["shards"]]


def test_band_mask_keeps_the_middle_of_the_tokens():
    means, tokens = np.array([4.0, 1.0, 3.0, 2.0]), np.array([10, 10, 10, 10])
    assert band_mask(means, tokens, 0.25, 0.75).tolist() == [False, False, True, True]  # 2.0 and 3.0
    assert band_mask(means, tokens, 0.0, 1.0).all()
    # token-weighted: the document of 1.0 holds most tokens, so it spans the middle
    assert band_mask(means, np.array([1, 97, 1, 1]), 0.25, 0.75).tolist() == [False, True, False, False]


def test_ref_band_keeps_each_domains_middle_band(scored, tmp_path, capsys):
    src, out, manifest, _ = scored
    band = ref_band(out, tmp_path / "band", low=0.2, high=0.8)
    tables = [shards.open_shard(out, s["path"]) for s in manifest["shards"]]
    rows = [r for t in tables for r in zip(*(t.column(c).to_pylist() for c in ("id", "domain", "num_tokens",
                                                                               "ref_loss_mean")))]
    want = set()
    for domain in {r[1] for r in rows}:
        mine = [r for r in rows if r[1] == domain]
        keep = band_mask(np.array([r[3] for r in mine]), np.array([r[2] for r in mine]), 0.2, 0.8)
        want |= {r[0] for r, k in zip(mine, keep) if k}
    got = {i for s in band["shards"] for i in shards.open_shard(tmp_path / "band", s["path"]).column("id").to_pylist()}
    assert got == want and 0 < len(got) < len(rows)
    assert band["ref_band"]["docs"] == len(got) and band["ref_band"]["of_docs"] == len(rows)
    assert band["scoring"]["flops"] == manifest["scoring"]["flops"]  # the one-off cost it was cut with
    assert "identity" not in band["scoring"] and band["scoring"]["derived"] == "ref_band"
    for domain, c in band["domains"].items():  # per domain: about 60% of each domain's tokens
        assert 0.4 < c["tokens"] / manifest["domains"][domain]["tokens"] < 0.8
    assert ref_band(out, tmp_path / "band", low=0.2, high=0.8) == band  # again: nothing to do
    assert "nothing to do" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="another folder"):
        ref_band(out, tmp_path / "band", low=0.1, high=0.8)
    with pytest.raises(ConfigError, match="datapipe score"):
        ref_band(src, tmp_path / "band2", low=0.1, high=0.8)
    with pytest.raises(ConfigError, match="low < high"):
        ref_band(out, tmp_path / "band3", low=0.8, high=0.2)
