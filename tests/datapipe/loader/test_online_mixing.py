"""Tests of online data mixing (ODM): the EXP3 bandit moves weight to the domain whose reported loss stays
high and keeps every domain above the exploration floor, the loader's batches are a pure function of the
reports (not of when they arrive), and resume is bitwise, also from a position older than the reports."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from datapipe.core.config import ConfigError
from datapipe.loader import PackedLoader
from datapipe.loader.feedback import LossFeedback
from datapipe.loader.online_mixing import DomainBandit, OnlineMixing, doc_domains, exploration
from helpers import check_batch, mixed_shards, write_source

KW = dict(seq_len=64, batch_size=3, seed=3, epochs=None, lookahead=12, shuffle_window=20, max_open_bins=4)
MIX = OnlineMixing(refresh=2, lag=3)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("odm")
    specs = mixed_shards(seed=1)
    docs = write_source(out, specs)
    domain_of = [d for spec in specs for d, _ in spec]  # global doc id -> domain, in write order
    return out, docs, domain_of


def losses_for(batch: dict, domain_of: list[str], loss: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic 'model': every document of a domain has that domain's loss."""
    ids = torch.unique(batch["doc_ids"][batch["doc_ids"] >= 0])
    return ids, torch.tensor([loss[domain_of[int(g)]] for g in ids], dtype=torch.float64)


def run(loader: PackedLoader, n: int, domain_of: list[str], loss: dict[str, float], delay: int = 0) -> list[dict]:
    """n batches; each batch's losses are reported `delay` batches after it is served (a trainer behind a prefetcher)."""
    out: list[dict] = []
    for b in loader:
        out.append(b)
        if len(out) > delay:
            loader.report_losses(*losses_for(out[-1 - delay], domain_of, loss))
        if len(out) == n:
            break
    return out


def domain_tokens(batches: list[dict], domain_of: list[str]) -> dict[str, float]:
    ids = torch.cat([b["doc_ids"][b["doc_ids"] >= 0] for b in batches]).tolist()
    counts: dict[str, int] = {}
    for g in ids:
        counts[domain_of[g]] = counts.get(domain_of[g], 0) + 1
    return {d: n / len(ids) for d, n in counts.items()}


def test_bandit_rewards_the_high_loss_domain_above_the_floor():
    cfg = OnlineMixing(alpha=0.5)
    bandit = DomainBandit(cfg, ["a", "b", "c", "off"], {"a": 1.0, "b": 1.0, "c": 1.0, "off": 0.0})
    assert np.allclose(bandit.policy(), [1 / 3, 1 / 3, 1 / 3, 0.0])  # t = 1: ε = 1/K, uniform
    for _ in range(200):  # every round holds all three arms; a's documents stay hard
        bandit.update(np.array([0, 0, 1, 2, 3]), np.array([5.0, 5.0, 1.0, 1.0, 9.0]))
    pi = bandit.policy()
    eps = exploration(201, 3)
    # the weight moved to the domain the model finds hard (the 1/π importance weights damp the move: at the
    # fixed point π_a / π_b = exp(ε (5 / π_a - 1 / π_b)), about 1.4 here)
    assert pi[0] > 1.3 * max(pi[1], pi[2]) and pi[0] > 0.38
    assert pi[3] == 0.0 and bandit.reward[3] == 0.0  # a domain of prior weight 0 is no arm
    assert math.isclose(pi.sum(), 1.0) and pi[:3].min() >= eps - 1e-12  # the exploration floor holds
    # the same rewards on b instead: b leads (the policy follows the rewards, not the domain order)
    other = DomainBandit(cfg, ["a", "b", "c", "off"], {"a": 1.0, "b": 1.0, "c": 1.0, "off": 0.0})
    for _ in range(200):
        other.update(np.array([0, 1, 1, 2]), np.array([1.0, 5.0, 5.0, 1.0]))
    assert other.policy()[1] > 1.3 * max(other.policy()[0], other.policy()[2])


def test_prior_and_warmup():
    bandit = DomainBandit(OnlineMixing(warmup=5), ["a", "b"], {"a": 3.0, "b": 1.0})
    for _ in range(5):
        assert np.allclose(bandit.policy(), [0.75, 0.25])  # the prior until `warmup` rounds are learnt
        bandit.update(np.array([0, 1]), np.array([1.0, 1.0]))
    # equal losses: the importance weights 1/π reward the domain served less, so the policy moves towards it
    assert bandit.policy()[1] > 0.25


def test_doc_domains_reads_mixed_shards(source):
    out, _, domain_of = source
    loader = PackedLoader(out, online_mixing=MIX, **KW)
    docs = np.arange(len(domain_of))
    got = doc_domains(loader._layout, loader._reader, docs)
    assert [loader._layout.domains[i] for i in got] == domain_of
    assert doc_domains(loader._layout, loader._reader, [len(domain_of) + 5]).tolist() == [-1]


def test_loader_shifts_the_mixture_to_the_domain_with_high_loss(source):
    out, docs, domain_of = source
    hard_code = run(PackedLoader(out, online_mixing=MIX, **KW), 80, domain_of, {"web": 1.0, "code": 5.0, "book": 1.0})
    hard_web = run(PackedLoader(out, online_mixing=MIX, **KW), 80, domain_of, {"web": 5.0, "code": 1.0, "book": 1.0})
    for b in hard_code[:10]:
        check_batch(b, docs, 64, 3)
    code_when_hard = domain_tokens(hard_code[30:], domain_of)["code"]
    code_when_easy = domain_tokens(hard_web[30:], domain_of)["code"]
    assert code_when_hard > code_when_easy + 0.1, (code_when_hard, code_when_easy)


def test_exploration_floor_keeps_every_domain_served(source):
    out, _, domain_of = source
    loader = PackedLoader(out, online_mixing=MIX, **KW)
    batches = run(loader, 100, domain_of, {"web": 0.0, "code": 50.0, "book": 0.0})
    shares = domain_tokens(batches[-25:], domain_of)
    assert set(shares) == {"web", "code", "book"} and shares["code"] > 0.6
    weights = loader.stats()["weights"]  # the policy in use: learnt the first 100 - lag reports
    assert min(weights.values()) >= exploration(100 - MIX.lag + 1, 3) - 1e-12


def test_batches_depend_on_the_reports_not_on_their_timing(source):
    out, _, domain_of = source
    loss = {"web": 1.0, "code": 4.0, "book": 2.0}
    now = run(PackedLoader(out, online_mixing=MIX, **KW), 40, domain_of, loss)
    late = run(PackedLoader(out, online_mixing=MIX, **KW), 40, domain_of, loss, delay=MIX.lag - 1)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(now, late) for k in x)
    other = run(PackedLoader(out, online_mixing=MIX, **KW), 40, domain_of, {"web": 4.0, "code": 1.0, "book": 2.0})
    assert not all(torch.equal(x["doc_ids"], y["doc_ids"]) for x, y in zip(now, other))  # the reports matter


def test_resume_is_bitwise_with_online_mixing(source):
    out, _, domain_of = source
    loss = {"web": 1.0, "code": 4.0, "book": 2.0}
    reference = run(PackedLoader(out, online_mixing=MIX, **KW), 30, domain_of, loss)
    for cut, workers in ((5, 0), (14, 2)):
        first = PackedLoader(out, online_mixing=MIX, **KW)
        head = run(first, cut, domain_of, loss)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = PackedLoader(out, online_mixing=MIX, num_workers=workers, **KW)
        resumed.load_state_dict(state)
        got = head + run(resumed, 30 - cut, domain_of, loss)
        assert all(torch.equal(x[k], y[k]) for x, y in zip(got, reference) for k in x), cut


def test_combined_with_prioritization_resumes_bitwise(source):
    """Each learner (predictor, bandit) has its own refresh, lag and queue; both are in the state."""
    from datapipe.loader.prioritize import Prioritize

    out, _, domain_of = source
    both = dict(online_mixing=OnlineMixing(refresh=3, lag=2),
                prioritize=Prioritize(pool=8, keep=0.5, min_reports=8, refresh=2, lag=3), **KW)
    loss = {"web": 1.0, "code": 4.0, "book": 2.0}
    reference = run(PackedLoader(out, **both), 24, domain_of, loss)
    first = PackedLoader(out, **both)
    head = run(first, 9, domain_of, loss)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["predictor"]["reports"] == state["mixing"]["reports"] == 9
    resumed = PackedLoader(out, **both)
    resumed.load_state_dict(state)
    got = head + run(resumed, 15, domain_of, loss)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(got, reference) for k in x)
    assert first.stats()["docs_skipped"] > 0


def test_resume_from_a_position_older_than_the_reports(source):
    """A prefetcher serves batches ahead of the trainer: the state saved after batch b (a refresh point) has
    the position of b but the reports of b, while the loader already planned further (and refreshed at b with
    the first b - lag reports). The resumed loader asks again for the snapshot at b: it must be the same."""
    out, _, domain_of = source
    loss = {"web": 1.0, "code": 4.0, "book": 2.0}
    reference = run(PackedLoader(out, online_mixing=MIX, **KW), 30, domain_of, loss)
    loader = PackedLoader(out, online_mixing=MIX, **KW)
    it, ahead, served, cut = iter(loader), 2, [], 8  # cut: a refresh point (MIX.refresh = 2)
    for k in range(cut + ahead + 1):  # the prefetcher: batches with the position after each, `ahead` in advance
        served.append((next(it), loader.position()))
        if 0 <= k - ahead < cut:  # the trainer reports the batches it trained on
            loader.report_losses(*losses_for(served[k - ahead][0], domain_of, loss))
    # the prefetcher has refreshed at batch cut + ahead (learning the first cut + ahead - lag reports); the
    # trainer saves the position after batch cut, with the reports of batches 1..cut
    state = json.loads(json.dumps(loader.state_dict(position=served[cut - 1][1])))
    resumed = PackedLoader(out, online_mixing=MIX, **KW)
    resumed.load_state_dict(state)
    got = [b for b, _ in served[:cut]] + run(resumed, 30 - cut, domain_of, loss)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(got, reference) for k in x)


def test_learner_keeps_the_reports_a_resumed_position_may_ask_for():
    """The bandit learns for good only the first reports - lag: a later request for an earlier refresh point
    (a resumed position) gets exactly the reports it names, not all the bandit has seen."""
    prior = {"a": 1.0, "b": 1.0}

    def fresh() -> LossFeedback:
        return LossFeedback(0, None, None, online_mixing=OnlineMixing(lag=3), mixing_prior=prior,
                            domains=lambda docs: np.asarray(docs) % 2)
    live, expected = fresh(), fresh()
    for k in range(8):  # the trainer has reported batches 1..8 and saves the position after batch 8 ...
        for fb in (live, expected):
            fb.report([k], [float(k)])
    live.mixing_snapshot(until=10 - 3)  # ... while the prefetcher already refreshed at batch 10
    saved = json.loads(json.dumps(live.state_dict()))
    resumed = fresh()
    resumed.load_state_dict(saved)
    assert resumed.mixing_snapshot(until=8 - 3) == expected.mixing_snapshot(until=8 - 3)  # the refresh at batch 8
    assert resumed.mixing_snapshot(until=8 - 3) != expected.mixing_snapshot(until=10 - 3)


def test_config_errors_name_the_field(source):
    out, _, _ = source
    with pytest.raises(ConfigError, match=r"online_mixing.alpha must be a number in \[0, 1\), got 1"):
        OnlineMixing(alpha=1)
    with pytest.raises(ConfigError, match=r"online_mixing.refresh must be an integer ≥ 1, got 0"):
        OnlineMixing(refresh=0)
    with pytest.raises(ConfigError, match="online_mixing keys must be among"):
        PackedLoader(out, online_mixing={"alpah": 0.5}, **KW)
    phases = {"phases": [{"start_tokens": 0, "weights": {"web": 1}}, {"start_tokens": 100, "weights": {"code": 1}}]}
    from datapipe.loader.schedule import MixtureSchedule
    with pytest.raises(ConfigError, match=r"mixture must be constant \(one phase\) with online_mixing"):
        PackedLoader(out, online_mixing=True, mixture=MixtureSchedule.from_dict(phases), **KW)
    state = PackedLoader(out, online_mixing=MIX, **KW).state_dict()
    with pytest.raises(ConfigError, match=r"state\['config'\]\['online_mixing'\]"):
        PackedLoader(out, online_mixing=OnlineMixing(refresh=3), **KW).load_state_dict(state)
    from helpers import tiny_cfg
    with pytest.raises(ConfigError, match=r"data.online_mixing.alpha must be a number in \[0, 1\)"):
        tiny_cfg(out, out / "run", "data.online_mixing.alpha=1.5")
    with pytest.raises(ConfigError, match=r"data.online_mixing.lag must be >= train.grad_accum - 1 = 3"):
        tiny_cfg(out, out / "run", "data.online_mixing.enabled=true", "data.online_mixing.lag=2", "train.grad_accum=4")


def test_trainer_with_online_mixing_resumes_exactly(tmp_path):
    """With the prefetch thread running ahead, a run split at step 4 (a refresh point) equals a straight run."""
    from helpers import tiny_cfg, write_train_source
    from datapipe.train.loop import train

    src = write_train_source(tmp_path / "src")
    sets = ["data.online_mixing.enabled=true", "data.online_mixing.refresh=2", "data.online_mixing.lag=3",
            "prefetch.enabled=true", "train.steps=8", "train.eval_every=0", "train.ckpt_every=0"]
    straight = train(tiny_cfg(src, tmp_path / "a", *sets))
    train(tiny_cfg(src, tmp_path / "b", "train.stop_at=4", *sets))
    rest = train(tiny_cfg(src, tmp_path / "b", *sets), resume=True)
    assert rest["params_sha256"] == straight["params_sha256"]
    ckpt = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert ckpt["loaders"][0]["mixing"]["model"]["rounds"] >= 4
    assert set(ckpt["loaders"][0]["planner"]["mixing"]) == {"code", "prose"}


def test_time_averaged_weights_are_the_runs_served_shares_and_a_static_arm_trains_at_them(tmp_path):
    """ODM's honest baseline: the weights an ODM run served on average (its loader states' per-domain tokens at the
    end), then a run with those weights as a fixed `data.mixture` serves about the same shares."""
    from helpers import tiny_cfg, write_train_source
    from datapipe.loader.online_mixing import served_weights, time_averaged_weights
    from datapipe.train.loop import train

    src = write_train_source(tmp_path / "src")
    sets = ["data.online_mixing.refresh=1", "data.online_mixing.lag=1", "data.online_mixing.warmup=0",
            "train.steps=16", "train.eval_every=0", "train.ckpt_every=0", "data.holdout_shards=0"]
    train(tiny_cfg(src, tmp_path / "odm", "data.online_mixing.enabled=true", *sets))
    weights = time_averaged_weights(tmp_path / "odm")
    state = torch.load(tmp_path / "odm" / "checkpoint.pt", weights_only=True)["loaders"][0]
    served = state["stats"]["domain_tokens"]
    assert set(weights) == {"code", "prose"} and sum(weights.values()) == pytest.approx(1.0)
    assert weights["code"] == pytest.approx(served["code"] / (served["code"] + served["prose"]))
    mixture = "{" + ", ".join(f"{d}: {w!r}" for d, w in weights.items()) + "}"
    train(tiny_cfg(src, tmp_path / "static", f"data.mixture={mixture}", *sets))
    static = time_averaged_weights(tmp_path / "static")
    assert static["code"] == pytest.approx(weights["code"], abs=0.08)  # within about a document per domain
    assert served_weights([state, state]) == weights  # ranks are summed
    with pytest.raises(ConfigError, match="checkpoint"):
        time_averaged_weights(tmp_path / "missing")
