"""Segments: the map stages of a block, run back to back up to a global stage, and that stage's decision.

One task per block and segment (`segment_task`) drops the previous global stage's losers, runs the segment's
map stages (language id, filters, a user's stages) and sends the next global stage's keys (the map side of its
exchange, `keys_exchange`). The exchange then brings each partition's keys to one task that asks the stage's
`decide` (`decide_losers`; near dedup's steps: `ResolvingStage.resolve`), and the losers are routed back to the
blocks (`datapipe.curation.losers`); `datapipe.curation.run` drives the segments and decisions in order. So exact and near dedup
are global across every file, worker and node, and a winner is the first document in input order.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.schema import DROPPED_SCHEMA
from datapipe.core.exchange import Shuffle, run_reduces
from datapipe.core.workfiles import write_work_table
from datapipe.core.storage import Location, location
from datapipe.curation.phases import unique_ids
from datapipe.curation.blocks import LOCATOR_COLUMNS, READ, block_documents, write_view
from datapipe.curation.counters import Counters
from datapipe.curation.map_stages import by_kind, run_stages, send_kinds, write_dropped
from datapipe.curation.losers import unit_losers
from datapipe.curation.phase import Phase
from datapipe.curation.plan import Plan, block_name, task_memory, text_bytes
from datapipe.curation.user_stages import UserStageFailed
from stages.base import GlobalStage, ResolvingStage, RunTasks


def _apply_losers(table: pa.Table, losers: pa.Table, stage: str, keep_text: bool) -> tuple[pa.Table, pa.RecordBatch | None]:
    """Drop the rows a global stage decided against (matched by global order)."""
    if losers.num_rows == 0 or table.num_rows == 0:
        return table, None
    lose = pc.is_in(table.column("order"), value_set=losers.column("order"))
    if not pc.any(lose).as_py():
        return table, None
    gone = table.filter(lose)
    kept = table.filter(pc.invert(lose))
    where = pc.index_in(gone.column("order"), value_set=losers.column("order"))
    n = gone.num_rows
    dropped = pa.RecordBatch.from_arrays(
        [
            gone.column("id").combine_chunks(),
            gone.column("domain").combine_chunks(),
            gone.column("order").combine_chunks(),
            pa.array([stage] * n, pa.string()),
            losers.column("reason").take(where).combine_chunks(),
            losers.column("kept_id").take(where).combine_chunks(),
            gone.column("text").combine_chunks() if keep_text else pa.nulls(n, pa.large_string()),
        ],
        schema=DROPPED_SCHEMA,
    )
    return kept, dropped


def _with_locators(documents: pa.Table, locators: pa.Table) -> pa.Table:
    """`documents` with each one's `LOCATOR_COLUMNS`, taken from `locators` (a superset, both by order)."""
    rows = pc.index_in(documents.column("order"), value_set=locators.column("order"))
    for name in LOCATOR_COLUMNS:
        documents = documents.append_column(name, locators.column(name).take(rows))
    return documents


def segment_phase(plan: Plan, seg_index: int, blocks: list[tuple[int, int]]) -> Phase:
    """One task per block through segment `seg_index`."""
    seg = plan.segments[seg_index]
    return Phase(seg.stage, seg.title, segment_task, plan, [(seg_index, u, b) for u, b in blocks], segment_record_at,
                 task_memory(plan, "segment"))


def segment_record_at(plan: Plan, seg_index: int, unit_index: int, block: int) -> Location:
    return plan.work / plan.segments[seg_index].name / f"{block_name(unit_index, block)}.json"


def segment_task(plan: Plan, seg_index: int, unit_index: int, block: int) -> dict[str, Any]:
    """One block through a segment: the previous global stage's losers dropped, the map stages, the next global
    stage's keys sent; the view of what it kept written (`work/<segment>/<block>.arrow`)."""
    seg = plan.segments[seg_index]
    name = block_name(unit_index, block)
    previous = plan.segments[seg_index - 1].global_stage if seg_index > 0 else None
    losers = unit_losers(plan.work / previous.name, unit_index, len(plan.units)) if previous is not None else None
    input_index = plan.units[unit_index].input_index
    located = seg.global_stage is not None and seg.global_stage.locates_text
    table = block_documents(plan.work, READ if seg_index == 0 else plan.segments[seg_index - 1].name, name, locate=located)
    locators = table.select(["order", *LOCATOR_COLUMNS]) if located else None
    table = table.drop(list(LOCATOR_COLUMNS)) if located else table
    if seg_index == 0:  # ids made unique before any stage sees them (datapipe/curation/phases/unique_ids.py)
        table = unique_ids.apply(plan.work, unit_index, table)
    counters = Counters()
    dropped_parts: list[pa.RecordBatch] = []
    keep_text = plan.cfg.output.keep_dropped_text

    if losers is not None:
        prev = plan.segments[seg_index - 1].global_stage.name
        before = table
        table, dropped = _apply_losers(table, losers, prev, keep_text)
        counters.count_stage(prev, before, table)
        if dropped is not None:
            dropped_parts.append(dropped)

    out = run_stages(plan, seg.stages, table, counters, dropped_parts)
    for part in dropped_parts:
        counters.count_dropped(input_index, part)
    write_dropped(plan, seg.name, name, dropped_parts)
    try:
        sent = send_keys(seg.global_stage, out if locators is None else _with_locators(out, locators), plan.work, name)
    except UserStageFailed as failed:
        raise failed.located(plan.units) from None
    write_view(plan.work, seg.name, name, out)  # what it kept, not the text again
    return {"rows": out.num_rows, "bytes": text_bytes(out), "counters": counters.to_json(), "keys_bytes": sent}


def keys_exchange(work: Location, stage: GlobalStage) -> Shuffle:
    """A global stage's exchange: its keys from every block (`work/<name>/keys/<block>.shuffle`) to one `decide`
    task per partition, which leaves `work/<name>/losers-tNNN.arrow` (and its record beside it)."""
    folder = work / stage.name
    return Shuffle(stage.name, str(folder / "keys"), stage.partitions, records=str(folder), receiver_name="losers-t{:03d}",
                   reduce_step="decide")


def send_keys(stage: GlobalStage | ResolvingStage | None, table: pa.Table, work: Location, block: str) -> dict[str, int]:
    """The map half of the segment's global stage over `table` (none: nothing sent): its files' bytes by kind."""
    if stage is None:
        return {}
    if isinstance(stage, ResolvingStage):  # tables by kind, one exchange each
        return send_kinds(stage.keys, by_kind(stage, work / stage.name), table, block)
    return send_kinds(lambda batch: {"keys": stage.keys(batch)}, lambda _: keys_exchange(work, stage), table, block)


def largest_keys(results: list[dict[str, Any]]) -> dict[str, int]:
    """The largest key file of each kind among a segment's block tasks (their `keys_bytes`, as they measured)."""
    largest: dict[str, int] = {}
    for r in results:
        for kind, size in r["keys_bytes"].items():
            largest[kind] = max(largest.get(kind, 0), size)
    return largest


def decide_losers(run_tasks: RunTasks, work: Location, stage: GlobalStage, blocks: list[str], results: list[dict[str, Any]]) -> dict[str, int]:
    """A global stage's decision: its blocks' keys (`results`: the segment tasks', each with its `keys_bytes`)
    routed by their measured sizes, then `decide` on each partition (`decide_task`); stats.json's summary."""
    sent = [{"bytes": largest_keys(results).get("keys", 0)}]
    decided = run_reduces(run_tasks, keys_exchange(work, stage), decide_task, (stage, str(work / stage.name)), blocks, sent)
    return {"removed": sum(d["losers"] for d in decided)}


def decide_task(shared: tuple[GlobalStage, str], partition: int, keys: pa.Table) -> dict[str, int]:
    """`decide` on one partition's keys, its losers written to `losers-tNNN.arrow`; their count."""
    stage, folder = shared
    losers = stage.decide(keys)
    write_work_table(location(folder) / f"losers-t{partition:03d}.arrow", losers)
    return {"losers": losers.num_rows}
