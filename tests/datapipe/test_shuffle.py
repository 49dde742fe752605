"""Shuffle files (`datapipe.core.shuffle`): one file per sender, each receiver reads its range of every file;
local and on a real S3 API server; and a curate run's objects grow with its tasks, not tasks x partitions."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from datapipe.core.workfiles import DamagedWorkFile

from helpers import small_config
from datapipe.core.shuffle import read_shuffle, shuffle_files, write_shuffle
from datapipe.curation.executors import LocalExecutor
from datapipe import curate


def _senders(folder, partitions: int, sizes=(0, 1, 37, 500)) -> dict[str, pa.Table]:
    """One file per sender, rows of every partition (an empty sender too); the tables written."""
    rng = np.random.default_rng(0)
    written = {}
    for s, n in enumerate(sizes):
        table = pa.table({"key": rng.integers(0, 2**62, n), "name": [f"s{s}-r{i}" for i in range(n)]})
        partition = rng.integers(0, partitions, n)
        write_shuffle(folder / f"s{s}.shuffle", table, partition, partitions)
        written[f"s{s}"] = table.append_column("partition", pa.array(partition))
    return written


@pytest.mark.parametrize("partitions", [1, 7, 20_000])  # 20,000: a header too large to read whole
def test_each_partition_gets_exactly_its_rows_in_sender_then_row_order(tmp_path, partitions):
    written = _senders(tmp_path, partitions)
    files = shuffle_files(tmp_path, list(written))
    seen = 0
    for p in sorted({int(x) for t in written.values() for x in t.column("partition").to_pylist()} | {0}):
        got = read_shuffle(files, p, partitions, source_column="sender")
        expected = [(i, n) for i, t in enumerate(written.values())
                    for n, q in zip(t.column("name").to_pylist(), t.column("partition").to_pylist()) if q == p]
        assert list(zip(got.column("sender").to_pylist(), got.column("name").to_pylist())) == expected
        seen += got.num_rows
    assert seen == sum(t.num_rows for t in written.values())


def test_a_file_is_deterministic_and_read_checks_its_partition_count(tmp_path):
    table = pa.table({"x": np.arange(10)})
    write_shuffle(tmp_path / "a.shuffle", table, np.arange(10) % 3, 3)
    write_shuffle(tmp_path / "b.shuffle", table, np.arange(10) % 3, 3)
    assert (tmp_path / "a.shuffle").read_bytes() == (tmp_path / "b.shuffle").read_bytes()  # resume: the same file
    with pytest.raises(DamagedWorkFile, match="says 3 partitions, not the run's 4"):
        read_shuffle([tmp_path / "a.shuffle"], 0, 4)
    (tmp_path / "c.shuffle").write_bytes(b"not a shuffle file at all, but long enough to hold a header" * 10)
    with pytest.raises(DamagedWorkFile, match="c.shuffle is damaged: no b'DPSHUF02' header"):
        read_shuffle([tmp_path / "c.shuffle"], 0, 3)
    with pytest.raises(ValueError, match=r"partition numbers must be in \[0, 3\)"):
        write_shuffle(tmp_path / "d.shuffle", table, np.arange(10), 3)
    assert read_shuffle([], 0, 3) is None and read_shuffle([], 0, 3, pa.schema([("x", pa.int64())])).num_rows == 0


def test_remote_files_are_read_by_ranges_on_a_real_s3_server(s3_server, tmp_path):
    from datapipe.core.storage import location, spread

    endpoint, bucket = s3_server
    folder = location(f"s3://{bucket}/shuffle-test")
    local = _senders(tmp_path, 5)
    remote = _senders(folder, 5)
    for p in range(5):
        a = read_shuffle(shuffle_files(tmp_path, list(local)), p, 5)
        b = read_shuffle(shuffle_files(folder, list(remote)), p, 5)
        assert a.equals(b)
    # one object per sender, written in one request, below a hashed prefix (`storage.spread`): no temporary key is left
    keys = sorted(f.path.split("shuffle-test/", 1)[1] for f in folder.walk_files())
    assert keys == sorted(f"{spread(folder / f's{s}.shuffle').parent.name}/s{s}.shuffle" for s in range(4))
    assert len({k.split("/")[0] for k in keys}) > 1  # spread over prefixes


def test_a_reader_of_every_partition_reads_each_file_whole_in_one_request(s3_server, monkeypatch):
    """A combine task reads every partition of its senders' files: one request a file (no header read first), the
    same rows as partition after partition; a reader of one partition reads a header and a range of each file."""
    import s3fs

    from datapipe.core.storage import location
    from datapipe.testing.latency_proxy import LatencyProxy

    folder = location(f"s3://{s3_server[1]}/shuffle-whole")
    written = _senders(folder, 5)
    with LatencyProxy(s3_server[0], 0.0) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        s3fs.S3FileSystem.clear_instance_cache()
        files = shuffle_files(str(folder), list(written))  # opened anew, at the proxy
        whole = read_shuffle(files, 0, 5, through=5, source_column="sender", partition_column="p")
        requests_whole = proxy.ranges
        proxy.reset()
        one = read_shuffle(files, 2, 5)
        requests_one = proxy.ranges
    s3fs.S3FileSystem.clear_instance_cache()
    assert requests_whole == len(files)
    with_rows = sum(1 for t in written.values() if 2 in t.column("partition").to_pylist())
    assert requests_one == len(files) + with_rows
    by_partition = [read_shuffle(files, p, 5, source_column="sender", partition_column="p") for p in range(5)]
    expected = pa.concat_tables(by_partition)
    # partition after partition, each file's rows in its order: the rows of one read, in the same order
    assert whole.sort_by([("p", "ascending")]).equals(expected.sort_by([("p", "ascending")]))
    assert one.equals(expected.filter(pa.compute.equal(expected.column("p"), 2)).drop(["sender", "p"]))


def _objects(work: Path) -> dict[str, int]:
    return {top: sum(len(files) for _, _, files in os.walk(work / top)) for top in sorted(os.listdir(work))}


def test_objects_grow_with_the_tasks_not_with_tasks_times_partitions(tmp_path, slice_input):
    """The same run at 3 and at 24 partitions: the map side's key files do not change at all (one per
    block and kind), the resolve writes a few objects per partition task, and the shards are the same."""
    runs = {}
    for partitions in (3, 24):
        cfg = small_config(tmp_path / f"p{partitions}", [slice_input], output={"keep_work": True}, read={"block_bytes": 2048},
                           dedup={"exact": {"enabled": True, "partitions": partitions},
                                  "minhash": {"enabled": True, "partitions": partitions}})
        runs[partitions] = curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    few, many = (_objects(tmp_path / f"p{p}" / "work") for p in (3, 24))
    blocks = len(list((tmp_path / "p3" / "work" / "read").glob("*.arrow")))
    assert blocks > 10
    # map side: one key file per block and kind, whatever the partition count (it was blocks x partitions). Where
    # each of 3 or 24 receivers would read every block's file (2 x blocks x partitions requests, past 4 x (blocks +
    # partitions)), a combine task reads them; the receivers read the combined file (small keys: one), and the block
    # files, which no one reads after, are deleted: the keys are not kept twice
    for folder in ("exact_dedup/keys", "ids/keys"):
        for p in (3, 24):
            names = sorted(f.name for f in (tmp_path / f"p{p}" / "work" / folder).iterdir())
            assert names == ["combined-00000.shuffle"], folder
        kind = folder.rsplit("/", 1)[1]
        assert len(list((tmp_path / "p3" / "work" / folder).parent.glob(f"records/combine-{kind}-*.json"))) == 1, folder
    # near dedup's one group reads each block's buckets once: fewer requests than a combine, so none ran
    for p in (3, 24):
        assert len(list((tmp_path / f"p{p}" / "work" / "minhash" / "buckets").iterdir())) == blocks
    assert not list((tmp_path / "p3" / "work" / "minhash" / "records").glob("combine-*.json"))
    # the resolve's tasks follow the documents, not the partitions (`near_dedup.resolve_groups`): this
    # small corpus is one group either way, its nodes gathered once into one file (the block files removed)
    assert [len(list((tmp_path / f"p{p}" / "work" / "minhash" / "nodes-by-group").iterdir())) for p in (3, 24)] == [1, 1]
    assert not (tmp_path / "p3" / "work" / "minhash" / "nodes").exists()
    assert many["minhash"] == few["minhash"]
    assert [s["sha256"] for s in runs[3].manifest["shards"]] == [s["sha256"] for s in runs[24].manifest["shards"]]


@pytest.mark.parametrize("partitions", [7, 20_000])
def test_a_range_of_partitions_is_read_in_one_piece_of_each_file(tmp_path, partitions):
    written = _senders(tmp_path, partitions)
    p0, p1 = 2, 6
    got = read_shuffle(shuffle_files(tmp_path, list(written)), p0, partitions, through=p1, source_column="sender",
                       partition_column="p")
    expected = [(i, q, n) for i, t in enumerate(written.values()) for q in range(p0, p1)
                for n, r in zip(t.column("name").to_pylist(), t.column("partition").to_pylist()) if r == q]
    assert list(zip(got.column("sender").to_pylist(), got.column("p").to_pylist(), got.column("name").to_pylist())) == expected


@pytest.mark.parametrize("how", ["emptied", "cut"])
def test_an_emptied_or_cut_file_on_s3_is_named_not_a_range_error(s3_server, how):
    """S3 answers a range that starts past an object's end with 416 (s3fs: OSError EINVAL): an emptied file read whole
    or by its header, or a file cut inside its header, is the DamagedWorkFile naming it, as on a disk."""
    from datapipe.core.storage import location, spread
    from datapipe.core.workfiles import read_work_ranges

    folder = location(f"s3://{s3_server[1]}/damaged-{how}")
    table = pa.table({"key": np.arange(50, dtype=np.int64)})
    write_shuffle(folder / "s.shuffle", table, np.arange(50) % 3, 3)
    path = spread(shuffle_files(str(folder), ["s"])[0])
    data = path.fs.cat_file(path.path)
    path.fs.pipe_file(path.path, b"" if how == "emptied" else data[:20])
    for p, through in ((0, 3), (1, 2)):  # read whole (one request); a header, then a range
        with pytest.raises(DamagedWorkFile, match=r"s\.shuffle is damaged"):
            read_shuffle([path], p, 3, through=through)
    with pytest.raises(DamagedWorkFile, match="shorter than its task wrote"):
        read_work_ranges([path], [40], [60])  # the exact check's reads of a block's frames


def _damaged(data: bytes, how: str, at: int) -> bytes:
    if how == "cut":
        return data[: len(data) // 2]
    if how == "emptied":  # what an unsynced rename can leave after a power loss
        return b""
    flipped = bytearray(data)
    flipped[at] ^= 0x01
    return bytes(flipped)


@pytest.mark.parametrize("partitions", [3, 9000])  # a header read whole, a header read in pieces
@pytest.mark.parametrize("how", ["cut", "emptied", "bit"])
def test_a_damaged_file_is_named_never_read_wrong(tmp_path, how, partitions):
    table = pa.table({"order": np.arange(200, dtype=np.int64), "key": [f"k{i}" for i in range(200)]})
    path = tmp_path / "s.shuffle"
    write_shuffle(path, table, np.arange(200) % partitions, partitions)
    data = path.read_bytes()
    readers = range(partitions) if partitions < 100 else [0, 1, 2, 199, 5000]  # 199: the last partition with rows
    intact = {p: read_shuffle([path], p, partitions) for p in readers}
    # a flipped bit in the last partition's rows, one in the header's offsets (offsets[1], read for partition 0)
    for at in [len(data) - 5, 40] if how == "bit" else [0]:
        path.write_bytes(_damaged(data, how, at))
        errors = 0
        for p in readers:
            try:
                got = read_shuffle([path], p, partitions)
            except DamagedWorkFile as exc:
                assert str(path) in str(exc)
                errors += 1
                continue
            assert got.equals(intact[p])  # a partition a reader gets is intact
        assert errors >= 1
        with pytest.raises(DamagedWorkFile, match="s.shuffle is damaged"):  # read whole (one request): any damage
            read_shuffle([path], 0, partitions, through=partitions)
    path.unlink()
    with pytest.raises(DamagedWorkFile, match="missing"):
        read_shuffle([path], 0, partitions)
