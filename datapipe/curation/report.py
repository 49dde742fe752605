"""What a run reports: the accounting per input, `stats.json`, and the paragraphs a stopped run ends with.

Accounting balances exactly: per input, records read = kept + dropped + quarantined. When nothing survives, the
run writes `stats.json` (no manifest) and says where the documents went; when a work file is damaged, it names
the file and the command that recovers.
"""

from __future__ import annotations

import time
from typing import Any

from datapipe.core.config import RunStopped
from datapipe.core.shards import atomic_write_json
from datapipe.core.storage import is_url, remove_tree
from datapipe.core.workfiles import DamagedWorkFile
from datapipe.curation.counters import Counters
from datapipe.curation.plan import Plan


def _accounting(plan: Plan, total: Counters) -> list[dict[str, Any]]:
    """Per input: read = kept + dropped + quarantined, exactly."""
    rows = []
    for i, inp in enumerate(plan.cfg.inputs):
        dropped: dict[str, dict[str, int]] = {}
        for (ii, stage, _domain, reason), n in total.dropped.items():
            if ii == i:
                dropped.setdefault(stage, {}).setdefault(reason, 0)
                dropped[stage][reason] += n
        quarantined = {r: n for (ii, r), n in total.quarantined.items() if ii == i}
        kept = sum(v[0] for (ii, _), v in total.kept.items() if ii == i)
        read = total.read.get(i, 0)
        n_dropped = sum(sum(r.values()) for r in dropped.values())
        rows.append(
            {
                "input": inp.path,
                "read": read,
                "kept": kept,
                "dropped": dropped,
                "quarantined": quarantined,
                "balanced": read == kept + n_dropped + sum(quarantined.values()),
            }
        )
    return rows


def build_stats(plan: Plan, total: Counters, seconds: float) -> dict[str, Any]:
    stage_order = ["read"] + [s.name for s in plan.read_stages] + [s.name for seg in plan.segments for s in seg.stages + ([seg.global_stage] if seg.global_stage else [])]
    funnel = []
    for stage in stage_order:
        domains = {d: dict(zip(("docs_in", "docs_out", "bytes_in", "bytes_out"), v)) for (s, d), v in sorted(total.funnel.items()) if s == stage}
        if domains:
            funnel.append({"stage": stage, "domains": domains})
    dropped: dict[str, dict[str, dict[str, int]]] = {}
    for (_i, stage, domain, reason), n in sorted(total.dropped.items()):
        d = dropped.setdefault(stage, {}).setdefault(domain, {})
        d[reason] = d.get(reason, 0) + n
    quarantined: dict[str, int] = {}
    for (_i, reason), n in sorted(total.quarantined.items()):
        quarantined[reason] = quarantined.get(reason, 0) + n
    kept: dict[str, dict[str, int]] = {}
    for (_i, domain), (docs, tokens) in sorted(total.kept.items()):
        k = kept.setdefault(domain, {"docs": 0, "tokens": 0})
        k["docs"] += docs
        k["tokens"] += tokens
    return {
        "funnel": funnel,
        "dropped": dropped,
        "quarantined": quarantined,
        "kept": kept,
        "inputs": _accounting(plan, total),
        "seconds": round(seconds, 3),
        "counters": total.to_json(),
    }


class NothingSurvived(RunStopped):
    """No document is left to write: every record was quarantined or dropped (or there were none).
    The message names the funnel; stats.json is written so that `datapipe stats` can show why. The
    CLI prints it without a traceback and exits 1."""


def nothing_survived(plan: Plan, total: Counters, t0: float, report: dict[str, Any]) -> NothingSurvived:
    """Write stats.json (no manifest: the run has no output) with what the run has `report`ed so far (damaged
    inputs, duplicate ids, ...), and say where the documents went."""
    stats = {**build_stats(plan, total, time.perf_counter() - t0), **report, "nothing_survived": True}
    atomic_write_json(plan.out / "stats.json", stats, durable=True)
    if not plan.cfg.output.keep_work:
        remove_tree(plan.work)
    read = sum(row["read"] for row in stats["inputs"])
    parts = [f"{read:,} records read from {len(plan.cfg.inputs)} input(s)"]
    if stats["quarantined"]:
        reasons = ", ".join(f"{r} {n:,}" for r, n in sorted(stats["quarantined"].items(), key=lambda kv: -kv[1]))
        parts.append(f"{sum(stats['quarantined'].values()):,} quarantined while reading ({reasons})")
    for stage, by_domain in stats["dropped"].items():
        reasons: dict[str, int] = {}
        for by_reason in by_domain.values():
            for reason, n in by_reason.items():
                reasons[reason] = reasons.get(reason, 0) + n
        top = ", ".join(f"{r} {n:,}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:3])
        parts.append(f"{sum(reasons.values()):,} dropped by {stage} ({top})")
    advice = ("the inputs are empty" if read == 0 else
              "check the inputs (format, text_field) and the filters, then run again into a new output folder")
    return NothingSurvived(
        f"no document survived curation: {'; '.join(parts)}; 0 kept. {advice[0].upper() + advice[1:]}. "
        f"stats.json is written: `datapipe stats {plan.out_dir}` shows the funnel and "
        f"`datapipe stats {plan.out_dir} --why ID` where one record went."
    )


def recovery(plan: Plan, exc: DamagedWorkFile) -> str:
    """One paragraph: which file, why the run stopped, the command that recovers."""
    work = plan.work
    remove = f"rm -r {work}" if not is_url(str(work)) else f"delete every object under {work}"
    return (f"{exc}. Work files are written without fsync, so a power loss, a full disk or a hand edit can leave one so, "
            f"and the run stopped rather than read it. To recover, {remove} and run the same command again: the run "
            f"redoes its work from the inputs and writes the same output.")
