"""Tests of datapipe.loader.PackedLoader: packing invariants on served batches, exact epochs,
rank × worker partition, bitwise resume (workers 0 and 2, mid-epoch and across epochs), mixture and
curriculum schedules, fsspec sources, resume cost on 1,000 shards, and argument errors.

Synthetic shards make every token identify its document and offset: document g's token k is
g * STRIDE + k + 1 and its last token is EOS (0), so a served batch can be checked token by token.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pytest
import torch

from datapipe.core import shards
from datapipe.loader import PackedLoader
from datapipe.loader.packing import block_causal_mask
from datapipe.loader.schedule import Curriculum, MixtureSchedule, Phase

STRIDE = 10_000
EOS = 0


def doc_tokens(g: int, n: int) -> list[int]:
    return [g * STRIDE + k + 1 for k in range(n - 1)] + [EOS]


def write_source(out: Path, shard_docs: list[list[tuple[str, int]]], *, scores: bool = False) -> dict[int, list[int]]:
    """Shards of documents given as (domain, length) per shard; returns {global doc id: tokens}."""
    infos, docs, g = [], {}, 0
    for index, spec in enumerate(shard_docs):
        cols = {"id": [], "domain": [], "tokens": [], "num_tokens": []}
        for domain, n in spec:
            docs[g] = doc_tokens(g, n)
            cols["id"].append(f"d{g}")
            cols["domain"].append(domain)
            cols["tokens"].append(docs[g])
            cols["num_tokens"].append(n)
            g += 1
        table = pa.table({
            "id": pa.array(cols["id"], pa.string()),
            "domain": pa.array(cols["domain"], pa.string()),
            "tokens": pa.array(cols["tokens"], pa.list_(pa.uint32())),
            "num_tokens": pa.array(cols["num_tokens"], pa.int64()),
        })
        if scores:  # a difficulty score unrelated to length: the document id modulo 7
            table = table.append_column("score", pa.array([float((g - len(spec) + i) % 7) for i in range(len(spec))]))
        infos.append(shards.write_shard(out, index, table))
    tokenizer = {"eos_id": EOS, "bos_id": None, "dtype": "uint32", "vocab_size": 2**24, "path": None, "sha256": None}
    shards.write_manifest(out, shards.build_manifest(infos, tokenizer=tokenizer, config={}, config_hash="test"))
    return docs


def mixed_shards(seed: int = 0, n_shards: int = 6, per_shard: int = 40, high: int = 300) -> list[list[tuple[str, int]]]:
    """Domain-clustered shards like curated ones (most hold one domain), long-tailed lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n_shards):
        domains = ["web"] * 3 + ["code"] * 2 + ["book"]
        base = domains[s % len(domains)]
        spec = []
        for _ in range(per_shard):
            d = base if s != 2 or rng.random() < 0.5 else "book"
            spec.append((d, int(min(rng.lognormal(4.0, 1.0) + 2, high))))
        out.append(spec)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict[int, list[int]]]:
    out = tmp_path_factory.mktemp("src")
    return out, write_source(out, mixed_shards())


def take(loader: PackedLoader, n: int | None = None) -> list[dict[str, torch.Tensor]]:
    out = []
    for b in loader:
        out.append(b)
        if n is not None and len(out) == n:
            break
    return out


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def served(batches: list[dict]) -> Counter:
    """(document, token) pairs served: each identifies one token of one document."""
    c: Counter = Counter()
    for b in batches:
        mask = b["doc_ids"] >= 0
        c.update(zip(b["doc_ids"][mask].tolist(), b["input_ids"][mask].tolist()))
    return c


def expected(docs: dict[int, list[int]], ids=None) -> Counter:
    return Counter((g, t) for g, toks in docs.items() if ids is None or g in ids for t in toks)


def check_batch(b: dict, docs: dict[int, list[int]], seq_len: int, batch_size: int) -> None:
    """Every packing invariant, checked against the original documents."""
    for key in ("input_ids", "labels", "position_ids", "doc_ids"):
        assert b[key].shape == (batch_size, seq_len) and b[key].dtype == torch.int64
    cu = b["cu_seqlens"].tolist()
    assert b["cu_seqlens"].dtype == torch.int32 and cu[0] == 0 and cu[-1] == batch_size * seq_len
    ids, labels = b["input_ids"].reshape(-1).tolist(), b["labels"].reshape(-1).tolist()
    pos, doc = b["position_ids"].reshape(-1).tolist(), b["doc_ids"].reshape(-1).tolist()
    for a, z in zip(cu[:-1], cu[1:]):
        assert a // seq_len == (z - 1) // seq_len  # a segment never spans two rows
        assert pos[a:z] == list(range(z - a))  # positions restart at every segment
        assert len(set(doc[a:z])) == 1
        g = doc[a]
        if g < 0:  # padding: no loss
            assert all(x == -100 for x in labels[a:z])
            continue
        toks = docs[g]
        start = 0 if ids[a] == EOS else ids[a] - g * STRIDE - 1
        assert ids[a:z] == toks[start : start + z - a]  # a contiguous range of one document
        nxt = toks[start + 1 : start + z - a + 1]  # labels: the next token of the same document ...
        want = nxt + [-100] * (z - a - len(nxt))  # ... and -100 where the document ends
        assert labels[a:z] == want
    # a document's ids are never adjacent to another's inside one attention segment
    mask = block_causal_mask(b["doc_ids"])
    assert not (mask & (b["doc_ids"][:, :, None] != b["doc_ids"][:, None, :])).any()


def test_epoch_serves_every_token_once_with_packing_invariants(source):
    out, docs = source
    loader = PackedLoader(out, seq_len=128, batch_size=4, seed=1, epochs=1, lookahead=16, shuffle_window=16)
    batches = take(loader)
    for b in batches:
        check_batch(b, docs, 128, 4)
    assert served(batches) == expected(docs)
    st = loader.stats()
    total = sum(len(t) for t in docs.values())
    assert st["tokens"] == total and st["epoch"] == 1 and st["docs_drawn"] == len(docs)
    assert st["docs_split"] == sum(len(t) > 128 for t in docs.values())
    assert 0.9 < st["packing_efficiency"] <= 1.0
    assert take(loader) == []  # the run is over: iterating again yields nothing


def test_same_seed_same_batches_other_seed_other_order(source):
    out, _ = source
    a = take(PackedLoader(out, seq_len=64, batch_size=4, seed=5, lookahead=8))
    b = take(PackedLoader(out, seq_len=64, batch_size=4, seed=5, lookahead=8))
    c = take(PackedLoader(out, seq_len=64, batch_size=4, seed=6, lookahead=8))
    assert same(a, b) and not same(a, c) and served(a) == served(c)


def test_ranks_and_workers_partition_exactly_and_workers_do_not_change_batches(source):
    out, docs = source
    kw = dict(seq_len=96, batch_size=2, seed=3, epochs=1, world_size=2, lookahead=8, shuffle_window=24)
    per_part: dict[tuple[int, int], Counter] = {}
    for rank in range(2):
        ref = take(PackedLoader(out, rank=rank, num_workers=0, **kw))
        with_workers = take(PackedLoader(out, rank=rank, num_workers=2, **kw))
        assert same(ref, with_workers)  # batch k is built by worker k % 2: the sequence is the same
        for w in range(2):
            per_part[rank, w] = served(with_workers[w::2])
    total: Counter = Counter()
    for part in per_part.values():
        assert not (set(total) & set(part))  # disjoint: no token served by two rank × worker parts
        total += part
    assert total == expected(docs)  # and together they serve every token exactly once
    # each rank holds half of every domain's tokens, to within one document: balanced batch counts
    manifest = shards.read_manifest(out)
    domain_of = [d for info in manifest["shards"] for d in shards.open_shard(out, info["path"]).column("domain").to_pylist()]
    tokens = [Counter(domain_of[g] for w in range(2) for g, _ in per_part[rank, w].elements()) for rank in range(2)]
    for d in manifest["domains"]:
        longest = max(len(t) for g, t in docs.items() if domain_of[g] == d)
        assert abs(tokens[0][d] - tokens[1][d]) < 2 * longest


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_is_bitwise_mid_epoch_and_across_epochs(source, workers):
    out, docs = source
    kw = dict(seq_len=64, batch_size=3, seed=7, epochs=2, lookahead=12, shuffle_window=20, max_open_bins=4)
    reference = take(PackedLoader(out, **kw))
    per_epoch = sum(len(t) for t in docs.values())
    assert served(reference) == Counter({k: 2 * v for k, v in expected(docs).items()})
    # cut points: early, mid-epoch, and just after epoch 0 ends (its last batch), into epoch 1
    tokens = np.cumsum([int((b["doc_ids"] >= 0).sum()) for b in reference])
    end0 = int(np.searchsorted(tokens, per_epoch)) + 1
    cuts = [1, len(reference) // 3, end0 - 1, end0 + 2] if workers == 0 else [len(reference) // 3, end0 + 2]
    for cut in cuts:
        first = PackedLoader(out, num_workers=workers, **kw)
        head = take(first, cut)
        state = json.loads(json.dumps(first.state_dict()))  # JSON-serialisable
        resumed = PackedLoader(out, num_workers=2 - workers, **kw)  # and the other number of workers
        resumed.load_state_dict(state)
        tail = take(resumed)
        assert same(head + tail, reference), cut
        assert resumed.stats()["tokens"] == 2 * per_epoch and resumed.stats()["epoch"] == 2
    assert len(json.dumps(state)) < 20_000


def test_infinite_mode_counts_epochs_and_reshuffles(source):
    out, docs = source
    loader = PackedLoader(out, seq_len=64, batch_size=4, seed=0, epochs=None, lookahead=8)
    per_epoch = sum(len(t) for t in docs.values())
    batches, order = [], []
    for b in loader:
        batches.append(b)
        order.append(loader.epoch)
        if loader.stats()["tokens"] > 2.5 * per_epoch:
            break
    assert loader.epoch == 2 and order == sorted(order)
    firsts = [b["doc_ids"][0, 0].item() for b in batches[:5]]
    n0 = order.index(1)  # the first batch drawn once epoch 1 began
    assert [b["doc_ids"][0, 0].item() for b in batches[n0 : n0 + 5]] != firsts


def test_mixture_schedule_realised_within_tolerance(tmp_path):
    # natural shares are 3:1 by tokens; the schedule asks 1:1, then moves linearly to all-b
    spec = [[("a", 60)] * 60, [("b", 20)] * 60]
    docs = write_source(tmp_path, spec)
    total = sum(len(t) for t in docs.values())
    schedule = MixtureSchedule([Phase(0, {"a": 1, "b": 1}), Phase(2000, {"a": 1, "b": 1}), Phase(4000, {"b": 1})],
                               interpolation="linear")
    loader = PackedLoader(tmp_path, seq_len=64, batch_size=2, seed=0, epochs=2, mixture=schedule, lookahead=4)
    shares = []
    a_ids = set(range(60))
    for b in loader:
        ids = b["doc_ids"][b["doc_ids"] >= 0]
        shares.append((loader.stats()["tokens"], sum(int(i in a_ids) for i in ids.tolist()), len(ids)))
    assert loader.stats()["tokens"] == 2 * total  # an epoch is the manifest's tokens
    first = [s for s in shares if s[0] <= 2000]
    a_share = sum(s[1] for s in first) / sum(s[2] for s in first)
    assert abs(a_share - 0.5) < 0.05
    late = [s for s in shares if s[0] > 4300]
    assert sum(s[1] for s in late) / sum(s[2] for s in late) < 0.03
    # b (1,200 tokens) is exhausted many times over: it repeats, each pass a fresh permutation
    st = loader.stats()
    assert st["domain_tokens"]["b"] > 2 * sum(len(docs[g]) for g in docs if g >= 60)
    # weights from config
    even = PackedLoader(tmp_path, seq_len=64, batch_size=2, seed=0, mixture={"a": 1, "b": 3}, lookahead=4)
    take(even)
    assert abs(even.stats()["domain_shares"]["b"] - 0.75) < 0.03


def test_mixture_domain_absent_from_a_rank_is_left_to_the_others(tmp_path):
    write_source(tmp_path, [[("a", 30)], [("b", 20)] * 40])  # one document of a: always rank 0's
    kw = dict(seq_len=64, batch_size=2, seed=0, world_size=2, mixture={"a": 1, "b": 1}, lookahead=4)
    rank1 = PackedLoader(tmp_path, rank=1, **kw)
    take(rank1)
    assert rank1.stats()["domain_tokens"]["a"] == 0 and rank1.stats()["tokens"] >= 400
    assert rank1.state_dict()["planner"]["excluded"] == ["a"]
    rank0 = PackedLoader(tmp_path, rank=0, **kw)
    take(rank0)
    assert abs(rank0.stats()["domain_shares"]["a"] - 0.5) < 0.1  # rank 0 repeats its document of a


def test_curriculum_orders_each_domain_from_easy_to_hard(tmp_path):
    docs = write_source(tmp_path, [[("a", 10)] * 30, [("a", 12)] * 30], scores=True)
    loader = PackedLoader(tmp_path, seq_len=64, batch_size=1, seed=0, lookahead=1, max_open_bins=0,
                          curriculum=Curriculum("score"))
    order = [b["doc_ids"][0, 0].item() for b in loader]  # lookahead 1: one document per row, in draw order
    assert sorted(order) == sorted(docs)
    scores = [g % 7 for g in order]
    assert scores == sorted(scores)
    by_len = PackedLoader(tmp_path, seq_len=64, batch_size=1, lookahead=1, max_open_bins=0,
                          curriculum=Curriculum("num_tokens", descending=True))
    assert [len(docs[b["doc_ids"][0, 0].item()]) for b in by_len][:30] == [12] * 30
    with pytest.raises(ValueError, match=r"curriculum.column must name a column of the shards, got 'loss'"):
        take(PackedLoader(tmp_path, seq_len=64, batch_size=1, curriculum=Curriculum("loss")))


def test_long_document_policy_per_domain(tmp_path):
    docs = write_source(tmp_path, [[("a", 100), ("b", 100), ("c", 100), ("a", 10)]])
    loader = PackedLoader(tmp_path, seq_len=32, batch_size=2, long_docs={"b": "truncate", "c": "drop"})
    batches = take(loader)
    got = served(batches)
    assert got == expected(docs, {0, 3}) + Counter((1, t) for t in docs[1][:32])
    st = loader.stats()
    assert (st["docs_split"], st["docs_truncated"], st["docs_dropped"], st["tokens_dropped"]) == (1, 1, 1, 168)


def test_fsspec_sources_give_the_same_batches(source):
    out, _ = source
    kw = dict(seq_len=64, batch_size=4, seed=2, lookahead=8)
    local = take(PackedLoader(out, **kw))
    assert same(local, take(PackedLoader(f"file://{out}", **kw)))
    root = f"memory://loader-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        for p in sorted(out.rglob("*")):
            if p.is_file():
                fs.pipe(f"{root}/{p.relative_to(out)}", p.read_bytes())
        mem = PackedLoader(root, **kw)
        assert same(local, take(mem, 3) + take(mem))  # resumes across iter() calls too
    finally:
        fs.rm(root, recursive=True)


def test_resume_on_1000_shards_reads_only_the_shards_it_needs(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # 1,000 fsyncs of tiny shards are most of the time
    rng = np.random.default_rng(0)
    write_source(tmp_path, [[("a" if s % 3 else "b", int(rng.integers(2, 40))) for _ in range(4)] for s in range(1000)])
    kw = dict(seq_len=64, batch_size=2, seed=0, lookahead=8, shuffle_window=16)
    first = PackedLoader(tmp_path, **kw)
    head = take(first, 200)
    state = first.state_dict()
    reference = take(first, 5)
    opened: list[str] = []
    real = shards.open_shard

    def counting(source, rel):
        opened.append(rel)
        return real(source, rel)

    monkeypatch.setattr(shards, "open_shard", counting)
    t0 = time.perf_counter()
    resumed = PackedLoader(tmp_path, **kw)
    resumed.load_state_dict(state)
    nxt = take(resumed, 5)
    seconds = time.perf_counter() - t0
    assert same(nxt, reference) and len(head) == 200
    # the shards of the pieces in the state and of the documents drawn for the next 5 batches
    # (about 6 short documents a batch, 4 per shard): a few dozen at most, never the 1,000
    assert len(set(opened)) <= 30, len(set(opened))
    assert seconds < 2.0, seconds


def test_curated_shards_boundaries_come_from_the_rows(tmp_path, slice_input):
    from helpers import small_config
    from datapipe.curate.executors import LocalExecutor
    from datapipe.curate.runner import curate

    out = tmp_path / "out"
    curate(small_config(out, [slice_input]), executor=LocalExecutor(), progress=False, log=lambda _: None)
    manifest = shards.read_manifest(out)
    eos = manifest["tokenizer"]["eos_id"]
    docs = {}
    for info in manifest["shards"]:
        docs.update(enumerate(shards.open_shard(out, info["path"]).column("tokens").to_pylist(), start=len(docs)))
    loader = PackedLoader(out, seq_len=256, batch_size=4, seed=0)
    batches = take(loader)
    assert loader.stats()["tokens"] == manifest["total_tokens"]
    pieces: dict[int, list[list[int]]] = {}
    for b in batches:
        cu = b["cu_seqlens"].tolist()
        ids, labels, doc = (b[k].reshape(-1).tolist() for k in ("input_ids", "labels", "doc_ids"))
        for a, z in zip(cu[:-1], cu[1:]):
            if doc[a] < 0:
                continue
            pieces.setdefault(doc[a], []).append(ids[a:z])
            # the rows' own boundaries: an EOS only ever ends a segment, and predicts nothing
            assert eos not in ids[a : z - 1]
            assert (labels[z - 1] == -100) == (ids[z - 1] == eos)
            assert labels[a : z - 1] == ids[a + 1 : z]
    # every document comes back whole: its pieces, in the order served, are the shard row
    assert {g: sum(p, []) for g, p in pieces.items()} == docs


def test_report_losses_is_bounded_and_part_of_the_state(source):
    out, _ = source
    loader = PackedLoader(out, seq_len=64, batch_size=2, loss_memory=3)
    loader.report_losses(torch.tensor([5, 5, 6, -1]), torch.tensor([1.0, 3.0, 4.0, 9.0]))
    assert loader.losses() == {5: 2.0, 6: 4.0}
    loader.report_losses([5, 7, 8], [4.0, 1.0, 1.0])
    assert loader.losses() == {5: 0.9 * 2.0 + 0.1 * 4.0, 7: 1.0, 8: 1.0}  # 6 was the least recent
    other = PackedLoader(out, seq_len=64, batch_size=2, loss_memory=3)
    other.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert other.losses() == loader.losses()
    with pytest.raises(ValueError, match=r"doc_ids and losses must have the same number of elements, got 2 and 1"):
        loader.report_losses([1, 2], [0.5])


def test_errors_name_the_argument_and_value(source, tmp_path):
    out, _ = source
    with pytest.raises(ValueError, match=r"seq_len must be an integer ≥ 1, got 0"):
        PackedLoader(out, seq_len=0, batch_size=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        PackedLoader(out, seq_len=8, batch_size=1, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"long_docs must be one of .*got 'cut'"):
        PackedLoader(out, seq_len=8, batch_size=1, long_docs="cut")
    with pytest.raises(ValueError, match=r"mixture names domains \['wiki'\] that the manifest lacks"):
        PackedLoader(out, seq_len=8, batch_size=1, mixture={"wiki": 1.0})
    with pytest.raises(ValueError, match=r"long_docs key must be '\*' or a domain"):
        PackedLoader(out, seq_len=8, batch_size=1, long_docs={"wiki": "drop"})
    a = PackedLoader(out, seq_len=64, batch_size=2, seed=1)
    b = PackedLoader(out, seq_len=64, batch_size=2, seed=2)
    with pytest.raises(ValueError, match=r"state\['config'\]\['seed'\] is 1 but this loader has 2"):
        b.load_state_dict(a.state_dict())
    write_source(tmp_path, [[("a", 5)]])
    with pytest.raises(ValueError, match=r"world_size must be at most the manifest's total_docs=1 .*got 4"):
        PackedLoader(tmp_path, seq_len=8, batch_size=1, rank=0, world_size=4)
