"""Near-dedup through the runner: planted near-duplicates of real documents are found with
precision and recall >= 0.99 against brute-force exact Jaccard (clusters: connected components of the
pairs at J >= 0.8), pairs planted just above the threshold (J in [0.80, 0.85]) included; the result is
the same in one process and on Ray with 2 workers, and with the components found in one task or in
distributed rounds; every removal names the document kept."""

from __future__ import annotations

import random

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datapipe.core.workfiles import read_record, read_work_table

from helpers import ASSETS, STALL_S, small_config
from datapipe.curation.phases import near_dedup
from datapipe.curation.executors import LocalExecutor, RayExecutor
from datapipe import curate
from datapipe.core.shards import read_manifest
from datapipe.testing.synthetic import (
    EDITS,
    MUTATIONS,
    cluster_pairs,
    components,
    mutate,
    plant,
    precision_recall,
    true_pairs,
)
from stages.minhash import MinHashConfig


def _corpus(tmp_path):
    """Real documents (long enough to carry 5-grams) plus mutated copies at many similarities."""
    rng = random.Random(42)
    originals = []
    for name in ("corpus_slice.jsonl", "quality_sample.jsonl"):
        for line in (ASSETS / name).read_bytes().splitlines():
            rec = orjson.loads(line)
            if len(rec["text"].split()) >= 150:
                originals.append(rec["text"])
    texts = list(originals)
    for i, text in enumerate(originals):
        for kind in rng.sample(MUTATIONS, 2):
            texts.append(mutate(text, rng.choice([0.005, 0.02, 0.05, 0.1, 0.3]), rng, kind))
    rng.shuffle(texts)
    path = tmp_path / "planted.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"doc{i}", "text": t}) + b"\n" for i, t in enumerate(texts)))
    return path, texts


def _originals(min_words=150):
    texts = []
    for name in ("corpus_slice.jsonl", "quality_sample.jsonl"):
        for line in (ASSETS / name).read_bytes().splitlines():
            rec = orjson.loads(line)
            if len(rec["text"].split()) >= min_words:
                texts.append(rec["text"])
    return texts


def _write(tmp_path, texts):
    path = tmp_path / "planted.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"doc{i}", "text": t}) + b"\n" for i, t in enumerate(texts)))
    return path


def _true_cluster_pairs(texts, words="alnum"):
    """Pairs of documents in one true cluster: connected components of the pairs at J >= 0.8."""
    label = components(len(texts), true_pairs(texts, MinHashConfig(words=words), 0.8))
    return cluster_pairs(dict(enumerate(label)))


def _found_clusters(out):
    rows = pq.read_table(out / "near_duplicates" / "clusters").to_pylist()
    return {int(r["id"][3:]): r["cluster_id"] for r in rows}


def _minhash_run(out, path, executor, **minhash):
    cfg = small_config(
        out,
        [{"path": str(path), "domain": "web"}],
        dedup={"exact": {"enabled": False}, "minhash": {"enabled": True, "partitions": 3, **minhash}},
        filters={},
    )
    return curate(cfg, executor=executor, progress=False, log=lambda _: None)


def test_planted_near_duplicates_precision_and_recall(tmp_path, capsys):
    path, texts = _corpus(tmp_path)
    result = _minhash_run(tmp_path / "out", path, LocalExecutor())
    clusters = pq.read_table(tmp_path / "out" / "near_duplicates" / "clusters").to_pylist()
    truth = _true_cluster_pairs(texts)
    precision, recall = precision_recall(cluster_pairs(_found_clusters(tmp_path / "out")), truth)
    with capsys.disabled():
        print(f"\nplanted near-dups: {len(texts)} docs, {len(truth)} pairs in true clusters (J>=0.8), "
              f"precision {precision:.3f}, recall {recall:.3f}")
    assert len(truth) >= 20  # the planted set really has pairs on both sides of the threshold
    assert precision >= 0.99 and recall >= 0.99
    # every removed document names the document kept, which is in the shards
    kept_ids = {r["id"] for r in clusters if r["kept"]}
    dropped = [r for f in (tmp_path / "out" / "dropped").glob("*.parquet") for r in pq.read_table(f).to_pylist()]
    near = [d for d in dropped if d["reason"] == "near_duplicate"]
    assert len(near) == sum(1 for r in clusters if not r["kept"]) > 0
    assert all(d["kept_id"] in kept_ids and d["stage"] == "minhash" for d in near)
    summary = result.stats["global_stages"]["minhash"]
    assert summary["removed"] == len(near) and summary["clusters"] == len({r["cluster_id"] for r in clusters})


@pytest.mark.parametrize("words", ["alnum", "whitespace"])
def test_pairs_planted_just_above_the_threshold_are_all_found(tmp_path, words):
    # Each original gets a copy edited to an exact Jaccard in [0.80, 0.86] (the band the previous
    # default, 9 x 13 bands verified by the estimate, found about half of), and one in [0.70, 0.76]
    # that must stay apart from it; Jaccard by the word rule under test, both rules.
    rng = random.Random(7)
    config = MinHashConfig(words=words)
    originals = _originals(min_words=200)
    filler = [line for t in originals for line in t.split("\n") if 3 <= len(line.split()) <= 8]
    texts, planted = [], []
    for i, text in enumerate(originals):
        near, j = plant(text, rng.uniform(0.80, 0.84), EDITS[i % 4], rng, config, filler)
        far, k = plant(text, rng.uniform(0.70, 0.75), EDITS[(i + 1) % 4], rng, config, filler)
        if not (0.80 <= j <= 0.86 and 0.70 <= k < 0.8):  # one edit (a line, a token) can move several \w words
            continue
        texts += [text, near, far]
        planted.append((len(texts) - 3, len(texts) - 2))
    assert len(planted) >= 20
    _minhash_run(tmp_path / "out", _write(tmp_path, texts), LocalExecutor(), words=words)
    found = _found_clusters(tmp_path / "out")
    missed = [(a, b) for a, b in planted if a not in found or found.get(a) != found.get(b)]
    # A pair in this band is still missed now and then: 16 x 6 bands miss one at J = 0.80 with
    # probability 0.008, and an estimate more than exact_margin (3.4 standard errors) below the
    # threshold rejects it unchecked. With the default hash (vector) and seed, one pair at J = 0.807
    # has the estimate 0.680 (87 of 128), just below 0.68 (its estimates over 300 seeds: mean 0.803,
    # sd 0.035, one below 0.68). The previous default missed about half of them.
    assert len(missed) <= 1, missed
    precision, recall = precision_recall(cluster_pairs(found), _true_cluster_pairs(texts, words))
    assert precision == 1.0 and recall >= 1 - 1.5 / len(planted)


def test_components_in_one_task_equal_distributed_rounds(tmp_path):
    path, _ = _corpus(tmp_path)
    _minhash_run(tmp_path / "one", path, LocalExecutor())
    result = _minhash_run(tmp_path / "rounds", path, LocalExecutor(), one_task_edges=0)
    assert result.stats["global_stages"]["minhash"]["rounds"] > 2  # it really ran the distributed rounds
    assert read_manifest(tmp_path / "rounds")["shards"] == read_manifest(tmp_path / "one")["shards"]
    a = pq.read_table(tmp_path / "one" / "near_duplicates" / "clusters")
    assert a.equals(pq.read_table(tmp_path / "rounds" / "near_duplicates" / "clusters"))


class _Killed(Exception):
    pass


class KilledAt(LocalExecutor):
    """Runs tasks in one process, but dies before the `after`-th task of step `desc`."""

    def __init__(self, desc: str, after: int) -> None:
        super().__init__()
        self.desc, self.after = desc, after

    def run_tasks(self, fn, shared, items, desc, **kwargs):
        if desc != self.desc:
            return super().run_tasks(fn, shared, items, desc)
        results = []
        for i, item in enumerate(items):
            if i == self.after:
                raise _Killed(desc)
            results.append(fn(shared, *item))
        return results


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory):
    """(the corpus, the run that no kill interrupted), with several resolve tasks per step; shared by the kill cases."""
    tmp = tmp_path_factory.mktemp("unkilled")
    path, _ = _corpus(tmp)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(near_dedup, "GROUP_DOCS", 16)  # several resolve tasks per step (one by default here)
        return path, tmp / "ref", _minhash_run(tmp / "ref", path, LocalExecutor())


@pytest.mark.parametrize("desc, after", [("minhash pairs", 1), ("minhash gather", 1), ("minhash attach", 1), ("minhash decide", 2), ("minhash fetch", 0), ("minhash check", 2), ("minhash components", 0), ("minhash members", 2), ("minhash keep", 1)])
def test_run_killed_in_the_resolve_resumes_to_the_same_result(tmp_path, monkeypatch, unkilled, desc, after):
    monkeypatch.setattr(near_dedup, "GROUP_DOCS", 16)
    path, ref_dir, ref = unkilled
    assert ref.stats["global_stages"]["minhash"]["tasks"] > max(after, 1)
    assert ref.stats["global_stages"]["minhash"]["exact_checked"] > 0  # the exact step really runs
    with pytest.raises(_Killed):
        _minhash_run(tmp_path / "out", path, KilledAt(desc, after))
    result = _minhash_run(tmp_path / "out", path, LocalExecutor())
    assert read_manifest(tmp_path / "out") == read_manifest(ref_dir)
    a = pq.read_table(tmp_path / "out" / "near_duplicates" / "clusters")
    assert a.equals(pq.read_table(ref_dir / "near_duplicates" / "clusters"))
    assert result.stats["global_stages"]["minhash"] == ref.stats["global_stages"]["minhash"]


@pytest.mark.parametrize("group_docs", [40])
def test_the_result_does_not_depend_on_how_partitions_are_grouped_into_tasks(tmp_path, monkeypatch, one_group, group_docs):
    """A few resolve tasks, or one for all: the same clusters, losers and shards (one task for every partition:
    the combine cases below)."""
    path, one_dir, one = one_group
    assert one.stats["global_stages"]["minhash"]["tasks"] == 1
    monkeypatch.setattr(near_dedup, "GROUP_DOCS", group_docs)
    many = _minhash_run(tmp_path / "many", path, LocalExecutor(), partitions=8)
    assert many.stats["global_stages"]["minhash"]["tasks"] > 1
    assert read_manifest(tmp_path / "many") == read_manifest(one_dir)
    a = pq.read_table(tmp_path / "many" / "near_duplicates" / "clusters")
    assert a.equals(pq.read_table(one_dir / "near_duplicates" / "clusters"))
    assert many.stats["global_stages"]["minhash"]["removed"] == one.stats["global_stages"]["minhash"]["removed"]


@pytest.fixture(scope="module")
def one_group(tmp_path_factory):
    """(the corpus, its run's folder at 8 partitions in one group, the run's result): the reference of the
    grouping and combine cases."""
    tmp = tmp_path_factory.mktemp("one-group")
    path, _ = _corpus(tmp)
    result = _minhash_run(tmp / "one", path, LocalExecutor(), partitions=8)
    return path, tmp / "one", result


@pytest.mark.parametrize("desc, after", [(None, 0), ("minhash attach combine", 0), ("minhash fetch", 0), ("minhash members combine", 0)])
def test_group_files_are_combined_for_their_readers_and_a_kill_there_resumes(tmp_path, monkeypatch, one_group, desc, after):
    """Eight groups (one per partition): each step's eight group files are merged by a combine task into one
    (`exchange_groups`), which the next step's receivers read (two requests each, not two per group); the one fetch
    task reads the eight groups' wanted files directly (fewer requests than a combine); the clusters and shards are
    those of one group, and a run killed in a combine or in the fetch resumes to them."""
    path, one, _ = one_group
    monkeypatch.setattr(near_dedup, "GROUP_DOCS", 1)
    if desc is not None:
        with pytest.raises(_Killed):
            _minhash_run(tmp_path / "many", path, KilledAt(desc, after), partitions=8)
    steps: list[tuple[str, int]] = []

    class Steps(LocalExecutor):
        def run_tasks(self, fn, shared, items, desc, **kwargs):
            steps.append((desc, len(items)))
            return super().run_tasks(fn, shared, items, desc, **kwargs)

    many = _minhash_run(tmp_path / "many", path, Steps(), partitions=8)
    assert many.stats["global_stages"]["minhash"]["tasks"] == 8
    combined = dict(steps)
    assert combined["minhash pairs combine"] == combined["minhash attach combine"] == combined["minhash members combine"] == 1
    assert combined["minhash fetch"] == 1 and "minhash wanted combine" not in combined
    assert read_manifest(tmp_path / "many") == read_manifest(one)
    a = pq.read_table(tmp_path / "many" / "near_duplicates" / "clusters")
    assert a.equals(pq.read_table(one / "near_duplicates" / "clusters"))


def test_keep_longest_keeps_the_longest_member(tmp_path):
    base = max((orjson.loads(l)["text"] for l in (ASSETS / "corpus_slice.jsonl").read_bytes().splitlines()), key=len)
    texts = [base, base + " one more sentence at the end.", base[: len(base) - 40]]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"d{i}", "text": t}) + b"\n" for i, t in enumerate(texts)))
    _minhash_run(tmp_path / "out", path, LocalExecutor(), keep="longest")
    rows = pq.read_table(tmp_path / "out" / "near_duplicates" / "clusters").to_pylist()
    assert {r["id"]: r["kept"] for r in rows} == {"d0": False, "d1": True, "d2": False}
    assert {r["cluster_id"] for r in rows} == {"d0"}


def test_same_result_in_one_process_and_on_ray(tmp_path, ray_local):
    path, _ = _corpus(tmp_path)
    _minhash_run(tmp_path / "local", path, LocalExecutor())
    _minhash_run(tmp_path / "ray", path, RayExecutor(progress=False, stall_timeout_s=STALL_S))
    assert read_manifest(tmp_path / "ray") == read_manifest(tmp_path / "local")
    a = pq.read_table(tmp_path / "local" / "near_duplicates" / "clusters")
    b = pq.read_table(tmp_path / "ray" / "near_duplicates" / "clusters")
    assert a.equals(b)


def test_clusters_merged_a_range_of_input_order_at_a_time_equal_one_sort(tmp_path, monkeypatch):
    """The clusters are merged by order from the groups' files one range of input units a task (not sorted whole
    in one step), a part each: three inputs in three ranges give the same table as one range, in input order."""
    from datapipe.curation.phases import near_dedup

    path, _ = _corpus(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in range(3):
        (parts / f"part-{i}.jsonl").write_bytes(b"".join(lines[i::3]))
    ref = _minhash_run(tmp_path / "ref", parts / "*.jsonl", LocalExecutor())
    monkeypatch.setattr(near_dedup, "MERGE_RANGES", 1)
    result = _minhash_run(tmp_path / "out", parts / "*.jsonl", LocalExecutor())
    a = pq.read_table(tmp_path / "ref" / "near_duplicates" / "clusters")
    assert a.num_rows > 10 and a.equals(pq.read_table(tmp_path / "out" / "near_duplicates" / "clusters"))
    assert len(list((tmp_path / "ref" / "near_duplicates" / "clusters").glob("part-*.parquet"))) == 3  # a range each
    docs = [(int(i[3:]) % 3, int(i[3:]) // 3) for i in a.column("id").to_pylist()]
    assert docs == sorted(docs)  # input order: part-K holds documents K, K + 3, ... in order
    assert result.stats["global_stages"]["minhash"] == ref.stats["global_stages"]["minhash"]


def _wanted(orders, senders, at, nbytes):
    return pa.table({"order": orders, "sender": np.asarray(senders, np.int32), "text_at": at, "text_bytes": nbytes,
                     "group": np.zeros(len(orders), np.int32)}, schema=near_dedup.WANTED_SCHEMA)


def test_a_fetch_reads_a_frame_by_its_range_and_a_block_without_locators_whole(tmp_path):
    """A document is read by the range of its frame in its read block; one of a block that holds its text itself
    (no locator) by reading that block, its text made a frame; every frame decompresses to its text."""
    from datapipe.core.schema import DOC_SCHEMA
    from datapipe.core.workfiles import write_work_table
    from datapipe.curation.blocks import READ, block_documents, decompress_frames, write_read_block
    from datapipe.curation.phases.near_dedup import KeySource, read_frames

    texts = ["x y z w v u t s", "one two three four five six seven"]
    table = pa.table({"id": ["d0", "d1"], "domain": ["d", "d"], "text": pa.array(texts, pa.large_string()),
                      "order": pa.array([0, 1], pa.int64()), "lang": pa.nulls(2, pa.string()),
                      "lang_score": pa.nulls(2, pa.float32())}, schema=DOC_SCHEMA)
    write_read_block(tmp_path, "b0", table, "zstd")
    write_work_table(tmp_path / "seg" / "b0.arrow", table)  # a block that holds its text itself
    located = block_documents(tmp_path, READ, "b0", ["order"], locate=True)
    at, nbytes = located.column("text_at").to_numpy()[1:], located.column("text_bytes").to_numpy()[1:]
    source = KeySource(str(tmp_path), str(tmp_path), ("seg/b0",))
    frames, read = read_frames(source, _wanted(np.array([1]), [0], at, nbytes))
    assert decompress_frames(frames, [tmp_path]) == [texts[1]] and read.pop("read_seconds") >= 0
    assert read == {"bytes_read": int(nbytes[0]), "text_bytes": len(texts[1]), "documents_read": 1, "ranges_read": 1}
    frames, read = read_frames(source, _wanted(np.array([1]), [0], np.array([-1]), np.array([-1])))
    assert decompress_frames(frames, [tmp_path]) == [texts[1]]
    assert read["bytes_read"] == sum(map(len, texts)) and read["ranges_read"] == 1  # the block's texts, read whole


def test_a_fetch_reads_a_blocks_spread_frames_in_one_range_for_every_group(tmp_path):
    """Documents of one block wanted by several groups: each is read once, and frames far apart for one task's
    few wants (RANGE_WASTE) are one range for a fetch (FETCH_GAP), which reads for every group at once."""
    from datapipe.curation.blocks import frame_ranges
    from datapipe.curation.phases.near_dedup import KeySource, fetch_task, Fetches, FRAME_SCHEMA
    from datapipe.core.exchange import SenderFiles
    from datapipe.core.shuffle import read_shuffle, write_shuffle
    from datapipe.testing.read_blocks import write_read_blocks

    rng = np.random.default_rng(2)
    texts = [[" ".join(f"w{x}" for x in rng.integers(0, 10**6, 200)) for _ in range(12)]]
    at, nbytes = write_read_blocks(tmp_path / "work", texts)
    orders = np.array([0, 6, 11, 6, 0])  # every sixth document, two wanted by two groups
    groups = np.array([0, 0, 1, 1, 2], np.int32)
    assert len(frame_ranges(at[orders[:3]], nbytes[orders[:3]])[1]) == 3  # one range each by a task's rule
    wanted = _wanted(orders, np.zeros(5), at[orders], nbytes[orders]).set_column(4, "group", pa.array(groups))
    write_shuffle(tmp_path / "wanted" / "g000.shuffle", wanted, np.zeros(5, np.int64), 1)
    source = KeySource(str(tmp_path), str(tmp_path / "work"), ("read/b0",), groups=near_dedup.Groups(3, 3))
    step = near_dedup.FetchStep(str(tmp_path), near_dedup.MinHashConfig(), source, str(tmp_path),
                                SenderFiles(str(tmp_path / "wanted"), ("g000",), 1), Fetches(1, 1))
    result = fetch_task(step, 0)
    assert (result["ranges_read"], result["documents_read"], result["rows"]) == (1, 3, 5)
    assert result["bytes_read"] == at[11] + nbytes[11] - at[0]
    for g in range(3):  # each group gets the frames it wanted
        got = read_shuffle([tmp_path / "frames" / "f00000.shuffle"], g, 3, FRAME_SCHEMA)
        assert sorted(got.column("order").to_pylist()) == sorted(orders[groups == g].tolist())


def test_a_damaged_text_frame_stops_the_exact_check_naming_the_read_block(tmp_path):
    """A range read is checked by its frame's own checksum: a changed byte is a DamagedWorkFile naming the block."""
    from datapipe.core.schema import DOC_SCHEMA
    from datapipe.core.workfiles import DamagedWorkFile
    from datapipe.curation.blocks import READ, block_documents, read_texts, write_read_block

    texts = ["alpha beta gamma delta", "epsilon zeta eta theta iota"]
    table = pa.table({"id": ["a", "b"], "domain": ["d", "d"], "text": pa.array(texts, pa.large_string()),
                      "order": pa.array([0, 1], pa.int64()), "lang": pa.nulls(2, pa.string()),
                      "lang_score": pa.nulls(2, pa.float32())}, schema=DOC_SCHEMA)
    write_read_block(tmp_path, "b0", table, "zstd")
    located = block_documents(tmp_path, READ, "b0", ["order"], locate=True)
    at, nbytes = located.column("text_at").to_numpy(), located.column("text_bytes").to_numpy()
    assert read_texts(tmp_path, "b0", at[::-1], nbytes[::-1]) == texts[::-1]
    assert block_documents(tmp_path, READ, "b0").equals(table)
    path = tmp_path / READ / "b0.arrow"
    data = bytearray(path.read_bytes())
    data[int(at[1]) + int(nbytes[1]) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(DamagedWorkFile, match="b0.arrow"):
        read_texts(tmp_path, "b0", at[1:], nbytes[1:])
    with pytest.raises(DamagedWorkFile, match="b0.arrow"):  # a whole read checks the object's digest
        block_documents(tmp_path, READ, "b0")


def test_neighbouring_frames_are_read_in_one_request(tmp_path, monkeypatch):
    """Frames within FRAME_GAP of each other in a read block are one range read, unless the range would hold more
    than RANGE_WASTE x their bytes; a wider gap and no waste bound (a fetch's) merge frames far apart."""
    from datapipe.core.schema import DOC_SCHEMA
    from datapipe.curation import blocks
    from datapipe.curation.blocks import READ, FRAME_GAP, block_documents, frame_ranges, read_texts, write_read_block

    rng = np.random.default_rng(0)
    words = [" ".join(f"w{x}" for x in rng.integers(0, 10**6, n)) for n in (40, 50, 60)]
    texts = [words[0], words[1], "x" * 0 + " ".join(f"z{x}" for x in rng.integers(0, 10**9, 9000)), words[2]]
    n = len(texts)  # the third's frame (~60 KB of random words) stands between the first two and the last
    table = pa.table({"id": [f"d{i}" for i in range(n)], "domain": ["d"] * n, "text": pa.array(texts, pa.large_string()),
                      "order": pa.array(range(n), pa.int64()), "lang": pa.nulls(n, pa.string()),
                      "lang_score": pa.nulls(n, pa.float32())}, schema=DOC_SCHEMA)
    write_read_block(tmp_path, "b0", table, "zstd")
    located = block_documents(tmp_path, READ, "b0", ["order"], locate=True)
    at, nbytes = located.column("text_at").to_numpy(), located.column("text_bytes").to_numpy()
    assert nbytes[2] > FRAME_GAP
    want = np.array([3, 1, 0])  # out of order: the texts come back in the order asked
    requests = []
    real = blocks.read_work_ranges
    monkeypatch.setattr(blocks, "read_work_ranges", lambda path, starts, ends: (requests.append(len(starts)), real(path, starts, ends))[1])
    assert read_texts(tmp_path, "b0", at[want], nbytes[want]) == [texts[3], texts[1], texts[0]]
    assert requests == [2]  # frames 0 and 1 together, frame 3 alone (past the big frame)
    group, starts, ends = frame_ranges(at[want], nbytes[want])
    assert group[1] == group[2] != group[0]
    assert (starts.tolist(), ends.tolist()) == ([at[0], at[3]], [at[1] + nbytes[1], at[3] + nbytes[3]])
    assert len(frame_ranges(at[want], nbytes[want], 2 * int(nbytes[2]), np.inf)[1]) == 1  # across the big frame
    # two small frames 9.5 KB apart: within FRAME_GAP, but one range would hold 20x their bytes; 100 bytes apart, one
    assert len(frame_ranges(np.array([0, 10_000]), np.array([500, 500]))[1]) == 2
    assert frame_ranges(np.array([0, 600]), np.array([500, 500]))[2].tolist() == [1100]


def test_a_fetch_reads_the_frames_of_all_its_blocks_in_one_batched_read(tmp_path, monkeypatch):
    """A fetch task asks for every block's ranges at once (one `read_work_ranges` call over all the blocks:
    concurrent on an object store), not block after block, a batch per EXACT_READ_BYTES of ranges; the frames and
    counts are each block's own."""
    from datapipe.curation import blocks
    from datapipe.curation.blocks import decompress_frames
    from datapipe.curation.phases.near_dedup import KeySource, read_frames
    from datapipe.testing.read_blocks import write_read_blocks

    rng = np.random.default_rng(1)
    texts = [[" ".join(f"w{x}" for x in rng.integers(0, 10**6, 30)) for _ in range(3)] for _ in range(4)]
    at, nbytes = write_read_blocks(tmp_path / "work", texts)
    calls = []
    real = blocks.read_work_ranges
    monkeypatch.setattr(blocks, "read_work_ranges", lambda paths, starts, ends: (calls.append(list(paths)), real(paths, starts, ends))[1])
    orders = np.array([0, 2, 4, 9, 11, 7])  # two of block 0, one of 1, three of 2 and 3, out of order
    senders = orders // 3
    source = KeySource(str(tmp_path), str(tmp_path / "work"), tuple(f"read/b{b}" for b in range(4)))
    frames, read = read_frames(source, _wanted(orders, senders, at[orders], nbytes[orders]))
    assert len(calls) == 1 and sorted({p.name for p in calls[0]}) == ["b0.arrow", "b1.arrow", "b2.arrow", "b3.arrow"]
    flat = [t for block in texts for t in block]
    assert decompress_frames(frames, [tmp_path] * len(frames)) == [flat[o] for o in orders.tolist()]
    assert read["ranges_read"] == len(calls[0]) == 4  # a block's frames are neighbours: one range each
    spans = [at[orders[senders == b]] for b in range(4)]
    ends = [(at + nbytes)[orders[senders == b]] for b in range(4)]
    assert read["bytes_read"] == sum(int(e.max() - a.min()) for a, e in zip(spans, ends))
    assert read["documents_read"] == len(orders) and read["text_bytes"] == sum(len(flat[o]) for o in orders.tolist())
    # at most EXACT_READ_BYTES of ranges a read: here two blocks' worth, so two reads of two blocks each
    monkeypatch.setattr(near_dedup, "EXACT_READ_BYTES", sum(int(e.max() - a.min()) for a, e in zip(spans[:2], ends[:2])))
    calls.clear()
    again, reread = read_frames(source, _wanted(orders, senders, at[orders], nbytes[orders]))
    assert [sorted({p.name for p in c}) for c in calls] == [["b0.arrow", "b1.arrow"], ["b2.arrow", "b3.arrow"]]
    assert again == frames
    assert {k: v for k, v in reread.items() if k != "read_seconds"} == {k: v for k, v in read.items() if k != "read_seconds"}


def test_a_block_gone_from_a_batched_read_is_named(tmp_path):
    """One read over several blocks' ranges: a missing block is a DamagedWorkFile naming that block."""
    from datapipe.core.workfiles import DamagedWorkFile
    from datapipe.curation.blocks import READ, read_blocks_texts
    from datapipe.testing.read_blocks import write_read_blocks

    texts = [["alpha beta gamma", "delta epsilon"], ["zeta eta theta"], ["iota kappa", "lambda mu nu"]]
    at, nbytes = write_read_blocks(tmp_path, texts)
    frames = [("b0", at[[1, 0]], nbytes[[1, 0]]), ("b1", at[2:3], nbytes[2:3]), ("b2", at[4:5], nbytes[4:5])]
    assert read_blocks_texts(tmp_path, frames) == [["delta epsilon", "alpha beta gamma"], ["zeta eta theta"], ["lambda mu nu"]]
    (tmp_path / READ / "b1.arrow").unlink()
    with pytest.raises(DamagedWorkFile, match=r"b1\.arrow is damaged: it is missing"):
        read_blocks_texts(tmp_path, frames)


def test_the_exact_check_fetches_by_block_and_records_its_reads(tmp_path):
    """The near pairs' documents are read by fetch tasks, a block's once for every group that wants them: each fetch
    task's record holds its wall (`seconds`) beside its reads' wall and requests; the summary sums the requests, and
    holds no wall (it is what every run of the same input repeats); the exact check's folders are gone after it."""
    path, _ = _corpus(tmp_path)
    cfg = small_config(tmp_path / "out", [{"path": str(path), "domain": "web"}], filters={}, output={"keep_work": True},
                       dedup={"exact": {"enabled": False}, "minhash": {"enabled": True, "partitions": 3}})
    result = curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    work = tmp_path / "out" / "work" / "minhash"
    records = [read_record(p) for p in sorted(work.rglob("fetch-*.json"))]
    assert records and all(r["seconds"] >= r["read_seconds"] >= 0 for r in records)
    summary = result.stats["global_stages"]["minhash"]
    assert summary["exact_ranges_read"] == sum(r["ranges_read"] for r in records) > 0
    assert summary["exact_documents_read"] == sum(r["documents_read"] for r in records) > 0
    wanted = sum(read_record(p)["wanted"] for p in work.rglob("decide-*.json"))
    assert summary["exact_documents_read"] <= wanted  # a document wanted by several groups, read once
    assert summary["exact_ranges_read"] <= summary["exact_documents_read"]
    assert not any("seconds" in key for key in summary)
    assert not any((work / name).exists() for name in ("pairs-v", "wanted", "decided", "frames"))


def test_without_verification_every_candidate_pair_joins_a_cluster(tmp_path):
    """`verify: false`: the buckets' star edges are the clusters' input (no signatures stored, no exact
    check); every verified cluster is inside an unverified one, and the eval split's near check runs too."""
    path, _ = _corpus(tmp_path)
    verified = _minhash_run(tmp_path / "verified", path, LocalExecutor())
    cfg = small_config(tmp_path / "unverified", [{"path": str(path), "domain": "web"}], filters={},
                       dedup={"exact": {"enabled": False}, "minhash": {"enabled": True, "partitions": 3, "verify": False}},
                       eval={"enabled": True, "fraction": 0.2}, output={"keep_work": True})
    unverified = curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    assert unverified.stats["global_stages"]["minhash"]["exact_checked"] == 0
    assert unverified.stats["global_stages"]["minhash"]["removed"] >= verified.stats["global_stages"]["minhash"]["removed"]
    loose = _found_clusters(tmp_path / "unverified")
    for a, b in cluster_pairs(_found_clusters(tmp_path / "verified")):
        assert a in loose and loose[a] == loose.get(b)
    nodes = pa.concat_tables([read_work_table(f) for f in sorted((tmp_path / "unverified" / "work" / "minhash"
                                                                            / "nodes-by-group").glob("*.arrow"))])
    assert "signature" not in nodes.column_names


def test_each_kind_of_key_is_laid_out_by_its_own_bytes_and_a_recorded_grouping_keeps_its_layout():
    """A block's buckets (a row per band) and its nodes (the signature) are exchanged each by its own size (here the
    estimate from the stage's own rows, as the cost model lays them out); a grouping recorded before the buckets had
    their own (no `bucket_bytes`) lays them out as that run did, by the nodes'."""
    from datapipe.curation.phases.near_dedup import Groups, KeySource, key_bytes, resolve_groups

    config = near_dedup.MinHashConfig()
    proposed = resolve_groups(1_165, 10**9)
    groups = Groups(proposed.partitions, proposed.count, key_bytes=key_bytes(config, 10**9, 16_384),
                    bucket_bytes=key_bytes(config, 10**9, 16_384, "buckets"))
    assert 0 < groups.bucket_bytes != groups.key_bytes > 0  # each measured from its own rows
    source = KeySource("keys", "work", ("read/b0",), groups=Groups(**groups.record()))
    assert source.key_exchange("buckets").largest_bytes == groups.bucket_bytes
    assert source.key_exchange("nodes").largest_bytes == groups.key_bytes
    before = {k: v for k, v in groups.record().items() if k != "bucket_bytes"}
    assert KeySource("keys", "work", ("read/b0",), groups=Groups(**before)).key_exchange("buckets").largest_bytes == groups.key_bytes
