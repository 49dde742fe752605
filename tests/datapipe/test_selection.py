"""Language id, diversity sampling and mixture reweighting through the whole pipeline."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from helpers import ASSETS, run_tasks_in_process, small_config
from datapipe.curation.executors import LocalExecutor
from datapipe import curate
from datapipe.core.shards import open_shard, read_manifest


def _inputs(tmp_path):
    """Real documents of three domains (the multilingual sample adds many languages to `man`)."""
    rows = []
    for name in ("corpus_slice.jsonl", "multilingual_sample.jsonl", "quality_sample.jsonl"):
        rows += [orjson.loads(l) for l in (ASSETS / name).read_bytes().splitlines()]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"id": f"{i}", "text": r["text"], "domain": r["source"]}) + b"\n"
                              for i, r in enumerate(rows)))
    return [{"path": str(path)}]


def _run(out, inputs, **sections):
    cfg = small_config(out, inputs, **{"filters": {}, **sections})
    return curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)


def _shards(out):
    return pa.concat_tables([open_shard(out, s["path"]) for s in read_manifest(out)["shards"]])


def test_langid_tags_shards_and_filters_key_on_language(tmp_path):
    out = tmp_path / "out"
    # drop every German manual page with a filter keyed on (domain, language)
    result = _run(out, _inputs(tmp_path), langid={"enabled": True},
                  filters={"man/de": {"gopher_quality": {"min_doc_words": 10**9, "max_doc_words": None}}})
    shards = _shards(out)
    langs = set(shards.column("lang").to_pylist())
    assert {"en", "fr", "ru", "ja"} <= langs and "de" not in set(
        shards.filter(pa.compute.equal(shards.column("domain"), "man")).column("lang").to_pylist())
    assert result.stats["dropped"]["filters"]["man"]["gopher_quality:word_count"] >= 1


def test_mixture_realises_targets_and_repeats_within_the_cap(tmp_path):
    out = tmp_path / "out"
    weights = {"man": 0.2, "license": 0.3, "code": 0.5}
    result = _run(out, _inputs(tmp_path), mixture={"enabled": True, "method": "explicit", "weights": weights, "max_epochs": 3})
    m = read_manifest(out)["mixture"]
    assert m["method"] == "explicit"
    shards = _shards(out)
    tokens = {d: 0 for d in weights}
    for d, n in zip(shards.column("domain").to_pylist(), shards.column("num_tokens").to_pylist()):
        tokens[d] += n
    total = sum(tokens.values())
    for d, entry in m["domains"].items():
        assert entry["realised_tokens"] == tokens[d]  # the manifest tells the truth about the shards
        assert abs(entry["realised_share"] - tokens[d] / total) < 1e-4
        if not entry["capped"]:
            assert abs(entry["realised_share"] - entry["target_share"]) < 0.1  # hash sampling on ~50 docs
        assert entry["epochs"] <= 3 + 1e-9
    # repeated documents: the same id several times, never more than the cap allows
    ids = shards.column("id").to_pylist()
    assert max(ids.count(i) for i in set(ids)) <= 3
    assert result.stats["mixture"] == m and all(row["balanced"] for row in result.stats["inputs"])


def test_diversity_sampling_keeps_a_fraction_and_records_the_rest(tmp_path):
    out = tmp_path / "out"
    result = _run(out, _inputs(tmp_path), diversity={"enabled": True, "domains": {"man": 0.5}})
    shards = _shards(out)
    kept_man = sum(1 for d in shards.column("domain").to_pylist() if d == "man")
    report = read_manifest(out)["diversity"]["man"]
    assert report["docs_kept"] == kept_man and abs(kept_man - report["docs_in"] / 2) <= report["clusters"]
    dropped = [r for f in (out / "dropped").glob("select-*.parquet") for r in pq.read_table(f).to_pylist()]
    assert len(dropped) == report["docs_in"] - kept_man
    assert {r["reason"] for r in dropped} == {"diversity_sampling"}
    assert all(row["balanced"] for row in result.stats["inputs"])
    # deterministic for a seed
    again = tmp_path / "again"
    _run(again, _inputs(tmp_path), diversity={"enabled": True, "domains": {"man": 0.5}})
    assert [s["sha256"] for s in read_manifest(again)["shards"]] == [s["sha256"] for s in read_manifest(out)["shards"]]


def test_diversity_cut_by_block_equals_the_choice_over_the_whole_domain(tmp_path, monkeypatch):
    """Diversity sampling decides per block from per-cluster totals (rank-bucket histograms, then the
    rows of one boundary bucket per cluster): the kept documents are exactly those of
    `stages.diversity.select` over the whole domain, ties in rank broken by input order."""
    import numpy as np

    from datapipe.core.workfiles import write_work_table as atomic_write_table
    from datapipe.curation import cuts as cut_module
    from datapipe.curation.phases import selection
    from stages import diversity

    monkeypatch.setattr(cut_module, "BUCKET_BITS", 2)  # 4 buckets: big boundary buckets, many rows to resolve
    monkeypatch.setattr(cut_module, "BUCKETS", 4)
    rng = np.random.default_rng(7)
    work = tmp_path / "work"
    budgets = {"a": 0.37, "b": 2500.0}  # a fraction of the documents; a number of tokens
    k = {"a": 5, "b": 3}
    names, whole = [], {d: [] for d in budgets}
    for i in range(6):
        parts = []
        for d in budgets:
            n = int(rng.integers(0, 40))
            rank = rng.integers(0, 2**64, size=n, dtype=np.uint64)
            rank[: n // 3] = np.uint64(3 << 61)  # equal ranks, in every block: input order decides
            part = pa.table({"row": np.arange(n, dtype=np.int64) * 2 + (d == "b"), "domain": [d] * n,
                             "cluster": rng.integers(0, k[d] - 1, size=n).astype(np.int32),  # the last cluster stays empty
                             "rank": rank, "num_tokens": rng.integers(0, 200, size=n)}, schema=cut_module.ASSIGN_SCHEMA)
            parts.append(part)
            whole[d].append(part.append_column("block", pa.array(np.full(n, i))))
        names.append(f"b{i}")
        atomic_write_table(work / "diversity" / f"b{i}.arrow", pa.concat_tables(parts))
    config = diversity.DiversityConfig(enabled=True, domains=budgets)
    centroids = {d: np.zeros((k[d], 2)) for d in budgets}
    cuts, report, _ = selection._diversity_cuts(run_tasks_in_process(), work, names, config, centroids, None)
    for d, budget in budgets.items():
        table = pa.concat_tables(whole[d])
        expected = diversity.select(table.column("cluster").to_numpy(), table.column("rank").to_numpy(),
                                    table.column("num_tokens").to_numpy(), budget)
        got = cuts[d].keep(table.column("cluster").to_numpy().astype(np.int64), table.column("rank").to_numpy(),
                           table.column("block").to_numpy(), table.column("row").to_numpy())
        assert 0 < expected.sum() < len(expected)
        assert got.tolist() == expected.tolist()
        tokens = {"budget_tokens": budget, "tokens_kept": int(table.column("num_tokens").to_numpy()[expected].sum())}
        assert report[d] == {"docs_in": table.num_rows, "docs_kept": int(expected.sum()),
                             "clusters": int(table.column("cluster").to_numpy().max()) + 1, **(tokens if budget > 1 else {})}


def test_a_diversity_token_budget_is_filled_past_a_long_document(tmp_path):
    """One domain, two clusters, a budget of 1,200 tokens: water-filled, 600 per cluster. Cluster 0 ranks 100, 100,
    900, 100 tokens: stopping before the crossing 900 kept 200 tokens; filled, it keeps 100 + 100 + 900 and not the
    last (it starts past the quota). Cluster 1 ranks 300, 300, 300: the first two fill it exactly. Kept: 1,700
    tokens, reported beside the budget; the in-memory twin (`stages.diversity.select`) keeps the same rows."""
    import numpy as np

    from datapipe.core.workfiles import write_work_table
    from datapipe.curation.phases import selection
    from stages import diversity

    tokens = np.array([100, 100, 900, 100, 300, 300, 300])
    cluster = np.array([0, 0, 0, 0, 1, 1, 1])
    rank = np.array([1, 2, 3, 4, 1, 2, 3], np.uint64) << np.uint64(50)
    block = np.array([0, 1, 0, 1, 0, 1, 0])
    for b in (0, 1):  # the documents of a cluster spread over two blocks
        mine = np.flatnonzero(block == b)
        write_work_table(tmp_path / "diversity" / f"b{b}.arrow", pa.table(
            {"row": mine.astype(np.int64), "domain": ["d"] * len(mine), "cluster": cluster[mine].astype(np.int32),
             "rank": rank[mine], "num_tokens": tokens[mine]}, schema=pa.schema(
                [("row", pa.int64()), ("domain", pa.string()), ("cluster", pa.int32()), ("rank", pa.uint64()),
                 ("num_tokens", pa.int64())])))
    config = diversity.DiversityConfig(enabled=True, domains={"d": 1200.0})
    cuts, report, kept_tokens = selection._diversity_cuts(run_tasks_in_process(), tmp_path, ["b0", "b1"], config,
                                                          {"d": np.zeros((2, 2))}, None)
    keep = cuts["d"].keep(cluster, rank, block, np.arange(7))
    assert np.flatnonzero(keep).tolist() == [0, 1, 2, 4, 5]
    assert diversity.select(cluster, rank, tokens, 1200.0).tolist() == keep.tolist()
    assert kept_tokens == {"d": 1700}
    assert report["d"] == {"docs_in": 7, "docs_kept": 5, "clusters": 2, "budget_tokens": 1200.0, "tokens_kept": 1700}


def test_a_filled_token_budget_keeps_the_long_document_that_crosses_it(tmp_path):
    """Ranked 100, 100, 5000, 100 tokens over two blocks, a budget of 1,000 tokens: stopping before the crossing
    document keeps 200 tokens; filling keeps it too (5,200 tokens) and nothing after it."""
    import numpy as np

    from datapipe.core.workfiles import write_work_table
    from datapipe.curation import cuts as cut_module

    work = tmp_path / "work"
    tokens, rank = [100, 100, 5000, 100], np.array([1, 2, 3, 4], np.uint64) << np.uint64(40)
    for block, rows in (("b0", [0, 2]), ("b1", [1, 3])):
        write_work_table(work / "select" / f"{block}.arrow", pa.table(
            {"row": np.array(rows, np.int64), "domain": ["*"] * 2, "cluster": np.zeros(2, np.int32),
             "rank": rank[rows], "num_tokens": np.array(tokens)[rows]}, schema=cut_module.ASSIGN_SCHEMA))
    for fill, kept_rows, kept_tokens in ((False, [0, 1], 200), (True, [0, 1, 2], 5200)):
        budget = {"*": cut_module.Budget(1000.0, by_tokens=True, fill=fill)}
        cuts, report, held = cut_module.cuts(run_tasks_in_process(), work, "select", ["b0", "b1"], budget, None)
        keep = cuts["*"].keep(np.zeros(4, np.int64), rank[[0, 2, 1, 3]], np.array([0, 0, 1, 1]), np.array([0, 2, 1, 3]))
        assert sorted(np.array([0, 2, 1, 3])[keep].tolist()) == kept_rows
        assert held["*"] == kept_tokens and report["*"]["docs_kept"] == len(kept_rows)
