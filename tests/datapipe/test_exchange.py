"""The one exchange (`datapipe.core.exchange`): the senders' files read directly while that is few files and
requests, else combined; either way every receiver reads the same rows in the same order."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from datapipe.core import exchange
from datapipe.core.exchange import Combined, Exchange, SenderFiles, combine_layout, route
from datapipe.core.shuffle import read_shuffle, shuffle_files, write_shuffle
from datapipe.core.workfiles import read_record


def _write_senders(folder, names, partitions, rng) -> int:
    """Senders' files of up to 30 rows each, spread over `partitions`; the largest file's bytes."""
    largest = 0
    for i, name in enumerate(names):
        n = int(rng.integers(0, 30))
        table = pa.table({"order": np.arange(n, dtype=np.int64) + 100 * i, "key": [f"{name}-{j}" for j in range(n)]})
        largest = max(largest, write_shuffle(folder / f"{name}.shuffle", table, rng.integers(0, partitions, size=n), partitions))
    return largest


class _Tasks:
    """A run_tasks that runs in this process and counts the tasks of each call."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, fn, shared, items, desc, record=None):
        self.calls.append(len(items))
        return [fn(shared, *item) for item in items]


@pytest.mark.parametrize("receiver_files, groups, ranges, calls", [(64, 3, 1, [3]), (2, 2, 2, [3, 4])])
def test_combined_senders_give_each_receiver_the_same_rows_in_the_same_order(tmp_path, monkeypatch, receiver_files,
                                                                             groups, ranges, calls):
    """5 senders to 4 receivers (2 x 5 x 4 requests: past 4 x (5 + 4)): merged as many to a group as fit a combine
    task's bytes (2 here), each sender's file read whole; where that leaves more groups than a receiver may read
    (RECEIVER_FILES), the senders are first merged whole into batches of 2 (3 tasks), and the 3 batches' files into
    2 groups cut into 2 partition ranges, one task each (4). Every partition reads the same rows, in the same order,
    from the combined files as from the 5 senders' (so receivers' outputs do not change), and never more than
    RECEIVER_FILES files."""
    rng = np.random.default_rng(0)
    names = tuple(f"b{i}" for i in range(5))
    largest = _write_senders(tmp_path, names, 4, rng)
    monkeypatch.setattr(exchange, "COMBINE_BYTES", 6 * largest + 1)  # two files fit a task whole
    monkeypatch.setattr(exchange, "RECEIVER_FILES", receiver_files)
    run_tasks = _Tasks()
    direct = [read_shuffle(shuffle_files(tmp_path, names), p, 4) for p in range(4)]
    combined = route(run_tasks, Exchange("keys", str(tmp_path), names, 4, largest))
    assert isinstance(combined, Combined) and combined == exchange.layout(Exchange("keys", str(tmp_path), names, 4, largest))
    assert (combined.per_file, len(combined.starts), combined.groups) == (2, ranges, groups)
    assert run_tasks.calls == calls and groups <= receiver_files
    for p in range(4):
        assert combined.read(p).equals(direct[p])
    span = combined.read(1, through=4).to_pylist()  # over both ranges when there are two: the same rows
    assert sorted(span, key=str) == sorted((r for p in (1, 2, 3) for r in direct[p].to_pylist()), key=str)
    # the senders' files (and the batches'), read by no one now, are gone
    assert sorted(f.name for f in tmp_path.iterdir() if f.is_file()) == sorted(
        f"{combined.name(r, k)}.shuffle" for r in range(ranges) for k in range(groups))


def test_a_few_senders_are_read_directly_with_no_task(tmp_path):
    """4 senders to 4 receivers: 2 x 4 x 4 requests, within 4 x (4 + 4): no combine task runs, the senders' files
    stay, and a receiver reads its rows of each (with each row's sender where the exchange asks for it)."""
    names = tuple(f"b{i}" for i in range(4))
    _write_senders(tmp_path, names, 4, np.random.default_rng(1))
    run_tasks = _Tasks()
    received = route(run_tasks, Exchange("keys", str(tmp_path), names, 4, 10**6, source_column="sender"))
    assert isinstance(received, SenderFiles) and run_tasks.calls == []
    for p in range(4):
        assert received.read(p).equals(read_shuffle(shuffle_files(tmp_path, names), p, 4, source_column="sender"))
    # a fifth sender makes 2 x 5 x 4 > 4 x (5 + 4): combined
    assert isinstance(exchange.layout(Exchange("keys", str(tmp_path), (*names, "b4"), 4, 10**6)), Combined)
    # past RECEIVER_FILES senders a receiver would read too many files, even one receiver
    many = tuple(f"b{i}" for i in range(exchange.RECEIVER_FILES + 1))
    assert isinstance(exchange.layout(Exchange("sample", "x", many, 1, 10**6)), Combined)
    assert isinstance(exchange.layout(Exchange("sample", "x", many[:-1], 1, 10**6)), SenderFiles)


def test_the_layout_for_a_terabyte_keeps_receivers_to_a_few_files_and_tasks_within_memory():
    """At the planner's layout for 1 TB (16,384 block files of near-dedup keys, ~9 MB each, 1,165 partitions) a
    receiver reads at most RECEIVER_FILES files, and no combine task holds more than COMBINE_BYTES (a third of it
    for its senders' ranges); small files merge as many to a group as a task takes."""
    big = combine_layout("keys", 16_384, 1_165, 9_000_000)
    assert big.groups <= exchange.RECEIVER_FILES
    share = big.per_file * 9_000_000 / len(big.starts)  # a range's share of its group's bytes
    assert 3 * share <= exchange.COMBINE_BYTES * 1.01 and len(big.starts) > 1
    small = combine_layout("keys", 16_384, 1_165, 2_000)
    assert (small.per_file, len(small.starts)) == (exchange.COMBINE_SENDERS, 1)
    aligned = combine_layout("keys", 16_384, 1_165, 9_000_000, spans=range(0, 1_165, 5))
    assert all(s % 5 == 0 for s in aligned.starts)


def test_at_a_terabytes_bytes_each_sender_is_read_once_and_receivers_read_a_few_files():
    """1 TB's near-dedup nodes (16,384 files of 34 MB, 1,165 partitions): 64 groups of 256 would not fit a combine task
    whole, and each of 25 partition ranges' tasks would read every sender (2 x 16,384 x 25 requests). `plan` merges the
    senders whole into batches that fit a task first (each sender's file read once), then the batches' files in
    partition ranges: no task holds more than COMBINE_BYTES, a receiver reads at most RECEIVER_FILES files."""
    big = Exchange("nodes", "keys", tuple(f"b{i}" for i in range(16_384)), 1_165, 34_000_000)
    combines, received = exchange.plan(big)
    (first, batches), (second, ranged) = combines
    assert first is big and batches.prefix == "batch" and len(batches.starts) == 1
    assert 3 * batches.per_file * 34_000_000 <= exchange.COMBINE_BYTES  # a batch's senders fit its task whole
    assert second.senders == tuple(batches.name(0, k) for k in range(batches.groups)) and received is ranged
    assert 3 * ranged.per_file * second.largest_bytes / len(ranged.starts) <= exchange.COMBINE_BYTES * 1.01
    assert ranged.groups <= exchange.RECEIVER_FILES
    reads = 16_384 + 2 * batches.groups * len(ranged.starts)  # each sender whole once; a batch file's range by each range
    assert reads < 2 * 16_384 * len(exchange.combine_layout("keys", 16_384, 1_165, 34_000_000).starts) / 5


def test_a_combined_file_keeps_each_rows_sender_among_all_senders(tmp_path, monkeypatch):
    """With `source_column`, the combined files hold each row's sender (its index among all senders), as reading the
    senders' own files with `source_column` gives it."""
    names = tuple(f"b{i}" for i in range(5))
    for i, name in enumerate(names):
        write_shuffle(tmp_path / f"{name}.shuffle", pa.table({"order": np.arange(6, dtype=np.int64) + 10 * i}),
                      np.arange(6) % 3, 3)
    direct = [read_shuffle(shuffle_files(tmp_path, names), p, 3, source_column="sender") for p in range(3)]
    largest = max(os.path.getsize(tmp_path / f"{name}.shuffle") for name in names)
    monkeypatch.setattr(exchange, "COMBINE_BYTES", 6 * largest + 1)  # two to a group
    monkeypatch.setattr(exchange, "RECEIVER_FILES", 2)  # so batches of two first, then the batches in two ranges
    combined = route(_Tasks(), Exchange("keys", str(tmp_path), names, 3, largest, source_column="sender"))
    assert (combined.per_file, len(combined.starts), combined.prefix) == (2, 2, "combined")
    for p in range(3):
        assert combined.read(p).to_pylist() == direct[p].to_pylist()


def _three_key_files_a_task(work: Path) -> int:
    """A COMBINE_BYTES that holds 3 of the largest key file of the ids' and exact dedup's exchanges whole (3 times over),
    not 4, from the sizes the tasks measured (their records)."""
    sizes = {"read": lambda r: r["keys_bytes"], "seg0": lambda r: r["keys_bytes"]["keys"]}  # a segment's: by kind
    largest = [max(size(read_record(f)) for f in (work / step).glob("*.json")) for step, size in sizes.items()]
    assert 9 * max(largest) + 1 < 12 * min(largest)  # the same three for both exchanges
    return 9 * max(largest) + 1


def test_a_run_whose_keys_are_batched_first_gives_the_same_shards_on_ray(tmp_path, monkeypatch, ray_local, slice_input):
    """A curate run on Ray whose ids' and exact dedup's keys do not fit a combine task by group (a small COMBINE_BYTES,
    two files a receiver): they are merged whole into batches first, then the batches in partition ranges (the
    decisions are the driver's; the tasks follow the layout they are given), and the shards are those of the run
    that reads its keys in one level, on the local executor."""
    from helpers import small_config
    from datapipe import curate
    from datapipe.curation.executors import LocalExecutor, RayExecutor

    def run(out, executor):
        cfg = small_config(out, [slice_input], read={"block_bytes": 4096}, output={"keep_work": True},
                           dedup={"exact": {"enabled": True, "partitions": 4}})
        return [s["sha256"] for s in curate(cfg, executor=executor, progress=False, log=lambda _: None).manifest["shards"]]

    reference = run(tmp_path / "ref", LocalExecutor())
    monkeypatch.setattr(exchange, "COMBINE_BYTES", _three_key_files_a_task(tmp_path / "ref" / "work"))
    monkeypatch.setattr(exchange, "RECEIVER_FILES", 2)
    assert run(tmp_path / "batched", RayExecutor(progress=False)) == reference
    for step in ("ids", "exact_dedup"):
        work = tmp_path / "batched" / "work" / step
        assert len(list((work / "records").glob("combine-keys-batch-*.json"))) == 4  # 10 senders, 3 to a batch
        # the receivers read the batches' groups by range; the blocks' files and the batches' are gone
        assert sorted(f.name for f in (work / "keys").iterdir()) == [f"combined-r{r:03d}-{k:05d}.shuffle"
                                                                     for r in range(2) for k in range(2)]


def test_a_run_killed_between_the_batches_and_their_ranges_resumes_to_the_same_shards(tmp_path, monkeypatch,
                                                                                        slice_input):
    """Killed at the second combine task of the batches' level (the batches written, the blocks' key files gone,
    one range file written): the resume skips the batches by their records and gives the one-level run's shards."""
    from helpers import Interrupted, small_config
    from datapipe import curate
    from datapipe.curation.executors import LocalExecutor

    def run(out):
        cfg = small_config(out, [slice_input], read={"block_bytes": 4096}, output={"keep_work": True},
                           dedup={"exact": {"enabled": True, "partitions": 4}})
        return [s["sha256"] for s in curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None).manifest["shards"]]

    reference = run(tmp_path / "ref")
    monkeypatch.setattr(exchange, "COMBINE_BYTES", _three_key_files_a_task(tmp_path / "ref" / "work"))
    monkeypatch.setattr(exchange, "RECEIVER_FILES", 2)
    combine, ranged = exchange.combine_task, []

    def killed_at_the_second_range(task, r, k, names):
        if task.layout.prefix == "combined" and Path(task.records).parent.name == "ids":  # the ids' keys, second level
            ranged.append((r, k))
            if len(ranged) == 2:
                raise Interrupted("killed")
        return combine(task, r, k, names)

    monkeypatch.setattr(exchange, "combine_task", killed_at_the_second_range)
    with pytest.raises(Interrupted):
        run(tmp_path / "out")
    keys = tmp_path / "out" / "work" / "ids" / "keys"
    assert sorted(f.name for f in keys.iterdir()) == [f"batch-{k:05d}.shuffle" for k in range(4)] + ["combined-r000-00000.shuffle"]
    monkeypatch.setattr(exchange, "combine_task", combine)
    assert run(tmp_path / "out") == reference


class _Recorded(_Tasks):
    """A run_tasks that also keeps where each task's record goes."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[str] = []

    def __call__(self, fn, shared, items, desc, record=None):
        if record is not None:
            self.records += [str(record(shared, *item)) for item in items]
        return super().__call__(fn, shared, items, desc)


def _numbers(shared: int, sender: str, n: int):
    """A map: n rows of this sender, row i to partition i % shared; the sender's own count beside its file's bytes."""
    rows = pa.table({"sender": [sender] * n, "i": np.arange(n, dtype=np.int64)})
    return rows, np.arange(n) % shared, {"rows": n}


def _count(shared: str, p0: int, rows: pa.Table) -> dict:
    """A reduce: what it got, as a result."""
    got = sorted(zip(rows.column("sender").to_pylist(), rows.column("i").to_pylist()))
    return {"p0": p0, "rows": got, "partitions": sorted(set(rows.column("partition").to_pylist())) if "partition" in rows.column_names else None}


@pytest.mark.parametrize("spans", [None, (0, 3)])
def test_a_shuffle_spec_runs_its_maps_and_reduces_names_every_record_and_routes_by_measured_sizes(tmp_path, monkeypatch, spans):
    """One spec owns both ends: the maps' files are named by the spec and their bytes measured; the reduces get every
    row of their partition (or span, with each row's partition), in receiver order; every record is the spec's. With
    a combine task fitting two of the measured files, the same rows arrive through combined files."""
    spec = exchange.Shuffle("numbers", str(tmp_path / "x"), 4, records=str(tmp_path / "records"), receiver_name="r{:02d}",
                            spans=spans)
    items = [(f"s{k}", 5 + k) for k in range(3)]  # few senders: read directly
    run_tasks = _Recorded()
    sent, got = exchange.map_reduce(run_tasks, spec, _numbers, 4, items, _count, "shared")
    assert [s["rows"] for s in sent] == [5 + k for k in range(3)] and all(s["bytes"] > 0 for s in sent)
    assert all((tmp_path / "x" / f"s{k}.shuffle").exists() for k in range(3))
    receivers = spec.receiver_spans()
    assert [g["p0"] for g in got] == [p0 for p0, _ in receivers]
    for (p0, p1), g in zip(receivers, got):
        assert g["rows"] == sorted((f"s{k}", i) for k in range(3) for i in range(5 + k) if p0 <= i % 4 < p1)
        assert g["partitions"] == (None if spans is None else list(range(p0, p1)))
    names = [f"s{k}" for k in range(3)] + [f"r{r:02d}" for r in range(len(receivers))]
    assert run_tasks.records == [str(tmp_path / "records" / f"{n}.json") for n in names]
    # measured sizes route: a combine that holds two of the largest file merges them (and removes the senders' files)
    monkeypatch.setattr(exchange, "COMBINE_BYTES", 6 * max(s["bytes"] for s in sent) + 1)
    monkeypatch.setattr(exchange, "RECEIVER_FILES", 2)
    combined = _Recorded()
    again = exchange.run_reduces(combined, spec, _count, "shared", [n for n, _ in items], sent)
    assert again == got and not (tmp_path / "x" / "s0.shuffle").exists()
    assert any(r.startswith(str(tmp_path / "records" / "combine-x-")) for r in combined.records)
