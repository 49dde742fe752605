"""The LM objective (datapipe/train/lm.py): `data.verify: always` reaches the loader, so a shard that rotted in
place with its size and modification time kept is refused, not trained on; evaluation reads every eval document
once and weights the domains by their tokens (or a declared target mixture), on one rank or two; the compute
counts (FLOPs, forward-only and distinct tokens) and their resume."""

from __future__ import annotations

import json
import os
import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader.reader import ShardError
from datapipe.testing.shards import write_fake_shards
from datapipe.train.lm import evaluate, flops_params
from datapipe.train.loop import train
from datapipe.train.model import GPT, ModelConfig, token_losses
from helpers import VOCAB, tiny_cfg, write_train_source

SETS = ("data.holdout_shards=0", "train.steps=2", "train.eval_every=0", "train.ckpt_every=0")


def test_data_verify_always_refuses_a_shard_that_rotted_in_place(tmp_path: Path) -> None:
    source = write_train_source(tmp_path / "src")
    train(tiny_cfg(source, tmp_path / "first", *SETS))  # the shards it opened pass, and are remembered
    for info in shards.read_manifest(source)["shards"]:
        path = source / info["path"]
        before = os.stat(path)
        rotted = bytearray(path.read_bytes())
        rotted[len(rotted) // 2] ^= 0x01  # one bit, in place: same size
        path.write_bytes(bytes(rotted))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the same modification time
    with pytest.raises(ShardError, match=r"shard shards/shard-\d+\.arrow of .* has sha256 \w+ but the manifest says"):
        train(tiny_cfg(source, tmp_path / "second", *SETS, "data.verify=always"))
    with pytest.raises(ConfigError, match=r"data.verify"):
        tiny_cfg(source, tmp_path / "third", *SETS, "data.verify=sometimes")


# ------------------------------------------------------------------ evaluation: every document once, token-weighted

SEQ = 64


def _docs() -> dict[str, list[list[int]]]:
    """A big domain (20 documents, one longer than a row, one an exact copy of another) and a small one (2 short
    documents): the small one is a few percent of the tokens."""
    rng = np.random.default_rng(1)
    big = [[int(t) for t in rng.integers(1, VOCAB, int(n))] + [0] for n in rng.integers(20, 60, 18)]
    big += [[int(t) for t in rng.integers(1, VOCAB, 150)] + [0], list(big[0])]
    small = [[int(t) for t in rng.integers(1, VOCAB, n)] + [0] for n in (9, 13)]
    return {"big": big, "small": small}


def _write(out: Path, docs: dict[str, list[list[int]]]) -> Path:
    rows = [{"id": f"{d}{i}", "domain": d, "tokens": t} for d, ts in docs.items() for i, t in enumerate(ts)]
    write_fake_shards(out, [rows[:11], rows[11:]], vocab_size=VOCAB, dtype="uint16")
    return out


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=32, max_seq_len=SEQ, attention="sdpa"))


@torch.no_grad()
def _reference(model: GPT, doc: list[int]) -> tuple[float, int]:
    """(sum of token losses, label tokens) of one document run alone, in seq_len chunks as the loader splits it (a
    chunk's last token predicts the next chunk's first; the document's last token predicts nothing)."""
    total, count = 0.0, 0
    for start in range(0, len(doc), SEQ):
        ids = torch.tensor(doc[start:start + SEQ])[None]
        labels = torch.tensor(doc[start + 1:start + SEQ + 1] + [-100] * (ids.shape[1] - len(doc[start + 1:start + SEQ + 1])))[None]
        tl = token_losses(model(ids, position_ids=torch.arange(ids.shape[1])[None]), labels)
        total += float(tl.sum())
        count += int((labels != -100).sum())
    return total, count


def test_evaluate_reads_every_document_once_and_weights_the_domains_by_their_tokens(tmp_path: Path) -> None:
    docs = _docs()
    source = _write(tmp_path / "eval", docs)
    model = _model()
    cfg = tiny_cfg(source, tmp_path / "run", *SETS, "data.eval_batches=0", f"data.seq_len={SEQ}", "data.batch_size=3")
    out = evaluate(model, str(source), cfg, torch.device("cpu"), 0, 1)
    ref = {d: [_reference(model, t) for t in ts] for d, ts in docs.items()}
    # every label token of every document is scored once: no domain is cycled, none is cut short
    for d in docs:
        tokens = sum(n for _, n in ref[d])
        assert out["eval_domains"][d]["tokens"] == tokens == sum(len(t) - 1 for t in docs[d])
        assert out["eval_domains"][d]["loss"] == pytest.approx(sum(s for s, _ in ref[d]) / tokens, rel=1e-5)
    manifest = shards.read_manifest(source)
    assert out["eval_tokens"] == manifest["total_tokens"] - manifest["total_docs"]
    assert out["eval_tokens_forwarded"] == manifest["total_tokens"] and not out["eval_capped"]
    # overall: the token-weighted mean of the domains' losses (the small domain weighs its tokens), not their plain mean
    per = {d: (out["eval_domains"][d]["loss"], out["eval_domains"][d]["tokens"]) for d in docs}
    weighted = sum(v * n for v, n in per.values()) / sum(n for _, n in per.values())
    assert out["eval_weighting"] == "tokens"
    assert out["eval_loss"] == out["eval_loss_tokens"] == pytest.approx(weighted, rel=1e-9)
    assert out["eval_loss_domain_mean"] == pytest.approx((per["big"][0] + per["small"][0]) / 2, rel=1e-9)
    assert abs(out["eval_loss"] - out["eval_loss_domain_mean"]) > 1e-4
    assert per["small"][1] < 0.05 * per["big"][1]

    # a cap on the batches: the same leading part every time, said to be capped
    capped = evaluate(model, str(source), replace(cfg, data=replace(cfg.data, eval_batches=2)), torch.device("cpu"), 0, 1)
    assert capped["eval_capped"] and 0 < capped["eval_tokens"] < out["eval_tokens"]
    # every domain is listed; one the cap left unread has no loss
    assert set(capped["eval_domains"]) == set(docs)
    assert all((v["loss"] is None) == (v["tokens"] == 0) for v in capped["eval_domains"].values())
    assert capped == evaluate(model, str(source), replace(cfg, data=replace(cfg.data, eval_batches=2)), torch.device("cpu"), 0, 1)


def test_an_eval_target_mixture_weights_the_domain_losses_and_must_name_eval_domains(tmp_path: Path) -> None:
    source = _write(tmp_path / "eval", _docs())
    model = _model()
    cfg = tiny_cfg(source, tmp_path / "run", *SETS, f"data.seq_len={SEQ}", "data.eval_target={big: 1, small: 3}")
    assert cfg.data.eval_target == {"big": 1.0, "small": 3.0}
    out = evaluate(model, str(source), cfg, torch.device("cpu"), 0, 1, cfg.data.eval_target)
    big, small = out["eval_domains"]["big"]["loss"], out["eval_domains"]["small"]["loss"]
    assert out["eval_weighting"] == "target" and out["eval_target"] == {"big": 0.25, "small": 0.75}
    assert out["eval_loss"] == pytest.approx(0.25 * big + 0.75 * small, rel=1e-12)
    tokens = evaluate(model, str(source), cfg, torch.device("cpu"), 0, 1)  # the same, token-weighted
    assert out["eval_loss_tokens"] == tokens["eval_loss"] and out["eval_loss_domain_mean"] == tokens["eval_loss_domain_mean"]
    # a domain the eval source lacks names the key, before any training; so do bad weights
    train_src = write_train_source(tmp_path / "train")
    with pytest.raises(ConfigError, match=r"data.eval_target names domain\(s\) \['nope'\] that the eval source"):
        train(tiny_cfg(train_src, tmp_path / "r1", *SETS, f"data.eval_source={source}", "data.eval_target={big: 1, nope: 1}"))
    assert not (tmp_path / "r1" / "metrics.jsonl").exists()
    for bad in ("{big: -1}", "{}", "{big: 0}"):
        with pytest.raises(ConfigError, match=r"data.eval_target must map domains to finite weights"):
            tiny_cfg(train_src, tmp_path / "r2", *SETS, f"data.eval_target={bad}")
    # a run logs the target weighting beside both others
    train(tiny_cfg(train_src, tmp_path / "r3", "data.holdout_shards=0", "train.steps=2", "train.eval_every=0",
                   f"data.eval_source={source}", f"data.seq_len={SEQ}", "data.eval_target={small: 1}"))
    last = json.loads((tmp_path / "r3" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["eval_weighting"] == "target" and last["eval_loss"] == last["eval_domains"]["small"]["loss"]
    assert last["eval_loss_tokens"] != last["eval_loss"]


def _ddp_eval(rank: int, world: int, port: int, source: str, model_path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model = _model()
    model.load_state_dict(torch.load(model_path, weights_only=True))
    cfg = tiny_cfg(Path(source), Path(out) / "run", *SETS, "data.eval_batches=0", f"data.seq_len={SEQ}")
    result = evaluate(model, source, cfg, torch.device("cpu"), rank, world)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def test_evaluate_on_two_ranks_reduces_to_the_one_rank_figures(tmp_path: Path) -> None:
    source = _write(tmp_path / "eval", _docs())
    model = _model()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_eval, args=(2, port, str(source), str(tmp_path / "model.pt"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    one = evaluate(model, str(source), tiny_cfg(source, tmp_path / "run", *SETS, "data.eval_batches=0", f"data.seq_len={SEQ}"),
                   torch.device("cpu"), 0, 1)
    for got in ranks:  # both ranks hold the whole split's figures: their parts partition it
        assert got["eval_tokens"] == one["eval_tokens"] and got["eval_tokens_forwarded"] == one["eval_tokens_forwarded"]
        assert got["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
        for d, v in one["eval_domains"].items():
            assert got["eval_domains"][d]["tokens"] == v["tokens"]
            assert got["eval_domains"][d]["loss"] == pytest.approx(v["loss"], rel=1e-5)


# ------------------------------------------------------------------ compute: FLOPs, forward-only and distinct tokens


def test_flops_are_6n_per_token_trained_plus_2n_per_token_forwarded_only_and_survive_a_resume(tmp_path, monkeypatch):
    from datapipe.train.lm import LMObjective

    source = write_train_source(tmp_path / "src")
    args = ("data.holdout_shards=0", "train.steps=6", "train.eval_every=3", "train.log_every=3", "train.ckpt_every=3",
            f"data.eval_source={source}")
    plain = train(tiny_cfg(source, tmp_path / "plain", *args))
    model = GPT(replace(tiny_cfg(source, tmp_path / "x").model, vocab_size=VOCAB))
    n = flops_params(model)
    assert n == model.num_params(non_embedding=False)  # tied: the shared matrix counts once, as the output projection
    untied = GPT(replace(model.cfg, tie_embeddings=False))
    assert flops_params(untied) == untied.num_params(non_embedding=True) == n  # the input lookup is not counted
    assert plain["flops_params"] == n and plain["tokens_forwarded_only"] == 0
    assert plain["flops"] == 6 * n * plain["tokens"] and plain["tokens_trained"] == plain["tokens"] > 0
    rows = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["flops"] == 6 * n * r["tokens_trained"] for r in rows) and [r["step"] for r in rows] == [3, 6]
    assert all("eval_loss" in r and r["eval_flops"] > 0 for r in rows)  # evaluations are counted apart
    assert rows[1]["eval_flops"] == 2 * rows[0]["eval_flops"] == 2 * 2 * n * rows[0]["eval_tokens_forwarded"]

    # code that forwards rows it does not train on adds them to forward_only_tokens: 2N each
    backward = LMObjective.backward

    def with_forward_only(self, model, micro):
        self.forward_only_tokens += 100
        return backward(self, model, micro)

    monkeypatch.setattr(LMObjective, "backward", with_forward_only)
    straight = train(tiny_cfg(source, tmp_path / "straight", *args))
    assert straight["tokens_forwarded_only"] == 600 and straight["tokens"] == plain["tokens"]
    assert straight["flops"] == 6 * n * straight["tokens"] + 2 * n * 600
    # stopped after step 3 and resumed: the same counts (forward-only tokens and distinct pieces are in the checkpoint)
    train(tiny_cfg(source, tmp_path / "split", *args, "train.stop_at=3"))
    ckpt = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=True)
    assert ckpt["loaders"][0]["lm_counters"]["forward_only_tokens"] == 300
    resumed = train(tiny_cfg(source, tmp_path / "split", *args), resume=True)
    for key in ("tokens", "tokens_forwarded_only", "flops", "distinct_tokens", "tokens_read", "eval_flops"):
        assert resumed[key] == straight[key], key


def test_distinct_tokens_count_each_piece_once_over_epochs(tmp_path: Path) -> None:
    docs = _docs()
    source = _write(tmp_path / "src", docs)
    # more than three passes over the data (its 1,000-odd tokens at 2 rows of 64 a step)
    summary = train(tiny_cfg(source, tmp_path / "run", "data.holdout_shards=0", "train.steps=30", "train.eval_every=0",
                             "train.log_every=7", f"data.seq_len={SEQ}", f"data.eval_source={source}"))
    pieces = {tuple(t[s:s + SEQ]) for ts in docs.values() for t in ts for s in range(0, len(t), SEQ)}
    assert summary["distinct_tokens"] == sum(len(p) for p in pieces)  # the copy of big[0] counts once
    assert summary["tokens_read"] == summary["tokens"] > 3 * summary["distinct_tokens"]
