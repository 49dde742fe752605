"""The summary `datapipe curate` prints: the stage funnel per domain, the drop reasons and what was written.

Read from `stats.json` and the manifest: the written counts are the manifest's rows, mixture copies included
and shown as such (`distinct_written` says how the distinct documents follow from `stats.json`)."""

from __future__ import annotations

from typing import Any

from datapipe.inspect.tables import table


def _n(count: int, one: str, many: str | None = None) -> str:
    return f"{count:,} {one if count == 1 else many or one + 's'}"


def distinct_written(stats: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Distinct training documents (and their tokens) written per domain, each counted once.

    stats.json's `kept` counts every document that was tokenized and not dropped afterwards, once each:
    the training documents and the held-out eval documents (written to eval/, listed under `eval`). The
    manifest counts rows in the training shards, so a document that the mixture repeats counts once per
    copy there. Training documents = `kept` - eval; mixture copies = manifest rows - training documents.
    With `eval.source` the eval documents are another run's, copied in: never in `kept`."""
    split = stats.get("eval") or {}
    held_out = {} if split.get("source") else split.get("domains", {})
    out = {}
    for domain, k in stats.get("kept", {}).items():
        e = held_out.get(domain, {})
        out[domain] = {"docs": k["docs"] - e.get("docs", 0), "tokens": k["tokens"] - e.get("tokens", 0)}
    return out


def format_funnel(stats: dict[str, Any], manifest: dict[str, Any] | None = None) -> str:
    """The stage funnel (documents and MB in -> out per stage and domain), the drop reasons, then what
    was written. With the run's `manifest`, the written counts are its rows (mixture copies included,
    and shown as such), so they equal the manifest's totals; without it, the distinct documents."""
    rows = []
    for entry in stats["funnel"]:
        for domain, c in entry["domains"].items():
            rows.append(
                [entry["stage"], domain, c["docs_in"], c["docs_out"], c["docs_in"] - c["docs_out"],
                 f"{c['bytes_in'] / 1e6:.2f}", f"{c['bytes_out'] / 1e6:.2f}"]
            )
    out = [table(["stage", "domain", "docs in", "docs out", "dropped", "MB in", "MB out"], rows)]
    reasons = [
        [stage, domain, reason, n]
        for stage, by_domain in stats["dropped"].items()
        for domain, by_reason in by_domain.items()
        for reason, n in sorted(by_reason.items(), key=lambda kv: -kv[1])
    ]
    if reasons:
        out.append(table(["stage", "domain", "reason", "docs"], reasons, left=3))
    if stats["quarantined"]:
        out.append(table(["quarantined", "", "records"], [[r, "", n] for r, n in stats["quarantined"].items()]))
    minhash = stats.get("global_stages", {}).get("minhash")
    if minhash:
        out.append(
            f"near-duplicates: {minhash['candidate_pairs']:,} candidate pairs, {minhash['clusters']:,} clusters, "
            f"{minhash['removed']:,} documents removed ({minhash['rounds']} connected-components rounds)"
        )
    out.append(_format_written(stats, manifest))
    return "\n\n".join(out)


def _format_written(stats: dict[str, Any], manifest: dict[str, Any] | None) -> str:
    distinct = distinct_written(stats)
    rows_of = (manifest or {}).get("domains", distinct)  # without a manifest: each document once
    counts = []
    for domain in sorted(set(distinct) | set(rows_of)):
        d = distinct.get(domain, {"docs": 0, "tokens": 0})
        w = rows_of.get(domain, {"docs": 0, "tokens": 0})
        counts.append([domain, w["docs"], w["tokens"], w["docs"] - d["docs"], w["tokens"] - d["tokens"]])
    counts.append(["total", *[sum(r[i] for r in counts) for i in range(1, 5)]])
    copies, copy_tokens = counts[-1][3], counts[-1][4]
    if copies:
        text = table(["written", "docs", "tokens", "mixture copies", "copy tokens"], counts, left=1)
        text += f"\n(every row written counts, as in the manifest: {_n(counts[-1][1] - copies, 'distinct document')} + {_n(copies, 'mixture copy', 'mixture copies')})"
    else:
        text = table(["written", "docs", "tokens"], [r[:3] for r in counts], left=1)
    held_out = stats.get("eval") or {}
    if held_out.get("domains"):
        docs = sum(c["docs"] for c in held_out["domains"].values())
        tokens = sum(c["tokens"] for c in held_out["domains"].values())
        text += f"\nheld-out eval split ({held_out.get('path', 'eval')}/, not in these totals): {_n(docs, 'document')}, {_n(tokens, 'token')}"
    return text
