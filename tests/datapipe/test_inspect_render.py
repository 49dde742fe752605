"""How the inspect wing renders what it counted: the curate summary's written table against the manifest,
mixture copies in the funnel (table and picture), the HTML page's cells against the terminal's, the
training picture's data-wait axis, and `datapipe stats` on a run where nothing survived."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from datapipe import cli
from datapipe.core.shards import atomic_write_json
from datapipe.inspect import stats
from datapipe.inspect.report import format_funnel
from datapipe.testing.shards import write_fake_shards


def _funnel(*stages: tuple[str, dict[str, tuple[int, int]]]) -> list[dict]:
    """stats.json's funnel from (stage, {domain: (docs_in, docs_out)}); 1,000 bytes a document."""
    return [{"stage": stage, "domains": {d: {"docs_in": i, "docs_out": o, "bytes_in": 1000 * i, "bytes_out": 1000 * o}
                                         for d, (i, o) in domains.items()}} for stage, domains in stages]


# ---------------------------------------------------------------- the curate summary


def curate_stats() -> tuple[dict, dict]:
    """stats.json and manifest.json of a run whose mixture repeats prose (332 distinct documents
    written as 811 rows) and code, downsamples manual, and holds out an eval split."""
    stats_json = {
        "funnel": _funnel(("read", {"code": (658, 658), "manual": (1497, 1497), "prose": (426, 426)}),
                          ("filters", {"code": (658, 631), "manual": (1497, 1332), "prose": (426, 332)})),
        "dropped": {"filters": {"code": {"c4:lines": 27}, "manual": {"gopher_quality:alpha_words": 165}, "prose": {"c4:lines": 94}},
                    "mixture": {"manual": {"mixture_downsampled": 254}}, "diversity": {"code": {"diversity_sampling": 118}}},
        "quarantined": {"empty_text": 3},
        # tokenized and never dropped afterwards, each document once: training documents and eval documents
        "kept": {"code": {"docs": 513, "tokens": 1_891_816}, "manual": {"docs": 1078, "tokens": 2_217_092},
                 "prose": {"docs": 338, "tokens": 335_559}},
        "eval": {"path": "eval", "domains": {"code": {"docs": 8, "tokens": 46_786}, "prose": {"docs": 6, "tokens": 6_000}}},
    }
    manifest = {"num_shards": 2, "total_docs": 2405, "total_tokens": 4_930_695,
                "domains": {"code": {"docs": 516, "tokens": 1_915_063}, "manual": {"docs": 1078, "tokens": 2_217_092},
                            "prose": {"docs": 811, "tokens": 798_540}}}
    return stats_json, manifest


def _table_row(text: str, label: str) -> list[str]:
    rows = [line.split() for line in text.splitlines() if line.split()[:1] == [label]]
    assert len(rows) == 1, (label, text)
    return rows[0]


def test_curate_summary_written_table_adds_up_to_the_manifest(capsys):
    stats_json, manifest = curate_stats()
    result = SimpleNamespace(stats=stats_json, manifest=manifest, out_dir="/runs/out", seconds=1.0)
    cli._report(result)  # what `datapipe curate` prints after a run
    printed = capsys.readouterr().out
    # one set of numbers: the table's total is the manifest's, and the line under it says the same
    assert _table_row(printed, "total") == ["total", "2,405", "4,930,695", "490", "539,014"]
    assert "2 shards, 2,405 documents, 4,930,695 tokens" in printed
    # per domain: rows written, and how many of them are the mixture's copies (code 516 - (513 - 8) = 11)
    assert _table_row(printed, "prose") == ["prose", "811", "798,540", "479", "468,981"]
    assert _table_row(printed, "code") == ["code", "516", "1,915,063", "11", "70,033"]
    assert _table_row(printed, "manual") == ["manual", "1,078", "2,217,092", "0", "0"]
    assert "1,915 distinct documents + 490 mixture copies" in printed
    assert "held-out eval split (eval/, not in these totals): 14 documents, 52,786 tokens" in printed


def test_curate_summary_without_repeats_has_no_copy_columns():
    stats_json, manifest = curate_stats()
    del stats_json["eval"]
    for d, k in stats_json["kept"].items():
        manifest["domains"][d] = dict(k)
    text = format_funnel(stats_json, manifest)
    assert "mixture copies" not in text
    assert _table_row(text, "total") == ["total", "1,929", "4,444,467"]


# ---------------------------------------------------------------- mixture copies in `datapipe stats`


@pytest.fixture
def repeated_dir(tmp_path) -> Path:
    """A finished run (fake shards) whose mixture wrote prose documents p0 and p1 twice and sampled
    two web documents away: web 8 -> 6 written, prose 4 distinct -> 6 rows."""
    out = tmp_path / "repeated"
    web = [{"id": f"w{i}", "domain": "web", "tokens": list(range(3 + i))} for i in range(6)]
    prose = [{"id": f"p{i}", "domain": "prose", "tokens": list(range(10 + 5 * i))} for i in range(4)]
    write_fake_shards(out, [web + prose[:2], prose[2:] + prose[:2]], vocab_size=64)
    atomic_write_json(out / "stats.json", {
        "funnel": _funnel(("read", {"web": (10, 10), "prose": (5, 5)}), ("filters", {"web": (10, 8), "prose": (5, 4)})),
        "dropped": {"filters": {"web": {"c4:lines": 2}, "prose": {"c4:lines": 1}}, "mixture": {"web": {"mixture_downsampled": 2}}},
        "quarantined": {},
        "kept": {"web": {"docs": 6, "tokens": sum(len(d["tokens"]) for d in web)},
                 "prose": {"docs": 4, "tokens": sum(len(d["tokens"]) for d in prose)}},
        "mixture": {"method": "temperature", "domains": {
            "web": {"natural_tokens": 100, "target_share": 0.2, "realised_tokens": 33, "realised_share": 0.15, "epochs": 0.7703, "capped": False},
            "prose": {"natural_tokens": 70, "target_share": 0.8, "realised_tokens": 187, "realised_share": 0.85, "epochs": 2.4231, "capped": False}}},
        "seconds": 2.0,
    })
    return out


def test_funnel_written_row_separates_drops_from_mixture_copies(repeated_dir):
    figures = stats.collect(repeated_dir)
    written = {r["domain"]: r for r in figures["funnel"] + figures["funnel_total"] if r["stage"] == "written"}
    # docs out = docs in - dropped + mixture copies; the drops match the drop reasons (mixture_downsampled 2)
    assert [(r["docs_in"], r["dropped"], r["mixture_copies"], r["docs_out"]) for r in (written["web"], written["prose"], written["all"])] \
        == [(8, 2, 0, 6), (4, 0, 2, 6), (12, 2, 2, 12)]
    text = stats.render_text(figures)
    assert "mixture copies" in text
    funnel = text.split("\n\n")[1]
    all_written = [line.split() for line in funnel.splitlines() if line.split()[:1] == ["written"]][-1]
    assert all_written[:6] == ["written", "12", "12", "2", "16.7%", "+2"]


def test_funnel_picture_marks_the_copies_and_keeps_labels_inside(repeated_dir, tmp_path):
    figures = stats.collect(repeated_dir)
    domains = list(figures["written"])
    fig = stats._plot_funnel(figures, domains, stats._colors(domains), repeated_dir.name)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        for t in ax.texts:
            if t.get_text():
                box = t.get_window_extent(renderer)
                assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, t.get_text()
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "6 written\n(+2 mixture copies)" in labels  # prose: the jump from 4 distinct to 6 rows is marked
    assert "6" in labels  # web: no copies, its count alone
    paths = stats.plot(figures, repeated_dir, tmp_path / "png")  # the whole set still draws
    assert all(p.stat().st_size > 10_000 for p in paths)


# ---------------------------------------------------------------- the HTML page's cells


def test_html_cells_are_the_terminal_cells_with_the_all_rows(repeated_dir):
    figures = stats.collect(repeated_dir)
    page = stats.render_html(figures, images=[])
    text = stats.render_text(figures)
    cells = [c.replace("&#x27;", "'").replace("&amp;", "&") for c in re.findall(r"<td[^>]*>(.*?)</td>", page)]
    assert cells
    for c in cells:  # one renderer of cells: whatever the page shows, the terminal shows the same way
        assert c in text, c
    assert not re.search(r"<td[^>]*>\d+\.\d{3,}</td>", page)  # no raw floats (a mean of 12.333, epochs 0.7703)
    assert "<td>0.77</td>" not in page and "<td class=num>0.77</td>" in page and "<td class=num>2.42</td>" in page
    written = page.split("Written (counted over the shards)")[1].split("</table>")[0]
    total = figures["summary"]
    assert f"<tr><td>all</td><td class=num>2</td><td class=num>{total['docs']}</td><td class=num>{total['tokens']}</td>" in written


def test_html_shows_code_spans_not_backticks(repeated_dir):
    page = stats.render_html(stats.collect(repeated_dir), images=[])
    assert "`" not in page  # the notes' `written` and `mixture` spans are <code>, as the terminal's backticks mean
    assert "<code>written</code>" in page


# ---------------------------------------------------------------- the eval split in the funnel


def test_the_eval_holdout_is_its_own_funnel_row_and_drop_reason(repeated_dir):
    """web: 8 past the filters, 1 held out for the eval split, 1 sampled away by the mixture, 6 written. The
    `written` row's dropped counts only the mixture's 1 (it had counted the eval document too, which no drop
    reason listed); the eval document leaves at an `eval split` row, with its reason in the drop-reason table."""
    stats_json = json.loads((repeated_dir / "stats.json").read_text())
    stats_json["kept"]["web"]["docs"] += 1  # `kept` counts the eval documents too
    stats_json["dropped"]["mixture"]["web"]["mixture_downsampled"] = 1
    stats_json["eval"] = {"path": "eval", "domains": {"web": {"docs": 1, "tokens": 5}}}
    atomic_write_json(repeated_dir / "stats.json", stats_json)
    figures = stats.collect(repeated_dir)
    rows = {(r["domain"], r["stage"]): r for r in figures["funnel"] + figures["funnel_total"]}
    assert [(rows[("web", s)]["docs_in"], rows[("web", s)]["dropped"], rows[("web", s)]["docs_out"]) for s in ("eval split", "written")] \
        == [(8, 1, 7), (7, 1, 6)]
    assert rows[("prose", "eval split")]["dropped"] == 0 and rows[("all", "eval split")]["dropped"] == 1
    reasons: dict[tuple[str, str], int] = {}
    for d in figures["drops"]:
        reasons[(d["domain"], d["stage"])] = reasons.get((d["domain"], d["stage"]), 0) + d["docs"]
    assert reasons[("web", "eval split")] == 1
    # every stage's dropped count is the sum of its reasons; `written`'s are the selection's (mixture, diversity)
    for (domain, stage), r in rows.items():
        if domain == "all" or not r["dropped"]:
            continue
        listed = (reasons.get((domain, "mixture"), 0) + reasons.get((domain, "diversity"), 0) if stage == "written"
                  else reasons.get((domain, stage), 0))
        assert r["dropped"] == listed, (domain, stage)
    assert "held_out_for_eval" in stats.render_text(figures)
    stats.plot(figures, repeated_dir, repeated_dir / "png")  # the byte-less row does not break the pictures


# ---------------------------------------------------------------- a run where nothing survived


def test_stats_on_a_run_where_nothing_survived_shows_the_funnel(tmp_path, capsys):
    out = tmp_path / "empty-run"
    out.mkdir()
    # what report.nothing_survived writes: stats.json, no manifest, no shards
    atomic_write_json(out / "stats.json", {
        "funnel": _funnel(("read", {"web": (10, 10)}), ("filters", {"web": (10, 0)})),
        "dropped": {"filters": {"web": {"gopher_quality:word_count": 7, "c4:lines": 3}}},
        "quarantined": {"malformed_json": 2}, "kept": {}, "inputs": [], "seconds": 0.4, "nothing_survived": True,
    })
    assert cli.main(["stats", str(out), "--plot", str(tmp_path / "png"), "--html", str(tmp_path / "page.html")]) == 0
    printed = capsys.readouterr().out
    assert "Nothing survived curation" in printed and "the run did not finish" not in printed
    assert "10 documents read (2 quarantined)" in printed
    assert _table_row(printed, "web")[:7] == ["web", "read", "10", "10", "0", "0.0%", "0.01"]
    assert "gopher_quality:word_count" in printed and "quarantine:malformed_json" in printed
    assert "Written (counted over the shards)" not in printed and "Document length" not in printed
    assert "Nothing survived curation" in (tmp_path / "page.html").read_text()
    assert len(list((tmp_path / "png").glob("*.png"))) == 3
    assert cli.main(["stats", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nothing_survived"] is True


# ---------------------------------------------------------------- the experiment picture


def test_experiment_picture_says_which_mark_is_the_seeds_and_which_the_mean_curve(tmp_path):
    from datapipe.inspect.experiment_plot import draw_experiment, plot_experiment

    def arm(crossings: list[float | None], mean_curve: float | None, ratio: float | None) -> dict:
        reached = [c for c in crossings if c is not None]
        mean = sum(reached) / len(reached) if reached else None
        return {"curve": {"tokens": [100, 200, 300], "mean": [3.0, 2.5, 2.2], "std": [0.1, 0.1, 0.1]},
                "tokens_to_target": {"mean": mean, "std": 10.0 if reached else None, "n": len(reached), "of": len(crossings)},
                "mean_curve_tokens_to_target": mean_curve, "ratio_to_baseline": {"of_means": None, "of_mean_curve": ratio}}

    results = {"baseline": "base", "target": 2.3, "seeds": [0, 1], "baseline_mean_curve_tokens_to_target": 280.0,
               "arms": {"base": arm([260.0, 290.0], 280.0, 1.0), "new": arm([150.0, None], 240.0, 240 / 280)}}
    fig = draw_experiment(results)
    right = fig.axes[1]
    legend = [t.get_text() for t in right.get_legend().get_texts()]
    assert "mean ± std over the seeds that reach it (each seed's own crossing)" in legend  # the bars
    assert "where the arm's mean curve (all seeds) reaches it" in legend  # the markers, which the ×ratio is of
    markers = [line for line in right.get_lines() if line.get_marker() == "D"]
    assert len(markers) == 1 and list(markers[0].get_ydata()) == [280.0, 240.0]
    assert "×ratio: the arm's mean curve against the baseline's" in right.get_title()
    (tmp_path / "results.json").write_text(json.dumps(results))
    assert plot_experiment(tmp_path / "results.json").stat().st_size > 10_000


# ---------------------------------------------------------------- the training picture


def test_data_wait_axis_has_a_floor(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    drawn, close = [], plt.close
    monkeypatch.setattr(plt, "close", drawn.append)  # keep the figure that plot_run would close
    from datapipe.inspect.plots import plot_run

    def top_of_data_wait(waits: list[float]) -> float:
        run = tmp_path / f"run{len(drawn)}"
        run.mkdir()
        rows = [{"step": i + 1, "loss": 3.0 - 0.1 * i, "lr": 1e-3, "tokens_per_s": 5000.0, "data_wait_frac": w} for i, w in enumerate(waits)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        plot_run(run)
        ax = next(a for a in drawn[-1].axes if a.get_title() == "fraction of step time waiting for data")
        bottom, top = ax.get_ylim()
        assert bottom == 0
        return top

    assert top_of_data_wait([0.0012, 0.0015, 0.0009]) >= 0.05  # noise stays small on the page
    assert top_of_data_wait([0.1, 0.3, 0.2]) >= 0.3  # a real wait is never cut off
    for fig in drawn:
        close(fig)
