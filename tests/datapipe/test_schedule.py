"""Tests of datapipe.loader.schedule: mixture phases and their interpolation, validation, the deficit
sampler's realised token shares, and the curriculum spec."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from datapipe.loader.schedule import Curriculum, DeficitSampler, MixtureSchedule, Phase


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], abs_tol=1e-12) for k in a)


def test_constant_schedule_normalises_and_fills_missing_domains():
    s = MixtureSchedule([{"start_tokens": 0, "weights": {"a": 3, "b": 1}}, {"start_tokens": 100, "weights": {"c": 1}}])
    assert s.domains == ("a", "b", "c")
    assert close(s.weights_at(0), {"a": 0.75, "b": 0.25, "c": 0.0})
    assert close(s.weights_at(99), {"a": 0.75, "b": 0.25, "c": 0.0})
    assert close(s.weights_at(100), {"a": 0.0, "b": 0.0, "c": 1.0})
    assert close(s.weights_at(10**12), {"a": 0.0, "b": 0.0, "c": 1.0})


@pytest.mark.parametrize("interpolation, mid", [("linear", 0.5), ("cosine", 0.5)])
def test_interpolated_schedules(interpolation, mid):
    s = MixtureSchedule([Phase(0, {"a": 1.0}), Phase(1000, {"b": 1.0})], interpolation=interpolation)
    assert close(s.weights_at(0), {"a": 1.0, "b": 0.0})
    assert close(s.weights_at(500), {"a": 1 - mid, "b": mid})
    assert close(s.weights_at(1000), {"a": 0.0, "b": 1.0})
    quarter = s.weights_at(250)["b"]
    expected = 0.25 if interpolation == "linear" else (1 - math.cos(math.pi / 4)) / 2
    assert math.isclose(quarter, expected)


def test_round_trip_and_equality():
    s = MixtureSchedule([Phase(0, {"a": 1, "b": 2}), Phase(50, {"a": 2})], interpolation="cosine")
    again = MixtureSchedule.from_dict(json.loads(json.dumps(s.to_dict())))
    assert again == s and again.weights_at(30) == s.weights_at(30)
    assert s != MixtureSchedule.constant({"a": 1})


def test_natural_weights_from_manifest():
    manifest = {"domains": {"code": {"docs": 3, "tokens": 300}, "man": {"docs": 9, "tokens": 100}, "x": {"docs": 0, "tokens": 0}}}
    assert close(MixtureSchedule.natural(manifest).weights_at(0), {"code": 0.75, "man": 0.25})


@pytest.mark.parametrize(
    "phases, kwargs, message",
    [
        ([], {}, r"phases must be a non-empty list of phases, got \[\]"),
        ([{"start_tokens": 5, "weights": {"a": 1}}], {}, r"phases\[0\].start_tokens must be 0, got 5"),
        ([Phase(0, {"a": 1}), Phase(0, {"b": 1})], {}, r"phases\[1\].start_tokens must be greater than .*=0, got 0"),
        ([Phase(0, {"a": -1})], {}, r"phases\[0\].weights\['a'\] must be a finite number ≥ 0, got -1"),
        ([Phase(0, {"a": 0})], {}, r"phases\[0\].weights must have a positive weight"),
        ([{"start": 0}], {}, r"phases\[0\] has unknown keys \['start'\]"),
        ([Phase(0, {"a": 1})], {"interpolation": "step"}, r"interpolation must be one of .*got 'step'"),
    ],
)
def test_schedule_errors_name_the_field_and_value(phases, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MixtureSchedule(phases, **kwargs)


def test_deficit_sampler_realises_token_shares_with_uneven_lengths():
    # domain a has documents 10x longer than b; weights are over tokens, not documents
    rng = np.random.default_rng(0)
    sampler = DeficitSampler(["a", "b", "c"])
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    served = {"a": 0, "b": 0, "c": 0}
    mean = {"a": 1000, "b": 100, "c": 300}
    total = 0
    for step in range(20000):
        d = sampler.choose(weights, ["a", "b", "c"])
        n = int(rng.integers(1, 2 * mean[d]))
        sampler.record(d, n, weights, ["a", "b", "c"])
        served[d] += n
        total += n
        if step > 100:  # at every point, each domain is within two long documents of its share
            assert all(abs(served[k] - weights[k] * total) < 4000 for k in served)
    assert all(abs(served[k] / total - weights[k]) < 0.002 for k in served)
    state = json.loads(json.dumps(sampler.state_dict()))
    other = DeficitSampler(["a", "b", "c"])
    other.load_state_dict(state)
    assert other.choose(weights, ["a", "b", "c"]) == sampler.choose(weights, ["a", "b", "c"])


def test_deficit_sampler_skips_zero_weights_and_ineligible_domains():
    sampler = DeficitSampler(["a", "b"])
    assert sampler.choose({"a": 0.0, "b": 1.0}, ["a", "b"]) == "b"
    assert sampler.choose({"a": 1.0, "b": 1.0}, ["b"]) == "b"
    assert sampler.choose({"a": 1.0, "b": 0.0}, ["b"]) is None


def test_curriculum_validation():
    assert Curriculum().to_dict() == {"column": "num_tokens", "descending": False}
    with pytest.raises(ValueError, match=r"curriculum.column must be a numeric column, got 'tokens'"):
        Curriculum("tokens")
