"""Work units sized from the data: `read.block_bytes: auto` and `output.shard_bytes: auto`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import ASSETS, small_config
from datapipe.core.config import ConfigError, from_dict
from datapipe.curation.config import CurateConfig, auto_block_bytes, auto_shard_bytes, load_config
from datapipe.curation.executors import LocalExecutor
from datapipe.curation.readers import estimated_text_bytes
from datapipe.curation.plan import remove_work
from datapipe import curate

MiB = 2**20
REPO = Path(__file__).parents[2]


# ---------------------------------------------------------------- the sizing functions (pure)


@pytest.mark.parametrize(
    ("input_bytes", "block_bytes"),
    [
        (10**12, 61_035_157),  # 1 TB: no more than 16,384 blocks (a shuffle reads blocks x partitions ranges)
        (10 * 2**30, 8 * MiB),  # a large input: blocks of the 8 MiB target (1,280 of them)
        (151_000_000, 8 * MiB),  # the shared corpus's text: 18 blocks of 8 MiB
        (64 * MiB, 4 * MiB),  # smaller: 16 blocks, so 8 workers get 2 each
        (1 * MiB, 64 * 2**10),
        (49_627, 16 * 2**10),  # the quickstart slice: the 16 KiB floor, 3 blocks
        (1_000, 16 * 2**10),  # never a block under 16 KiB
        (None, 8 * MiB),  # sizes unknown (a remote store that gives none): the target
    ],
)
def test_auto_block_bytes(input_bytes, block_bytes):
    assert auto_block_bytes(input_bytes) == block_bytes


@pytest.mark.parametrize(
    ("token_bytes", "shard_bytes"),
    [
        (10 * 2**30, 64 * MiB),  # a large output: 64 MiB shards
        (100 * MiB, 25 * MiB),  # smaller: 4 shards
        (40_000, 10_000),
        (3, 1),  # a few bytes: one document per shard
    ],
)
def test_auto_shard_bytes(token_bytes, shard_bytes):
    assert auto_shard_bytes(token_bytes) == shard_bytes


def test_estimated_text_bytes_counts_compressed_files_larger():
    assert estimated_text_bytes({"a.jsonl": {"size": 1000}, "b.jsonl.gz": {"size": 1000}, "c.parquet": {"size": 10}}) == 5040
    assert estimated_text_bytes({"a.jsonl": {"size": 1000}, "s3://b/c.jsonl": {"size": None}}) is None


# ---------------------------------------------------------------- the config


def test_auto_is_the_default_and_numbers_still_work():
    cfg = from_dict(CurateConfig, {"inputs": [{"path": "x.jsonl"}]})
    assert cfg.read.block_bytes == "auto" and cfg.output.shard_bytes == "auto"
    cfg = from_dict(CurateConfig, {"inputs": [{"path": "x.jsonl"}], "read": {"block_bytes": 4096}, "output": {"shard_bytes": 8192}})
    assert cfg.read.block_bytes == 4096 and cfg.output.shard_bytes == 8192


@pytest.mark.parametrize(("section", "key", "value"), [("read", "block_bytes", "big"), ("read", "block_bytes", 0),
                                                        ("output", "shard_bytes", -1)])
def test_a_bad_size_names_its_key(section, key, value):
    with pytest.raises(ConfigError, match=rf"{section}\.{key}.*'auto'"):
        from_dict(CurateConfig, {"inputs": [{"path": "x.jsonl"}], section: {key: value}})


def test_the_quickstart_recipe_sizes_from_the_data():
    cfg = load_config(REPO / "configs" / "quickstart.yaml")
    assert cfg.read.block_bytes == "auto" and cfg.output.shard_bytes == "auto"


# ---------------------------------------------------------------- a run


def test_auto_on_a_tiny_input_gives_several_blocks_and_shards_and_counts_every_second(tmp_path):
    out = tmp_path / "out"
    # The shipped slice (49 KB) with the defaults: auto blocks and shards.
    cfg = small_config(out, [{"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}],
                       read={"block_bytes": "auto", "batch_size": 16}, output={"dir": str(out), "shard_bytes": "auto", "keep_work": True})
    result = curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    blocks = sorted((out / "work" / "read").glob("u*-b*.arrow"))
    assert len(blocks) >= 3  # the tasks after reading run in parallel
    run = json.loads((out / "run.json").read_text())
    assert run["work_layout"]["read.block_bytes"] == 16 * 2**10  # recorded resolved: a resume finds the same blocks
    assert run["config"]["output"]["shard_bytes"] == "auto"  # result-affecting, and decided by the data alone
    assert result.manifest["num_shards"] >= 4  # one can be held out; 2 ranks get 2 each
    # every second of the run is in a phase, from planning and starting the executor to the work/ clean-up
    stats = json.loads((out / "stats.json").read_text())
    phases = stats["phase_seconds"]
    assert {"start", "read", "tokenize", "shards", "write", "clean up"} <= set(phases)
    assert sum(phases.values()) == pytest.approx(stats["seconds"], abs=0.02)


def test_work_is_deleted_by_tasks_one_per_folder(tmp_path):
    """The driver lists work/ once and hands each phase's folder to a task; nothing is left."""
    work = tmp_path / "work"
    for folder, n in (("read", 3), ("minhash", 2)):
        (work / folder / "sub").mkdir(parents=True)
        for i in range(n):
            (work / folder / f"f{i}.arrow").write_bytes(b"x")
            (work / folder / "sub" / f"g{i}.json").write_bytes(b"{}")
    (work / "plan.json").write_text("{}")
    calls = []

    def run_tasks(fn, shared, items, desc, **kwargs):
        calls.append((desc, list(items)))
        return [fn(shared, *item) for item in items]

    remove_work(work, run_tasks)
    assert not work.exists()
    assert calls == [("clean_up", [("minhash",), ("plan.json",), ("read",)])]


def test_clean_up_of_work_is_in_stats(tmp_path):
    out = tmp_path / "out"
    cfg = small_config(out, [{"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}])
    result = curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    assert not (out / "work").exists()
    stats = json.loads((out / "stats.json").read_text())
    assert "clean up" in stats["phase_seconds"] and stats == result.stats
    assert sum(stats["phase_seconds"].values()) == pytest.approx(stats["seconds"], abs=0.02)


# ---------------------------------------------------------------- shuffle partitions and task memory


@pytest.mark.parametrize(
    ("input_bytes", "shuffle", "partitions"),
    [
        (2**40, "minhash", 1280),  # 1 TiB of text: near dedup's partitions each fit 4 GiB
        (2**40, "exact", 256),
        (151_000_000, "minhash", 16),  # the shared corpus: the floor
        (None, "minhash", 16),  # sizes unknown: the floor
    ],
)
def test_auto_partitions_keep_each_task_under_the_budget(input_bytes, shuffle, partitions):
    from datapipe.curation.config import TASK_BYTES_PER_TEXT_BYTE, auto_partitions

    budget = 4 * 2**30
    assert auto_partitions(input_bytes, shuffle, budget) == partitions
    if input_bytes is not None:
        assert input_bytes * TASK_BYTES_PER_TEXT_BYTE[shuffle] / partitions <= budget


def test_auto_partitions_come_from_the_input_and_do_not_change_the_output(tmp_path, slice_input):
    from datapipe.curation.readers import plan_units
    from datapipe.curation.plan import resolve_block_bytes

    dedup = {"exact": {"enabled": True}, "minhash": {"enabled": True}}
    auto = small_config(tmp_path / "auto", [slice_input], dedup=dedup)
    assert auto.dedup.minhash.partitions == "auto" and auto.dedup.exact.partitions == "auto"  # the defaults
    resolved = resolve_block_bytes(auto, plan_units(list(auto.inputs)))
    assert (resolved.dedup.exact.partitions, resolved.dedup.minhash.partitions) == (16, 16)
    # a budget small enough to need more partitions than the floor: the same shards
    tiny = small_config(tmp_path / "tiny", [slice_input], dedup=dedup, ray={"task_memory_gib": 5e-6})
    assert resolve_block_bytes(tiny, plan_units(list(tiny.inputs))).dedup.minhash.partitions > 16
    a = curate(auto, executor=LocalExecutor(), progress=False, log=lambda _: None)
    b = curate(tiny, executor=LocalExecutor(), progress=False, log=lambda _: None)
    assert [s["sha256"] for s in a.manifest["shards"]] == [s["sha256"] for s in b.manifest["shards"]]


def test_ray_is_told_each_tasks_memory_capped_at_the_largest_node():
    from datapipe.curation.executors import RayExecutor

    executor = RayExecutor.__new__(RayExecutor)  # no Ray started: only the sizing is under test
    executor._node_memory = None
    executor.ray = type("FakeRay", (), {"nodes": staticmethod(lambda: [
        {"Alive": True, "Resources": {"memory": 8 * 2**30}}, {"Alive": True, "Resources": {"memory": 16 * 2**30}},
        {"Alive": False, "Resources": {"memory": 64 * 2**30}}])})
    assert executor._memory(None) == {}
    assert executor._memory(2**30) == {"memory": 2**30}
    assert executor._memory(32 * 2**30) == {"memory": 16 * 2**30}  # never more than a live node has: it would never run
