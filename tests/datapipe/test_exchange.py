"""The one exchange (`datapipe.core.exchange`): the senders' files read directly while that is few files and
requests, else combined; either way every receiver reads the same rows in the same order."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest

from datapipe.core import exchange
from datapipe.core.exchange import Combined, Exchange, SenderFiles, combine_layout, route
from datapipe.core.shuffle import read_shuffle, shuffle_files, write_shuffle


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


@pytest.mark.parametrize("receiver_files, per_file, ranges", [(64, 2, 1), (2, 3, 2)])
def test_combined_senders_give_each_receiver_the_same_rows_in_the_same_order(tmp_path, monkeypatch, receiver_files,
                                                                             per_file, ranges):
    """5 senders to 4 receivers (2 x 5 x 4 requests: past 4 x (5 + 4)): merged as many to a group as fit a combine
    task's bytes (2 here); where that leaves more groups than a receiver may read (RECEIVER_FILES), larger groups
    cut into partition ranges, one task each. Every partition reads the same rows, in the same order, from the
    combined files as from the 5 senders' (so receivers' outputs do not change), and never more than RECEIVER_FILES
    files."""
    rng = np.random.default_rng(0)
    names = tuple(f"b{i}" for i in range(5))
    largest = _write_senders(tmp_path, names, 4, rng)
    monkeypatch.setattr(exchange, "COMBINE_BYTES", 6 * largest + 1)  # two files fit a task whole
    monkeypatch.setattr(exchange, "RECEIVER_FILES", receiver_files)
    run_tasks = _Tasks()
    direct = [read_shuffle(shuffle_files(tmp_path, names), p, 4) for p in range(4)]
    combined = route(run_tasks, Exchange("keys", str(tmp_path), names, 4, largest))
    groups = -(-5 // per_file)
    assert isinstance(combined, Combined)
    assert (combined.per_file, len(combined.starts), combined.groups) == (per_file, ranges, groups)
    assert run_tasks.calls == [groups * ranges] and groups <= receiver_files
    for p in range(4):
        assert combined.read(p).equals(direct[p])
    span = combined.read(1, through=4).to_pylist()  # over both ranges when there are two: the same rows
    assert sorted(span, key=str) == sorted((r for p in (1, 2, 3) for r in direct[p].to_pylist()), key=str)
    # the senders' files, read by no one now, are gone
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
    monkeypatch.setattr(exchange, "RECEIVER_FILES", 2)  # so three to a group, in two ranges
    combined = route(_Tasks(), Exchange("keys", str(tmp_path), names, 3, largest, source_column="sender"))
    assert (combined.per_file, len(combined.starts)) == (3, 2)
    for p in range(3):
        assert combined.read(p).to_pylist() == direct[p].to_pylist()
