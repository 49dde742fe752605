"""Tests of datapipe.loader.PackedLoader: packing invariants on served batches, exact epochs,
rank × worker partition, bitwise resume (workers 0 and 2, mid-epoch and across epochs), mixture and
curriculum schedules, fsspec sources, resume cost on 1,000 shards, and argument errors.

Synthetic shards make every token identify its document and offset: document g's token k is
g * STRIDE + k + 1 and its last token is EOS (0), so a served batch can be checked token by token.
"""

from __future__ import annotations

import multiprocessing

import json
import os
import time
import uuid
from collections import Counter
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from datapipe.core import shards
from datapipe.core.config import ConfigError
from datapipe.loader import PackedLoader
from datapipe.loader.reader import ShardError
from datapipe.loader.schedule import Curriculum, MixtureSchedule, Phase
from helpers import STRIDE, check_batch, mixed_shards, write_source

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


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("long_docs", ["split", "truncate"])
def test_ranks_end_an_epoch_within_one_batch_on_very_long_and_very_short_documents(tmp_path, world, long_docs):
    """A worst case for a split by whole documents: each domain is mostly 2-20-token documents with
    some of 15-45 rows. Ranks cut long documents at chunk boundaries and carry each domain's
    rounding into the next, so every rank serves the same tokens to within a row, and the same
    number of batches to within one; the ranks still partition the epoch exactly."""
    rng = np.random.default_rng(0)
    spec = [[("abc"[s % 3], int(rng.integers(2, 20)) if rng.random() < 0.8 else int(rng.integers(1000, 3000)))
             for _ in range(20)] for s in range(6)]
    docs = write_source(tmp_path, spec)
    seq_len = 64
    batches, parts, domain_tokens = [], [], []
    for rank in range(world):
        loader = PackedLoader(tmp_path, seq_len=seq_len, batch_size=2, seed=0, rank=rank, world_size=world,
                              lookahead=16, long_docs=long_docs)
        served_here = take(loader)
        batches.append(len(served_here))
        parts.append(served(served_here))
        domain_tokens.append(loader.stats()["domain_tokens"])
    assert max(batches) - min(batches) <= 1, batches
    total: Counter = Counter()
    for part in parts:
        assert not (set(total) & set(part))
        total += part
    if long_docs == "split":
        assert total == expected(docs)  # every token once, over the ranks together
    tokens = [sum(p.values()) for p in parts]
    assert max(tokens) - min(tokens) <= seq_len, tokens
    for d in "abc":  # and every rank holds every domain in the same proportion, to within two rows
        per_rank = [t[d] for t in domain_tokens]
        assert max(per_rank) - min(per_rank) <= 2 * seq_len, (d, per_rank)


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


def test_mixture_repeats_documents_side_by_side_and_each_copy_is_its_own_segment(tmp_path):
    """A domain of 3 short documents mixed 50/50 with another restarts its pass every 3 documents,
    so the packer puts two copies of one document next to each other in a row (same doc_ids).
    Each copy must be its own attention segment: the mask is checked against cu_seqlens."""
    docs = write_source(tmp_path, [[("a", 10)] * 3, [("b", 30)] * 20])
    loader = PackedLoader(tmp_path, seq_len=128, batch_size=2, seed=0, epochs=1, mixture={"a": 1, "b": 1}, lookahead=4)
    adjacent = 0
    for b in take(loader, 10):
        check_batch(b, docs, 128, 2)
        cu, doc = b["cu_seqlens"].tolist(), b["doc_ids"].reshape(-1).tolist()
        adjacent += sum(doc[c] == doc[c - 1] >= 0 for c in cu[1:-1])  # a piece starts where the same document ends
    assert adjacent >= 2, adjacent


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
    from datapipe.curation.executors import LocalExecutor
    from datapipe import curate

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
    # every document comes back whole: its pieces are the shard row's seq_len chunks (served in any order:
    # a long document's chunks are shuffled among the window's other units)
    chunks = {g: sorted(t[i : i + 256] for i in range(0, len(t), 256)) for g, t in docs.items()}
    assert {g: sorted(p) for g, p in pieces.items()} == chunks


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


def test_state_at_a_position_carries_the_live_losses(source):
    """`state_dict(position)`: the position of an earlier batch (as a prefetcher captures it) with
    the losses reported since; a loader given it resumes at that batch with those losses."""
    out, _ = source
    kw = dict(seq_len=64, batch_size=2, seed=4, lookahead=8)
    loader = PackedLoader(out, **kw)
    head = take(loader, 3)
    position = loader.state_dict()  # captured after batch 3 was read ...
    ahead = take(loader, 2)  # ... but the source runs two batches ahead of the trainer
    loader.report_losses([1, 2], [0.5, 1.5])
    state = json.loads(json.dumps(loader.state_dict(position=position)))
    assert state["planner"] == position["planner"] and state["stats"] == position["stats"]
    assert position["losses"] == [] and state["losses"] == loader.state_dict()["losses"] != []
    resumed = PackedLoader(out, **kw)
    resumed.load_state_dict(state)
    assert resumed.losses() == {1: 0.5, 2: 1.5}
    assert same(take(resumed, 2), ahead) and len(head) == 3
    with pytest.raises(ValueError, match=r"position must be a state from state_dict\(\)"):
        loader.state_dict(position={"version": -1})


def test_report_losses_and_state_dict_need_no_lock_of_the_caller(source):
    """Threads reporting the same documents while another takes states: no update is lost and no
    state is torn (the feedback object holds its own lock). A tiny switch interval forces the
    interleavings that an unguarded read-modify-write or iteration would lose to."""
    import sys
    import threading

    out, _ = source
    loader = PackedLoader(out, seq_len=64, batch_size=2, loss_memory=1000)
    threads, reports, errors = 4, 150, []
    stop = threading.Event()

    def report():
        try:
            for i in range(reports):
                loader.report_losses(list(range(40)), [1.0] * 40)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    def snapshot():
        try:
            while not stop.is_set():
                json.dumps(loader.state_dict(position=loader.state_dict()))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=report) for _ in range(threads)]
        reader = threading.Thread(target=snapshot)
        reader.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        stop.set()
        reader.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    counts = {doc: n for doc, _, n in loader.state_dict()["losses"]}
    assert counts == {doc: threads * reports for doc in range(40)}


def three_shards(out: Path) -> tuple[dict[int, list[int]], Path, set[int]]:
    """A source of 3 one-domain shards; returns the documents, shard 1's file and its document ids."""
    docs = write_source(out, [[("a", 40)] * 10, [("a", 50)] * 10, [("a", 60)] * 10])
    info = shards.read_manifest(out)["shards"][1]
    return docs, out / info["path"], set(range(10, 20))


def served_until_error(loader: PackedLoader) -> tuple[list[dict], BaseException | None]:
    out = []
    try:
        for b in loader:
            out.append(b)
    except ShardError as exc:
        return out, exc
    return out, None


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_a_damaged_shard_is_named_before_any_of_its_tokens_is_served(tmp_path, damage, workers):
    docs, path, ids = three_shards(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flipped":  # same size, one byte of the token data changed
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) - 100]
    path.write_bytes(bytes(data))
    batches, error = served_until_error(PackedLoader(tmp_path, seq_len=64, batch_size=2, num_workers=workers))
    assert error is not None and "shards/" + path.name in str(error)
    assert ("sha256" if damage == "flipped" else "bytes but the manifest says") in str(error)
    assert not ids & {g for b in batches for g in b["doc_ids"].unique().tolist()}  # nothing of it was served
    # the DataLoader's workers are stopped with the error, not left to the garbage collector (which took 5 s each)
    assert not multiprocessing.active_children()


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    docs, path, ids = three_shards(tmp_path)  # document g's token ids run up to g * STRIDE + length - 1
    manifest = shards.read_manifest(tmp_path)
    manifest["tokenizer"]["vocab_size"] = 10 * STRIDE  # shard 0 (documents 0-9) fits, shards 1 and 2 do not
    shards.write_manifest(tmp_path, manifest)
    # one shard per window: shard 0 is read (and served) before shard 1 is opened
    batches, error = served_until_error(PackedLoader(tmp_path, seq_len=64, batch_size=2, shuffle=False, lookahead=2,
                                                     shuffle_shards=1))
    assert error is not None and "token ids >= the manifest's tokenizer vocab_size=100000" in str(error)
    assert "shards/" + path.name in str(error)
    assert batches and not {g for b in batches for g in b["doc_ids"].unique().tolist()} - set(range(-1, 10))


def test_a_shard_is_hashed_once_until_it_changes(tmp_path, monkeypatch):
    import hashlib

    docs, path, _ = three_shards(tmp_path)
    hashed: list[str] = []
    real = hashlib.file_digest

    def counting(f, name):
        hashed.append(getattr(f, "name", ""))
        return real(f, name)

    monkeypatch.setattr(hashlib, "file_digest", counting)
    kw = dict(seq_len=64, batch_size=2)
    reference = take(PackedLoader(tmp_path, **kw))
    assert len(hashed) == 3
    again = take(PackedLoader(tmp_path, **kw))  # another loader (a resume, or DataLoader workers)
    assert same(again, reference) and len(hashed) == 3  # remembered by (path, size, mtime): no re-hash
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # the shard was rewritten (same bytes)
    take(PackedLoader(tmp_path, **kw))
    assert len(hashed) == 4 and hashed[-1].endswith(path.name)
    monkeypatch.setenv("DATAPIPE_CACHE_DIR", str(tmp_path / "empty-cache"))
    assert same(take(PackedLoader(tmp_path, verify=False, **kw)), reference) and len(hashed) == 4


def test_errors_name_the_argument_and_value(source, tmp_path):
    """Argument errors are ConfigErrors (the CLI prints them without a traceback) naming the argument."""
    out, _ = source
    with pytest.raises(ConfigError, match=r"seq_len must be an integer ≥ 1, got 0"):
        PackedLoader(out, seq_len=0, batch_size=1)
    with pytest.raises(ConfigError, match=r"rank must be in \[0, world_size=2\), got 2"):
        PackedLoader(out, seq_len=8, batch_size=1, rank=2, world_size=2)
    with pytest.raises(ConfigError, match=r"long_docs must be one of .*got 'cut'"):
        PackedLoader(out, seq_len=8, batch_size=1, long_docs="cut")
    with pytest.raises(ConfigError, match=r"mixture names domains \['wiki'\] that the manifest lacks"):
        PackedLoader(out, seq_len=8, batch_size=1, mixture={"wiki": 1.0})
    with pytest.raises(ConfigError, match=r"long_docs key must be '\*' or a domain"):
        PackedLoader(out, seq_len=8, batch_size=1, long_docs={"wiki": "drop"})
    with pytest.raises(ConfigError, match=r"phases\[0\].weights\['web'\] must be a finite number ≥ 0, got -1"):
        PackedLoader(out, seq_len=8, batch_size=1, mixture={"web": -1})
    with pytest.raises(ConfigError, match=r"prioritize keys must be among .*got \['pools'\]"):
        PackedLoader(out, seq_len=8, batch_size=1, prioritize={"pools": 3})
    a = PackedLoader(out, seq_len=64, batch_size=2, seed=1)
    b = PackedLoader(out, seq_len=64, batch_size=2, seed=2)
    with pytest.raises(ConfigError, match=r"state\['config'\]\['seed'\] is 1 but this loader has 2"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ConfigError, match=r"got 1 \(a state of version 1 was written before ranks were balanced"):
        a.load_state_dict({**a.state_dict(), "version": 1})
    write_source(tmp_path, [[("a", 5)]])
    with pytest.raises(ConfigError, match=r"world_size must be at most the manifest's total_docs=1 .*got 4"):
        PackedLoader(tmp_path, seq_len=8, batch_size=1, rank=0, world_size=4)


def test_an_epoch_of_many_tiny_shards_opens_each_shard_about_once(tmp_path, monkeypatch):
    # 400 shards of 3 documents, three domains, long-tailed lengths: the default window of 8,192
    # documents spans every shard, far more than the 16 cached. Bounding each window to a few shards
    # and holding the shards of waiting pieces open must open each shard O(1) times per epoch.
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    rng = np.random.default_rng(1)
    spec = [[("abc"[s % 3], int(min(rng.lognormal(3.0, 1.0) + 2, 300))) for _ in range(3)] for s in range(400)]
    docs = write_source(tmp_path, spec)
    opened: Counter = Counter()
    real = shards.open_shard

    def counting(source, rel):
        opened[rel] += 1
        return real(source, rel)

    monkeypatch.setattr(shards, "open_shard", counting)
    for workers in (0, 2):  # workers plan every batch and build their share: each process opens ≤ 2× shards
        opened.clear()
        loader = PackedLoader(tmp_path, seq_len=64, batch_size=4, seed=0, lookahead=64, num_workers=workers)
        batches, open_now = [], []
        for b in loader:
            batches.append(b)
            open_now.append(len(loader._reader._cache))
        assert served(batches) == expected(docs)  # the whole epoch, every token once
        if workers == 0:  # worker processes open shards out of sight of this counter
            assert len(opened) == 400 and sum(opened.values()) <= 2 * 400, (len(opened), sum(opened.values()))
            assert max(opened.values()) <= 2, opened.most_common(3)
            # held shards are let go: 3 windows of 16 shards, those of the pieces in the look-ahead (64), the
            # open bins and the planned rows, and the LRU's 16 (+4 between evictions): far below the 400 of a leak
            assert max(open_now) <= 160, max(open_now)
