"""Tests of loss-aware prioritization: the predictor learns a feature-loss relation, selection favours
high predicted loss under a floor, the loader's batches keep the packing invariants, and resume is
bitwise with prioritization on (read N with reported losses, save, rebuild, load, compare the rest)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from datapipe.loader import PackedLoader
from datapipe.loader.prioritize import FEATURES, LossPredictor, Prioritize, predict, select, selection_probs
from helpers import check_batch, mixed_shards, write_source

KW = dict(seq_len=64, batch_size=3, seed=3, epochs=None, lookahead=12, shuffle_window=20, max_open_bins=4)
PRIO = Prioritize(pool=8, keep=0.5, min_reports=8, refresh=3, temperature=0.3, floor=0.2)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("prio")
    return out, write_source(out, mixed_shards(seed=1))


def fake_loss(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic 'model': a document's loss is its length in tokens / 100 (longer = harder)."""
    ids = batch["doc_ids"][batch["doc_ids"] >= 0]
    uniq, counts = torch.unique(ids, return_counts=True)
    return uniq, counts.double() / 100.0


def run(loader: PackedLoader, n: int) -> list[dict]:
    out = []
    for b in loader:
        out.append(b)
        loader.report_losses(*fake_loss(b))
        if len(out) == n:
            break
    return out


def test_predictor_learns_a_linear_relation():
    rng = np.random.default_rng(0)
    cfg = Prioritize(min_reports=10, forget=1.0)
    p = LossPredictor(cfg)
    assert p.snapshot() is None
    X = rng.normal(size=(400, len(FEATURES))) * [1, 2, 0.1, 0.1, 1] + [-7, 5, 0.5, 0.1, 2]
    y = 3.0 + X @ np.array([0.5, -0.2, 2.0, 1.0, 0.0])
    p.update(X, y)
    err = np.abs(predict(p.snapshot(), X[-50:]) - y[-50:]).max()
    assert err < 0.05  # standardisation drifts early on; RLS still fits the line to within 0.05 nats


def test_selection_favours_high_predictions_and_never_starves():
    cfg = Prioritize(temperature=0.5, floor=0.2)
    pred = np.array([1.0, 2.0, 3.0, 4.0])
    p = selection_probs(pred, cfg)
    assert np.all(np.diff(p) > 0) and np.isclose(p.sum(), 1.0) and p.min() >= 0.2 / 4
    rng = np.random.default_rng(0)
    firsts = np.bincount([select(4, pred, 1, cfg, rng)[0] for _ in range(4000)], minlength=4) / 4000
    assert np.allclose(firsts, p, atol=0.03)
    assert sorted(select(4, None, 4, cfg, rng).tolist()) == [0, 1, 2, 3]


def test_prioritized_loader_serves_longer_documents_and_keeps_invariants(source):
    out, docs = source
    base = run(PackedLoader(out, **KW), 60)
    pri = run(PackedLoader(out, prioritize=PRIO, **KW), 60)
    for b in pri[:10]:
        check_batch(b, docs, 64, 3)

    def mean_len(batches):
        ids = {int(g) for b in batches[20:] for g in b["doc_ids"].unique() if g >= 0}
        return np.mean([len(docs[g]) for g in ids])

    # the fake loss rises with length, and log length is a feature: prioritization must favour long docs
    assert mean_len(pri) > 1.15 * mean_len(base)
    stats = PackedLoader(out, prioritize=PRIO, **KW)
    run(stats, 5)
    assert stats.stats()["docs_skipped"] > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_bitwise_with_prioritization(source, workers):
    out, _ = source
    reference = run(PackedLoader(out, prioritize=PRIO, **KW), 30)
    for cut in (4, 13):  # before the predictor is ready, and after several refreshes
        first = PackedLoader(out, prioritize=PRIO, num_workers=workers, **KW)
        head = run(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = PackedLoader(out, prioritize=PRIO, num_workers=2 - workers, **KW)
        resumed.load_state_dict(state)
        tail = run(resumed, 30 - cut)
        got = head + tail
        assert all(torch.equal(x[k], y[k]) for x, y in zip(got, reference) for k in x), cut
    with pytest.raises(ValueError, match="prioritize"):
        PackedLoader(out, prioritize=Prioritize(pool=4), **KW).load_state_dict(state)


def test_prioritize_errors_name_the_field():
    with pytest.raises(ValueError, match=r"prioritize.keep must be in \(0, 1\], got 0"):
        Prioritize(keep=0)
    with pytest.raises(ValueError, match="prioritize keys must be among"):
        Prioritize.from_value({"pools": 3})


@pytest.mark.parametrize("prefetch", ["false", "true"])
def test_trainer_with_prioritization_resumes_exactly(tmp_path, prefetch):
    """The predictor learns the loss reports up to a point fixed by the batch count (`lag`), so with or
    without the prefetch thread running ahead, a run split at step 5 (refresh points fall on both sides)
    equals a straight run bitwise, and two fresh runs agree."""
    from helpers import tiny_cfg, write_train_source as write_source
    from datapipe.train.loop import train

    src = write_source(tmp_path / "src")
    sets = ["data.prioritize.enabled=true", "data.prioritize.pool=4", "data.prioritize.min_reports=4",
            "data.prioritize.refresh=2", "data.prioritize.lag=3", f"prefetch.enabled={prefetch}"]
    straight = train(tiny_cfg(src, tmp_path / "a", *sets))
    again = train(tiny_cfg(src, tmp_path / "c", *sets))
    assert again["params_sha256"] == straight["params_sha256"]
    train(tiny_cfg(src, tmp_path / "b", "train.stop_at=5", *sets))
    rest = train(tiny_cfg(src, tmp_path / "b", *sets), resume=True)
    assert rest["params_sha256"] == straight["params_sha256"]
    ckpt = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert ckpt["loaders"][0]["predictor"]["model"]["n"] > 4 and ckpt["loaders"][0]["planner"]["predictor"] is not None
