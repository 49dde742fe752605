"""Terminal tables from `stats.json`: the stage funnel per domain and the drop reasons."""

from __future__ import annotations

from typing import Any


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[f"{c:,}" if isinstance(c, int) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_funnel(stats: dict[str, Any]) -> str:
    """The stage funnel (documents and MB in -> out per stage and domain), then drop reasons."""
    rows = []
    for entry in stats["funnel"]:
        for domain, c in entry["domains"].items():
            rows.append(
                [entry["stage"], domain, c["docs_in"], c["docs_out"], c["docs_in"] - c["docs_out"],
                 f"{c['bytes_in'] / 1e6:.2f}", f"{c['bytes_out'] / 1e6:.2f}"]
            )
    out = [_table(["stage", "domain", "docs in", "docs out", "dropped", "MB in", "MB out"], rows)]
    reasons = [
        [stage, domain, reason, n]
        for stage, by_domain in stats["dropped"].items()
        for domain, by_reason in by_domain.items()
        for reason, n in sorted(by_reason.items(), key=lambda kv: -kv[1])
    ]
    if reasons:
        out.append(_table(["stage", "domain", "reason", "docs"], reasons))
    if stats["quarantined"]:
        out.append(_table(["quarantined", "", "records"], [[r, "", n] for r, n in stats["quarantined"].items()]))
    minhash = stats.get("global_stages", {}).get("minhash")
    if minhash:
        out.append(
            f"near-duplicates: {minhash['candidate_pairs']:,} candidate pairs, {minhash['clusters']:,} clusters, "
            f"{minhash['removed']:,} documents removed ({minhash['rounds']} connected-components rounds)"
        )
    kept = [[domain, "", k["docs"], k["tokens"]] for domain, k in stats["kept"].items()]
    kept.append(["total", "", sum(k["docs"] for k in stats["kept"].values()), sum(k["tokens"] for k in stats["kept"].values())])
    out.append(_table(["written", "", "docs", "tokens"], kept))
    return "\n\n".join(out)
