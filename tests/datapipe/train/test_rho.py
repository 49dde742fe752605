"""RHO-LOSS selection in the LM objective (train.rho) and the loader's per-token document columns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader import PackedLoader
from datapipe.loader.packing import build_batch, pack, select_rows
from datapipe.testing.shards import write_fake_shards
from datapipe.train.lm import select_reducible
from datapipe.train.loop import train
from datapipe.train.model import GPT, ModelConfig
from helpers import VOCAB, tiny_cfg, write_train_source

SEQ = 64


def write_planted(out: Path, *, code_ref: float = 100.0) -> Path:
    """Two domains whose documents each fill one row exactly (SEQ tokens), so every row is one domain; a quarter are
    `code`, planted with a huge ref_loss (its reducible loss is then very negative: never worth training on)."""
    rng = np.random.default_rng(1)
    specs, g = [], 0
    for s in range(4):
        domain = "code" if s == 3 else "prose"
        shard = []
        for _ in range(24):
            start = int(rng.integers(1, VOCAB))
            toks = [(start + 5 * k) % (VOCAB - 1) + 1 for k in range(SEQ - 1)] + [0]
            shard.append({"id": f"d{g}", "domain": domain, "tokens": toks,
                          "ref_loss": code_ref if domain == "code" else float(rng.uniform(0, 1))})
            g += 1
        specs.append(shard)
    write_fake_shards(out, specs, vocab_size=VOCAB, dtype="uint16")
    return out


def _cfg(src: Path, out: Path, *overrides: str):
    return tiny_cfg(src, out, "data.holdout_shards=0", "train.rho.enabled=true", "train.rho.candidates=4",
                    "train.steps=6", "train.ckpt_every=3", "train.log_every=3", *overrides)


def _domains(src: Path) -> list[str]:
    return [d for info in shards.read_manifest(src)["shards"] for d in shards.open_shard(src, info["path"]).column("domain").to_pylist()]


# ------------------------------------------------------------------------------------------- the loader


def test_loader_carries_a_document_column_per_token(tmp_path):
    src = write_train_source(tmp_path / "src")
    table = [shards.open_shard(src, s["path"]) for s in shards.read_manifest(src)["shards"]]
    # a column unrelated to order or length: the document's index times 0.5
    specs = [[{"id": i, "domain": d, "tokens": t, "ref_loss": 0.5 * g}
              for g, (i, d, t) in enumerate(zip(*(tb.column(c).to_pylist() for c in ("id", "domain", "tokens"))),
                                            start=30 * n)]
             for n, tb in enumerate(table)]
    write_fake_shards(tmp_path / "scored", specs, vocab_size=VOCAB, dtype="uint16")
    batches = {}
    for workers in (0, 1):
        loader = PackedLoader(tmp_path / "scored", seq_len=SEQ, batch_size=3, seed=0, doc_columns=("ref_loss",),
                              num_workers=workers)
        batches[workers] = list(loader)
    for b0, b1 in zip(batches[0], batches[1], strict=True):  # the same with worker processes
        assert all(torch.equal(b0[k], b1[k]) for k in b0)
        doc = b0["doc_ids"]
        assert b0["ref_loss"].dtype == torch.float32 and b0["ref_loss"].shape == doc.shape
        want = torch.where(doc >= 0, 0.5 * doc.float(), torch.zeros(()))  # doc id g carries 0.5 g; padding 0
        assert torch.equal(b0["ref_loss"], want)


def test_a_missing_column_says_run_datapipe_score(tmp_path):
    src = write_train_source(tmp_path / "src")
    with pytest.raises(ConfigError, match="run `datapipe score` first"):
        PackedLoader(src, seq_len=SEQ, batch_size=2, doc_columns=("ref_loss",))
    with pytest.raises(ConfigError, match="numeric"):
        PackedLoader(src, seq_len=SEQ, batch_size=2, doc_columns=("domain",))
    with pytest.raises(ConfigError, match="datapipe score"):  # the trainer says so before any step
        train(_cfg(src, tmp_path / "run"))


def test_select_rows_is_the_batch_of_those_rows():
    lengths = [30, 50, 20, 64, 10, 5, 40, 7, 33]
    docs = {i: np.arange(n) + 100 * i for i, n in enumerate(lengths)}
    rows = pack(lengths, SEQ)
    full = {k: torch.from_numpy(v) for k, v in build_batch(rows, docs.__getitem__, SEQ).items()}
    for pick in ([2, 0], [1], [0, 1, 3]):
        want = build_batch([rows[i] for i in pick], docs.__getitem__, SEQ)
        got = select_rows(full, torch.tensor(pick))
        assert got.keys() == want.keys() and all(torch.equal(got[k], torch.from_numpy(want[k])) for k in want)


# ------------------------------------------------------------------------------------------- selection


def test_select_reducible_trains_on_the_top_rows(tmp_path):
    src = write_planted(tmp_path / "src", code_ref=0.0)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=32, max_seq_len=SEQ))
    batch = next(iter(PackedLoader(src, seq_len=SEQ, batch_size=8, seed=0, doc_columns=("ref_loss",))))
    chosen, scores = select_reducible(model, batch, 3, "ref_loss", torch.device("cpu"))
    want = []  # each row alone: mean over its label tokens of (loss - ref_loss)
    with torch.no_grad():
        for r in range(8):
            mask = batch["labels"][r] != -100
            logits = model(batch["input_ids"][r:r + 1])[0]
            tl = torch.nn.functional.cross_entropy(logits[mask], batch["labels"][r][mask], reduction="none")
            want.append(float((tl - batch["ref_loss"][r][mask]).mean()))
    assert scores.tolist() == pytest.approx(want, abs=1e-5)
    top = sorted(np.argsort(want)[::-1][:3].tolist())
    assert torch.equal(chosen["input_ids"], batch["input_ids"][top])  # the top 3, in the loader's order


def test_a_domain_with_a_huge_ref_loss_is_never_trained_on(tmp_path):
    src = write_planted(tmp_path / "src")
    domain = _domains(src)
    summary = train(_cfg(src, tmp_path / "run"))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["loaders"][0]
    trained = {int(doc) for doc, _, _ in state["losses"]}  # the loss reports: documents of the rows trained on
    assert trained and {domain[d] for d in trained} == {"prose"}
    assert state["stats"]["domain_tokens"]["code"] > 0  # code rows were candidates: the selection refused them
    # accounting: every row is a full document, so tokens are exact
    assert summary["tokens"] == 6 * 2 * SEQ and summary["tokens_forwarded"] == 4 * summary["tokens"]
    assert summary["tokens_forwarded"] == state["stats"]["tokens"]  # the loader served every candidate row


def test_without_rho_the_same_data_trains_on_every_domain(tmp_path):
    src = write_planted(tmp_path / "src")
    domain = _domains(src)
    summary = train(_cfg(src, tmp_path / "run", "train.rho.enabled=false"))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["loaders"][0]
    assert "code" in {domain[int(doc)] for doc, _, _ in state["losses"]}
    assert "tokens_forwarded" not in summary


def test_a_resumed_rho_run_continues_identically(tmp_path):
    src = write_planted(tmp_path / "src", code_ref=0.5)
    short = ("train.rho.candidates=2", "train.steps=4", "train.ckpt_every=2")
    straight = train(_cfg(src, tmp_path / "straight", *short))
    train(_cfg(src, tmp_path / "split", *short, "train.stop_at=2"))
    resumed = train(_cfg(src, tmp_path / "split", *short), resume=True)
    assert resumed["start_step"] == 2
    assert resumed["params_sha256"] == straight["params_sha256"]
    assert resumed["losses"] == straight["losses"][2:]
    assert (resumed["tokens"], resumed["tokens_forwarded"]) == (straight["tokens"], straight["tokens_forwarded"])


def test_config_errors_name_the_key(tmp_path):
    src = write_planted(tmp_path / "src")
    with pytest.raises(ConfigError, match="train.rho.candidates"):
        _cfg(src, tmp_path / "run", "train.rho.candidates=1")
    with pytest.raises(ConfigError, match="data.prioritize.enabled"):
        _cfg(src, tmp_path / "run", "data.prioritize.enabled=true")
    with pytest.raises(ConfigError, match="data.online_mixing.enabled"):
        _cfg(src, tmp_path / "run", "data.online_mixing.enabled=true")
    with pytest.raises(ConfigError, match="train.objective 'lm'"):
        _cfg(src, tmp_path / "run", "train.objective=dpo")
