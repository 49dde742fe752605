"""The global-stage contract (`stages.base.GlobalStage`): a stage is `keys` + `decide`, and the runner does the
rest — a third one, defined here and unknown to the runner, runs like exact dedup: its keys reach one `decide` per
partition through the exchange, its losers are dropped by the next segment with its name, reason and kept id, and
its count lands in stats.json."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from helpers import small_config
from datapipe.core.shards import read_manifest
from datapipe.curation.executors import LocalExecutor
from datapipe import curate

DOCS = Path(__file__).resolve().parents[2] / "docs" / "curation.md"


def _docs_stage() -> type:
    """docs/curation.md's example of a global stage, run as written: the page cannot drift from what runs."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    (code,) = [b for b in blocks if "class FirstLineDedup(GlobalStage)" in b]
    module = types.ModuleType("docs_first_line")
    sys.modules[module.__name__] = module  # pickled by reference, as a user's module is
    exec(compile(code, str(DOCS), "exec"), module.__dict__)
    return module.FirstLineDedup


def test_the_documented_stage_is_keys_and_decide_in_few_lines():
    block = next(b for b in re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S) if "class FirstLineDedup" in b)
    assert len(block[block.index("class FirstLineDedup"):].strip().splitlines()) <= 25
    assert "read_shuffle" not in block and "resolve" not in block
    assert {"keys", "decide"} <= set(vars(_docs_stage()))


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
    result = curate(cfg, executor=LocalExecutor(), extra_stages=[_docs_stage()()], progress=False, log=lambda _: None)

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


def test_a_stage_written_to_the_old_resolve_contract_is_told_what_to_write_instead():
    import pytest

    from stages.base import GlobalStage

    with pytest.raises(TypeError, match=r"defines resolve\(run_tasks, folder, \.\.\.\), which a global stage no longer "
                                        r"has: define decide\(keys\)"):
        class Old(GlobalStage):  # noqa: F841 - its definition is what is refused
            name, partitions = "old", 2

            def keys(self, batch):
                return {"keys": batch}

            def resolve(self, run_tasks, folder, out_dir, senders, documents):
                return {}
