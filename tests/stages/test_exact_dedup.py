import pyarrow as pa

from datapipe.core.schema import DOC_SCHEMA
from stages.exact_dedup import ExactDedupConfig, ExactDedupStage


def batch(rows):
    return pa.RecordBatch.from_pylist(
        [{"id": i, "domain": "d", "text": t, "order": o} for i, t, o in rows], schema=DOC_SCHEMA
    )


def test_first_in_input_order_wins_whatever_the_partitioning():
    rows = [("a", "same", 7), ("b", "other", 1), ("c", "same", 3), ("d", "same", 11), ("e", "other", 0), ("f", "solo", 2)]
    results = []
    for partitions in (1, 2, 5):
        stage = ExactDedupStage(ExactDedupConfig(partitions=partitions))
        keys = stage.keys(batch(rows))
        assert set(keys.column("partition").to_pylist()) <= set(range(partitions))
        # decide each partition on its own, as the runner's exchange does
        losers = []
        for p in range(partitions):
            part = keys.filter(pa.compute.equal(keys.column("partition"), p))
            losers += stage.decide(part.drop(["partition"])).to_pylist()
        results.append(sorted((r["order"], r["kept_id"]) for r in losers))
    assert results[0] == [(1, "e"), (7, "c"), (11, "c")]
    assert results[0] == results[1] == results[2]


def test_no_duplicates_no_losers():
    stage = ExactDedupStage(ExactDedupConfig())
    assert stage.decide(stage.keys(batch([("a", "x", 0), ("b", "y", 1)])).drop(["partition"])).num_rows == 0
    assert stage.decide(stage.keys(batch([])).drop(["partition"])).num_rows == 0  # a partition with no keys


def test_hash_sees_every_character():
    stage = ExactDedupStage(ExactDedupConfig(partitions=1))
    keys = stage.keys(batch([("a", "x ", 0), ("b", "x", 1), ("c", "X", 2), ("d", "x", 3)]))
    assert len(set(keys.column("hash").to_pylist())) == 3
