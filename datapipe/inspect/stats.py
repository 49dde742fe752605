"""`datapipe stats OUTPUT_DIR`: what a finished run did, as tables, pictures, a page or JSON.

One function gathers every figure, and the renderers only format them:

- `collect(out_dir) -> dict` reads `stats.json` (the stage funnel and the drop reasons, which the
  runner already summed over every task), `manifest.json` (its per-shard counts) and the shards
  themselves. The shards are scanned lazily with polars, selecting only `domain`, `num_tokens` and
  `lang` (when present), so the token lists are never read. One pass gives the written docs and
  tokens, the length percentiles per domain (and per (domain, lang) when the shards carry
  languages) and a log-binned length histogram. The cost grows with the number of documents, not
  with their tokens, and no Python code loops over rows, so a folder of thousands of shards stays
  fast. The per-shard counts in the manifest are cross-checked against the scan (`manifest_agrees`).
  A held-out split that the manifest names (`splits.eval`, the folder OUT/eval/) is counted the same
  way over its own shards (`splits`: docs and tokens per domain), beside the training copies removed for it.
- `render_text(figures)`: the terminal tables. `plot(figures, out_dir, folder)`: funnel.png,
  token_share.png and lengths.png, and selection_scores.png for a run that selected by a model
  (`model_selection`: its cost, documents scored and kept, score histograms) (matplotlib, Agg canvas, no pyplot state). `render_html(figures,
  images)`: one self-contained page, with the PNGs as base64 data URIs. Both draw the same sections
  (`_sections`), whose cells `tables.cell` writes, so the page and the terminal show the same figures.
  A run where nothing survived (`nothing_survived` in stats.json, no manifest) shows its funnel and drop reasons.
- `why(out_dir, doc_id)`: where one document went. It searches `dropped/*.parquet` (stage, reason,
  the id kept instead of a duplicate, and the near-duplicate cluster), then the shards (which
  shard), then `quarantine/*.jsonl` (by the id derived from file and line or row, or by the raw
  record naming the id).

The folder may be local or a URL (`s3://bucket/run`, read through `datapipe.core.storage`): polars scans
local files lazily; remote shards are read whole through the storage module and their token column dropped.

Stages before tokenization know text bytes, not tokens, so the funnel counts documents and MB in
and out per stage. Tokens exist only for what was written, and the tables say so. The documents held
out for the eval split leave the training data at a funnel row of their own (`eval split`) and are
listed as their own drop reason (`held_out_for_eval`), so every `dropped` count of the funnel has its
reasons in the drop-reason table; selection by a model and diversity sampling have a row each (their drops), and the
`written` row's `dropped` counts what the mixture's down-sampling removed.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from datapipe.core.config import ConfigError
from datapipe.core.shards import CLUSTERS_DIR, MANIFEST_NAME, SHARD_DIR, read_manifest, read_table
from datapipe.core.storage import RemotePath, reachable
from datapipe.inspect.report import distinct_written
from datapipe.inspect.tables import cell, table

PERCENTILES = (5, 25, 50, 75, 95)
BINS_PER_DECADE = 8  # length histogram: fixed log-spaced bins, so one pass needs no min/max first
TOTAL = "all"  # the pseudo-domain of the totals rows
WRITTEN = "written"  # the pseudo-stage of the funnel's last row: tokenized and written to shards
EVAL_SPLIT = "eval split"  # the pseudo-stage before it where the eval split's documents leave the training data
HELD_OUT = "held_out_for_eval"  # their reason in the drop-reason table
PLOTS = ("funnel.png", "token_share.png", "lengths.png")
SELECTION_PLOT = "selection_scores.png"  # drawn only when the run selected by a model


class NotAnOutputFolder(ConfigError):
    """The folder holds no finished (or at least summarised) datapipe run."""


# ---------------------------------------------------------------- collect


def collect(out_dir: str | Path) -> dict[str, Any]:
    """Every figure the tables, pictures, page and JSON show, as one JSON-able dict."""
    out = reachable(out_dir, "OUTPUT_DIR")
    stats_path = out / "stats.json"
    if not stats_path.is_file():
        what = "does not exist" if not out.exists() else "holds no stats.json (the run has not finished, or it is not a datapipe output folder)"
        raise NotAnOutputFolder(f"output folder {str(out)!r} {what}")
    stats = json.loads(stats_path.read_text())
    manifest = read_manifest(out) if (out / MANIFEST_NAME).is_file() else None
    if manifest is not None:
        shard_paths = [out / s["path"] for s in manifest["shards"]]
    else:  # stats.json is written just before the manifest: a run stopped in between
        shard_paths = sorted((out / SHARD_DIR).glob("*.arrow"))

    scan = _scan_shards(shard_paths)
    funnel, funnel_total = _funnel(stats, scan["written"])
    domains = sorted({r["domain"] for r in funnel} | set(scan["written"]))
    written = _written(domains, scan["written"], manifest)
    read_docs = {r["domain"]: r["docs_in"] for r in funnel if r["stage"] == funnel[0]["stage"]} if funnel else {}
    drops = [
        {"stage": stage, "domain": domain, "reason": reason, "docs": n,
         "share_of_read": round(n / read_docs[domain], 6) if read_docs.get(domain) else None}
        for stage, by_domain in stats.get("dropped", {}).items()
        for domain, by_reason in by_domain.items()
        for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    drops += [  # the funnel's `eval split` rows, so that every dropped count has its reason here
        {"stage": EVAL_SPLIT, "domain": r["domain"], "reason": HELD_OUT, "docs": r["dropped"],
         "share_of_read": round(r["dropped"] / read_docs[r["domain"]], 6) if read_docs.get(r["domain"]) else None}
        for r in funnel if r["stage"] == EVAL_SPLIT and r["dropped"]
    ]
    total_docs = sum(w["docs"] for w in written.values())
    total_tokens = sum(w["tokens"] for w in written.values())
    return {
        "out_dir": str(out.resolve() if isinstance(out, Path) else out),
        "complete": manifest is not None,
        "nothing_survived": bool(stats.get("nothing_survived")),  # the run stopped: no document was left to write
        "summary": {
            "shards": len(shard_paths),
            "docs": total_docs,
            "tokens": total_tokens,
            "read": sum(read_docs.values()),
            "quarantined": sum(stats.get("quarantined", {}).values()),
            "seconds": stats.get("seconds"),
            "config_hash": (manifest or {}).get("config_hash"),
            "tokenizer": {k: (manifest or {}).get("tokenizer", {}).get(k) for k in ("vocab_size", "dtype")},
        },
        "funnel": funnel,
        "funnel_total": funnel_total,
        "written": written,
        "drops": drops,
        "quarantined": dict(stats.get("quarantined", {})),
        "near_duplicates": stats.get("global_stages", {}).get("minhash"),
        "mixture": _mixture(stats, manifest),
        "model_selection": _model_selection(stats, manifest),
        "lengths": scan["lengths"],
        "lengths_by_lang": scan["lengths_by_lang"],
        "length_histogram": scan["histogram"],
        "manifest_agrees": _manifest_agrees(written, manifest),
        "phase_seconds": stats.get("phase_seconds", {}),
        "splits": _splits(out, manifest, stats),
    }


def _splits(out: Path | RemotePath, manifest: dict | None, stats: dict[str, Any]) -> dict[str, Any]:
    """Each held-out split the manifest names (`eval`): docs and tokens per domain counted over its own
    shards (cross-checked with its manifest), and the training copies removed for it (stats.json)."""
    found = {}
    for name, entry in sorted(((manifest or {}).get("splits") or {}).items()):
        folder = out / entry["path"]
        sub = read_manifest(folder)
        written = _scan_shards([folder / s["path"] for s in sub["shards"]])["written"]
        found[name] = {"path": entry["path"], "shards": len(sub["shards"]), "domains": dict(sorted(written.items())),
                       "docs": sum(w["docs"] for w in written.values()), "tokens": sum(w["tokens"] for w in written.values()),
                       "manifest_agrees": _manifest_agrees(written, sub),
                       "removed_from_train": (stats.get(name) or {}).get("removed_from_train", {})}
    return found


def _length_aggs() -> list[pl.Expr]:
    n = pl.col("num_tokens")
    return [
        pl.len().alias("docs"),
        n.sum().alias("tokens"),
        n.mean().alias("mean"),
        *[n.quantile(p / 100, interpolation="linear").alias(f"p{p}") for p in PERCENTILES],
        n.max().alias("max"),
    ]


def _scan(paths: list[Path | RemotePath], *, parquet: bool = False, file_column: str | None = None) -> pl.LazyFrame:
    """The Arrow IPC (or Parquet) files `paths` as one lazy frame, with the file of each row in `file_column`
    when given. Local files are scanned lazily by polars; remote ones are read through the storage module
    (shards without their `tokens` column, which nothing here reads)."""
    if not any(isinstance(p, RemotePath) for p in paths):
        extra = {"include_file_paths": file_column} if file_column else {}
        files = [str(p) for p in paths]
        return pl.scan_parquet(files, **extra) if parquet else pl.scan_ipc(files, **extra)
    frames = []
    for p in paths:
        if parquet:
            import pyarrow.parquet as pq

            with p.open("rb") as f:
                t = pq.read_table(f)
        else:
            t = read_table(p)
        frame = pl.from_arrow(t.drop_columns([c for c in ("tokens",) if c in t.column_names]))
        frames.append(frame.with_columns(pl.lit(str(p)).alias(file_column)) if file_column else frame)
    return pl.concat(frames, how="diagonal_relaxed").lazy()


def _relative(file: str, out: Path | RemotePath) -> str:
    """The path of `file` (a local path or URL under `out`) relative to `out`."""
    return str(Path(file).relative_to(out)) if isinstance(out, Path) else file[len(str(out)) + 1:]


def _scan_shards(paths: list[Path | RemotePath]) -> dict[str, Any]:
    """One lazy polars pass over the shards: written docs/tokens, percentiles, histogram."""
    empty = {"written": {}, "lengths": [], "lengths_by_lang": [], "histogram": {"bins_per_decade": BINS_PER_DECADE, "edges": [], "counts": {}}}
    if not paths:
        return empty
    lf = _scan(paths)
    has_lang = "lang" in lf.collect_schema().names()
    lf = lf.select(["domain", "num_tokens"] + (["lang"] if has_lang else []))  # never `tokens`
    # bin k holds lengths in [10**(k/B), 10**((k+1)/B)); every document has >= 1 token (its EOS)
    bin_expr = (pl.col("num_tokens").clip(lower_bound=1).cast(pl.Float64).log10() * BINS_PER_DECADE).floor().cast(pl.Int64)
    queries = [
        lf.group_by("domain").agg(_length_aggs()).sort("domain"),
        lf.group_by("domain", bin_expr.alias("bin")).agg(pl.len().alias("docs")).sort("domain", "bin"),
    ]
    if has_lang:
        queries.append(lf.filter(pl.col("lang").is_not_null()).group_by("domain", "lang").agg(_length_aggs()).sort("domain", "lang"))
    frames = pl.collect_all(queries)
    by_domain, hist = frames[0], frames[1]
    by_lang = frames[2] if has_lang else None
    if by_domain.height == 0:
        return empty

    def rows(df: pl.DataFrame) -> list[dict[str, Any]]:
        return [{**r, "mean": round(r["mean"], 3), **{f"p{p}": float(r[f"p{p}"]) for p in PERCENTILES}} for r in df.drop("tokens").to_dicts()]

    written = {r["domain"]: {"docs": r["docs"], "tokens": r["tokens"]} for r in by_domain.select("domain", "docs", "tokens").to_dicts()}
    lo, hi = int(hist["bin"].min()), int(hist["bin"].max())
    counts = {}
    for d, part in hist.partition_by("domain", as_dict=True).items():  # one small frame per domain
        dense = [0] * (hi - lo + 1)
        for b, c in zip(part["bin"].to_list(), part["docs"].to_list()):
            dense[b - lo] = c
        counts[d[0] if isinstance(d, tuple) else d] = dense
    edges = [round(10 ** (k / BINS_PER_DECADE), 3) for k in range(lo, hi + 2)]
    return {
        "written": written,
        "lengths": rows(by_domain),
        "lengths_by_lang": rows(by_lang) if by_lang is not None else [],
        "histogram": {"bins_per_decade": BINS_PER_DECADE, "edges": edges, "counts": dict(sorted(counts.items()))},
    }


def _funnel(stats: dict[str, Any], written: dict[str, dict[str, int]]) -> tuple[list[dict], list[dict]]:
    """Rows (domain, stage, docs/bytes in and out) in pipeline order; with an eval split chosen by this
    run, an `eval split` row per domain (its documents leave the training data there); then a `written`
    row per domain with the tokens and the mixture's copies (docs out = docs in - dropped + copies); and
    the same summed over domains."""
    rows: list[dict[str, Any]] = []
    last_out: dict[str, int] = {}
    for entry in stats.get("funnel", []):
        for domain, c in entry["domains"].items():
            rows.append({"domain": domain, "stage": entry["stage"], "docs_in": c["docs_in"], "docs_out": c["docs_out"],
                         "dropped": c["docs_in"] - c["docs_out"], "bytes_in": c["bytes_in"], "bytes_out": c["bytes_out"],
                         "tokens_out": None, "mixture_copies": None})
            last_out[domain] = c["docs_out"]
    split = stats.get("eval") or {}
    if split.get("domains") is not None and not split.get("source"):  # held out here (not another run's, copied in)
        for domain in sorted(last_out):
            held = split["domains"].get(domain, {}).get("docs", 0)
            rows.append({"domain": domain, "stage": EVAL_SPLIT, "docs_in": last_out[domain], "docs_out": last_out[domain] - held,
                         "dropped": held, "bytes_in": None, "bytes_out": None, "tokens_out": None, "mixture_copies": None})
            last_out[domain] -= held
    for stage in _selection_steps(stats):  # selection by a model, then diversity sampling: a row each
        for domain in sorted(last_out):
            n = sum(stats["dropped"][stage].get(domain, {}).values())
            rows.append({"domain": domain, "stage": stage, "docs_in": last_out[domain], "docs_out": last_out[domain] - n,
                         "dropped": n, "bytes_in": None, "bytes_out": None, "tokens_out": None, "mixture_copies": None})
            last_out[domain] -= n
    distinct = distinct_written(stats)
    for domain in sorted(set(last_out) | set(written)):
        w = written.get(domain, {"docs": 0, "tokens": 0})
        docs_in = last_out.get(domain, w["docs"])
        # rows written = distinct documents + the copies of those that the mixture repeats; stats.json's
        # `kept` gives the distinct ones (without it, a row count above docs_in can only be copies)
        once = distinct[domain]["docs"] if domain in distinct else min(w["docs"], docs_in)
        rows.append({"domain": domain, "stage": WRITTEN, "docs_in": docs_in, "docs_out": w["docs"], "dropped": docs_in - once,
                     "bytes_in": None, "bytes_out": None, "tokens_out": w["tokens"], "mixture_copies": w["docs"] - once})
    stage_order = {s: i for i, s in enumerate(dict.fromkeys(r["stage"] for r in rows))}
    rows.sort(key=lambda r: (r["domain"], stage_order[r["stage"]]))
    total: dict[str, dict[str, Any]] = {}
    for r in rows:
        t = total.setdefault(r["stage"], {"domain": TOTAL, "stage": r["stage"]})
        for k in ("docs_in", "docs_out", "dropped", "bytes_in", "bytes_out", "tokens_out", "mixture_copies"):
            t[k] = None if r[k] is None else (t.get(k) or 0) + r[k]
    return rows, sorted(total.values(), key=lambda r: stage_order[r["stage"]])


def _selection_steps(stats: dict[str, Any]) -> list[str]:
    """The selection steps before the shards that dropped documents, in pipeline order: selection by a model (its
    stage's name, in `model_selection`), diversity sampling. What the `written` row then drops is the mixture's."""
    steps = [(stats.get("model_selection") or {}).get("stage"), "diversity"]
    return [s for s in steps if s and s in stats.get("dropped", {})]


def _written(domains: list[str], scanned: dict[str, dict[str, int]], manifest: dict | None) -> dict[str, dict[str, Any]]:
    total = sum(w["tokens"] for w in scanned.values()) or 1
    shards_of: dict[str, int] = {}
    for s in (manifest or {}).get("shards", []):  # a loop over shards (their summaries), not rows
        for d in s.get("domains", {}):
            shards_of[d] = shards_of.get(d, 0) + 1
    out = {}
    for d in domains:
        w = scanned.get(d, {"docs": 0, "tokens": 0})
        out[d] = {"docs": w["docs"], "tokens": w["tokens"], "token_share": round(w["tokens"] / total, 6),
                  "mean_tokens": round(w["tokens"] / w["docs"], 3) if w["docs"] else None,
                  "shards": shards_of.get(d) if manifest is not None else None}
    return out


def _manifest_agrees(written: dict[str, dict[str, Any]], manifest: dict | None) -> bool | None:
    """Do the manifest's per-domain totals equal the count over the shard files?"""
    if manifest is None:
        return None
    listed = {d: (c["docs"], c["tokens"]) for d, c in manifest.get("domains", {}).items()}
    scanned = {d: (w["docs"], w["tokens"]) for d, w in written.items() if w["docs"]}
    return listed == scanned


def _mixture(stats: dict[str, Any], manifest: dict | None) -> dict[str, Any] | None:
    """The mixture entry ({"method", "domains": {d: {natural_tokens, target_share, realised_tokens,
    realised_share, epochs, capped}}}) of stats.json, else of the manifest; None when neither has one."""
    for source, doc in (("stats.json", stats), (MANIFEST_NAME, manifest or {})):
        mix = doc.get("mixture")
        if isinstance(mix, dict) and isinstance(mix.get("domains"), dict):
            return {"method": mix.get("method"), "source": source, "domains": dict(sorted(mix["domains"].items()))}
    return None


def _model_selection(stats: dict[str, Any], manifest: dict | None) -> dict[str, Any] | None:
    """The `model_selection` entry (method, stage, flops, cpu_seconds, groups, histogram) of stats.json,
    else of the manifest, unchanged; None when neither has one."""
    for doc in (stats, manifest or {}):
        sel = doc.get("model_selection")
        if isinstance(sel, dict):
            return sel
    return None


# ---------------------------------------------------------------- text


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _mb(b: int | None) -> str | None:
    return None if b is None else f"{b / 1e6:,.2f}"


def _pct(x: float | None, digits: int = 1) -> str | None:
    return None if x is None else f"{100 * x:.{digits}f}%"


def _funnel_rows(rows: list[dict[str, Any]], with_copies: bool) -> list[list[Any]]:
    out, prev = [], None
    for r in rows:
        share = _pct(r["dropped"] / r["docs_in"]) if r["docs_in"] and r["dropped"] >= 0 else None
        copies = [f"+{r['mixture_copies']:,}" if r.get("mixture_copies") else None] if with_copies else []
        out.append([r["domain"] if r["domain"] != prev else "", r["stage"], r["docs_in"], r["docs_out"], r["dropped"],
                    share, *copies, _mb(r["bytes_in"]), _mb(r["bytes_out"]), r["tokens_out"]])
        prev = r["domain"]
    return out


def _split_title(name: str, split: dict[str, Any]) -> str:
    removed = split["removed_from_train"]
    what = ", ".join(f"{n:,} {r.replace('_', ' ')}" for r, n in sorted(removed.items()) if n) or "none"
    return (f"Split '{name}' ({split['path']}/, {_n(split['shards'], 'shard')}; held out before diversity sampling and the "
            f"mixture; training copies removed: {what})"
            + ("" if split["manifest_agrees"] is not False else "\nWARNING: its manifest's per-domain totals differ from a count over its shards"))


@dataclass
class _Section:
    """One block of the report, built once and drawn by both `render_text` and `render_html`: a title,
    a note, and a table whose cells `tables.cell` writes (the first `left` columns are labels)."""

    title: str
    note: str = ""
    header: list[str] | None = None
    rows: list[list[Any]] = field(default_factory=list)
    left: int = 1


def _summary(figures: dict[str, Any]) -> tuple[str, list[str]]:
    """The summary sentence and the warnings under it."""
    s = figures["summary"]
    quarantined = f" ({s['quarantined']:,} quarantined)" if s["quarantined"] else ""
    took = f"; run took {s['seconds']:.1f} s" if s.get("seconds") is not None else ""
    if figures.get("nothing_survived"):
        return (f"Nothing survived curation: no document was written (no shards, no manifest.json) of {s['read']:,} documents read"
                f"{quarantined}{took}.\nThe funnel and the drop reasons below say where they went.", [])
    warnings = []
    if not figures["complete"]:
        warnings.append("no manifest.json, the run did not finish; shards found on disk are counted")
    if figures["manifest_agrees"] is False:
        warnings.append("the manifest's per-domain totals differ from a count over the shard files")
    return f"{_n(s['shards'], 'shard')}, {s['docs']:,} documents, {s['tokens']:,} tokens written of {s['read']:,} documents read{quarantined}{took}", warnings


def _sections(figures: dict[str, Any]) -> list[_Section]:
    """Every table of the report, in order: funnel, drop reasons, written, splits, selection by a model, mixture, lengths."""
    s = figures["summary"]
    rows = figures["funnel"] + figures["funnel_total"]
    copies = {r["domain"]: r.get("mixture_copies") or 0 for r in rows if r["stage"] == WRITTEN}
    with_copies = any(copies.values())
    note = ("Stages before tokenization count documents and MB of text;\n"
            "tokens exist only for what was written (the `written` rows, counted over the shards).")
    if with_copies:
        note += ("\nThe mixture writes some documents more than once: at `written`, docs out = docs in - dropped + mixture copies.")
    sections = [_Section("Stage funnel per domain", note,
                         ["domain", "stage", "docs in", "docs out", "dropped", "drop %"] + (["mixture copies"] if with_copies else [])
                         + ["MB in", "MB out", "tokens"], _funnel_rows(rows, with_copies), left=2)
                if rows else _Section("Stage funnel: no document got past reading.")]

    drops = [["read", None, f"quarantine:{reason}", n, None] for reason, n in figures["quarantined"].items()]
    drops += _drop_rows(figures["drops"], [r["stage"] for r in figures["funnel"]])
    if drops:
        sections.append(_Section("Drop reasons", "", ["stage", "domain", "reason", "docs", "% of read"], drops, left=3))
    else:
        sections.append(_Section("Drop reasons: nothing was dropped."))
    nd = figures["near_duplicates"]
    if nd:
        sections.append(_Section(f"near-duplicates: {nd.get('candidate_pairs', 0):,} candidate pairs, {_n(nd.get('clusters', 0), 'cluster')}, "
                                 f"{nd.get('removed', 0):,} documents removed"))
    if figures.get("nothing_survived"):
        return sections

    w = figures["written"]
    rows = [[d, c["shards"], c["docs"], c["tokens"], _pct(c["token_share"]), c["mean_tokens"]] for d, c in w.items()]
    rows.append([TOTAL, s["shards"], s["docs"], s["tokens"], _pct(1.0 if s["tokens"] else 0.0), s["tokens"] / s["docs"] if s["docs"] else None])
    header = ["domain", "shards", "docs", "tokens", "token share", "tokens/doc"]
    if with_copies:
        header.append("mixture copies")
        for r in rows:
            r.append(copies.get(r[0], 0))
    sections.append(_Section("Written (counted over the shards)",
                             "docs include the mixture's copies, as the manifest does" if with_copies else "", header, rows))

    for name, split in figures.get("splits", {}).items():
        rows = [[d, c["docs"], c["tokens"]] for d, c in split["domains"].items()] + [[TOTAL, split["docs"], split["tokens"]]]
        sections.append(_Section(_split_title(name, split), "", ["domain", "docs", "tokens"], rows))

    if figures.get("model_selection"):
        sections += _selection_sections(figures["model_selection"])

    mix = figures["mixture"]
    if mix:
        rows = [[d, c.get("natural_tokens"), _pct(c.get("target_share")), c.get("realised_tokens"), _pct(c.get("realised_share")),
                 None if c.get("epochs") is None else f"{c['epochs']:.2f}", "yes" if c.get("capped") else "no"]
                for d, c in mix["domains"].items()]
        sections.append(_Section(f"Mixture (method {mix['method']}, from {mix['source']}): target vs realised token share", "",
                                 ["domain", "natural tokens", "target", "realised tokens", "realised", "epochs", "capped"], rows))
    else:
        sections.append(_Section("Mixture: none recorded (no `mixture` in stats.json or manifest.json); the natural mix was written."))

    lcols = ["docs"] + [f"p{p}" for p in PERCENTILES] + ["max", "mean"]

    def lrow(r: dict[str, Any]) -> list[Any]:
        return [r["docs"], *[f"{r[f'p{p}']:,.0f}" for p in PERCENTILES], r["max"], f"{r['mean']:,.1f}"]

    title = "Document length in tokens (over the shards)"
    if figures["lengths_by_lang"]:
        rows, hidden = [], [x for x in figures["lengths_by_lang"] if x["docs"] < MIN_LANGUAGE_DOCS]
        for r in figures["lengths"]:
            rows.append([r["domain"], "(all)", *lrow(r)])
            rows += [["", x["lang"], *lrow(x)] for x in figures["lengths_by_lang"]
                     if x["domain"] == r["domain"] and x["docs"] >= MIN_LANGUAGE_DOCS]
        note = (f"{_n(len(hidden), 'language row')} of fewer than {MIN_LANGUAGE_DOCS} documents not shown "
                f"({_n(sum(x['docs'] for x in hidden), 'document')}; `--json` has them)." if hidden else "")
        sections.append(_Section(title, note, ["domain", "lang", *lcols], rows, left=2))
    else:
        sections.append(_Section(title, "", ["domain", *lcols], [[r["domain"], *lrow(r)] for r in figures["lengths"]]))
    return sections


MIN_LANGUAGE_DOCS = 20  # a (domain, lang) length row of fewer documents says too little to show: it is counted instead
FOLD_BELOW = 0.02  # a drop reason of fewer documents than this share of its stage's drops in its domain is folded


def _drop_rows(drops: list[dict[str, Any]], stage_order: list[str]) -> list[list[Any]]:
    """The drop-reason table's rows: by stage in pipeline order, then domain, the reasons by count; the reasons of a
    stage and domain too small to matter (under FOLD_BELOW of its drops, and more than one of them) as one row
    "N other reasons" (the JSON keeps every one)."""
    order = {stage: i for i, stage in enumerate(dict.fromkeys(stage_order))}
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for d in drops:
        groups.setdefault((d["stage"], d["domain"]), []).append(d)
    rows = []
    for (stage, domain), group in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], len(order)), kv[0])):
        group = sorted(group, key=lambda d: (-d["docs"], d["reason"]))
        total = sum(d["docs"] for d in group)
        small = [d for d in group if d["docs"] < FOLD_BELOW * total]
        shown = group if len(small) < 2 else [d for d in group if d not in small]
        rows += [[stage, domain, d["reason"], d["docs"], _pct(d["share_of_read"])] for d in shown]
        if len(small) >= 2:
            shares = [d["share_of_read"] for d in small]
            share = sum(shares) if all(x is not None for x in shares) else None
            rows.append([stage, domain, f"{len(small)} other reasons", sum(d["docs"] for d in small), _pct(share)])
    return rows


def _kept_score_range(edges: list[float], kept: list[int]) -> str | None:
    """The scores of the kept documents, to the histogram's bins: from the lower edge of the lowest bin
    holding a kept document to the upper edge of the highest one (the first and last bins are open tails)."""
    held = [i for i, n in enumerate(kept) if n]
    if not held:
        return None
    lo = edges[held[0] - 1] if held[0] > 0 else None
    hi = edges[held[-1]] if held[-1] < len(edges) else None
    if lo is None and hi is None:
        return "any"
    if lo is None:
        return f"< {hi:.4g}"
    if hi is None:
        return f">= {lo:.4g}"
    return f"{lo:.4g} .. {hi:.4g}"


def _selection_sections(sel: dict[str, Any]) -> list[_Section]:
    """Selection by a model: what it cost, per domain the documents scored and kept (with the kept
    scores' range, to the histogram's bins), and per budget group its documents in and kept."""
    flops = sel.get("flops")
    cpu = sel.get("cpu_seconds")
    title = (f"Selection by a model (method {sel.get('method')}, stage `{sel.get('stage')}`): "
             f"{'-' if flops is None else f'{flops:.3g}'} FLOPs, {'-' if cpu is None else f'{cpu:,.2f}'} CPU seconds")
    hist = sel.get("histogram") or {}
    edges = hist.get("edges", [])
    rows = []
    for d, h in sorted((hist.get("domains") or {}).items()):
        scored, kept = sum(h["all"]), sum(h["kept"])
        rows.append([d, scored, kept, _pct(kept / scored) if scored else None, _kept_score_range(edges, h["kept"])])
    if rows:
        scored, kept = sum(r[1] for r in rows), sum(r[2] for r in rows)
        rows.append([TOTAL, scored, kept, _pct(kept / scored) if scored else None, None])
    note = "kept scores: from the lowest to the highest histogram bin holding a kept document (the outer bins are open tails)"
    sections = [_Section(title, note, ["domain", "scored", "kept", "kept %", "kept scores"], rows)]
    groups = sel.get("groups") or {}
    if groups:  # a budget cut (keep_fraction / keep_tokens); a threshold has no groups
        rows = [[g, c.get("docs_in"), c.get("docs_kept"), c.get("clusters")] for g, c in sorted(groups.items())]
        sections.append(_Section("Selection by a model: per budget group (`*`: one budget over the corpus)", "",
                                 ["group", "docs in", "docs kept", "clusters"], rows))
    return sections


def render_text(figures: dict[str, Any]) -> str:
    """The terminal report: summary, funnel, drop reasons, written, mixture, lengths."""
    summary, warnings = _summary(figures)
    parts = [f"datapipe stats: {figures['out_dir']}\n{summary}" + "".join(f"\nWARNING: {w}" for w in warnings)]
    for sec in _sections(figures):
        lines = [sec.title] + ([sec.note] if sec.note else []) + ([table(sec.header, sec.rows, left=sec.left)] if sec.header else [])
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


# ---------------------------------------------------------------- pictures


def _figure(width: float, height: float):
    """A matplotlib Figure on an Agg canvas: no pyplot, so no global backend or figure state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _colors(domains: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(domains) <= 10 else "tab20"]
    return {d: cmap(i % cmap.N) for i, d in enumerate(domains)}


def plot(figures: dict[str, Any], out_dir: str | Path, folder: str | Path) -> list[Path]:
    """Write funnel.png, token_share.png and lengths.png (and selection_scores.png when the run selected
    by a model) into `folder`; return their paths.
    `out_dir` (the run's folder) only titles the pictures."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    name = Path(out_dir).name or str(out_dir)
    domains = list(figures["written"])
    colors = _colors(domains)
    paths = []
    for fname, draw in zip(PLOTS, (_plot_funnel, _plot_share, _plot_lengths)):
        fig = draw(figures, domains, colors, name)
        path = folder / fname
        fig.savefig(path)
        paths.append(path)
    if figures.get("model_selection"):  # only a run that selected by a model has scores to draw
        path = folder / SELECTION_PLOT
        _plot_selection(figures["model_selection"], name).savefig(path)
        paths.append(path)
    return paths


def _plot_funnel(figures: dict[str, Any], domains: list[str], colors: dict, name: str):
    fig = _figure(12, 4.8)
    ax_docs, ax_text = fig.subplots(1, 2)
    stages = list(dict.fromkeys(r["stage"] for r in figures["funnel"]))
    counted = {r["stage"] for r in figures["funnel"] if r["bytes_out"] is not None}
    text_stages = [s for s in stages if s in counted]  # the stages that count text bytes (before tokenization)
    total_bytes = max([r["bytes_in"] or 0 for r in figures["funnel_total"]] + [0])
    unit, scale = ("MB", 1e6) if total_bytes >= 1e6 else ("KB", 1e3)
    docs_seen: list[int] = []
    end_labels = []
    for d in domains:
        rows = {r["stage"]: r for r in figures["funnel"] if r["domain"] == d}
        first = rows.get(stages[0]) if stages else None
        # the first point is what entered the first stage; then what left each stage
        docs = [first["docs_in"] if first else math.nan] + [rows[s]["docs_out"] if s in rows else math.nan for s in stages]
        text = [first["bytes_in"] / scale if first else math.nan] + [rows[s]["bytes_out"] / scale if s in rows else math.nan for s in text_stages]
        # a mixture that upsamples writes some documents more than once: the line ends at the distinct
        # documents written, and a dashed arrow climbs from there to the rows written, copies included
        copies = (rows.get(WRITTEN) or {}).get("mixture_copies") or 0
        end = len(docs) - 1
        top = docs[end]
        docs[end] = top - copies
        ax_docs.plot(range(len(docs)), docs, marker="o", color=colors[d], label=d)
        ax_text.plot(range(len(text)), text, marker="o", color=colors[d], label=d)
        label = f"{top:,}"
        if copies:
            ax_docs.annotate("", (end, top), xytext=(end, docs[end]),
                             arrowprops={"arrowstyle": "-|>", "linestyle": "--", "color": colors[d], "shrinkA": 4, "shrinkB": 0})
            ax_docs.plot([end], [top], marker="o", markerfacecolor="white", color=colors[d])
            label = f"{top:,} written\n(+{copies:,} mixture copies)"
        end_labels.append(ax_docs.annotate(label, (end, top), textcoords="offset points", xytext=(7, 0), va="center",
                                           fontsize=8, color=colors[d]))
        docs_seen += [int(v) for v in docs + [top] if v and not math.isnan(v)]
    log = bool(docs_seen) and max(docs_seen) / max(min(docs_seen), 1) > 50  # very different sizes: log scale
    for ax, labels, ylabel, title in (
        (ax_docs, ["in"] + stages, "documents", "Documents in, then left after each stage"),
        (ax_text, ["in"] + text_stages, f"{unit} of text", f"Text ({unit}) in, then left after each stage\n(tokens are counted only once written)"),
    ):
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=11)
        ax.grid(True, alpha=0.3)
        if log:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    if domains:
        ax_docs.legend(title="domain", fontsize=8, loc="lower left")
    fig.suptitle(f"Stage funnel per domain: {name}" + ("  (log scale)" if log else ""), fontsize=13)
    _fit_labels(ax_docs, end_labels)
    return fig


def _fit_labels(ax, labels: list) -> None:
    """Keep every end-of-line label inside the frame and off the others: widen the x axis to the right
    (a label sits a fixed number of points right of its data point, so only a wider data range makes
    room), then move labels up or down where they would cross the frame or cover one another."""
    if not labels:
        return
    fig = ax.figure
    for t in labels:  # the layout keeps the frame where it is; the labels move into it
        t.set_in_layout(False)
    fig.canvas.draw()  # lay out first: sizes in pixels are known only once drawn
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    x0, x1 = ax.get_xlim()
    pad = 6  # pixels between the longest label and the frame
    need = 0.0  # the largest fraction of the frame width that the data point must leave free on its right
    anchor = 0.0  # that label's data x
    for t in labels:
        px = ax.transData.transform((t.xy[0], 0))[0]
        overhang = t.get_window_extent(renderer).x1 - px + pad  # pixels from the data point to the label's end
        if overhang / frame.width > need:
            need, anchor = overhang / frame.width, t.xy[0]
    right = x0 + (anchor - x0) / (1 - need) if need < 1 else x1  # then the anchor sits at (1 - need) of the width
    if right > x1:
        ax.set_xlim(x0, right)
    # vertically: lines can end at the same count (several domains at 0), or at the frame's edge
    gap = 2  # pixels
    boxes = sorted(((t.get_window_extent(renderer), t) for t in labels), key=lambda bt: bt[0].y0)  # bottom first
    shifts, floor = [], frame.y0 + gap
    for box, _t in boxes:  # upwards: above the frame's bottom and above the label below
        shifts.append(max(floor - box.y0, 0.0))
        floor = box.y1 + shifts[-1] + gap
    ceiling = frame.y1 - gap
    for i in reversed(range(len(boxes))):  # downwards, only where a label crosses the frame's top
        box = boxes[i][0]
        shifts[i] -= max(box.y1 + shifts[i] - ceiling, 0.0)
        ceiling = box.y0 + shifts[i] - gap
    for (_box, t), shift in zip(boxes, shifts):
        if shift:
            t.xyann = (t.xyann[0], t.xyann[1] + shift * 72 / fig.dpi)  # offset points


def _plot_share(figures: dict[str, Any], domains: list[str], colors: dict, name: str):
    import numpy as np

    mix = figures["mixture"]
    fig = _figure(10, 1.4 + 0.6 * max(len(domains), 2))
    ax = fig.subplots()
    y = np.arange(len(domains))
    realised = [100 * figures["written"][d]["token_share"] for d in domains]
    if mix:
        target = [100 * (mix["domains"].get(d, {}).get("target_share") or 0.0) for d in domains]
        h = 0.38
        bars_t = ax.barh(y - h / 2, target, h, color="lightgray", edgecolor="gray", label="target")
        bars_r = ax.barh(y + h / 2, realised, h, color="tab:blue", label="realised (counted over the shards)")
        ax.bar_label(bars_t, labels=[f"{v:.1f}%" for v in target], padding=3, fontsize=8)
        ax.bar_label(bars_r, labels=[f"{v:.1f}%" for v in realised], padding=3, fontsize=8)
        fig.legend(fontsize=8, loc="outside right upper")
        title = f"Token share per domain: target vs realised (mixture method {mix['method']})"
    else:
        bars = ax.barh(y, realised, 0.6, color=[colors[d] for d in domains])
        tokens = [figures["written"][d]["tokens"] for d in domains]
        ax.bar_label(bars, labels=[f"{v:.1f}%  ({t:,} tokens)" for v, t in zip(realised, tokens)], padding=3, fontsize=8)
        title = "Token share per domain (realised; no mixture target recorded)"
    ax.set_yticks(y, domains)
    ax.invert_yaxis()
    ax.set_xlabel("share of written tokens (%)")
    ax.set_xlim(0, max(realised + ([100 * (c.get("target_share") or 0) for c in mix["domains"].values()] if mix else []) + [1]) * 1.3)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_title(f"{title}: {name}", fontsize=11)
    return fig


def _domain_grid(shown: list, xlabel: str):
    """A figure with one axis per domain (three a row), each labelled and gridded alike; unused axes hidden."""
    from matplotlib.ticker import MaxNLocator

    ncols = min(3, max(len(shown), 1))
    nrows = math.ceil(max(len(shown), 1) / ncols)
    fig = _figure(4.2 * ncols, 3.2 * nrows)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[: len(shown)]:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("documents")
        ax.grid(True, alpha=0.3)
    for ax in axes[len(shown):]:
        ax.set_visible(False)
    return fig, axes


def _plot_lengths(figures: dict[str, Any], domains: list[str], colors: dict, name: str):
    hist = figures["length_histogram"]
    lengths = {r["domain"]: r for r in figures["lengths"]}
    shown = [d for d in domains if d in hist["counts"]] or domains[:1]
    fig, axes = _domain_grid(shown, "document length (tokens, log scale)")
    edges = hist["edges"]
    for ax, d in zip(axes, shown):
        counts = hist["counts"].get(d)
        if counts:
            ax.stairs(counts, edges, fill=True, color=colors[d], alpha=0.75)
            r = lengths[d]
            for p, style in (("p5", ":"), ("p50", "--"), ("p95", ":")):
                ax.axvline(max(r[p], 1), color="black", linestyle=style, linewidth=1)
            ax.set_title(f"{d}: {r['docs']:,} docs, median {r['p50']:,.0f} tokens", fontsize=10)
        ax.set_xscale("log")
    fig.suptitle(f"Document length per domain (dashed: median; dotted: p5 and p95): {name}", fontsize=12)
    return fig


def _plot_selection(sel: dict[str, Any], name: str):
    """The score histogram per domain: every scored document, the kept ones on top."""
    hist = sel.get("histogram") or {}
    inner = hist.get("edges") or [0.0]
    by_domain = hist.get("domains") or {}
    shown = sorted(by_domain) or [None]
    # the outer bins are open tails: drawn one inner bin wide beyond the first and last edges
    width = (inner[-1] - inner[0]) / max(len(inner) - 1, 1) or 1.0
    edges = [inner[0] - width, *inner, inner[-1] + width]
    colors = _colors(shown)
    fig, axes = _domain_grid(shown, "score (outer bins: the tails)")
    for ax, d in zip(axes, shown):
        h = by_domain.get(d)
        if h and len(h["all"]) == len(edges) - 1:
            ax.stairs(h["all"], edges, fill=True, color="lightgray", label="all scored")
            ax.stairs(h["kept"], edges, fill=True, color=colors[d], alpha=0.8, label="kept")
            ax.set_title(f"{d}: {sum(h['kept']):,} of {sum(h['all']):,} kept", fontsize=10)
            ax.legend(fontsize=8)
    fig.suptitle(f"Selection scores per domain (method {sel.get('method')}): {name}", fontsize=12)
    return fig


# ---------------------------------------------------------------- html


def _html_text(text: str) -> str:
    """Report text as HTML: escaped, `code` spans as <code>, line breaks kept (the terminal's backticks
    and newlines would show literally on the page)."""
    return re.sub(r"`([^`\n]+)`", r"<code>\1</code>", html.escape(text)).replace("\n", "<br>\n")


def _html_table(header: list[str], rows: list[list[Any]], left: int) -> str:
    """The table `tables.table` draws, as HTML: the same cells, the first `left` columns as labels."""
    def td(i: int, c: Any) -> str:
        return f"<td{' class=num' if i >= left else ''}>{_html_text(cell(c))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "\n".join("<tr>" + "".join(td(i, c) for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table>\n<tr>{head}</tr>\n{body}\n</table>"


def render_html(figures: dict[str, Any], images: list[Path] | None = None) -> str:
    """One self-contained page: the tables of `render_text` and the PNGs as base64 data URIs.
    Without `images`, the pictures are drawn into a temporary folder first."""
    if images is None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            return render_html(figures, plot(figures, figures["out_dir"], tmp))
    e = html.escape
    summary, warnings = _summary(figures)
    sections = [f"<h1>datapipe stats</h1>\n<p><code>{e(figures['out_dir'])}</code></p>", f"<p>{_html_text(summary)}</p>"]
    sections += [f"<p class=warn>Warning: {_html_text(w)}</p>" for w in warnings]
    pictures = "\n".join(
        f'<figure><img alt="{e(p.stem)}" src="data:image/png;base64,{base64.b64encode(Path(p).read_bytes()).decode()}"></figure>'
        for p in images
    )
    sections.append(f"<h2>Pictures</h2>\n{pictures}")
    for sec in _sections(figures):
        if sec.header is None and not sec.note:  # a one-line section: a paragraph
            sections.append(f"<p>{_html_text(sec.title)}</p>")
            continue
        sections.append(f"<h2>{_html_text(sec.title)}</h2>" + (f"\n<p>{_html_text(sec.note)}</p>" if sec.note else "")
                        + (f"\n{_html_table(sec.header, sec.rows, sec.left)}" if sec.header else ""))
    style = ("body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}"
             "table{border-collapse:collapse;margin:.5em 0 1.5em}th,td{border:1px solid #ccc;padding:3px 8px}"
             "th{background:#f3f3f3}td.num{text-align:right;font-variant-numeric:tabular-nums}"
             "img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}.warn{color:#a00}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>datapipe stats: {e(figures['out_dir'])}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(sections) + "\n</body></html>\n")


# ---------------------------------------------------------------- why


def _find_in_shards(out: Path | RemotePath, doc_id: str) -> dict[str, Any] | None:
    if (out / MANIFEST_NAME).is_file():
        manifest = read_manifest(out)
        paths = [out / s["path"] for s in manifest["shards"]]
        for entry in (manifest.get("splits") or {}).values():  # a held-out split's shards: "shard" names eval/shards/...
            paths += [out / entry["path"] / s["path"] for s in read_manifest(out / entry["path"])["shards"]]
    else:
        paths = sorted((out / SHARD_DIR).glob("*.arrow"))
    if not paths:
        return None
    lf = _scan(paths, file_column="_file")
    cols = ["id", "domain", "num_tokens", "_file"] + (["lang"] if "lang" in lf.collect_schema().names() else [])
    hit = lf.select(cols).filter(pl.col("id") == doc_id).head(1).collect()
    if hit.height == 0:
        return None
    r = hit.row(0, named=True)
    return {"id": doc_id, "status": "kept", "domain": r["domain"], "shard": _relative(r["_file"], out),
            "num_tokens": r["num_tokens"], "lang": r.get("lang")}


def _find_dropped(out: Path | RemotePath, doc_id: str) -> dict[str, Any] | None:
    files = sorted((out / "dropped").glob("*.parquet"))
    if not files:
        return None
    hit = (_scan(files, parquet=True, file_column="_file")
           .select("id", "domain", "stage", "reason", "kept_id", "_file")
           .filter(pl.col("id") == doc_id).head(1).collect())
    if hit.height == 0:
        return None
    r = hit.row(0, named=True)
    return {"id": doc_id, "status": "dropped", "domain": r["domain"], "stage": r["stage"], "reason": r["reason"],
            "kept_id": r["kept_id"], "file": _relative(r["_file"], out)}


def _find_cluster(out: Path | RemotePath, doc_id: str) -> dict[str, Any] | None:
    parts = sorted((out / CLUSTERS_DIR).glob("*.parquet"))
    older = out / "near_duplicates" / "clusters.parquet"  # where a run before the parts wrote them, in one file
    parts = parts or ([older] if older.is_file() else [])
    if not parts:
        return None
    lf = _scan(parts, parquet=True)
    mine = lf.filter(pl.col("id") == doc_id).select("cluster_id").head(1).collect()
    if mine.height == 0:
        return None
    cid = mine.item()
    members = lf.filter(pl.col("cluster_id") == cid).select("id", "kept").collect()
    kept = members.filter(pl.col("kept"))["id"].to_list()
    return {"cluster_id": cid, "size": members.height, "kept": kept[0] if kept else None, "members": members["id"].head(20).to_list()}


def _find_quarantined(out: Path | RemotePath, doc_id: str) -> dict[str, Any] | None:
    """Quarantined records never got an id: match the id derived from file and line (JSONL) or
    row (columnar), or a raw record that names the id as a JSON string."""
    files = sorted((out / "quarantine").glob("*.jsonl"))
    if not files:
        return None
    schema = {"file": pl.String, "line": pl.Int64, "row": pl.Int64, "reason": pl.String, "detail": pl.String, "raw": pl.String}
    q = pl.concat([pl.read_ndjson(f if isinstance(f, Path) else io.BytesIO(f.read_bytes()), schema=schema) for f in files])  # one frame per file (few, small)
    derived = (pl.col("file") + ":" + pl.col("line").cast(pl.String)).eq(doc_id).fill_null(False) | (
        pl.col("file") + ":" + pl.col("row").cast(pl.String)).eq(doc_id).fill_null(False)
    hit = q.filter(derived)
    match = "derived id (file and line or row)"
    if hit.height == 0:
        hit = q.filter(pl.col("raw").str.contains(json.dumps(doc_id), literal=True).fill_null(False))
        match = "the raw record names this id"
    if hit.height == 0:
        return None
    r = hit.row(0, named=True)
    return {"id": doc_id, "status": "quarantined", "file": r["file"], "line": r["line"], "row": r["row"],
            "reason": r["reason"], "detail": r["detail"], "match": match}


def why(out_dir: str | Path, doc_id: str) -> dict[str, Any] | None:
    """Where document `doc_id` went: dropped (stage, reason, the id kept instead of a duplicate,
    its near-duplicate cluster), kept (which shard) or quarantined; None when the id is unknown."""
    out = reachable(out_dir, "OUTPUT_DIR")
    if not (out / "stats.json").is_file() and not (out / MANIFEST_NAME).is_file():
        raise NotAnOutputFolder(f"output folder {str(out)!r} holds no stats.json or manifest.json")
    found = _find_dropped(out, doc_id)
    if found is not None:
        if found["reason"] == "near_duplicate" or found["stage"] == "minhash":
            found["cluster"] = _find_cluster(out, doc_id)
        if found["kept_id"]:  # what became of the copy that was kept instead (a later stage may drop it)
            kept = _find_in_shards(out, found["kept_id"]) or _find_dropped(out, found["kept_id"])
            found["kept_copy"] = {k: kept[k] for k in ("status", "shard", "stage", "reason") if k in kept} if kept else None
        return found
    return _find_in_shards(out, doc_id) or _find_quarantined(out, doc_id)


def render_why(info: dict[str, Any] | None, doc_id: str) -> str:
    if info is None:
        return f"{doc_id}: unknown id (not in the shards, dropped/ or quarantine/)"
    if info["status"] == "kept":
        lang = f", lang {info['lang']}" if info.get("lang") else ""
        return f"{doc_id}: kept, in {info['shard']} (domain {info['domain']}{lang}, {info['num_tokens']:,} tokens)"
    if info["status"] == "quarantined":
        where = f"line {info['line']}" if info["line"] is not None else f"row {info['row']}"
        return (f"{doc_id}: quarantined while reading {info['file']} {where}: {info['reason']}\n"
                f"  detail: {info['detail']}\n  (matched by {info['match']})")
    lines = [f"{doc_id}: dropped at stage {info['stage']}, reason {info['reason']} (domain {info['domain']}; {info['file']})"]
    if info["kept_id"]:
        kind = " (near-duplicate)" if info["reason"] == "near_duplicate" else " (exact duplicate)" if info["reason"] == "exact_duplicate" else ""
        lines.append(f"  a copy of {info['kept_id']}{kind}")
        k = info.get("kept_copy")
        if k:
            fate = f"kept, in {k['shard']}" if k["status"] == "kept" else f"itself dropped later at stage {k['stage']}, reason {k['reason']}"
            lines.append(f"  {info['kept_id']}: {fate}")
    c = info.get("cluster")
    if c:
        lines.append(f"  near-duplicate cluster {c['cluster_id']}: {c['size']:,} documents, kept {c['kept']}")
    return "\n".join(lines)
