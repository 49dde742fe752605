"""The loader's compiled loops (`datapipe/loader/kernels.py`) change no batch and no state.

Two independent sources: the planner's one-unit step (`Planner._advance`, the Python the compiled runs replace
for most units), and digests of the batches and planner states that the loader of commit b3fa50f, before any
compiled loop, served on the same shards.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from datapipe.loader import PackedLoader
from datapipe.loader.packing import IGNORE_INDEX, BFDPacker, Piece, expand_batch
from datapipe.loader.planner import Planner
from datapipe.loader.schedule import Curriculum, MixtureSchedule, Phase
from helpers import mixed_shards, write_source

CASES = {
    "epoch": dict(seq_len=64, batch_size=4, epochs=2),
    "small_windows": dict(seq_len=64, batch_size=3, epochs=2, shuffle_window=7, shuffle_shards=1, lookahead=16),
    "lookahead_1": dict(seq_len=128, batch_size=2, epochs=1, lookahead=1, max_open_bins=0),
    "long_docs": dict(seq_len=32, batch_size=4, epochs=1, long_docs={"web": "truncate", "book": "drop", "*": "split"}),
    "rank_1_of_3": dict(seq_len=48, batch_size=2, epochs=2, rank=1, world_size=3, shuffle_window=11),
    "mixture_constant": dict(seq_len=64, batch_size=4, epochs=2, mixture={"web": 1, "code": 2, "book": 1}, lookahead=8),
    "mixture_steps": dict(seq_len=64, batch_size=2, epochs=1, lookahead=32, mixture=MixtureSchedule(
        [Phase(0, {"web": 1, "code": 1}), Phase(3000, {"book": 1, "code": 1}), Phase(6000, {"web": 1})])),
    "mixture_linear": dict(seq_len=64, batch_size=2, epochs=1, lookahead=8, mixture=MixtureSchedule(
        [Phase(0, {"web": 1, "code": 1}), Phase(3000, {"book": 1, "code": 3})], interpolation="linear")),
    "curriculum": dict(seq_len=40, batch_size=2, epochs=2, curriculum=Curriculum("score")),
    "no_shuffle": dict(seq_len=64, batch_size=4, epochs=1, shuffle=False),
    "online_mixing": dict(seq_len=64, batch_size=2, epochs=1, online_mixing=True),
    "prioritize": dict(seq_len=64, batch_size=2, epochs=1, prioritize=True),
}

# sha256 (first 16 hex digits) of the first 150 batches and planner states of each case, served by b3fa50f's loader;
# `prioritize`'s since its loss predictor sums without BLAS (b3fa50f's digest was that of one OpenBLAS kernel's sums)
BEFORE = {
    "epoch": "536755f4bc19504b",
    "small_windows": "0bb8ab4f27c51ac1",
    "lookahead_1": "aaa85c4b948b5999",
    "long_docs": "d2337751ec98f021",
    "rank_1_of_3": "dd7af00296055343",
    "mixture_constant": "b2301a81fdbe6295",
    "mixture_steps": "ef36071e84ddcd60",
    "mixture_linear": "658a3a45ff23f1d5",
    "curriculum": "eff0098043608f10",
    "no_shuffle": "11fb3b800dfb7088",
    "online_mixing": "41faf622f927d7c3",
    "prioritize": "c8bfddc8df632640",
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed")
    write_source(out, mixed_shards(seed=3, n_shards=6, per_shard=40, high=300), scores=True)
    return out


def served(loader: PackedLoader, batches: int = 150) -> tuple[str, list[dict]]:
    """The digest of the batches and planner states, and the states; each batch reports made-up losses, which
    online mixing and prioritization need and use."""
    h, states = hashlib.sha256(), []
    for i, b in enumerate(loader):
        if i >= batches:
            break
        for key in sorted(b):
            h.update(key.encode())
            h.update(b[key].numpy().tobytes())
        states.append(loader.state_dict()["planner"])
        h.update(json.dumps(states[-1], sort_keys=True).encode())
        ids = b["doc_ids"]
        loader.report_losses(ids, (ids % 13).float() / 13 + 1)
    return h.hexdigest()[:16], states


@pytest.mark.parametrize("case", sorted(CASES))
def test_batches_and_states_are_those_of_the_loader_before(source, case):
    digest, _ = served(PackedLoader(source, seed=5, **CASES[case]))
    assert digest == BEFORE[case]


@pytest.mark.parametrize("case", ["epoch", "small_windows", "long_docs", "mixture_steps", "mixture_linear", "curriculum"])
def test_compiled_runs_draw_what_the_one_unit_step_draws(source, case, monkeypatch):
    fast_digest, fast_states = served(PackedLoader(source, seed=5, **CASES[case]))
    monkeypatch.setattr(Planner, "_draw_run", lambda self: 0)  # every unit through `_advance`
    slow_digest, slow_states = served(PackedLoader(source, seed=5, **CASES[case]))
    assert fast_states == slow_states
    assert fast_digest == slow_digest


def expand_reference(input_ids, seg_doc, seg_len, seg_last_label) -> dict[str, np.ndarray]:
    """The training arrays of a compact batch by numpy's whole-array formulas, as expand_batch had them."""
    ids = input_ids.reshape(-1).astype(np.int64)
    cu = np.concatenate([[0], np.cumsum(seg_len)])
    labels = np.empty_like(ids)
    labels[:-1] = ids[1:]
    labels[cu[1:] - 1] = seg_last_label
    for s in np.flatnonzero(seg_doc < 0):
        labels[cu[s]:cu[s + 1]] = IGNORE_INDEX
    arrays = {"input_ids": ids, "labels": labels, "doc_ids": np.repeat(seg_doc, seg_len),
              "segment_ids": np.repeat(np.arange(len(seg_len)), seg_len),
              "position_ids": np.arange(ids.size) - np.repeat(cu[:-1], seg_len)}
    return {**{k: v.reshape(input_ids.shape) for k, v in arrays.items()}, "cu_seqlens": cu.astype(np.int32)}


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_expand_batch_equals_the_whole_array_formulas(dtype):
    rng = np.random.default_rng(0)
    for _ in range(50):
        rows, seq_len = int(rng.integers(1, 5)), int(rng.integers(1, 40))
        seg_doc, seg_len, seg_last = [], [], []
        for _ in range(rows):
            left = seq_len
            while left:
                n = int(rng.integers(1, left + 1))
                seg_doc.append(int(rng.integers(-1, 3)))  # -1: padding
                seg_len.append(n)
                seg_last.append(int(rng.choice([IGNORE_INDEX, rng.integers(0, 100)])))
                left -= n
        arrays = dict(input_ids=rng.integers(0, 100, (rows, seq_len)).astype(dtype), seg_doc=np.array(seg_doc),
                      seg_len=np.array(seg_len), seg_last_label=np.array(seg_last))
        got, want = expand_batch(**arrays), expand_reference(**arrays)
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), key


def test_expand_batch_refuses_segments_that_do_not_tile_the_batch():
    ids = np.zeros((1, 4), dtype=np.int64)
    with pytest.raises(ValueError, match=r"seg_len must sum to input_ids.size=4, got 3"):
        expand_batch(ids, np.array([0]), np.array([3]), np.array([IGNORE_INDEX]))
    with pytest.raises(ValueError, match=r"seg_len must be positive, got 0"):
        expand_batch(ids, np.array([0, 1]), np.array([4, 0]), np.array([IGNORE_INDEX, IGNORE_INDEX]))


def test_extend_buffers_as_push_does_and_refuses_a_pack_due():
    pieces = [Piece(doc, 0, 3 + doc, 3 + doc, 0, doc) for doc in range(5)]
    one_by_one, at_once = BFDPacker(8, lookahead=6), BFDPacker(8, lookahead=6)
    assert [one_by_one.push(p) for p in pieces] == [[]] * 5
    at_once.extend(pieces)
    assert at_once.state_dict() == one_by_one.state_dict() and at_once.room == 1
    assert at_once.flush() == one_by_one.flush()
    with pytest.raises(ValueError, match=r"extend must leave the buffer under lookahead=6 pieces, got 6 pieces onto 0"):
        BFDPacker(8, lookahead=6).extend(pieces + pieces[:1])
    with pytest.raises(ValueError, match=r"piece.length must be in \[1, seq_len=8\], got 9"):
        BFDPacker(8, lookahead=6).extend([Piece(0, 0, 9, 9)])


def test_steady_until_is_where_the_weights_can_next_change():
    phases = [Phase(0, {"web": 1}), Phase(100, {"code": 1}), Phase(200, {"web": 1, "code": 1})]
    steps = MixtureSchedule(phases)
    assert [steps.steady_until(t) for t in (0, 99, 100, 250)] == [100, 100, 200, float("inf")]
    assert all(steps.weights_at(t) == steps.weights_at(100) for t in range(100, 200))
    linear = MixtureSchedule(phases, interpolation="linear")
    assert [linear.steady_until(t) for t in (0, 150, 200)] == [0, 150, float("inf")]
