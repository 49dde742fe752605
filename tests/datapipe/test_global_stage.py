"""The global-stage contract (`stages.base.GlobalStage`): the runner drives any global stage through
one code path — a third one, defined here and unknown to the runner, runs like exact and near dedup:
its keys are shuffled by partition, its resolve half runs its own tasks, its losers are dropped by the
next segment with its name, reason and kept id, and its summary lands in stats.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from helpers import small_config
from datapipe.core.shards import read_manifest
from datapipe.core.workfiles import write_work_table
from datapipe.curation.executors import LocalExecutor
from datapipe import curate
from datapipe.core.shuffle import read_shuffle
from stages.base import LOSER_SCHEMA, GlobalStage, RunTasks

PARTITIONS = 2


class FirstLineDedup(GlobalStage):
    """Keeps the first document (by input order) of each distinct first line."""

    name = "first_line"
    partitions = PARTITIONS

    def keys(self, batch: pa.RecordBatch) -> dict[str, pa.Table]:
        lines = [t.split("\n", 1)[0] for t in batch.column("text").to_pylist()]
        partition = [xxhash.xxh64_intdigest(line.encode()) % PARTITIONS for line in lines]
        return {"keys": pa.table({"line": lines, "partition": pa.array(partition, pa.uint32()),
                                  "order": batch.column("order"), "id": batch.column("id")})}

    def resolve(self, run_tasks: RunTasks, folder: Path, out_dir: Path, senders: list[str], documents: int) -> dict[str, Any]:
        # one key file per block that sent keys, named by the block: no listing
        files = [str(folder / "keys" / f"{s.rsplit('/', 1)[-1]}.shuffle") for s in senders]
        removed = run_tasks(_first_line_task, (str(folder), files), [(p,) for p in range(PARTITIONS)], self.name)
        return {"removed": sum(removed)}


def _first_line_task(shared: tuple[str, list[str]], p: int) -> int:
    folder, files = shared
    keys = read_shuffle(files, p, PARTITIONS)
    rows = sorted(keys.to_pylist(), key=lambda r: r["order"]) if keys is not None else []
    first: dict[str, str] = {}
    losers = []
    for r in rows:
        if r["line"] in first:
            losers.append({"order": r["order"], "reason": "same_first_line", "kept_id": first[r["line"]]})
        else:
            first[r["line"]] = r["id"]
    write_work_table(Path(folder) / f"losers-t{p:03d}.arrow", pa.Table.from_pylist(losers, schema=LOSER_SCHEMA))
    return len(losers)


def test_a_third_global_stage_runs_through_the_generic_path(tmp_path):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    texts = []
    for i in range(30):
        head = f"header {i % 4}"  # 4 distinct first lines: 26 of 30 documents lose
        body = " ".join(words[(i + j) % len(words)] + str(i * 31 + j) for j in range(60))
        texts.append(f"{head}\n{body}")
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"d{i}", "text": t}) + b"\n" for i, t in enumerate(texts)))
    cfg = small_config(tmp_path / "out", [{"path": str(path), "domain": "web"}], filters={},
                       dedup={"exact": {"enabled": True, "partitions": 3}, "minhash": {"enabled": True, "partitions": 3}})
    result = curate(cfg, executor=LocalExecutor(), extra_stages=[FirstLineDedup()], progress=False, log=lambda _: None)

    dropped = [r for f in sorted((tmp_path / "out" / "dropped").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    mine = {r["id"]: r for r in dropped if r["stage"] == "first_line"}
    assert set(mine) == {f"d{i}" for i in range(4, 30)}
    assert all(r["reason"] == "same_first_line" and r["kept_id"] == f"d{int(i[1:]) % 4}" for i, r in mine.items())
    assert result.stats["global_stages"]["first_line"] == {"removed": 26}
    assert result.stats["global_stages"]["exact_dedup"] == {"removed": 0}
    assert result.stats["global_stages"]["minhash"]["removed"] == 0  # nothing near-duplicate is left
    assert [f["stage"] for f in result.stats["funnel"]][-2:] == ["first_line", "minhash"]
    assert all(row["balanced"] for row in result.stats["inputs"])
    assert read_manifest(tmp_path / "out")["total_docs"] == 4
