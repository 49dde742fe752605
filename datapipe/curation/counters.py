"""Counters that every task returns and the run adds up into `stats.json`.

Kept as plain dicts keyed by tuples so they pickle cheaply across Ray and serialise to JSON as lists.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from datapipe.core.schema import DROPPED_SCHEMA

class Counters:
    def __init__(self) -> None:
        # (stage, domain) -> [docs_in, docs_out, bytes_in, bytes_out]
        self.funnel: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        # (input index, stage, domain, reason) -> documents
        self.dropped: dict[tuple[int, str, str, str], int] = defaultdict(int)
        # (input index, reason) -> records
        self.quarantined: dict[tuple[int, str], int] = defaultdict(int)
        # input index -> records read (documents + quarantined)
        self.read: dict[int, int] = defaultdict(int)
        # (input index, domain) -> [documents, tokens] written to shards
        self.kept: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])

    def count_stage(self, stage: str, before: pa.RecordBatch, after: pa.RecordBatch) -> None:
        """Documents and text bytes in and out of `stage`, per domain."""
        for which, batch in ((0, before), (1, after)):
            if batch.num_rows == 0:
                continue
            table = pa.table({"domain": batch.column("domain"), "n": pc.binary_length(batch.column("text"))})
            for row in table.group_by("domain").aggregate([("n", "sum"), ("n", "count")]).to_pylist():
                entry = self.funnel[(stage, row["domain"])]
                entry[which] += row["n_count"]
                entry[2 + which] += row["n_sum"]

    def count_dropped(self, input_index: int, dropped: pa.RecordBatch | pa.Table) -> None:
        if dropped.num_rows == 0:
            return
        table = pa.table({"stage": dropped.column("stage"), "domain": dropped.column("domain"), "reason": dropped.column("reason")})
        for row in table.group_by(["stage", "domain", "reason"]).aggregate([("reason", "count")]).to_pylist():
            self.dropped[(input_index, row["stage"], row["domain"], row["reason"])] += row["reason_count"]

    def selection_drops(self, input_index: int, rows: pa.Table, stage: str, reason: str) -> pa.Table:
        """Rows (id, domain, num_tokens) a selection step dropped after tokenizing: their records (DROPPED_SCHEMA), counted
        as drops and taken out of the kept documents and tokens."""
        n = rows.num_rows
        table = pa.table({
            "id": rows.column("id"), "domain": rows.column("domain"), "order": pa.nulls(n, pa.int64()),
            "stage": pa.array([stage] * n, pa.string()), "reason": pa.array([reason] * n, pa.string()),
            "kept_id": pa.nulls(n, pa.string()), "text": pa.nulls(n, pa.large_string()),
        }, schema=DROPPED_SCHEMA)
        for d, k in zip(rows.column("domain").to_pylist(), rows.column("num_tokens").to_pylist()):
            self.kept[(input_index, d)][0] -= 1
            self.kept[(input_index, d)][1] -= k
        self.count_dropped(input_index, table)
        return table

    def merge(self, other: "Counters") -> None:
        for k, v in other.funnel.items():
            self.funnel[k] = [a + b for a, b in zip(self.funnel[k], v)]
        for k, v in other.kept.items():
            self.kept[k] = [a + b for a, b in zip(self.kept[k], v)]
        for name in ("dropped", "quarantined", "read"):
            mine = getattr(self, name)
            for k, v in getattr(other, name).items():
                mine[k] += v

    def to_json(self) -> dict[str, Any]:
        return {
            "funnel": [[*k, *v] for k, v in sorted(self.funnel.items())],
            "dropped": [[*k, v] for k, v in sorted(self.dropped.items())],
            "quarantined": [[*k, v] for k, v in sorted(self.quarantined.items())],
            "read": [[k, v] for k, v in sorted(self.read.items())],
            "kept": [[*k, *v] for k, v in sorted(self.kept.items())],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Counters":
        c = cls()
        for *k, a, b, x, y in data["funnel"]:
            c.funnel[tuple(k)] = [a, b, x, y]
        for *k, v in data["dropped"]:
            c.dropped[tuple(k)] = v
        for *k, v in data["quarantined"]:
            c.quarantined[tuple(k)] = v
        for k, v in data["read"]:
            c.read[k] = v
        for *k, d, t in data["kept"]:
            c.kept[tuple(k)] = [d, t]
        return c
