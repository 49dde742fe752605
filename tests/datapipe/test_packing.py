"""Tests of datapipe.loader.packing: cutting policies, the best-fit packer's invariants and resume,
the arrays of a packed batch, and the block-diagonal causal mask."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from datapipe.loader.packing import (
    IGNORE_INDEX,
    BFDPacker,
    Piece,
    block_causal_mask,
    build_batch,
    pack,
    segment_ids_of,
    served_lengths,
    split_document,
)


def lengths(n: int, seed: int, high: int) -> list[int]:
    """A long-tailed length mix like real documents: many short, some longer than a row."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.minimum(rng.lognormal(4.0, 1.0, size=n).astype(int) + 1, high)]


def test_split_document_policies():
    assert split_document(7, 5, 8) == [Piece(7, 0, 5, 5)]
    assert [(p.start, p.end) for p in split_document(7, 20, 8, "split")] == [(0, 8), (8, 16), (16, 20)]
    assert [(p.start, p.end) for p in split_document(7, 20, 8, "truncate")] == [(0, 8)]
    assert split_document(7, 20, 8, "drop") == []
    assert split_document(7, 8, 8, "drop") == [Piece(7, 0, 8, 8)]  # fits exactly: kept whole
    with pytest.raises(ValueError, match=r"policy must be one of .*got 'cut'"):
        split_document(7, 20, 8, "cut")
    # a rank's part of a long split document: the document's own chunks in [start, end)
    assert [(p.start, p.end) for p in split_document(7, 20, 8, "split", start=8)] == [(8, 16), (16, 20)]
    assert [(p.start, p.end) for p in split_document(7, 20, 8, "split", end=16)] == [(0, 8), (8, 16)]
    with pytest.raises(ValueError, match=r"beginning at a multiple of seq_len=8, got \[4, 20\)"):
        split_document(7, 20, 8, "split", start=4)
    with pytest.raises(ValueError, match="must be a non-empty range of a split document"):
        split_document(7, 20, 8, "truncate", start=8)
    assert served_lengths([5, 8, 20], 8, "split").tolist() == [5, 8, 20]
    assert served_lengths([5, 8, 20], 8, "truncate").tolist() == [5, 8, 8]
    assert served_lengths([5, 8, 20], 8, "drop").tolist() == [5, 8, 0]


@pytest.mark.parametrize("seq_len", [64, 256])
def test_pack_invariants(seq_len):
    lens = lengths(3000, seed=seq_len, high=4 * seq_len)
    rows = pack(lens, seq_len, lookahead=64, max_open_bins=8)
    covered: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        assert 0 < sum(p.length for p in row) <= seq_len
        assert len({p.doc for p in row}) == len(row)  # pieces of one document never share a row
        for p in row:
            covered.setdefault(p.doc, []).append((p.start, p.end))
    for doc, n in enumerate(lens):
        spans = sorted(covered[doc])
        if n <= seq_len:
            assert spans == [(0, n)]  # a document that fits is never cut
        else:  # cut at multiples of seq_len, covering the document exactly once
            assert spans == [(s, min(s + seq_len, n)) for s in range(0, n, seq_len)]
    assert set(covered) == set(range(len(lens)))
    efficiency = sum(lens) / (len(rows) * seq_len)
    assert efficiency > 0.97, efficiency


def test_pack_truncate_and_drop():
    lens = [10, 50, 3, 70, 8]
    rows = pack(lens, 16, policy="truncate", lookahead=4)
    assert sorted((p.doc, p.start, p.end) for r in rows for p in r) == [
        (0, 0, 10), (1, 0, 16), (2, 0, 3), (3, 0, 16), (4, 0, 8)]
    rows = pack(lens, 16, policy="drop", lookahead=4)
    assert sorted(p.doc for r in rows for p in r) == [0, 2, 4]


def test_pack_is_best_fit_decreasing_within_the_buffer():
    # One buffer: 6, 5, 5, 4, 3, 3 into rows of 10 -> best fit decreasing gives [6,4], [5,5], [3,3].
    rows = pack([3, 5, 6, 3, 5, 4], 10, lookahead=6, max_open_bins=0)
    assert sorted(sorted(p.length for p in r) for r in rows) == [[3, 3], [4, 6], [5, 5]]
    # rows come out in the arrival order of their first piece; pieces within a row too
    assert [[p.doc for p in r] for r in rows] == [[0, 3], [1, 4], [2, 5]]


def test_open_bins_carry_over_and_age_out():
    def run(max_bin_age: int) -> tuple[list, list]:
        packer = BFDPacker(10, lookahead=2, max_open_bins=1, max_bin_age=max_bin_age)
        first = packer.push(Piece(0, 0, 3, 3, seq=0)) + packer.push(Piece(1, 0, 4, 4, seq=1))
        assert first == [] and packer.pending_pieces == 2  # [4, 3] share a bin that stays open (room 3)
        out = packer.push(Piece(2, 0, 9, 9, seq=2)) + packer.push(Piece(3, 0, 8, 8, seq=3))
        return [[p.doc for p in r] for r in out], [[p.doc for p in r] for r in packer.flush()]

    # the open bin is the emptiest, so it stays open for the next buffer ...
    assert run(max_bin_age=4) == ([[2], [3]], [[0, 1]])
    # ... unless it has waited max_bin_age buffers already
    assert run(max_bin_age=1) == ([[0, 1], [2], [3]], [])
    # small pieces fill an open bin before a new one is opened
    packer = BFDPacker(10, lookahead=2, max_open_bins=1)
    packer.push(Piece(0, 0, 3, 3, seq=0)), packer.push(Piece(1, 0, 4, 4, seq=1))
    out = packer.push(Piece(2, 0, 2, 2, seq=2)) + packer.push(Piece(3, 0, 1, 1, seq=3))
    assert [[p.doc for p in r] for r in out] == [[0, 1, 2, 3]]


def test_packer_state_resumes_exactly():
    lens = lengths(500, seed=3, high=200)
    pieces = [p for doc, n in enumerate(lens) for p in split_document(doc, n, 64, seq=doc)]

    def run(packer: BFDPacker, items: list[Piece]) -> list:
        return [r for it in items for r in packer.push(it)]

    full = BFDPacker(64, lookahead=32, max_open_bins=4)
    expected = run(full, pieces) + full.flush()
    for cut in (1, 137, 400):
        first = BFDPacker(64, lookahead=32, max_open_bins=4)
        head = run(first, pieces[:cut])
        state = first.state_dict()
        second = BFDPacker(64, lookahead=32, max_open_bins=4)
        second.load_state_dict(state)
        assert head + run(second, pieces[cut:]) + second.flush() == expected


def test_packer_rejects_bad_settings_and_pieces():
    with pytest.raises(ValueError, match=r"seq_len must be an integer ≥ 1, got 0"):
        BFDPacker(0)
    with pytest.raises(ValueError, match=r"lookahead must be an integer ≥ 1, got 2.5"):
        BFDPacker(8, lookahead=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"piece.length must be in \[1, seq_len=8\], got 9"):
        BFDPacker(8).push(Piece(0, 0, 9, 9))


def test_build_batch_arrays():
    docs = {0: np.array([11, 12, 13, 0]), 1: np.array([21, 22, 0]), 2: np.array([31, 32, 33, 34, 35, 36, 0])}
    rows = [[Piece(0, 0, 4, 4), Piece(1, 0, 3, 3)], [Piece(2, 0, 5, 7)], [Piece(2, 5, 7, 7)]]
    b = build_batch(rows, docs.__getitem__, 8, batch_size=4, pad_id=0)
    assert b["input_ids"].shape == (4, 8) and b["input_ids"].dtype == np.int64
    assert b["input_ids"][0].tolist() == [11, 12, 13, 0, 21, 22, 0, 0]
    assert b["labels"][0].tolist() == [12, 13, 0, -100, 22, 0, -100, -100]  # no label across documents
    assert b["position_ids"][0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert b["doc_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, -1]
    # a cut piece predicts its own document's next token at its last position
    assert b["labels"][1].tolist() == [32, 33, 34, 35, 36, -100, -100, -100]
    assert b["labels"][2].tolist() == [0, -100] + [-100] * 6
    assert b["doc_ids"][3].tolist() == [-1] * 8 and (b["labels"][3] == IGNORE_INDEX).all()  # padding row
    assert b["cu_seqlens"].tolist() == [0, 4, 7, 8, 13, 16, 18, 24, 32]
    assert b["segment_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1, 2] and b["segment_ids"][3].tolist() == [7] * 8
    assert b["cu_seqlens"].dtype == np.int32


def test_block_causal_mask_follows_the_pieces_even_for_one_document_twice():
    """Segments are the packed pieces: row 0 holds document 1 twice, side by side (a mixture can
    draw a document again); each copy attends only to itself. The mask is checked against the
    pieces' spans, written out by hand, not against the ids it was built from."""
    docs = {0: np.arange(1, 5), 1: np.arange(1, 4), 2: np.arange(1, 8)}
    rows = [[Piece(0, 0, 4, 4, seq=0), Piece(1, 0, 3, 3, seq=1), Piece(1, 0, 3, 3, seq=2)], [Piece(2, 0, 7, 7)]]
    b = {k: torch.from_numpy(v) for k, v in build_batch(rows, docs.__getitem__, 12).items()}
    assert b["doc_ids"][0].tolist() == [0] * 4 + [1] * 6 + [-1] * 2  # the copies share an id ...
    assert b["segment_ids"][0].tolist() == [0] * 4 + [1] * 3 + [2] * 3 + [3] * 2  # ... not a segment
    assert b["segment_ids"][1].tolist() == [4] * 7 + [5] * 5
    spans = [[(0, 4), (4, 7), (7, 10), (10, 12)], [(0, 7), (7, 12)]]  # [start, end) of each piece and padding
    want = torch.zeros(2, 12, 12, dtype=torch.bool)
    for r, row in enumerate(spans):
        for a, z in row:
            want[r, a:z, a:z] = torch.ones(z - a, z - a, dtype=torch.bool).tril()
    m1 = block_causal_mask(b["segment_ids"])
    m2 = block_causal_mask(b["cu_seqlens"], 12)
    assert m1.dtype == torch.bool and torch.equal(m1, want) and torch.equal(m2, want)
    assert torch.equal(segment_ids_of(b["cu_seqlens"], 12), b["segment_ids"])
    assert torch.equal(segment_ids_of(b["cu_seqlens"], 12, batch_size=2), b["segment_ids"])
    assert m1.any(dim=-1).all()  # every query attends at least itself: no NaN rows in softmax
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must be a multiple of seq_len=5, got 24"):
        block_causal_mask(b["cu_seqlens"], 5)


def test_pack_is_deterministic_and_multiset_exact_on_token_lists():
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 1000, size=int(n) - 1), 0) for n in lengths(400, seed=9, high=300)]
    rows = pack([len(d) for d in docs], 128, lookahead=16)
    assert rows == pack([len(d) for d in docs], 128, lookahead=16)
    b = build_batch(rows, docs.__getitem__, 128)
    served = Counter(b["input_ids"][b["doc_ids"] >= 0].tolist())
    assert served == Counter(np.concatenate(docs).tolist())
