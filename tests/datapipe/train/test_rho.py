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
from datapipe.train.lm import remembered_scores, select_reducible, top_rows
from datapipe.train.loop import train
from datapipe.train.model import GPT, ModelConfig
from helpers import VOCAB, tiny_cfg, write_train_source

SEQ = 64


def write_planted(out: Path, *, code_ref: float = 100.0) -> Path:
    """Two domains whose documents each fill one row exactly (SEQ tokens), so every row is one domain; a quarter are
    `code`, planted with a huge ref_loss on every token (its reducible loss is then very negative: never worth
    training on). ref_loss is per token (a list as long as the tokens), ref_loss_mean its document's mean."""
    rng = np.random.default_rng(1)
    specs, g = [], 0
    for s in range(4):
        domain = "code" if s == 3 else "prose"
        shard = []
        for _ in range(24):
            start = int(rng.integers(1, VOCAB))
            toks = [(start + 5 * k) % (VOCAB - 1) + 1 for k in range(SEQ - 1)] + [0]
            ref = [code_ref] * SEQ if domain == "code" else rng.uniform(0, 1, SEQ).tolist()
            ref[-1] = 0.0  # the last token predicts nothing
            shard.append({"id": f"d{g}", "domain": domain, "tokens": toks, "ref_loss": ref,
                          "ref_loss_mean": float(np.mean(ref[:-1]))})
            g += 1
        specs.append(shard)
    write_fake_shards(out, specs, vocab_size=VOCAB, dtype="uint16")
    return out


def write_long(out: Path, *, n_long: int = 6, chunks: int = 4, noisy_chunk: int | None = None, n_short: int = 0,
               short_ref: float = 0.0) -> tuple[Path, list[list[float]]]:
    """`n_long` documents of `chunks` x SEQ tokens (each split into `chunks` rows of SEQ tokens) whose per-token
    ref_loss is 1000 g + t (document g, position t), unless `noisy_chunk` is set: then ref_loss is 0.5
    everywhere but 100 on that chunk's tokens (-1: on none). Plus `n_short` documents of SEQ tokens with ref_loss `short_ref`.
    Returns the folder and each document's ref_loss."""
    rng = np.random.default_rng(2)
    docs, refs = [], []
    for g in range(n_long + n_short):
        n = chunks * SEQ if g < n_long else SEQ
        start = int(rng.integers(1, VOCAB))
        toks = [(start + 3 * k) % (VOCAB - 1) + 1 for k in range(n - 1)] + [0]
        if g >= n_long:
            ref = [short_ref] * n
        elif noisy_chunk is None:
            ref = [float(1000 * g + t) for t in range(n)]
        else:
            ref = [100.0 if t // SEQ == noisy_chunk else 0.5 for t in range(n)]
        refs.append(ref)
        docs.append({"id": f"L{g}", "domain": "prose" if g % 2 else "code", "tokens": toks, "ref_loss": ref})
    write_fake_shards(out, [docs[: len(docs) // 2], docs[len(docs) // 2:]], vocab_size=VOCAB, dtype="uint16")
    return out, refs


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


def test_loader_carries_a_token_column_of_each_piece(tmp_path):
    src, refs = write_long(tmp_path / "src", n_long=5, chunks=3, n_short=7, short_ref=0.25)
    docs = [toks for info in shards.read_manifest(src)["shards"]  # global doc id = order in the shards
            for toks in shards.open_shard(src, info["path"]).column("tokens").to_pylist()]
    batches = {}
    for workers in (0, 1):
        loader = PackedLoader(src, seq_len=SEQ, batch_size=3, seed=0, token_columns=("ref_loss",), num_workers=workers)
        batches[workers] = list(loader)
    seen = 0
    for b0, b1 in zip(batches[0], batches[1], strict=True):  # the same with worker processes
        assert all(torch.equal(b0[k], b1[k]) for k in b0)
        ref, doc, seg = b0["ref_loss"], b0["doc_ids"], b0["segment_ids"]
        assert ref.dtype == torch.float32 and ref.shape == doc.shape
        assert torch.all(ref[doc < 0] == 0)
        for s in torch.unique(seg[doc >= 0]).tolist():  # each piece: its document's values at its own positions
            where = seg == s
            g = int(doc[where][0])
            values = ref[where]
            start = int(values[0]) - 1000 * g if g < 5 else None
            want = refs[g][start:start + len(values)] if g < 5 else refs[g][:len(values)]
            assert values.tolist() == want
            if g < 5:
                assert b0["input_ids"][where].tolist() == docs[g][start:start + len(values)]  # the tokens of those positions
                seen += start > 0
    assert seen  # pieces other than the first of a long document were checked


def test_a_per_document_ref_loss_is_refused_as_an_old_scoring(tmp_path):
    src = write_train_source(tmp_path / "src")
    tables = [shards.open_shard(src, s["path"]) for s in shards.read_manifest(src)["shards"]]
    specs = [[{"id": i, "domain": d, "tokens": t, "ref_loss": 1.5}
              for i, d, t in zip(*(tb.column(c).to_pylist() for c in ("id", "domain", "tokens")))] for tb in tables]
    write_fake_shards(tmp_path / "old", specs, vocab_size=VOCAB, dtype="uint16")
    with pytest.raises(ConfigError, match="not a list per document.*scored again"):
        PackedLoader(tmp_path / "old", seq_len=SEQ, batch_size=2, token_columns=("ref_loss",))
    with pytest.raises(ConfigError, match="train.rho.column='ref_loss'.*not a list per document"):
        train(_cfg(tmp_path / "old", tmp_path / "run"))
    specs = [[{**d, "ref_loss": [0.5] * (len(d["tokens"]) - 1)} for d in spec] for spec in specs]  # one short
    write_fake_shards(tmp_path / "short", specs, vocab_size=VOCAB, dtype="uint16")
    with pytest.raises(ConfigError, match="one value per token"):
        PackedLoader(tmp_path / "short", seq_len=SEQ, batch_size=2, token_columns=("ref_loss",))


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


def _tiny_model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=32, max_seq_len=SEQ))


def _row_reducible(model: GPT, batch: dict, r: int) -> float:
    """Row r alone, piece by piece: mean over its label tokens of (loss - that token's ref_loss)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for s in torch.unique(batch["segment_ids"][r]).tolist():
            where = batch["segment_ids"][r] == s
            labels = batch["labels"][r][where]
            mask = labels != -100
            if not mask.any():
                continue
            logits = model(batch["input_ids"][r][where][None])[0]
            tl = torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="none")
            total += float((tl - batch["ref_loss"][r][where][mask]).sum())
            count += int(mask.sum())
    return total / count


def test_select_reducible_uses_each_tokens_own_ref_loss(tmp_path):
    """Long documents cut into pieces, the ref_loss of every token different: a row's reducible loss is the mean of
    (token loss - that token's ref_loss) over the tokens it trains on, not the document's mean."""
    src, _ = write_long(tmp_path / "src", n_long=4, chunks=3, n_short=10, short_ref=0.5)
    model = _tiny_model()
    batch = next(iter(PackedLoader(src, seq_len=SEQ, batch_size=8, seed=0, token_columns=("ref_loss",))))
    chosen, scores = select_reducible(model, batch, 3, "ref_loss", torch.device("cpu"))
    want = [_row_reducible(model, batch, r) for r in range(8)]
    assert scores.tolist() == pytest.approx(want, abs=1e-3)
    top = sorted(np.argsort(want, kind="stable")[::-1][:3].tolist())
    assert torch.equal(chosen["input_ids"], batch["input_ids"][top])  # the top 3, in the loader's order


def test_a_noisy_piece_of_a_long_document_is_never_selected_but_its_other_pieces_are(tmp_path):
    """Every long document's third piece has a huge reference loss on its tokens, the others a small one: the
    selection takes the other pieces and never that one (with one value per document they would all look alike)."""
    src, _ = write_long(tmp_path / "src", n_long=12, chunks=4, noisy_chunk=2)
    model = _tiny_model()
    loader = PackedLoader(src, seq_len=SEQ, batch_size=8, seed=0, token_columns=("ref_loss",))
    trained_docs, noisy_candidates = set(), 0
    for batch in loader:
        noisy_candidates += int((batch["ref_loss"] == 100).any(1).sum())
        chosen, _ = select_reducible(model, batch, 3, "ref_loss", torch.device("cpu"), max_rows_per_doc=0)
        assert not (chosen["ref_loss"] == 100).any()
        trained_docs |= set(chosen["doc_ids"][:, 0].tolist())
    assert noisy_candidates == 12  # every noisy piece was a candidate (one epoch)
    assert len(trained_docs) >= 8  # and the other pieces of most of those documents were trained on


def test_top_rows_caps_the_rows_of_one_document():
    scores = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0])
    doc_ids = torch.tensor([[1, 1], [1, 1], [1, 1], [2, 3], [2, 2], [4, -1], [3, 3], [2, 2]])  # rows of pieces
    assert top_rows(scores, doc_ids, 4).tolist() == [0, 1, 2, 3]  # no cap: the top four
    got = top_rows(scores, doc_ids, 4, max_rows_per_doc=1)
    # cap 1: row 0 (doc 1), row 3 (docs 2, 3), row 5 (doc 4); rows 1, 2 (doc 1), 4, 7 (doc 2), 6 (doc 3) are refused;
    # a fourth row is needed: the best refused one, row 1
    assert got.tolist() == [0, 1, 3, 5]
    assert top_rows(scores, doc_ids, 4, max_rows_per_doc=2).tolist() == [0, 1, 3, 4]
    assert top_rows(scores, doc_ids, 3, max_rows_per_doc=2).tolist() == [0, 1, 3]
    assert torch.equal(top_rows(scores, doc_ids, 4, max_rows_per_doc=1), got)  # deterministic


def test_remembered_scores_weigh_each_document_by_its_label_tokens():
    batch = {"doc_ids": torch.tensor([[1, 1, 1, 2], [3, 3, -1, -1], [-1, -1, -1, -1]]),
             "labels": torch.tensor([[5, 5, -100, -100], [5, -100, -100, -100], [-100] * 4])}
    memory = {1: 2.0, 2: -1.0}  # document 3 was never trained on: the prior, the memory's mean (0.5)
    scores = remembered_scores(batch, memory)
    assert scores[:2].tolist() == pytest.approx([2.0, 0.5]) and scores[2] == float("-inf")
    assert remembered_scores(batch, memory, prior=-7.0)[1] == pytest.approx(-7.0)
    assert remembered_scores(batch, {})[:2].tolist() == [0.0, 0.0]


def test_pieces_of_one_long_document_cannot_fill_a_selected_batch(tmp_path):
    """One long document (16 pieces) whose tokens' ref_loss is far below the short documents': without a cap its
    pieces fill the selected rows; with train.rho.max_rows_per_doc=2 at most two of them are taken."""
    src, _ = write_long(tmp_path / "src", n_long=1, chunks=16, noisy_chunk=-1, n_short=16, short_ref=50.0)
    model = _tiny_model()
    batch = next(iter(PackedLoader(src, seq_len=SEQ, batch_size=16, seed=0, token_columns=("ref_loss",))))
    long_rows = int((batch["doc_ids"][:, 0] == 0).sum())
    assert long_rows >= 6  # the candidates hold enough pieces of it to fill the batch
    chosen, _ = select_reducible(model, batch, 6, "ref_loss", torch.device("cpu"))  # no cap
    assert int((chosen["doc_ids"][:, 0] == 0).sum()) == 6
    chosen, _ = select_reducible(model, batch, 6, "ref_loss", torch.device("cpu"), max_rows_per_doc=2)
    assert int((chosen["doc_ids"][:, 0] == 0).sum()) == 2
    assert len(torch.unique(chosen["doc_ids"][:, 0])) == 5


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
    # every candidate row's selection forward is forward-only compute (the selected rows are forwarded again)
    assert summary["tokens_forwarded_only"] == summary["tokens_forwarded"]


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


def test_last_loss_selection_forwards_nothing_and_skips_documents_that_were_not_worth_it(tmp_path):
    """selection: last_loss over two passes of the data: no candidate forward; each trained document's reducible
    loss is remembered, and a code document (reference loss 100 on every token: reducible far below the others)
    that was trained on in the first pass (before anything was known about it) is never trained on again."""
    src = write_planted(tmp_path / "src")
    domain = _domains(src)
    summary = train(_cfg(src, tmp_path / "run", "train.rho.selection=last_loss", "train.steps=24",
                         "train.ckpt_every=24", "train.log_every=6"))
    assert summary["tokens_forwarded"] == 0 and summary["tokens_forwarded_only"] == 0
    assert summary["tokens"] == 24 * 2 * SEQ
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["loaders"][0]
    assert state["stats"]["tokens"] == 4 * summary["tokens"]  # two passes over the 96 documents' rows
    memory = {int(doc): (value, int(n)) for doc, value, n in state["losses"]}
    code = {d: v for d, v in memory.items() if domain[d] == "code"}
    prose = {d: v for d, v in memory.items() if domain[d] == "prose"}
    assert code and all(value < -50 and n == 1 for value, n in code.values())  # reducible: loss - 100
    assert all(value > -10 for value, _ in prose.values())
    assert any(n >= 2 for _, n in prose.values())  # prose documents came back and were trained again


def test_a_resumed_last_loss_run_continues_identically(tmp_path):
    src = write_planted(tmp_path / "src", code_ref=0.5)
    short = ("train.rho.selection=last_loss", "train.steps=8", "train.ckpt_every=4")
    straight = train(_cfg(src, tmp_path / "straight", *short))
    train(_cfg(src, tmp_path / "split", *short, "train.stop_at=4"))
    resumed = train(_cfg(src, tmp_path / "split", *short), resume=True)
    assert resumed["params_sha256"] == straight["params_sha256"]
    assert resumed["losses"] == straight["losses"][4:]


def test_a_static_mixture_trains_on_its_domains_only(tmp_path):
    src = write_planted(tmp_path / "src")
    domain = _domains(src)
    train(_cfg(src, tmp_path / "run", "train.rho.enabled=false", "data.mixture={prose: 1.0}"))
    state = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["loaders"][0]
    assert {domain[int(doc)] for doc, _, _ in state["losses"]} == {"prose"}
    assert state["stats"]["domain_tokens"]["code"] == 0
    with pytest.raises(ConfigError, match="data.mixture"):
        _cfg(src, tmp_path / "run2", "data.mixture={prose: -1}")


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
    with pytest.raises(ConfigError, match="train.rho.max_rows_per_doc"):
        _cfg(src, tmp_path / "run", "train.rho.max_rows_per_doc=-1")
    with pytest.raises(ConfigError, match="train.rho.selection"):
        _cfg(src, tmp_path / "run", "train.rho.selection=oracle")
