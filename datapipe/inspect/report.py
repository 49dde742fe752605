"""Terminal tables from `stats.json`: the stage funnel per domain and the drop reasons."""

from __future__ import annotations

from typing import Any

from datapipe.inspect.tables import table


def format_funnel(stats: dict[str, Any]) -> str:
    """The stage funnel (documents and MB in -> out per stage and domain), then drop reasons."""
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
        out.append(table(["stage", "domain", "reason", "docs"], reasons))
    if stats["quarantined"]:
        out.append(table(["quarantined", "", "records"], [[r, "", n] for r, n in stats["quarantined"].items()]))
    minhash = stats.get("global_stages", {}).get("minhash")
    if minhash:
        out.append(
            f"near-duplicates: {minhash['candidate_pairs']:,} candidate pairs, {minhash['clusters']:,} clusters, "
            f"{minhash['removed']:,} documents removed ({minhash['rounds']} connected-components rounds)"
        )
    kept = [[domain, "", k["docs"], k["tokens"]] for domain, k in stats["kept"].items()]
    kept.append(["total", "", sum(k["docs"] for k in stats["kept"].values()), sum(k["tokens"] for k in stats["kept"].values())])
    out.append(table(["written", "", "docs", "tokens"], kept))
    return "\n\n".join(out)
