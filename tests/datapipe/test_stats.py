"""`datapipe stats`: tables, JSON figures equal to a direct count over the shards, pictures, the
HTML page, `--why`, and a hand-made output folder with a mixture entry and languages, then a `model_selection` entry."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from helpers import ASSETS, small_config
from datapipe.inspect import stats
from datapipe.cli import main
from datapipe.curation.executors import LocalExecutor
from datapipe import curate
from datapipe.testing.shards import write_fake_shards
from datapipe.core.shards import atomic_write_json, read_manifest, read_table, write_manifest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One real run, curated once: the corpus slice (exact and near duplicates, filter drops) and a
    small extra file with a malformed line and a record with empty text (quarantined)."""
    root = tmp_path_factory.mktemp("stats")
    extra = root / "extra.jsonl"
    extra.write_text(
        json.dumps({"id": "extra/ok", "source": "code", "text": "def f(x):\n    return x + 1\n\nprint(f(2))\n"}) + "\n"
        + "{this is not json\n"
        + json.dumps({"id": "extra/empty", "source": "code", "text": "   "}) + "\n"
    )
    inputs = [{"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}, {"path": str(extra), "domain_field": "source"}]
    cfg = small_config(root / "out", inputs,
                       dedup={"minhash": {"enabled": True, "threshold": 0.8, "ngram": 5, "num_perm": 128, "partitions": 4}},
                       filters={"license": {"gopher_quality": {"min_alpha_words_ratio": 0.65}}})
    curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    return root / "out"


@pytest.fixture(scope="module")
def figures(run_dir) -> dict:
    return stats.collect(run_dir)


def shard_tables(out: Path) -> list[pa.Table]:
    return [read_table(out / s["path"]) for s in read_manifest(out)["shards"]]


def direct_counts(out: Path) -> dict[str, dict[str, int]]:
    """Docs and tokens per domain, counted with pyarrow over every shard file."""
    counts: dict[str, dict[str, int]] = {}
    for t in shard_tables(out):
        for row in t.group_by("domain").aggregate([("num_tokens", "sum"), ("num_tokens", "count")]).to_pylist():
            c = counts.setdefault(row["domain"], {"docs": 0, "tokens": 0})
            c["docs"] += row["num_tokens_count"]
            c["tokens"] += row["num_tokens_sum"]
    return counts


def test_json_figures_equal_a_direct_count_over_the_shards(run_dir, capsys):
    assert main(["stats", str(run_dir), "--json"]) == 0
    fig = json.loads(capsys.readouterr().out)  # one JSON object, nothing else on stdout
    counts = direct_counts(run_dir)
    assert len(read_manifest(run_dir)["shards"]) > 1  # several shards are aggregated
    assert {d: {"docs": w["docs"], "tokens": w["tokens"]} for d, w in fig["written"].items() if w["docs"]} == counts
    assert fig["summary"]["docs"] == sum(c["docs"] for c in counts.values())
    assert fig["summary"]["tokens"] == sum(c["tokens"] for c in counts.values())
    assert fig["manifest_agrees"] is True and fig["complete"] is True
    assert sum(w["token_share"] for w in fig["written"].values()) == pytest.approx(1.0, abs=1e-4)
    # the funnel ends, per domain, in a `written` row with the tokens; earlier stages know no tokens
    for domain, c in counts.items():
        rows = [r for r in fig["funnel"] if r["domain"] == domain]
        assert rows[0]["stage"] == "read" and rows[-1]["stage"] == "written"
        assert rows[-1]["docs_out"] == c["docs"] and rows[-1]["tokens_out"] == c["tokens"]
        assert all(r["tokens_out"] is None for r in rows[:-1])
        assert all(r["docs_out"] == nxt["docs_in"] for r, nxt in zip(rows, rows[1:]))
    total_written = [r for r in fig["funnel_total"] if r["stage"] == "written"][0]
    assert total_written["tokens_out"] == fig["summary"]["tokens"]
    # drop reasons and quarantine equal stats.json's, and the documents balance
    run_stats = json.loads((run_dir / "stats.json").read_text())
    assert {(d["stage"], d["domain"], d["reason"]): d["docs"] for d in fig["drops"]} == {
        (s, dom, r): n for s, by_d in run_stats["dropped"].items() for dom, by_r in by_d.items() for r, n in by_r.items()}
    assert fig["quarantined"] == {"malformed_json": 1, "empty_text": 1}
    assert fig["summary"]["read"] == fig["summary"]["docs"] + sum(d["docs"] for d in fig["drops"])
    assert fig["mixture"] is None  # this run has no mixture stage
    assert all(r["lang"] is not None for r in fig["lengths_by_lang"])  # null languages are left out


def test_length_percentiles_equal_numpy_over_the_shards(run_dir, figures):
    table = pa.concat_tables([t.select(["domain", "num_tokens"]) for t in shard_tables(run_dir)])
    assert [r["domain"] for r in figures["lengths"]] == sorted(set(table.column("domain").to_pylist()))
    for r in figures["lengths"]:
        n = table.filter(pc.equal(table.column("domain"), r["domain"])).column("num_tokens").to_numpy()
        assert r["docs"] == len(n) and r["max"] == n.max()
        assert r["mean"] == pytest.approx(n.mean(), abs=1e-3)
        for p in stats.PERCENTILES:
            assert r[f"p{p}"] == pytest.approx(np.percentile(n, p))
    hist = figures["length_histogram"]
    for domain, counts in hist["counts"].items():
        assert len(counts) == len(hist["edges"]) - 1
        assert sum(counts) == figures["written"][domain]["docs"]


def test_text_tables(figures, run_dir, capsys):
    text = stats.render_text(figures)
    for needle in ("Stage funnel per domain", "MB in", "tokens exist only for what was written", "exact_dedup", "minhash",
                   "written", "exact_duplicate", "near_duplicate", "quarantine:malformed_json", "Mixture: none recorded",
                   "p5", "p95", "token share", "near-duplicates:"):
        assert needle in text, needle
    for domain, w in figures["written"].items():
        assert domain in text and f"{w['tokens']:,}" in text
    assert main(["stats", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == text.strip()


def test_plots_are_real_pngs(figures, run_dir, tmp_path):
    paths = stats.plot(figures, run_dir, tmp_path / "plots")
    assert [p.name for p in paths] == ["funnel.png", "token_share.png", "lengths.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000, p  # a drawn picture, not an empty canvas


def test_cli_plot_and_html(run_dir, tmp_path, capsys):
    page = tmp_path / "report" / "stats.html"
    assert main(["stats", str(run_dir), "--plot", str(tmp_path / "png"), "--html", str(page)]) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed and str(page) in printed
    assert sorted(p.name for p in (tmp_path / "png").glob("*.png")) == ["funnel.png", "lengths.png", "token_share.png"]
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("data:image/png;base64,") == 3
    assert "<table>" in html and "exact_duplicate" in html and "src=\"http" not in html  # self-contained
    # --html alone draws the pictures itself
    alone = tmp_path / "alone.html"
    assert main(["stats", str(run_dir), "--html", str(alone)]) == 0
    assert alone.read_text().count("data:image/png;base64,") == 3


def test_why_duplicates_name_the_copy_kept(run_dir, capsys):
    import polars as pl

    dropped = pl.read_parquet(run_dir / "dropped" / "*.parquet")
    exact = dropped.filter(pl.col("reason") == "exact_duplicate").row(0, named=True)
    info = stats.why(run_dir, exact["id"])
    assert info["status"] == "dropped" and info["stage"] == exact["stage"] and info["kept_id"] == exact["kept_id"]
    assert main(["stats", str(run_dir), "--why", exact["id"]]) == 0
    out = capsys.readouterr().out
    assert f"a copy of {exact['kept_id']}" in out and "exact_dedup" in out

    near = dropped.filter(pl.col("reason") == "near_duplicate").row(0, named=True)
    info = stats.why(run_dir, near["id"])
    clusters = pl.scan_parquet(run_dir / "near_duplicates" / "clusters").collect()
    cid = clusters.filter(pl.col("id") == near["id"])["cluster_id"].item()
    assert info["cluster"]["cluster_id"] == cid and info["cluster"]["kept"] == near["kept_id"]
    assert info["cluster"]["size"] == clusters.filter(pl.col("cluster_id") == cid).height
    assert main(["stats", str(run_dir), "--why", near["id"]]) == 0
    out = capsys.readouterr().out
    assert f"a copy of {near['kept_id']}" in out and "near_duplicate" in out and f"cluster {cid}" in out

    filtered = dropped.filter(pl.col("stage") == "filters").row(0, named=True)
    assert main(["stats", str(run_dir), "--why", filtered["id"], "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["stage"], info["reason"], info["kept_id"]) == ("filters", filtered["reason"], None)


def test_why_reads_the_clusters_of_a_folder_written_before_the_parts(run_dir, tmp_path):
    """An output folder of a run before the clusters were written in parts (one near_duplicates/clusters.parquet):
    a near copy's cluster is found there as in the parts (not taken as no cluster)."""
    import shutil

    import polars as pl
    import pyarrow.parquet as pq

    dropped = pl.read_parquet(run_dir / "dropped" / "*.parquet")
    near = dropped.filter(pl.col("reason") == "near_duplicate").row(0, named=True)
    older = tmp_path / "older"
    shutil.copytree(run_dir, older)
    pq.write_table(pq.read_table(older / "near_duplicates" / "clusters"), older / "near_duplicates" / "clusters.parquet")
    shutil.rmtree(older / "near_duplicates" / "clusters")
    assert stats.why(older, near["id"])["cluster"] == stats.why(run_dir, near["id"])["cluster"] is not None


def test_why_kept_quarantined_and_unknown(run_dir, capsys):
    shard = read_manifest(run_dir)["shards"][-1]
    kept_id = read_table(run_dir / shard["path"]).column("id")[0].as_py()
    assert stats.why(run_dir, kept_id)["shard"] == shard["path"]
    assert main(["stats", str(run_dir), "--why", kept_id]) == 0
    assert f"kept, in {shard['path']}" in capsys.readouterr().out

    extra = str(run_dir.parent / "extra.jsonl")
    bad = stats.why(run_dir, f"{extra}:2")  # the derived id of the malformed line
    assert (bad["status"], bad["reason"], bad["line"]) == ("quarantined", "malformed_json", 2)
    empty = stats.why(run_dir, "extra/empty")  # its raw record names its id
    assert (empty["status"], empty["reason"]) == ("quarantined", "empty_text")

    assert main(["stats", str(run_dir), "--why", "no/such/document"]) == 1
    assert "unknown id" in capsys.readouterr().out


def test_not_an_output_folder_exits_2(tmp_path, capsys):
    assert main(["stats", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["stats", str(tmp_path)]) == 2
    assert "holds no stats.json" in capsys.readouterr().err


# ---------------------------------------------------------------- a hand-made folder: mixture and languages


@pytest.fixture
def mixed_dir(tmp_path) -> Path:
    """Two shards with a `lang` column, a manifest and a stats.json holding a `mixture` entry."""
    out = tmp_path / "mixed"
    rng = np.random.default_rng(0)
    specs = []
    for domain, langs, n in [("web", ["en", "de", "en", None], 40), ("code", [None], 12)]:
        lengths = rng.integers(2, 3000, n)
        specs.append([{"id": f"{domain}/{i}", "domain": domain, "tokens": list(range(k)), "lang": langs[i % len(langs)]}
                      for i, k in enumerate(lengths)])
    manifest = write_fake_shards(out, specs, vocab_size=4096, dtype="uint16")
    web, code = manifest["domains"]["web"]["tokens"], manifest["domains"]["code"]["tokens"]
    mixture = {"method": "temperature", "domains": {
        "web": {"natural_tokens": web * 3, "target_share": 0.7, "realised_tokens": web, "realised_share": web / (web + code), "epochs": 0.33, "capped": False},
        "code": {"natural_tokens": code, "target_share": 0.3, "realised_tokens": code, "realised_share": code / (web + code), "epochs": 1.0, "capped": True},
    }}
    manifest["mixture"] = mixture
    write_manifest(out, manifest)
    funnel = [{"stage": "read", "domains": {
        "web": {"docs_in": 50, "docs_out": 45, "bytes_in": 900_000, "bytes_out": 850_000},
        "code": {"docs_in": 12, "docs_out": 12, "bytes_in": 80_000, "bytes_out": 80_000}}},
        {"stage": "filters", "domains": {
            "web": {"docs_in": 45, "docs_out": 40, "bytes_in": 850_000, "bytes_out": 800_000},
            "code": {"docs_in": 12, "docs_out": 12, "bytes_in": 80_000, "bytes_out": 80_000}}}]
    atomic_write_json(out / "stats.json", {"funnel": funnel, "dropped": {"read": {"web": {"empty_text": 5}}, "filters": {"web": {"c4:lines": 5}}},
                                           "quarantined": {}, "kept": {}, "mixture": mixture, "seconds": 1.5})
    return out


def test_mixture_and_languages_from_a_hand_made_folder(mixed_dir, tmp_path):
    fig = stats.collect(mixed_dir)
    assert fig["mixture"]["method"] == "temperature" and fig["mixture"]["domains"]["code"]["capped"] is True
    text = stats.render_text(fig)
    assert "Mixture (method temperature" in text and "70.0%" in text and "30.0%" in text
    # per (domain, lang), null languages left out, equal to numpy
    langs = {(r["domain"], r["lang"]) for r in fig["lengths_by_lang"]}
    assert langs == {("web", "en"), ("web", "de")}
    web = pa.concat_tables([read_table(mixed_dir / s["path"]) for s in read_manifest(mixed_dir)["shards"]])
    en = [n for n, d, l in zip(web["num_tokens"].to_pylist(), web["domain"].to_pylist(), web["lang"].to_pylist()) if (d, l) == ("web", "en")]
    row = next(r for r in fig["lengths_by_lang"] if r["lang"] == "en")
    assert row["docs"] == len(en) and row["p50"] == pytest.approx(np.percentile(en, 50))
    assert "lang" in text and " en " in text and " de " not in text  # de's 10 documents: too few for a row of its own
    assert "1 language row of fewer than 20 documents not shown (10 documents; `--json` has them)" in text
    paths = stats.plot(fig, mixed_dir, tmp_path / "png")
    assert all(p.stat().st_size > 10_000 for p in paths)
    assert "target" in stats.render_html(fig, paths)


def test_a_folder_without_manifest_counts_the_shards_on_disk(mixed_dir):
    (mixed_dir / "manifest.json").unlink()
    fig = stats.collect(mixed_dir)
    assert fig["complete"] is False and fig["summary"]["shards"] == 2
    assert fig["mixture"]["source"] == "stats.json"  # stats.json carries the mixture too
    assert "the run did not finish" in stats.render_text(fig)


# ---------------------------------------------------------------- a hand-made folder: selection by a model

EDGES = [round(-1.8 + 0.2 * i, 1) for i in range(19)]  # inner edges -1.8 .. 1.8; the outer bins are open tails
SELECTION = {"method": "dsir", "stage": "dsir", "flops": 1.39e7, "cpu_seconds": 1.79,
             "groups": {"*": {"clusters": 1, "docs_in": 52, "docs_kept": 15}},
             "histogram": {"edges": EDGES, "domains": {
                 # web: 40 scored, 10 kept in bins 12..19 (scores >= EDGES[11] = 0.4, up to the open top tail)
                 "web": {"all": [1, 2, 2, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 1, 1, 1, 0, 1],
                         "kept": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 1, 1, 1, 0, 1]},
                 # code: 12 scored, 5 kept in bins 5..8 (scores in [EDGES[4], EDGES[8]) = [-1.0, -0.2))
                 "code": {"all": [0, 0, 0, 1, 1, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
                          "kept": [0, 0, 0, 0, 0, 1, 2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]}}}}


def _selection_rows(text: str) -> dict[str, list[str]]:
    """The rows of the text report's per-domain selection table, by domain."""
    part = next(p for p in text.split("\n\n") if p.startswith("Selection by a model (method"))
    return {line.split()[0]: line.split() for line in part.splitlines()[4:] if line.split()}


def test_selection_by_a_model_tables_picture_page_and_json(mixed_dir, tmp_path, capsys):
    # absent: no section, no picture
    fig = stats.collect(mixed_dir)
    assert fig["model_selection"] is None and "Selection by a model" not in stats.render_text(fig)
    assert [p.name for p in stats.plot(fig, mixed_dir, tmp_path / "without")] == list(stats.PLOTS)

    doc = json.loads((mixed_dir / "stats.json").read_text())
    atomic_write_json(mixed_dir / "stats.json", {**doc, "model_selection": SELECTION})
    fig = stats.collect(mixed_dir)
    text = stats.render_text(fig)
    assert "method dsir" in text and "1.39e+07 FLOPs" in text and "1.79 CPU seconds" in text
    rows = _selection_rows(text)
    assert rows["web"][1:4] == ["40", "10", "25.0%"] and rows["web"][4:] == [">=", "0.4"]
    assert rows["code"][1:4] == ["12", "5", "41.7%"] and rows["code"][4:] == ["-1", "..", "-0.2"]
    assert rows["all"][1:3] == ["52", "15"]
    assert "per budget group" in text and re.search(r"^\*\s+52\s+15\s+1$", text, re.MULTILINE)

    png, page = tmp_path / "png", tmp_path / "stats.html"
    assert main(["stats", str(mixed_dir), "--plot", str(png), "--html", str(page)]) == 0
    capsys.readouterr()
    picture = png / "selection_scores.png"
    assert picture.read_bytes()[:8] == PNG_MAGIC and picture.stat().st_size > 10_000
    html = page.read_text()
    assert 'alt="selection_scores"' in html and html.count("data:image/png;base64,") == len(stats.PLOTS) + 1
    assert "Selection by a model (method dsir" in html and "&gt;= 0.4" in html

    assert main(["stats", str(mixed_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_selection"] == SELECTION  # unchanged


def test_the_drop_reason_table_goes_by_stage_in_pipeline_order_and_folds_the_small_reasons():
    from datapipe.inspect.stats import _drop_rows

    drops = [{"stage": "filters", "domain": "man", "reason": f"gopher_quality:r{i}", "docs": i, "share_of_read": 0.001 * i}
             for i in range(1, 8)]
    drops += [{"stage": "filters", "domain": "man", "reason": "gopher_repetition:top", "docs": 500, "share_of_read": 0.5},
              {"stage": "filters", "domain": "code", "reason": "code:one", "docs": 1, "share_of_read": 0.01},
              {"stage": "exact_dedup", "domain": "man", "reason": "exact_duplicate", "docs": 40, "share_of_read": 0.04}]
    rows = _drop_rows(drops, ["read", "exact_dedup", "filters", "minhash"])
    assert [r[:4] for r in rows] == [["exact_dedup", "man", "exact_duplicate", 40], ["filters", "code", "code:one", 1],
                                     ["filters", "man", "gopher_repetition:top", 500],
                                     ["filters", "man", "7 other reasons", 28]]  # 1 + ... + 7 documents, each under 2%
    assert rows[-1][4] == "2.8%"


def test_the_funnel_has_a_row_for_each_selection_step_and_written_drops_only_the_mixture_s(tmp_path):
    from helpers import ASSETS, small_config
    from datapipe import curate
    from datapipe.curation.executors import LocalExecutor

    out = tmp_path / "out"
    cfg = small_config(out, [{"path": str(ASSETS / "corpus_slice.jsonl"), "domain_field": "source"}],
                       diversity={"enabled": True, "domains": {"man": 0.5}, "clusters": 2}, mixture={"enabled": True},
                       selection={"method": "random", "keep_fraction": 0.8})
    curate(cfg, executor=LocalExecutor(), progress=False, log=lambda _: None)
    fig = stats.collect(out)
    dropped = json.loads((out / "stats.json").read_text())["dropped"]
    order = list(dict.fromkeys(r["stage"] for r in fig["funnel"]))
    assert order[-3:] == ["random_selection", "diversity", "written"]
    for stage in ("random_selection", "diversity"):
        rows = {r["domain"]: r for r in fig["funnel"] if r["stage"] == stage}
        assert {d: r["dropped"] for d, r in rows.items() if r["dropped"]} == {d: sum(v.values()) for d, v in dropped[stage].items()}
    written = {r["domain"]: r for r in fig["funnel"] if r["stage"] == "written"}
    diversity = {r["domain"]: r for r in fig["funnel"] if r["stage"] == "diversity"}
    assert all(written[d]["docs_in"] == diversity[d]["docs_out"] for d in written)  # the steps chain
    assert all(p.stat().st_size > 10_000 for p in stats.plot(fig, out, tmp_path / "png"))  # their rows count no bytes
