"""Tests that a long document's chunks are shuffled among its window's other units (issue H5): no
batch is filled by one document, an epoch still serves every token once on one rank and on two,
and a resume in the middle of the document's chunks continues bitwise. Old states are refused.

Synthetic shards as in test_loader.py: document g's token k is g * STRIDE + k + 1, its last is EOS.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from datapipe.core.config import ConfigError
from datapipe.loader import PackedLoader
from helpers import check_batch, write_source

SEQ_LEN, BATCH = 64, 16
LONG_CHUNKS = 50  # the long document is 50 rows of SEQ_LEN tokens


@pytest.fixture(scope="module")
def long_source(tmp_path_factory) -> tuple[Path, dict[int, list[int]], int]:
    """3,000 short documents (8-40 tokens, ~1,100 rows) with one of 50 x SEQ_LEN tokens in their
    middle, in one shard (so two ranks cut the long document)."""
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(8, 41, size=3000)]
    lengths.insert(1500, LONG_CHUNKS * SEQ_LEN)
    out = tmp_path_factory.mktemp("long")
    docs = write_source(out, [[("web", n) for n in lengths]])
    return out, docs, 1500


def rows_of(batch: dict, doc: int) -> int:
    return int((batch["doc_ids"] == doc).any(dim=1).sum())


def served(batches: list[dict]) -> Counter:
    c: Counter = Counter()
    for b in batches:
        mask = b["doc_ids"] >= 0
        c.update(zip(b["doc_ids"][mask].tolist(), b["input_ids"][mask].tolist()))
    return c


def expected(docs: dict[int, list[int]]) -> Counter:
    return Counter((g, t) for g, toks in docs.items() for t in toks)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_long_document_is_spread_over_its_window_and_served_once(long_source, seed):
    out, docs, long_doc = long_source
    # one window holds every document: 3,050 units, 50 of them the long document's chunks (1.6%)
    loader = PackedLoader(out, seq_len=SEQ_LEN, batch_size=BATCH, seed=seed, epochs=1, lookahead=32)
    batches = list(loader)
    for b in batches:
        check_batch(b, docs, SEQ_LEN, BATCH)
    assert served(batches) == expected(docs)  # every token of the epoch exactly once
    per_batch = [rows_of(b, long_doc) for b in batches]
    assert sum(per_batch) == LONG_CHUNKS
    # ~4.5% of the rows are the long document's, under 1 of 16 rows a batch on average; served back
    # to back (before), 3 batches were that document alone
    assert max(per_batch) <= 4, per_batch
    assert sum(n > 0 for n in per_batch) >= 15, per_batch
    st = loader.stats()
    assert (st["docs_drawn"], st["docs_split"]) == (len(docs), 1)  # counters still count documents


def test_two_ranks_partition_a_long_document(long_source):
    out, docs, long_doc = long_source
    parts = [list(PackedLoader(out, seq_len=SEQ_LEN, batch_size=BATCH, seed=0, rank=r, world_size=2))
             for r in range(2)]
    assert served(parts[0]) + served(parts[1]) == expected(docs)
    assert all(sum(rows_of(b, long_doc) for b in part) > 0 for part in parts)  # the cut falls inside it
    assert all(rows_of(b, long_doc) <= 4 for part in parts for b in part)


def test_resume_in_the_middle_of_a_long_documents_chunks_is_bitwise(long_source):
    out, docs, long_doc = long_source
    kw = dict(seq_len=SEQ_LEN, batch_size=BATCH, seed=0, epochs=2, lookahead=32)
    reference = list(PackedLoader(out, **kw))
    seen = np.cumsum([rows_of(b, long_doc) for b in reference])
    k = int(np.searchsorted(seen, LONG_CHUNKS // 2))  # batch k holds the long document's 25th chunk
    assert 0 < seen[k] < LONG_CHUNKS
    loader = PackedLoader(out, **kw)
    it = iter(loader)
    for _ in range(k + 1):
        next(it)
    state = loader.state_dict()
    resumed = PackedLoader(out, **kw)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(reference) - k - 1
    assert all(torch.equal(x[key], y[key]) for x, y in zip(rest, reference[k + 1 :]) for key in x)


def test_a_state_from_before_units_is_refused(long_source):
    out, _, _ = long_source
    loader = PackedLoader(out, seq_len=SEQ_LEN, batch_size=BATCH, seed=0)
    with pytest.raises(ConfigError, match=r"got 3 \(a state of version 3 was written before a long document's chunks"):
        loader.load_state_dict({**loader.state_dict(), "version": 3})
